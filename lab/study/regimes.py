"""The study across regimes: what each setting's runs measured about replay's regime, and the step-size sweep.

Two reports over the study's saved runs (`study.run_one` records), written by `python -m lab.study` beside its table:

- `regime_stats`: per setting, the figures that decide what replay does to a model, to set beside the paper's run:
  questions per optimizer update, learning rate and its ratio to them (the step one question takes), optimizer
  updates, fresh visits per training question, whether GRPO was still improving over the last quarter, how many
  training questions GRPO never solved, replays per replayed question and replay demand against the buffer's size.
- `sweep`: ExGRPO minus GRPO at each point of the step-size sweep (the same setting at several learning rates), and
  `difficulty`: the same at the paper-shaped step across difficulties (the share of training questions GRPO never
  solves). Each difference is paired by seed (median and min-max band over seeds) and given on both axes, labelled:
  at equal optimizer updates and at equal generated rollouts (a replayed group generates K - 1 rows, so ExGRPO ends
  a run with fewer). "Final" is the mean of the final model's saved evaluations; at equal rollouts it is set against
  GRPO's held-out curve read at ExGRPO's final rollout count. The AUC is the mean held-out pass@1 over the run,
  against updates or against generated rollouts. One figure each, against the step size and against difficulty.
- `batch_diagnostics`: from the per-generation-batch records, why replay does what it does: all-fail and all-pass
  groups among fresh and replayed groups, the importance weights of replayed tokens, the replayed trajectories' age.
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


def final_mean(record: dict) -> float:
    """The final model's held-out pass@1: the mean of its saved evaluations (the curve's last point and the same model
    evaluated again with other sampling seeds)."""
    values = record["final"].get("pass_at_1_resampled") or [record["final"]["pass_at_1"]]
    return statistics.fmean(values)


def curve_at(record: dict, rollouts: float) -> float:
    """Held-out pass@1 at `rollouts` generated rollouts: linear between evaluations (the last one the final model's
    mean, `final_mean`), held beyond it."""
    x, y = record["curve"]["rollouts"], [*record["curve"]["pass_at_1"][:-1], final_mean(record)]
    if rollouts >= x[-1]:
        return y[-1]
    for (x0, y0), (x1, y1) in zip(zip(x, y), zip(x[1:], y[1:])):
        if x0 <= rollouts <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (rollouts - x0) / (x1 - x0)
    return y[0]


def equal_rollouts_difference(a: dict, b: dict) -> float:
    """Run `a`'s held-out pass@1 minus run `b`'s at the same generated rollouts: the run that generated more is read on
    its curve (`curve_at`) at the other's final rollout count, the other at its final model (`final_mean`)."""
    ra, rb = a["final"]["rollouts"], b["final"]["rollouts"]
    if ra <= rb:
        return final_mean(a) - curve_at(b, ra)
    return curve_at(a, rb) - final_mean(b)


def auc(record: dict, budget: float, axis: str = "rollouts") -> float:
    """Mean held-out pass@1 over the first `budget` generated rollouts (`axis` "step": optimizer updates): the area
    under the held-out curve (trapezoids, linear between evaluations) divided by `budget`."""
    x, y = record["curve"][axis], record["curve"]["pass_at_1"]
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


def never_solved(records: list[dict]) -> float | None:
    """The share of the training questions a run drew that it never solved, median over `records` (GRPO's runs)."""
    asked = [r["questions"] for r in records if r.get("questions", {}).get("seen")]
    return _median([q["never_solved"] / q["seen"] for q in asked])


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
    out["never_solved"] = never_solved(grpo)
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


# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom: the standard table's values.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_interval(values: list[float]) -> tuple[float, float] | None:
    """The 95% t-interval of the mean of `values` (one per seed): mean -+ t(0.975, n - 1) * sd / sqrt(n), sd the
    sample standard deviation (n - 1). None with fewer than 2 values. Seeds are the units: what varies between two
    arms trained with one seed is the whole training run, not only the held-out estimate of its final model."""
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = T_975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return mean - half, mean + half


