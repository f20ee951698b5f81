"""The registered comparison of replay rules (benchmarks/results/policies/plan.md): what it runs and how it is read.

    python -m lab.study --policies                 # train the registered runs that are missing, then the analysis
    python -m lab.study --policies --report-only   # the analysis from the runs saved so far

The rules of arXiv 2606.04560 (an age limit of tau_max = 10 optimizer updates and questions drawn by the |advantage|
of their stored success) on ExGRPO, as `rollout_recipe`, against TRL's GRPOTrainer in three settings at fresh seeds
(primary), and each rule alone against ExGRPO at the hard point (secondary, exploratory). The machinery is the
registered study's (`lab.study.confirm`): runs only from a committed tree and one commit, paired by seed, both axes,
95% t-intervals over seeds, the paired t-test with the exact sign-flip p beside it, Holm within each family.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from . import confirm
from .confirm import ALPHA, MARGIN, _f, _figure, comparison_markdown, load_runs, saved_commits
from .regimes import final_mean, never_solved

RESULTS = "benchmarks/results/policies"
SETTINGS = ("addition", "countdown-paper-lr2.5e-5", "countdown-hard")
HARD = "countdown-hard"
SEEDS = (28, 29, 30, 31, 32)  # no run used them: 0-24 the earlier studies, 25-27 the replication
SECONDARY_SEEDS = (28, 29, 30)
RECIPE = "rollout_recipe"
COMPONENTS = ("age_limit", "advantage_priority")
ARMS = ("grpo", RECIPE, "exgrpo", *COMPONENTS)
PRIMARY = ((RECIPE, "grpo"),)  # x AXES x SETTINGS: a family of 6, Holm-corrected
SECONDARY = tuple((c, "exgrpo") for c in COMPONENTS)  # x AXES at countdown-hard: a family of 4, Holm-corrected
DESCRIPTIVE = ((RECIPE, "exgrpo"),)  # at countdown-hard, seeds 28-30, no test
FAMILIES = (("primary", PRIMARY, SETTINGS), ("secondary", SECONDARY, (HARD,)))


def registered_order() -> list[tuple[str, str, int]]:
    """The runs in the order the plan trains them: the grpo and rollout_recipe pairs, setting by setting (each seed's
    pair together), then at countdown-hard exgrpo and each component alone, seed by seed."""
    return family_runs("primary") + family_runs("secondary")


def family_runs(family: str) -> list[tuple[str, str, int]]:
    """The runs a family's comparisons read, in the registered order: the primary's grpo and rollout_recipe pairs;
    the secondary's exgrpo and each component alone at countdown-hard (the descriptive recipe - exgrpo reads both)."""
    if family == "primary":
        return [(t, a, s) for t in SETTINGS for s in SEEDS for a in ("grpo", RECIPE)]
    return [(HARD, a, s) for s in SECONDARY_SEEDS for a in ("exgrpo", *COMPONENTS)]


def complete_families(runs: list[dict]) -> tuple[str, ...]:
    """The families whose registered runs are all saved: each one's answer is written once its own runs are in (the
    other family's runs are other arms and cannot change it)."""
    done = {(r["task"], r["arm"], r["seed"]) for r in runs}
    return tuple(f for f in ("primary", "secondary") if set(family_runs(f)) <= done)


# ------------------------------------------------------------------------------------------------ analysis
def comparisons(runs: list[dict]) -> list[dict[str, Any]]:
    """The registered comparisons (confirm.comparisons over this plan's families) and, descriptive, the recipe against
    ExGRPO at countdown-hard on the seeds both ran."""
    rows = confirm.comparisons(runs, FAMILIES)
    extra = confirm.comparisons(runs, (("descriptive-pair", DESCRIPTIVE, (HARD,)),))
    for c in extra:
        c["family"] = "descriptive"
        c.pop("verdict", None)
    return rows + extra


PLAIN = {
    "addition": "sums of 1-4 digits, one right answer each; the model starts at {warm} held-out pass@1",
    "countdown-paper-lr2.5e-5": "the paper's batch shape and step; {never} of the training questions never solved",
    "countdown-hard": "the same from a weaker model: {never} of the training questions never solved",
}
PRIMARY_WORDS = confirm.PRIMARY_WORDS
SECONDARY_WORDS = confirm.SECONDARY_WORDS
ARM_WORDS = {"age_limit": "the age limit alone", "advantage_priority": "advantage priority alone"}


