"""The study across regimes: what each setting's runs measured about replay's regime, and the step-size sweep.

Two reports over the study's saved runs (`study.run_one` records), written by `exgrpo study` beside its table:

- `regime_stats`: per setting, the figures that decide what replay does to a model, to set beside the paper's run:
  questions per optimizer update, learning rate and its ratio to them (the step one question takes), optimizer
  updates, fresh visits per training question, whether GRPO was still improving over the last quarter, how many
  training questions GRPO never solved, replays per replayed question and replay demand against the buffer's size.
- `sweep`: ExGRPO minus GRPO at each point of the step-size sweep (the same setting at several learning rates):
  final held-out pass@1 and the area under the held-out curve against generated rollouts, paired by seed, with the
  median and the min-max band over seeds; and one figure of both against the step size (log scale).
"""

from __future__ import annotations

import functools
import math
import statistics
from pathlib import Path
from typing import Any

# The paper's main run (Qwen2.5-Math-7B), for the regime table: 128 questions per generation batch in two updates of
# 64, lr 1e-6 constant, 700 generation batches = 1,400 updates over OpenR1-Math-46k; about half of the training
# questions never solved (the paper's section 6.1). The replay figures are estimates from the released script's
# settings, not measured.
PAPER_REGIME = {
    "questions_per_update": 64,
    "learning_rate": 1e-6,
    "step_size": 1e-6 / 64,
    "updates": 1400,
    "fresh_visits_per_question": "about 1.0",
    "grpo_last_quarter_gain": "still improving",
    "never_solved": "about half",
    "replays_per_question": "about 4 / 2-3 / 45-68 (estimated)",
    "replay_demand_over_buffer": "about 0.005 (estimated)",
}
MAIN = ("grpo", "exgrpo")


def _settings(record: dict) -> dict:
    return record["settings"]["task"]


def step_size(record: dict) -> float:
    """Learning rate per question of an optimizer update."""
    task = _settings(record)
    return task["learning_rate"] / task["prompts_per_step"]


def last_quarter_gain(record: dict) -> float | None:
    """Held-out pass@1 at the end minus at three quarters of the run (the evaluation nearest to it)."""
    steps, values = record["curve"]["step"], record["curve"]["pass_at_1"]
    if len(steps) < 2:
        return None
    at = 0.75 * steps[-1]
    j = min(range(len(steps)), key=lambda i: abs(steps[i] - at))
    return values[-1] - values[j]


def auc(record: dict, budget: float) -> float:
    """Mean held-out pass@1 over the first `budget` generated rollouts: the area under the held-out curve against
    generated rollouts (trapezoids, linear between evaluations) divided by `budget`."""
    x, y = record["curve"]["rollouts"], record["curve"]["pass_at_1"]
    area = 0.0
    for (x0, y0), (x1, y1) in zip(zip(x, y), zip(x[1:], y[1:])):
        if x0 >= budget:
            break
        if x1 > budget:  # cut the last trapezoid at the budget
            y1 = y0 + (y1 - y0) * (budget - x0) / (x1 - x0)
            x1 = budget
        area += (x1 - x0) * (y0 + y1) / 2
    return area / budget


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def regime_stats(records: list[dict]) -> dict[str, Any]:
    """The regime figures of one setting from its runs (GRPO's and ExGRPO's; other arms are ignored)."""
    grpo = [r for r in records if r["arm"] == "grpo"]
    exgrpo = [r for r in records if r["arm"] == "exgrpo"]
    any_run = (grpo or exgrpo or records)[0]
    task = _settings(any_run)
    out: dict[str, Any] = {
        "questions_per_update": task["prompts_per_step"],
        "questions_per_generation": task["prompts_per_step"] * task.get("steps_per_generation", 1),
        "learning_rate": task["learning_rate"],
        "step_size": step_size(any_run),
        "updates": task["steps"],
        "train_questions": task["train_questions"],
    }
    visits = [sum(r["steps"]["fresh_questions"]) / task["train_questions"] for r in exgrpo]
    out["fresh_visits_per_question"] = _median(visits)
    out["grpo_last_quarter_gain"] = _median([g for g in map(last_quarter_gain, grpo) if g is not None])
    asked = [r["questions"] for r in grpo if r.get("questions", {}).get("seen")]
    never = [q["never_solved"] / q["seen"] for q in asked]
    out["never_solved"] = _median(never)  # share of the training questions GRPO drew that it never solved
    means, medians, maxima, demand = [], [], [], []
    for r in exgrpo:
        histogram = {int(c): n for c, n in r["replay_counts"]["histogram"].items()}
        counts = sorted(c for c, n in histogram.items() for _ in range(n))
        if counts:
            means.append(sum(counts) / len(counts))
            medians.append(statistics.median(counts))
            maxima.append(max(counts))
        steps = r["steps"]
        ratios = [
            replayed / size
            for replayed, size in zip(steps["replayed"], steps["buffer_questions"])
            if replayed and size  # a generation batch that replayed, against the buffer at the end of its step
        ]
        if ratios:
            demand.append(statistics.median(ratios))
    out["replays_per_question"] = (
        {"mean": _median(means), "median": _median(medians), "max": _median(maxima)} if means else None
    )
    out["replay_demand_over_buffer"] = _median(demand)
    return out


