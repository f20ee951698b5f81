"""Resuming after a crash in the middle of writing a checkpoint.

A run killed while it saves leaves its newest ``checkpoint-N`` incomplete; `exgrpo train` used to pick that folder
and die until it was deleted by hand. Now it resumes from the newest COMPLETE checkpoint and says which ones it
skipped and why. Checked two ways:

- incomplete checkpoints made by hand from a real one, one per way a save can be cut short (fast);
- real `exgrpo train` processes killed with SIGKILL while they write a checkpoint, then resumed: at a moment chosen
  from inside the process (deterministic: the kill lands between two given writes of the save) and at a moment
  chosen from outside (as soon as the checkpoint folder appears).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exgrpo_trl.checkpoints import checkpoint_problems, find_resumable_checkpoint, resolve_checkpoint
from exgrpo_trl.cli.train import parse_args
from exgrpo_trl.state_file import ARRAYS_FILENAME, META_FILENAME, STATE_DIRNAME
from tests.helpers import ROOT, TINY_RECIPE, make_trainer, toy_recipe_args
from tests.resume.crashing import CRASH_AT, ENV

NO_WEIGHTS = "no model weights (model.safetensors, pytorch_model.bin, a sharded index or an adapter)"
ONLY_STATE = f"{NO_WEIGHTS}; no optimizer.pt; no scheduler.pt; no rng_state.pth; no trainer_state.json"


def _args(small_toy_dir: Path, out: Path, max_steps: int) -> list[str]:
    return [
        *toy_recipe_args(small_toy_dir, out),
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "1",
        "--save_total_limit",
        "0",  # keep every checkpoint: the test looks at all of them
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "16",  # 2 questions x 8 rollouts
        "--generation_batch_size",
        "32",  # 2 optimizer steps per generation batch: a checkpoint falls inside one
        "--replay_start_pass_rate",
        "0",  # collect (and save a buffer) from the first step
        "--disable_tqdm",
        "true",
    ]


# PYTHONPATH: the child processes import this tree's exgrpo_trl, whatever is installed


def _crash(tmp_path: Path, point: str, step: int, args: list[str]) -> subprocess.CompletedProcess:
    script = tmp_path / "crash_at.py"
    script.write_text(CRASH_AT)
    cmd = [sys.executable, str(script), point, str(step), *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _train(args: list[str]) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "exgrpo"
    entry = [str(script), "train"] if script.is_file() else [sys.executable, "-m", "exgrpo_trl.cli", "train"]
    return subprocess.run([*entry, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def _skip_line(path: Path, why: str) -> str:
    return f"Skipping {path}: incomplete ({why}), a save that was interrupted?"


def _resume_line(path: Path) -> str:
    return f"Resuming from checkpoint {path} (give another output_dir for a fresh run)"


def _log(run: subprocess.CompletedProcess) -> str:
    return run.stdout + run.stderr


def _steps_trained(out: Path) -> list[int]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [e["step"] for e in state["log_history"] if "loss" in e]


# ---------------------------------------------------------------------------------------------------------------
# Real processes killed while they write a checkpoint
# ---------------------------------------------------------------------------------------------------------------
def test_killed_while_saving_then_resumed(small_toy_dir, tmp_path):
    """Killed while writing the ExGRPO state of checkpoint-2 (only the temporary folder is left), then resumed: the
    resumed run skips checkpoint-2, says why, resumes from checkpoint-1 and finishes."""
    out = tmp_path / "out"
    crashed = _crash(tmp_path, "exgrpo_state", 2, _args(small_toy_dir, out, 3))
    assert crashed.returncode == -signal.SIGKILL, _log(crashed)[-3000:]
    (leftover,) = (out / "checkpoint-2").iterdir()
    assert leftover.name.startswith(f".{STATE_DIRNAME}.tmp-") and not (leftover / META_FILENAME).exists()

    resumed = _train(_args(small_toy_dir, out, 3))
    assert resumed.returncode == 0, _log(resumed)[-3000:]
    why = f"an unfinished ExGRPO state ({leftover.name}) and no {STATE_DIRNAME}/; {ONLY_STATE}"
    assert _skip_line(out / "checkpoint-2", why) in _log(resumed)
    assert _resume_line(out / "checkpoint-1") in _log(resumed)
    assert _steps_trained(out) == [1, 2, 3]
    assert not checkpoint_problems(out / "checkpoint-2") and not checkpoint_problems(out / "checkpoint-3")


@pytest.mark.slow
def test_killed_at_every_point_of_a_save(small_toy_dir, tmp_path):
    """One run killed four times, each time at another point of saving its next checkpoint, and resumed each time
    from the newest complete one; the fifth run finishes. Then a kill from outside, as soon as a checkpoint's ExGRPO
    state is in place, and a resume judged by what is on disk."""
    out = tmp_path / "out"
    crashed = _crash(tmp_path, "model", 1, _args(small_toy_dir, out, 6))  # a first checkpoint with only exgrpo_state/
    assert crashed.returncode == -signal.SIGKILL, _log(crashed)[-3000:]
    assert sorted(p.name for p in (out / "checkpoint-1").iterdir()) == [STATE_DIRNAME]

    expected = [
        # (where the previous run was killed, why it is skipped, where the next run is killed)
        (1, ONLY_STATE, ("exgrpo_state", 2)),
        (2, None, ("optimizer", 3)),  # the leftover name is checked below
        (3, "no optimizer.pt; no scheduler.pt; no rng_state.pth; no trainer_state.json", ("trainer_state", 4)),
        (4, "trainer_state.json is truncated or corrupted (", None),  # then the JSON error
    ]
    for killed_at, why, next_kill in expected:
        args = _args(small_toy_dir, out, 6)
        skipped = out / f"checkpoint-{killed_at}"
        if why is None:  # named before the next run: its first save removes the leftover
            why = f"an unfinished ExGRPO state ({_leftover(skipped).name}) and no {STATE_DIRNAME}/; {ONLY_STATE}"
        run = _crash(tmp_path, *next_kill, args) if next_kill else _train(args)
        log = _log(run)
        assert run.returncode == (-signal.SIGKILL if next_kill else 0), log[-3000:]
        (line,) = [x for x in log.splitlines() if x.startswith("Skipping") or " - Skipping " in x]
        if why.endswith("("):
            assert f"Skipping {skipped}: incomplete ({why}" in line and line.endswith(
                "), a save that was interrupted?"
            )
        else:
            assert _skip_line(skipped, why) in line
        if killed_at == 1:
            assert "No complete checkpoint in" in log and "Resuming from" not in log
        else:
            assert _resume_line(out / f"checkpoint-{killed_at - 1}") in log
    assert _steps_trained(out) == [1, 2, 3, 4, 5, 6]
    assert all(not checkpoint_problems(out / f"checkpoint-{n}") for n in range(1, 7))

    # From outside: kill as soon as checkpoint-8's ExGRPO state is in place (the rest is being written), then resume.
    _kill_when(out / "checkpoint-8" / STATE_DIRNAME, _args(small_toy_dir, out, 9))
    _resume_and_check(small_toy_dir, out, 9)


def test_killed_from_outside_then_resumed(small_toy_dir, tmp_path):
    """A real `exgrpo train` killed from outside as soon as its checkpoint-2 folder appears (measured here: every
    time, the folder was empty or held only the temporary ExGRPO state), then resumed and judged by what is on disk."""
    out = tmp_path / "out"
    _kill_when(out / "checkpoint-2", _args(small_toy_dir, out, 3))
    assert checkpoint_problems(out / "checkpoint-2")  # what a kill there leaves is incomplete, whatever the moment
    _resume_and_check(small_toy_dir, out, 3)


def _kill_when(path: Path, args: list[str]) -> None:
    """Start `exgrpo train ARGS` and SIGKILL it as soon as `path` exists."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "exgrpo_trl.cli", "train", *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _resume_and_check(small_toy_dir: Path, out: Path, max_steps: int) -> None:
    """Resume and finish; trainer_state.json is written last, so the newest checkpoint whose trainer_state.json
    parses is where the run must resume, and every newer one must be skipped with a reason."""
    steps = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    complete = max((n for n in steps if _parses(out / f"checkpoint-{n}" / "trainer_state.json")), default=None)
    resumed = _train(_args(small_toy_dir, out, max_steps))
    assert resumed.returncode == 0, _log(resumed)[-3000:]
    if complete is None:
        assert "Resuming from" not in _log(resumed)
    else:
        assert _resume_line(out / f"checkpoint-{complete}") in _log(resumed)
    for n in steps:
        if complete is None or n > complete:
            assert f"Skipping {out / f'checkpoint-{n}'}: incomplete (" in _log(resumed)
    assert _steps_trained(out) == list(range(1, max_steps + 1))


