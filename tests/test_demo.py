"""The whole `exgrpo demo` at 2 steps per run: table, results.json and figure.png with the expected fields."""

from __future__ import annotations

import json
import re

import pytest

from exgrpo_trl.cli import demo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_resolve_defaults_quick_and_overrides():
    s = demo._resolve(demo.build_parser().parse_args([]))
    assert (s["steps"], s["warm_start_steps"], s["eval_questions"], s["eval_samples"]) == (300, 1500, 200, 16)
    assert s["out"] == "runs/demo" and s["cache_dir"] == ".cache/exgrpo-demo"
    q = demo._resolve(demo.build_parser().parse_args(["--quick", "--steps", "3", "--seed", "5"]))
    assert (q["steps"], q["warm_start_steps"], q["eval_questions"], q["seed"]) == (3, 5, 8, 5)
    assert q["replay_ratio"] is None and q["replay_start_pass_rate"] is None  # ExGRPOConfig's defaults apply


def test_cli_dispatches_demo(capsys):
    from exgrpo_trl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    assert "--warm-start-steps" in capsys.readouterr().out


def test_moving_average():
    assert demo.moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    argv = [
        "--out", str(out / "run"),
        "--cache-dir", str(out / "cache"),
        "--seed", "3",
        "--steps", "2",
        "--warm-start-steps", "5",
        "--train-questions", "64",
        "--eval-questions", "12",
        "--eval-samples", "2",
        "--no-progress",
    ]  # fmt: skip
    return out / "run", argv


def test_two_step_demo_end_to_end(demo_run, capsys):
    run_dir, argv = demo_run
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out

    # --- the table
    header = next(line for line in printed.splitlines() if line.startswith("held-out pass@1"))
    assert header.split()[2:] == ["warm", "start", "GRPO", "ExGRPO"]
    rows = {}
    for line in printed.splitlines():
        m = re.match(r"^(1 digit|[234] digits|overall)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.group(2, 3, 4)]
    assert set(rows) <= {"1 digit", "2 digits", "3 digits", "4 digits", "overall"} and "overall" in rows
    assert "ExGRPO at the end: buffer" in printed and "retired questions" in printed and "replayed fraction" in printed
    assert "warm start: trained" in printed

    # --- results.json
    results = json.loads((run_dir / "results.json").read_text())
    assert {"settings", "timings", "pass_at_1", "exgrpo", "curves", "per_question_pass_rate", "figure"} <= set(results)
    s = results["settings"]
    assert (s["steps"], s["seed"], s["eval_questions"], s["eval_samples"], s["warm_start_steps"]) == (2, 3, 12, 2, 5)
    assert s["model_parameters"] == 1_053_312 and s["warm_start_cached"] is False
    assert s["trainer_settings"]["per_device_train_batch_size"] == 16 * 8
    assert s["exgrpo_settings"]["replay_ratio"] == 0.5 and s["exgrpo_settings"]["policy_shaping_gamma"] == 0.1
    for kind in ("warm_start", "grpo", "exgrpo"):
        e = results["pass_at_1"][kind]
        assert 0.0 <= e["overall"] <= 1.0
        assert set(e["by_digits"]) <= {"1", "2", "3", "4"} and e["by_digits"]
        # the printed table carries the same numbers, rounded to 3 decimals
        col = ("warm_start", "grpo", "exgrpo").index(kind)
        assert rows["overall"][col] == pytest.approx(e["overall"], abs=5e-4)
        for d, v in e["by_digits"].items():
            label = f"{d} digit" + ("s" if d != "1" else "")
            assert rows[label][col] == pytest.approx(v, abs=5e-4)
    pq = results["per_question_pass_rate"]
    assert len(pq["prompt"]) == len(pq["digits"]) == len(pq["grpo"]) == len(pq["exgrpo"]) == 12
    # the samples are 0/2, 1/2 or 2/2 and overall is their mean
    assert all(p in (0.0, 0.5, 1.0) for p in pq["warm_start"])
    assert results["pass_at_1"]["warm_start"]["overall"] == pytest.approx(sum(pq["warm_start"]) / 12, abs=1e-12)

    ex = results["exgrpo"]
    for key in ("buffer_questions", "buffer_trajectories", "retired", "replayed_fraction", "replay_start_step"):
        assert key in ex
    assert set(ex["bucket_counts"]) == {str(k) for k in range(1, 8)}
    assert sum(ex["bucket_counts"].values()) == ex["buffer_questions"]
    assert 0.0 <= ex["replayed_fraction"] <= 1.0

    for kind in ("grpo", "exgrpo"):
        c = results["curves"][kind]
        assert c["step"] == [1, 2] and len(c["reward"]) == 2
    c = results["curves"]["exgrpo"]
    assert len(c["buffer_questions"]) == len(c["retired"]) == len(c["buffer_trajectories"]) == 2
    # a 5-step warm start solves almost nothing, so the delayed start (pass@1 > 0.35) never fires and ExGRPO
    # must train exactly like GRPO: same warm start, same seed, same data order, same hyperparameters.
    assert ex["replay_start_step"] is None and ex["buffer_questions"] == 0
    assert results["curves"]["grpo"]["reward"] == c["reward"]
    assert pq["grpo"] == pq["exgrpo"]

    t = results["timings"]
    assert {"warm_start_s", "grpo_train_s", "exgrpo_train_s", "eval_s", "total_s"} <= set(t)
    assert t["total_s"] >= t["grpo_train_s"] + t["exgrpo_train_s"]

    # --- figure.png
    png = run_dir / results["figure"]
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 800
