"""`ExGRPORun` driven by hand, with plain tensors and a plain config object: no trainer, no TRL.

One generation batch of 4 groups of K = 4 (16 rows, one process): the buffer holds one question Q with two stored
candidates, replay_ratio 0.5 replays min(1 question, floor(0.5 * 4)) = 1 group, the last one (group 3, rows 12-15).
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import Trajectory, question_key
from exgrpo_trl.run import METRIC_PREFIX, BatchKey, ExGRPORun, Ranks

K, EOS, PAD = 4, 1, 0
Q = "Q"  # the buffered question's prompt
CANDIDATES = [[5, 6, EOS], [7, EOS]]  # Q's stored trajectories; the scorer gives the second the lower entropy


def config(**overrides):
    """The ExGRPOConfig fields the run reads, the paper's defaults, as a plain object."""
    fields = dict(
        replay_mu=0.5, replay_sigma=1.0, question_selection="gaussian", seed=0, replay_cooldown=0,
        offline_solutions_column=None, offline_guidance="all_groups", replay_start_pass_rate=None, replays=True,
        skips_retired=True, replay_ratio=0.5, trajectory_selection="lowest_entropy", max_trajectory_candidates=None,
        replay_stored_trajectory=True, success_reward_threshold=1.0, remove_clip_after_replay_start=True,
        policy_shaping_gamma=0.1, replay_importance_correction=True, steps_per_generation=1,
    )  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


def make_run(**overrides) -> ExGRPORun:
    run = ExGRPORun(
        config(**overrides),
        num_generations=K,
        max_completion_length=4,
        loss_type="dr_grpo",
        tokenize_completion=lambda text: [ord(c) for c in text] + [EOS],
        stop_ids={EOS, PAD},
        warn=lambda message: None,
        info=lambda message: None,
    )
    run.buffer.update_group(
        question_key(Q),
        2,
        {"prompt": Q},
        [Trajectory(np.array(c), np.full(len(c), -0.5 - i), 0) for i, c in enumerate(CANDIDATES)],
    )
    return run


def score(rows, prompts, completion_ids, masks):
    """Entropy 0.7 for Q's first candidate and 0.2 for its second (so the second is selected)."""
    assert prompts == [Q, Q] and [list(map(int, c)) for c in completion_ids] == CANDIDATES
    return torch.tensor([0.7, 0.2])