def _band(values: list[float]) -> dict | None:
    """Per-seed values summarised: median, min and max, and the mean, its standard deviation over seeds and its 95%
    t-interval (`t_interval`; None for one seed)."""
    if not values:
        return None
    ci = t_interval(values)
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "seeds": len(values),
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else None,
        "ci95": list(ci) if ci is not None else None,
    }


# The comparisons every point reports, ExGRPO minus GRPO paired by seed: (key, what, axis)
COMPARISONS = (
    ("final_updates", "final", "equal updates"),
    ("final_rollouts", "final", "equal rollouts"),
    ("auc_updates", "AUC", "equal updates"),
    ("auc_rollouts", "AUC", "equal rollouts"),
)


def compare(task: str, records: list[dict], arm: str = "exgrpo", base: str = "grpo") -> dict | None:
    """`arm` minus `base` (by default ExGRPO minus GRPO) on one setting, paired by seed, on both axes (None without
    runs of both arms):

    - `final_updates`: the final models' held-out pass@1 (`final_mean`), both after the same optimizer updates;
    - `final_rollouts`: at the same generated rollouts (`equal_rollouts_difference`): ExGRPO's final model against
      GRPO's curve at ExGRPO's final rollout count (a replayed group generates K - 1 rows);
    - `auc_updates`: the mean held-out pass@1 over the updates (`auc` against steps);
    - `auc_rollouts`: the mean over the first B generated rollouts, B the fewest any run of the setting generated.
    """
    grpo = [r for r in records if r["arm"] == base]
    exgrpo = [r for r in records if r["arm"] == arm]
    if not (grpo and exgrpo):
        return None
    budget = min(r["final"]["rollouts"] for r in grpo + exgrpo)
    steps = min(r["curve"]["step"][-1] for r in grpo + exgrpo)
    by_seed = {r["seed"]: r for r in grpo}
    at_rollouts = [
        equal_rollouts_difference(r, by_seed[r["seed"]])
        for r in sorted(exgrpo, key=lambda r: r["seed"])
        if r["seed"] in by_seed
    ]
    return {
        "task": task,
        "step_size": step_size(records[0]),
        "learning_rate": _settings(records[0])["learning_rate"],
        "steps": _settings(records[0])["steps"],
        "grpo_final": _band([final_mean(r) for r in grpo]),
        "exgrpo_final": _band([final_mean(r) for r in exgrpo]),
        "final_updates": _band(_paired(grpo, exgrpo, final_mean)),
        "final_rollouts": _band(at_rollouts),
        "auc_budget": budget,
        "auc_updates": _band(_paired(grpo, exgrpo, functools.partial(auc, budget=steps, axis="step"))),
        "auc_rollouts": _band(_paired(grpo, exgrpo, functools.partial(auc, budget=budget))),
        "grpo_last_quarter_gain": _median([g for g in map(last_quarter_gain, grpo) if g is not None]),
        "never_solved": never_solved([r for r in records if r["arm"] == "grpo"]),
        "arms": [arm, base],
    }


# The pairs of arms the diagnostic table sets side by side: what each piece of ExGRPO does, paired by seed.
ARM_PAIRS = (
    ("exgrpo", "grpo"),
    ("revisit_no_replay", "exgrpo"),
    ("revisit_no_replay", "grpo"),
    ("grpo_skip_retired", "grpo"),
    ("grpo_skip_retired", "exgrpo"),
    ("uniform_questions", "exgrpo"),
    ("random_trajectory", "exgrpo"),
    ("luffy", "grpo"),  # offline guidance (docs/algorithm.md, section 11)
    ("exgrpo_offline", "exgrpo"),
    ("exgrpo_offline", "luffy"),
    ("exgrpo_offline", "grpo"),
    # what replay costs at the hard point (docs/study.md): dose, concentration, shaping; and the reuse limit
    ("replay_quarter", "exgrpo"),
    ("replay_quarter", "grpo"),
    ("reuse_limit", "exgrpo"),
    ("reuse_limit", "grpo"),
    ("uniform_questions", "grpo"),
    ("no_shaping", "exgrpo"),
    ("no_shaping", "grpo"),
)


