"""Trajectory selection (algorithm §6): entropy scoring in one padded batch equals scoring alone; argmin is picked."""

import numpy as np
import pytest
import torch

from exgrpo_trl.buffer import Trajectory, question_key
from tests.helpers import make_trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory, tokenizer):
    t = make_trainer(tmp_path_factory.mktemp("sel"), tokenizer, model_seed=3, replay_start_pass_rate=0.0,
                     per_device_train_batch_size=16)  # fmt: skip
    t.model.train()
    return t


def reference_entropy(model, prompt, completion):
    """Mean full-vocabulary entropy over the completion's positions, from a plain unpadded forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()  # the positions predicting completion tokens
    logp = torch.log_softmax(logits, -1)
    return float(-(logp.exp() * logp).sum(-1).mean())


def draw_plan(trainer, groups: int):
    """The replay plan of a generation batch of `groups` questions (opened and closed by the run, not trained)."""
    inputs = [{"prompt": "1+1=", "always": False}] * (groups * trainer.num_generations)
    with trainer.exgrpo_run.generation_batch(inputs, trainer._exgrpo_score_candidates) as batch:
        return batch.plan


PROMPTS = [[3, 4], [5, 6, 7, 8], [4, 4, 9, 10, 11, 3]]
COMPLETIONS = [[5, 6, 1], [7, 8, 9, 10, 11, 12, 1], [3, 4, 5, 6, 1]]


def test_padded_batch_equals_alone(trainer):
    together = trainer._exgrpo_score_entropies(PROMPTS, COMPLETIONS)
    alone = torch.cat([trainer._exgrpo_score_entropies([p], [c]) for p, c in zip(PROMPTS, COMPLETIONS)])
    reference = torch.tensor(
        [reference_entropy(trainer.model, p, c) for p, c in zip(PROMPTS, COMPLETIONS)], dtype=torch.float64
    )
    assert torch.allclose(together.double(), alone.double(), atol=1e-5, rtol=0)
    assert torch.allclose(together.double(), reference, atol=1e-5, rtol=0)
    assert together.std() > 1e-3  # the three differ, so the comparison means something


def test_scoring_raises_no_deprecation_warning(trainer):
    """TRL's `disable_gradient_checkpointing`, around every scoring pass, reads transformers' deprecated
    `is_gradient_checkpointing`: one FutureWarning per generation batch that replays, about TRL's code."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer._exgrpo_score_entropies(PROMPTS, COMPLETIONS)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("selection", ["lowest_entropy", "highest_entropy"])
def test_plan_picks_the_extreme_entropy(trainer, tokenizer, selection):
    prompt = "3+4="
    prompt_ids = tokenizer(prompt)["input_ids"]
    candidates = [[5, 6, 1], [7, 8, 9, 10, 11, 12, 1], [3, 4, 5, 6, 1], [9, 1]]
    entropies = [reference_entropy(trainer.model, prompt_ids, c) for c in candidates]
    expected = int(np.argmin(entropies) if selection == "lowest_entropy" else np.argmax(entropies))
    assert len({round(e, 4) for e in entropies}) == 4

    trainer.args.trajectory_selection = selection
    buffer = trainer.exgrpo_state.buffer
    buffer.questions.clear()
    buffer.update_group(
        question_key(prompt),
        3,
        {"prompt": prompt, "always": False},
        [Trajectory(np.array(c), np.full(len(c), -1.0 - i), 0) for i, c in enumerate(candidates)],
    )
    trainer.exgrpo_state.replay_active = True
    # 4 groups: n_exp = min(1, floor(0.5 * 4)) = 1
    plan = draw_plan(trainer, 4)
    assert plan.group_indices == [3]
    assert plan.completion_ids == [candidates[expected]]
    assert torch.equal(plan.behaviour_logps[0], torch.full((len(candidates[expected]),), -1.0 - expected))
    assert plan.selected_entropies == pytest.approx([entropies[expected]], abs=1e-5)
    trainer.args.trajectory_selection = "lowest_entropy"


