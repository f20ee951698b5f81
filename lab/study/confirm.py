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


FAMILIES = (("primary", PRIMARY, SETTINGS), ("secondary", SECONDARY, SETTINGS))


def comparisons(runs: list[dict], families: tuple = FAMILIES) -> list[dict[str, Any]]:
    """Every registered comparison with its figures, Holm-corrected within its family (module docstring).
    `families`: (name, (arm, base) pairs, settings) for "primary" and "secondary"; the AUC is descriptive."""
    by_setting: dict[str, list[dict]] = {}
    for r in runs:
        by_setting.setdefault(r["task"], []).append(r)
    out = []
    for family, pairs, settings in families:
        for setting in settings:
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


def concentration(runs: list[dict], settings: tuple = SETTINGS, arms: tuple = ARMS) -> list[dict[str, Any]]:
    """Per setting and replaying arm, the concentration of replay from each run's generation-batch records:
    `exgrpo/replay/reuse` (replays per distinct replayed question over the last 50 draws) averaged over the run's
    batches and at its end, and the repeat share averaged over the run; the median over seeds and the per-seed
    values."""
    out = []
    for setting in settings:
        for arm in arms:
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
    found = _by_key(rows)
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
            # a non-inferiority verdict rests on the t-test (the sign-flip p cannot go below 0.031 at 5 seeds)
            figures = [f"{_f(c['mean'])}{_interval(c)}, {c['verdict'].replace(')', '; t-test)')}" for c in both]
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


# ------------------------------------------------------------------------------------------------ the answer
AXIS_WORDS = {"final_rollouts": "equal generated rollouts", "final_updates": "equal updates"}
EARLIER = "benchmarks/results/study"  # the earlier study's runs (seeds 0-4), read the same way for comparison
EARLIER_SEEDS = (0, 1, 2, 3, 4)
# plan.md, "What will be written for each outcome": the primary verdicts in words
PRIMARY_WORDS = {
    "above": "ended above GRPO",
    "below": "ended below GRPO",
    f"non-inferior (within {MARGIN})": f"was level with GRPO (not worse by {MARGIN} or more)",
    "not resolved": f"was not told apart from GRPO, and a loss of {MARGIN} is not ruled out",
}
SECONDARY_WORDS = {"above": "above", "below": "below", "not resolved": "not told apart"}


def earlier_comparisons(root: str | Path = EARLIER) -> list[dict[str, Any]]:
    """The same comparisons over the earlier study's runs of these settings and arms, seeds 0-4 (their uncorrected
    figures are what the earlier docs said; their Holm figures are not read)."""
    runs = [r for r in load_runs(Path(root)) if r["task"] in SETTINGS and r["arm"] in ARMS and r["seed"] in
            EARLIER_SEEDS]  # fmt: skip
    return [c for c in comparisons(runs) if c["n"]] if runs else []


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """The tested comparisons (not the descriptive AUC) by setting, arm, base and axis."""
    return {(c["setting"], c["arm"], c["base"], c["axis"]): c for c in rows if c["family"] != "descriptive"}


def _figure(c: dict[str, Any]) -> str:
    return f"{_f(c['mean'])}{_interval(c)}"


def _direction(c: dict[str, Any]) -> int:
    """+1 / -1 where the uncorrected 95% interval lies above / below 0, else 0."""
    lo, hi = c["ci95"] or (None, None)
    return 0 if lo is None or lo <= 0 <= hi else (1 if lo > 0 else -1)


def _decided_by(c: dict[str, Any]) -> str:
    """The Holm-adjusted p the verdict rests on: of a loss of MARGIN for "non-inferior" (the t-test's: the exact
    sign-flip test cannot go below 1 / 2^n one-sided, 0.031 at 5 seeds), else of no difference."""
    if c["verdict"].startswith("non-inferior"):
        floor = 0.5 ** c["n"]
        return (f"Holm p of a loss of {MARGIN} or more {_p_words(c['p_noninferior_holm'])}, by the t-test: the "
                f"sign-flip test's p cannot go below {floor:.3f} one-sided at {c['n']} seeds")  # fmt: skip
    return f"Holm p {_p_words(c['p_t_holm'])}"


def _p_words(x: float | None) -> str:
    return "< 0.001" if x is not None and x < 0.001 else _p(x)


def _phrase(found: dict, setting: str, arm: str, base: str, words: dict[str, str]) -> str:
    """One comparison on both axes in words: "<verdict> at both ... (fig) and ... (fig)", or one clause an axis."""
    both = [(axis, found[(setting, arm, base, axis)]) for axis in AXIS_WORDS]
    holm = [f"{_figure(c)}, {_decided_by(c)}" for _, c in both]
    if both[0][1]["verdict"] == both[1][1]["verdict"]:
        return f"{words[both[0][1]['verdict']]} at both {AXIS_WORDS['final_rollouts']} ({holm[0]}) and " \
            f"{AXIS_WORDS['final_updates']} ({holm[1]})"  # fmt: skip
    return "; ".join(f"{words[c['verdict']]} at {AXIS_WORDS[axis]} ({h})" for (axis, c), h in zip(both, holm))