def _leftover(checkpoint: Path) -> Path:
    (path,) = [p for p in checkpoint.iterdir() if p.name.startswith(f".{STATE_DIRNAME}.tmp-")]
    return path


def _parses(path: Path) -> bool:
    try:
        return isinstance(json.loads(path.read_text()), dict)
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------------------
# Incomplete checkpoints made by hand
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def complete_checkpoint(tmp_path_factory, tokenizer):
    """checkpoint-1 of a real ExGRPO run with something in its buffer."""

    out = tmp_path_factory.mktemp("complete")
    trainer = make_trainer(
        out, tokenizer, max_steps=1, save_strategy="steps", save_steps=1, replay_start_pass_rate=0.0
    )
    trainer.train()
    assert trainer.exgrpo_state.buffer.num_trajectories > 0
    return out / "out" / "checkpoint-1"


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _keep_only(*names):
    def damage(c: Path):
        for p in c.iterdir():
            if p.name not in names:
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    return damage


def _leave_tmp(c: Path):
    """What a kill inside state.save_state leaves: the temporary folder, half written, and nothing else."""
    _keep_only(STATE_DIRNAME)(c)
    (c / STATE_DIRNAME).rename(c / f".{STATE_DIRNAME}.tmp-4242")
    (c / f".{STATE_DIRNAME}.tmp-4242" / META_FILENAME).unlink()


