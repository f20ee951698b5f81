"""`remove_clip_after_replay_start`: the PPO clip on fresh tokens goes once replay has started (the authors' released
script's loss_remove_clip), on hand-made ratios through TRL's own loss; off by default (algorithm §8)."""

import pytest
import torch

from exgrpo_trl import ExGRPOConfig
from exgrpo_trl.trainer import BatchKey
from tests.helpers import make_trainer
from tests.support.recording import RecordingTrainer


# dr_grpo, one row, 3 completion tokens + 1 masked, ratios r = exp(logp - old) = 1.6, 1.0, 0.5, epsilon 0.2,
# normaliser B * max_completion_length = 1 * 4:
#   A = +1: clipped  -(min(1.6, 1.2) + 1.0 + min(0.5, 0.8)) / 4 = -(1.2 + 1.0 + 0.5) / 4 = -0.675
#           removed  -(1.6 + 1.0 + 0.5) / 4 = -0.775
#   A = -1: clipped  (max(1.6, 1.2) + 1.0 + max(0.5, 0.8)) / 4 = (1.6 + 1.0 + 0.8) / 4 = 0.85
#           removed  (1.6 + 1.0 + 0.5) / 4 = 0.775
@pytest.mark.parametrize("advantage, clipped, removed", [(1.0, -0.675, -0.775), (-1.0, 0.85, 0.775)])
def test_clip_removed_on_hand_made_ratios(tmp_path, tokenizer, advantage, clipped, removed):
    trainer = make_trainer(tmp_path, tokenizer, remove_clip_after_replay_start=True, max_completion_length=4)
    assert trainer.beta == 0.0 and trainer.args.entropy_coef == 0.0 and trainer.loss_type == "dr_grpo"
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    prompt = torch.tensor([tokenizer("12+34=")["input_ids"]])
    completion = torch.tensor([[5, 6, 7, 1]])
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
              "completion_mask": torch.tensor([[1, 1, 1, 0]]), "advantages": torch.tensor([advantage]),
              "num_items_in_batch": torch.tensor(3)}  # fmt: skip
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt, completion], 1), torch.ones(1, prompt.size(1) + 4, dtype=torch.long), 4
        )
    inputs["old_per_token_logps"] = logps - torch.tensor([[1.6, 1.0, 0.5, 1.0]]).log()
    assert trainer._compute_loss(trainer.model, inputs).item() == pytest.approx(clipped, abs=1e-5)
    unclipped = {**inputs, BatchKey.UNCLIPPED: torch.ones(1, dtype=torch.bool)}
    assert trainer._compute_loss(trainer.model, unclipped).item() == pytest.approx(removed, abs=1e-5)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.2)  # restored after the loss


def test_only_batches_generated_after_the_switch(tmp_path, tokenizer):
    # Delayed start at 0.35: the synthetic reward solves 30-60% of rollouts, so replay starts within a few batches;
    # the batches generated before that keep the clip, every batch after it carries the key.
    trainer = make_trainer(tmp_path / "on", tokenizer, cls=RecordingTrainer, remove_clip_after_replay_start=True,
                           max_steps=4, replay_start_pass_rate=0.35)  # fmt: skip
    trainer.train()
    actives = [b["before"]["active"] for b in trainer.batches]
    assert any(actives) and not all(actives)
    assert [(BatchKey.UNCLIPPED in b["output"]) for b in trainer.batches] == actives
    off = make_trainer(tmp_path / "off", tokenizer, cls=RecordingTrainer, remove_clip_after_replay_start=False,
                       max_steps=2, replay_start_pass_rate=0.0)  # fmt: skip
    off.train()
    assert not any(BatchKey.UNCLIPPED in b["output"] for b in off.batches)


def test_rejected_where_there_is_no_ppo_clip(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="loss_type 'cispo' has none to remove"):
        make_trainer(tmp_path, tokenizer, remove_clip_after_replay_start=True, loss_type="cispo")
    assert ExGRPOConfig.__dataclass_fields__["remove_clip_after_replay_start"].default is False  # algorithm §8
