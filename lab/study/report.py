"""The study's report: per task and arm, final held-out pass@1 over seeds and the rollouts to reach GRPO's final
figure (`summarize`, `markdown`), the curves (`figure`), and the sweeps and regime table (`sweep_report`)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from .regimes import final_mean
from .tasks import ARMS, DIFFICULTY_POINTS, MAIN_ARMS, SWEEP_FAMILY, TASKS


def _median_band(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _first_reaching(record: dict, target: float) -> int | None:
    for rollouts, value in zip(record["curve"]["rollouts"], record["curve"]["pass_at_1"]):
        if value is not None and value >= target - 1e-12:
            return rollouts
    return None


def summarize(runs: list[dict]) -> dict:
    """Per task and arm: final held-out pass@1 over seeds (median, min, max of the mean of each final model's saved
    evaluations; per difficulty, its last evaluation), and the generated rollouts each seed needed to reach GRPO's
    final median, against GRPO's total."""
    by: dict[str, dict[str, list[dict]]] = {}
    for record in runs:
        by.setdefault(record["task"], {}).setdefault(record["arm"], []).append(record)
    summary: dict[str, Any] = {}
    for task, arms in by.items():
        grpo = arms.get("grpo", [])
        target = statistics.median(final_mean(r) for r in grpo) if grpo else None
        grpo_rollouts = statistics.median(r["final"]["rollouts"] for r in grpo) if grpo else None
        warm = [r["curve"]["pass_at_1"][0] for rs in arms.values() for r in rs]
        summary[task] = {"grpo_final_median": target, "grpo_rollouts": grpo_rollouts, "arms": {}}
        summary[task]["warm_start_median"] = statistics.median(warm) if warm else None
        for arm, records in sorted(arms.items(), key=lambda kv: list(ARMS).index(kv[0]) if kv[0] in ARMS else 99):
            records = sorted(records, key=lambda r: r["seed"])
            finals = [final_mean(r) for r in records]  # the mean of the final model's saved evaluations
            difficulties = sorted({d for r in records for d in r["final"]["by_difficulty"]}, key=float)
            entry = {
                "seeds": [r["seed"] for r in records],
                "final": dict(zip(("median", "min", "max"), _median_band(finals))),
                "final_per_seed": finals,
                "by_difficulty": {
                    d: statistics.median(r["final"]["by_difficulty"][d] for r in records) for d in difficulties
                },
                "rollouts": statistics.median(r["final"]["rollouts"] for r in records),
            }
            if target is not None:
                reach = [_first_reaching(r, target) for r in records]
                reached = [x for x in reach if x is not None]
                # median over seeds, a seed that never reached counting as infinitely many rollouts
                ordered = sorted(x if x is not None else math.inf for x in reach)
                median = statistics.median(ordered) if ordered else math.inf
                entry["rollouts_to_grpo_final"] = {
                    "per_seed": reach,
                    "reached": len(reached),
                    "median": None if math.isinf(median) else median,
                    "share_of_grpo": None if math.isinf(median) or not grpo_rollouts else median / grpo_rollouts,
                }
            summary[task]["arms"][arm] = entry
    return summary


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def band(final: dict) -> str:
    """A summary's final pass@1 as "median [min, max]"."""
    return f"{fmt(final['median'])} [{fmt(final['min'])}, {fmt(final['max'])}]"


