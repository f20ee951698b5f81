"""The draw (exgrpo_trl.draw): every rule in one function, on hand-made buffers; numbers derived in the comments."""

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import ExperienceBuffer, Trajectory
from exgrpo_trl.draw import choose_questions, draw, drop_old, question_priority
from exgrpo_trl.settings import ExGRPOSettings

EOS = 1


def traj(first, collected_at, advantage=None, length=2):
    return Trajectory(np.array([first] * (length - 1) + [EOS]), np.full(length, -0.5), collected_at,
                      advantage=advantage)  # fmt: skip


def buffer_of(settings, questions, k=4):
    """questions: key -> (bucket, [trajectories])."""
    buffer = ExperienceBuffer(k, settings, seed=0)
    for key, (bucket, trajectories) in questions.items():
        buffer.update_group(key, bucket, {"prompt": key}, trajectories)
    return buffer


def test_the_age_limit_drops_what_is_older_than_n_batches():
    # at clock 6 with replay_max_age 2: ages 6 - 0 = 6, 6 - 3 = 3, 6 - 5 = 1: only the trajectory of batch 5 stays
    # (age 1 <= 2); question "r" holds only one of batch 1 (age 5): it leaves the buffer, not retired
    settings = ExGRPOSettings(replay_max_age=2)
    buffer = buffer_of(settings, {"q": (2, [traj(10, 0), traj(11, 3), traj(12, 5)]), "r": (2, [traj(13, 1)])})
    assert drop_old(buffer, settings, 6) == 3
    assert [t.collected_at for t in buffer.questions["q"].trajectories] == [5]
    assert "r" not in buffer and "r" not in buffer.retired and buffer.bucket_counts()[2] == 1
    # age exactly N is kept: at clock 7 the batch-5 trajectory is 2 old
    assert drop_old(buffer, settings, 7) == 0
    # no limit: nothing dropped, however old
    plain = buffer_of(ExGRPOSettings(), {"q": (2, [traj(10, 0)])})
    assert drop_old(plain, plain.settings, 10_000) == 0 and "q" in plain


def test_the_draw_applies_the_age_limit_before_choosing():
    # one replayed group of 2 (replay_ratio 0.5): at clock 4, "old" (collected at 0, age 4 > 3) cannot be drawn,
    # so the one question drawn is "new", whatever the generator says
    settings = ExGRPOSettings(replay_max_age=3)
    for seed in range(5):
        buffer = buffer_of(settings, {"old": (2, [traj(10, 0)]), "new": (2, [traj(11, 2)])})
        buffer.rng = np.random.Generator(np.random.PCG64(seed))
        plan = draw(buffer, settings, 2, 4)
        assert plan.keys == ["new"] and plan.collected_at == [2] and "old" not in buffer


def test_the_use_cap_retires_a_trajectory_replayed_n_times():
    # replay_max_uses 2, one question with one trajectory, one replayed group a batch: batch 0 uses it once (uses 1,
    # kept), batch 1 twice (uses 2 = the cap: it leaves, and its question with it); batch 2 draws nothing
    settings = ExGRPOSettings(replay_max_uses=2)
    buffer = buffer_of(settings, {"q": (2, [traj(10, 0)])})
    first = draw(buffer, settings, 2, 0)
    assert first.keys == ["q"] and first.uses == [1] and buffer.questions["q"].trajectories[0].uses == 1
    second = draw(buffer, settings, 2, 1)
    assert second.uses == [2] and "q" not in buffer and "q" not in buffer.retired
    assert draw(buffer, settings, 2, 2) is None
    # without a cap the count goes on and nothing leaves
    plain = buffer_of(ExGRPOSettings(), {"q": (2, [traj(10, 0)])})
    assert [draw(plain, plain.settings, 2, c).uses for c in range(3)] == [[1], [2], [3]] and "q" in plain


