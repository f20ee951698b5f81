"""The package layout (scripts/check_imports.py): no import circles, imports go down the layers, pure modules stay
free of trl / transformers / accelerate, the package never imports the lab. Checked on the real package, and on a
made-up one that breaks each rule."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_imports", ROOT / "scripts" / "check_imports.py")
check_imports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_imports)


def test_the_package_holds_its_layout():
    problems, graph = check_imports.check(ROOT / "exgrpo_trl")
    assert problems == []
    assert "exgrpo_trl.replay" in graph and "exgrpo_trl.cli.train" in graph
    assert graph["exgrpo_trl.replay"] == {"exgrpo_trl.buffer"}  # the plan, rows and collection
    # the draw: every rule, on the buffer and the settings, building the plan
    assert graph["exgrpo_trl.draw"] == {"exgrpo_trl.buffer", "exgrpo_trl.replay", "exgrpo_trl.settings"}
    assert graph["exgrpo_trl.settings"] == set()  # the settings import nothing of the package


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "exgrpo_trl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "exgrpo_trl"


def test_each_broken_rule_is_reported(tmp_path):
    package = write(
        tmp_path,
        {
            "__init__.py": "",
            "buffer.py": "import numpy\n",
            "replay.py": "from .config import f\n",  # pure, but reaches trl through config
            "config.py": "def f():\n    from trl import GRPOTrainer\n",
            "trainer.py": "from .tasks.toy import x\n",  # the algorithm imports an application
            "tasks/__init__.py": "",
            "tasks/toy.py": "from ..eval import report\nx = 1\n",  # tasks imports eval: up a layer
            "eval/__init__.py": "",
            "eval/report.py": "def g():\n    import exgrpo_trl.eval.grading\n",
            "eval/grading.py": "from . import report\n",  # report <-> grading
            "cli/__init__.py": "def main():\n    from lab.study import run_one\n",  # the package imports the lab
        },
    )
    problems, _ = check_imports.check(package)
    assert problems == [
        "import circle: exgrpo_trl.eval.grading <-> exgrpo_trl.eval.report",
        "exgrpo_trl.tasks.toy (tasks) imports exgrpo_trl.eval.report (eval): imports go down the layers",
        "exgrpo_trl.trainer (algorithm) imports exgrpo_trl.tasks.toy (tasks): imports go down the layers",
        "exgrpo_trl.cli imports lab: the package never imports the repository's lab/ folder",
        "exgrpo_trl.replay must not import trl through exgrpo_trl.config",
    ]
    assert check_imports.main([str(package)]) == 1
