"""Kill one rank of a 2-process `exgrpo train` at random moments, rerun the same command until it finishes, and
compare the end with an uninterrupted run's, bitwise (issue 51).

    python benchmarks/kill_one_rank.py                        # tiny: DDP, 1 kill, 4 steps (the smoke run)
    python benchmarks/kill_one_rank.py --backend ddp --kills 8 --max-steps 40 --save-steps 4 \\
        --json benchmarks/results/kill_one_rank/ddp.json
    python benchmarks/kill_one_rank.py --backend zero3 --kills 8 --max-steps 40 --save-steps 4 \\
        --json benchmarks/results/kill_one_rank/zero3.json     # needs deepspeed

Each launch is the same command, from the repository root:

    accelerate launch --config_file {recipes/accelerate/cpu_ddp.yaml,tests/multiprocess/zero3_cpu.yaml} \\
        --num_processes 2 \\
        -m exgrpo_trl.cli.train --config recipes/tiny_cpu.yaml --model_name_or_path TOY ...

on 2 CPU processes (DDP over gloo, or DeepSpeed ZeRO-3 with DS_ACCELERATOR=cpu), with the CPU recipe on a tiny
untrained toy model written into the output folder, and a reward an untrained model earns (a completion ending within
6 tokens; one-digit sums always, so they retire), so that the buffer fills, questions retire and replay runs from the
start.
First one uninterrupted run (the reference); then the killed run: each launch is watched and one rank's worker gets
SIGKILL at a moment drawn (seeded) among

- ``train``: a random delay (0 to 1 s) after the run saved a new complete checkpoint (in training, or wherever
  the moment falls);
- ``save``: a random delay (0 to 0.02 s; a DDP save takes a few tens of ms here) after a new checkpoint folder
  appears;
- ``rng``: rank 1 as soon as its own RNG state file appears in a new checkpoint folder (while it writes it: a
  checkpoint the main process may finish without it; what issue 51 found).

After each kill the launch is waited for (torchrun stops the other rank): the teardown time is from the SIGKILL to the
launcher's exit, and where the kill landed is read from the output folder (the newest checkpoint folder, complete or
not and why, and the newest complete one). Then the same command again, until it exits 0. The end is compared with
the reference's: the final weights (``model.safetensors``; under ZeRO-3 the fp32 weights DeepSpeed's zero_to_fp32
gathers from the final save), every file of every checkpoint kept, byte for byte (the last one's ExGRPO state holds
the buffer and its state; the RNG states; the optimizer or DeepSpeed's partitions) but ``training_args.bin`` (it
holds the output folder) and ``trainer_state.json`` (its log compared without its timings), and which checkpoints
are kept.

A launch that exits non-zero after the run's end (a rank aborting as its interpreter exits, "terminate called without
an active exception": seen under ZeRO-3 on CPU, about 1 launch in 10, with or without kills) is counted apart
(``aborts_at_exit``); the same command then says the run is complete and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EOS_ID = 1  # the char tokenizer's (exgrpo_trl.tasks.toy)
MODES = ("train", "save", "rng")
TIMINGS = ("step_time",)  # the log fields two equal runs differ in
NOT_COMPARED = ("training_args.bin", "trainer_state.json")  # the output folder's path; timings (compared apart)


def reward(completion_ids, digits, **kwargs):
    """The benchmark's reward (`exgrpo train --reward_funcs kill_one_rank:reward`): 1 for a completion that ends
    within 6 tokens (about half of an untrained model's), and for every one-digit sum (its group is all solved: it
    retires)."""
    return [1.0 if d == 1 or (EOS_ID in ids and len(ids) <= 6) else 0.0 for ids, d in zip(completion_ids, digits)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("ddp", "zero3"), default="ddp")
    p.add_argument("--kills", type=int, default=1, help="SIGKILLs of one rank before the run may finish")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2, help="a multiple of 2 (the generation batch) resumes exactly")
    p.add_argument("--save-total-limit", type=int, default=2)
    p.add_argument("--questions", type=int, default=48, help="training questions (16 a generation batch of 2 steps)")
    p.add_argument("--seed", type=int, default=0, help="draws the kills (modes, ranks, delays)")
    p.add_argument("--output-dir", help="where the runs go (default: a temporary folder, removed at the end)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds; a launch still running is a hang")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ the runs
def write_toy(folder: Path, questions: int) -> Path:
    """The toy model (untrained, 2 layers of 64) and its train.jsonl, as `python -m exgrpo_trl.tasks.toy` writes."""
    from exgrpo_trl.tasks.toy import addition_splits, build_tiny_model_dir

    build_tiny_model_dir(folder, hidden_size=64, num_layers=2, intermediate_size=128)
    train, _ = addition_splits(questions, 8, seed=0)
    train.to_json(str(folder / "train.jsonl"))
    return folder


def command(args, toy: Path, out: Path) -> list[str]:
    # DDP: the shipped CPU config; ZeRO-3: the tests' (DeepSpeed on CPU processes)
    config = ROOT / (
        "recipes/accelerate/cpu_ddp.yaml" if args.backend == "ddp" else "tests/multiprocess/zero3_cpu.yaml"
    )
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
        "-m", "exgrpo_trl.cli.train", "--config", str(ROOT / "recipes" / "tiny_cpu.yaml"),
        "--model_name_or_path", str(toy), "--dataset_name", str(toy / "train.jsonl"), "--output_dir", str(out),
        "--reward_funcs", "kill_one_rank:reward", "--max_steps", str(args.max_steps),
        "--save_steps", str(args.save_steps), "--save_total_limit", str(args.save_total_limit),
        "--per_device_train_batch_size", "32", "--generation_batch_size", "128", "--max_completion_length", "8",
        "--logging_steps", "1", "--disable_tqdm", "true",
    ]  # fmt: skip


def environment() -> dict[str, str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    paths = [str(ROOT), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")]  # the package; this module's reward
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # an enclosing launch's
    return env


def workers(launcher) -> dict[int, object]:
    """The launch's rank workers, by rank: the launcher's descendants started with a RANK (torchrun's workers)."""
    import psutil

    found = {}
    try:
        children = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            rank = child.environ().get("RANK")
            if rank is not None and "exgrpo_trl.cli.train" in " ".join(child.cmdline()):
                found[int(rank)] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def checkpoints(out: Path) -> dict[int, Path]:
    from exgrpo_trl.checkpoints import checkpoint_step

    if not out.is_dir():
        return {}
    return {s: p for p in out.iterdir() if (s := checkpoint_step(p.name)) is not None and p.is_dir()}


def newest_complete(out: Path) -> int:
    from exgrpo_trl.checkpoints import checkpoint_problems

    return max((s for s, p in checkpoints(out).items() if not checkpoint_problems(p)), default=0)


def stop(launcher, procs) -> None:
    """A launch still running: SIGTERM the launcher (torchrun forwards it), then SIGKILL what is left, by PID."""
    import psutil

    for proc in [launcher, *procs]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGTERM if proc is launcher else signal.SIGKILL)
    psutil.wait_procs([launcher, *procs], timeout=30)


