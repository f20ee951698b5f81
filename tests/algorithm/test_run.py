"""`ExGRPORun` on an `ExGRPOState`, driven by hand with plain tensors and the settings dataclass: no trainer, no TRL.

One generation batch of 4 groups of K = 4 (16 rows, one process): the buffer holds one question Q with two stored
candidates, replay_ratio 0.5 replays min(1 question, floor(0.5 * 4)) = 1 group, the last one (group 3, rows 12-15).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import Trajectory, question_key
from exgrpo_trl.run import BatchKey, ExGRPORun, Rollouts
from exgrpo_trl.settings import ExGRPOSettings
from exgrpo_trl.training_state import METRIC_PREFIX, ExGRPOState, Messages, Ranks

K, EOS, PAD = 4, 1, 0
Q = "Q"  # the buffered question's prompt
CANDIDATES = [[5, 6, EOS], [7, EOS]]  # Q's stored trajectories; the scorer gives the second the lower entropy


def settings(**overrides) -> ExGRPOSettings:
    """The paper's settings, replay from the first batch, every candidate scored, no PPO clip after the start."""
    fields = dict(replay_start_pass_rate=None, max_trajectory_candidates=None, remove_clip_after_replay_start=True)
    return ExGRPOSettings(**{**fields, **overrides})


def tokenize(text):
    return [ord(c) for c in text] + [EOS]


def make_run(**overrides) -> ExGRPORun:
    quiet = Messages(lambda message: None, lambda message: None)
    state = ExGRPOState(settings(**overrides), K, tokenize=tokenize, max_completion_length=4, messages=quiet)
    run = ExGRPORun(state, Rollouts(tokenize, 4, frozenset({EOS, PAD}), "dr_grpo"))
    state.buffer.update_group(
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
    with run.generation_batch(inputs, score) as batch:
        assert run.open_batch is batch
        completions = [[3, EOS]] * (4 * K)  # every generated row ended by the model
        completions = [list(batch.rows.splice.get(i, c)) for i, c in enumerate(completions)]
        solved = [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
        rewards = torch.tensor(solved, dtype=torch.float32).unsqueeze(1)  # (16, 1)
        prompts = [x["prompt"] for x in batch.rows.inputs]
        assert run.scored(batch, batch.rows.inputs, prompts, [""] * 16, completions, rewards) is rewards
        width = max(len(c) for c in completions)
        output = {
            "completion_ids": torch.tensor([c + [PAD] * (width - len(c)) for c in completions]),
            "completion_mask": torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions]),
            "advantages": torch.zeros(16),
        }
        output.update(run.finish(batch, output, reward_weights=torch.ones(1), micro_batches_left=1))
    assert run.open_batch is None  # closed with the block
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
    assert (run.state.replay_active, run.state.clock, batch.clock, plan.clock) == (True, 1, 0, 0)

    # the first loss pass over the batch records the behaviour log-probs and commits (micro_batches_left was 1)
    logps = torch.full(output["completion_ids"].shape, -0.25)
    run.record_behaviour(output, logps)
    assert run.pending is None
    buffer = run.state.buffer
    assert question_key("P2") in buffer.retired  # 4/4
    assert buffer.questions[question_key("P1")].k == 2
    assert [t.completion_ids.tolist() for t in buffer.questions[question_key("P1")].trajectories] == [[3, EOS]] * 1
    assert buffer.questions[question_key("P1")].trajectories[0].logps.tolist() == [-0.25, -0.25]
    assert buffer.questions[question_key("P1")].trajectories[0].collected_at == 0  # stamped with the batch's clock
    assert buffer.questions[question_key(Q)].k == 2  # row 12 (stored) and row 13 solved
    assert len(buffer.questions[question_key(Q)].trajectories) == 3  # row 13's [3, EOS] joins the two candidates
    assert question_key("P0") not in buffer  # k = 0: nothing stored


