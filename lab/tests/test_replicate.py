"""`python -m lab.study --replicate`: fresh seeds read against the registered runs (figures derived by hand)."""

import json
import math

import pytest

from lab import study
from lab.study import replicate
from lab.tests.records import make_record


def test_prediction_interval_by_hand():
    # [0.30 .. 0.34]: mean 0.32, sd sqrt(0.001 / 4) = 0.0158114; t(0.975, 4) = 2.776; sqrt(1 + 1/5) = 1.0954451:
    # half-width 2.776 x 0.0158114 x 1.0954451 = 0.0480818
    lo, hi = replicate.prediction_interval([0.30, 0.31, 0.32, 0.33, 0.34])
    assert math.isclose(lo, 0.32 - 0.0480818, abs_tol=1e-7) and math.isclose(hi, 0.32 + 0.0480818, abs_tol=1e-7)
    assert replicate.prediction_interval([0.3]) is None


def _runs(finals_by_arm, seeds):
    # a two-point curve: 0.2 at 0 rollouts, then the final at 1000 rollouts (every arm: equal rollouts = equal updates)
    return [make_record("addition", arm, s, [0, 100], [0, 1000], [0.2, f]) for arm, finals in finals_by_arm.items()
            for s, f in zip(seeds, finals)]  # fmt: skip


def test_the_reading_places_each_fresh_seed_by_hand():
    registered = _runs({"grpo": [0.30, 0.31, 0.32, 0.33, 0.34], "exgrpo": [0.28, 0.30, 0.30, 0.32, 0.30]},
                       [20, 21, 22, 23, 24])  # fmt: skip
    fresh = _runs({"grpo": [0.33, 0.40], "exgrpo": [0.31, 0.31]}, [25, 26])
    payload, text = replicate.reading("addition", registered, fresh)
    rows = {r["quantity"]: r for r in payload["rows"]}
    grpo = rows["grpo: final held-out pass@1"]
    # prediction interval [0.2719, 0.3681] (test above): 0.33 inside, 0.40 above
    assert [grpo["fresh"][s]["against_prediction"] for s in ("25", "26")] == ["inside", "ABOVE"]
    # the fresh mean 0.365 against the registered mean's interval 0.32 -+ 2.776 x 0.0158114 / sqrt(5) = [0.3004,
    # 0.3396]: above
    assert math.isclose(grpo["fresh_mean"], 0.365) and grpo["fresh_mean_against_ci"] == "ABOVE"
    diff = rows["exgrpo - grpo, equal updates"]
    # registered differences -0.02, -0.01, -0.02, -0.01, -0.04 (mean -0.02); fresh -0.02 and -0.09
    assert math.isclose(diff["registered"]["mean"], -0.02)
    # sd sqrt(6e-4 / 4) = 0.0122474; prediction interval -0.02 -+ 2.776 x 0.0122474 x 1.0954451 = [-0.0572, 0.0172]
    assert [diff["fresh"][s]["against_prediction"] for s in ("25", "26")] == ["inside", "BELOW"]
    assert "exgrpo - grpo, equal generated rollouts" in rows
    assert "Outside the registered prediction interval: grpo: final held-out pass@1 seed 26;" in text


def test_replicate_refuses_used_seeds_and_missing_seeds(capsys):
    assert study.main(["--replicate", "addition", "--seeds", "22-26"]) == 2
    assert "seed 22 was used by the registered study" in capsys.readouterr().err
    assert study.main(["--replicate", "addition"]) == 2
    assert "give --seeds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--replicate", "countdown-medium", "--seeds", "30"])  # not a registered setting


def test_replicate_trains_the_registered_arms_and_writes_the_reading(tmp_path, monkeypatch, capsys):
    # the training itself is the study's (run_missing, tested there): here, what is trained and what is written
    trained = []

    def fake_run_missing(args, tasks, todo):
        for task, arm, seed in todo:
            trained.append((task, arm, seed))
            path = args.results / task / arm / f"seed{seed}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(make_record(task, arm, seed, [0, 100], [0, 1000], [0.2, 0.7])))
        return []

    monkeypatch.setattr(study.cli, "run_missing", fake_run_missing)
    argv = ["--replicate", "addition", "--seeds", "25,26", "--results", str(tmp_path)]
    assert study.main(argv) == 0
    assert trained == [("addition", a, s) for a in ("grpo", "exgrpo", "reuse_limit") for s in (25, 26)]
    out = capsys.readouterr().out
    assert "## addition: 2 fresh seed(s) (25, 26) against the registered runs (seeds 20, 21, 22, 23, 24)" in out
    assert (tmp_path / "addition" / "replication.md").read_text().strip() == out.split("runs to train\n")[1].strip()
    assert study.main(argv) == 0 and len(trained) == 6  # saved runs are not trained again