def one_batch(run):
    """Steps 1-3 of one generation batch; the rows solved: group 0 none, group 1 rows 4 and 5, group 2 all four,
    group 3 (replayed) its stored row 12 and row 13."""
    inputs = [{"prompt": f"P{i // K}"} for i in range(4 * K)]
    batch = run.begin_batch(inputs, score)
    completions = [[3, EOS]] * (4 * K)  # every generated row ended by the model
    completions = [list(batch.rows.splice.get(i, c)) for i, c in enumerate(completions)]
    solved = [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
    rewards = torch.tensor(solved, dtype=torch.float32).unsqueeze(1)  # (16, 1)
    run.scored(batch, batch.rows.inputs, [x["prompt"] for x in batch.rows.inputs], [""] * 16, completions, rewards)
    width = max(len(c) for c in completions)
    output = {
        "completion_ids": torch.tensor([c + [PAD] * (width - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions]),
        "advantages": torch.zeros(16),
    }
    run.after_scoring(batch, output, reward_weights=torch.ones(1), micro_batches_left=1, step=7)
    return batch, output


def test_one_generation_batch_by_hand():
    run = make_run()
    batch, output = one_batch(run)
    plan = batch.plan
    assert plan.group_indices == [3] and plan.keys == [question_key(Q)]
    assert plan.completion_ids == [CANDIDATES[1]]  # the lower entropy (0.2 < 0.7)
    assert plan.selected_entropies == pytest.approx([0.2])
    assert [x["prompt"] for x in batch.rows.inputs[12:]] == [Q] * 4 and batch.rows.splice == {12: CANDIDATES[1]}
    # the loss keys: only row 12 carries a stored trajectory, with its behaviour log-probs (-1.5, fp16 exact)
    assert output[BatchKey.REPLAY_MASK].tolist() == [i == 12 for i in range(16)]
    assert output[BatchKey.BEHAVIOUR_LOGPS][12, :2].tolist() == [-1.5, -1.5]
    assert output[BatchKey.UNCLIPPED].all()  # replay active from the start (no delayed start)
    # collected: the solved generated rows of groups with 0 < k < K (group 1: rows 4, 5; group 3: row 13, not 12)
    assert output[BatchKey.COLLECT].nonzero().flatten().tolist() == [4, 5, 13]
    # figures: 1 of 4 groups replayed; Pass@1 = 8 / 16; of the fresh groups (k = 0, 2, 4) one fails throughout
    metrics = {name.removeprefix(METRIC_PREFIX): values for name, values in run.metrics.items()}
    assert metrics["replay/fraction"] == [0.25] and metrics["batch/pass_at_1"] == [0.5]
    assert metrics["batch/fresh_all_fail"] == [pytest.approx(1 / 3)] and metrics["replay/repeat_share"] == [0.0]
    assert metrics["replay/reuse"] == [1.0]  # one replay of one question over the window so far
    assert run.switches == {"replay_active": True, "generation_batches": 1} and run.batch is batch

    # the first loss pass over the batch records the behaviour log-probs and commits (micro_batches_left was 1)
    logps = torch.full(output["completion_ids"].shape, -0.25)
    run.record_behaviour(output, logps)
    assert run.pending is None
    buffer = run.buffer
    assert question_key("P2") in buffer.retired  # 4/4
    assert buffer.questions[question_key("P1")].k == 2
    assert [t.completion_ids.tolist() for t in buffer.questions[question_key("P1")].trajectories] == [[3, EOS]] * 1
    assert buffer.questions[question_key("P1")].trajectories[0].logps.tolist() == [-0.25, -0.25]
    assert buffer.questions[question_key(Q)].k == 2  # row 12 (stored) and row 13 solved
    assert len(buffer.questions[question_key(Q)].trajectories) == 3  # row 13's [3, EOS] joins the two candidates
    assert question_key("P0") not in buffer  # k = 0: nothing stored


def test_replay_term_by_hand():
    """One replayed row of two tokens, w = exp(logp - behaviour) = exp(0) = 1, gamma 0.1: f(w) = 1 / 1.1; A = 2, so
    each token's loss is -2 / 1.1; dr_grpo divides the sum by rows (2) x max_completion_length (4):
    2 x (-2 / 1.1) / 8 = -0.4545..."""
    run = make_run()
    inputs = {
        BatchKey.REPLAY_MASK: torch.tensor([True, False]),
        BatchKey.BEHAVIOUR_LOGPS: torch.tensor([[-0.5, -0.5], [0.0, 0.0]]),
        "completion_mask": torch.ones(2, 2),
        "advantages": torch.tensor([2.0, 5.0]),
    }
    run.replay_token_weights = []
    loss = run.replay_term(inputs, torch.full((2, 2), -0.5), gradient_accumulation_steps=1)
    assert loss.item() == pytest.approx(2 * (-2 / 1.1) / 8, abs=1e-6)
    assert run.replay_token_weights[0].tolist() == [1.0, 1.0]
    assert run.metrics[METRIC_PREFIX + "replay/is_weight_mean"] == [1.0]
    assert run.metrics[METRIC_PREFIX + "replay/shaped_weight_mean"] == [pytest.approx(1 / 1.1)]


def test_delayed_start_and_state_round_trip():
    run = make_run(replay_start_pass_rate=0.6)
    assert run.switches["replay_active"] is False
    batch, output = one_batch(run)
    assert batch.plan is None and BatchKey.REPLAY_MASK not in output  # nothing replayed before the start
    # Pass@1 8 / 16 = 0.5 <= 0.6: still off (only retirement counts; group 2 retired, nothing stored)
    assert run.switches == {"replay_active": False, "generation_batches": 1}
    run.record_behaviour(output, torch.zeros(output["completion_ids"].shape))
    assert question_key("P2") in run.buffer.retired and question_key("P1") not in run.buffer
    state = run.state_dict()
    # no sampler yet, no offline guide; the batch's figures (8 of 16 rows solved, no group replayed, group 0 of
    # the 4 fresh ones failed throughout) and the number of processes that saved it
    latest = {"replay/fraction": 0.0, "batch/pass_at_1": 0.5, "batch/fresh_all_fail": 0.25, "replay/active": 0.0}
    assert state == {"replay_active": False, "generation_batches": 1, "latest": latest, "num_processes": 1}
    other = make_run(replay_start_pass_rate=0.6)
    other.load_state_dict({**state, "generation_batches": 5})
    assert other.switches == {"replay_active": False, "generation_batches": 5}  # the rest is not a switch
    assert other.latest == latest  # the log rows after a resume carry them (`fill_log`)
    older = make_run(replay_start_pass_rate=0.6)  # a state saved before the latest figures were
    older.load_state_dict({"replay_active": True, "generation_batches": 3})
    assert older.switches == {"replay_active": True, "generation_batches": 3} and older.latest == {}


def test_offline_guidance_off_is_a_null_guide():
    run = make_run()
    assert not run.offline.active and run.offline.state_dict() is None
    on = make_run(offline_solutions_column="solution")
    assert on.offline.active and on.state_dict()["offline"] == {"rejected": [], "self_solved": []}


def test_the_run_imports_no_training_framework():
    """Imported in a fresh interpreter: the run module pulls in none of trl, transformers, accelerate."""
    import subprocess

    frameworks = "('trl', 'transformers', 'accelerate')"
    code = f"import sys, exgrpo_trl.run; print(sorted(m for m in {frameworks} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ranks_default_to_one_process():
    ranks = Ranks()
    assert (ranks.process_index, ranks.num_processes, ranks.is_main_process) == (0, 1, True)
    assert ranks.gather_objects([1, 2]) == [1, 2] and ranks.broadcast("x") == "x"
    assert not math.isnan(ranks.gather(torch.ones(1)).item())
