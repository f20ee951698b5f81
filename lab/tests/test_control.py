"""The over-fitting control's summary over seeds (`lab.study.control`), on figures chosen by hand."""

import pytest

from lab.study.control import control_summary, summary_markdown


def run(seed, warm, final, grpo):
    pair = lambda r, m: {"replayed": r, "matched": m}  # noqa: E731
    return {"task": "countdown-hard", "arm": "exgrpo", "seed": seed, "warm_start": pair(*warm),
            "final": pair(*final), "grpo_final": pair(*grpo)}  # fmt: skip


def test_summary_by_hand():
    rows = [
        # lift beyond matched (0.6 - 0.2) - (0.5 - 0.2) = 0.1; replayed 0.6 - 0.55 = 0.05; matched 0.5 - 0.5 = 0
        run(0, (0.2, 0.2), (0.6, 0.5), (0.55, 0.5)),
        # (0.5 - 0.1) - (0.3 - 0.1) = 0.2; 0.5 - 0.6 = -0.1; 0.3 - 0.4 = -0.1
        run(1, (0.1, 0.1), (0.5, 0.3), (0.6, 0.4)),
    ]
    summary = {s["contrast"]: s for s in control_summary(rows)}
    lift = summary["lift_beyond_matched"]
    assert lift["values"] == pytest.approx([0.1, 0.2])
    # mean 0.15, sd of (0.1, 0.2) = 0.0707; 95% t with 1 degree of freedom: 12.706 x 0.0707 / sqrt(2) = 0.6353
    assert lift["mean"] == pytest.approx(0.15) and lift["sd"] == pytest.approx(0.0707, abs=1e-4)
    assert lift["ci95"] == pytest.approx([0.15 - 0.6353, 0.15 + 0.6353], abs=1e-4)
    assert summary["replayed_minus_base"]["values"] == pytest.approx([0.05, -0.1])
    assert summary["matched_minus_base"]["values"] == pytest.approx([0.0, -0.1])
    table = summary_markdown(control_summary(rows))
    assert "| +0.150 (sd 0.071) [-0.485, +0.785] | +0.100, +0.200 |" in table


def test_one_seed_has_no_interval_and_a_missing_matched_set_is_left_out():
    rows = [run(0, (0.2, None), (0.6, None), (0.55, None))]
    summary = {s["contrast"]: s for s in control_summary(rows)}
    assert set(summary) == {"replayed_minus_base"}  # the two contrasts that need the matched set have no value
    assert summary["replayed_minus_base"]["ci95"] is None and summary["replayed_minus_base"]["sd"] is None
