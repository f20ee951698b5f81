"""The registered confirmatory study (benchmarks/results/confirm/plan.md): what it runs and how it is read.

    python -m lab.study --confirm                 # train the registered runs that are missing, then the analysis
    python -m lab.study --confirm --report-only   # the analysis from the runs saved so far

Every run starts only from a committed tree (`provenance.require_clean`) and from the same commit as the runs already
saved in the folder (`check_one_commit`), so that all of them say exactly what code made them. The plan fixes the
settings, arms and seeds (`SETTINGS`, `ARMS`, `SEEDS`), the order they train in (`registered_order`), the
comparisons and their families (`PRIMARY`, `SECONDARY`), the margin and the level; `analyse` reads the saved runs
exactly so: paired by seed, final held-out pass@1 at equal generated rollouts and at equal updates (and the AUC,
descriptive), each with its mean, standard deviation and 95% t-interval over seeds, the paired t-test's p, the exact
sign-flip p beside it, and Holm's correction over each family.
"""

from __future__ import annotations

import functools
import json
import statistics
from pathlib import Path
from typing import Any

from . import stats
from .regimes import auc, equal_rollouts_difference, final_mean, never_solved, t_interval

RESULTS = "benchmarks/results/confirm"
SETTINGS = ("addition", "countdown-weak", "countdown-paper-lr2.5e-5", "countdown-hard")
ARMS = ("grpo", "exgrpo", "reuse_limit")
SEEDS = (20, 21, 22, 23, 24)
MARGIN = 0.01  # non-inferiority margin, held-out pass@1 (about the seed-to-seed sd of a paired difference)
ALPHA = 0.05
AXES = (("final_rollouts", "final, equal generated rollouts"), ("final_updates", "final, equal updates"))
AUC_AXES = (("auc_rollouts", "AUC, equal generated rollouts"), ("auc_updates", "AUC, equal updates"))
PRIMARY = (("reuse_limit", "grpo"),)  # x AXES x SETTINGS: a family of 8, Holm-corrected
SECONDARY = (("exgrpo", "grpo"), ("reuse_limit", "exgrpo"))  # x AXES x SETTINGS: a family of 16, Holm-corrected


def registered_order() -> list[tuple[str, str, int]]:
    """The runs in the order the plan trains them: the grpo and reuse_limit pairs first, setting by setting (each
    seed's pair together), then exgrpo, setting by setting."""
    pairs = [(t, a, s) for t in SETTINGS for s in SEEDS for a in ("grpo", "reuse_limit")]
    return pairs + [(t, "exgrpo", s) for t in SETTINGS for s in SEEDS]


def saved_commits(results: Path) -> dict[str, list[str]]:
    """commit -> the saved runs of `results` it made (a run without one under "none")."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(results).glob("*/*/seed*.json")):
        commit = (json.loads(path.read_text()).get("provenance") or {}).get("commit") or "none"
        out.setdefault(commit, []).append(str(path.relative_to(results)))
    return out


def check_one_commit(results: Path, commit: str) -> None:
    """ValueError unless every run already saved in `results` was made by `commit` (one registered study, one
    commit: a run resumed after an interruption trains from the commit that started the study)."""
    others = {c: runs for c, runs in saved_commits(results).items() if c != commit}
    if others:
        c, runs = next(iter(others.items()))
        raise ValueError(
            f"{results} holds runs made by commit {c} ({len(runs)}, e.g. {runs[0]}); this checkout is at {commit}: "
            "train the rest from the commit that made them (a git worktree of it)"
        )


# ------------------------------------------------------------------------------------------------ analysis
def load_runs(results: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(results).glob("*/*/seed*.json"))]


def paired(records: list[dict], arm: str, base: str) -> dict[str, list[tuple[int, float]]]:
    """`arm` minus `base` on one setting, seed by seed (seeds both ran), on every axis: final held-out pass@1 at equal
    generated rollouts (`regimes.equal_rollouts_difference`) and at equal updates (`regimes.final_mean`), and the AUC
    over the fewest rollouts (updates) any run of the two arms made."""
    a = {r["seed"]: r for r in records if r["arm"] == arm}
    b = {r["seed"]: r for r in records if r["arm"] == base}
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {}
    both = [*a.values(), *b.values()]
    budget = min(r["final"]["rollouts"] for r in both)
    steps = min(r["curve"]["step"][-1] for r in both)
    value = {
        "final_rollouts": equal_rollouts_difference,
        "final_updates": lambda x, y: final_mean(x) - final_mean(y),
        "auc_rollouts": lambda x, y: auc(x, budget) - auc(y, budget),
        "auc_updates": lambda x, y: auc(x, steps, "step") - auc(y, steps, "step"),
    }
    return {key: [(s, f(a[s], b[s])) for s in seeds] for key, f in value.items()}


def describe(values: list[float]) -> dict[str, Any]:
    """Mean, sd and 95% t-interval over seeds, the paired t-test's two-sided p and the exact sign-flip p."""
    ci = t_interval(values)
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
        "sd": statistics.stdev(values) if len(values) > 1 else None,
        "ci95": list(ci) if ci else None,
        "p_t": stats.t_test_p(values),
        "p_sign_flip": stats.sign_flip_p(values),
    }


