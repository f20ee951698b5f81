"""The registered comparison of replay rules (benchmarks/results/policies/plan.md): the arms' age limit in generation
batches, the registered order, and the analysis's figures and words (derived by hand in the comments)."""

import dataclasses
import json

import pytest

from lab import study
from lab.study import policies
from lab.study.tasks import ARMS, MAX_AGE_UPDATES, TASKS, arm_settings
from lab.tests.records import arm_records


def test_the_age_limit_in_updates_becomes_generation_batches():
    # tau_max = 10 updates; addition takes 1 update per generation batch, the paper's shape 2: a trajectory replayed
    # a batches after it was collected has seen a (resp. 2a) updates, so the limit is 10 (resp. 5) batches
    addition, hard = TASKS["addition"], TASKS["countdown-hard"]
    assert (addition.steps_per_generation, hard.steps_per_generation) == (1, 2)
    recipe = arm_settings(addition, ARMS["rollout_recipe"])
    assert recipe == {"max_trajectory_candidates": None, "replay_max_age": 10, "replay_priority": "advantage"}
    assert arm_settings(hard, ARMS["rollout_recipe"]) == {
        "replay_start_pass_rate": 0.0, "max_trajectory_candidates": None, "replay_max_age": 5,
        "replay_priority": "advantage"}  # fmt: skip
    assert arm_settings(hard, ARMS["age_limit"])["replay_max_age"] == 5
    assert "replay_max_age" not in arm_settings(hard, ARMS["advantage_priority"])
    assert arm_settings(hard, ARMS["grpo"]) == {"replay_start_pass_rate": 0.0}  # the task's own, nothing of the arm
    assert MAX_AGE_UPDATES not in arm_settings(hard, ARMS["age_limit"])  # not a config field
    # 10 updates are not a whole number of generation batches of 3 updates: refused, naming both
    odd = dataclasses.replace(hard, steps_per_generation=3)
    with pytest.raises(ValueError, match=r"max_age_updates 10 is not a whole number of generation batches of "
                                         r"countdown-hard \(3 updates each\)"):  # fmt: skip
        arm_settings(odd, ARMS["rollout_recipe"])


def test_registered_order():
    order = policies.registered_order()
    assert len(order) == 3 * 5 * 2 + 3 * 3 == 39 and len(set(order)) == 39
    # the pairs first, setting by setting, each seed's pair together
    assert order[:4] == [("addition", "grpo", 28), ("addition", "rollout_recipe", 28), ("addition", "grpo", 29),
                         ("addition", "rollout_recipe", 29)]  # fmt: skip
    assert [t for t, _, _ in order[:30:10]] == list(policies.SETTINGS)
    assert order[30:33] == [("countdown-hard", a, 28) for a in ("exgrpo", "age_limit", "advantage_priority")]
    assert not {s for _, _, s in order} & set(range(28))  # fresh seeds: 0-24 the studies, 25-27 the replication
    assert {a for _, a, _ in order} == set(policies.ARMS) and set(policies.ARMS) <= set(ARMS)


def _save(root, records):
    for r in records:
        path = root / r["task"] / r["arm"] / f"seed{r['seed']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))


