"""Entropy scoring of stored trajectories (algorithm §6): their batching, and the scorer itself with the model's
forward passed in (`EntropyScorer`), independent of the training loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
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


def _same(value):
    return value


@dataclass(frozen=True)
class EntropyScorer:
    """The mean per-token entropy of (prompt, completion) pairs under the current policy (algorithm §6), over each
    completion's model tokens only: the chunking and the sharding over ranks, with the model's forward passed in.

    `forward(input_ids, attention_mask, logits_to_keep, batch_size, **image_inputs)` returns the (B, C) per-token
    entropies of the last C positions (TRL's `_get_per_token_logps_and_entropies`, no grad). `image_inputs(prompts,
    input_ids)`: for a vision-language model, the image inputs of one chunk from its prompts as messages holding their
    images (None: text only). `gather`: every rank's tensor, concatenated (one process: itself)."""

    forward: Callable[..., torch.Tensor]
    pad_token_id: int
    chunk_rows: int  # rows per forward pass at most
    device: torch.device | str | None = None
    rank: int = 0
    world: int = 1
    gather: Callable[[torch.Tensor], torch.Tensor] = _same
    image_inputs: Callable[..., dict[str, Any]] | None = None

    def __call__(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        masks: list | None = None,
        vision: list | None = None,
    ) -> torch.Tensor:
        """(N,) mean entropies on the host, the same on every rank. The rows are split evenly over the ranks, each
        rank padding its share to the same number of rows, so every rank runs the same number of forward passes
        (DeepSpeed ZeRO-3 hangs otherwise); the results are gathered. `masks`: per row, 1 for the model's tokens
        (None: all of them); `vision`: per row, its prompt as messages holding its images (None: text only)."""
        total = len(completion_ids)
        per_rank = math.ceil(total / self.world)
        mine = list(range(self.rank * per_rank, min((self.rank + 1) * per_rank, total)))
        mine += [mine[-1] if mine else 0] * (per_rank - len(mine))  # padding rows: scored, then discarded
        masks = [None] * total if masks is None else masks
        entropies = self.mean_entropies(
            [prompt_ids[i] for i in mine],
            [completion_ids[i] for i in mine],
            [masks[i] for i in mine],
            None if vision is None else [vision[i] for i in mine],
        )
        return self.gather(entropies).cpu()[:total]

    def mean_entropies(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        masks: list | None = None,
        vision: list | None = None,
    ) -> torch.Tensor:
        """This rank's rows, (N,) on the device, in forward passes over rows of similar length.

        Rows are sorted by length and cut into chunks of at most `chunk_rows` rows, each padded only to its own
        longest row: stored trajectories vary a lot in length, and padding every row to the longest one roughly
        doubled the scoring cost. The number of chunks depends only on the number of rows, which is the same on every
        rank."""
        n = len(completion_ids)
        masks = [None] * n if masks is None else masks
        lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
        order = sorted(range(n), key=lengths.__getitem__)
        means = torch.empty(n, dtype=torch.float32, device=self.device)  # stays on the device
        for start in range(0, n, self.chunk_rows):
            rows = order[start : start + self.chunk_rows]
            input_ids, attention_mask, completion_mask = pad_prompt_completion(
                [prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], self.pad_token_id, self.device
            )
            images = {} if vision is None else self.image_inputs([vision[i] for i in rows], input_ids)
            entropies = self.forward(input_ids, attention_mask, completion_mask.size(1), len(rows), **images)
            model_tokens = completion_mask * model_token_mask([masks[i] for i in rows], completion_mask)  # (B, C)
            means[torch.tensor(rows, device=means.device)] = masked_mean_per_row(entropies.float(), model_tokens)
        return means


def image_inputs(prompt_ids, images, fields: dict[str, Any], input_ids: torch.Tensor) -> dict[str, Any]:
    """The image inputs of one scoring chunk, as TRL's forward pass takes them for training: from the processor's
    output for the chunk's prompts (`prompt_ids`, `images` per row, and its `fields`: pixel values, image grids, ...),
    the images per row, and the per-token fields (token type ids) left-padded like the prompts and 0 over the
    completion. `input_ids`: the chunk's (B, P + C) tokens from `pad_prompt_completion`. {} when no row has an
    image."""
    if images is None:  # no row of the chunk has an image
        return {}
    width, device = input_ids.size(1), input_ids.device
    out: dict[str, Any] = {"num_images": [len(row) if row else 0 for row in images]}
    width_prompt = max(len(ids) for ids in prompt_ids)
    for name, value in fields.items():  # as TRL's generation takes them
        if isinstance(value, list) and value and isinstance(value[0], list):  # per token of each prompt
            padded = torch.zeros((len(value), width), dtype=torch.long, device=device)
            for i, row in enumerate(value):
                padded[i, width_prompt - len(row) : width_prompt] = torch.as_tensor(row, dtype=torch.long)
            out[name] = padded
        else:  # pixel values, image grids, ...: a tensor, or arrays to stack into one
            out[name] = (value if isinstance(value, torch.Tensor) else torch.tensor(np.array(value))).to(device)
    return out