def _paired(grpo: list[dict], exgrpo: list[dict], value) -> list[float]:
    """ExGRPO minus GRPO of `value(record)`, seed by seed (seeds present in both arms)."""
    by_seed = {r["seed"]: r for r in grpo}
    ordered = sorted(exgrpo, key=lambda r: r["seed"])
    return [value(r) - value(by_seed[r["seed"]]) for r in ordered if r["seed"] in by_seed]


def _band(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "seeds": len(values)}


def sweep(runs: list[dict], family: str) -> list[dict]:
    """One entry per setting whose name starts with `family` (the sweep's points), by step size, largest first.

    Differences are ExGRPO minus GRPO with the same seed: final held-out pass@1, and the mean held-out pass@1 over
    the first B generated rollouts (`auc`), B the fewest rollouts any run of the point generated (a replayed group
    generates K - 1, so ExGRPO's runs end a little earlier)."""
    points = []
    for task in sorted({r["task"] for r in runs if r["task"].startswith(family)}):
        records = [r for r in runs if r["task"] == task]
        grpo = [r for r in records if r["arm"] == "grpo"]
        exgrpo = [r for r in records if r["arm"] == "exgrpo"]
        if not (grpo and exgrpo):
            continue
        budget = min(r["final"]["rollouts"] for r in grpo + exgrpo)
        points.append(
            {
                "task": task,
                "step_size": step_size(records[0]),
                "learning_rate": _settings(records[0])["learning_rate"],
                "steps": _settings(records[0])["steps"],
                "grpo_final": _band([r["final"]["pass_at_1"] for r in grpo]),
                "exgrpo_final": _band([r["final"]["pass_at_1"] for r in exgrpo]),
                "final_difference": _band(_paired(grpo, exgrpo, lambda r: r["final"]["pass_at_1"])),
                "auc_budget": budget,
                "auc_difference": _band(_paired(grpo, exgrpo, functools.partial(auc, budget=budget))),
                "grpo_last_quarter_gain": _median([g for g in map(last_quarter_gain, grpo) if g is not None]),
            }
        )
    return sorted(points, key=lambda p: -p["step_size"])


def estimate_noise(runs: list[dict]) -> dict | None:
    """How much the held-out estimate of one final model moves with the sampling seed: the standard deviation of
    its repeated evaluations (`final.pass_at_1_resampled`), pooled over the runs that have several."""
    variances, sizes = [], []
    for r in runs:
        values = r["final"].get("pass_at_1_resampled") or []
        if len(values) >= 2:
            variances.append(statistics.variance(values))
            sizes.append(len(values))
    if not variances:
        return None
    pooled = sum(v * (n - 1) for v, n in zip(variances, sizes)) / sum(n - 1 for n in sizes)
    return {"runs": len(variances), "evaluations_per_run": max(sizes), "std": math.sqrt(pooled)}


def _e(x: float) -> str:
    return f"{x:.1e}".replace("e-0", "e-")


