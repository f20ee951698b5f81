"""The overhead benchmark's harness: turn order, and a tiny end-to-end run (benchmarks are never timed in tests)."""

import importlib.util
import json
import pathlib
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_benchmark(name: str):
    """The module of benchmarks/NAME.py, loaded from its file."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tiny(name: str, tmp_path, *flags: str) -> dict:
    """benchmarks/NAME.py at its tiny default size with `flags`, checkpoints under tmp_path: its figures (it must exit
    0)."""
    out = tmp_path / "figures.json"
    assert load_benchmark(name).main(["--output-dir", str(tmp_path / "run"), "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def overhead():
    return load_benchmark("overhead")


def test_turns_alternate_who_goes_first(overhead):
    # Two threads of 4 steps each: turns follow A B B A A B B A; once A is done B runs alone.
    turns = overhead._Turns(["a", "b"])
    order = []

    def work(name, steps):  # what `run_in_lockstep` and its callback do around each optimizer step
        turns.wait(name)
        for _ in range(steps):
            order.append(name)
            turns.pass_on(name)  # on_step_end
            turns.wait(name)
        turns.pass_on(name, finished=True)

    threads = [threading.Thread(target=work, args=("a", 4)), threading.Thread(target=work, args=("b", 6))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert order == list("abbaabba") + list("bb")


def test_tiny_run_writes_its_figures(overhead, tmp_path):
    out = tmp_path / "figures.json"
    overhead.main(
        [
            "--hidden-size",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--questions-per-step",
            "4",
            "--max-completion-length",
            "8",
            "--prefill-questions",
            "8",
            "--steps",
            "3",
            "--warmup-steps",
            "1",
            "--replay-max-age",
            "2",
            "--replay-priority",
            "advantage",
            "--json",
            str(out),
        ]
    )
    figures = json.loads(out.read_text())
    assert figures["rules"] == {"replay_max_age": 2, "replay_max_uses": None, "replay_priority": "advantage"}
    assert figures["draw_median_s"] > 0
    from exgrpo_trl import draw

    assert draw.draw_questions is overhead.DRAW_FUNCTIONS["draw_questions"]  # the timing wrappers are gone
    assert len(figures["step_times_s"]["grpo"]) == len(figures["step_times_s"]["exgrpo"]) == 2
    assert figures["ratio"] == pytest.approx(figures["exgrpo_median_s"] / figures["grpo_median_s"])
    assert set(figures["per_step_ms"]) >= {"entropy scoring", "plan (sample + broadcast)"}


@pytest.fixture(scope="module")
def candidate_cap():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))  # candidate_cap imports overhead's builders
    try:
        spec = importlib.util.spec_from_file_location("candidate_cap", ROOT / "benchmarks" / "candidate_cap.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_candidate_cap_summary_counts_by_hand(candidate_cap):
    # Two selections, candidates oldest first.
    #   A: entropies [1.0, 3.0, 2.0], stored NLL [0.2, 0.9, 0.5]: true argmin 0 (the oldest, age rank 2).
    #      newest 2 = {1, 2} -> picks 2 (gap 2.0 - 1.0 = 1.0); lowest NLL 2 = {0, 2} -> picks 0 (same).
    #   B: entropies [2.5, 0.5], NLL [0.1, 0.3]: argmin 1 (newest, age rank 0); with 2 candidates no cap binds.
    #   M=2 scores 2 + 2 = 4 of the 5 rows (80.0%); M=1 scores nothing (a single candidate needs no forward).
    lines = candidate_cap.summarise(
        [candidate_cap.np.array([1.0, 3.0, 2.0]), candidate_cap.np.array([2.5, 0.5])],
        [candidate_cap.np.array([0.2, 0.9, 0.5]), candidate_cap.np.array([0.1, 0.3])],
        caps=[2, 1],
    )
    assert lines[0].startswith("2 scored selections, 5 candidates scored (mean 2.5, max 3 per question)")
    assert lines[1] == "age rank of the true argmin (0 = newest stored): 0: 50.0%, 2: 50.0%"
    assert "same pick  50.0% (1/2); gap when not: mean 1.0000, max 1.0000 nats; scores 80.0% of the rows" in lines[2]
    assert "same pick 100.0% (2/2); never differs; scores 80.0% of the rows" in lines[3]
    # M=1: newest -> A picks 2 (gap 1.0), B picks 1 (same); lowest NLL -> A picks 0 (same), B picks 0 (gap 2.0)
    assert "same pick  50.0% (1/2); gap when not: mean 1.0000, max 1.0000 nats; scores 0.0% of the rows" in lines[4]
    assert "same pick  50.0% (1/2); gap when not: mean 2.0000, max 2.0000 nats; scores 0.0% of the rows" in lines[5]


def test_candidate_cap_tiny_run(candidate_cap, capsys):
    candidate_cap.main(
        [
            "--hidden-size",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--questions-per-step",
            "4",
            "--max-completion-length",
            "8",
            "--prefill-questions",
            "8",
            "--steps",
            "3",
            "--caps",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert "scored selections" in out and "M=1            newest: same pick" in out


def test_buffer_memory_tiny_run(capsys):
    # 300 trajectories of 20 tokens: every stage runs (fill, plan through exgrpo_trl.replay, save, load in a fresh
    # process, the non-main rank's load); the benchmark itself asserts that the loaded buffer equals the saved one.
    spec = importlib.util.spec_from_file_location("buffer_memory", ROOT / "benchmarks" / "buffer_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (
        module.main(
            [
                "--trajectories",
                "300",
                "--length",
                "20",
                "--plan-questions",
                "8",
                "--repeats",
                "2",
                "--io-repeats",
                "1",
                "--no-reference",
                "--max-candidates",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    figures = json.loads(out.split("figures: ", 1)[1].splitlines()[0])
    assert figures["bytes_per_token_data"] == 6.0  # int32 id + float16 log-prob
    assert "300 trajectories x 20 tokens = 6,000 tokens" in out


def test_stop_tokens_end_an_untrained_model_between_the_lengths(overhead):
    # vocab 512, completions 8-24: span 16; an untrained model samples about uniformly, so a stop probability of
    # 2 / 16 per token ends a completion half-way on average: ceil(2 * 512 / 16) = 64 fillers, the last ids 448..511.
    args = overhead.argparse.Namespace(vocab_size=512, min_completion_length=8, max_completion_length=24, seed=0)
    tokenizer, reward, _ = overhead.build_task(args)
    stops = overhead.stop_token_ids(tokenizer, args)
    assert stops == [1, *range(448, 512)]
    # marked: digits 4..13 and even fillers 16, 18, ...; solved = ends with a stop and an even count of marked ones
    # [4, 16, 1]: 2 marked, ends with EOS; [4, 17, 1]: 1 marked; [4, 16, 5]: no stop; [5, 510]: the stop 510 is an
    # even filler, 2 marked; [5, 511]: 1 marked
    assert reward([[4, 16, 1], [4, 17, 1], [4, 16, 5], [5, 510], [5, 511]]) == [1.0, 0.0, 0.0, 1.0, 0.0]
    # the character vocabulary alone keeps EOS as the only stop and the digits as the marked tokens
    small = overhead.argparse.Namespace(vocab_size=None, min_completion_length=0, max_completion_length=8, seed=0)
    tokenizer, reward, _ = overhead.build_task(small)
    assert overhead.stop_token_ids(tokenizer, small) == [1] and reward([[4, 5, 1], [4, 1]]) == [1.0, 0.0]


def test_real_vocab_tiny_run(tmp_path):
    # "real_vocab.py" at a tiny size on the CPU: vocab 512, completions of 8-24 tokens, float32.
    figures = run_tiny("real_vocab", tmp_path)
    smoke, numerics = figures["smoke"], figures["numerics"]
    # 4 questions x K=8 in micro-batches of 8: 4 optimizer steps a generation batch; 2 batches, then 1 after resume.
    # The first batch has an empty buffer; each later one replays floor(0.5 x 4) = 2 questions.
    assert smoke["optimizer_steps"] == 8 and (smoke["resumed_from_step"], smoke["resumed_to_step"]) == (8, 12)
    assert smoke["replayed_groups_per_generation_batch"] == [0, 2] and smoke["replayed_groups_after_resume"] == [2]
    assert smoke["checkpoint_has_buffer"] and smoke["buffer_restored_exactly"]
    assert smoke["buffer_trajectories_after_resume"] > smoke["buffer_trajectories"] > 0
    assert smoke["deepspeed_zero_stage"] is None
    assert figures["memory"]["scoring_peak_gib"] is None  # peak memory is measured on CUDA only
    # Learning rate 0 in float32: the re-scored log-probs equal the stored ones up to float16 storage, whose rounding
    # is at most half the float16 spacing at the stored value (log-probs near -6.2 of a 512-token vocabulary: in
    # [4, 8) the spacing is 2^-8, so at most 2^-9 = 0.00195); the forward itself adds only float32 rounding.
    assert numerics["replayed_groups_per_generation_batch"] == [0, 2]
    assert numerics["float16_half_spacing_max"] == 2**-9
    assert numerics["abs_log_w_max"] <= 2**-9 + 1e-5 and numerics["excess_over_storage_max"] <= 1e-5
    assert abs(numerics["logged_is_weight_mean"] - 1) < 2**-9


def test_real_vocab_smoke_with_a_rollout_func(tmp_path, monkeypatch):
    # "real_vocab.py --checks smoke --rollout-func": the same smoke, rollouts from a rollout_func of TRL's documented
    # shape (no env_mask, a per-row field): one call per generation batch, 2 + 1 batches; each replayed row (the first
    # row of each of the 2 replayed groups of batch 2, and of the batch after the resume) reached the reward with the
    # field stored with its trajectory.
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    smoke = run_tiny("real_vocab", tmp_path, "--checks", "smoke", "--rollout-func")["smoke"]
    assert smoke["rollout_func_calls"] == 2 and smoke["replayed_groups_per_generation_batch"] == [0, 2]
    assert smoke["replayed_rows"] == smoke["replayed_rows_with_their_field"] == 2
    assert smoke["buffer_restored_exactly"] and smoke["replayed_groups_after_resume"] == [2]


def test_vlm_smoke_tiny_run(tmp_path):
    # "vlm_smoke.py" at its tiny default size on the CPU: the tests' tiny Qwen2-VL, 4 questions x K=8 a generation
    # batch, 2 batches, then 1 more after the resume.
    figures = run_tiny("vlm_smoke", tmp_path)
    train, resume = figures["train"], figures["resume"]
    # 32 rows in micro-batches of 8: 4 optimizer steps a generation batch; the first batch's buffer is empty
    assert train["optimizer_steps"] == 8 and resume["resumed_to_step"] == 12
    assert train["replayed_groups"][0] == 0 and sum(train["replayed_groups"]) > 0 and sum(resume["replayed_groups"])
    # a replayed group is K = 8 rows (K - 1 fresh and the stored one), every one its question's row and image
    assert train["replayed_rows"] == 8 * sum(train["replayed_groups"])
    assert resume["replayed_rows"] == 8 * sum(resume["replayed_groups"])
    assert train["rows_without_their_image"] == resume["rows_without_their_image"] == 0
    assert train["stored_images"] == train["buffer_questions"] > 0  # one image a question
    assert train["checkpoint_has_buffer"] and resume["buffer_restored_exactly"]
    assert figures["image_tokens"] == 1  # 28 x 28 pixels: 2 x 2 patches of 14, merged 2 x 2


def test_vlm_smoke_counts_a_replayed_row_without_its_image(monkeypatch):
    # the check can fail: a planned replay whose rows lost their image is counted, row by row
    module = load_benchmark("vlm_smoke")
    from types import SimpleNamespace

    rows = [{"prompt": "q", "image": None} for _ in range(4)]
    plan = SimpleNamespace(group_indices=[1], keys=["key of the image question"])
    run = SimpleNamespace(_rows=lambda inputs, plan: SimpleNamespace(inputs=rows))  # ExGRPORun._rows (issue 52)
    seen = module.watch_replays(SimpleNamespace(exgrpo_run=run), k=2)
    run._rows(rows, plan)
    assert seen == {"replayed_groups": [1], "replayed_rows": 2, "rows_without_their_image": 2}


def test_kill_one_rank_tiny_run(tmp_path):
    # "kill_one_rank.py" at its tiny default: `exgrpo train` on 2 processes (DDP over gloo), 4 steps, one rank's worker
    # killed as its RNG state file appears in checkpoint-2 (what issue 51 found: a checkpoint finished by the main
    # process without that file), then the same command until it exits 0: the end is the uninterrupted run's.
    figures = run_tiny("kill_one_rank", tmp_path)
    (first, *_) = figures["kills"]
    assert first["kill"]["mode"] == "rng" and first["killed"] and first["newest_folder"] == 2
    assert first["exit_code"] != 0 and first["teardown_s"] < 60 and first["workers_left"] == []
    assert figures["kills_fired"] == 1 and figures["hangs"] == 0 and figures["workers_left"] == 0
    comparison = figures["comparison"]
    assert comparison["final_weights"] is True and comparison["buffer_and_state_bitwise"]
    assert comparison["checkpoint_differences"] == {"checkpoint-2": [], "checkpoint-4": []}
    assert comparison["all_equal"]


def test_continuous_batching_flag_reaches_the_config(overhead):
    import argparse

    p = argparse.ArgumentParser()
    overhead.add_task_arguments(p)
    p.set_defaults(device="cpu", bf16=False)  # main's own flags
    assert overhead.trainer_config(p.parse_args([]))["use_transformers_continuous_batching"] is False
    on = overhead.trainer_config(p.parse_args(["--continuous-batching"]))
    assert on["use_transformers_continuous_batching"] is True


def test_every_benchmark_script_has_a_smoke_run():
    # A benchmark no test runs can rot unseen (buffer_memory.py once did): each script must be named in this file
    # by a test that runs it at a tiny size.
    text = pathlib.Path(__file__).read_text()
    scripts = sorted(p for p in (ROOT / "benchmarks").glob("*.py"))

    def named(script) -> bool:  # its file name, or its module name given to load_benchmark / run_tiny
        return any(
            form in text for form in (f'"{script.name}"', f'benchmark("{script.stem}")', f'tiny("{script.stem}"')
        )

    assert scripts and all(named(script) for script in scripts), [s.name for s in scripts if not named(s)]


def test_study_script_reports_saved_runs(tmp_path):
    # "study.py" as a script, report-only over two saved runs (the training path runs in lab/tests/test_study.py)
    import subprocess
    import sys

    for arm, final in (("grpo", 0.5), ("exgrpo", 0.625)):
        path = tmp_path / "addition" / arm / "seed0.json"
        path.parent.mkdir(parents=True)
        curve = {
            "step": [0, 1],
            "rollouts": [0, 128],
            "pass_at_1": [0.25, final],
            "by_difficulty": {"1": [0.25, final]},
        }
        final_figures = {"pass_at_1": final, "rollouts": 128, "by_difficulty": {"1": final}}
        path.write_text(
            json.dumps({"task": "addition", "arm": arm, "seed": 0, "curve": curve, "final": final_figures})
        )
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "study.py"),
            "--report-only",
            "--tasks",
            "addition",
            "--arms",
            "grpo,exgrpo",
            "--seeds",
            "0",
            "--results",
            str(tmp_path),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # GRPO's final 0.5 is the target; ExGRPO's curve reaches 0.625 >= 0.5 at 128 rollouts: 100% of GRPO's 128
    assert "| exgrpo | 1 | 0.625 [0.625, 0.625] | 0.625 | 128 | 100% | 1/1 |" in out
    assert (tmp_path / "study.png").is_file()