def user_table(runs: list[dict], rows: list[dict]) -> str:
    """One row a setting: what the data is like (measured), GRPO's final held-out pass@1 (median over seeds), and the
    recipe against GRPO at equal generated rollouts / equal updates (mean [95% t-interval], the Holm verdict)."""
    found = confirm._by_key(rows)
    lines = ["| your data is like | GRPO final held-out pass@1 | ExGRPO with the age limit and advantage priority - "
             "GRPO, same rollouts / same updates |", "|---|---|---|"]  # fmt: skip
    for setting in SETTINGS:
        records = [r for r in runs if r["task"] == setting]
        grpo = [r for r in records if r["arm"] == "grpo"]
        both = [found.get((setting, RECIPE, "grpo", axis)) for axis in ("final_rollouts", "final_updates")]
        if not grpo or any(c is None or not c["n"] for c in both):
            continue
        warm = statistics.median(r["curve"]["pass_at_1"][0] for r in records)
        never = never_solved(grpo)
        plain = PLAIN[setting].format(warm=f"{warm:.2f}", never="-" if never is None else f"{100 * never:.0f}%")
        figures = [f"{_figure(c)}, {c['verdict'].replace(')', '; t-test)')}" for c in both]
        lines.append(f"| {plain} | {statistics.median(final_mean(r) for r in grpo):.3f} | {' / '.join(figures)} "
                     f"({both[0]['n']} seeds) |")  # fmt: skip
    return "\n".join(lines)


def answer(rows: list[dict[str, Any]], families: tuple[str, ...] = ("primary", "secondary")) -> list[str]:
    """The registered answer in the plan's words ("What will be written for each outcome"), for the `families`
    whose runs are all in: the primary's bullets (a setting each, then the question in the title), the secondary's."""
    found = confirm._by_key(rows)
    out = []
    if "primary" in families:
        for setting in SETTINGS:
            words = confirm._phrase(found, setting, RECIPE, "grpo", PRIMARY_WORDS)
            out.append(f"**{setting}**: ExGRPO with the age limit and advantage priority {words}.")
        out.append(_not_losing(found))
    if "secondary" in families:
        parts = [f"{ARM_WORDS[arm]} against ExGRPO: {confirm._phrase(found, HARD, arm, 'exgrpo', SECONDARY_WORDS)}"
                 for arm in COMPONENTS]  # fmt: skip
        out.append(f"**Each rule alone** at {HARD} (exploratory, 3 seeds): " + "; ".join(parts) + ".")
    return out


def _not_losing(found: dict) -> str:
    """The question in the title, answered only for the settings and axes where the recipe was above or level."""
    verdicts = {(s, a): found[(s, RECIPE, "grpo", a)]["verdict"] for s in SETTINGS for a in confirm.AXIS_WORDS}
    axes = {s: [a for a in confirm.AXIS_WORDS if verdicts[(s, a)] == "above" or verdicts[(s, a)].startswith(
        "non-inferior")] for s in SETTINGS}  # fmt: skip
    held = [f"{s} {'on both axes' if len(a) == 2 else 'at ' + confirm.AXIS_WORDS[a[0]]}" for s, a in axes.items() if a]
    if sum(map(len, axes.values())) == len(verdicts):
        return "**A replay rule that does not lose**: the recipe was level with or above GRPO in every setting on " \
            "both axes."  # fmt: skip
    if held:
        return f"**A replay rule that does not lose**: only in {'; '.join(held)}; elsewhere the recipe was below " \
            "GRPO or not told apart from it."  # fmt: skip
    return "**A replay rule that does not lose**: not found here; the recipe was level with or above GRPO in no " \
        "setting on either axis."  # fmt: skip


README_COLUMNS = {
    "addition": "sums",
    "countdown-paper-lr2.5e-5": "the paper's shape",
    "countdown-hard": "weaker model",
}  # the README table's rows, as short column names


def readme_row(rows: list[dict[str, Any]]) -> str:
    """The README's one row for the recipe: a column a setting (the user table's rows, by short name), each the
    recipe - GRPO at equal generated rollouts / equal updates with its Holm verdict (5 seeds each)."""
    found = confirm._by_key(rows)
    cells = []
    for setting in SETTINGS:
        both = [found[(setting, RECIPE, "grpo", axis)] for axis in confirm.AXIS_WORDS]
        cells.append(" / ".join(f"{_figure(c)}, {c['verdict'].replace(')', '; t-test)')}" for c in both))
    head = " | ".join(README_COLUMNS[s] for s in SETTINGS)
    return "\n".join(
        [
            f"| ExGRPO with an age limit and advantage priority - GRPO | {head} |",
            "|---|---|---|---|",
            f"| same rollouts / same updates (5 seeds) | {' | '.join(cells)} |",
        ]
    )


