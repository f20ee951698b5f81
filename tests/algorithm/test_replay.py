"""The pure replay bookkeeping (exgrpo_trl.replay) on hand-made inputs, without a trainer or a model."""

import math

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import ExperienceBuffer, Trajectory, question_key
from exgrpo_trl.draw import draw_questions, select_lowest
from exgrpo_trl.replay import (
    GroupOutcome,
    ReplayPlan,
    ReplayQuestion,
    StoredRow,
    assign_rows,
    batch_outcome,
    collect,
    commit,
    replay_count,
)
from exgrpo_trl.sampler import SkipRetiredSampler
from exgrpo_trl.settings import ExGRPOSettings

EOS = 1


def traj(ids, logps, step=0):
    return Trajectory(np.array(ids), np.array(logps), step)


def test_replay_count():
    # floor(0.5 * 6) = 3; capped by the buffer's 2 questions; floor(0.7 * 3) = floor(2.1) = 2; rho 0 -> 0
    assert replay_count(10, 0.5, 6) == 3
    assert replay_count(2, 0.5, 6) == 2
    assert replay_count(10, 0.7, 3) == 2
    assert replay_count(10, 0.0, 6) == 0
    assert replay_count(10, 1.0, 3) == 3


def test_select_lowest_takes_the_first_on_ties():
    scores = torch.tensor([3.0, 1.0, 1.0, 2.0])
    assert select_lowest(scores) == 1
    assert select_lowest(scores, highest=True) == 0


def draw(buffer, clock=0, **settings):
    """Draw one generation batch of 2 groups at the paper's replay ratio 0.5 (one replayed question) in `clock`."""
    return draw_questions(buffer, ExGRPOSettings(**settings), 2, clock)


def one_question_buffer(nlls):
    """A buffer (K = 4) holding one question whose i-th trajectory has a stored NLL of nlls[i] (one token each)."""
    buffer = ExperienceBuffer(4, seed=0)
    trajectories = [traj([10 + i, EOS], [-nll, -nll]) for i, nll in enumerate(nlls)]
    buffer.update_group("q", 2, {"prompt": "q"}, trajectories)
    return buffer


def test_draw_shortlists_by_stored_likelihood():
    # stored NLLs 0.5, 0.1, 0.9, 0.3 (float16-exact); the 2 lowest are 0.1 (index 1) and 0.3 (index 3), kept in
    # stored order; the 2 highest are 0.9 (index 2) and 0.5 (index 0)
    buffer = one_question_buffer([0.5, 0.125, 0.875, 0.25])
    (drawn,) = draw(buffer, max_trajectory_candidates=2)
    assert drawn.key == "q" and drawn.row == {"prompt": "q"}
    assert [t.completion_ids[0] for t in drawn.candidates] == [11, 13]
    (drawn,) = draw(buffer, trajectory_selection="highest_entropy", max_trajectory_candidates=2)
    assert [t.completion_ids[0] for t in drawn.candidates] == [10, 12]
    (drawn,) = draw(buffer, max_trajectory_candidates=None)
    assert [t.completion_ids[0] for t in drawn.candidates] == [10, 11, 12, 13]
    assert draw_questions(buffer, ExGRPOSettings(replay_ratio=0.5), 1, 0) == []  # floor(0.5 x 1) = 0


def test_draws_carry_bucket_and_repeat_into_the_plan():
    # One question in bucket 2 (2 of 4): drawn in three consecutive batches it is a repeat from the second on; with
    # a reuse limit of 1 it sits out the second batch (nothing drawn: the plan is empty) and is no repeat in the third.
    buffer = one_question_buffer([0.5])
    plans = []
    for clock in range(3):
        drawn = draw(buffer, clock)
        plans.append(ReplayPlan.build(drawn, [0] * len(drawn), num_groups=3, clock=clock))
    assert [(p.buckets, p.repeats, p.repeat_share) for p in plans] == [([2], [False], 0.0), ([2], [True], 1.0)] * 1 + [
        ([2], [True], 1.0)
    ]
    assert [(p.clock, p.collected_at) for p in plans] == [(0, [0]), (1, [0]), (2, [0])]  # collected in batch 0
    limited = one_question_buffer([0.5])
    limited.settings = ExGRPOSettings(replay_cooldown=1)
    sizes = [[(q.bucket, q.repeat) for q in draw(limited, clock, replay_cooldown=1)] for clock in range(3)]
    assert sizes == [[(2, False)], [], [(2, False)]]


