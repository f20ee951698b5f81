"""Batching of stored trajectories for entropy scoring (algorithm §6), independent of the training loop."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_prompt_completion(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out (prompt, completion) pairs the way GRPOTrainer does: prompts left-padded, completions right-padded.

    Returns:
        input_ids (N, P + C), attention_mask (N, P + C), completion_mask (N, C), where C is the longest completion;
        the model's last C positions (TRL's `logits_to_keep`) are the completion tokens of every row.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    n = len(prompt_ids)
    p_len = max(len(p) for p in prompt_ids)
    c_len = max(len(c) for c in completion_ids)
    input_ids = torch.full((n, p_len + c_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, p_len + c_len), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        input_ids[i, p_len - len(prompt) : p_len] = torch.as_tensor(prompt, dtype=torch.long)
        input_ids[i, p_len : p_len + len(completion)] = torch.as_tensor(completion, dtype=torch.long)
        attention_mask[i, p_len - len(prompt) : p_len + len(completion)] = 1
    completion_mask = attention_mask[:, p_len:]  # (N, C)
    return input_ids.to(device), attention_mask.to(device), completion_mask.to(device)


def model_token_mask(masks: Sequence[Sequence[int] | None], like: torch.Tensor) -> torch.Tensor:
    """(N, C) 0/1 mask of the model's tokens in right-padded completions, shaped and typed like `like`: each row's
    mask (1 where the model produced the token, 0 where a tool or an environment inserted it; None: all ones) in
    its first positions, 1 after them (the completion mask zeroes the padding)."""
    out = torch.ones_like(like)  # (N, C)
    for i, mask in enumerate(masks):
        if mask is not None:
            out[i, : len(mask)] = torch.as_tensor(list(mask), dtype=like.dtype)
    return out


def masked_mean_per_row(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row's values over its own masked positions: (N, T), (N, T) -> (N,)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
