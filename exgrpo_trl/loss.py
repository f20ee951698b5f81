"""Loss pieces of ExGRPO's mixed-policy objective (algorithm §8), as small pure functions on tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

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


@dataclass
class ReplayTokenStats:
    """One rank's sums over a micro-batch's replayed tokens (offline tokens apart) and over its offline tokens, for
    the logged figures: each field a 0-d tensor. `as_row` lays them out for one gather over the ranks (every rank the
    same 9 figures, offline guidance on or off), `figures` turns the gathered rows into the logged means."""

    weight_sum: torch.Tensor  # sum of w over replayed tokens
    shaped_sum: torch.Tensor  # sum of f(w)
    count: torch.Tensor  # replayed tokens
    weight_max: torch.Tensor  # max w (0 with no replayed token)
    loss: torch.Tensor  # the replayed-token term of this rank's loss
    below_gamma: torch.Tensor  # replayed tokens with w < gamma (0 without shaping)
    offline_weight_sum: torch.Tensor  # sum of pi_theta over offline tokens (their w: behaviour log-prob 0)
    offline_shaped_sum: torch.Tensor  # sum of f(pi_theta)
    offline_count: torch.Tensor  # offline tokens

    @classmethod
    def of(
        cls,
        w: torch.Tensor,
        shaped: torch.Tensor,
        token_mask: torch.Tensor,
        offline_mask: torch.Tensor | None,
        loss: torch.Tensor,
        gamma: float | None,
    ) -> ReplayTokenStats:
        """From the (B, T) weights w and f(w), the boolean masks of replayed and of offline tokens (None: no offline
        guidance) and the term's loss."""
        weights = w[token_mask]
        zero = w.new_tensor(0.0)
        offline = (
            (w[offline_mask].sum(), shaped[offline_mask].sum(), offline_mask.sum().to(w.dtype))
            if offline_mask is not None
            else (zero, zero, zero)
        )
        return cls(
            weights.sum(),
            shaped[token_mask].sum(),
            token_mask.sum().to(w.dtype),
            w.masked_fill(~token_mask, 0.0).amax(),  # w > 0: the max over replayed tokens, 0 with none (no sync)
            loss.detach(),
            (weights < gamma).sum().to(w.dtype) if gamma is not None else zero,
            *offline,
        )

    def as_row(self) -> torch.Tensor:
        """(9,) float32, in field order."""
        return torch.stack([getattr(self, f.name) for f in fields(self)]).float()

    @staticmethod
    def figures(rows: torch.Tensor, gamma: float | None) -> dict[str, float]:
        """The logged figures from every rank's `as_row` ((world, 9), on the host): token means over all ranks, the
        max over ranks, the loss averaged over ranks; a mean whose tokens number 0 is left out."""
        col = {f.name: rows[:, i] for i, f in enumerate(fields(ReplayTokenStats))}
        out: dict[str, float] = {}
        offline = col["offline_count"].sum().item()
        if offline > 0:  # w of an offline token is pi_theta itself
            out["offline/token_prob_mean"] = col["offline_weight_sum"].sum().item() / offline
            out["offline/shaped_weight_mean"] = col["offline_shaped_sum"].sum().item() / offline
        count = col["count"].sum().item()
        if count > 0:
            out["replay/is_weight_mean"] = col["weight_sum"].sum().item() / count
            out["replay/is_weight_max"] = col["weight_max"].max().item()
            out["replay/shaped_weight_mean"] = col["shaped_sum"].sum().item() / count
            if gamma is not None:  # the tokens whose weight the shaping holds near 0 (f(w) < 1/2)
                out["replay/is_weight_below_gamma"] = col["below_gamma"].sum().item() / count
        out["replay/loss"] = col["loss"].mean().item()
        return out
