"""ExperienceBuffer: bucket probabilities, capped sampling, retirement, de-duplication, RNG isolation (§2-5)."""

import math
import random

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import (
    ExperienceBuffer,
    Trajectory,
    gaussian_bucket_probabilities,
    question_key,
    shortlist_candidates,
)
from exgrpo_trl.draw import choose_questions
from exgrpo_trl.settings import ExGRPOSettings


def traj(*ids, step=0):
    return Trajectory(np.array(ids), np.full(len(ids), -0.5), step)


def filled(sizes: dict[int, int], seed=0, k=8, **kwargs) -> ExperienceBuffer:
    """A buffer with sizes[b] questions in bucket b, named 'b<b>-<i>', one trajectory each."""
    buffer = ExperienceBuffer(k, ExGRPOSettings(**kwargs), seed=seed)
    for bucket, size in sizes.items():
        for i in range(size):
            buffer.update_group(f"b{bucket}-{i}", bucket, {"prompt": f"b{bucket}-{i}"}, [traj(bucket, i)])
    return buffer


def test_bucket_probabilities_k8_match_spec():
    # §5: weight(k) = exp(-(k - 4)^2 / 2) for K=8, mu=.5, sigma=1: 1, e^-.5=.60653, e^-2=.13534, e^-4.5=.011109;
    # sum = 1 + 2 * (.60653 + .13534 + .011109) = 2.50596; p4 = .39905, p3 = .24204, p2 = .05401, p1 = .00443.
    expected = {1: 0.0044, 2: 0.0540, 3: 0.2420, 4: 0.3990, 5: 0.2420, 6: 0.0540, 7: 0.0044}
    probs = gaussian_bucket_probabilities(range(1, 8), 8, mu=0.5, sigma=1.0)
    assert set(probs) == set(expected)
    for k, p in expected.items():
        assert probs[k] == pytest.approx(p, abs=1e-3)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-12)
    # The same through a buffer whose every bucket holds questions (sizes differ: probabilities must not).
    buffer_probs = filled({1: 1, 2: 5, 3: 2, 4: 9, 5: 1, 6: 3, 7: 4}).bucket_probabilities()
    for k in expected:
        assert buffer_probs[k] == pytest.approx(probs[k], abs=1e-12)


def test_empty_buckets_renormalise():
    # Non-empty {3, 4, 7}: weights e^-.5 = .606531, 1, e^-4.5 = .011109; sum 1.617640.
    probs = filled({3: 2, 4: 1, 7: 5}).bucket_probabilities()
    assert set(probs) == {3, 4, 7}
    assert probs[3] == pytest.approx(0.606531 / 1.617640, abs=1e-6)
    assert probs[4] == pytest.approx(1.0 / 1.617640, abs=1e-6)
    assert probs[7] == pytest.approx(0.011109 / 1.617640, abs=1e-6)


def test_sampling_caps_buckets_and_never_repeats():
    # 13 questions: 2 in bucket 4, 1 in bucket 3, 10 in bucket 1. Asking for 12 forces the caps: buckets 4 and 3
    # (together ~64% of the mass) give all they have, the remaining 9 come from bucket 1.
    buffer = filled({4: 2, 3: 1, 1: 10})
    for _ in range(20):
        picked = choose_questions(buffer, 12, clock=0)
        assert len(picked) == len(set(picked)) == 12
        per_bucket = {b: sum(key.startswith(f"b{b}-") for key in picked) for b in (1, 3, 4)}
        assert per_bucket == {4: 2, 3: 1, 1: 9}
    assert sorted(choose_questions(buffer, 100, clock=0)) == sorted(buffer.questions)  # capped at the buffer's size


def test_sampling_frequencies_follow_bucket_probabilities():
    buffer = filled(dict.fromkeys(range(1, 8), 40), seed=3)
    probs = buffer.bucket_probabilities()
    draws = 20000
    counts = dict.fromkeys(range(1, 8), 0)
    for _ in range(draws):
        (key,) = choose_questions(buffer, 1, clock=0)
        counts[int(key[1])] += 1
    for b, p in probs.items():
        sigma = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[b] / draws - p) < 4.5 * sigma + 1e-4, (b, counts[b] / draws, p)