def _verdict(c: dict[str, Any], primary: bool) -> str:
    """What the registered reading concludes from one comparison (plan.md, "Decisions")."""
    p = c.get("p_t_holm")
    if p is not None and p < ALPHA:
        return "above" if c["mean"] > 0 else "below"
    if primary and c.get("p_noninferior_holm") is not None and c["p_noninferior_holm"] < ALPHA:
        return f"non-inferior (within {MARGIN})"
    return "not resolved"


def comparisons(runs: list[dict]) -> list[dict[str, Any]]:
    """Every registered comparison with its figures, Holm-corrected within its family (module docstring)."""
    by_setting: dict[str, list[dict]] = {}
    for r in runs:
        by_setting.setdefault(r["task"], []).append(r)
    out = []
    for family, pairs in (("primary", PRIMARY), ("secondary", SECONDARY)):
        for setting in SETTINGS:
            for arm, base in pairs:
                values = paired(by_setting.get(setting, []), arm, base)
                for key, label in AXES + AUC_AXES:
                    per_seed = values.get(key, [])
                    vals = [v for _, v in per_seed]
                    c = {"setting": setting, "arm": arm, "base": base, "axis": key, "label": label,
                         "family": family if key.startswith("final") else "descriptive",
                         "per_seed": {str(s): v for s, v in per_seed}, **describe(vals)}  # fmt: skip
                    if c["family"] == "primary":
                        c["p_noninferior"] = stats.noninferiority_p(vals, MARGIN)
                        c["p_noninferior_sign_flip"] = stats.sign_flip_p(vals, shift=MARGIN, two_sided=False)
                    out.append(c)
    for family in ("primary", "secondary"):
        members = [c for c in out if c["family"] == family]
        for c, adjusted in zip(members, stats.holm([c["p_t"] for c in members])):
            c["p_t_holm"] = adjusted
        if family == "primary":
            for c, adjusted in zip(members, stats.holm([c["p_noninferior"] for c in members])):
                c["p_noninferior_holm"] = adjusted
        for c in members:
            c["verdict"] = _verdict(c, family == "primary")
    return out


def concentration(runs: list[dict]) -> list[dict[str, Any]]:
    """Per setting and replaying arm, the concentration of replay from each run's generation-batch records:
    `exgrpo/replay/reuse` (replays per distinct replayed question over the last 50 draws) averaged over the run's
    batches and at its end, and the repeat share averaged over the run; the median over seeds and the per-seed
    values."""
    out = []
    for setting in SETTINGS:
        for arm in ARMS:
            records = sorted((r for r in runs if r["task"] == setting and r["arm"] == arm), key=lambda r: r["seed"])
            per_seed = []
            for r in records:
                reuse = [b["reuse"] for b in r.get("batches", []) if b.get("reuse") is not None]
                shares = [b["repeat_share"] for b in r.get("batches", []) if b.get("repeat_share") is not None]
                if reuse:
                    per_seed.append({"seed": r["seed"], "reuse_mean": statistics.fmean(reuse), "reuse_end": reuse[-1],
                                     "repeat_share_mean": statistics.fmean(shares) if shares else None})  # fmt: skip
            if per_seed:
                med = functools.partial(_median_of, per_seed)
                out.append({"setting": setting, "arm": arm, "seeds": len(per_seed), "per_seed": per_seed,
                            "reuse_mean": med("reuse_mean"), "reuse_end": med("reuse_end"),
                            "repeat_share_mean": med("repeat_share_mean")})  # fmt: skip
    return out