DAMAGES = {
    "no trainer_state.json": (lambda c: (c / "trainer_state.json").unlink(), "no trainer_state.json"),
    "trainer_state.json cut": (
        lambda c: _cut(c / "trainer_state.json"),
        "trainer_state.json is truncated or corrupted (",
    ),
    "no optimizer": (lambda c: (c / "optimizer.pt").unlink(), "no optimizer.pt"),
    "optimizer cut": (lambda c: _cut(c / "optimizer.pt"), "optimizer.pt is truncated or not a torch file"),
    "no scheduler": (lambda c: (c / "scheduler.pt").unlink(), "no scheduler.pt"),
    # transformers would resume without it, but not as the run would have gone on (the RNG states of several
    # processes: tests/resume/test_checkpoint_ranks.py)
    "no rng state": (lambda c: (c / "rng_state.pth").unlink(), "no rng_state.pth"),
    "rng state cut": (lambda c: _cut(c / "rng_state.pth"), "rng_state.pth is truncated or not a torch file"),
    "no model weights": (lambda c: (c / "model.safetensors").unlink(), NO_WEIGHTS),
    "model weights cut": (lambda c: _cut(c / "model.safetensors"), "model.safetensors is truncated or corrupted ("),
    "only exgrpo_state": (_keep_only(STATE_DIRNAME), ONLY_STATE),
    "leftover tmp only": (
        _leave_tmp,
        f"an unfinished ExGRPO state (.{STATE_DIRNAME}.tmp-4242) and no {STATE_DIRNAME}/; {ONLY_STATE}",
    ),
    "state.json cut": (
        lambda c: _cut(c / STATE_DIRNAME / META_FILENAME),
        "unreadable ExGRPO state (ExGRPO state file is truncated or corrupted: ",
    ),
    "buffer file cut": (
        lambda c: _cut(c / STATE_DIRNAME / ARRAYS_FILENAME),
        "unreadable ExGRPO state (ExGRPO buffer file is truncated or corrupted: ",
    ),
    "buffer file missing": (
        lambda c: (c / STATE_DIRNAME / ARRAYS_FILENAME).unlink(),
        "unreadable ExGRPO state (ExGRPO buffer file is missing: ",
    ),
}


def _output_dir(tmp_path: Path, complete_checkpoint: Path, damage) -> Path:
    """checkpoint-1 complete, checkpoint-2 a damaged copy of it."""
    out = tmp_path / "out"
    shutil.copytree(complete_checkpoint, out / "checkpoint-1")
    shutil.copytree(complete_checkpoint, out / "checkpoint-2")
    damage(out / "checkpoint-2")
    return out


@pytest.mark.parametrize("case", list(DAMAGES))
def test_incomplete_checkpoint_is_skipped_saying_why(tmp_path, complete_checkpoint, case, caplog):
    damage, why = DAMAGES[case]
    out = _output_dir(tmp_path, complete_checkpoint, damage)
    checkpoint, skipped = find_resumable_checkpoint(out)
    assert checkpoint == str(out / "checkpoint-1")
    ((path, reason),) = skipped
    assert path == str(out / "checkpoint-2")
    assert reason == why if not why.endswith("(") and not why.endswith(": ") else reason.startswith(why), reason

    _, args, _ = parse_args(["--config", str(TINY_RECIPE), "--output_dir", str(out)])
    with caplog.at_level(logging.WARNING, logger="exgrpo_trl.cli.train"):
        assert resolve_checkpoint(args) == str(out / "checkpoint-1")
    assert [r.getMessage() for r in caplog.records] == [_skip_line(out / "checkpoint-2", reason)]

    # named explicitly, it is refused with the same reason
    _, args, _ = parse_args(["--config", str(TINY_RECIPE), "--resume_from_checkpoint", str(out / "checkpoint-2")])
    with pytest.raises(ValueError) as info:
        resolve_checkpoint(args)
    assert str(info.value) == (
        f"Cannot resume from {out / 'checkpoint-2'}: {reason}. Give a complete checkpoint, or leave "
        "resume_from_checkpoint unset to resume from the newest complete one in output_dir."
    )


