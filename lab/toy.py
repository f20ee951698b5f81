"""Held-out evaluation of the toy tasks: sampled pass@1 per question and by difficulty (`evaluate_pass_at_1`).

The tasks themselves (addition, the tokenizer, the tiny model, the supervised warm start) ship with the package in
`exgrpo_trl.utils.tiny`; Countdown (`lab.countdown`) plugs in through `reward_fn` and `difficulty_key`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from exgrpo_trl.utils.tiny import addition_reward

__all__ = ["evaluate_pass_at_1"]


@torch.no_grad()
def evaluate_pass_at_1(
    model,
    tokenizer: PreTrainedTokenizerFast,
    dataset,
    *,
    samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
    reward_fn: Callable[..., list[float]] | None = None,
    difficulty_key: str = "digits",
    return_completions: bool = False,
) -> dict:
    """Sampled pass@1: for each question, the fraction of `samples` sampled completions that are correct.

    `dataset` needs ``prompt`` and ``answer`` columns (and ``digits`` for the per-difficulty split). Returns
    ``{"overall": mean over questions, "by_digits": {d: mean over questions with d digits},
    "per_question": [pass rate of each question, in dataset order]}``. Sampling is seeded (global torch RNG
    forked, so the caller's is untouched); `temperature` 0 means greedy. `batch_size` counts sequences.

    Other tasks: `reward_fn` (default `addition_reward`) is called TRL-style, ``reward_fn(completions, **columns)``
    with every column but ``prompt`` repeated per sample; `difficulty_key` names the column of the per-difficulty
    split, returned as ``"by_{difficulty_key}"``; `return_completions` adds ``"completions"``: each question's
    sampled texts.
    """
    reward_fn = addition_reward if reward_fn is None else reward_fn
    prompts = list(dataset["prompt"])
    columns = {c: list(dataset[c]) for c in dataset.column_names if c != "prompt"}
    digits = list(dataset[difficulty_key]) if difficulty_key in dataset.column_names else None
    questions_per_batch = max(1, batch_size // samples)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    per_question: list[float] = []
    completions: list[list[str]] = []
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    sample = temperature > 0
    gen_kwargs = dict(
        do_sample=sample,
        max_new_tokens=max_new_tokens,
        num_return_sequences=samples,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if sample:
        gen_kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            starts = range(0, len(prompts), questions_per_batch)
            for i in tqdm(starts, desc="evaluating pass@1", disable=not progress, unit="batch", dynamic_ncols=True):
                chunk = prompts[i : i + questions_per_batch]
                enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = model.generate(**enc, **gen_kwargs)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                repeated = {
                    c: [v for v in vs[i : i + questions_per_batch] for _ in range(samples)]
                    for c, vs in columns.items()
                }
                rewards = reward_fn(texts, **repeated)
                for q in range(len(chunk)):
                    per_question.append(sum(rewards[q * samples : (q + 1) * samples]) / samples)
                    completions.append(texts[q * samples : (q + 1) * samples])
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    by_digits: dict[int, float] = {}
    if digits is not None:
        groups = defaultdict(list)
        for d, p in zip(digits, per_question):
            groups[int(d)].append(p)
        by_digits = {d: sum(v) / len(v) for d, v in sorted(groups.items())}
    overall = sum(per_question) / len(per_question) if per_question else math.nan
    result = {"overall": overall, f"by_{difficulty_key}": by_digits, "per_question": per_question}
    if return_completions:
        result["completions"] = completions
    return result