def answer(rows: list[dict[str, Any]], earlier: list[dict[str, Any]] | None = None) -> list[str]:
    """The registered answer in the plan's words ("What will be written for each outcome"), from the verdicts of
    `comparisons`: a bullet per setting (the reuse limit against GRPO, then ExGRPO against GRPO and the limit against
    ExGRPO), the earlier claim at countdown-hard, what follows for `replay_cooldown`, and every comparison whose
    direction (the uncorrected 95% interval above or below 0) differs from the earlier study's (`earlier`)."""
    found = _by_key(rows)
    out = []
    for setting in SETTINGS:
        words = _phrase(found, setting, "reuse_limit", "grpo", PRIMARY_WORDS)
        verdicts = {axis: found[(setting, "reuse_limit", "grpo", axis)]["verdict"] for axis in AXIS_WORDS}
        removes = [a for a, v in verdicts.items() if v.startswith("non-inferior")
                   and found[(setting, "reuse_limit", "exgrpo", a)]["verdict"] == "above"]  # fmt: skip
        if removes:
            where = " and ".join(AXIS_WORDS[a] for a in removes)
            words += f"; at {where} it removes ExGRPO's loss there rather than adding a gain over GRPO"
        if "below" in verdicts.values():
            words += "; the reuse limit is not recommended for settings like this one"
        out.append(
            f"**{setting}**: with the reuse limit, ExGRPO {words}. ExGRPO (the paper's settings) against GRPO: "
            f"{_phrase(found, setting, 'exgrpo', 'grpo', SECONDARY_WORDS)}. The reuse limit against ExGRPO: "
            f"{_phrase(found, setting, 'reuse_limit', 'exgrpo', SECONDARY_WORDS)}."
        )
    hard = found[("countdown-hard", "reuse_limit", "grpo", "final_rollouts")]
    before = _by_key(earlier or [])
    old = before.get(("countdown-hard", "reuse_limit", "grpo", "final_rollouts"))
    claim = f"the earlier result ({_figure(old)}, seeds 0-4, uncorrected)" if old else "the earlier result"
    contains = old is not None and hard["ci95"] and hard["ci95"][0] <= old["mean"] <= hard["ci95"][1]
    if hard["verdict"] == "above":
        out.append(f"**The earlier claim** at countdown-hard, equal generated rollouts: {claim} held on fresh seeds: "
                   f"{_figure(hard)}, above GRPO ({_decided_by(hard)}).")  # fmt: skip
    else:
        still = f"; the new interval still contains {_f(old['mean'])}" if contains else ""
        out.append(f"**The earlier claim** at countdown-hard, equal generated rollouts: {claim} did not hold on fresh "
                   f"seeds, that is, it was not confirmed{still}: ExGRPO with the limit "
                   f"{PRIMARY_WORDS[hard['verdict']]} ({_figure(hard)}, {_decided_by(hard)}); the docs no longer say "
                   "that the reuse limit ends above GRPO there.")  # fmt: skip
    primary = {(s, a): found[(s, "reuse_limit", "grpo", a)]["verdict"] for s in SETTINGS for a in AXIS_WORDS}
    below_rollouts = [s for s in SETTINGS if primary[(s, "final_rollouts")] == "below"]
    below = [s for s in SETTINGS if "below" in (primary[(s, a)] for a in AXIS_WORDS)]
    above = [f"{s} at {AXIS_WORDS[a]}" for (s, a), v in primary.items() if v == "above"]
    if below_rollouts:
        advice = (f"with the reuse limit below GRPO at equal generated rollouts in {', '.join(below_rollouts)}, "
                  "`replay_cooldown` is an option to try with its measured costs, not a recommendation")  # fmt: skip
    elif below:
        advice = (f"the reuse limit is below GRPO at equal updates in {', '.join(below)} and is not recommended for "
                  "settings like those")  # fmt: skip
    else:
        advice = "the reuse limit was below GRPO in no setting on either axis"
    held = f"; it ended above GRPO only in {'; '.join(above)}" if above else "; it ended above GRPO in no setting"
    out.append(f"**`replay_cooldown`**: {advice}{held}.")
    changed = []
    for key, c in found.items():
        prior = before.get(key)
        if prior and _direction(prior) != _direction(c):
            setting, arm, base, axis = key
            changed.append(f"{arm} - {base} at {setting}, {AXIS_WORDS[axis]}: earlier {_figure(prior)}, now "
                           f"{_figure(c)} ({c['verdict']} with Holm's correction)")  # fmt: skip
    out.append(
        "**Against the earlier study** (seeds 0-4, same settings; a direction is an uncorrected 95% interval "
        "above or below 0): " + ("; ".join(changed) + "." if changed else "no comparison changed direction.")
    )
    return out


