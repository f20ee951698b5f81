"""The documented CPU path runs as written: the whole local path of recipes/tiny_cpu.yaml in
docs/cpu.md (build, train, inspect), and the study's tables in docs/study.md are the committed results'. The quick
starts are run by tests/project/test_docs.py."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_PAGE = (ROOT / "docs" / "cpu.md").read_text()
STUDY_PAGE = (ROOT / "docs" / "study.md").read_text()
# PYTHONPATH: the child processes import this tree's exgrpo_trl, whatever is installed
ENV = {
    **os.environ,
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
}


def cpu_path_commands() -> list[str]:
    """The indented commands of "The whole path on a CPU", without their comments, the environment line left out."""
    section = CPU_PAGE[CPU_PAGE.index("## The whole path on a CPU") :]
    block = section[section.index("\n    ") : section.index("\n\n", section.index("\n    "))]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands[0].startswith("make install")
    return commands[1:]


def _copy_recipe(tmp_path: Path) -> None:
    (tmp_path / "recipes").mkdir()
    shutil.copy(ROOT / "recipes" / "tiny_cpu.yaml", tmp_path / "recipes")


def test_cpu_path_commands_work(tmp_path, monkeypatch, capsys):
    """The page's commands, run in a folder holding only the recipe (a fresh clone's layout), each through its own
    entry point, with a 3-step warm start and 2 training steps (replay on from the first) instead of the real run."""
    from exgrpo_trl import cli
    from exgrpo_trl.tasks import toy

    build, train, inspect = cpu_path_commands()
    assert build == "python -m exgrpo_trl.tasks.toy --out outputs/tiny-toy --num-heads 4 --warm-start-steps 2000"
    assert train == "exgrpo train --config recipes/tiny_cpu.yaml"
    assert inspect == "exgrpo inspect outputs/exgrpo-tiny-cpu/checkpoint-300"
    _copy_recipe(tmp_path)
    monkeypatch.chdir(tmp_path)

    assert toy.main([*shlex.split(build)[3:-1], "3", "--no-progress"]) == 0
    fast = ["--max_steps", "2", "--save_steps", "2", "--disable_tqdm", "true"]  # the recipe replays from the start
    assert cli.main([*shlex.split(train)[1:], *fast]) == 0
    out = capsys.readouterr().out
    output_dir = tmp_path / "outputs" / "exgrpo-tiny-cpu"
    assert f"  model and tokenizer: {output_dir}\n" in out  # the end-of-run summary
    assert cli.main([*shlex.split(inspect.replace("checkpoint-300", "checkpoint-2"))[1:]]) == 0
    report = capsys.readouterr().out
    assert re.search(r"^replay\s+on; 1 generation batches so far$", report, re.M), report


def test_the_cpu_page_and_the_readme_install_alike():
    """docs/cpu.md started from `make install` while the README installs into the user's own environment: the page
    now offers both, with the README's own package line, and the README's torch line for a CPU is the installation
    page's (the same short time-outs as make install's script; test_docs checks those against the script)."""
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quick start (GPU)")]
    (torch_line,) = [line.strip() for line in install.splitlines() if "download.pytorch.org" in line]
    assert f"`{torch_line}`" in (ROOT / "docs" / "installation.md").read_text()
    assert 'pip install ".[demo]"' in install
    section = CPU_PAGE[CPU_PAGE.index("## The whole path on a CPU") : CPU_PAGE.index("## Images on a CPU")]
    assert 'pip install ".[demo]"' in section and "your own" in section and "make install" in section


def test_cpu_path_without_the_build_fails_at_once(tmp_path, monkeypatch, capsys):
    """Without the first command, training used to retry the Hub for `outputs/tiny-toy` for a minute; then it said so
    once torch was imported (9 s at load 5); now before (exit 2, a usage error: cli/precheck.py)."""
    from exgrpo_trl import cli

    _, train, _ = cpu_path_commands()
    _copy_recipe(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(shlex.split(train)[1:]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "exgrpo train: error: model_name_or_path ./outputs/tiny-toy is a local path that does not exist "
        f"({tmp_path / 'outputs' / 'tiny-toy'}); create it first (a recipe's header says how), or give a Hub id "
        "(org/name)."
    )


@pytest.mark.slow
def test_cpu_path_for_real(tmp_path):
    """The page's commands verbatim, in a folder holding only the recipe: about 20 minutes here (the warm start).
    The trained checkpoint's buffer is not empty and replay is on."""
    _copy_recipe(tmp_path)
    exgrpo = Path(sys.executable).parent / "exgrpo"
    outputs = []
    for command in cpu_path_commands():
        words = shlex.split(command)
        words = [sys.executable, *words[1:]] if words[0] == "python" else [str(exgrpo), *words[1:]]
        run = subprocess.run(words, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=3600)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        outputs.append(run.stdout)
    report = outputs[-1]
    assert re.search(r"^replay\s+on; 150 generation batches so far$", report, re.M), report
    assert int(re.search(r"^questions\s+([\d,]+)$", report, re.M).group(1).replace(",", "")) > 0, report


