"""Rollout functions of every shape TRL 1.16 accepts from a user (`GRPOTrainer(rollout_func=...)`), for the contract
test (tests/trainer/test_rollout_shapes.py).

TRL's contract: the function gets this process's prompts (each question's K rows, as the sampler gave them) and the
trainer, and returns a dict with `prompt_ids`, `completion_ids` and `logprobs` (per row); an `env_mask` (per row, 1
for the model's tokens) is TRL's tool mask; every other key is a per-row field handed to the reward functions. TRL
neither truncates nor pads what it gets: the function decides the lengths.

`make_rollout(...)` builds one of them over the trainer's own model and `generate` (sampling, the trainer's
generation config), text prompts or a vision-language model's messages with images:

- `env_mask`: also return an `env_mask` that marks each completion's first token as the environment's (0);
- `logprobs`: "floats" (the sampled tokens' log-probs under the sampling distribution) or None (TRL's docs allow
  both: its own examples pass vLLM's, OpenEnv's may have none);
- `fields`: also return the per-row field `draw` ("CALL:ROW", unique to each row of each call), which the reward
  functions receive; `FieldLog` records what they were given;
- `extra_tokens`: generate up to max_completion_length + extra_tokens new tokens (negative: fewer), so completions
  come back longer (or shorter) than the trainer's max_completion_length.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class FieldLog:
    """What the reward functions were given, one entry per generation batch: the completion ids and, where the
    function returns it, the field `draw`; and the rollout function's calls so far."""

    def __init__(self):
        self.ids: list[list[list[int]]] = []
        self.draws: list[list[str] | None] = []
        self.calls = 0

    def reward(self, base):
        """`base` (a reward function) that also records what it was given."""

        def reward(completion_ids, **kwargs):
            self.ids.append([list(ids) for ids in completion_ids])
            self.draws.append(list(kwargs["draw"]) if "draw" in kwargs else None)
            return base(completion_ids=completion_ids, **kwargs)

        reward.__name__ = getattr(base, "__name__", "reward")
        return reward


def _tokenized(trainer, prompts: list) -> tuple[list[list[int]], dict[str, Any]]:
    """Each prompt's token ids as the function renders it, and the extra model inputs of the whole (left-padded)
    batch for a vision-language model (pixel values and image grids), else {}."""
    processing = trainer.processing_class
    if isinstance(prompts[0], str):
        return [processing(text=p, add_special_tokens=False)["input_ids"] for p in prompts], {}
    # messages with image blocks (TRL has put each row's images into them): the processor renders and embeds them
    out = processing.apply_chat_template(
        prompts, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt", padding=True
    )
    ids = [row[mask.bool()].tolist() for row, mask in zip(out["input_ids"], out["attention_mask"])]
    extra = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    return ids, extra


def make_rollout(*, env_mask: bool = False, logprobs: str | None = "floats", fields: bool = True, extra_tokens=0,
                 log: FieldLog | None = None):  # fmt: skip
    """A rollout function of the shape the keywords give (module docstring)."""
    log = FieldLog() if log is None else log

    def rollout(prompts, trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
        pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        prompt_ids, extra = _tokenized(trainer, prompts)
        width = max(len(p) for p in prompt_ids)
        device = trainer.accelerator.device
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        config = copy.deepcopy(trainer.generation_config)
        config.max_new_tokens = trainer.max_completion_length + extra_tokens
        config.min_new_tokens = None
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                output_scores=True, return_dict_in_generate=True, **{k: v.to(device) for k, v in extra.items()},
            )  # fmt: skip
        steps = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # (B, new tokens, V)
        completion_ids, token_logps = [], []
        stops = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        stops = {eos, *filter(lambda x: x is not None, stops)}  # a generation config may list several stop ids
        for i, row in enumerate(out.sequences[:, width:].tolist()):
            ends = [t for t, token in enumerate(row) if token in stops]
            end = ends[0] + 1 if ends else len(row)  # up to and including the stop token, or all (truncated)
            completion_ids.append(row[:end])
            token_logps.append([steps[i, t, row[t]].item() for t in range(end)])
        output: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": token_logps if logprobs == "floats" else None,
        }
        if env_mask:
            output["env_mask"] = [[0] + [1] * (len(ids) - 1) for ids in completion_ids]
        if fields:
            output["draw"] = [f"{log.calls}:{i}" for i in range(len(completion_ids))]
        log.calls += 1
        return output

    rollout.log = log
    return rollout


def make_vllm_rollout(log: FieldLog | None = None):
    """A rollout function generating through the trainer's vLLM (colocate or server mode), as OpenEnv-style
    integrations do: the prompts tokenized, `trainer.vllm_generation.generate` asked for one completion per prompt
    row (K rows per question, as TRL's own generation asks), the sampled tokens' log-probs, and the field `draw`."""
    log = FieldLog() if log is None else log

    def rollout(prompts, trainer):
        prompt_ids = [trainer.processing_class(text=p, add_special_tokens=False)["input_ids"] for p in prompts]
        _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
            prompts=prompt_ids, images=None, num_generations=trainer.num_generations
        )
        output = {
            "prompt_ids": prompt_ids,
            "completion_ids": [list(ids) for ids in completion_ids],
            "logprobs": [[lp[0] for lp in seq] for seq in logprobs],
            "draw": [f"{log.calls}:{i}" for i in range(len(completion_ids))],
        }
        log.calls += 1
        return output

    rollout.log = log
    return rollout