def test_draw_random_picks_one_by_the_buffer_generator():
    buffer = one_question_buffer([0.5, 0.125, 0.875, 0.25])
    expected = np.random.default_rng(0)  # the buffer's own generator, seeded 0: same draws in the same order
    expected.choice(1)  # choose_questions draws the question first (one question: index 0)
    (drawn,) = draw(buffer, trajectory_selection="random", max_trajectory_candidates=2)
    assert len(drawn.candidates) == 1  # the cap does not apply: one uniform draw over all four
    assert drawn.candidates[0].completion_ids[0] in (10, 11, 12, 13)


def test_plan_build_replays_the_last_groups():
    drawn = [
        ReplayQuestion("a", {"prompt": "a"}, [traj([5, EOS], [-0.5, -0.25]), traj([6, 7, EOS], [-1.0, -2.0, -0.5])]),
        ReplayQuestion("b", {"prompt": "b"}, [traj([8, EOS], [-0.75, -0.125])]),
    ]
    plan = ReplayPlan.build(drawn, chosen=[1, 0], num_groups=4, clock=5, selected_entropies=[0.3])
    assert plan.group_indices == [2, 3]  # 4 groups, 2 replayed: the last two
    assert plan.keys == ["a", "b"] and plan.rows == [{"prompt": "a"}, {"prompt": "b"}]
    assert plan.completion_ids == [[6, 7, EOS], [8, EOS]]
    assert plan.behaviour_logps[0].dtype == torch.float32
    assert plan.behaviour_logps[0].tolist() == [-1.0, -2.0, -0.5]
    assert plan.behaviour_logps[1].tolist() == [-0.75, -0.125]
    assert plan.selected_entropies == [0.3]


def plan_for(groups, num_groups, k):
    """A plan replaying `groups` (the last ones of `num_groups`), group g's question "replayed-g" with the stored
    trajectory [100 + g, EOS]."""
    assert list(groups) == list(range(num_groups - len(groups), num_groups))
    questions = [ReplayQuestion(f"r{g}", {"prompt": f"replayed-{g}"}, []) for g in groups]
    return ReplayPlan(questions, [traj([100 + g, EOS], [0.0, 0.0]) for g in groups], num_groups, clock=0)


def test_assign_rows_on_two_ranks_with_a_group_spanning_both():
    # K = 4, 3 groups = 12 global rows, 2 ranks of 6: rank 0 holds rows 0-5, rank 1 rows 6-11. Groups 1 (rows 4-7)
    # and 2 (rows 8-11) are replayed; group 1 starts on rank 0 (local 4), so its stored trajectory goes there.
    k, plan = 4, plan_for([1, 2], 3, 4)
    fresh = [{"prompt": f"fresh-{i}"} for i in range(6)]
    rank0 = assign_rows(fresh, plan, process_index=0, k=k)
    assert [x["prompt"] for x in rank0.inputs] == ["fresh-0", "fresh-1", "fresh-2", "fresh-3"] + ["replayed-1"] * 2
    assert rank0.replay_rows == [-1, -1, -1, -1, 0, -1]
    assert rank0.splice == {4: [101, EOS]}
    rank1 = assign_rows(fresh, plan, process_index=1, k=k)
    assert [x["prompt"] for x in rank1.inputs] == ["replayed-1"] * 2 + ["replayed-2"] * 4
    assert rank1.replay_rows == [-1, -1, 1, -1, -1, -1]
    assert rank1.splice == {2: [102, EOS]}
    assert rank1.is_replayed(2) and not rank1.is_replayed(0)
    assert fresh[0] == {"prompt": "fresh-0"}  # the caller's rows are not modified
    # revisiting without the stored trajectory: the same rows get the questions, none is reserved
    revisit = plan_for([1, 2], 3, 4)
    revisit.with_trajectories = False
    rank1 = assign_rows(fresh, revisit, process_index=1, k=k)
    assert [x["prompt"] for x in rank1.inputs] == ["replayed-1"] * 2 + ["replayed-2"] * 4
    assert rank1.replay_rows == [-1] * 6 and rank1.splice == {}
    none = assign_rows(fresh, None, process_index=0, k=k)
    assert none.inputs == fresh and none.replay_rows == [-1] * 6 and none.splice == {}


