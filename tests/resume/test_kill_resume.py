"""Real `exgrpo train` processes killed with SIGKILL at seeded random moments, rerun until they finish.

One run of 48 steps over 3 epochs (64 questions, 4 a step: 16 steps an epoch), a checkpoint every 2 steps (the
generation batch: 2 optimizer steps), `save_total_limit` 2, is killed again and again, each time by one of:

- ``outside``: SIGKILL from this process once the run has saved a new complete checkpoint, after a random delay (so
  it lands in training, in a save or in a rotation, wherever the moment falls), or at the latest once two more
  checkpoints are complete (so that on a fast machine the run does not reach its end before every kind of kill);
- ``outside-save``: SIGKILL as soon as a new checkpoint folder appears (inside a save);
- ``exgrpo_state``: from inside, while the ExGRPO state is half-written into its temporary folder;
- ``rotation``: from inside, halfway through rotation's deletion of an old checkpoint (which is left half-deleted,
  with the freshest folder time), in the second epoch or later;
- ``final``: from inside, in the end-of-run save of the model, after the last checkpoint.

Each time the same command is run again, until it exits 0. The final weights and buffer must equal an
uninterrupted run's bitwise, the run must end at max_steps exactly (a rerun of the finished command trains nothing),
the checkpoints kept must be the uninterrupted run's, and no temporary state folder may remain.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.numpy import load_file

from exgrpo_trl.checkpoints import checkpoint_problems, checkpoint_step
from exgrpo_trl.state_file import ARRAYS_FILENAME, META_FILENAME, STATE_DIRNAME
from tests.helpers import ROOT, toy_recipe_args
from tests.resume.crashing import CRASH_AT, ENV

MAX_STEPS = 48
SECOND_EPOCH = 20  # the rotation kill lands at this step or later: 16 steps an epoch


def _args(toy_dir: Path, out: Path) -> list[str]:
    return [
        *toy_recipe_args(toy_dir, out), "--max_steps", str(MAX_STEPS), "--save_steps", "2", "--save_total_limit", "2",
        "--logging_steps", "1", "--per_device_train_batch_size", "32", "--generation_batch_size", "64",
        "--replay_start_pass_rate", "0", "--disable_tqdm", "true",
    ]  # fmt: skip


def _complete_steps(out: Path) -> list[int]:
    if not out.is_dir():
        return []
    steps = [checkpoint_step(p.name) for p in out.glob("checkpoint-*")]
    return sorted(s for s in steps if s is not None and _complete(out / f"checkpoint-{s}"))


def _complete(checkpoint: Path) -> bool:
    """Whether the running trainer's checkpoint is complete; one it rotates away while it is looked at is not."""
    try:
        return not checkpoint_problems(checkpoint)
    except FileNotFoundError:  # this poller races the training process's rotation
        return False


def _newest(out: Path) -> int:
    return max(_complete_steps(out), default=0)


def _command(point: str | None, step: int, args: list[str], script: Path) -> list[str]:
    if point is None:
        return [sys.executable, "-m", "exgrpo_trl.cli", "train", *args]
    return [sys.executable, str(script), point, str(step), *args]