def reuse_reading(conc: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """What `exgrpo/replay/reuse` can tell a user, read by a rule fixed before the last runs (exploratory, not a
    registered test): per setting, ExGRPO's reuse (median over seeds of its mean over the run) beside whether ExGRPO
    ended below GRPO (the secondary verdict, Holm, on either axis). A threshold is given only where the settings
    separate: every setting where ExGRPO lost above every setting where it did not; it is then the range between them.
    """
    reuse = {c["setting"]: c["reuse_mean"] for c in conc if c["arm"] == "exgrpo" and c["reuse_mean"] is not None}
    limited = {c["setting"]: c["reuse_mean"] for c in conc if c["arm"] == "reuse_limit" and c["reuse_mean"]}
    lost = {c["setting"] for c in rows if (c["arm"], c["base"]) == ("exgrpo", "grpo") and c.get("verdict") == "below"}
    if not reuse:
        return "ExGRPO's `exgrpo/replay/reuse`: no ExGRPO run has logged it."
    figures = "; ".join(f"{s} {reuse[s]:.2f} ({'below GRPO' if s in lost else 'not below'})" for s in reuse)
    if limited:
        figures += "; with `replay_cooldown: 9`: " + ", ".join(f"{s} {v:.2f}" for s, v in limited.items())
    lo = [reuse[s] for s in reuse if s in lost]
    hi = [reuse[s] for s in reuse if s not in lost]
    uncorrected = [f"{c['setting']} at {AXIS_WORDS[c['axis']]} ({_figure(c)})" for c in rows
                   if (c["arm"], c["base"]) == ("exgrpo", "grpo") and c["axis"] in AXIS_WORDS
                   and c.get("ci95") and _direction(c) < 0]  # fmt: skip
    if not lo:
        verdict = ("no setting's ExGRPO - GRPO was resolved below 0 after Holm's correction, so no value of it "
                   "marks a resolved loss")  # fmt: skip
        if uncorrected:
            verdict += f"; uncorrected, the 95% interval lies below 0 in {'; '.join(uncorrected)}"
    elif not hi:
        verdict = "ExGRPO was below GRPO in every setting, so it does not tell the settings apart"
    elif min(lo) > max(hi):
        verdict = (f"ExGRPO was below GRPO where its reuse averaged {min(lo):.2f} or more and not where it averaged "
                   f"{max(hi):.2f} or less, so a threshold lies between the two ({len(reuse)} settings, 5 seeds "
                   "each; exploratory)")  # fmt: skip
    else:
        verdict = (f"it does not separate the settings where ExGRPO was below GRPO (reuse {min(lo):.2f} to "
                   f"{max(lo):.2f}) from the others ({min(hi):.2f} to {max(hi):.2f}): no threshold is read from "
                   "these runs")  # fmt: skip
    return (
        f"ExGRPO's `exgrpo/replay/reuse`, median over seeds of its mean over the run: {figures}. Reading: {verdict}."
    )


def analyse(results: str | Path) -> tuple[dict[str, Any], str]:
    """The registered analysis of the runs saved in `results`; writes analysis.json and analysis.md there."""
    results = Path(results)
    runs = load_runs(results)
    rows = comparisons(runs)
    conc = concentration(runs)
    done = {(r["task"], r["arm"], r["seed"]) for r in runs}
    missing = [f"{t}/{a}/seed{s}" for t, a, s in registered_order() if (t, a, s) not in done]
    commits = saved_commits(results)
    earlier = earlier_comparisons(results.parent / "study") if (results.parent / "study").is_dir() else []
    bullets = answer(rows, earlier) if not missing else []
    payload = {"comparisons": rows, "concentration": conc, "finals": finals(runs), "missing": missing,
               "commits": {c: len(v) for c, v in commits.items()}, "answer": bullets}  # fmt: skip
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
        "## The registered answer",
        "",
        "\n".join(f"- {b}" for b in bullets) or f"Written when all {len(registered_order())} runs are in.",
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
    if not missing:
        payload["reuse_reading"] = reuse_reading(conc, rows)
        lines += ["", payload["reuse_reading"]]
    text = "\n".join(lines) + "\n"
    (results / "analysis.json").write_text(json.dumps(payload, indent=1) + "\n")
    (results / "analysis.md").write_text(text)
    return payload, text
