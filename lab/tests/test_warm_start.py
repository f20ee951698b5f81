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


# ------------------------------------------------------------------------------------------------ shipped entries
def _ship(tmp_path, monkeypatch, kw):
    """Train a tiny warm start into one cache folder and make it the only shipped entry (as `lab.study.ship` does:
    its warm_start.json completed with the weights' sha256)."""
    import json
    import shutil

    shipped = tmp_path / "shipped"
    monkeypatch.setattr(warm_start_cache, "SHIPPED", shipped)
    model, _ = load_or_train_warm_start(tmp_path / "built", **kw)
    entry = Path(model.warm_start_path)
    shutil.copytree(entry, shipped / entry.name)
    meta = json.loads((entry / "warm_start.json").read_text())
    assert meta["weights_sha256"] == warm_start_cache.weights_sha256(model)  # recorded when built
    assert meta["machine"]["capability"] == torch.backends.cpu.get_cpu_capability()
    return model, shipped / entry.name


KW = dict(steps=3, seed=1, progress=False, batch_size=8, hidden_size=64, num_heads=1, num_layers=1)


def test_a_shipped_warm_start_loads_first_and_is_checked(tmp_path, monkeypatch):
    import json

    built, shipped = _ship(tmp_path, monkeypatch, KW)
    monkeypatch.setattr(warm_start_cache, "warm_start", lambda *a, **k: pytest.fail("trained with a shipped entry"))
    cache = tmp_path / "empty-cache"
    assert warm_start_cache.warm_start_is_cached(cache, **{k: v for k, v in KW.items() if k != "progress"})
    model, _ = load_or_train_warm_start(cache, **KW)
    assert model.warm_start_path == str(shipped) and not cache.exists()  # nothing trained or written
    assert warm_start_cache.weights_sha256(model) == warm_start_cache.weights_sha256(built)
    # a damaged copy (here: the recorded sha256 no longer the weights') is refused in one line naming the file
    meta = json.loads((shipped / "warm_start.json").read_text())
    (shipped / "warm_start.json").write_text(json.dumps({**meta, "weights_sha256": "ab" * 32}))
    with pytest.raises(warm_start_cache.WarmStartError, match=r"model\.safetensors: its weights' sha256 is not"):
        load_or_train_warm_start(cache, **KW)


def test_rebuild_trains_afresh_and_compares_with_the_shipped_entry(tmp_path, monkeypatch, capsys):
    import json

    built, shipped = _ship(tmp_path, monkeypatch, KW)
    try:
        warm_start_cache.warm_start_source("rebuild")
        model, _ = load_or_train_warm_start(tmp_path / "cache", **KW)
        assert Path(model.warm_start_path).parent == tmp_path / "cache"
        # the same settings on the same machine: the same weights (one thread, deterministic)
        line = capsys.readouterr().err.splitlines()[-1]
        assert "rebuilt on this machine" in line and line.endswith("equal to the shipped entry")
        # a second load in this process reads the rebuilt entry, not a third training
        monkeypatch.setattr(warm_start_cache, "warm_start", lambda *a, **k: pytest.fail("rebuilt twice"))
        again, _ = load_or_train_warm_start(tmp_path / "cache", **KW)
        assert again.warm_start_path == model.warm_start_path
        monkeypatch.undo()
        # a shipped entry whose weights differ from a rebuild's: said so
        monkeypatch.setattr(warm_start_cache, "SHIPPED", shipped.parent)
        meta = json.loads((shipped / "warm_start.json").read_text())
        (shipped / "warm_start.json").write_text(json.dumps({**meta, "weights_sha256": "ab" * 32}))
        warm_start_cache._rebuilt.clear()
        load_or_train_warm_start(tmp_path / "cache", **KW)
        line = capsys.readouterr().err.splitlines()[-1]
        assert "DIFFERS from the shipped entry (abababababab...)" in line
        with pytest.raises(ValueError, match="warm-start source 'nowhere'"):
            warm_start_cache.warm_start_source("nowhere")
    finally:
        warm_start_cache.warm_start_source("shipped")
        warm_start_cache._rebuilt.clear()


def test_the_shipped_warm_starts_are_the_registered_runs(tmp_path):
    # Every warm start a registered run recorded ships, with the sha256 the runs recorded, and loads to those weights.
    import json

    from lab.study import confirm
    from lab.study.tasks import TASKS

    recorded = {}
    for path in Path(confirm.RESULTS).glob("*/*/seed*.json"):
        record = json.loads(path.read_text())
        recorded.setdefault(record["task"], set()).add(record["provenance"]["warm_start_sha256"])
    assert set(recorded) == set(confirm.SETTINGS) and all(len(v) == 1 for v in recorded.values())
    for setting, (sha,) in recorded.items():
        task = TASKS[setting]
        model, _ = task.load(str(tmp_path), task.warm_start_steps, False)  # an empty cache: only the shipped entry
        assert Path(model.warm_start_path).parent == warm_start_cache.SHIPPED, setting
        assert warm_start_cache.weights_sha256(model) == sha, setting
        meta = json.loads((Path(model.warm_start_path) / "warm_start.json").read_text())
        assert meta["weights_sha256"] == sha and 0 < meta["held_out_pass_at_1"]["overall"] < 1
    assert not any(tmp_path.iterdir())  # nothing trained