def test_batch_outcome_by_weighted_total():
    # 2 reward functions weighted 1 and 0.5, threshold 1.0, K = 4:
    # row totals: 1+0=1 (solved), 0+1=0.5, 0.5+1=1.0 (solved), 0+0=0 | nan+2=1.0 (solved), nan,nan (never), 2+0=2
    # (solved), 0.8+0.1=0.9 -> group successes [2, 2], pass@1 4/8
    rewards = torch.tensor(
        [[1.0, 0.0], [0.0, 1.0], [0.5, 1.0], [0.0, 0.0], [math.nan, 2.0], [math.nan, math.nan], [2.0, 0.0], [0.8, 0.2]]
    )
    outcome = batch_outcome(rewards, torch.tensor([1.0, 0.5]), 1.0, 4)
    assert outcome.solved.tolist() == [True, False, True, False, True, False, True, False]
    assert outcome.successes == [2, 2]
    assert outcome.pass_at_1 == 0.5
    # a row whose every reward is NaN is not solved even at threshold 0 (its nansum is 0)
    assert batch_outcome(rewards, torch.tensor([1.0, 0.5]), 0.0, 4).solved.tolist()[5] is False


def test_collect_stores_solved_untruncated_fresh_rows_of_mixed_groups():
    # K = 4, one rank, 3 groups. Group 0: rows 0 and 2 solved (k = 2), row 2 truncated (no stop token at the end).
    # Group 1: all solved (k = 4): retired, nothing stored. Group 2: replayed (row 8 carries the stored trajectory),
    # rows 8 and 9 solved (k = 2): only the fresh row 9 is stored.
    k = 4
    inputs = [{"prompt": "p0"}] * 4 + [{"prompt": "p1"}] * 4 + [{"prompt": "p2"}] * 4
    rows = assign_rows(inputs, None, process_index=0, k=k)
    rows.replay_rows[8] = 0
    solved = [1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    outcome = batch_outcome(torch.tensor(solved, dtype=torch.float32)[:, None], torch.ones(1), 1.0, k)
    completions = [[5, EOS]] * 12
    completions[2] = [5, 6]  # truncated
    pending = collect(
        rows,
        outcome,
        completions,
        process_index=0,
        k=k,
        collecting=True,
        stop_ids={EOS, 0},
        micro_batches_left=2,
        clock=7,
    )
    assert [(g.group, g.key, g.k, g.row) for g in pending.groups] == [
        (0, question_key("p0"), 2, {"prompt": "p0"}),
        (1, question_key("p1"), 4, None),  # K/K: retired, no row kept
        (2, question_key("p2"), 2, {"prompt": "p2"}),
    ]
    assert {local: (r.global_row, r.key) for local, r in pending.rows.items()} == {
        0: (0, question_key("p0")),
        9: (9, question_key("p2")),
    }
    assert pending.micro_batches_left == 2 and pending.collected_at == 7 and pending.take_recorded() == []
    # before the delayed start: groups are reported (retirement works from step 1) but nothing is kept or stored
    off = collect(
        rows,
        outcome,
        completions,
        process_index=0,
        k=k,
        collecting=False,
        stop_ids={EOS, 0},
        micro_batches_left=2,
        clock=7,
    )
    assert [(g.group, g.row) for g in off.groups] == [(0, None), (1, None), (2, None)] and off.rows == {}


def test_collect_reports_a_group_on_the_rank_holding_its_first_row():
    # K = 4, 2 groups over 2 ranks of 4 rows: rank 1's rows are group 1 (global rows 4-7)
    k = 4
    inputs = [{"prompt": "p1"}] * 4
    rows = assign_rows(inputs, None, process_index=1, k=k)
    outcome = batch_outcome(torch.tensor([0, 0, 0, 0, 1, 0, 0, 0.0])[:, None], torch.ones(1), 1.0, k)
    pending = collect(
        rows,
        outcome,
        [[5, EOS]] * 4,
        process_index=1,
        k=k,
        collecting=True,
        stop_ids={EOS},
        micro_batches_left=1,
        clock=0,
    )
    assert [(g.group, g.k) for g in pending.groups] == [(1, 1)]  # group 0 (k = 0, on rank 0) is not reported
    assert {local: r.global_row for local, r in pending.rows.items()} == {0: 4}


def test_commit_applies_every_rank_in_global_row_order():
    k = 4
    rank1 = ([GroupOutcome(1, "b", 1, {"prompt": "b"})], [StoredRow(5, "b", None, [9, EOS], [-0.5, -0.25])])
    rank0 = (
        [GroupOutcome(0, "a", 2, {"prompt": "a"}), GroupOutcome(2, "c", 4, None)],
        [StoredRow(3, "a", None, [8, EOS], [-1.0, -0.5]), StoredRow(1, "a", None, [7, EOS], [-0.25, -0.125])],
    )
    main = ExperienceBuffer(k, seed=0)
    commit(main, [rank1, rank0], collected_at=3, is_main_process=True, k=k)
    assert [t.completion_ids.tolist() for t in main.questions["a"].trajectories] == [[7, EOS], [8, EOS]]  # row 1, 3
    assert main.questions["a"].k == 2 and main.questions["b"].k == 1
    assert main.questions["b"].trajectories[0].collected_at == 3
    assert main.retired == {"c"}
    other = ExperienceBuffer(k, seed=0)
    commit(other, [rank1, rank0], collected_at=3, is_main_process=False, k=k)
    assert other.num_questions == 0 and other.retired == {"c"}  # other ranks keep only the retired set


class PermutationSampler:
    """The parts of TRL's RepeatSampler the wrapper uses: `num_samples`, `batch_size`, a fixed-size epoch."""

    def __init__(self, num_samples, batch_size, seed=0):
        self.num_samples, self.batch_size, self._length = num_samples, batch_size, num_samples
        self.rng = np.random.default_rng(seed)

    def __len__(self):
        return self._length

    def __iter__(self):
        yield from self.rng.permutation(self.num_samples).tolist()


def test_skip_retired_sampler_keeps_the_epoch_length_and_skips_retired():
    prompts = [f"q{i}" for i in range(8)]
    retired = set()
    sampler = SkipRetiredSampler(PermutationSampler(8, 2), lambda: [question_key(q) for q in prompts], retired)
    assert sorted(sampler) == list(range(8))  # nothing retired: the inner order over every row
    retired.update({question_key("q1"), question_key("q6")})
    epoch = list(sampler)
    assert len(epoch) == 8  # the nominal length, so max_steps holds
    assert not {1, 6} & set(epoch)
    assert sorted(epoch[:6]) == [0, 2, 3, 4, 5, 7]  # one full pass over the 6 remaining, then a new pass begins
    assert sampler.passes == [frozenset(retired), frozenset(retired)]


def test_skip_retired_sampler_falls_back_when_less_than_a_batch_remains():
    prompts = [f"q{i}" for i in range(4)]
    retired = {question_key(p) for p in prompts[:3]}
    sampler = SkipRetiredSampler(PermutationSampler(4, 2), lambda: [question_key(q) for q in prompts], retired)
    assert sorted(sampler) == [0, 1, 2, 3]  # 1 question left < a batch of 2: the whole dataset again


@pytest.mark.parametrize("resume_passes", [[frozenset({question_key("q0")})]])
def test_skip_retired_sampler_replays_the_saved_passes(resume_passes):
    prompts = [f"q{i}" for i in range(4)]
    sampler = SkipRetiredSampler(
        PermutationSampler(4, 1), lambda: [question_key(q) for q in prompts], {question_key("q3")}
    )
    sampler.load_state_dict({"epoch": None, "passes": [sorted(p) for p in resume_passes]})  # an older checkpoint's
    epoch = list(sampler)
    assert 0 not in epoch[:3] and sorted(epoch[:3]) == [1, 2, 3]  # the saved pass excluded q0, not today's q3
    assert sampler.resume is None