def test_analysis_by_hand(tmp_path):
    hard = "countdown-hard"
    grpo = [0.30, 0.31, 0.32, 0.33, 0.34]
    recipe = [0.31, 0.33, 0.35, 0.37, 0.39]  # + 0.01 ... 0.05 at equal updates
    exgrpo = [0.30, 0.30, 0.30]
    age = [0.32, 0.29, 0.33]  # + 0.02, - 0.01, + 0.03 against ExGRPO
    batches = {"rollout_recipe": [{"age": {"mean": 2.0, "max": 4}, "replayed_groups": 8, "reuse": 1.0},
                                  {"age": None, "replayed_groups": 0, "reuse": None},
                                  {"age": {"mean": 4.0, "max": 10}, "replayed_groups": 4, "reuse": 3.0}]}  # fmt: skip
    records = arm_records(hard, {"grpo": grpo, "rollout_recipe": recipe}, policies.SEEDS, batches)
    records += arm_records(hard, {"exgrpo": exgrpo, "age_limit": age}, policies.SECONDARY_SEEDS)
    _save(tmp_path, records)
    payload, text = policies.analyse(tmp_path)
    rows = {(c["arm"], c["base"], c["axis"]): c for c in payload["comparisons"] if c["setting"] == hard}

    updates = rows[("rollout_recipe", "grpo", "final_updates")]
    # mean 0.03, sd 0.0158114, t = 4.24264 at 4 df: two-sided p 0.013236; non-inferior by 0.01: t = 5.65685,
    # one-sided p 0.002407 (test_confirm derives both)
    assert updates["mean"] == pytest.approx(0.03) and updates["p_t"] == pytest.approx(0.013236, abs=1e-6)
    assert updates["p_noninferior"] == pytest.approx(0.002407, abs=1e-6) and updates["family"] == "primary"
    # 2 primary members hold data (this one setting): Holm doubles the smaller p
    other = rows[("rollout_recipe", "grpo", "final_rollouts")]
    assert updates["p_t_holm"] == pytest.approx(max(2 * min(updates["p_t"], other["p_t"]), updates["p_t"]))
    assert updates["verdict"] == "above"
    # age_limit - exgrpo at 3 seeds: 0.02, -0.01, 0.03: mean 0.013333, deviations 0.006667, -0.023333, 0.016667,
    # sum of squares 8.6667e-4, sd sqrt(4.3333e-4) = 0.020817, se 0.012019, t = 1.10940; at 2 df
    # P(|T| <= t) = t / sqrt(2 + t^2) = 1.10940 / 1.79744 = 0.61721: p = 0.38279; the 8 sign patterns of (0.02,
    # 0.01, 0.03) reach |sum| >= 0.04 in 4: sign-flip p 0.5
    secondary = rows[("age_limit", "exgrpo", "final_updates")]
    assert secondary["mean"] == pytest.approx(0.013333, abs=1e-6) and secondary["n"] == 3
    assert secondary["p_t"] == pytest.approx(0.38279, abs=1e-5) and secondary["p_sign_flip"] == 0.5
    assert secondary["family"] == "secondary" and secondary["verdict"] == "not resolved"
    assert "p_noninferior" not in secondary
    # the recipe against ExGRPO: descriptive, on the 3 seeds both ran (0.01, 0.03, 0.05 at equal updates)
    descriptive = rows[("rollout_recipe", "exgrpo", "final_updates")]
    assert descriptive["family"] == "descriptive" and descriptive["n"] == 3 and "verdict" not in descriptive
    assert descriptive["mean"] == pytest.approx(0.03)
    # what was replayed: mean of the batch means with an age (2, 4 -> 3), the largest (10), replayed groups per
    # batch (8, 0, 4 -> 4), reuse (1, 3 -> 2); every seed the same, so the medians too
    profile = {(p["setting"], p["arm"]): p for p in payload["replay_profile"]}
    p = profile[(hard, "rollout_recipe")]
    assert (p["age_mean"], p["age_max"], p["replayed_groups"], p["reuse_mean"], p["seeds"]) == (3.0, 10, 4.0, 2.0, 5)
    assert "| countdown-hard | rollout_recipe | 5 | 3.00 / 10 | 4.0 | 2.00 |" in text
    assert len(payload["missing"]) == 39 - 16 and "Runs in: 16 of 39" in text and payload["answer"] == []
    assert payload["complete_families"] == [] and "Written when the 30 primary runs are in." in text
    assert "- Written later: the primary's, when its 30 runs are in.\n- Written later: the secondary's, when its 9 " \
        "runs are in." in text  # fmt: skip
    # for a user: GRPO's median final 0.32; at equal rollouts GRPO is read at 950 of 1000 rollouts, 0.2 + 0.95 (g -
    # 0.2): the differences are 0.01 + 0.005, 0.02 + 0.0055, ... (mean 0.036, sd 0.0166, half-width 0.0206)
    assert "| 0.320 | +0.036 [+0.015, +0.057], above / +0.030 [+0.010, +0.050], above (5 seeds) |" in text
    assert (tmp_path / "analysis.md").read_text() == text


def test_the_registered_answer_in_the_plans_words():
    """Each outcome is written as plan.md's "What will be written for each outcome" says: the recipe below GRPO at
    addition, level at the paper's shape, above at the hard point; a replay rule that does not lose only where it was
    level or above; each rule alone against ExGRPO."""
    grpo = [0.30, 0.31, 0.32, 0.33, 0.34]
    below = [g - 0.10 - 0.001 * i for i, g in enumerate(grpo)]
    runs = arm_records("addition", {"grpo": grpo, "rollout_recipe": below}, policies.SEEDS)
    # level at equal updates: mean 0, sd 0.0016, so t = 0 (no difference) and a loss of 0.01 is ruled out (t = 0.01 /
    # (0.0016 / sqrt 5) = 14); at equal rollouts GRPO is read at 950 of its 1000 rollouts, + 0.05 (g - 0.2) each
    level = [0.002, -0.001, 0.0, 0.001, -0.002]
    runs += arm_records("countdown-paper-lr2.5e-5", {"grpo": grpo, "rollout_recipe": [g + d for g, d in
                                                                                    zip(grpo, level)]},
                     policies.SEEDS)  # fmt: skip
    runs += arm_records("countdown-hard", {"grpo": grpo, "rollout_recipe": [g + 0.05 for g in grpo]}, policies.SEEDS)
    secondary = {"exgrpo": [0.3, 0.3, 0.3], "age_limit": [0.32, 0.29, 0.33], "advantage_priority": [0.2, 0.21, 0.19]}
    runs += arm_records("countdown-hard", secondary, policies.SECONDARY_SEEDS)
    bullets = policies.answer(policies.comparisons(runs))
    assert bullets[0].startswith("**addition**: ExGRPO with the age limit and advantage priority ended below GRPO at "
                                 "both equal generated rollouts")  # fmt: skip
    assert "was level with GRPO (not worse by 0.01 or more) at equal updates" in bullets[1]
    assert bullets[2].startswith(
        "**countdown-hard**: ExGRPO with the age limit and advantage priority ended above GRPO"
    )
    assert bullets[3].startswith("**A replay rule that does not lose**: only in ") and "addition" not in bullets[3]
    # at the paper's shape level at equal updates and, at equal rollouts, + 0.005 + 0.0005 i more (0.007, 0.0045,
    # 0.006, 0.0075, 0.005: mean 0.006, sd 0.00127, half-width 0.00158, above 0); above at countdown-hard on both axes
    assert "ended above GRPO at equal generated rollouts (+0.006 [+0.004, +0.008]" in bullets[1]
    assert bullets[3] == (
        "**A replay rule that does not lose**: only in countdown-paper-lr2.5e-5 on both axes; countdown-hard on both "
        "axes; elsewhere the recipe was below GRPO or not told apart from it."
    )
    assert bullets[4].startswith("**Each rule alone** at countdown-hard (exploratory, 3 seeds): the age limit alone "
                                 "against ExGRPO: not told apart")  # fmt: skip
    assert "; advantage priority alone against ExGRPO: below at both equal generated rollouts (-0.100" in bullets[4]
    # each family's answer alone: the primary's four bullets without the secondary's, the secondary's one alone
    assert policies.answer(policies.comparisons(runs), ("primary",)) == bullets[:4]
    assert policies.answer(policies.comparisons(runs), ("secondary",)) == bullets[4:]