def _f(x: float | None, digits: int = 3, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _diff(b: dict | None, digits: int = 3) -> str:
    if b is None:
        return "-"
    return f"{_f(b['median'], digits, True)} [{_f(b['min'], digits, True)}, {_f(b['max'], digits, True)}]"


def sweep_markdown(points: list[dict], old: list[dict]) -> str:
    """The sweep's table; `old` holds the earlier settings' points (other batch shapes), listed after it."""
    head = "| setting | lr / questions per update | lr | updates | GRPO final | ExGRPO final | ExGRPO - GRPO final "
    head += "| ExGRPO - GRPO AUC | seeds | GRPO's last-quarter gain |"
    lines = [head, "|" + "---|" * 10]
    for p in points + old:
        g, e = p["grpo_final"], p["exgrpo_final"]
        seeds = p["final_difference"]["seeds"] if p["final_difference"] else 0
        cells = [
            p["task"],
            _e(p["step_size"]),
            f"{p['learning_rate']:g}",
            str(p["steps"]),
            f"{_f(g['median'])} [{_f(g['min'])}, {_f(g['max'])}]",
            f"{_f(e['median'])} [{_f(e['min'])}, {_f(e['max'])}]",
            _diff(p["final_difference"]),
            _diff(p["auc_difference"]),
            str(seeds),
            _f(p["grpo_last_quarter_gain"], 3, True),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regime_markdown(stats: dict[str, dict]) -> str:
    """The regime table: the paper's run beside each setting, one column each."""
    names = list(stats)
    rows = [
        ("questions per optimizer update", "questions_per_update", lambda v: f"{v}"),
        ("learning rate", "learning_rate", lambda v: f"{v:g}"),
        ("lr / questions per update", "step_size", _e),
        ("optimizer updates", "updates", lambda v: f"{v:,}"),
        ("fresh visits per training question (ExGRPO)", "fresh_visits_per_question", lambda v: f"{v:.2f}"),
        ("GRPO's held-out gain over the last quarter", "grpo_last_quarter_gain", lambda v: f"{v:+.3f}"),
        ("training questions GRPO never solved (of those drawn)", "never_solved", lambda v: f"{v:.2f}"),
        (
            "replays per replayed question, mean / median / max",
            "replays_per_question",
            lambda v: f"{v['mean']:.1f} / {v['median']:g} / {v['max']:g}",
        ),
        ("replay demand / buffer size, median", "replay_demand_over_buffer", lambda v: f"{v:.3f}"),
    ]
    lines = ["| | paper (Qwen2.5-Math-7B) | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    for label, key, show in rows:
        paper = PAPER_REGIME[key]
        cells = [paper if isinstance(paper, str) else show(paper)]
        for name in names:
            value = stats[name].get(key)
            cells.append("-" if value is None else show(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_figure(points: list[dict], old: list[dict], path: Path, noise: float | None = None) -> None:
    """ExGRPO minus GRPO against lr / questions per update (log scale): final pass@1 and AUC, median and band."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for ax, key, title in zip(
        axes,
        ("final_difference", "auc_difference"),
        ("final held-out pass@1", "mean held-out pass@1 over the run's rollouts (AUC)"),
    ):
        for group, style, label in ((points, "o-", "paper-shaped batch (sweep)"), (old, "s", "earlier settings")):
            shown = [p for p in group if p[key]]
            if not shown:
                continue
            x = [p["step_size"] for p in shown]
            med = [p[key]["median"] for p in shown]
            lo = [p[key]["median"] - p[key]["min"] for p in shown]
            hi = [p[key]["max"] - p[key]["median"] for p in shown]
            ax.errorbar(x, med, yerr=[lo, hi], fmt=style, capsize=4, lw=1.8, ms=6, label=label)
            if group is old:
                for i, p in enumerate(sorted(shown, key=lambda p: (p["step_size"], -p[key]["median"]))):
                    # settings at one step size alternate above and below their point, so labels do not overlap
                    ax.annotate(p["task"], (p["step_size"], p[key]["median"]), fontsize=6,
                                xytext=(4, 4 if i % 2 == 0 else -9), textcoords="offset points")  # fmt: skip
        ax.axhline(0.0, color="black", lw=0.8)
        if noise and key == "final_difference":
            # two independent estimates differ by sqrt(2) x the noise of one
            ax.axhspan(-2 * math.sqrt(2) * noise, 2 * math.sqrt(2) * noise, color="grey", alpha=0.15, lw=0,
                       label="estimate noise (2 sd of a difference)")  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: minor labels overlap
        ax.set_xlabel("learning rate / questions per update")
        ax.set_ylabel("ExGRPO - GRPO")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