def test_uniform_question_selection_ignores_buckets():
    buffer = filled({1: 30, 4: 30}, question_selection="uniform", seed=1)
    draws = 4000
    bucket1 = sum(choose_questions(buffer, 1, clock=0)[0].startswith("b1-") for _ in range(draws))
    # uniform over 60 questions: P(bucket 1) = .5, sigma = sqrt(.25 / 4000) = .0079
    assert abs(bucket1 / draws - 0.5) < 4.5 * 0.0079


def test_sampling_reproducible_from_seed_and_leaves_global_rngs_alone():
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    before = (torch.get_rng_state().clone(), np.random.get_state()[1].copy(), random.getstate())
    a = [choose_questions(filled({1: 5, 3: 5, 4: 5, 6: 5}, seed=7), 6, clock=0) for _ in range(2)]
    b = filled({1: 5, 3: 5, 4: 5, 6: 5}, seed=8)
    b_draws = [choose_questions(b, 6, clock=0) for _ in range(5)]
    after = (torch.get_rng_state(), np.random.get_state()[1], random.getstate())
    assert a[0] == a[1]  # same seed, same contents: same draw
    assert any(d != a[0] for d in b_draws)  # another seed draws differently
    assert torch.equal(before[0], after[0])
    assert np.array_equal(before[1], after[1])
    assert before[2] == after[2]


def test_update_group_buckets_retirement_and_dedup():
    buffer = ExperienceBuffer(8)
    row = {"prompt": "1+1=", "answer": "2"}
    assert buffer.update_group("q", 3, row, [traj(1, 2), traj(1, 2), traj(3)]) == 2  # the duplicate is dropped
    assert buffer.bucket_counts()[3] == 1 and buffer.num_trajectories == 2
    assert buffer.update_group("q", 5, row, [traj(3), traj(4, 5)]) == 1  # (3,) is already stored
    assert buffer.questions["q"].k == 5 and buffer.num_trajectories == 3
    assert buffer.update_group("q", 0) == 0  # 0/K: the entry keeps its bucket and trajectories
    assert buffer.questions["q"].k == 5 and buffer.num_trajectories == 3
    assert buffer.update_group("new", 2, {"prompt": "x"}, []) == 0 and "new" not in buffer  # needs a trajectory
    buffer.update_group("q", 8)  # K/K: retired, removed
    assert "q" not in buffer and buffer.retired == {"q"} and buffer.num_trajectories == 0
    assert buffer.update_group("q", 4, row, [traj(9)]) == 0 and "q" not in buffer  # retirement is permanent
    assert choose_questions(buffer, 3, clock=0) == []
    with pytest.raises(ValueError, match="success count"):
        buffer.update_group("q", 9)


def test_trajectory_storage_is_six_bytes_per_token():
    t = Trajectory(np.arange(10), np.linspace(-3, 0, 10), collected_at=4)
    assert t.completion_ids.dtype == np.int32 and t.logps.dtype == np.float16
    assert t.completion_ids.nbytes + t.logps.nbytes == 60
    with pytest.raises(ValueError, match="same length"):
        Trajectory(np.arange(3), np.zeros(2), 0)


def test_question_key_is_stable_and_distinguishes_prompts():
    assert question_key("1+1=") == question_key("1+1=")
    assert question_key("1+1=") != question_key("1+2=")
    messages = [{"role": "user", "content": "hi"}]
    assert question_key(messages) == question_key([{"content": "hi", "role": "user"}])
    assert len(question_key(messages)) == 32


def test_shortlist_keeps_the_lowest_stored_nll_in_stored_order():
    # Stored NLL = mean of -logp over each trajectory's tokens (float16 values exact in binary):
    #   t0: -(-1.0 - 3.0) / 2 = 2.0    t1: 0.5    t2: -(-3.0) = 3.0    t3: -(-0.25 - 1.75) / 2 = 1.0
    #   t4: 0.5 (ties with t1; t4 is newer)
    logps = [[-1.0, -3.0], [-0.5], [-3.0, -3.0, -3.0], [-0.25, -1.75], [-0.5, -0.5]]
    trajs = [Trajectory(np.arange(len(lp)) + 3, np.array(lp), step) for step, lp in enumerate(logps)]

    def picked(m, highest=False):
        return [t.collected_at for t in shortlist_candidates(trajs, m, highest)]

    assert picked(1) == [4]  # t1 and t4 tie at 0.5: the newer one
    assert picked(2) == [1, 4]
    assert picked(3) == [1, 3, 4]  # then t3 (1.0); returned in stored order, not by rank
    assert picked(4) == [0, 1, 3, 4]
    assert picked(1, highest=True) == [2]  # 3.0
    assert picked(2, highest=True) == [0, 2]  # then t0 (2.0)
    assert picked(5) == picked(9) == picked(None) == [0, 1, 2, 3, 4]  # no cap to apply


