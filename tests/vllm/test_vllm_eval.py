"""`exgrpo eval`'s vLLM generator (exgrpo_trl.eval) against a real vLLM (PyPI's CPU build), in `.venv-vllm`
(`make vllm_test`, part of `make test`)."""

from __future__ import annotations

import pytest

from exgrpo_trl import eval as ev

from .helpers import vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_vllm_generator_matches_transformers_greedy(tokenizer_dir, tokenizer, tmp_path, monkeypatch):
    """`exgrpo eval`'s vLLM generator against a real vLLM (PyPI's CPU build): seeded sampling repeats, lengths and
    truncation are consistent, and greedy decoding gives the transformers generator's completions token for token."""
    from transformers import AutoModelForCausalLM

    for key, value in vllm_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "5+5=", "987+6=")]
    vllm_gen = ev.VLLMGenerator(
        tokenizer_dir,
        tokenizer,
        dtype="float32",
        max_model_len=64,
        seed=0,
        progress=False,
        llm_kwargs={"enforce_eager": True},
    )
    sampled = vllm_gen.generate(ids, n=3, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=7, desc="t")
    assert sampled == vllm_gen.generate(ids, n=3, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=7, desc="t")
    assert [len(x) for x in sampled] == [3, 3, 3]
    assert all(1 <= c.num_tokens <= 5 and (not c.truncated or c.num_tokens == 5) for x in sampled for c in x)
    # greedy: the same prompt tokens and decoding give the same completions as the transformers path
    hf_gen = ev.TransformersGenerator(AutoModelForCausalLM.from_pretrained(tokenizer_dir), tokenizer, progress=False)
    greedy = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=6)
    assert vllm_gen.generate(ids, **greedy) == hf_gen.generate(ids, **greedy)