def test_uses_are_counted_on_the_chosen_trajectory_only():
    # two candidates, scored entropies 0.9 and 0.2: the lowest (the second) is chosen and counted
    settings = ExGRPOSettings()
    buffer = buffer_of(settings, {"q": (2, [traj(10, 0), traj(11, 1)])})
    plan = draw(buffer, settings, 2, 2, score=lambda rows, prompts, ids, masks: torch.tensor([0.9, 0.2]))
    assert plan.selected_entropies == [pytest.approx(0.2)] and plan.collected_at == [1]
    assert [t.uses for t in buffer.questions["q"].trajectories] == [0, 1]


def test_advantage_priority_draws_in_proportion_to_the_latest_success():
    # latest stored advantages 0.75, -0.25 (|.| 0.25) and 0.5 (an earlier 0.1 of "c" is not its latest): weights
    # 0.75 : 0.25 : 0.5, probabilities 0.5, 1/6, 1/3. 6,000 single draws: each frequency within 0.03 (sd of a share
    # near 0.5 over 6,000 draws is sqrt(0.25 / 6000) = 0.0065; 0.03 is 4.6 sd)
    settings = ExGRPOSettings(replay_priority="advantage")
    buffer = buffer_of(settings, {"a": (1, [traj(10, 0, 0.75)]), "b": (3, [traj(11, 0, -0.25)]),
                                  "c": (2, [traj(12, 0, 0.1), traj(13, 1, 0.5)])})  # fmt: skip
    assert [question_priority(buffer, q) for q in "abc"] == [0.75, 0.25, 0.5]
    counts = dict.fromkeys("abc", 0)
    for _ in range(6000):
        (key,) = choose_questions(buffer, 1, 0)
        counts[key] += 1
    for q, p in zip("abc", (0.5, 1 / 6, 1 / 3)):
        assert abs(counts[q] / 6000 - p) < 0.03, counts
    # two of three drawn without replacement: always distinct
    assert all(len(set(choose_questions(buffer, 2, 0))) == 2 for _ in range(100))


def test_advantage_priority_without_a_recorded_advantage():
    # a trajectory seeded from an export, or from an older state, has none: its question counts as a success of its
    # bucket under unscaled rewards, 1 - k / K: k = 1 of K = 4 -> 0.75, k = 3 -> 0.25
    settings = ExGRPOSettings(replay_priority="advantage")
    buffer = buffer_of(settings, {"a": (1, [traj(10, 0)]), "b": (3, [traj(11, 0)])})
    assert [question_priority(buffer, q) for q in "ab"] == [0.75, 0.25]


def test_the_reuse_limit_still_applies_under_advantage_priority():
    # replay_cooldown 1: a question replayed at clock 0 sits out clock 1; with two questions and one drawn a batch,
    # batches alternate whatever the weights
    settings = ExGRPOSettings(replay_priority="advantage", replay_cooldown=1)
    buffer = buffer_of(settings, {"a": (1, [traj(10, 0, 0.9)]), "b": (3, [traj(11, 0, 0.1)])})
    keys = [draw(buffer, settings, 2, c).keys[0] for c in range(1, 7)]
    assert all(x != y for x, y in zip(keys, keys[1:])), keys


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("replay_max_age", 0, "replay_max_age must be None or an integer >= 1 (generation batches), got 0."),
        ("replay_max_age", 2.5, "replay_max_age must be None or an integer >= 1"),
        ("replay_max_uses", -1, "replay_max_uses must be None or an integer >= 1 (replays), got -1."),
        ("replay_priority", "entropy", "replay_priority must be one of ('gaussian', 'advantage'), got 'entropy'."),
    ],
)
def test_out_of_range_is_one_line_naming_the_setting(field, value, message):
    with pytest.raises(ValueError) as info:
        ExGRPOSettings(**{field: value})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_advantage_priority_and_uniform_selection_conflict():
    with pytest.raises(ValueError, match="replay_priority 'advantage' replaces question_selection's rule"):
        ExGRPOSettings(replay_priority="advantage", question_selection="uniform")