def test_one_clock_stamps_trajectories_and_ages_them():
    """The state's clock counts generation batches: five made before this one, whose plan is for batch 5; Q's
    candidates were stored in batch 0 (make_run), so the replayed one is 5 - 0 = 5 batches old (`replay/age`), and
    the trajectories this batch stores are stamped 5; the clock then reads 6."""
    run = make_run()
    run.state.clock = 5
    batch, output = one_batch(run)
    assert (batch.clock, batch.plan.clock, batch.plan.collected_at) == (5, 5, [0])
    assert run.metrics[METRIC_PREFIX + "replay/age"] == [5.0] and run.state.clock == 6
    run.record_behaviour(output, torch.full(output["completion_ids"].shape, -0.25))
    assert [t.collected_at for t in run.state.buffer.questions[question_key("P1")].trajectories] == [5]
    assert run.state.buffer.replayed_at == {question_key(Q): 5}  # the reuse limit counts in the same unit


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
    assert run.state.replay_active is False
    batch, output = one_batch(run)
    assert batch.plan is None and BatchKey.REPLAY_MASK not in output  # nothing replayed before the start
    # Pass@1 8 / 16 = 0.5 <= 0.6: still off (only retirement counts; group 2 retired, nothing stored)
    assert (run.state.replay_active, run.state.clock) == (False, 1)
    run.record_behaviour(output, torch.zeros(output["completion_ids"].shape))
    assert question_key("P2") in run.state.buffer.retired and question_key("P1") not in run.state.buffer
    saved = run.state.state_dict()
    # no sampler yet, no offline guide; the batch's metrics (8 of 16 rows solved, no group replayed, group 0 of the 4
    # fresh ones failed throughout) and the number of processes that saved it
    latest = {"replay/fraction": 0.0, "batch/pass_at_1": 0.5, "batch/fresh_all_fail": 0.25, "replay/active": 0.0}
    assert saved == {"replay_active": False, "generation_batches": 1, "latest": latest, "num_processes": 1}
    other = make_run(replay_start_pass_rate=0.6)
    other.state.load_state_dict({**saved, "generation_batches": 5})
    assert (other.state.replay_active, other.state.clock) == (False, 5)
    assert other.state.latest == latest  # the log rows after a resume carry them (`log_metrics`)
    older = make_run(replay_start_pass_rate=0.6)  # a state saved before the latest metrics were
    older.state.load_state_dict({"replay_active": True, "generation_batches": 3})
    assert (older.state.replay_active, older.state.clock, older.state.latest) == (True, 3, {})


def test_offline_guidance_off_is_a_null_guide():
    run = make_run()
    assert not run.state.offline.active and run.state.offline.state_dict() is None
    on = make_run(offline_solutions_column="solution")
    assert on.state.offline.active and on.state.state_dict()["offline"] == {"rejected": [], "self_solved": []}


def test_a_loss_without_a_clip_cannot_drop_it():
    state = make_run().state
    with pytest.raises(ValueError, match="remove_clip_after_replay_start removes the PPO clip"):
        ExGRPORun(state, Rollouts(tokenize, 4, frozenset({EOS}), "sapo"))


@pytest.mark.parametrize("module", ["exgrpo_trl.run", "exgrpo_trl.training_state", "exgrpo_trl.settings"])
def test_the_run_imports_no_training_framework(module):
    """Imported in a fresh interpreter: the run, its state and the settings pull in none of trl, transformers,
    accelerate (the settings not even torch)."""
    import subprocess

    frameworks = "('trl', 'transformers', 'accelerate')" if module != "exgrpo_trl.settings" else "('torch', 'trl')"
    code = f"import sys, {module}; print(sorted(m for m in {frameworks} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_ranks_default_to_one_process():
    ranks = Ranks()
    assert (ranks.process_index, ranks.num_processes, ranks.is_main_process) == (0, 1, True)
    assert ranks.gather_objects([1, 2]) == [1, 2] and ranks.broadcast("x") == "x"
    assert not math.isnan(ranks.gather(torch.ones(1)).item())
