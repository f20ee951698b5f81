"""A full disk at each kind of save, on a small filesystem of its own (tmpfs; skipped where it cannot be mounted):
`exgrpo train` says in one line what could not be written, where, how much is free there and which checkpoint the
same command resumes from; exits 1; leaves no temporary state folder; and, once space is freed, the same command
resumes and ends where an uninterrupted run ends. `exgrpo export` likewise.

The run: the CPU recipe on the small toy model, 8 steps, a generation batch every 2 steps (the reward function is
called once per generation batch), a checkpoint every 2 steps. The reward function (tests/support/cli_rewards.py:
filling_reward) fills the filesystem at its call N, leaving a given number of bytes, so that the next save fails:

- ``state``: call 2, nothing left: checkpoint-4's ExGRPO state, the first thing a checkpoint writes (Python's ENOSPC);
- ``checkpoint``: call 2, 64 KB left: enough for the state, not for the model (torch's and safetensors' writers,
  which lose the errno);
- ``final``: 6 steps, a checkpoint every 4: call 3, nothing left: the end-of-run save of the model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from exgrpo_trl.checkpoints import STATE_TMP_PREFIX, find_resumable_checkpoint
from tests.helpers import ROOT, TINY_RECIPE

EXGRPO = str(Path(sys.executable).with_name("exgrpo"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MB tmpfs mounted at tmp_path/disk for the test (unmounted after)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here (needs root): {mount.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def train(toy: Path, out: Path, max_steps: int, save_steps: int, fill: dict | None = None):
    command = [EXGRPO, "train", "--config", str(TINY_RECIPE), "--model_name_or_path", str(toy),
               "--dataset_name", str(toy / "train.jsonl"), "--output_dir", str(out), "--max_steps", str(max_steps),
               "--save_steps", str(save_steps), "--save_total_limit", "10", "--logging_steps", "1",
               "--reward_funcs", "tests.support.cli_rewards:filling_reward"]  # fmt: skip
    env = {**ENV, **{f"EXGRPO_TEST_FILL_{k.upper()}": str(v) for k, v in (fill or {}).items()}}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


CASES = {
    "state": dict(max_steps=8, save_steps=2, fill=dict(at=2, leave=0), resumes_from="checkpoint-2"),
    "checkpoint": dict(max_steps=8, save_steps=2, fill=dict(at=2, leave=64_000), resumes_from="checkpoint-2"),
    "final": dict(max_steps=6, save_steps=4, fill=dict(at=3, leave=0), resumes_from="checkpoint-4"),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_a_full_disk_at_a_save_is_one_line_and_the_same_command_resumes(tmp_path, small_disk, small_toy_dir, kind):
    case = CASES[kind]
    reference = train(small_toy_dir, tmp_path / "reference", case["max_steps"], case["save_steps"])
    assert reference.returncode == 0, reference.stderr[-2000:]
    out = small_disk / "out"
    run = train(small_toy_dir, out, case["max_steps"], case["save_steps"], {**case["fill"], "dir": small_disk})
    assert run.returncode == 1, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("exgrpo train: error:")]
    resume = out / case["resumes_from"]
    assert line.startswith(f"exgrpo train: error: could not write into {out}: no space left on the disk ({small_disk}")
    assert line.endswith(
        f"free there); free some space, then run the same command again to resume from the newest complete "
        f"checkpoint, {resume} (--debug shows the traceback)"
    ), line
    assert "Traceback" not in run.stderr
    assert not list(out.glob(f"*/{STATE_TMP_PREFIX}*"))  # no temporary state folder left behind
    assert find_resumable_checkpoint(str(out))[0] == str(resume)
    (small_disk / "filler").unlink()  # space freed
    rerun = train(small_toy_dir, out, case["max_steps"], case["save_steps"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"Resuming from checkpoint {resume}" in rerun.stdout + rerun.stderr
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()


def test_a_full_disk_during_export_is_one_line(tmp_path, small_disk, small_toy_dir):
    run = train(small_toy_dir, tmp_path / "run", 2, 2)
    assert run.returncode == 0, run.stderr[-2000:]
    with open(small_disk / "filler", "wb") as f:  # fill the disk
        while True:
            try:
                f.write(b"\0" * 65536)
                f.flush()
            except OSError:
                break
    export = subprocess.run([EXGRPO, "export", str(tmp_path / "run" / "checkpoint-2"), "--out", str(small_disk / "x")],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert export.returncode == 1
    (line,) = [x for x in export.stderr.splitlines() if x.startswith("exgrpo export:")]
    assert "Traceback" not in export.stderr
    assert line.startswith(
        f"exgrpo export: could not write the export to {small_disk / 'x'}: no space left on the disk"
    )
    assert line.endswith("free some space, then run the same command again"), line


def test_what_counts_as_a_full_disk(tmp_path):
    """By the errno anywhere in the chain, by safetensors' words, or a write error on a filesystem with under 1 MB
    free; a Ctrl-C or any other error on a roomy disk is not one."""
    import errno

    from exgrpo_trl.cli.diskfull import disk_problem
    from exgrpo_trl.cli.interrupt import Interrupted

    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "f"))
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert disk_problem(outer, tmp_path).startswith(f"the disk quota is used up ({tmp_path / 'f'}, ")
    assert disk_problem(OSError(errno.EROFS, "Read-only file system"), tmp_path) == (
        f"the filesystem is read-only ({tmp_path})"
    )
    assert disk_problem(Exception("I/O error: No space left on device (os error 28)"), tmp_path).startswith(
        "no space left on the disk ("
    )
    assert disk_problem(RuntimeError("unexpected pos 3703616 vs 3703508"), tmp_path) is None  # a roomy disk
    assert disk_problem(Interrupted(3, 8, str(tmp_path)), tmp_path) is None
