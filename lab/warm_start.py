"""The lab's warm-start cache: a supervised warm start of the toy model (`exgrpo_trl.tasks.toy.warm_start`),
trained once per setting and then loaded from disk. The study, the demo and Countdown start from it.

- `SupervisedTask`: what a warm start other than addition trains on (an alphabet and an example generator), named
  for the cache key.
- `load_or_train_warm_start`: a warm-started (model, tokenizer), from the cache or trained and written into it.
- `warm_start_is_cached`: whether those arguments would load without training.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from exgrpo_trl.tasks.toy import build_char_tokenizer, build_tiny_model, load_char_tokenizer, warm_start

__all__ = ["SupervisedTask", "load_or_train_warm_start", "warm_start_is_cached"]

# Bump when anything that changes a warm-started checkpoint changes (cache key).
_WARM_START_FORMAT = 2


@dataclass(frozen=True)
class SupervisedTask:
    """What a warm start other than addition trains on: the tokenizer's alphabet and an example generator.

    `example(rng)` returns one ``(prompt, answer)`` drawn with `rng` only. `name` goes into the warm-start cache
    key in place of the generator itself: change it whenever the examples or the alphabet change.
    """

    name: str
    alphabet: tuple[str, ...]
    example: Callable[[random.Random], tuple[str, str]]


def _warm_start_key(settings: dict) -> str:
    blob = json.dumps(settings, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _warm_start_entry(
    cache_dir: Path,
    *,
    steps: int,
    seed: int,
    batch_size: int,
    lr: float,
    warmup: int,
    task: SupervisedTask | None = None,
    **model_kwargs,
) -> tuple[Path, dict]:
    settings = {
        "format": _WARM_START_FORMAT,
        "steps": steps,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "warmup": warmup,
        "model": dict(sorted(model_kwargs.items())),
    }
    prefix = "warm-start"
    if task is not None:  # addition (None) keeps the key and folder name it had before tasks existed
        settings["task"] = task.name
        prefix = f"warm-start-{task.name}"
    return Path(cache_dir) / f"{prefix}-{steps}steps-seed{seed}-{_warm_start_key(settings)}", settings


def warm_start_is_cached(
    cache_dir: str | os.PathLike,
    *,
    steps: int = 1000,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 2e-3,
    warmup: int = 100,
    task: SupervisedTask | None = None,
    **model_kwargs,
) -> bool:
    """Whether `load_or_train_warm_start` with the same arguments would load from `cache_dir` (no training)."""
    entry, _ = _warm_start_entry(
        Path(cache_dir), steps=steps, seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, task=task, **model_kwargs
    )
    return (entry / "warm_start.json").is_file()


def load_or_train_warm_start(
    cache_dir: str | os.PathLike,
    *,
    steps: int = 1000,
    seed: int = 0,
    progress: bool = True,
    batch_size: int = 128,
    lr: float = 2e-3,
    warmup: int = 100,
    task: SupervisedTask | None = None,
    **model_kwargs,
):
    """A warm-started (model, tokenizer), trained once and then loaded from `cache_dir`.

    `task` None trains on addition; a `SupervisedTask` trains on its examples with a tokenizer over its alphabet.

    The cache entry is keyed by every setting (steps, seed, optimiser settings, model shape) and written
    atomically (a temporary folder renamed into place), so an interrupted run never leaves a half-written entry.
    The entry folder also holds ``warm_start.json`` (settings, final loss, training time); its path is set on
    the returned model as ``model.warm_start_path``.
    """
    cache_dir = Path(cache_dir)
    entry, settings = _warm_start_entry(
        cache_dir, steps=steps, seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, task=task, **model_kwargs
    )
    if (entry / "warm_start.json").is_file():
        tokenizer = load_char_tokenizer(entry)
        model = Qwen2ForCausalLM.from_pretrained(str(entry), dtype=torch.float32)
        model.warm_start_path = str(entry)
        return model, tokenizer

    tokenizer = build_char_tokenizer() if task is None else build_char_tokenizer(alphabet=task.alphabet)
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    if steps > 0:
        info = warm_start(
            model,
            tokenizer,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            warmup=warmup,
            seed=seed,
            progress=progress,
            example=None if task is None else task.example,
        )
    else:
        info = {"losses": [], "seconds": 0.0, "steps": 0}
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-warm-start-", dir=cache_dir))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        meta = {
            "settings": settings,
            "final_loss": (sum(info["losses"][-20:]) / len(info["losses"][-20:])) if info["losses"] else None,
            "seconds": info["seconds"],
        }
        (tmp / "warm_start.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "warm_start.json").is_file():  # not a concurrent writer that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    model.warm_start_path = str(entry)
    return model, tokenizer