def arm_pairs(task: str, records: list[dict]) -> list[dict]:
    """`compare` for each pair of `ARM_PAIRS` both of whose arms ran on `task`."""
    return [c for arm, base in ARM_PAIRS if (c := compare(task, records, arm, base)) is not None]


def arm_pairs_markdown(pairs: list[dict]) -> str:
    """One row a pair of arms: the difference on both axes, paired by seed: mean (sd over seeds) [95% t-interval]."""
    head = ["arms", *(f"{what}, {axis}" for _, what, axis in COMPARISONS), "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in pairs:
        arm, base = c["arms"]
        cells = [f"{arm} - {base}", *[_diff(c[key]) for key, _, _ in COMPARISONS], str(c["final_updates"]["seeds"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep(runs: list[dict], family: str) -> list[dict]:
    """`compare` for each setting whose name starts with `family` (the sweep's points), by step size, largest first."""
    points = []
    for task in sorted({r["task"] for r in runs if r["task"].startswith(family)}):
        point = compare(task, [r for r in runs if r["task"] == task])
        if point is not None:
            points.append(point)
    return sorted(points, key=lambda p: -p["step_size"])


def difficulty(runs: list[dict], tasks: list[str]) -> list[dict]:
    """`compare` for the settings `tasks` (one step size, several difficulties), by the share of training questions
    GRPO never solved, easiest first."""
    points = [compare(t, [r for r in runs if r["task"] == t]) for t in tasks]
    return sorted((p for p in points if p is not None), key=lambda p: p["never_solved"] or 0.0)


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
    """A paired difference over seeds: mean, standard deviation over seeds, 95% t-interval over seeds."""
    if b is None:
        return "-"
    if b.get("ci95") is None:  # one seed (or a record written before the intervals): no interval
        return f"{_f(b.get('mean', b['median']), digits, True)} (1 seed)"
    lo, hi = b["ci95"]
    return f"{_f(b['mean'], digits, True)} (sd {_f(b['sd'], digits)}) [{_f(lo, digits, True)}, {_f(hi, digits, True)}]"


def _diff_headers() -> list[str]:
    return [f"ExGRPO - GRPO {what}, {axis}" for _, what, axis in COMPARISONS]


def sweep_markdown(points: list[dict], old: list[dict]) -> str:
    """The sweep's table; `old` holds the earlier settings' points (other batch shapes), listed after it."""
    head = ["setting", "lr / questions per update", "lr", "updates", "GRPO final", "ExGRPO final", *_diff_headers()]
    head += ["seeds", "GRPO's last-quarter gain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points + old:
        g, e = p["grpo_final"], p["exgrpo_final"]
        seeds = p["final_updates"]["seeds"] if p["final_updates"] else 0
        cells = [
            p["task"],
            _e(p["step_size"]),
            f"{p['learning_rate']:g}",
            str(p["steps"]),
            f"{_f(g['median'])} [{_f(g['min'])}, {_f(g['max'])}]",
            f"{_f(e['median'])} [{_f(e['min'])}, {_f(e['max'])}]",
            *[_diff(p[key]) for key, _, _ in COMPARISONS],
            str(seeds),
            _f(p["grpo_last_quarter_gain"], 3, True),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def difficulty_markdown(points: list[dict]) -> str:
    """The difficulty table: one row a setting at the same step, by the share of questions GRPO never solves."""
    head = ["setting", "training questions GRPO never solved", "warm start", "GRPO final", "ExGRPO final"]
    head += [*_diff_headers(), "seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        g, e = p["grpo_final"], p["exgrpo_final"]
        cells = [
            p["task"],
            _f(p["never_solved"], 2),
            _f(p.get("warm_start")),
            f"{_f(g['median'])} [{_f(g['min'])}, {_f(g['max'])}]",
            f"{_f(e['median'])} [{_f(e['min'])}, {_f(e['max'])}]",
            *[_diff(p[key]) for key, _, _ in COMPARISONS],
            str(p["final_updates"]["seeds"] if p["final_updates"] else 0),
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


def _difference_figure(groups, x_key: str, x_label: str, path: Path, noise: float | None, log_x: bool) -> None:
    """Two panels (final, AUC), each with ExGRPO minus GRPO at equal updates and at equal rollouts against `x_key`:
    the mean paired difference with its 95% t-interval over seeds. `groups`: (points, label, marker, annotate) for each
    family of points; an annotated family is a set of separate settings (labelled, not joined by a line). `noise`: the
    standard deviation of a difference of two final figures of fixed models from their evaluation alone (the grey
    band is 2 of them): a smaller figure than the seed-to-seed spread the bars show."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11.5, 4.0))
    panels = (("final", "final held-out pass@1"), ("AUC", "mean held-out pass@1 over the run (AUC)"))
    for ax, (what, title) in zip(axes, panels):
        for points, label, marker, annotate in groups:
            for (key, _, axis), shift, fill in zip(
                [c for c in COMPARISONS if c[1] == what], (0.97, 1.03) if log_x else (-0.004, 0.004), ("full", "none")
            ):
                shown = [p for p in points if p[key] and p[x_key] is not None]
                if not shown:
                    continue
                x = [p[x_key] * shift if log_x else p[x_key] + shift for p in shown]
                med = [p[key]["mean"] for p in shown]
                ci = [p[key]["ci95"] or [p[key]["mean"]] * 2 for p in shown]  # one seed: no bar
                lo = [m - c[0] for m, c in zip(med, ci)]
                hi = [c[1] - m for m, c in zip(med, ci)]
                ax.errorbar(x, med, yerr=[lo, hi], fmt=marker + ("" if annotate else "-"), capsize=4, lw=1.4,
                            ms=6, fillstyle=fill, label=f"{label}, {axis}")  # fmt: skip
                if annotate and axis == "equal rollouts":
                    for i, p in enumerate(shown):
                        # right of the rightmost bar, centred on it: settings at one step with close figures
                        # (countdown-medium and -weak) stay apart, where offsets alternating up and down crossed
                        ax.annotate(p["task"], (x[i], med[i]), fontsize=6, xytext=(6, 0), va="center",
                                    textcoords="offset points")  # fmt: skip
        ax.axhline(0.0, color="black", lw=0.8)
        if noise and what == "final":
            ax.axhspan(-2 * noise, 2 * noise, color="grey", alpha=0.15, lw=0,
                       label="evaluation noise of fixed models (2 sd), not the seed-to-seed spread")  # fmt: skip
        if log_x:
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: minor labels overlap
        ax.set_xlabel(x_label)
        ax.set_ylabel("ExGRPO - GRPO (mean, 95% t-interval over seeds)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def sweep_figure(points: list[dict], old: list[dict], path: Path, noise: float | None = None) -> None:
    """ExGRPO minus GRPO against lr / questions per update (log scale), on both axes: final pass@1 and AUC."""
    groups = [(points, "paper-shaped batch", "o", False), (old, "earlier settings", "s", True)]
    _difference_figure(groups, "step_size", "learning rate / questions per update", path, noise, log_x=True)


def difficulty_figure(points: list[dict], path: Path, noise: float | None = None) -> None:
    """ExGRPO minus GRPO at the paper-shaped step against the share of training questions GRPO never solves."""
    groups = [(points, "paper's step", "o", False)]
    _difference_figure(groups, "never_solved", "training questions GRPO never solved", path, noise, log_x=False)


def batch_diagnostics(records: list[dict]) -> dict[str, dict]:
    """Per arm, from the per-generation-batch records (runs that have them), the median over seeds of: the share of
    fresh and of replayed groups with no success (all-fail: no gradient, no success to store) and with every rollout a
    success (all-pass: no gradient either), the groups per generation batch that carry a gradient (neither), the
    importance weights of replayed tokens (mean, 5th and 95th percentile, share below gamma; medians over batches),
    the replayed trajectories' mean age in updates, and, from the records that carry them, the repeat share, the
    replayed groups whose generated rows all fail, and replays per buffered question per batch (the concentration).
    The buffer's size is the one the batch drew from."""
    out: dict[str, dict] = {}
    for arm in sorted({r["arm"] for r in records if r.get("batches")}):
        per_seed: dict[str, list[float]] = {}
        for r in (r for r in records if r["arm"] == arm and r.get("batches")):
            batches = r["batches"]
            figures = {}
            for kind in ("fresh", "replayed"):
                groups = sum(b[f"{kind}_groups"] for b in batches)
                fail = sum(b[f"{kind}_all_fail"] for b in batches)
                full = sum(b[f"{kind}_all_pass"] for b in batches)
                if groups:
                    figures[f"{kind}_all_fail"] = fail / groups
                    figures[f"{kind}_all_pass"] = full / groups
                figures[f"{kind}_with_gradient"] = (groups - fail - full) / len(batches)
            weights = [b["is_weight"] for b in batches if b.get("is_weight")]
            for stat in ("mean", "p05", "p95", "below_gamma"):
                values = [w[stat] for w in weights if w[stat] is not None]
                if values:
                    figures[f"is_weight_{stat}"] = statistics.median(values)
            ages = [b["age"]["mean"] for b in batches if b.get("age")]
            if ages:
                figures["age_mean"] = statistics.fmean(ages)
            # concentration (records written since the reuse limit): how often the same questions come back
            shares = [b["repeat_share"] for b in batches if b.get("repeat_share") is not None]
            if shares:
                figures["repeat_share"] = statistics.fmean(shares)
            replayed = sum(b["replayed_groups"] for b in batches)
            if replayed and "replayed_fresh_all_fail" in batches[0]:
                figures["replayed_fresh_all_fail"] = sum(b["replayed_fresh_all_fail"] for b in batches) / replayed
            demand = [
                b["replayed_groups"] / sum(b["buckets"].values())
                for b in batches
                if b.get("buckets") and sum(b["buckets"].values()) and b["replayed_groups"]
            ]
            if demand:
                figures["replays_per_buffered"] = statistics.fmean(demand)
            for key, value in figures.items():
                per_seed.setdefault(key, []).append(value)
        out[arm] = {key: statistics.median(values) for key, values in per_seed.items()}
        out[arm]["seeds"] = max((len(v) for v in per_seed.values()), default=0)
    return out


DIAGNOSTIC_ROWS = (
    ("fresh groups all-fail (share)", "fresh_all_fail", 3),
    ("fresh groups all-pass (share)", "fresh_all_pass", 3),
    ("replayed groups all-fail (share)", "replayed_all_fail", 3),
    ("replayed groups all-pass (share)", "replayed_all_pass", 3),
    ("fresh groups with a gradient, per generation batch", "fresh_with_gradient", 1),
    ("replayed groups with a gradient, per generation batch", "replayed_with_gradient", 1),
    ("importance weight w of replayed tokens, mean", "is_weight_mean", 3),
    ("w, 5th percentile", "is_weight_p05", 3),
    ("w, 95th percentile", "is_weight_p95", 3),
    ("replayed tokens with w below gamma (share)", "is_weight_below_gamma", 3),
    ("replayed trajectories' age (updates), mean", "age_mean", 1),
    ("replayed questions also replayed in the batch before (repeat share)", "repeat_share", 3),
    ("replayed groups whose generated rows all fail (share)", "replayed_fresh_all_fail", 3),
    ("replays per buffered question, per generation batch that replays", "replays_per_buffered", 3),
)


def diagnostics_markdown(diagnostics: dict[str, dict]) -> str:
    """`batch_diagnostics` as a table: one column an arm (medians over its seeds), one row a figure."""
    arms = list(diagnostics)
    head = ["per generation batch", *(f"{arm} ({diagnostics[arm]['seeds']})" for arm in arms)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, digits in DIAGNOSTIC_ROWS:
        cells = [_f(diagnostics[arm].get(key), digits) for arm in arms]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