@pytest.mark.parametrize(
    "cap,selection",
    [
        (1, "lowest_entropy"),
        (2, "lowest_entropy"),
        (3, "lowest_entropy"),
        (None, "lowest_entropy"),
        (2, "highest_entropy"),
    ],
)
def test_candidate_cap_scores_the_shortlist(trainer, tokenizer, cap, selection, monkeypatch):
    prompt = "3+4="
    prompt_ids = tokenizer(prompt)["input_ids"]
    candidates = [[5, 6, 1], [7, 8, 9, 10, 11, 12, 1], [3, 4, 5, 6, 1], [9, 1]]  # stored oldest first
    nll = [2.0, 0.5, 3.0, 1.0]  # stored log-probs -nll on every token
    # lowest stored NLL first: 1 (0.5), 3 (1.0), 0 (2.0), 2 (3.0); highest first: 2, 0, 3, 1
    by_nll = [1, 3, 0, 2] if selection == "lowest_entropy" else [2, 0, 3, 1]
    kept = list(range(4)) if cap is None else sorted(by_nll[:cap])  # scored in stored order
    entropies = [reference_entropy(trainer.model, prompt_ids, c) for c in candidates]
    pick = np.argmin if selection == "lowest_entropy" else np.argmax
    expected = kept[int(pick([entropies[i] for i in kept]))]
    scored = []
    score = trainer._exgrpo_score_entropies
    monkeypatch.setattr(trainer, "_exgrpo_score_entropies", lambda p, c, m=None: scored.append(c) or score(p, c, m))

    monkeypatch.setattr(trainer.args, "max_trajectory_candidates", cap)
    monkeypatch.setattr(trainer.args, "trajectory_selection", selection)
    buffer = trainer.exgrpo_state.buffer
    buffer.questions.clear()
    buffer.update_group(
        question_key(prompt),
        3,
        {"prompt": prompt, "always": False},
        [Trajectory(np.array(c), np.full(len(c), -nll[i]), 0) for i, c in enumerate(candidates)],
    )
    trainer.exgrpo_state.replay_active = True
    plan = draw_plan(trainer, 4)
    assert plan.completion_ids == [candidates[expected]]
    assert torch.equal(plan.behaviour_logps[0], torch.full((len(candidates[expected]),), -nll[expected]))
    # one candidate needs no scoring; otherwise exactly the shortlist is scored
    assert [[list(map(int, ids)) for ids in c] for c in scored] == (
        [] if cap == 1 else [[candidates[i] for i in kept]]
    )
    assert len(buffer.questions[question_key(prompt)].trajectories) == 4  # the buffer itself keeps them all
    if cap == 2:  # the cap changes the pick here, so the test tells the shortlist from "score everything"
        assert expected != int(pick(entropies))


def test_random_selection_ignores_the_cap(trainer, tokenizer, monkeypatch):
    """Random selection scores nothing, so it draws uniformly over every stored trajectory, cap or not."""
    prompt = "3+4="
    candidates = [[5, 6, 1], [7, 8, 9, 10, 11, 12, 1], [3, 4, 5, 6, 1], [9, 1], [4, 1]]
    monkeypatch.setattr(trainer.args, "max_trajectory_candidates", 1)
    monkeypatch.setattr(trainer.args, "trajectory_selection", "random")
    buffer = trainer.exgrpo_state.buffer
    buffer.questions.clear()
    buffer.update_group(
        question_key(prompt),
        3,
        {"prompt": prompt, "always": False},
        [Trajectory(np.array(c), np.full(len(c), -1.0), 0) for c in candidates],
    )
    trainer.exgrpo_state.replay_active = True
    asked = []
    monkeypatch.setattr(buffer, "choose_random", lambda n: asked.append(n) or n - 2)
    never = lambda p, c, m=None: pytest.fail("random selection scored")  # noqa: E731
    monkeypatch.setattr(trainer, "_exgrpo_score_entropies", never)
    plan = draw_plan(trainer, 4)
    assert asked == [5]  # drawn over all 5 stored trajectories, not over a shortlist of 1
    assert plan.completion_ids == [candidates[3]]  # index n - 2 = 3
