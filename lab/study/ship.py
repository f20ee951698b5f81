"""`python -m lab.study.ship TASK [TASK ...]`: put the warm starts of these settings into the repository
(`lab.warm_start.SHIPPED`), for the maintainers: every warm start a registered run trains from ships, so that a run
rebuilt on another machine starts from the same weights.

Each task's warm start is taken from `--cache-dir` (trained there when missing: `--rebuild` trains it afresh), its
weights' sha256 compared with what the runs under `--runs` recorded for that task (a difference stops the command:
those are not the weights the runs trained from), its held-out pass@1 measured (the task's evaluation, its held-out set
and samples, sampling seed 0), and the entry copied into the shipped folder with ``warm_start.json`` completed: the
weights' sha256 (checked on every load), the held-out pass@1, the machine that built it and the runs that match it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from ..warm_start import SHIPPED, warm_start_source, weights_sha256
from .tasks import DEFAULT_CACHE, TASKS


def recorded_sha256(runs: Path, task: str) -> dict[str, list[str]]:
    """warm-start sha256 -> the runs under `runs` of `task` that recorded it."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(runs).glob(f"{task}/*/seed*.json")):
        made = (json.loads(path.read_text()).get("provenance") or {}).get("warm_start_sha256")
        if made:
            out.setdefault(made, []).append(str(path.relative_to(runs)))
    return out


def ship(task_name: str, cache_dir: str, runs: Path, dest: Path = SHIPPED) -> dict:
    """Ship one task's warm start (module docstring); returns its completed warm_start.json."""
    task = TASKS[task_name]
    model, tokenizer = task.load(cache_dir, task.warm_start_steps, True)
    entry = Path(model.warm_start_path)
    made = weights_sha256(model)
    recorded = recorded_sha256(runs, task_name)
    if recorded and made not in recorded:
        shown = ", ".join(f"{sha[:12]}... ({len(r)} runs)" for sha, r in recorded.items())
        raise SystemExit(f"ship {task_name}: the warm start's sha256 is {made[:12]}..., the runs recorded {shown}")
    _, eval_set = task.splits(task.train_questions, task.eval_questions, cache_dir)
    result = task.evaluate(model, tokenizer, eval_set, task.eval_samples, 0)
    meta = json.loads((entry / "warm_start.json").read_text())
    meta.update(
        weights_sha256=made,
        held_out_pass_at_1={
            "overall": result["overall"],
            "by_difficulty": {str(k): v for k, v in result["by_difficulty"].items()},
            "questions": len(eval_set),
            "samples": task.eval_samples,
            "sampling_seed": 0,
            "task": task_name,
        },
        runs=recorded.get(made, []),
    )
    meta.setdefault("machine", None)  # entries built before machines were recorded: unknown
    target = dest / entry.name
    tmp = dest / f".tmp-{entry.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(entry, tmp)
    (tmp / "warm_start.json").write_text(json.dumps(meta, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.study.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("tasks", nargs="+", help=f"of {', '.join(TASKS)}")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE)
    p.add_argument("--runs", type=Path, default=Path("benchmarks/results/confirm"), help="runs that must match")
    p.add_argument("--rebuild", action="store_true", help="train each warm start afresh into the cache first")
    args = p.parse_args(argv)
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        print(f"ship: unknown task {unknown[0]!r}; known: {', '.join(TASKS)}", file=sys.stderr)
        return 2
    warm_start_source("rebuild" if args.rebuild else "cache")
    SHIPPED.mkdir(parents=True, exist_ok=True)
    for name in args.tasks:
        meta = ship(name, args.cache_dir, args.runs)
        held = meta["held_out_pass_at_1"]
        print(f"{name}: sha256 {meta['weights_sha256'][:12]}..., held-out pass@1 {held['overall']:.4f} "
              f"({held['questions']} questions x {held['samples']}), by {len(meta['runs'])} runs")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
