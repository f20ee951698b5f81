"""A few completions of a model, and the same questions before and after training side by side (notebooks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .generators import TransformersGenerator, render_prompt

__all__ = ["compare_completions", "question_text", "sample_completions"]


def sample_completions(
    model,
    tokenizer,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    seed: int = 0,
) -> list[str]:
    """One completion per prompt with transformers ``generate`` (greedy when `temperature` is 0, else seeded sampling).

    Prompts are rendered as TRL renders training prompts (plain strings as is, messages through the chat template).
    Works on a `PeftModel` too: before any update a fresh LoRA adapter is the identity, so the trainer's model
    before `train()` gives the base model's completions. The model's train/eval mode, its generation config and the
    caller's RNG are left as they were.
    """
    prompt_ids = [list(tokenizer(render_prompt(p, tokenizer), add_special_tokens=False)["input_ids"]) for p in prompts]
    generator = TransformersGenerator(model, tokenizer, batch_size=batch_size, progress=False)
    # A policy loaded for training with gradient checkpointing has its KV cache turned off, which makes long
    # completions quadratic; this is inference, so the cache is on while it runs.
    generation_config = getattr(model, "generation_config", None)
    use_cache = getattr(generation_config, "use_cache", None)
    if generation_config is not None:
        generation_config.use_cache = True
    try:
        grouped = generator.generate(
            prompt_ids, n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed
        )
    finally:
        if generation_config is not None:
            generation_config.use_cache = use_cache
    return [completions[0].text for completions in grouped]


def question_text(prompt: Any) -> str:
    """What was asked: a plain prompt as is, else the content of the last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else str(prompt)


def _tail(text: str, max_chars: int | None) -> str:
    # The end of a reasoning trace is where its answer is.
    if max_chars is None or len(text) <= max_chars:
        return text
    return "…" + text[-(max_chars - 1) :]


def compare_completions(
    prompts: Sequence[Any],
    answers: Sequence[Any],
    before: Sequence[str],
    after: Sequence[str],
    reward_func: Callable[..., list[float]],
    *,
    max_chars: int | None = 400,
):
    """A `pandas.DataFrame`, one row per question: question, reference answer, the completion before and after
    training (their last `max_chars` characters) and each one's reward from `reward_func` (a TRL reward function
    taking ``completions`` and ``answer``)."""
    import pandas as pd

    if not len(prompts) == len(answers) == len(before) == len(after):
        raise ValueError(
            f"prompts, answers, before and after must have the same length, got {len(prompts)}, {len(answers)}, "
            f"{len(before)}, {len(after)}"
        )
    answers = [str(a) for a in answers]
    before_reward = reward_func(completions=list(before), answer=answers)
    after_reward = reward_func(completions=list(after), answer=answers)
    return pd.DataFrame(
        {
            "question": [_tail(question_text(p), max_chars) for p in prompts],
            "answer": answers,
            "before": [_tail(t, max_chars) for t in before],
            "reward before": before_reward,
            "after": [_tail(t, max_chars) for t in after],
            "reward after": after_reward,
        }
    )
