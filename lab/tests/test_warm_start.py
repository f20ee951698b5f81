"""The lab's warm-start cache (lab.warm_start): a hit loads without training, and addition's entry names are pinned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exgrpo_trl.tasks.toy import build_char_tokenizer
from lab import warm_start as warm_start_cache
from lab.warm_start import load_or_train_warm_start


def test_warm_start_cache_hit(tmp_path, monkeypatch):
    kw = dict(steps=3, seed=1, progress=False, batch_size=8, hidden_size=64, num_heads=1, num_layers=1)
    cache_kw = {k: v for k, v in kw.items() if k != "progress"}
    assert not warm_start_cache.warm_start_is_cached(tmp_path, **cache_kw)
    model, tok = load_or_train_warm_start(tmp_path, **kw)
    assert warm_start_cache.warm_start_is_cached(tmp_path, **cache_kw)
    assert not warm_start_cache.warm_start_is_cached(tmp_path, **{**cache_kw, "seed": 2})
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and (entries[0] / "warm_start.json").is_file()  # no temp folder left

    def boom(*args, **kwargs):
        raise AssertionError("warm start trained again on a cache hit")

    monkeypatch.setattr(warm_start_cache, "warm_start", boom)
    again, tok2 = load_or_train_warm_start(tmp_path, **kw)
    assert again.warm_start_path == model.warm_start_path
    sd, sd2 = model.state_dict(), again.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert tok2("12+3=")["input_ids"] == tok("12+3=")["input_ids"]
    # another setting is another entry, which must train (and here hits the stub)
    with pytest.raises(AssertionError, match="trained again"):
        load_or_train_warm_start(tmp_path, **{**kw, "steps": 4})


def test_addition_vocab_and_cache_key_pinned():
    # ids and the demo's warm-start entry name as they were before the tokenizer took an alphabet and the warm
    # start a task: a change here orphans every cached addition warm start
    vocab = build_char_tokenizer().get_vocab()
    assert vocab == {
        "<pad>": 0,
        "<eos>": 1,
        "<bos>": 2,
        "<unk>": 3,
        **{str(d): 4 + d for d in range(10)},
        "+": 14,
        "=": 15,
    }
    demo = dict(steps=1500, seed=0, batch_size=128, lr=2e-3, warmup=100)
    shape = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512)
    entry, settings = warm_start_cache._warm_start_entry(Path("c"), **demo, **shape)
    assert entry.name == "warm-start-1500steps-seed0-dc0db9a3570b" and "task" not in settings