def _median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


# What each setting is like, in a user's words; {warm} and {never} are measured (`user_table`).
PLAIN = {
    "addition": "sums of 1-4 digits, one right answer each; the model starts at {warm} held-out pass@1",
    "countdown-weak": "a weak model: {warm} held-out pass@1 at the start, replay from the first batch",
    "countdown-paper-lr2.5e-5": "the paper's batch shape and step; {never} of the training questions never solved",
    "countdown-hard": "the same from a weaker model: {never} of the training questions never solved",
}


def user_table(runs: list[dict], rows: list[dict]) -> str:
    """The registered answer for a user, one row a setting: what the data is like (measured), GRPO's final held-out
    pass@1 (median over seeds), and ExGRPO and ExGRPO with the reuse limit against GRPO at equal generated rollouts /
    at equal updates (mean [95% t-interval over seeds], the verdict with Holm's correction)."""
    found = {(c["setting"], c["arm"], c["base"], c["axis"]): c for c in rows}
    axes = "same rollouts / same updates"
    lines = [f"| your data is like | GRPO final held-out pass@1 | ExGRPO - GRPO, {axes} | ExGRPO with the reuse limit "
             f"- GRPO, {axes} |", "|---|---|---|---|"]  # fmt: skip
    for setting in SETTINGS:
        records = [r for r in runs if r["task"] == setting]
        grpo = [r for r in records if r["arm"] == "grpo"]
        if not grpo:
            continue
        warm = statistics.median(r["curve"]["pass_at_1"][0] for r in records)
        never = never_solved(grpo)
        plain = PLAIN[setting].format(warm=f"{warm:.2f}", never="-" if never is None else f"{100 * never:.0f}%")
        cells = [plain, f"{statistics.median(final_mean(r) for r in grpo):.3f}"]
        for arm in ("exgrpo", "reuse_limit"):
            both = [found.get((setting, arm, "grpo", axis)) for axis in ("final_rollouts", "final_updates")]
            if any(c is None or not c["n"] for c in both):
                cells.append("not run yet")
                continue
            figures = [f"{_f(c['mean'])}{_interval(c)}, {c['verdict']}" for c in both]
            n = both[0]["n"]
            cells.append(f"{' / '.join(figures)} ({n} seed{'s' if n > 1 else ''})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interval(c: dict[str, Any]) -> str:
    return f" [{_f(c['ci95'][0])}, {_f(c['ci95'][1])}]" if c["ci95"] else ""


def finals(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """setting -> arm -> seed -> final held-out pass@1 (`regimes.final_mean`)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in runs:
        out.setdefault(r["task"], {}).setdefault(r["arm"], {})[str(r["seed"])] = final_mean(r)
    return out


def _f(x: float | None, digits: int = 3, sign: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _p(x: float | None) -> str:
    return "-" if x is None else (f"{x:.4f}" if x < 0.001 else f"{x:.3f}")


def comparison_markdown(rows: list[dict]) -> str:
    head = ["setting", "arms", "axis", "mean (sd) [95% t-interval over seeds]", "per seed", "p (t)", "p (sign-flip)",
            "p Holm (t)", "verdict"]  # fmt: skip
    primary = any(c["family"] == "primary" for c in rows)
    if primary:
        head[-1:-1] = [f"p non-inferior by {MARGIN} (t / sign-flip)", "p non-inferior Holm (t)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in rows:
        ci = _interval(c).strip() or ("(one seed)" if c["n"] else "(no runs yet)")
        sd = f" (sd {_f(c['sd'], sign=False)})" if c["sd"] is not None else ""
        cells = [c["setting"], f"{c['arm']} - {c['base']}", c["label"], f"{_f(c['mean'])}{sd} {ci}",
                 ", ".join(_f(v) for v in c["per_seed"].values()), _p(c["p_t"]), _p(c["p_sign_flip"]),
                 _p(c.get("p_t_holm"))]  # fmt: skip
        if primary:
            cells += [f"{_p(c.get('p_noninferior'))} / {_p(c.get('p_noninferior_sign_flip'))}",
                      _p(c.get("p_noninferior_holm"))]  # fmt: skip
        cells.append(c.get("verdict", "descriptive"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def analyse(results: str | Path) -> tuple[dict[str, Any], str]:
    """The registered analysis of the runs saved in `results`; writes analysis.json and analysis.md there."""
    results = Path(results)
    runs = load_runs(results)
    rows = comparisons(runs)
    conc = concentration(runs)
    done = {(r["task"], r["arm"], r["seed"]) for r in runs}
    missing = [f"{t}/{a}/seed{s}" for t, a, s in registered_order() if (t, a, s) not in done]
    commits = saved_commits(results)
    payload = {"comparisons": rows, "concentration": conc, "finals": finals(runs), "missing": missing,
               "commits": {c: len(v) for c, v in commits.items()}}  # fmt: skip
    lines = [
        "# The registered study: analysis",
        "",
        "## For a user: final held-out pass@1, paired by seed, at equal generated rollouts / equal updates",
        "",
        user_table(runs, rows),
        "",
        f"Runs in: {len(runs)} of {len(registered_order())}"
        + (f"; missing: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}" if missing else "")
        + f". Commits: {', '.join(f'{c[:12]} ({n})' for c, n in payload['commits'].items()) or 'none yet'}.",
        "",
        "Paired by seed; final = the mean of the final model's held-out evaluations; equal generated rollouts: the "
        "arm that generated more is read on its held-out curve at the other's final rollout count. p (t): the paired "
        "t-test, two-sided; p (sign-flip): the exact sign-flip test, two-sided (with 5 seeds it cannot go below "
        f"0.0625); Holm: within the family. Verdicts as registered: above / below (Holm p < {ALPHA}), non-inferior "
        f"(primary only: Holm p of the one-sided test of a loss of {MARGIN} or more < {ALPHA}), else not resolved.",
        "",
        "## Primary: reuse_limit - grpo (a family of 8, Holm)",
        "",
        comparison_markdown([c for c in rows if c["family"] == "primary"]),
        "",
        "## Secondary: exgrpo - grpo, reuse_limit - exgrpo (a family of 16, Holm)",
        "",
        comparison_markdown([c for c in rows if c["family"] == "secondary"]),
        "",
        "## Descriptive: AUC (no test)",
        "",
        comparison_markdown([c for c in rows if c["family"] == "descriptive"]),
        "",
        "## Concentration of replay (`exgrpo/replay/reuse`, replays per distinct replayed question over the last 50 "
        "generation batches that replayed; median over seeds)",
        "",
        "| setting | arm | seeds | reuse, mean over the run | reuse at the end | repeat share, mean | per seed "
        "(mean / end) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in conc:
        seeds = ", ".join(f"{s['reuse_mean']:.2f} / {s['reuse_end']:.2f}" for s in c["per_seed"])
        lines.append(
            f"| {c['setting']} | {c['arm']} | {c['seeds']} | {_f(c['reuse_mean'], 2, False)} | "
            f"{_f(c['reuse_end'], 2, False)} | {_f(c['repeat_share_mean'], 3, False)} | {seeds} |"
        )
    text = "\n".join(lines) + "\n"
    (results / "analysis.json").write_text(json.dumps(payload, indent=1) + "\n")
    (results / "analysis.md").write_text(text)
    return payload, text
