"""The demo (`make demo`, `python -m lab.demo`): one seed of the study, GRPO and ExGRPO side by side. The comparison's
arithmetic and wording on hand-made runs (it must say which arm ended higher, whichever it is), then the whole demo
at 2 steps per run."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab import demo, study

ROOT = Path(__file__).resolve().parents[2]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_defaults_are_the_studied_setting():
    args = demo.build_parser().parse_args([])
    assert (args.task, args.seed, args.jobs, str(args.out)) == (demo.DEFAULT_TASK, 0, 2, "runs/demo")
    assert demo.DEFAULT_TASK in study.TASKS and str(args.cache_dir) == study.DEFAULT_CACHE
    with pytest.raises(SystemExit):
        demo.build_parser().parse_args(["--task", "nope"])


def test_demo_runs_as_a_module_of_the_lab_not_an_exgrpo_command(capsys):
    from exgrpo_trl.cli import main

    run = subprocess.run([sys.executable, "-m", "lab.demo", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0 and "--task" in run.stdout, run.stderr
    assert main(["demo"]) == 2  # the installed command knows nothing of the lab
    assert "unknown command 'demo'" in capsys.readouterr().err


def _record(arm, rollouts, curve, by_difficulty, replayed):
    return {
        "task": "countdown-weak", "arm": arm, "seed": 0, "seconds": 12.0,
        "curve": {"step": list(range(len(curve))), "rollouts": rollouts, "pass_at_1": curve,
                  "by_difficulty": by_difficulty},
        "steps": {"replayed": replayed, "buffer_questions": [3, 5], "retired": [1, 2]},
        "replay_counts": {"questions_replayed": 5, "replays": sum(replayed), "max": 3, "histogram": {"1": 2, "3": 1}},
        "probes": {},
        "final": {"pass_at_1": curve[-1], "rollouts": rollouts[-1],
                  "by_difficulty": {d: v[-1] for d, v in by_difficulty.items()}},
    }  # fmt: skip


@pytest.fixture
def records():
    # GRPO: 16 groups x 8 rollouts = 128 per step. ExGRPO replays 0 then 8 groups, each generating K - 1 = 7:
    # 128, then 128 - 8 = 120 -> 248 in all.
    grpo = _record("grpo", [0, 128, 256], [0.1, 0.2, 0.3], {"2": [0.2, 0.3, 0.5], "3": [0.0, 0.1, 0.1]}, [0, 0])
    ex = _record("exgrpo", [0, 128, 248], [0.1, 0.3, 0.28], {"2": [0.2, 0.5, 0.4], "3": [0.0, 0.1, 0.16]}, [0, 8])
    ex["probes"] = {
        "replayed": {"questions": 2, "warm_start": {"overall": 0.1}, "final": {"overall": 0.6}},
        "retired": {"questions": 2, "warm_start": {"overall": 0.5}, "final": {"overall": 0.25}},
    }
    return {"grpo": grpo, "exgrpo": ex}


def test_comparison_arithmetic(records):
    task = study.TASKS["countdown-weak"]
    c = demo.compare(task, records)
    # GRPO's final 0.3; ExGRPO's curve reaches 0.3 at step 1 after 128 rollouts: 128 / 256 = 50%; it ends at 0.28
    assert c["grpo_final"] == 0.3 and c["difference"] == pytest.approx(-0.02, abs=1e-12)
    assert c["exgrpo_reached_grpo_final"] == {"step": 1, "rollouts": 128, "share_of_grpo": 0.5}
    assert c["warm_start"] == {"overall": 0.1, "by_difficulty": {"2": 0.2, "3": 0.0}}
    # replay first fires at step 2 (the second entry); mean over steps 2.. of [8] = 8
    assert c["replay"]["first_step"] == 2 and c["replay"]["replayed_per_step_after_start"] == 8
    assert (c["replay"]["buffer_questions"], c["replay"]["retired"], c["replay"]["replays"]) == (5, 2, 8)
    text = demo.report_text(task, records, c, None, seed=0)
    assert "ExGRPO ends 0.020 lower than GRPO (0.280 against 0.300)" in text
    assert "at step 1, after 128 generated rollouts: 50% of GRPO's 256" in text
    assert "from step 2, 8.0 of 16 groups per step were replayed questions" in text
    assert "Pass@1 on the 2 most replayed training questions: 0.100 at the warm start, 0.600 at the end." in text
    assert "Pass@1 on 2 of the retired training questions: 0.500 at the warm start, 0.250 at the end." in text
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line.strip()) for line in text.splitlines()[2:6])}
    assert rows == {
        "needs 2 numbers": ["0.200", "0.500", "0.400"],
        "needs 3 numbers": ["0.000", "0.100", "0.160"],
        "overall": ["0.100", "0.300", "0.280"],
        "generated rollouts": ["256", "248"],
    }


def test_comparison_says_which_arm_ended_higher(records):
    task = study.TASKS["countdown-weak"]
    higher = copy.deepcopy(records)
    higher["exgrpo"]["curve"]["pass_at_1"][-1] = higher["exgrpo"]["final"]["pass_at_1"] = 0.35
    assert "ExGRPO ends 0.050 higher than GRPO (0.350 against 0.300)" in demo.report_text(
        task, higher, demo.compare(task, higher), None, seed=0
    )
    never = copy.deepcopy(records)
    never["exgrpo"]["curve"]["pass_at_1"] = [0.1, 0.25, 0.29]
    never["exgrpo"]["final"]["pass_at_1"] = 0.29
    c = demo.compare(task, never)
    assert c["exgrpo_reached_grpo_final"] is None
    text = demo.report_text(task, never, c, None, seed=0)
    assert "ExGRPO never reached GRPO's final held-out pass@1 (0.300); its best evaluation was 0.290." in text
    level = copy.deepcopy(records)
    level["exgrpo"]["final"]["pass_at_1"] = 0.3
    assert "ExGRPO ends level with GRPO" in demo.report_text(task, level, demo.compare(task, level), None, seed=0)


def test_study_context_places_the_seed(tmp_path, records):
    # two GRPO seeds (finals 0.3, 0.4 -> median 0.35) and one ExGRPO seed (0.28, never reaching 0.35)
    for arm, seed, final in (("grpo", 0, 0.3), ("grpo", 1, 0.4), ("exgrpo", 0, 0.28)):
        r = copy.deepcopy(records[arm])
        r["seed"], r["curve"]["pass_at_1"][-1], r["final"]["pass_at_1"] = seed, final, final
        path = study.run_path(tmp_path, "countdown-weak", arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    context = demo._study_context(tmp_path, "countdown-weak")
    assert context["arms"]["grpo"]["final"] == {"median": 0.35, "min": 0.3, "max": 0.4}
    task = study.TASKS["countdown-weak"]
    text = demo.report_text(task, records, demo.compare(task, records), context, seed=0)
    assert "The study (2 GRPO and 1 ExGRPO seeds of countdown-weak)" in text
    assert "GRPO 0.350 [0.300, 0.400], ExGRPO 0.280 [0.280, 0.280]" in text
    assert "did not reach GRPO's final median on most seeds" in text
    assert demo._study_context(tmp_path, "addition") is None


def test_two_step_demo_end_to_end(tmp_path, capsys):
    out, cache = tmp_path / "run", tmp_path / "cache"
    argv = ["--quick", "--out", str(out), "--cache-dir", str(cache), "--no-progress"]
    assert demo.main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert {"task", "seed", "settings", "comparison", "study", "runs", "figure", "seconds"} <= set(results)
    assert results["task"] == demo.DEFAULT_TASK and results["study"] is None  # --quick: not the studied setting
    assert results["settings"]["steps"] == 2 and results["settings"]["eval_questions"] == 8
    records = {arm: json.loads(Path(path).read_text()) for arm, path in results["runs"].items()}
    assert records["grpo"]["settings"]["trainer"] == "GRPOTrainer"
    assert records["exgrpo"]["settings"]["trainer"] == "ExGRPOTrainer"
    c = results["comparison"]
    # the printed table carries the records' numbers, rounded to 3 decimals
    overall = next(line for line in printed.splitlines() if line.startswith("overall")).split()[1:]
    want = [records["grpo"]["curve"]["pass_at_1"][0], records["grpo"]["final"]["pass_at_1"],
            records["exgrpo"]["final"]["pass_at_1"]]  # fmt: skip
    assert [float(x) for x in overall] == pytest.approx(want, abs=5e-4)
    assert c["final"]["grpo"]["rollouts"] == 256  # 2 steps x 16 questions x 8 rollouts
    assert re.search(r"This seed \(0\): ExGRPO ends (level with|[\d.]+ (higher|lower) than) GRPO", printed)
    # a 5-step warm start solves nothing, so nothing enters the buffer, ExGRPO replays nothing and trains exactly
    # like GRPO: same warm start, seed, data order and hyperparameters
    assert sum(records["exgrpo"]["steps"]["replayed"]) == 0 and c["replay"]["first_step"] is None
    assert records["exgrpo"]["curve"]["pass_at_1"] == records["grpo"]["curve"]["pass_at_1"]
    assert "ExGRPO replayed nothing" in printed
    png = out / results["figure"]
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 800


def test_demo_prints_the_study_sweep(tmp_path):
    """The demo's closing lines: the study's sweep.json as written by `python -m lab.study`, one line a step size."""
    from lab.tests.records import make_record

    x = [0, 1000, 2000]
    logs = dict(steps={"fresh_questions": [64, 32], "replayed": [0, 32], "buffer_questions": [10, 40]},
                replay_counts={"histogram": {"1": 32}})  # fmt: skip
    runs = [  # one sweep point at lr 2.5e-5 over 64 questions an update (3.9e-7): GRPO 0.40 / 0.42, ExGRPO 0.43 / 0.41
        make_record(f"{study.SWEEP_FAMILY}-x", "grpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.40], lr=2.5e-5),
        make_record(f"{study.SWEEP_FAMILY}-x", "grpo", 1, [0, 1, 2], x, [0.2, 0.3, 0.42], lr=2.5e-5),
        make_record(f"{study.SWEEP_FAMILY}-x", "exgrpo", 0, [0, 1, 2], x, [0.2, 0.3, 0.43], lr=2.5e-5, **logs),
        make_record(f"{study.SWEEP_FAMILY}-x", "exgrpo", 1, [0, 1, 2], x, [0.2, 0.3, 0.41], lr=2.5e-5, **logs),
    ]
    assert demo.sweep_lines(tmp_path) == []  # no sweep.json: nothing printed
    study.sweep_report(runs, tmp_path)
    lines = demo.sweep_lines(tmp_path)
    # paired differences +0.03 (seed 0) and -0.01 (seed 1): median +0.01, band [-0.01, +0.03]
    name = f"{study.SWEEP_FAMILY}-x"  # padded to 26 columns
    expected = "ExGRPO - GRPO final, equal updates +0.010 [-0.010, +0.030] over 2 paired seeds"
    assert lines[2] == f"  3.9e-07  {name}{' ' * (26 - len(name))} {expected}"
    assert len(lines) == 3  # a title, one point, no estimate noise (no resampled evaluations)