def replay_profile(runs: list[dict]) -> list[dict[str, Any]]:
    """Per setting and replaying arm, from the generation-batch records: the age (optimizer updates since collection)
    of the replayed trajectories (mean over batches of each batch's mean, and the largest), the replayed groups per
    batch and `reuse` (replays per distinct replayed question over the last 50 batches); medians over seeds."""
    out = []
    for setting in SETTINGS:
        for arm in ARMS[1:]:
            per_seed = []
            for r in sorted((r for r in runs if r["task"] == setting and r["arm"] == arm), key=lambda r: r["seed"]):
                batches = r.get("batches", [])
                ages = [b["age"]["mean"] for b in batches if b.get("age")]
                reuse = [b["reuse"] for b in batches if b.get("reuse") is not None]
                per_seed.append({
                    "seed": r["seed"],
                    "age_mean": statistics.fmean(ages) if ages else None,
                    "age_max": max((b["age"]["max"] for b in batches if b.get("age")), default=None),
                    "replayed_groups": statistics.fmean(b.get("replayed_groups", 0) for b in batches) if batches
                    else None,
                    "reuse_mean": statistics.fmean(reuse) if reuse else None,
                })  # fmt: skip
            if per_seed:
                med = {k: confirm._median_of(per_seed, k) for k in ("age_mean", "age_max", "replayed_groups",
                                                                    "reuse_mean")}  # fmt: skip
                out.append({"setting": setting, "arm": arm, "seeds": len(per_seed), **med, "per_seed": per_seed})
    return out


def analyse(results: str | Path) -> tuple[dict[str, Any], str]:
    """The registered analysis of the runs saved in `results`; writes analysis.json and analysis.md there."""
    results = Path(results)
    runs = load_runs(results)
    rows = comparisons(runs)
    profile = replay_profile(runs)
    done = {(r["task"], r["arm"], r["seed"]) for r in runs}
    order = registered_order()
    missing = [f"{t}/{a}/seed{s}" for t, a, s in order if (t, a, s) not in done]
    commits = {c: len(v) for c, v in saved_commits(results).items()}
    families = complete_families(runs)
    bullets = answer(rows, families)
    pending = [f"the {f}'s, when its {len(family_runs(f))} runs are in" for f in ("primary", "secondary")
               if f not in families]  # fmt: skip
    payload = {"comparisons": rows, "replay_profile": profile, "finals": confirm.finals(runs), "missing": missing,
               "commits": commits, "answer": bullets, "complete_families": list(families)}  # fmt: skip
    lines = [
        "# Replay rules against GRPO: analysis",
        "",
        "## For a user: final held-out pass@1, paired by seed, at equal generated rollouts / equal updates",
        "",
        user_table(runs, rows),
        "",
        f"Runs in: {len(runs)} of {len(order)}"
        + (f"; missing: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}" if missing else "")
        + f". Commits: {', '.join(f'{c[:12]} ({n})' for c, n in commits.items()) or 'none yet'}.",
        "",
        "Paired by seed; final = the mean of the final model's held-out evaluations; equal generated rollouts: the "
        "arm that generated more is read on its held-out curve at the other's final rollout count. p (t): the paired "
        "t-test, two-sided; p (sign-flip): the exact sign-flip test, two-sided (it cannot go below 0.0625 with 5 "
        f"seeds, 0.25 with 3); Holm: within the family. Verdicts as registered: above / below (Holm p < {ALPHA}), "
        f"non-inferior (primary only: Holm p of the one-sided test of a loss of {MARGIN} or more < {ALPHA}), else "
        "not resolved.",
        "",
        "## The registered answer",
        "",
        "\n".join([*(f"- {b}" for b in bullets), *(f"- Written later: {p}." for p in pending)]),
        "",
        "## For the README: one row",
        "",
        readme_row(rows)
        if "primary" in families
        else f"Written when the {len(family_runs('primary'))} primary runs are in.",
        "",
        "## Primary: rollout_recipe - grpo (a family of 6, Holm)",
        "",
        comparison_markdown([c for c in rows if c["family"] == "primary"]),
        "",
        "## Secondary, exploratory: each rule alone - exgrpo at countdown-hard, 3 seeds (a family of 4, Holm)",
        "",
        comparison_markdown([c for c in rows if c["family"] == "secondary"]),
        "",
        "## Descriptive (no test): AUC, and rollout_recipe - exgrpo at countdown-hard",
        "",
        comparison_markdown([c for c in rows if c["family"] == "descriptive"]),
        "",
        "## What was replayed (generation-batch records; median over seeds)",
        "",
        "| setting | arm | seeds | age of replayed trajectories, updates: mean / largest | replayed groups per "
        "batch | reuse, mean over the run |",
        "|---|---|---|---|---|---|",
    ]
    for p in profile:
        lines.append(f"| {p['setting']} | {p['arm']} | {p['seeds']} | {_f(p['age_mean'], 2, False)} / "
                     f"{_f(p['age_max'], 0, False)} | {_f(p['replayed_groups'], 1, False)} | "
                     f"{_f(p['reuse_mean'], 2, False)} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    (results / "analysis.json").write_text(json.dumps(payload, indent=1) + "\n")
    (results / "analysis.md").write_text(text)
    return payload, text
