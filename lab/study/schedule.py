"""Running the study's runs: each in a child process with one thread, `--jobs` at a time, with progress bars; a run
whose JSON exists is skipped, so an interrupted study resumes where it stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ..warm_start import warm_start_source
from .provenance import LAB_ROOT
from .run import progress_path
from .tasks import Task


def run_path(results: Path, task: str, arm: str, seed: int) -> Path:
    return results / task / arm / f"seed{seed}.json"


def _parse_seeds(text: str) -> list[int]:
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return seeds


def _child_command(args, task: str, arm: str, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "lab.study", "--run-one", task, arm, str(seed)]
    # absolute: the child runs from the lab's folder, not the caller's
    cmd += ["--results", str(Path(args.results).resolve()), "--cache-dir", str(Path(args.cache_dir).resolve())]
    cmd += [part for item in args.set for part in ("--set", item)]
    registered = getattr(args, "confirm", False) or getattr(args, "policies", False)
    cmd += ["--confirm"] if registered else []  # a registered run: trained only from a committed tree
    if warm_start_source() != "shipped":  # rebuilt (or taken from) the cache by this process: the children read it
        cmd += ["--warm-start-source", "cache"]
    return cmd + (["--quick"] if args.quick else [])


def _step(cache_dir, key: tuple[str, str, int]) -> tuple[int, int] | None:
    try:
        step, total = progress_path(cache_dir, *key).read_text().split()
        return int(step), int(total)
    except (OSError, ValueError):
        return None


def run_missing(
    args, tasks: dict[str, Task], todo: list[tuple[str, str, int]], step_bars: dict[tuple, str] | None = None
) -> list[str]:
    """Train the runs in `todo`, `args.jobs` at a time in child processes; returns the failures.

    Progress: one bar over runs, its postfix the step each running run is at; or, with `step_bars` (run -> label),
    one bar of steps per run instead."""
    import torch
    from tqdm.auto import tqdm

    from exgrpo_trl.utils.threads import default_cpu_threads

    torch.set_num_threads(default_cpu_threads())  # the warm starts below; a busy machine slows 2 threads 5-17 times
    for task in sorted({t for t, _, _ in todo}):  # build each warm start and data split once, before the children
        tasks[task].load(str(args.cache_dir), tasks[task].warm_start_steps, not args.no_progress)
        tasks[task].splits(tasks[task].train_questions, tasks[task].eval_questions, str(args.cache_dir))
    logs = Path(args.cache_dir) / "study-logs"
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, failures = list(todo), {}, []
    bar = tqdm(
        total=len(todo), desc="study runs", unit="run", disable=args.no_progress or bool(step_bars), dynamic_ncols=True
    )
    bars = {
        key: tqdm(total=tasks[key[0]].steps, desc=label, unit="step", position=i, disable=args.no_progress,
                  dynamic_ncols=True)
        for i, (key, label) in enumerate((step_bars or {}).items())
    }  # fmt: skip
    while pending or running:
        while pending and len(running) < args.jobs:
            key = pending.pop(0)
            progress_path(args.cache_dir, *key).unlink(missing_ok=True)
            log = open(logs / f"{key[0]}-{key[1]}-seed{key[2]}.log", "w")  # noqa: SIM115 (closed when it ends)
            child = subprocess.Popen(_child_command(args, *key), stdout=log, stderr=subprocess.STDOUT, cwd=LAB_ROOT)
            running[key] = (child, log)
        time.sleep(1.0)
        for key, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[key]
            bar.update(1)
            name = f"{key[0]}/{key[1]}/seed{key[2]}"
            if proc.returncode != 0:
                failures.append(f"{name} failed (exit {proc.returncode}); log: {log.name}")
                bar.write(failures[-1])
            else:
                if key in bars:
                    bars[key].update(bars[key].total - bars[key].n)
                record = json.loads(run_path(args.results, *key).read_text())
                bar.write(f"{name}: held-out pass@1 {record['final']['pass_at_1']:.3f} ({record['seconds']:.0f}s)")
        steps = {key: _step(args.cache_dir, key) for key in running}
        for key, step_bar in bars.items():
            if steps.get(key):
                step_bar.update(steps[key][0] - step_bar.n)
        bar.set_postfix(
            running=", ".join(
                f"{t}/{a}/s{s}" + (f" {steps[(t, a, s)][0]}/{steps[(t, a, s)][1]}" if steps[(t, a, s)] else "")
                for t, a, s in running
            ),
            refresh=False,
        )
    for step_bar in bars.values():
        step_bar.close()
    bar.close()
    return failures
