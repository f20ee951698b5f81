"""The study harness (`python -m lab.study`, benchmarks/study.py) at a tiny size: what a run saves, the table, the
figure, and that a second call finds the saved runs and trains nothing. Plus the report's arithmetic on hand-made
runs."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import study
from lab.study import run as study_run
from lab.study import schedule

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_study_saves_reports_and_resumes(tmp_path, capsys):
    results, cache = tmp_path / "results", tmp_path / "cache"
    argv = ["--quick", "--tasks", "addition", "--arms", "grpo,exgrpo", "--seeds", "0", "--results", str(results),
            "--cache-dir", str(cache), "--no-progress"]  # fmt: skip
    assert study.main(argv) == 0
    first = capsys.readouterr().out
    assert "2 runs to train, 0 found" in first
    runs = {arm: results / "addition" / arm / "seed0.json" for arm in ("grpo", "exgrpo")}
    for arm, path in runs.items():
        record = json.loads(path.read_text())
        assert (record["task"], record["arm"], record["seed"]) == ("addition", arm, 0)
        assert record["settings"]["task"]["steps"] == 2 and record["settings"]["arm"] == study.ARMS[arm].__dict__
        # quick: evaluated at steps 0, 1, 2; 16 questions x 8 rollouts per step, none replayed from the warm start
        assert record["curve"]["step"] == [0, 1, 2]
        assert record["curve"]["rollouts"] == [0, 128, 256] and record["final"]["rollouts"] == 256
        assert set(record["curve"]["by_difficulty"]) == set(record["final"]["by_difficulty"]) >= {"1"}
        assert len(record["steps"]["fresh_questions"]) == 2
        assert record["settings"]["trainer"] == ("GRPOTrainer" if arm == "grpo" else "ExGRPOTrainer")
    summary = json.loads((results / "results.json").read_text())
    assert set(summary["addition"]["arms"]) == {"grpo", "exgrpo"}
    assert "| grpo | 1 |" in (results / "results.md").read_text()
    assert (results / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # each run left its last step for the parent's progress bars
    for arm in runs:
        assert study.progress_path(cache, "addition", arm, 0).read_text() == "2 2\n"
        assert schedule._step(cache, ("addition", arm, 0)) == (2, 2)
    assert schedule._step(cache, ("addition", "grpo", 9)) is None

    # the report covers every saved run, whatever this call's --tasks and --arms
    assert study.main([*argv, "--arms", "grpo", "--report-only"]) == 0
    capsys.readouterr()
    assert "| exgrpo | 1 |" in (results / "results.md").read_text()

    mtimes = {arm: path.stat().st_mtime_ns for arm, path in runs.items()}
    assert study.main(argv) == 0
    assert "0 runs to train, 2 found" in capsys.readouterr().out
    assert {arm: path.stat().st_mtime_ns for arm, path in runs.items()} == mtimes  # nothing retrained


def test_killed_run_resumes_from_its_checkpoint_to_the_same_record(tmp_path):
    # countdown-weak replays from the first update (replay_start_pass_rate 0); after a 150-step warm start part of
    # the quick pool is solved, so the buffer fills and replay runs within 6 updates. Checkpoints land every update
    # (lcm of eval_every 1 and steps_per_generation 1), the newest two kept.
    cache = tmp_path / "cache"
    workdir = cache / "study-trainer" / "countdown-weak-exgrpo-seed0"

    def command(results):
        return [sys.executable, "-m", "lab.study", "--quick", "--set", "steps=6",
                "--set", "warm_start_steps=150", "--cache-dir", str(cache), "--results", str(tmp_path / results),
                "--run-one", "countdown-weak", "exgrpo", "0"]  # fmt: skip

    def saved(results):
        return json.loads((tmp_path / results / "countdown-weak" / "exgrpo" / "seed0.json").read_text())

    subprocess.run(command("straight"), check=True, capture_output=True, cwd=ROOT)
    straight = saved("straight")
    assert sum(straight["steps"]["replayed"]) > 0 and straight["resumed_at"] == []
    assert not workdir.exists()  # a finished run's checkpoints are deleted
    check_batch_records(straight, questions=16, k=8)
    # the over-fitting control: the most replayed questions and never-replayed ones matched to them, and the final
    # model kept; scored with this run's own final model in GRPO's place, the control's GRPO column must equal the
    # run's own final figures (same model, same questions, same sampling seed)
    control = straight["control"]
    assert control["replayed"] and 0 < len(control["matched"]) <= len(control["replayed"])
    assert not set(control["matched"]) & set(control["replayed"])
    kept = study_run.final_model_path(cache, "countdown-weak", "exgrpo", 0)
    assert (kept / "model.safetensors").is_file()
    shutil.copytree(kept, study_run.final_model_path(cache, "countdown-weak", "grpo", 0))
    from lab.study import control as study_control

    tasks = study.build_tasks(True, study.parse_overrides(["steps=6", "warm_start_steps=150"]))
    (row,) = study_control.control_rows(tmp_path / "straight", str(cache), tasks)
    assert (row["arm"], row["seed"], row["grpo_final"]) == ("exgrpo", 0, control["final"])
    assert "| countdown-weak | exgrpo | 0 |" in study_control.control_markdown([row])
    # written, then written again: the saved row is kept, not scored again (a changed figure in control.json stays)
    study_control.write_control(tmp_path / "straight", str(cache), tasks)
    written = json.loads((tmp_path / "straight" / "control.json").read_text())
    assert written["runs"] == [row]
    written["runs"][0]["grpo_final"]["matched"] = 0.123456
    (tmp_path / "straight" / "control.json").write_text(json.dumps(written))
    study_control.write_control(tmp_path / "straight", str(cache), tasks)
    assert json.loads((tmp_path / "straight" / "control.json").read_text())["runs"][0]["grpo_final"]["matched"] == (
        0.123456)  # fmt: skip

    # killed from outside as soon as update 3's checkpoint holds the study's state
    proc = subprocess.Popen(command("killed"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 300
    while not (workdir / "checkpoint-3" / study.STUDY_STATE).exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "killed" / "countdown-weak" / "exgrpo" / "seed0.json").exists()
    with_state = sorted(int(p.parent.name.split("-")[1]) for p in workdir.glob(f"checkpoint-*/{study.STUDY_STATE}"))
    assert len(with_state) >= 2  # save_total_limit 2: the newest two complete checkpoints
    # killed between the trainer's save and the study's: the newest checkpoint without its state is passed over
    (workdir / f"checkpoint-{with_state[-1]}" / study.STUDY_STATE).unlink()

    # a checkpoint of other settings is never resumed from: the folder is cleared and the run starts afresh
    other = tmp_path / "other"
    shutil.copytree(workdir, other)
    assert study_run._resume_point(str(other), {"task": "another"}) == (None, None) and not other.exists()

    subprocess.run(command("killed"), check=True, capture_output=True, cwd=ROOT)
    resumed = saved("killed")
    assert resumed["resumed_at"] == [with_state[-2]]
    for run in (straight, resumed):
        del run["seconds"], run["resumed_at"]
    assert resumed == straight  # curves, per-update logs, replay counts, probes, finals: all equal
    assert not workdir.exists()


def record(arm, seed, rollouts, curve, by_difficulty=None):
    final = curve[-1]
    return {
        "task": "t", "arm": arm, "seed": seed,
        "curve": {"rollouts": rollouts, "pass_at_1": curve},
        "final": {"pass_at_1": final, "rollouts": rollouts[-1], "by_difficulty": by_difficulty or {"1": final}},
    }  # fmt: skip


def test_summary_arithmetic():
    # GRPO finals 0.5, 0.6, 0.7 -> target (median) 0.6 after 1000 rollouts each.
    # ExGRPO seed 0 reaches 0.6 at 400 rollouts, seed 1 at 800, seed 2 never: median over {400, 800, inf} = 800,
    # 80% of GRPO's 1000; finals 0.65, 0.6, 0.55 -> median 0.6 [0.55, 0.65].
    grpo_x = [0, 500, 1000]
    runs = [record("grpo", s, grpo_x, [0.4, 0.45, f]) for s, f in enumerate([0.5, 0.6, 0.7])]
    ex_x = [0, 400, 800]
    runs += [record("exgrpo", 0, ex_x, [0.4, 0.61, 0.65]), record("exgrpo", 1, ex_x, [0.4, 0.5, 0.6]),
             record("exgrpo", 2, ex_x, [0.4, 0.5, 0.55])]  # fmt: skip
    s = study.summarize(runs)["t"]
    assert s["grpo_final_median"] == pytest.approx(0.6) and s["grpo_rollouts"] == 1000
    ex = s["arms"]["exgrpo"]
    assert ex["final"] == {"median": 0.6, "min": 0.55, "max": 0.65}
    assert ex["rollouts_to_grpo_final"] == {"per_seed": [400, 800, None], "reached": 2, "median": 800,
                                            "share_of_grpo": 0.8}  # fmt: skip
    # GRPO itself: seeds 1 and 2 reach 0.6 at 1000 (their finals), seed 0 never -> median 1000, 100%
    assert s["arms"]["grpo"]["rollouts_to_grpo_final"]["median"] == 1000
    table = study.markdown(study.summarize(runs))
    assert "| exgrpo | 3 | 0.600 [0.550, 0.650] | 0.600 | 800 | 80% | 2/3 |" in table
    # a majority of seeds that never reach it: the median is infinite, reported as not reached
    runs[-2] = record("exgrpo", 1, ex_x, [0.4, 0.5, 0.58])
    ex = study.summarize(runs)["t"]["arms"]["exgrpo"]["rollouts_to_grpo_final"]
    assert ex["median"] is None and ex["share_of_grpo"] is None and ex["reached"] == 1
    assert not math.isinf(study.summarize(runs)["t"]["grpo_rollouts"])


def test_unknown_arm_is_one_line(capsys):
    assert study.main(["--arms", "grpo,nope", "--report-only"]) == 2
    assert "unknown arm 'nope'" in capsys.readouterr().err


def test_set_overrides_task_fields(capsys):
    tasks = study.build_tasks(False, study.parse_overrides(["learning_rate=2e-4", "steps=600"]))
    assert tasks["addition"].learning_rate == 2e-4 and tasks["addition"].steps == 600
    assert isinstance(tasks["addition"].steps, int)
    assert study.TASKS["addition"].steps == 300  # the registry itself is untouched
    assert study.main(["--set", "nope=1", "--report-only"]) == 2
    assert "--set 'nope=1': expected FIELD=VALUE" in capsys.readouterr().err


def check_batch_records(record: dict, questions: int, k: int) -> None:
    """The per-generation-batch records of an ExGRPO run agree with its per-step logs: one a generation batch (here
    one a step), fresh and replayed groups adding up to the batch, the replayed ones never all-fail (each holds its
    stored success), bucket counts summing to the buffer's questions, ages that are updates back, and importance
    weights recorded exactly when something was replayed."""
    batches, steps = record["batches"], record["steps"]
    assert [b["step"] for b in batches] == list(range(len(steps["replayed"])))
    for b, replayed, in_buffer in zip(batches, steps["replayed"], steps["buffer_questions"]):
        assert b["fresh_groups"] + b["replayed_groups"] == questions and b["replayed_groups"] == replayed
        assert b["replayed_all_fail"] == 0 and b["fresh_all_fail"] + b["fresh_all_pass"] <= b["fresh_groups"]
        assert sum(b["buckets"].values()) == in_buffer and sorted(b["buckets"]) == [str(c) for c in range(1, k)]
        assert len(b["replayed_buckets"]) == replayed and all(1 <= c < k for c in b["replayed_buckets"])
        assert 0 <= b["replayed_fresh_all_fail"] <= b["replayed_groups"]
        if replayed:
            assert 0 <= b["repeat_share"] <= 1
            assert 0 <= b["age"]["mean"] <= b["age"]["max"] <= b["step"]
            w = b["is_weight"]
            assert w["tokens"] > 0 and w["p05"] <= w["mean"] <= w["p95"] and 0 <= w["below_gamma"] <= 1
        else:
            assert b["age"] is None and b["is_weight"] is None
    assert any(b["replayed_groups"] for b in batches)


def test_matched_questions_by_hand():
    # replayed (key, difficulty, warm pass rate), most replayed first: a (2, 0.5), b (2, 0.5), c (3, 0.1), d (4, 0.0)
    # candidates: x (2, 0.45), y (2, 0.9), z (3, 0.2), w (3, 0.1). a takes x (|0.05| beats |0.4|), b the one left of
    # difficulty 2, y; c takes w (exact); d has no candidate of difficulty 4: none
    replayed = [("a", 2, 0.5), ("b", 2, 0.5), ("c", 3, 0.1), ("d", 4, 0.0)]
    candidates = [("x", 2, 0.45), ("y", 2, 0.9), ("z", 3, 0.2), ("w", 3, 0.1)]
    assert study_run.matched_questions(replayed, candidates) == ["x", "y", "w"]


def test_group_shares_by_hand():
    # K = 4, three groups, the last one replayed: [1 0 0 0] one success, [0 0 0 0] all-fail, [1 1 1 1] all-pass
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert study_run.group_shares(rewards, 4, replayed=1) == {
        "fresh_groups": 2, "fresh_all_fail": 1, "fresh_all_pass": 0,
        "replayed_groups": 1, "replayed_all_fail": 0, "replayed_all_pass": 1, "replayed_fresh_all_fail": 0,
    }  # fmt: skip
    # Two replayed groups, K = 4: [1 0 0 0] (the stored success, its 3 generated rows all fail) and [1 0 1 0]
    # (one generated success): 1 replayed group whose generated rows all fail. Revisited without a stored row
    # (stored_first=False) the first row is generated too: [1 0 0 0] has a generated success, so 0.
    rewards = [0.0] * 4 + [1.0, 0.0, 0.0, 0.0] + [1.0, 0.0, 1.0, 0.0]
    assert study_run.group_shares(rewards, 4, replayed=2)["replayed_fresh_all_fail"] == 1
    assert study_run.group_shares(rewards, 4, replayed=2, stored_first=False)["replayed_fresh_all_fail"] == 0
    # None (a reward function that had nothing to say) is no success; nothing replayed: every group is fresh
    assert study_run.group_shares([None, 1.0, None, None], 2, replayed=0)["fresh_all_fail"] == 1


def test_weight_summary_by_hand():
    import torch

    # w over two loss passes: sorted 0.05, 0.5, 1, 2, 4. Mean 7.55 / 5 = 1.51. torch.quantile interpolates linearly
    # between order statistics at position q x (n - 1): q = 0.05 -> 0.2, 0.05 + 0.2 x 0.45 = 0.14; q = 0.95 -> 3.8,
    # 2 + 0.8 x 2 = 3.6. Below gamma = 0.1: only 0.05, 1 of 5.
    summary = study_run.weight_summary([torch.tensor([0.05, 0.5, 1.0, 2.0]), torch.tensor([4.0])], 0.1)
    assert summary == {"tokens": 5, "mean": 1.51, "p05": 0.14, "p95": 3.6, "below_gamma": 0.2}
    assert study_run.weight_summary([], 0.1) is None and study_run.weight_summary([torch.tensor([])], 0.1) is None
    assert study_run.weight_summary([torch.tensor([1.0])], None)["below_gamma"] is None  # no shaping: no gamma


def test_batch_record_ages_and_buckets():
    from types import SimpleNamespace

    from exgrpo_trl.buffer import ExperienceBuffer, Trajectory

    buffer = ExperienceBuffer(4)
    buffer.update_group("q", 2, {"prompt": "q"}, [Trajectory([5, 1], [-0.5, -0.25], 3)])  # q: 2 of 4, bucket 2
    buffer.mark_replayed(["q"], clock=0)
    buffer.mark_replayed(["q", "r"], clock=1)  # reuse: 3 replays of 2 questions over the window
    plan = SimpleNamespace(collected_at=[1, 2], clock=4, with_trajectories=True, buckets=[2, 3], repeat_share=0.5)
    # generation batch 4 (update 8, two updates a batch): trajectories collected in batches 1 and 2 are 3 and 2
    # batches, 6 and 4 updates old
    out = study_run.batch_record(8, plan, {"fresh_groups": 1}, buffer, updates_per_batch=2)
    assert out == {"step": 8, "fresh_groups": 1, "buckets": {"1": 0, "2": 1, "3": 0}, "age": {"mean": 5.0, "max": 6},
                   "replayed_buckets": [2, 3], "repeat_share": 0.5, "reuse": 1.5}  # fmt: skip
    revisit = SimpleNamespace(collected_at=[3], with_trajectories=False, buckets=[1], repeat_share=0.0)  # no age
    assert study_run.batch_record(9, revisit, {}, None) == {
        "step": 9, "buckets": None, "age": None, "replayed_buckets": [1], "repeat_share": 0.0, "reuse": None
    }  # fmt: skip
    assert study_run.batch_record(9, None, {}, None)["repeat_share"] is None  # nothing replayed


def test_hard_point_is_the_paper_point_from_a_weaker_start():
    hard, paper = study.TASKS[study.HARD_POINT], study.TASKS[study.PAPER_POINT]
    same = ("learning_rate", "steps", "prompts_per_step", "steps_per_generation", "train_questions", "eval_questions")
    assert all(getattr(hard, f) == getattr(paper, f) for f in same)
    assert hard.warm_start_steps == 300 < paper.warm_start_steps and hard.exgrpo == {"replay_start_pass_rate": 0.0}
    quick = study.build_tasks(True)[study.HARD_POINT]  # the paper's batch shape shrunk to fit the smoke pool
    assert quick.generation_questions <= study.QUICK["train_questions"]
