"""Sampling completions for evaluation: transformers `generate` and vLLM, one interface, seeded."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------------------------
# Prompts and generation
# ----------------------------------------------------------------------------------------------------------------
_WARNED_NO_TEMPLATE = False


def render_prompt(prompt: Any, tokenizer) -> str:
    """A prompt as the text the model reads: a string as is; messages through the tokenizer's chat template with
    the generation prompt (as TRL renders training prompts), or joined by blank lines without a template."""
    global _WARNED_NO_TEMPLATE
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    if not _WARNED_NO_TEMPLATE:
        logger.warning("the tokenizer has no chat template: message prompts are joined as plain text")
        _WARNED_NO_TEMPLATE = True
    return "\n\n".join(str(m["content"]) for m in prompt) + "\n\n"


@dataclass
class Completion:
    text: str
    num_tokens: int
    truncated: bool


class TransformersGenerator:
    """Sampling with transformers ``generate``: prompts x n sequences, in batches of `batch_size` sequences
    (longest prompts first, left padding), seeded without touching the caller's RNG, with a tqdm bar."""

    def __init__(self, model, tokenizer, *, batch_size: int = 32, progress: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.progress = batch_size, progress

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (configured, self.tokenizer.eos_token_id):
            if value is None:
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v not in ids:
                    ids.append(int(v))
        return ids

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int = 0,
        desc: str | None = None,
    ) -> list[list[Completion]]:
        import torch
        from tqdm.auto import tqdm
        from transformers import GenerationConfig

        model = self.model
        eos = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        sample = temperature > 0
        config = dict(
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            eos_token_id=eos or None,
            pad_token_id=pad,
            num_return_sequences=1,
            repetition_penalty=1.0,
        )
        if sample:
            config.update(temperature=temperature, top_p=top_p, top_k=0)
        generation_config = GenerationConfig(**config)

        jobs = [i for i in range(len(prompt_ids)) for _ in range(n)]
        order = sorted(range(len(jobs)), key=lambda j: (-len(prompt_ids[jobs[j]]), j))
        done: list[Completion | None] = [None] * len(jobs)
        device = next(model.parameters()).device
        rng_devices = []
        if device.type == "cuda":
            rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
        was_training = model.training
        model.eval()
        bar = tqdm(
            total=len(jobs), desc=desc or "generating", unit="seq", disable=not self.progress, dynamic_ncols=True
        )
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices):
                torch.manual_seed(seed)
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    rows = [list(prompt_ids[jobs[j]]) for j in chunk]
                    width = max(len(r) for r in rows)
                    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
                    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
                    for r, ids in enumerate(rows):
                        if ids:
                            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                            attention_mask[r, width - len(ids) :] = 1
                    out = model.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention_mask.to(device),
                        generation_config=generation_config,
                    )
                    for j, ids in zip(chunk, out[:, width:].tolist()):
                        done[j] = self._completion(ids, eos)
                    bar.update(len(chunk))
        finally:
            bar.close()
            model.train(was_training)
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for j, completion in enumerate(done):
            grouped[jobs[j]].append(completion)
        return grouped

    def _completion(self, ids: list[int], eos: list[int]) -> Completion:
        stop = next((i for i, t in enumerate(ids) if t in eos), None)
        kept = ids if stop is None else ids[:stop]
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return Completion(text, len(ids) if stop is None else stop + 1, stop is None)


def vllm_available() -> bool:
    """vLLM importable AND a CUDA GPU present (the `auto` backend's test)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _request_seed(seed: int, name: str | None, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class VLLMGenerator:
    """Sampling with vLLM (one engine for all benchmarks). Same interface as `TransformersGenerator`.

    Prompts go in as token ids (tokenized by the same code as the transformers path) and completions are decoded by
    our `tokenizer` from vLLM's token ids (so both paths share tokenization and decoding); sampling is set fully
    (temperature, top-p, max tokens, seed; top-k off, no repetition penalty, whatever the model's generation config
    says), and ``finish_reason == "length"`` marks a truncated completion. `llm_kwargs` go to ``vllm.LLM``
    (e.g. ``{"enforce_eager": true}``). No GPU test here: checked only against PyPI's CPU build of vLLM.
    """

    def __init__(
        self,
        model: str,
        tokenizer,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        seed: int = 0,
        revision: str | None = None,
        trust_remote_code: bool = False,
        progress: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
    ):
        from vllm import LLM

        kwargs = dict(
            model=model,
            tokenizer=tokenizer_path or model,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            revision=revision,
            trust_remote_code=trust_remote_code,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(llm_kwargs or {})
        self.llm = LLM(**kwargs)
        self.tokenizer = tokenizer
        self.progress = progress

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int = 0,
        desc: str | None = None,
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        # One seed per request (from the run's seed, the benchmark and the question's position): reproducible, and
        # unlike one shared seed, different questions do not reuse the same random draws.
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=-1,
                repetition_penalty=1.0,
                max_tokens=max_new_tokens,
                seed=_request_seed(seed, desc, i),
            )
            for i in range(len(prompt_ids))
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        if desc and self.progress:
            logger.info("generating: %s", desc)
        outputs = self.llm.generate(prompts, params, use_tqdm=self.progress)
        return [
            [
                Completion(
                    self.tokenizer.decode(list(o.token_ids), skip_special_tokens=True),
                    len(o.token_ids),
                    o.finish_reason == "length",
                )
                for o in out.outputs
            ]
            for out in outputs
        ]