def moment(kill: dict, out: Path, start_complete: int, start_folders: set[int]) -> bool:
    """Whether the kill's moment has come (its delay then runs): ``train``, a new complete checkpoint; ``save``, a new
    checkpoint folder; ``rng``, the killed rank's RNG state file in a new checkpoint folder."""
    new = [p for s, p in checkpoints(out).items() if s not in start_folders]
    if kill["mode"] == "train":
        return newest_complete(out) > start_complete
    if kill["mode"] == "save":
        return bool(new)
    return any((p / f"rng_state_{kill['rank']}.pth").exists() for p in new)


def launch(args, cmd, env, out: Path, log: Path, kill: dict | None) -> dict:
    """One launch of the same command; with `kill` (mode, rank, delay), SIGKILL that rank's worker at the moment the
    mode picks. Returns what happened: exit code, seconds, and for a kill where it landed and the teardown time."""
    import psutil

    start_complete, start_folders = newest_complete(out), set(checkpoints(out))
    offset = log.stat().st_size if log.is_file() else 0
    t0 = time.monotonic()
    with open(log, "ab") as f:
        f.write(f"\n===== launch ({'kill ' + json.dumps(kill) if kill else 'no kill'})\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    launcher = psutil.Process(proc.pid)
    seen: dict[int, object] = {}
    result: dict = {"kill": kill}
    # Polling costs CPU the two ranks need (on a 2-core machine): the workers are looked for until both are found,
    # a new complete checkpoint every 50 ms; only the wait for an RNG state file to appear polls fast.
    poll = 0.0002 if kill is not None and kill["mode"] == "rng" else 0.01
    try:
        fired_at = progress_at = None
        deadline, last_slow = t0 + args.launch_timeout, 0.0
        while proc.poll() is None and time.monotonic() < deadline:
            now = time.monotonic()
            slow_turn = now - last_slow >= 0.05
            if slow_turn:
                last_slow = now
                if len(seen) < 2:
                    seen.update(workers(launcher))
            if kill is not None and fired_at is None:
                due = kill["mode"] != "train" or slow_turn
                if progress_at is None and due and moment(kill, out, start_complete, start_folders):
                    progress_at = now
                if progress_at is not None and now >= progress_at + kill["delay"] and kill["rank"] in seen:
                    try:
                        seen[kill["rank"]].send_signal(signal.SIGKILL)
                        fired_at = time.monotonic()
                        result["killed_after_s"] = round(fired_at - t0, 2)
                    except psutil.NoSuchProcess:
                        pass
            time.sleep(poll if fired_at is None else 0.01)
        if proc.poll() is None:  # a hang (or a launch longer than the limit)
            stop(launcher, list(seen.values()))
            result["hung"] = True
        code = proc.wait()
    except BaseException:
        stop(launcher, list(seen.values()))
        raise
    end = time.monotonic()
    result.update(exit_code=code, seconds=round(end - t0, 2))
    with open(log, "rb") as f:
        f.seek(offset)
        said = f.read().decode(errors="replace")
    # a rank that aborted as the interpreter exited, after the run's work was done (gloo's threads; see the notes)
    result["abort_at_exit"] = "terminate called without an active exception" in said
    result["finished"] = "exgrpo train: done at step" in said or "is already complete" in said
    survivors = [p.pid for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    result["workers_left"] = survivors
    if survivors:  # none should be: a worker hung in a collective after its peer died
        stop(launcher, [p for p in seen.values() if p.pid in survivors])
    if kill is not None:
        result["killed"] = fired_at is not None
        if fired_at is not None:
            result["teardown_s"] = round(end - fired_at, 2)
        result.update(landed(out, start_complete, said, args))
    return result


def landed(out: Path, before: int, said: str, args) -> dict:
    """Where a kill landed, read from the output folder and the launch's log: the last step logged, the newest
    checkpoint folder (complete or why not), the newest complete one, any unfinished ExGRPO state, and the phase:
    ``save`` (the newest folder is incomplete or a temporary state folder is left), ``end`` (every checkpoint is
    complete up to max_steps: in the end-of-run saves) or ``training``."""
    from exgrpo_trl.checkpoints import checkpoint_problems

    found = checkpoints(out)
    newest = max(found, default=0)
    problems = checkpoint_problems(found[newest]) if newest else []
    leftovers = sorted(p.parent.name + "/" + p.name for p in out.glob("checkpoint-*/.exgrpo_state.tmp-*"))
    complete = newest_complete(out)
    epochs = re.findall(r"'epoch': '([0-9.]+)'", said)  # the log rows, one a step (logging_steps 1)
    steps_per_epoch = args.questions * 8 // (2 * 32)  # K = 8 rollouts a question, 2 ranks x 32 rows a step
    phase = "save" if problems or leftovers else "end" if complete == args.max_steps else "training"
    return {
        "last_logged_step": round(float(epochs[-1]) * steps_per_epoch) if epochs else None,
        "newest_folder": newest,
        "newest_folder_problems": problems,
        "newest_complete": complete,
        "complete_before": before,
        "state_leftovers": leftovers,
        "phase": phase,
        "in_save": phase == "save",
    }


# ------------------------------------------------------------------------------------------------ comparison
def final_weights(out: Path) -> dict:
    """name -> bytes of the final weights: model.safetensors, or under ZeRO-3 (saved as a DeepSpeed checkpoint) the
    fp32 weights DeepSpeed's zero_to_fp32 gathers from its partitions."""
    if (out / "model.safetensors").is_file():
        from safetensors.numpy import load_file

        return {k: v.tobytes() for k, v in load_file(str(out / "model.safetensors")).items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(out))
    return {k: v.detach().numpy().tobytes() for k, v in state.items()}


def log_rows(path: Path) -> list[dict]:
    history = json.loads(path.read_text())["log_history"]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in history if "train_runtime" not in row]


def checkpoint_differences(mine: Path, theirs: Path) -> list[str]:
    """What differs between two checkpoint folders: files only one holds, files whose bytes differ (all but
    NOT_COMPARED), and the log without its timings ("log_history")."""
    if not mine.is_dir():
        return ["(missing)"]
    files = {str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file()}
    own = {str(p.relative_to(mine)) for p in mine.rglob("*") if p.is_file()}
    differ = sorted(f"only in one: {f}" for f in files ^ own)
    for f in sorted(files & own):
        if Path(f).name not in NOT_COMPARED and (mine / f).read_bytes() != (theirs / f).read_bytes():
            differ.append(f)
    if "trainer_state.json" in files & own and log_rows(mine / "trainer_state.json") != log_rows(
        theirs / "trainer_state.json"
    ):
        differ.append("log_history")
    return differ


def compare(out: Path, reference: Path) -> dict:
    """The killed run's end against the reference's: the final weights, every checkpoint kept (the last one holds
    the buffer and its state in exgrpo_state/), which checkpoints are kept, and the run's completion mark."""
    verdict: dict = {}
    try:
        verdict["final_weights"] = final_weights(out) == final_weights(reference)
    except Exception as e:  # noqa: BLE001 - a missing or unreadable final save is a difference, said as such
        verdict["final_weights"] = f"unreadable: {e}"
    kept = sorted(checkpoints(reference))
    verdict["checkpoints_kept"] = sorted(checkpoints(out)) == kept
    verdict["checkpoint_differences"] = {
        f"checkpoint-{s}": checkpoint_differences(out / f"checkpoint-{s}", reference / f"checkpoint-{s}") for s in kept
    }
    last = reference / f"checkpoint-{max(kept)}" / "exgrpo_state" if kept else None
    verdict["buffer_and_state_bitwise"] = last is not None and all(
        (out / last.relative_to(reference) / f).is_file()
        and (out / last.relative_to(reference) / f).read_bytes() == (last / f).read_bytes()
        for f in ("buffer.safetensors", "state.json")
    )
    verdict["run_marked_complete"] = (out / "exgrpo_run_complete.json").is_file()
    verdict["all_equal"] = (
        verdict["final_weights"] is True
        and verdict["checkpoints_kept"]
        and not any(verdict["checkpoint_differences"].values())
        and verdict["buffer_and_state_bitwise"]
        and verdict["run_marked_complete"]
    )
    return verdict


def draw_kills(args) -> list[dict]:
    """The kills, seeded: the modes in turn (a shuffled cycle), a random rank (rank 1 for rng) and delay each."""
    rng = random.Random(args.seed)
    modes = [MODES[i % len(MODES)] for i in range(args.kills)]
    rng.shuffle(modes)
    if args.kills == 1:
        modes = ["rng"]  # the smoke run: the case issue 51 found
    delays = {"train": (0.0, 1.0), "save": (0.0, 0.02), "rng": (0.0, 0.0)}
    # rng: rank 1, whose file the main process does not wait for (the main process writes trainer_state.json after
    # its own RNG state: killed in it, it leaves no trainer_state.json)
    return [
        {"mode": m, "rank": 1 if m == "rng" else rng.randint(0, 1), "delay": round(rng.uniform(*delays[m]), 3)}
        for m in modes
    ]


def until_it_exits_0(args, cmd, env, out: Path, log: Path) -> list[dict]:
    """The same command, run again until it exits 0 (at most 4 times); what each launch gave."""
    runs = []
    while not runs or runs[-1]["exit_code"] != 0:
        if len(runs) == 4:
            raise SystemExit(f"kill_one_rank: {out.name}: no exit 0 after 4 launches; see {log}")
        runs.append(launch(args, cmd, env, out, log, None))
        r = runs[-1]
        print(f"{out.name} launch: exit {r['exit_code']}, {r['seconds']:.1f} s"
              + (" (a rank aborted at exit after the run's end)" if r["abort_at_exit"] and r["finished"] else ""),
              flush=True)  # fmt: skip
    return runs


def describe(i: int, r: dict) -> str:
    kill = r["kill"]
    head = f"kill {i}: {kill['mode']:5s} rank {kill['rank']} delay {kill['delay']:.2f}s"
    if not r.get("killed"):
        return f"{head}: the run ended first (exit {r['exit_code']}, {r['seconds']:.1f} s)"
    problems = "; ".join(r["newest_folder_problems"]) or "complete"
    return (f"{head}: at {r['killed_after_s']:.1f} s, last logged step {r['last_logged_step']}, in {r['phase']}; "
            f"newest folder checkpoint-{r['newest_folder']} ({problems}); newest complete {r['complete_before']} -> "
            f"{r['newest_complete']}; teardown {r['teardown_s']:.2f} s, exit {r['exit_code']}, workers left "
            f"{len(r['workers_left'])}")  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.save_steps % 2:
        raise SystemExit("kill_one_rank: --save-steps must be even (the generation batch is 2 steps)")
    base = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp(prefix="kill_one_rank-"))
    base.mkdir(parents=True, exist_ok=True)
    env = environment()
    figures: dict = {"backend": args.backend, "max_steps": args.max_steps, "save_steps": args.save_steps,
                     "save_total_limit": args.save_total_limit, "seed": args.seed}  # fmt: skip
    try:
        toy = base / "toy"
        if not (toy / "train.jsonl").is_file():
            write_toy(toy, args.questions)
        reference, out = base / "reference", base / "killed"
        for folder in (reference, out):
            shutil.rmtree(folder, ignore_errors=True)
        for log in ("reference.log", "killed.log"):
            (base / log).unlink(missing_ok=True)
        figures["reference"] = until_it_exits_0(
            args, command(args, toy, reference), env, reference, base / "reference.log"
        )
        cmd = command(args, toy, out)
        kills, runs = draw_kills(args), []
        for i, kill in enumerate(kills, 1):
            result = launch(args, cmd, env, out, base / "killed.log", kill)
            runs.append(result)
            print(describe(i, result), flush=True)
            if result["exit_code"] == 0:
                break
        if runs[-1]["exit_code"] != 0:
            runs += until_it_exits_0(args, cmd, env, out, base / "killed.log")
        verdict = compare(out, reference)
        fired = [r for r in runs if r.get("killed")]
        figures.update(
            launches=len(runs),
            kills=runs,
            kills_fired=len(fired),
            kills_in_save=sum(r["in_save"] for r in fired),
            kills_by_phase={ph: sum(r["phase"] == ph for r in fired) for ph in ("training", "save", "end")},
            teardown_s=[r["teardown_s"] for r in fired],
            hangs=sum(bool(r.get("hung")) for r in runs),
            aborts_at_exit=sum(r["abort_at_exit"] and r["finished"] for r in figures["reference"] + runs),
            workers_left=sum(len(r["workers_left"]) for r in runs),
            comparison=verdict,
        )
        print(f"{len(fired)} kills (by phase: {figures['kills_by_phase']}), teardown "
              f"{min(figures['teardown_s'], default=0):.2f}-{max(figures['teardown_s'], default=0):.2f} s, "
              f"{len(runs)} launches, hangs {figures['hangs']}, workers left {figures['workers_left']}, "
              f"aborts at exit after the run's end {figures['aborts_at_exit']}")  # fmt: skip
        print("comparison with the uninterrupted run: " + ", ".join(f"{k} {v}" for k, v in verdict.items()))
    finally:
        if not args.output_dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if figures["comparison"]["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