def test_reuse_limit_by_hand():
    # replay_cooldown N = 2: a question replayed in generation batch b sits out b+1 and b+2 and is eligible again in
    # b+3. 4 questions, 3 asked for per batch (draws are closed by mark_replayed, as draw_questions does):
    #   batch 0: all 4 eligible -> 3 drawn (A)          batch 1: only the 4th (not in A) is eligible -> 1 drawn
    #   batch 2: none eligible (A sat out 1, 2; the 4th sits out 2, 3) -> 0 drawn: every group of the batch is fresh
    #   batch 3: A eligible again (3 - 0 > 2), the 4th not (3 - 1 = 2) -> exactly A again
    buffer = filled({3: 2, 4: 2}, replay_cooldown=2)
    first = choose_questions(buffer, 3, clock=0)
    assert len(first) == 3 and buffer.mark_replayed(first, clock=0) == [False] * 3
    second = choose_questions(buffer, 3, clock=1)
    assert second == sorted(set(buffer.questions) - set(first)) and buffer.mark_replayed(second, clock=1) == [False]
    assert choose_questions(buffer, 3, clock=2) == [] and buffer.mark_replayed([], clock=2) == []
    fourth = choose_questions(buffer, 3, clock=3)
    assert sorted(fourth) == sorted(first)
    assert buffer.mark_replayed(fourth, clock=3) == [False] * 3  # replayed in batch 0, not in batch 2: no repeat
    assert (buffer.replayed_at[second[0]], buffer.replayed_at[first[0]]) == (1, 3)
    # the clock is the run's: batches before replay started (no draw) count too, 10 - 3 > 2
    assert sorted(choose_questions(buffer, 4, clock=10)) == sorted(buffer.questions)


def test_reuse_limit_gaussian_over_eligible_buckets_and_repeat_flags():
    # Bucket 4 (weight 1) holds 1 question, bucket 1 (weight e^-4.5) holds 5. Without a limit a draw of 1 almost
    # always takes bucket 4's question, and every draw after the first is a repeat (batch b-1 had it too).
    plain = filled({4: 1, 1: 5}, seed=1)
    flags = [plain.mark_replayed(choose_questions(plain, 1, clock=b), clock=b) for b in range(50)]
    assert sum(f == [True] for f in flags) >= 45
    # With a limit of 1 it can be drawn at most every other batch; in between, the Gaussian renormalises over the
    # buckets that hold an eligible question (bucket 1 alone): a draw never comes back empty, never repeats.
    limited = filled({4: 1, 1: 5}, seed=1, replay_cooldown=1)
    drawn = []
    for b in range(50):
        keys = choose_questions(limited, 1, clock=b)
        assert len(keys) == 1 and limited.mark_replayed(keys, clock=b) == [False]
        drawn += keys
    assert all(a != b for a, b in zip(drawn, drawn[1:]))
    assert drawn.count("b4-0") >= 20  # taken at nearly every draw it is eligible for (p = 1 / (1 + e^-4.5) = .989)


def test_reuse_limit_is_state_and_off_changes_nothing():
    # Draws are the same whatever the clock says when there is no limit (the paper): same seed, same keys.
    a, b = filled({2: 6, 4: 6, 6: 6}, seed=7), filled({2: 6, 4: 6, 6: 6}, seed=7)
    for t in range(5):
        keys = choose_questions(a, 4, clock=t)
        a.mark_replayed(keys, clock=t)
        assert keys == choose_questions(b, 4, clock=100 + t)
    # When questions were replayed is saved and restored: a restored buffer with a limit draws what the original draws
    c = filled({2: 6, 4: 6, 6: 6}, seed=7, replay_cooldown=3)
    for t in range(3):
        c.mark_replayed(choose_questions(c, 4, clock=t), clock=t)
    arrays, meta = c.state_dict()
    assert meta["clock"] == "generation_batches" and meta["config"]["cooldown"] == 3  # the key states always had
    d = ExperienceBuffer(8, ExGRPOSettings(replay_cooldown=3))
    d.load_state_dict(arrays, meta)
    assert d.replayed_at == c.replayed_at and max(d.replayed_at.values()) == 2
    assert choose_questions(d, 6, clock=3) == choose_questions(c, 6, clock=3)
    # a retired question leaves the record; the limit is named by its option when a resume changes it
    key = next(iter(c.replayed_at))
    c.retire(key)
    assert key not in c.replayed_at
    e = ExperienceBuffer(8, ExGRPOSettings(replay_cooldown=5))
    assert e.config_changes(meta["config"]) == {"replay_cooldown": (3, 5)}
    del meta["config"]["cooldown"]  # written before the option: read as no limit
    assert e.config_changes(meta["config"]) == {"replay_cooldown": (0, 5)}


