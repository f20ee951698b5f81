"""The study across regimes (issue 24) at a tiny size: the paper-shaped Countdown settings, a tiny run of one with
two optimizer updates per generation batch, the whole-pool splits, and the sweep's report and figure on hand-made
runs whose figures are derived by hand."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from exgrpo_trl.cli import regimes, study


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
    from exgrpo_trl.tasks.countdown import countdown_pool_splits, is_held_out

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


def _record(task, arm, seed, eval_steps, rollouts, curve, lr=1e-4, **extra):
    return {
        "task": task, "arm": arm, "seed": seed,
        "settings": {"task": {"learning_rate": lr, "prompts_per_step": 64, "steps_per_generation": 2,
                              "steps": eval_steps[-1], "train_questions": 1000}},
        "curve": {"step": eval_steps, "rollouts": rollouts, "pass_at_1": curve},
        "final": {"pass_at_1": curve[-1], "rollouts": rollouts[-1], **extra.pop("final", {})},
        **extra,
    }  # fmt: skip


def test_auc_and_last_quarter_by_hand():
    r = _record("t", "grpo", 0, [0, 50, 100], [0, 100, 200], [0.2, 0.4, 0.4])
    # trapezoids: 100 x (0.2 + 0.4) / 2 = 30, then 100 x 0.4 = 40; over 200 rollouts: 70 / 200
    assert regimes.auc(r, 200) == pytest.approx(0.35)
    # cut at 150: 30 + 50 x 0.4 = 50 over 150
    assert regimes.auc(r, 150) == pytest.approx(50 / 150)
    r = _record("t", "grpo", 0, [0, 25, 50, 75, 100], [0, 1, 2, 3, 4], [0.2, 0.3, 0.35, 0.38, 0.40])
    assert regimes.last_quarter_gain(r) == pytest.approx(0.02)  # 0.40 at step 100 minus 0.38 at step 75


def test_sweep_pairs_seeds_and_orders_points_by_step_size():
    fam = "fam"
    x = [0, 1000, 2000]
    runs = [
        # lr 1e-4: GRPO 0.40 / 0.42, ExGRPO 0.45 / 0.41 -> paired differences +0.05, -0.01
        _record(f"{fam}-a", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.40]),
        _record(f"{fam}-a", "grpo", 1, [0, 1, 2], x, [0.2, 0.3, 0.42]),
        _record(f"{fam}-a", "exgrpo", 0, [0, 1, 2], [0, 900, 1800], [0.2, 0.3, 0.45]),
        _record(f"{fam}-a", "exgrpo", 1, [0, 1, 2], [0, 900, 1800], [0.2, 0.3, 0.41]),
        # lr 4e-4 (a larger step): one seed each, ExGRPO 0.03 lower
        _record(f"{fam}-b", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.40], lr=4e-4),
        _record(f"{fam}-b", "exgrpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.37], lr=4e-4),
        _record("other", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.5]),
    ]
    points = regimes.sweep(runs, fam)
    assert [p["task"] for p in points] == [f"{fam}-b", f"{fam}-a"]  # largest step first
    b, a = points
    assert b["step_size"] == pytest.approx(4e-4 / 64) and a["step_size"] == pytest.approx(1e-4 / 64)
    assert a["final_difference"] == pytest.approx({"median": 0.02, "min": -0.01, "max": 0.05, "seeds": 2})
    assert b["final_difference"]["median"] == pytest.approx(-0.03)
    # AUC over the first 1800 rollouts (ExGRPO's runs end there). GRPO seed 0: 1000 x 0.25 = 250, then 800 x
    # (0.3 + (0.3 + 0.1 x 0.8)) / 2 = 272 -> 522 / 1800; ExGRPO seed 0: 900 x 0.25 = 225, 900 x 0.375 = 337.5 ->
    # 562.5 / 1800; difference 40.5 / 1800 = 0.0225. Seed 1: GRPO 250 + 800 x (0.3 + 0.396) / 2 = 528.4;
    # ExGRPO 225 + 900 x 0.355 = 544.5; difference 16.1 / 1800.
    assert a["auc_budget"] == 1800
    assert a["auc_difference"]["max"] == pytest.approx(40.5 / 1800)
    assert a["auc_difference"]["min"] == pytest.approx(16.1 / 1800)
    table = regimes.sweep_markdown(points, [])
    assert (
        f"| {fam}-a | 1.6e-6 | 0.0001 | 2 | 0.410 [0.400, 0.420] | 0.430 [0.410, 0.450] | +0.020 [-0.010, +0.050] |"
        in (table)
    )


def test_regime_stats_by_hand():
    steps = {
        "fresh_questions": [100, 0, 60, 0],  # 160 fresh draws over a pool of 1000: 0.16 visits a question
        "replayed": [0, 0, 40, 0],
        "buffer_questions": [0, 0, 200, 200],  # one generation batch replayed 40 of a buffer of 200: 0.2
    }
    ex = _record("t", "exgrpo", 0, [0, 4], [0, 1], [0.2, 0.3], steps=steps,
                 replay_counts={"histogram": {"1": 2, "3": 1}})  # fmt: skip
    grpo = _record("t", "grpo", 0, [0, 2, 3, 4], [0, 1, 2, 3], [0.2, 0.25, 0.28, 0.3],
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


def test_sweep_figure_is_written(tmp_path):
    point = {"task": "p", "step_size": 1e-6, "final_difference": {"median": 0.01, "min": -0.01, "max": 0.02},
             "auc_difference": {"median": 0.0, "min": -0.01, "max": 0.01}}  # fmt: skip
    old = {**point, "task": "old", "step_size": 3e-6}
    regimes.sweep_figure([point], [old], tmp_path / "s.png", noise=0.004)
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Counter(p.suffix for p in tmp_path.iterdir()) == {".png": 1}
