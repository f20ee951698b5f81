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
from pathlib import Path

from .run import _r, _rows_by_key, final_model_path
from .tasks import ARMS, Task


def control_rows(results: Path, cache_dir: str, tasks: dict[str, Task], base: str = "grpo") -> list[dict]:
    """One row per saved run with a control record whose seed's `base` final model is in the cache."""
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


def write_control(results: Path, cache_dir: str, tasks: dict[str, Task]) -> str:
    rows = control_rows(results, cache_dir, tasks)
    table = control_markdown(rows)
    (Path(results) / "control.json").write_text(json.dumps(rows, indent=1) + "\n")
    (Path(results) / "control.md").write_text("### Over-fitting control\n\n" + table + "\n")
    return table