STUDY = ROOT / "benchmarks" / "results" / "study"


def test_study_tables_match_the_committed_results():
    """The study page's figures are the committed results.json's, not typed by hand: the addition table is
    results.md's, row for row, and every row of the Countdown table is rebuilt here from results.json."""
    from lab.study import band, fmt

    results = json.loads((STUDY / "results.json").read_text())
    report = (STUDY / "results.md").read_text()
    addition = report[report.index("### addition") : report.index("### countdown")]
    rows = [line for line in addition.splitlines() if line.startswith("| ") and not line.startswith("| arm")]
    assert len(rows) == 8
    for row in rows:
        assert row in STUDY_PAGE, row
    section = STUDY_PAGE[STUDY_PAGE.index("## Countdown (where") : STUDY_PAGE.index("## The demo")]
    for arm in results["countdown-weak"]["arms"]:
        cells = []
        for task in ("countdown-weak", "countdown-medium"):
            entry = results[task]["arms"][arm]
            cells.append(f"{len(entry['seeds'])}: {band(entry['final'])}")
            cells += [fmt(entry["by_difficulty"][d]) for d in ("2", "3", "4")]
        assert f"| {arm} | " + " | ".join(cells) + " |" in section, arm
    # the answer paragraph: GRPO and ExGRPO on each task, 5 seeds each
    answer = STUDY_PAGE[STUDY_PAGE.index("**The answer, measured") :]
    answer = answer[: answer.index("\n\n")].replace("\n", " ")
    for task in ("addition", "countdown-medium", "countdown-weak"):
        for arm in ("grpo", "exgrpo"):
            assert len(results[task]["arms"][arm]["seeds"]) == 5
            assert band(results[task]["arms"][arm]["final"]) in answer, (task, arm)


def _table_rows(report: str, heading: str) -> list[str]:
    """The rows (not the header) of the first table after `heading` in results.md."""
    section = report[report.index(heading) :]
    table = section[section.index("\n| ") + 1 :].split("\n\n")[0]
    return [line for line in table.splitlines()[2:] if line.startswith("| ")]


def test_sweep_tables_are_the_committed_results():
    """The study page's sweep, difficulty, regime and paper-point tables are results.md's (written by `python -m
    lab.study` from the saved runs), row for row, and the README's user table is the registered study's analysis.md's;
    the sweep table has every point of sweep.json."""
    from lab.study import PAPER_POINT

    report = (STUDY / "results.md").read_text()
    sweep = json.loads((STUDY / "sweep.json").read_text())
    sweep_rows = _table_rows(report, "### Step-size sweep")
    assert len(sweep_rows) == len(sweep["points"]) + len(sweep["earlier_settings"]) >= 4
    for row in sweep_rows:
        assert row in STUDY_PAGE, row
    assert f"seeds varies by {sweep['estimate_noise']['std']:.4f} (standard deviation pooled" in STUDY_PAGE
    for heading in ("### Regimes", f"### {PAPER_POINT}:", "### Difficulty at the paper's step"):
        rows = _table_rows(report, heading)
        assert rows
        for row in rows:
            assert row in STUDY_PAGE, (heading, row)
    # the README's table for a user is the registered study's (benchmarks/results/confirm/analysis.md, written by
    # `python -m lab.study --confirm --report-only` once all 60 runs were in), row for row: one row a setting in plain
    # words, GRPO's final, and ExGRPO's and the reuse limit's differences on both axes with their Holm verdicts
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("<!-- study:user -->") : readme.index("<!-- /study:user -->")]
    analysis = (ROOT / "benchmarks" / "results" / "confirm" / "analysis.md").read_text()
    assert "Runs in: 60 of 60." in analysis
    registered = _table_rows(analysis, "## For a user:")
    readme_rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # not the header
    assert readme_rows == registered and len(registered) == 4
    assert all(row.count("(5 seeds)") == 2 for row in registered)
    # and the recipe's row (benchmarks/results/policies/analysis.md, the comparison of replay rules, written once its
    # 30 primary runs were in): a column a setting, both axes with their Holm verdicts
    policies = ROOT / "benchmarks" / "results" / "policies"
    row = readme[readme.index("<!-- study:policies-readme -->") : readme.index("<!-- /study:policies-readme -->")]
    row = row.split("\n", 1)[1].strip("\n")
    assert "primary" in json.loads((policies / "analysis.json").read_text())["complete_families"]
    written = (policies / "analysis.md").read_text().split("## For the README: one row\n\n")[1].split("\n\n")[0]
    assert row == written and row.count("(5 seeds)") == 1 and row.count("], ") == 6
    check = subprocess.run([sys.executable, "scripts/study_tables.py", "--check"], cwd=ROOT, capture_output=True,
                           text=True)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert f'PAPER_POINT = "{PAPER_POINT}"' in (ROOT / "scripts" / "study_tables.py").read_text()
