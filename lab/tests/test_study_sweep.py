"""The study across regimes at a tiny size: the paper-shaped Countdown settings, a tiny run of one with
two optimizer updates per generation batch, the whole-pool splits, and the sweep's report and figure on hand-made
runs whose figures are derived by hand."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lab import study
from lab.study import regimes
from lab.tests.records import make_record


def test_sweep_settings_are_the_paper_shape_at_several_step_sizes():
    points = {name: t for name, t in study.TASKS.items() if name.startswith(study.SWEEP_FAMILY)}
    assert len(points) >= 3
    for task in points.values():
        # 128 questions per generation batch in two updates of 64, as the paper's 128 in two mini-batches of 64
        assert (task.prompts_per_step, task.steps_per_generation, task.generation_questions) == (64, 2, 128)
        assert task.exgrpo == {"replay_start_pass_rate": 0.35}  # the paper's delayed start
        assert task.train_questions == 16000 and task.step_size == task.learning_rate / 64
    sizes = sorted(t.step_size for t in points.values())
    assert sizes[-1] == pytest.approx(study.TASKS["countdown-medium"].step_size)  # from the old settings' 3.1e-6
    assert sizes[0] <= sizes[-1] / 8  # down by at least a factor 8


def test_pool_splits_have_the_same_mix_and_are_cached(tmp_path):
    from lab.countdown import countdown_pool_splits, is_held_out

    train, eval_ = countdown_pool_splits(1600, 100, cache_dir=tmp_path)
    assert len(train) == 1600 and len(eval_) == 100 and len(set(train["prompt"])) == 1600
    assert not any(map(is_held_out, train["prompt"])) and all(map(is_held_out, eval_["prompt"]))
    cached = tmp_path / "countdown-pool-1600-100-seed0"
    assert (cached / "train.jsonl").is_file() and (cached / "eval.jsonl").is_file()
    again_train, again_eval = countdown_pool_splits(1600, 100, cache_dir=tmp_path)
    assert again_train["prompt"] == train["prompt"] and again_eval["prompt"] == eval_["prompt"]
    assert again_train["numbers"][0] == train["numbers"][0]  # lists survive the JSON round trip
    with pytest.raises(ValueError, match="at most 16000 train"):
        countdown_pool_splits(20000, 10)


def test_tiny_sweep_run_counts_one_generation_batch_per_two_updates(tmp_path, capsys):
    results, cache = tmp_path / "results", tmp_path / "cache"
    task = f"{study.SWEEP_FAMILY}-lr1e-4"
    argv = ["--quick", "--tasks", task, "--arms", "grpo", "--seeds", "0", "--results", str(results),
            "--cache-dir", str(cache), "--no-progress"]  # fmt: skip
    assert study.main(argv) == 0
    capsys.readouterr()
    record = json.loads((results / task / "grpo" / "seed0.json").read_text())
    # quick: 8 questions per update, 2 updates per generation batch, 2 steps: one generation batch of 16 x 8
    # rollouts, generated at step 1 and trained on at steps 1 and 2
    assert record["curve"]["step"] == [0, 1, 2] and record["curve"]["rollouts"] == [0, 128, 128]
    assert record["steps"]["fresh_questions"] == [16, 0] and record["steps"]["rollouts"] == [128, 128]
    q = record["questions"]
    assert (q["pool"], q["seen"], q["fresh_visits"]) == (64, 16, 16) and 0 <= q["never_solved"] <= 16
    assert len(record["final"]["pass_at_1_resampled"]) == 2  # QUICK_SWEEP: the final model evaluated twice
    assert record["settings"]["config"]["steps_per_generation"] == 2
    sweep = json.loads((results / "sweep.json").read_text())
    assert sweep["regimes"][task]["questions_per_generation"] == 16
    assert (results / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auc_and_last_quarter_by_hand():
    r = make_record("t", "grpo", 0, [0, 50, 100], [0, 100, 200], [0.2, 0.4, 0.4])
    # trapezoids: 100 x (0.2 + 0.4) / 2 = 30, then 100 x 0.4 = 40; over 200 rollouts: 70 / 200
    assert regimes.auc(r, 200) == pytest.approx(0.35)
    # cut at 150: 30 + 50 x 0.4 = 50 over 150
    assert regimes.auc(r, 150) == pytest.approx(50 / 150)
    r = make_record("t", "grpo", 0, [0, 25, 50, 75, 100], [0, 1, 2, 3, 4], [0.2, 0.3, 0.35, 0.38, 0.40])
    assert regimes.last_quarter_gain(r) == pytest.approx(0.02)  # 0.40 at step 100 minus 0.38 at step 75


def test_sweep_pairs_seeds_and_orders_points_by_step_size():
    fam = "fam"
    x = [0, 1000, 2000]
    runs = [
        # lr 1e-4: GRPO 0.40 / 0.42, ExGRPO 0.45 / 0.41 -> paired differences +0.05, -0.01
        make_record(f"{fam}-a", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.40]),
        make_record(f"{fam}-a", "grpo", 1, [0, 1, 2], x, [0.2, 0.3, 0.42]),
        make_record(f"{fam}-a", "exgrpo", 0, [0, 1, 2], [0, 900, 1800], [0.2, 0.3, 0.45]),
        make_record(f"{fam}-a", "exgrpo", 1, [0, 1, 2], [0, 900, 1800], [0.2, 0.3, 0.41]),
        # lr 4e-4 (a larger step): one seed each, ExGRPO 0.03 lower
        make_record(f"{fam}-b", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.40], lr=4e-4),
        make_record(f"{fam}-b", "exgrpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.37], lr=4e-4),
        make_record("other", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.5]),
    ]
    points = regimes.sweep(runs, fam)
    assert [p["task"] for p in points] == [f"{fam}-b", f"{fam}-a"]  # largest step first
    b, a = points
    assert b["step_size"] == pytest.approx(4e-4 / 64) and a["step_size"] == pytest.approx(1e-4 / 64)
    # two seeds, -0.01 and +0.05: mean 0.02, sd 0.042426, t(0.975, 1) = 12.706: half 12.706 x 0.042426 / sqrt(2)
    # = 0.38118 -> [-0.36118, 0.40118]
    final = dict(a["final_updates"])
    lo, hi = final.pop("ci95")
    assert (lo, hi) == (pytest.approx(-0.36118, abs=1e-5), pytest.approx(0.40118, abs=1e-5))
    assert final == pytest.approx({"median": 0.02, "min": -0.01, "max": 0.05, "seeds": 2, "mean": 0.02,
                                   "sd": 0.0424264})  # fmt: skip
    assert b["final_updates"]["median"] == pytest.approx(-0.03)
    # at equal rollouts: ExGRPO's 1800 against GRPO's curve there, 0.3 + 0.1 x 800 / 1000 = 0.38 (seed 0) and
    # 0.3 + 0.12 x 0.8 = 0.396 (seed 1): +0.07 and +0.014
    assert {k: a["final_rollouts"][k] for k in ("median", "min", "max", "seeds", "mean")} == pytest.approx(
        {"median": 0.042, "min": 0.014, "max": 0.07, "seeds": 2, "mean": 0.042}
    )
    # at equal updates (2 each), AUC over steps: GRPO seed 0 (0.25 + 0.35) / 2 = 0.30, ExGRPO (0.25 + 0.375) / 2
    assert a["auc_updates"]["max"] == pytest.approx(0.3125 - 0.30)
    # AUC over the first 1800 rollouts (ExGRPO's runs end there). GRPO seed 0: 1000 x 0.25 = 250, then 800 x
    # (0.3 + (0.3 + 0.1 x 0.8)) / 2 = 272 -> 522 / 1800; ExGRPO seed 0: 900 x 0.25 = 225, 900 x 0.375 = 337.5 ->
    # 562.5 / 1800; difference 40.5 / 1800 = 0.0225. Seed 1: GRPO 250 + 800 x (0.3 + 0.396) / 2 = 528.4;
    # ExGRPO 225 + 900 x 0.355 = 544.5; difference 16.1 / 1800.
    assert a["auc_budget"] == 1800
    assert a["auc_rollouts"]["max"] == pytest.approx(40.5 / 1800)
    assert a["auc_rollouts"]["min"] == pytest.approx(16.1 / 1800)
    table = regimes.sweep_markdown(points, [])
    assert "| ExGRPO - GRPO final, equal updates | ExGRPO - GRPO final, equal rollouts |" in table
    assert (
        # equal rollouts: +0.07 and +0.014, mean 0.042, sd 0.039598, half 12.706 x 0.039598 / sqrt(2) = 0.35577
        f"| {fam}-a | 1.6e-6 | 0.0001 | 2 | 0.410 [0.400, 0.420] | 0.430 [0.410, 0.450] | +0.020 (sd 0.042) "
        "[-0.361, +0.401] | +0.042 (sd 0.040) [-0.314, +0.398] |" in table
    )


def test_regime_stats_by_hand():
    steps = {
        "fresh_questions": [100, 0, 60, 0],  # 160 fresh draws over a pool of 1000: 0.16 visits a question
        "replayed": [0, 0, 40, 0],
        "buffer_questions": [0, 0, 200, 200],  # one generation batch replayed 40 of a buffer of 200: 0.2
    }
    ex = make_record("t", "exgrpo", 0, [0, 4], [0, 1], [0.2, 0.3], steps=steps,
                 replay_counts={"histogram": {"1": 2, "3": 1}})  # fmt: skip
    grpo = make_record("t", "grpo", 0, [0, 2, 3, 4], [0, 1, 2, 3], [0.2, 0.25, 0.28, 0.3],
                   questions={"seen": 800, "never_solved": 200}, steps=steps)  # fmt: skip
    s = regimes.regime_stats([ex, grpo])
    assert s["fresh_visits_per_question"] == pytest.approx(0.16)
    assert s["never_solved"] == pytest.approx(0.25)
    # replays per replayed question: counts 1, 1, 3 -> mean 5/3, median 1, max 3
    assert s["replays_per_question"] == {"mean": pytest.approx(5 / 3), "median": 1, "max": 3}
    assert s["replay_demand_over_buffer"] == pytest.approx(0.2)
    assert s["grpo_last_quarter_gain"] == pytest.approx(0.3 - 0.28)  # end (step 4) minus step 3 (nearest to 3)
    assert s["step_size"] == pytest.approx(1e-4 / 64) and s["questions_per_generation"] == 128
    table = regimes.regime_markdown({"t": s})
    assert (
        "| replays per replayed question, mean / median / max | about 4 / 2-3 / 45-68 (estimated) | 1.7 / 1 / 3 |"
        in (table)
    )


def test_estimate_noise_pools_the_resampled_evaluations():
    # two runs: [0.40, 0.42] (variance 0.0002) and [0.30, 0.30, 0.33] (variance 0.0003); pooled over 1 + 2
    # degrees of freedom: (0.0002 + 2 x 0.0003) / 3
    runs = [{"final": {"pass_at_1_resampled": [0.40, 0.42]}}, {"final": {"pass_at_1_resampled": [0.30, 0.30, 0.33]}}]
    noise = regimes.estimate_noise(runs)
    assert noise["std"] == pytest.approx(((0.0002 + 2 * 0.0003) / 3) ** 0.5)
    assert noise["runs"] == 2 and noise["evaluations_per_run"] == 3
    assert regimes.estimate_noise([{"final": {}}]) is None


def test_sweep_and_difficulty_figures_are_written(tmp_path):
    band = regimes._band([-0.01, 0.01, 0.02])
    point = {"task": "p", "step_size": 1e-6, "never_solved": 0.2, **{key: band for key, _, _ in regimes.COMPARISONS}}
    old = {**point, "task": "old", "step_size": 3e-6}
    regimes.sweep_figure([point], [old], tmp_path / "s.png", noise=0.004)
    regimes.difficulty_figure([point, {**point, "task": "hard", "never_solved": 0.5}], tmp_path / "d.png", 0.004)
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Counter(p.suffix for p in tmp_path.iterdir()) == {".png": 2}


def test_final_is_the_mean_of_the_saved_evaluations_and_curves_are_read_between_them():
    r = make_record("t", "grpo", 0, [0, 50, 100], [0, 100, 200], [0.2, 0.4, 0.40], final={"pass_at_1_resampled":
                    [0.40, 0.42, 0.41, 0.41]})  # fmt: skip
    assert regimes.final_mean(r) == pytest.approx(0.41)  # (0.40 + 0.42 + 0.41 + 0.41) / 4
    # at 150 rollouts: halfway from 0.4 (at 100) to the final model's 0.41 (at 200)
    assert regimes.curve_at(r, 150) == pytest.approx(0.405)
    assert regimes.curve_at(r, 50) == pytest.approx(0.3) and regimes.curve_at(r, 500) == pytest.approx(0.41)
    fewer = make_record("t", "exgrpo", 0, [0, 50, 100], [0, 90, 150], [0.2, 0.3, 0.43])
    # ExGRPO ends at 150 rollouts: 0.43 against GRPO's 0.405 there; the other way round the result is the same
    assert regimes.equal_rollouts_difference(fewer, r) == pytest.approx(0.025)
    assert regimes.equal_rollouts_difference(r, fewer) == pytest.approx(-0.025)


def test_difficulty_orders_settings_by_never_solved_and_pairs_arms():
    def runs(task, never, ex_final):
        solved = {"questions": {"seen": 100, "never_solved": never}}
        return [
            make_record(task, "grpo", 0, [0, 1, 2], [0, 100, 200], [0.1, 0.2, 0.3], **solved),
            make_record(task, "exgrpo", 0, [0, 1, 2], [0, 100, 190], [0.1, 0.2, ex_final]),
            make_record(task, "revisit_no_replay", 0, [0, 1, 2], [0, 100, 200], [0.1, 0.2, 0.25]),
        ]

    points = regimes.difficulty(runs("easy", 20, 0.28) + runs("hard", 50, 0.33), ["hard", "easy"])
    assert [(p["task"], p["never_solved"]) for p in points] == [("easy", 0.2), ("hard", 0.5)]
    assert points[1]["final_updates"]["median"] == pytest.approx(0.03)
    # equal rollouts: GRPO at 190 rollouts, 0.2 + 0.1 x 0.9 = 0.29; 0.33 - 0.29
    assert points[1]["final_rollouts"]["median"] == pytest.approx(0.04)
    pairs = regimes.arm_pairs("hard", runs("hard", 50, 0.33))
    assert [tuple(c["arms"]) for c in pairs] == [("exgrpo", "grpo"), ("revisit_no_replay", "exgrpo"),
                                                 ("revisit_no_replay", "grpo")]  # fmt: skip
    # revisit (200 rollouts) against ExGRPO (190): revisit's curve at 190, 0.2 + 0.05 x 0.9 = 0.245, minus 0.33
    assert pairs[1]["final_rollouts"]["median"] == pytest.approx(-0.085)
    assert "| revisit_no_replay - grpo | -0.050 (1 seed) |" in regimes.arm_pairs_markdown(pairs)
    assert "| hard | 0.50 |" in regimes.difficulty_markdown(points)


def test_batch_diagnostics_by_hand():
    def batch(fresh, fail, full, replayed, r_fail, r_full, weight=None, age=None):
        return {"fresh_groups": fresh, "fresh_all_fail": fail, "fresh_all_pass": full, "replayed_groups": replayed,
                "replayed_all_fail": r_fail, "replayed_all_pass": r_full, "is_weight": weight, "age": age}  # fmt: skip

    w = {"tokens": 10, "mean": 1.0, "p05": 0.5, "p95": 2.0, "below_gamma": 0.1}
    seed0 = make_record("t", "exgrpo", 0, [0, 1], [0, 1], [0.1, 0.2], batches=[
        batch(8, 4, 0, 0, 0, 0),  # nothing replayed yet
        batch(4, 2, 1, 4, 0, 2, w, {"mean": 3.0, "max": 5}),
    ])  # fmt: skip
    d = regimes.batch_diagnostics([seed0])["exgrpo"]
    # fresh: 6 all-fail and 1 all-pass of 12 groups; replayed: 0 and 2 of 4; with a gradient per batch: fresh
    # (12 - 7) / 2 batches = 2.5, replayed (4 - 2) / 2 = 1
    assert d["fresh_all_fail"] == pytest.approx(0.5) and d["fresh_all_pass"] == pytest.approx(1 / 12)
    assert d["replayed_all_fail"] == 0 and d["replayed_all_pass"] == pytest.approx(0.5)
    assert d["fresh_with_gradient"] == pytest.approx(2.5) and d["replayed_with_gradient"] == pytest.approx(1.0)
    assert d["is_weight_p95"] == 2.0 and d["age_mean"] == 3.0 and d["seeds"] == 1
    table = regimes.diagnostics_markdown({"exgrpo": d})
    assert "| fresh groups all-fail (share) | 0.500 |" in table


def test_training_curves_figure_from_one_seed(tmp_path):
    from lab.study.report import _smooth, curves_figure

    # a trailing mean over up to 2 values: 1, (1 + 2) / 2, (2 + 3) / 2, (3 + 4) / 2
    assert _smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    steps = {"batch_pass_at_1": [0.1, None], "fresh_questions": [2, 0], "replayed": [0, 0], "retired": [0, 0]}
    batch = {"step": 1, "fresh_groups": 2, "fresh_all_fail": 1, "buckets": None}
    grpo = make_record("hard", "grpo", 0, [0, 2], [0, 16], [0.1, 0.2], steps=steps, batches=[batch])
    stored = {**batch, "buckets": {"1": 1, "2": 0}}
    exgrpo = make_record("hard", "exgrpo", 0, [0, 2], [0, 16], [0.1, 0.2], steps=steps, batches=[stored])
    curves_figure(grpo, exgrpo, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offline_arms_at_tiny_size_count_offline_rows_as_not_generated(tmp_path, capsys):
    """LUFFY and ExGRPO with offline solutions (the task's `answer` column: one correct expression per Countdown
    question) at the hard point, quick: one generation batch of 16 questions x 8 rows, every question with a solution
    and nothing to replay yet, so each of the 16 groups gets its solution in its first row and 16 x 7 = 112 rows are
    generated (the rollouts axis counts generated rows)."""
    results, cache = tmp_path / "results", tmp_path / "cache"
    argv = ["--quick", "--tasks", study.HARD_POINT, "--arms", "luffy,exgrpo_offline", "--seeds", "0",
            "--results", str(results), "--cache-dir", str(cache), "--no-progress"]  # fmt: skip
    assert study.main(argv) == 0
    capsys.readouterr()
    for arm, replay in (("luffy", 0.0), ("exgrpo_offline", 0.5)):
        record = json.loads((results / study.HARD_POINT / arm / "seed0.json").read_text())
        assert record["settings"]["arm"]["exgrpo"]["offline_solutions_column"] == "answer"
        assert record["settings"]["arm"]["exgrpo"].get("replay_ratio", 0.5) == replay
        assert [b["offline_rows"] for b in record["batches"]] == [16]
        assert record["steps"]["rollouts"] == [112, 112]


def test_t_interval_and_band_by_hand():
    from lab.study import regimes

    # values -0.01, -0.02, -0.03: mean -0.02, sd = sqrt((0.01^2 + 0 + 0.01^2) / 2) = 0.01, t(0.975, 2) = 4.303:
    # half-width 4.303 x 0.01 / sqrt(3) = 0.024843 -> [-0.044843, +0.004843]
    lo, hi = regimes.t_interval([-0.01, -0.02, -0.03])
    assert lo == pytest.approx(-0.044843, abs=1e-6) and hi == pytest.approx(0.004843, abs=1e-6)
    band = regimes._band([-0.01, -0.02, -0.03])
    assert band["mean"] == pytest.approx(-0.02) and band["sd"] == pytest.approx(0.01)
    assert (band["median"], band["min"], band["max"], band["seeds"]) == (-0.02, -0.03, -0.01, 3)
    assert regimes._diff(band) == "-0.020 (sd 0.010) [-0.045, +0.005]"
    # five seeds, t(0.975, 4) = 2.776: values 1..5 have mean 3, sd sqrt(2.5), half 2.776 x sqrt(2.5 / 5) =
    # 2.776 x 0.707107 = 1.962928
    lo, hi = regimes.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (lo, hi) == (pytest.approx(3 - 1.962928, abs=1e-6), pytest.approx(3 + 1.962928, abs=1e-6))
    # one seed: no interval, said so
    assert regimes.t_interval([0.1]) is None and regimes._diff(regimes._band([0.1])) == "+0.100 (1 seed)"
