"""The over-fitting control: does replay lift the questions it replays because it replays them?

An ExGRPO-family run records (`run.overfitting_control`) its 100 most replayed training questions and 100 never
replayed ones matched to them by difficulty and warm-start pass rate, with the warm start's and its own final pass@1
on both sets. Here GRPO's final model of the same seed (kept by every run, `run.final_model_path`) is scored on the
same two sets. Replay's own effect on the replayed questions is ExGRPO's rise there beyond what it shows on the
matched set and beyond GRPO's rise on the replayed set; the most replayed questions were chosen for having been
solved, so their rise alone says nothing.

    python -m lab.study --control      # after the runs: writes RESULTS/control.json and control.md
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .regimes import t_interval
from .run import _r, _rows_by_key, final_model_path
from .tasks import ARMS, Task


def control_rows(
    results: Path, cache_dir: str, tasks: dict[str, Task], base: str = "grpo", done: dict | None = None
) -> list[dict]:
    """One row per saved run with a control record whose seed's `base` final model is in the cache; a run whose row
    is in `done` (keyed by task, arm and seed: a saved run and a kept final model do not change) keeps that row."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    rows, loaded = [], {}
    for path in sorted(Path(results).glob("*/*/seed*.json")):
        record = json.loads(path.read_text())
        control = record.get("control")
        task = tasks.get(record.get("task"))
        model_dir = final_model_path(cache_dir, record.get("task", ""), base, record.get("seed", -1))
        if not control or task is None or record["arm"] not in ARMS or not model_dir.is_dir():
            continue
        kept = (done or {}).get((record["task"], record["arm"], record["seed"]))
        if kept is not None:
            rows.append(kept)
            continue
        if task.name not in loaded:  # the task's tokenizer and training rows, once
            _, tokenizer = task.load(cache_dir, task.warm_start_steps, False)
            train_set, _ = task.splits(task.train_questions, task.eval_questions, cache_dir)
            loaded[task.name] = (tokenizer, _rows_by_key(train_set))
        tokenizer, by_key = loaded[task.name]
        model = AutoModelForCausalLM.from_pretrained(str(model_dir))
        seed = record["seed"]
        scored = {}
        for name in ("replayed", "matched"):
            keys = [key for key in control[name] if key in by_key]
            dataset = Dataset.from_list([by_key[key] for key in keys])
            scored[name] = (
                _r(task.evaluate(model, tokenizer, dataset, task.eval_samples, seed)["overall"]) if keys else None
            )
        rows.append({"task": record["task"], "arm": record["arm"], "seed": seed, "warm_start": control["warm_start"],
                     "final": control["final"], f"{base}_final": scored})  # fmt: skip
    return rows


def control_markdown(rows: list[dict], base: str = "grpo") -> str:
    """One row a run: warm start, the arm's final and GRPO's final pass@1 on the replayed and on the matched set."""
    head = ["task", "arm", "seed", "warm start: replayed / matched", "arm final: replayed / matched",
            f"{base} final: replayed / matched"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def pair(d: dict) -> str:
        return " / ".join("-" if d.get(k) is None else f"{d[k]:.3f}" for k in ("replayed", "matched"))

    for r in rows:
        cells = [
            r["task"],
            r["arm"],
            str(r["seed"]),
            pair(r["warm_start"]),
            pair(r["final"]),
            pair(r[f"{base}_final"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# What the control compares, per run (None where a figure is missing): name -> (what it says, value of a row)
CONTRAST = {
    "lift_beyond_matched": (
        "the arm's rise on its replayed set beyond its rise on the matched set",
        lambda r, b: _minus(_minus(r["final"]["replayed"], r["warm_start"]["replayed"]),
                            _minus(r["final"]["matched"], r["warm_start"]["matched"])),
    ),
    "replayed_minus_base": (
        "the arm's final minus GRPO's final on the replayed set",
        lambda r, b: _minus(r["final"]["replayed"], r[f"{b}_final"]["replayed"]),
    ),
    "matched_minus_base": (
        "the arm's final minus GRPO's final on the matched set",
        lambda r, b: _minus(r["final"]["matched"], r[f"{b}_final"]["matched"]),
    ),
}  # fmt: skip


def _minus(a, b):
    return None if a is None or b is None else a - b


def control_summary(rows: list[dict], base: str = "grpo") -> list[dict]:
    """Per task and arm, each `CONTRAST` over the runs' seeds: the mean, the standard deviation over seeds and the
    95% t-interval over seeds (`t_interval`; None with one seed), and the per-seed values."""
    by_arm = defaultdict(list)
    for r in rows:
        by_arm[(r["task"], r["arm"])].append(r)
    out = []
    for (task, arm), runs in sorted(by_arm.items()):
        runs = sorted(runs, key=lambda r: r["seed"])
        for name, (_, value) in CONTRAST.items():
            values = [v for v in (value(r, base) for r in runs) if v is not None]
            if values:
                ci = t_interval(values)
                out.append({"task": task, "arm": arm, "contrast": name, "values": [_r(v) for v in values],
                            "mean": _r(statistics.fmean(values)),
                            "sd": _r(statistics.stdev(values)) if len(values) > 1 else None,
                            "ci95": [_r(x) for x in ci] if ci else None})  # fmt: skip
    return out


def summary_markdown(summary: list[dict]) -> str:
    """One row per task, arm and contrast: mean (sd over seeds) [95% t-interval over seeds], and the seeds' values."""
    lines = ["| task | arm | contrast | mean (sd) [95% t-interval over seeds] | per seed |", "|---|---|---|---|---|"]
    for s in summary:
        sd = "" if s["sd"] is None else f" (sd {s['sd']:.3f})"
        ci = "" if s["ci95"] is None else f" [{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}]"
        values = ", ".join(f"{v:+.3f}" for v in s["values"])
        lines.append(
            f"| {s['task']} | {s['arm']} | {CONTRAST[s['contrast']][0]} | {s['mean']:+.3f}{sd}{ci} | {values} |"
        )
    return "\n".join(lines)


def write_control(results: Path, cache_dir: str, tasks: dict[str, Task]) -> str:
    """control.json and control.md in `results`; the rows of an earlier control.json are kept, so that the runs that
    landed since are the only ones scored."""
    saved = Path(results) / "control.json"
    earlier = json.loads(saved.read_text())["runs"] if saved.is_file() else []
    rows = control_rows(results, cache_dir, tasks, done={(r["task"], r["arm"], r["seed"]): r for r in earlier})
    summary = control_summary(rows)
    table = control_markdown(rows) + "\n\n" + summary_markdown(summary)
    (Path(results) / "control.json").write_text(json.dumps({"runs": rows, "summary": summary}, indent=1) + "\n")
    (Path(results) / "control.md").write_text("### Over-fitting control\n\n" + table + "\n")
    return table
