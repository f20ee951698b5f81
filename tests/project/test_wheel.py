"""The package as a user installs it: a wheel built from this tree, installed with its declared dependencies
into a fresh virtual environment (torch first, alone, as docs/installation.md says), then what a new user runs
first: `exgrpo --version`, `exgrpo train --help`, the math reward on a correct answer (it scored 0.0 in such an
environment, math-verify being only an extra); that the wheel holds the package and nothing of the lab; and the
lab's demo (`python -m lab.demo --quick`, from a copy of lab/ beside the installed wheel) without the `demo` extra
(one line naming it, at once) and with it (the whole smoke run, report included): the lab needs nothing of the
package that the wheel does not ship.

About 1.5-3 minutes here: installing torch and the dependencies dominates (the index and pip's cache serve them;
`--no-compile` skips byte-compiling torch's files). TORCH_SPEC and TORCH_INDEX choose torch as in the Makefile."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
TORCH_INDEX = os.environ.get("TORCH_INDEX", "")


def _run(*args: str, env=None, timeout=900, check=True) -> subprocess.CompletedProcess:
    run = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert run.returncode == 0, " ".join(args) + "\n" + (run.stdout + run.stderr)[-4000:]
    return run


@pytest.fixture(scope="module")
def fresh_env(tmp_path_factory):
    """A fresh virtual environment holding torch, then the wheel with its declared dependencies and nothing else."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # built from a copy: the build leaves nothing in the working tree
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    shutil.copytree(ROOT / "exgrpo_trl", source / "exgrpo_trl", ignore=shutil.ignore_patterns("__pycache__"))
    started = time.perf_counter()
    _run(sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(work))
    (wheel,) = work.glob("exgrpo_trl-*.whl")
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", str(work / "venv"))
    pip = [str(work / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run(*pip, TORCH_SPEC, *(["--index-url", TORCH_INDEX] if TORCH_INDEX else []))
    _run(*pip, str(wheel))
    installed = time.perf_counter() - started
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONNOUSERSITE="1")
    print(f"\nwheel {wheel.name} built and installed with its dependencies in {installed:.0f}s")
    return work, wheel, env


def test_the_installed_package_is_the_wheel(fresh_env):
    work, wheel, env = fresh_env
    python = str(work / "venv" / "bin" / "python")
    where = subprocess.run(
        [python, "-c", "import exgrpo_trl; print(exgrpo_trl.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
    )
    assert str(work / "venv") in where.stdout, where.stdout + where.stderr
    assert _run(python, "-m", "pip", "check", env=env).returncode == 0


def test_cli_version_and_help(fresh_env):
    work, _, env = fresh_env
    exgrpo = str(work / "venv" / "bin" / "exgrpo")
    assert _run(exgrpo, "--version", env=env).stdout == "exgrpo-trl 0.1.0\n"
    started = time.perf_counter()
    help_ = _run(exgrpo, "train", "--help", env=env).stdout
    seconds = time.perf_counter() - started
    assert help_.startswith("usage: exgrpo train --config RECIPE.yaml") and "--replay_ratio" in help_
    assert seconds < 3, f"exgrpo train --help took {seconds:.1f}s"
    print(f"exgrpo train --help in the fresh environment: {seconds:.2f}s")


def test_math_reward_scores_a_correct_answer(fresh_env):
    work, _, env = fresh_env
    code = (
        "from exgrpo_trl.tasks.rewards import math_reward\n"
        "print(math_reward(['<think>ok</think> The answer is \\\\boxed{42}'], answer=['42']))"
    )
    assert _run(str(work / "venv" / "bin" / "python"), "-c", code, env=env).stdout == "[1.0]\n"


def test_the_image_kit_runs_from_the_wheel(fresh_env):
    """The CPU try-out with images (the trainer page's quick start) needs nothing outside the wheel: the tiny
    Qwen2-VL and its processor are built, a question's image becomes its image tokens, the colour reward scores."""
    work, _, env = fresh_env
    code = (
        "from exgrpo_trl.tasks.vision import build_tiny_vlm, colour_dataset, colour_reward\n"
        "model, processor = build_tiny_vlm()\n"
        "row = colour_dataset(4, shades=40)[0]\n"
        "text = processor.apply_chat_template(row['prompt'], add_generation_prompt=True)\n"
        "batch = processor(text=[text], images=[row['image']], return_tensors='pt')\n"
        "print(type(model).__name__, tuple(batch['image_grid_thw'][0].tolist()), "
        "colour_reward([f\"It is {row['answer']}.\"], answer=[row['answer']]))"
    )
    run = subprocess.run(
        [str(work / "venv" / "bin" / "python"), "-c", code], capture_output=True, text=True, env=env, cwd=work
    )  # from `work`, so that the repository's folder is not on the path: the wheel's package is imported
    assert run.stdout == "Qwen2VLForConditionalGeneration (1, 2, 2) [1.0]\n", run.stdout + run.stderr[-3000:]


def test_the_wheel_holds_the_package_and_not_the_lab(fresh_env):
    import zipfile

    _, wheel, _ = fresh_env
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"exgrpo_trl", wheel.name.split("-")[0] + "-0.1.0.dist-info"}, top
    assert "exgrpo_trl/tasks/toy.py" in names  # the CPU kit users try ExGRPO with
    assert "exgrpo_trl/tasks/vision.py" in names  # and its image counterpart
    assert not [n for n in names if any(part in n for part in ("countdown", "study", "demo", "regimes"))], names


def test_lab_demo_against_the_wheel_without_then_with_its_extra(fresh_env):
    work, wheel, env = fresh_env
    lab_home = work / "lab-home"  # lab/ alone, so that `exgrpo_trl` is the installed wheel's
    shutil.copytree(ROOT / "lab", lab_home / "lab", ignore=shutil.ignore_patterns("__pycache__"))
    out, cache = str(work / "demo"), str(work / "cache")
    demo = [str(work / "venv" / "bin" / "python"), "-m", "lab.demo", "--quick", "--no-progress", "--out", out]
    demo += ["--cache-dir", cache]
    started = time.perf_counter()
    without = subprocess.run(demo, capture_output=True, text=True, env=env, cwd=lab_home, timeout=300)
    assert without.returncode == 1 and time.perf_counter() - started < 30, without.stderr[-3000:]
    assert without.stderr.splitlines() == [
        "demo: error: make demo needs matplotlib, which is not installed: pip install 'matplotlib' "
        "(or, in the repository's folder, pip install '.[demo]')"
    ]
    assert not (work / "demo").exists()  # nothing was trained

    pip = [str(work / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]
    _run(*pip, f"{wheel}[demo]")
    with_extra = subprocess.run(demo, capture_output=True, text=True, env=env, cwd=lab_home, timeout=900)
    assert with_extra.returncode == 0, with_extra.stderr[-3000:]
    assert "This seed (0): ExGRPO ends" in with_extra.stdout
    assert (work / "demo" / "results.json").is_file() and (work / "demo" / "figure.png").is_file()
    print(with_extra.stdout[-1500:])