def _kill_from_outside(args: list[str], out: Path, rng: random.Random, at_folder: bool) -> tuple[int, str]:
    """Run until it makes progress (a new complete checkpoint, or with `at_folder` a new checkpoint folder), then
    SIGKILL it (after a random delay unless `at_folder`, cut short once two more checkpoints are complete). Returns
    (exit code, what the kill landed on)."""
    start = _newest(out)
    proc = subprocess.Popen(_command(None, 0, args, Path()), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    delay = 0.0 if at_folder else rng.uniform(0.0, 1.5)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if at_folder:
                folders = [checkpoint_step(p.name) or 0 for p in out.glob("checkpoint-*")]
                if max(folders, default=0) > start:
                    break
            elif _newest(out) > start:
                break
            time.sleep(0.002)
        first, until = _newest(out), time.monotonic() + delay
        while proc.poll() is None and time.monotonic() < until and _newest(out) < first + 4:
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    return proc.returncode, f"{delay:.2f}s after progress past checkpoint-{start}"


def _arrays_and_meta(checkpoint: Path) -> tuple[dict, bytes]:
    arrays = load_file(str(checkpoint / STATE_DIRNAME / ARRAYS_FILENAME))
    return {k: v.tobytes() for k, v in arrays.items()}, (checkpoint / STATE_DIRNAME / META_FILENAME).read_bytes()


def test_killed_at_random_moments_ends_bitwise(small_toy_dir, tmp_path):
    script = tmp_path / "crash_at.py"
    script.write_text(CRASH_AT)
    reference = tmp_path / "reference"
    run = subprocess.run(_command(None, 0, _args(small_toy_dir, reference), script), cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]

    out = tmp_path / "killed"
    args = _args(small_toy_dir, out)
    rng = random.Random(26)
    # every kind of kill at least once, in a seeded order; in-process kills at a seeded checkpoint ahead of progress
    modes = ["outside", "outside", "outside", "outside-save", "outside-save", "exgrpo_state", "rotation"]
    rng.shuffle(modes)
    modes.append("final")
    log, exit_code = [], None
    for mode in modes:
        progress = _newest(out)
        if mode in ("outside", "outside-save"):
            exit_code, where = _kill_from_outside(args, out, rng, at_folder=mode == "outside-save")
        else:
            step = min(MAX_STEPS - 2, max(6, progress + 2 * rng.randint(1, 3)))
            if mode == "rotation":
                step = max(step, SECOND_EPOCH)
            elif mode == "final":
                step = MAX_STEPS
            crashed = subprocess.run(_command(mode, step, args, script), cwd=ROOT, env=ENV, capture_output=True,
                                     text=True, timeout=600)  # fmt: skip
            exit_code, where = crashed.returncode, f"checkpoint-{step}"
        leftovers = sorted(p.name for p in out.glob(f"checkpoint-*/.{STATE_DIRNAME}.tmp-*"))
        incomplete = sorted(p.name for p in out.glob("checkpoint-*") if checkpoint_problems(p))
        log.append((mode, where, progress, _newest(out), exit_code, incomplete, leftovers))
        if exit_code == 0:
            break
        assert exit_code == -signal.SIGKILL, log[-1]
    restarts = 0
    while exit_code != 0:
        restarts += 1
        assert restarts <= 3, log
        finished = subprocess.run(_command(None, 0, args, script), cwd=ROOT, env=ENV, capture_output=True,
                                  text=True, timeout=600)  # fmt: skip
        exit_code = finished.returncode
        assert exit_code == 0, (finished.stdout + finished.stderr)[-3000:]

    print(f"\n{len(log)} kills, {restarts} final run(s):")
    for mode, where, before, after, code, incomplete, leftovers in log:
        print(f"  {mode:13s} {where:38s} newest complete checkpoint {before:2d} -> {after:2d}, exit {code}, "
              f"incomplete {incomplete or '-'}, temporary state folders {leftovers or '-'}")  # fmt: skip
    killed_at = [entry for entry in log if entry[4] == -signal.SIGKILL]
    assert len(killed_at) >= 6
    assert any(after >= 16 and mode != "final" for mode, _, _, after, *_ in killed_at)  # killed in epoch 2 or later
    assert any(entry[0] == "rotation" and entry[5] for entry in killed_at)  # a half-deleted checkpoint was left
    assert any(entry[6] for entry in killed_at)  # and a temporary state folder

    # The end: max_steps exactly, the same checkpoints kept, nothing temporary, weights and buffer bitwise
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted(p.name for p in reference.glob("checkpoint-*"))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        f"checkpoint-{MAX_STEPS - 2}",
        f"checkpoint-{MAX_STEPS}",
    ]
    assert not list(out.rglob(f".{STATE_DIRNAME}.tmp-*"))
    final_weights, reference_weights = (
        load_file(str(out / "model.safetensors")),
        load_file(str(reference / "model.safetensors")),
    )
    assert final_weights.keys() == reference_weights.keys()
    assert all(final_weights[k].tobytes() == reference_weights[k].tobytes() for k in final_weights)
    for name in (f"checkpoint-{MAX_STEPS - 2}", f"checkpoint-{MAX_STEPS}"):
        assert _arrays_and_meta(out / name) == _arrays_and_meta(reference / name), name

    # A rerun of the finished command trains nothing and says so
    again = subprocess.run(_command(None, 0, args, script), cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"is already complete (step {MAX_STEPS} of max_steps {MAX_STEPS})" in again.stdout
    assert json.loads((out / "trainer_state.json").read_text()) == state
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        f"checkpoint-{MAX_STEPS - 2}",
        f"checkpoint-{MAX_STEPS}",
    ]