def test_families_are_answered_as_their_runs_land(tmp_path):
    """The primary's answer and the README's row are written once the 30 primary runs are in, before the secondary's
    9; the row has a column a setting: the recipe - GRPO at equal rollouts / equal updates with its Holm verdict."""
    grpo = [0.30, 0.31, 0.32, 0.33, 0.34]
    below = [g - 0.10 - 0.001 * i for i, g in enumerate(grpo)]
    runs = []
    for setting in policies.SETTINGS:
        runs += arm_records(setting, {"grpo": grpo, "rollout_recipe": below}, policies.SEEDS)
    _save(tmp_path, runs)
    payload, text = policies.analyse(tmp_path)
    assert payload["complete_families"] == ["primary"] and len(payload["missing"]) == 9
    assert len(payload["answer"]) == 4 and payload["answer"][3].startswith("**A replay rule that does not lose**: "
                                                                           "not found here")  # fmt: skip
    assert "- Written later: the secondary's, when its 9 runs are in." in text
    # at equal updates the differences are -0.100, -0.101, ..., -0.104: mean -0.102, sd 0.0015811, half-width
    # 2.776445 x 0.0015811 / sqrt 5 = 0.001963: [-0.104, -0.100]; at equal rollouts GRPO is read at 950 of its 1000
    # rollouts (0.2 + 0.95 (g - 0.2)): each difference 0.05 (g - 0.2) = 0.005 + 0.0005 i less negative, so -0.095,
    # -0.0955, ..., -0.097: mean -0.096, sd 0.0005 x 1.5811 = 0.0007906, half-width 0.000982: [-0.097, -0.095]
    row = (
        "| same rollouts / same updates (5 seeds) | "
        + " | ".join(["-0.096 [-0.097, -0.095], below / -0.102 [-0.104, -0.100], below"] * 3)
        + " |"
    )
    assert text.split("## For the README: one row\n\n")[1].split("\n\n")[0].splitlines() == [
        "| ExGRPO with an age limit and advantage priority - GRPO | sums | the paper's shape | weaker model |",
        "|---|---|---|---|",
        row,
    ]


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--policies", "--quick"],
            "lab.study: --policies runs the registered settings as they are: no --quick or --set\n",
        ),  # fmt: skip
        (["--policies", "--confirm"], "lab.study: --confirm and --policies are two registered studies: give one\n"),
    ],
)
def test_policies_refusals(tmp_path, capsys, argv, line):
    assert study.main([*argv, "--results", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == line and not (tmp_path / "r").exists()


@pytest.mark.parametrize("compare", [True, False])
def test_the_policies_report_prints_no_unregistered_exgrpo_minus_grpo(tmp_path, compare):
    """The usual report beside a registered study: exgrpo - grpo at countdown-hard is registered in confirm's plan
    (compare=True, its table and figures) but not in policies' (compare=False: no such table, no sweep or difficulty
    figure), though both hold exgrpo and grpo runs there; the per-arm diagnostics stay in both."""
    runs = arm_records("countdown-hard", {"grpo": [0.40, 0.42], "exgrpo": [0.43, 0.41]}, [1, 2])
    for record in runs:
        record.update(steps={"fresh_questions": [64, 32], "replayed": [0, 32], "buffer_questions": [10, 40]},
                      replay_counts={"histogram": {"1": 32}})  # fmt: skip
    text = study.sweep_report(runs, tmp_path, compare)
    assert ("ExGRPO minus GRPO" in text) is compare
    assert (tmp_path / "difficulty.png").exists() is compare and (tmp_path / "sweep.png").exists() is compare
    assert bool(json.loads((tmp_path / "sweep.json").read_text())["difficulty"]) is compare
    assert "### Regimes: the paper's run beside each setting" in text