@pytest.mark.parametrize(
    "case, damage",
    [
        ("plain GRPO checkpoint", lambda c: shutil.rmtree(c / STATE_DIRNAME)),  # the trainer warns on resume
        ("leftover tmp beside a complete state", lambda c: (c / f".{STATE_DIRNAME}.tmp-4242").mkdir()),
    ],
)
def test_complete_enough_checkpoints_are_taken(tmp_path, complete_checkpoint, case, damage):
    out = _output_dir(tmp_path, complete_checkpoint, damage)
    assert find_resumable_checkpoint(out) == (str(out / "checkpoint-2"), [])


def test_save_only_model_needs_no_optimizer(tmp_path, complete_checkpoint):
    out = _output_dir(tmp_path, complete_checkpoint, DAMAGES["no optimizer"][0])
    assert find_resumable_checkpoint(out, need_optimizer=False) == (str(out / "checkpoint-2"), [])
    _, args, _ = parse_args(["--config", str(TINY_RECIPE), "--output_dir", str(out), "--save_only_model", "true"])
    assert resolve_checkpoint(args) == str(out / "checkpoint-2")


def test_resume_from_checkpoint_values(tmp_path, complete_checkpoint, caplog):
    """Unset: the newest complete checkpoint, or none; true (YAML's true, or 'true' on the command line): the same,
    but none is an error; false: a fresh run even with checkpoints there."""
    out = _output_dir(tmp_path, complete_checkpoint, DAMAGES["no trainer_state.json"][0])
    base = ["--config", str(TINY_RECIPE), "--output_dir", str(out)]
    for value in ("true", "True", "yes", "1"):
        assert resolve_checkpoint(parse_args([*base, "--resume_from_checkpoint", value])[1]) == str(
            out / "checkpoint-1"
        )
    for value in ("false", "False", "no", "0"):
        assert resolve_checkpoint(parse_args([*base, "--resume_from_checkpoint", value])[1]) is None
    args = parse_args(base)[1]
    args.resume_from_checkpoint = True  # what a recipe's `resume_from_checkpoint: true` gives
    assert resolve_checkpoint(args) == str(out / "checkpoint-1")
    args.resume_from_checkpoint = False
    assert resolve_checkpoint(args) is None

    shutil.rmtree(out / "checkpoint-1")  # only the incomplete one left
    assert resolve_checkpoint(parse_args(base)[1]) is None  # unset: a fresh run, said so
    assert f"No complete checkpoint in {out}: training starts from step 0." in caplog.text
    with pytest.raises(ValueError) as info:
        resolve_checkpoint(parse_args([*base, "--resume_from_checkpoint", "true"])[1])
    assert str(info.value) == (
        f"resume_from_checkpoint is true but {out} holds no complete checkpoint (1 incomplete, skipped); leave it "
        "unset to start a fresh run when there is none."
    )
    assert (
        resolve_checkpoint(parse_args(["--config", str(TINY_RECIPE), "--output_dir", str(tmp_path / "new")])[1])
        is None
    )


def test_an_indexed_cpu_device_loads_as_the_cpu(tmp_path):
    """transformers 5.17 (the vLLM environment's) loads a multi-process run's optimizer state onto args.device, on
    CPU ranks an indexed one that torch cannot restore to; the trainer's resume loads it onto the CPU instead."""
    import pytest
    import torch

    from exgrpo_trl.compat import plain_cpu_map_location

    path = tmp_path / "optimizer.pt"
    torch.save({"state": torch.arange(3.0)}, path)
    with pytest.raises(RuntimeError, match="don't know how to restore data location"):
        torch.load(path, map_location=torch.device("cpu", 1), weights_only=True)
    with plain_cpu_map_location():
        loaded = torch.load(path, map_location=torch.device("cpu", 1), weights_only=True)
        assert torch.equal(loaded["state"], torch.arange(3.0))
        assert torch.load(path, map_location="cpu:1", weights_only=True)["state"].tolist() == [0.0, 1.0, 2.0]
    assert torch.load is not None and "plain_cpu" not in getattr(torch.load, "__qualname__", "")  # put back