def markdown(summary: dict) -> str:
    lines = []
    for task, s in summary.items():
        lines.append(f"### {task}: {TASKS[task].description if task in TASKS else ''}")
        lines.append("")
        lines.append(
            f"Warm start held-out pass@1 {fmt(s['warm_start_median'])}; "
            f"GRPO's final median {fmt(s['grpo_final_median'])} after {fmt(s['grpo_rollouts'], 0)} generated rollouts."
        )
        lines.append("")
        difficulties = sorted({d for a in s["arms"].values() for d in a["by_difficulty"]}, key=float)
        head = ["arm", "seeds", "final pass@1 median [min, max]", *[f"d={d}" for d in difficulties]]
        head += ["rollouts to GRPO's final (median)", "share of GRPO's", "seeds reaching"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for arm, a in s["arms"].items():
            reach = a.get("rollouts_to_grpo_final", {})
            share = reach.get("share_of_grpo")
            row = [
                arm,
                str(len(a["seeds"])),
                band(a["final"]),
                *[fmt(a["by_difficulty"].get(d)) for d in difficulties],
                fmt(reach.get("median"), 0) if reach.get("median") is not None else "not reached",
                "-" if share is None else f"{100 * share:.0f}%",
                f"{reach.get('reached', 0)}/{len(a['seeds'])}",
            ]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def figure(runs: list[dict], path: Path, arms: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs}, key=lambda t: list(TASKS).index(t) if t in TASKS else 99)
    cols = min(4, max(1, len(tasks)))  # four settings a row
    rows = max(1, math.ceil(len(tasks) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        for arm in arms:
            records = [r for r in runs if r["task"] == task and r["arm"] == arm]
            if not records:
                continue
            n = min(len(r["curve"]["rollouts"]) for r in records)
            x = [statistics.median(r["curve"]["rollouts"][j] for r in records) / 1000 for j in range(n)]
            ys = [[r["curve"]["pass_at_1"][j] for r in records] for j in range(n)]
            median = [statistics.median(y) for y in ys]
            main = arm in MAIN_ARMS
            line = ax.plot(
                x, median, lw=2.2 if main else 1.0, ls="-" if main else "--", label=f"{arm} ({len(records)})"
            )
            ax.fill_between(
                x,
                [min(y) for y in ys],
                [max(y) for y in ys],
                color=line[0].get_color(),
                alpha=0.18 if main else 0.06,
                lw=0,
            )
        ax.set_title(task)
        ax.set_xlabel("generated rollouts (thousands)")
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the dashboards' smoothing)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def curves_figure(grpo: dict, exgrpo: dict, path: Path, window: int = 10) -> None:
    """One seed's training curves, GRPO beside ExGRPO, as the logged metrics draw them on a dashboard: held-out pass@1
    (the evaluation callback), the batch's pass@1 (`exgrpo/batch/pass_at_1`), the share of fresh groups with no
    success (TRL's `frac_reward_zero_std`, all-fail part) against the share of questions replayed
    (`exgrpo/replay/fraction`), and ExGRPO's buffer by bucket with the retired questions (`exgrpo/buffer/*`).
    Per-batch series are smoothed over `window` generation batches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11.5, 7.0))
    (held_out, batch), (groups, buffer) = axes
    for record, style in ((grpo, "-"), (exgrpo, "-")):
        arm = record["arm"]
        curve = record["curve"]
        held_out.plot(curve["step"], curve["pass_at_1"], style, marker="o", ms=3, label=arm)
        steps = record["steps"]
        passed = [(i + 1, v) for i, v in enumerate(steps["batch_pass_at_1"]) if v is not None]
        if passed:
            batch.plot([s for s, _ in passed], _smooth([v for _, v in passed], window), style, label=arm)
        batches = [b for b in record.get("batches") or [] if b["fresh_groups"]]
        if batches:
            share = [b["fresh_all_fail"] / b["fresh_groups"] for b in batches]
            groups.plot([b["step"] for b in batches], _smooth(share, window), label=f"{arm}: fresh groups all-fail")
    planned = [(i + 1, r / (r + f)) for i, (r, f) in enumerate(zip(exgrpo["steps"]["replayed"],
               exgrpo["steps"]["fresh_questions"])) if r + f]  # fmt: skip
    groups.plot([s for s, _ in planned], _smooth([v for _, v in planned], window), "--",
                label=f"{exgrpo['arm']}: questions replayed")  # fmt: skip
    stored = [b for b in exgrpo.get("batches") or [] if b.get("buckets")]
    if stored:
        ks = sorted(stored[0]["buckets"], key=int)
        buffer.stackplot([b["step"] for b in stored], [[b["buckets"][k] for b in stored] for k in ks],
                         labels=[f"bucket {k}" for k in ks], alpha=0.8)  # fmt: skip
    retired = exgrpo["steps"]["retired"]
    buffer.plot(range(1, len(retired) + 1), retired, color="black", lw=1.5, label="retired")
    titles = (
        (held_out, "held-out pass@1", "pass@1"),
        (batch, f"batch pass@1, replayed groups included (exgrpo/batch/pass_at_1, {window}-batch mean)", "pass@1"),
        (groups, f"share per generation batch ({window}-batch mean)", "share"),
        (buffer, f"{exgrpo['arm']} buffer: questions by bucket (exgrpo/buffer/*)", "questions"),
    )
    for ax, title, ylabel in titles:
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("optimizer updates")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2 if ax is buffer else 1)
    fig.suptitle(f"{exgrpo['task']}, seed {exgrpo['seed']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def report(results: Path, tasks: list[str] | None, arms: list[str] | None, compare: bool = True) -> tuple[dict, str]:
    runs = []
    for path in sorted(results.glob("*/*/seed*.json")):
        record = json.loads(path.read_text())
        if (tasks is None or record["task"] in tasks) and (arms is None or record["arm"] in arms):
            runs.append(record)
    summary = summarize(runs)
    table = markdown(summary)
    (results / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results / "results.md").write_text(table + "\n")
    plotted = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    figure(runs, results / "study.png", plotted)
    if any(r["task"].startswith(SWEEP_FAMILY) or r["task"] in DIFFICULTY_POINTS for r in runs):
        table += "\n" + sweep_report(runs, results, compare)
        (results / "results.md").write_text(table + "\n")
    return summary, table


def sweep_report(runs: list[dict], results: Path, compare: bool = True) -> str:
    """The step-size sweep and the difficulty axis (`regimes.compare` on both axes), the regime table and, from the
    per-generation-batch records, the diagnostics of each difficulty point; written as sweep.json, sweep.png,
    difficulty.png and (the hardest point's seed 0, GRPO beside ExGRPO) curves.png. `compare=False` (a registered
    study that does not compare ExGRPO with GRPO) leaves every ExGRPO - GRPO table and figure out."""
    from . import regimes

    earlier = [name for name in TASKS if not name.startswith(SWEEP_FAMILY) and name not in DIFFICULTY_POINTS]
    points = regimes.sweep(runs, SWEEP_FAMILY) if compare else []
    old = [p for name in earlier for p in regimes.sweep(runs, name)] if compare else []
    hard = regimes.difficulty(runs, list(DIFFICULTY_POINTS)) if compare else []
    by_task: dict[str, list[dict]] = {}
    order = list(TASKS)  # the earlier settings, the sweep from its largest step to its smallest, the difficulty axis
    for record in sorted(runs, key=lambda r: order.index(r["task"]) if r["task"] in order else len(order)):
        by_task.setdefault(record["task"], []).append(record)
    stats = {name: regimes.regime_stats(records) for name, records in by_task.items()}
    for point in hard:
        point["warm_start"] = statistics.median(r["curve"]["pass_at_1"][0] for r in by_task[point["task"]])
    diagnostics = {
        name: regimes.batch_diagnostics(by_task[name])
        for name in DIFFICULTY_POINTS
        if name in by_task and any(r.get("batches") for r in by_task[name])
    }
    paper_shaped = [r for r in runs if r["task"].startswith(SWEEP_FAMILY) or r["task"] in DIFFICULTY_POINTS]
    noise = regimes.estimate_noise(paper_shaped)
    payload = {"points": points, "earlier_settings": old, "difficulty": hard, "diagnostics": diagnostics,
               "regimes": stats, "estimate_noise": noise}  # fmt: skip
    # a difference of two final figures, each the mean of the final model's evaluations, by chance alone
    sd = noise["std"] * math.sqrt(2 / noise["evaluations_per_run"]) if noise else None
    if compare:
        regimes.sweep_figure(points, old, results / "sweep.png", sd)
    if hard:
        regimes.difficulty_figure(hard, results / "difficulty.png", sd)
    seed0 = {r["arm"]: r for r in by_task.get(DIFFICULTY_POINTS[-1], []) if r["seed"] == 0}
    if compare and "grpo" in seed0 and "exgrpo" in seed0:
        curves_figure(seed0["grpo"], seed0["exgrpo"], results / "curves.png")
    axes = (
        "paired by seed: mean (sd over seeds) [95% t-interval over seeds]; final: the mean of the final model's "
        "evaluations; equal updates: after the same optimizer updates; equal rollouts: GRPO read at ExGRPO's "
        "generated rollouts"
    )
    lines = []
    if compare:
        lines += [f"### Step-size sweep: ExGRPO minus GRPO ({axes})", "", regimes.sweep_markdown(points, old), ""]
    if noise:
        lines += [
            f"Evaluation noise (of fixed models; not the spread between training runs, which the intervals over seeds "
            f"give): one final model evaluated with {noise['evaluations_per_run']} sampling seeds varies by "
            f"{noise['std']:.4f} (standard deviation pooled over {noise['runs']} runs); a difference of two final "
            f"figures, each the mean of {noise['evaluations_per_run']}, by about {sd:.4f}.",
            "",
        ]
    if hard:
        lines += [f"### Difficulty at the paper's step: ExGRPO minus GRPO ({axes})", ""]
        lines += [regimes.difficulty_markdown(hard), ""]
    for name in DIFFICULTY_POINTS:
        pairs = regimes.arm_pairs(name, by_task.get(name, []))
        payload.setdefault("arm_pairs", {})[name] = pairs
        if len(pairs) > 1:
            lines += [f"### Arms paired by seed at {name} ({axes})", "", regimes.arm_pairs_markdown(pairs), ""]
    for name, table in diagnostics.items():
        lines += [f"### Diagnostics at {name}: what each generation batch was made of (medians over seeds)", ""]
        lines += [regimes.diagnostics_markdown(table), ""]
    lines += ["### Regimes: the paper's run beside each setting", "", regimes.regime_markdown(stats), ""]
    (results / "sweep.json").write_text(json.dumps(payload, indent=1) + "\n")
    return "\n".join(lines)