def test_a_state_that_counted_draws_is_moved_onto_the_clock():
    # Written before the clock counted generation batches: draws 0-2 (replay on from batch 4 of the run, which had
    # made 7 batches when saved: draw d is batch d + 4), trajectories stamped with the optimizer step (2 per batch).
    buffer = filled({3: 2, 4: 2}, replay_cooldown=2)
    keys = list(buffer.questions)
    arrays, meta = buffer.state_dict()
    arrays["collected_at"] = np.array([0, 6, 10, 13])
    old = {k: v for k, v in meta.items() if k not in ("clock", "recent")}
    old |= {"draws": 3, "replayed_at": {keys[0]: 1, keys[1]: 2}, "recent_draws": [[keys[2]], [keys[0]], [keys[1]]]}
    restored = ExperienceBuffer(8, ExGRPOSettings(replay_cooldown=2))
    restored.load_state_dict(arrays, old, clock=7, updates_per_batch=2)
    assert restored.replayed_at == {keys[0]: 5, keys[1]: 6}  # + (7 - 3)
    assert list(restored.recent) == [(4, [keys[2]]), (5, [keys[0]]), (6, [keys[1]])]
    assert [t.collected_at for t in restored.iter_trajectories()] == [0, 3, 5, 6]  # step // 2
    assert sorted(choose_questions(restored, 4, clock=7)) == sorted(keys[2:])  # keys 0, 1 sit out batch 7 (7 - 6 <= 2)
    restored.load_state_dict(arrays, {k: v for k, v in old.items() if k not in ("draws", "replayed_at")})
    assert restored.replayed_at == {} and [t.collected_at for t in restored.iter_trajectories()] == [0, 6, 10, 13]


def test_reuse_is_replays_per_distinct_question_over_the_window_and_is_state():
    buffer = filled({3: 3})
    a, b, c = list(buffer.questions)
    assert buffer.reuse() is None  # nothing drawn yet
    buffer.mark_replayed([a, b], clock=0)
    assert buffer.reuse() == 1.0  # 2 replays of 2 questions
    buffer.mark_replayed([a, c], clock=1)
    buffer.mark_replayed([a], clock=2)
    buffer.mark_replayed([], clock=3)  # a batch that replayed nothing
    assert buffer.reuse() == pytest.approx(5 / 3)  # a three times, b and c once: 5 replays of 3 questions
    # the window holds the last REUSE_WINDOW (50) generation batches: 46 more draws of c, batches 4-49
    for t in range(4, 50):
        buffer.mark_replayed([c], clock=t)
    assert buffer.reuse() == pytest.approx((5 + 46) / 3)
    buffer.mark_replayed([c], clock=50)  # batch 50 pushes out batch 0 ([a, b]): a twice, c 48 times, b gone
    assert buffer.reuse() == pytest.approx((2 + 48) / 2)
    # a retired question's replays stay in the window (they happened), and the window is saved and restored
    buffer.retire(a)
    arrays, meta = buffer.state_dict()
    restored = ExperienceBuffer(8)
    restored.load_state_dict(arrays, meta)
    assert list(restored.recent) == list(buffer.recent) and restored.reuse() == pytest.approx(25.0)
    # batches with no draw (replay not started) leave the window by the clock: 60 batches later it is empty
    buffer.mark_replayed([], clock=110)
    assert buffer.reuse() is None
    # a state saved before the figure existed restores with an empty window
    old = {k: v for k, v in meta.items() if k not in ("recent", "clock")}
    restored.load_state_dict(arrays, old)
    assert restored.reuse() is None and len(restored.recent) == 0
