"""Loss pieces of ExGRPO's mixed-policy objective (algorithm §8), as small pure functions on tensors."""

from __future__ import annotations

import math

import torch


def shaped_replay_token_loss(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    gamma: float | None,
    importance_correction: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss of replayed tokens: -f(w) * A, with w = exp(logp_theta - logp_behaviour), no clipping.

    f(w) = w / (w + gamma) (policy shaping), or f(w) = w when `gamma` is None (the "w/o shaping" ablation). Without
    importance correction, logp_behaviour := logp_theta.detach(), so w = 1 in value while its gradient still flows.
    The shaped weight is computed as sigmoid(log w - log gamma), which equals w / (w + gamma) and cannot overflow.
    Its gradient w.r.t. logp_theta is gamma * w / (w + gamma)^2 (largest, 1/4, at w = gamma).

    Args:
        per_token_logps: (B, T) log-probs of the current policy (with grad).
        behaviour_logps: (B, T) stored log-probs of the behaviour policy (ignored without importance correction).
        advantages: (B, 1) or (B, T) advantages.

    Returns:
        per_token_loss (B, T), w (B, T) detached, f(w) (B, T) detached.
    """
    reference = behaviour_logps if importance_correction else per_token_logps.detach()
    log_w = per_token_logps - reference  # (B, T)
    shaped = torch.exp(log_w) if gamma is None else torch.sigmoid(log_w - math.log(gamma))  # w or w / (w + gamma)
    per_token_loss = -shaped * advantages  # (B, T)
    return per_token_loss, torch.exp(log_w.detach()), shaped.detach()


def aggregate_token_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | None,
    num_processes: int,
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    training: bool = True,
) -> torch.Tensor:
    """Aggregate a (B, T) per-token loss exactly as TRL 1.16's GRPOTrainer does for `loss_type`.

    ExGRPO applies ONE normaliser to fresh and replayed tokens together (algorithm §8): TRL aggregates the fresh tokens
    (replayed rows contribute 0 there), and this function aggregates the replayed tokens over the same batch and
    mask, so the two terms add up to the loss over the whole mixed batch. A test checks it against GRPOTrainer.
    """
    accumulation = gradient_accumulation_steps if training else 1.0
    masked = per_token_loss * mask  # (B, T)
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token_loss.size(0) * max_completion_length) / accumulation
    if loss_type in ("cispo", "dapo", "vespo"):
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * gradient_accumulation_steps / steps_per_generation
        return masked.sum() / normalizer
    if loss_type == "luspo":
        return masked.sum(-1).mean() / accumulation
    raise ValueError(f"ExGRPO does not support loss_type={loss_type!r}")


SUPPORTED_LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "cispo", "dapo", "vespo", "luspo")
# The loss types whose fresh tokens TRL clips PPO-style, clamp(r, 1 - epsilon_low, 1 + epsilon_high).
PPO_CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
