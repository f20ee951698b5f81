"""The lab's warm starts: a supervised warm start of the toy model (`exgrpo_trl.tasks.toy.warm_start`), shipped
with the repository for every setting a registered run used (`SHIPPED`), else trained once per setting into a cache
folder and then loaded from disk. The study, the demo and Countdown start from it.

Why ship them: the addition warm start sits on a sharp transition (held-out pass@1 0.31 at 1,200 supervised steps,
0.76 at 1,500), so a last-bit difference between two CPUs' kernels (AVX2 against AVX-512) decides which side a rebuild
lands on. A shipped entry is the exact file the registered runs trained from; its ``warm_start.json`` records the
weights' sha256 (`weights_sha256`, checked on every load) and its held-out pass@1. Anything registered from now on
takes a warm-start length on a plateau of held-out pass@1 (where a few steps more or less change it little), never on
a transition like addition's, and ships its entry (`python -m lab.study.ship`) before the first run.

- `SupervisedTask`: what a warm start other than addition trains on (an alphabet and an example generator), named
  for the cache key.
- `load_or_train_warm_start`: a warm-started (model, tokenizer): the shipped entry, else the cache's, else trained
  and written into the cache; with the source "rebuild" trained afresh and compared with the shipped entry.
- `warm_start_is_cached`: whether those arguments would load without training.
- `warm_start_source`: where warm starts come from in this process ("shipped", "cache" or "rebuild").
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

__all__ = [
    "SHIPPED",
    "SOURCES",
    "SupervisedTask",
    "WarmStartError",
    "load_or_train_warm_start",
    "warm_start_is_cached",
    "warm_start_source",
]

# Bump when anything that changes a warm-started checkpoint changes (cache key).
_WARM_START_FORMAT = 2
# The warm starts that ship with the repository, one folder per entry, named as in a cache folder.
SHIPPED = Path(__file__).resolve().parent / "warm_starts"
# shipped: the shipped entry where there is one (else the cache's, trained if missing); cache: the cache's only;
# rebuild: trained afresh into the cache (once per process and entry), then compared with the shipped entry.
SOURCES = ("shipped", "cache", "rebuild")
_source = {"value": "shipped"}
_rebuilt: set[str] = set()  # entries this process has rebuilt (a second load reads the rebuilt one)


class WarmStartError(ValueError):
    """A shipped or cached warm start whose weights are not the ones its ``warm_start.json`` records."""


def warm_start_source(value: str | None = None) -> str:
    """Where warm starts come from in this process (module docstring, `SOURCES`); sets it when `value` is given."""
    if value is not None:
        if value not in SOURCES:
            raise ValueError(f"warm-start source {value!r}: expected one of {', '.join(SOURCES)}")
        _source["value"] = value
    return _source["value"]


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
    """Whether `load_or_train_warm_start` with the same arguments would load (shipped or from `cache_dir`) without
    training."""
    entry, _ = _warm_start_entry(
        Path(cache_dir), steps=steps, seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, task=task, **model_kwargs
    )
    source = warm_start_source()
    if source == "rebuild" and entry.name not in _rebuilt:
        return False
    return (entry / "warm_start.json").is_file() or (source == "shipped" and (SHIPPED / entry.name).is_dir())


def weights_sha256(model) -> str:
    """sha256 of a model's state dict: each tensor's name, dtype, shape and bytes, in name order (what a study run
    records as ``warm_start_sha256``)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous().view(-1)
        h.update(f"{name}:{t.dtype}:{tuple(tensor.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())  # the raw bytes, whatever the dtype (bf16 included)
    return h.hexdigest()


def machine() -> dict:
    """The machine a warm start or a run was made on, as far as it decides the numbers: the CPU's model name, the
    kernels torch picked for it (`torch.backends.cpu.get_cpu_capability()`: AVX512, AVX2, ...) and torch's thread
    count."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"cpu": _cpu_model(), "capability": capability, "threads": torch.get_num_threads()}


def _cpu_model() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _load_entry(entry: Path):
    """(model, tokenizer) from an entry folder, its weights checked against the sha256 its warm_start.json records."""
    meta_path = entry / "warm_start.json"
    try:
        meta = json.loads(meta_path.read_text())
        tokenizer = load_char_tokenizer(entry)
        model = Qwen2ForCausalLM.from_pretrained(str(entry), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise WarmStartError(f"{entry}: the warm start does not load ({exc})") from exc
    expected = meta.get("weights_sha256")
    if expected is not None and weights_sha256(model) != expected:
        raise WarmStartError(
            f"{entry / 'model.safetensors'}: its weights' sha256 is not the {expected[:12]}... its warm_start.json "
            "records (a damaged copy or a Git LFS pointer: check the file out again)"
        )
    model.warm_start_path = str(entry)
    return model, tokenizer


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

    Where it comes from follows `warm_start_source`: "shipped" (the default) loads the repository's entry of these
    settings when there is one, else the cache's; "cache" skips the shipped entries; "rebuild" trains afresh into the
    cache once per process and says on stderr whether the weights equal the shipped entry's.

    The cache entry is keyed by every setting (steps, seed, optimiser settings, model shape) and written
    atomically (a temporary folder renamed into place), so an interrupted run never leaves a half-written entry.
    The entry folder also holds ``warm_start.json`` (settings, final loss, training time); its path is set on
    the returned model as ``model.warm_start_path``.
    """
    cache_dir = Path(cache_dir)
    entry, settings = _warm_start_entry(
        cache_dir, steps=steps, seed=seed, batch_size=batch_size, lr=lr, warmup=warmup, task=task, **model_kwargs
    )
    source = warm_start_source()
    shipped = SHIPPED / entry.name
    if source == "shipped" and (shipped / "warm_start.json").is_file():
        return _load_entry(shipped)
    rebuild = source == "rebuild" and entry.name not in _rebuilt
    if (entry / "warm_start.json").is_file() and not rebuild:
        return _load_entry(entry)

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
            "weights_sha256": weights_sha256(model),
            "machine": machine(),
        }
        (tmp / "warm_start.json").write_text(json.dumps(meta, indent=2) + "\n")
        if rebuild and entry.exists():  # an earlier entry of these settings makes way for the rebuilt one
            old = entry.with_name(f".old-{entry.name}-{os.getpid()}")
            os.rename(entry, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / "warm_start.json").is_file():  # not a concurrent writer that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if rebuild:
        _rebuilt.add(entry.name)
        _tell_rebuilt(entry, shipped, meta)
    model.warm_start_path = str(entry)
    return model, tokenizer


def _tell_rebuilt(entry: Path, shipped: Path, meta: dict) -> None:
    """One line on stderr: the rebuilt warm start against the shipped entry of the same settings."""
    import sys

    made = meta["weights_sha256"]
    m = meta["machine"]
    where = f"{m['cpu']}, {m['capability']} kernels, {m['threads']} thread(s)"
    try:
        ship = json.loads((shipped / "warm_start.json").read_text()).get("weights_sha256")
    except (OSError, ValueError):
        ship = None
    if ship is None:
        said = "no shipped entry of these settings to compare with"
    elif ship == made:
        said = "equal to the shipped entry"
    else:
        said = (f"DIFFERS from the shipped entry ({ship[:12]}...): runs from this one will not retrace runs made from "
                "the shipped one")  # fmt: skip
    print(f"warm start {entry.name} rebuilt on this machine ({where}): sha256 {made[:12]}..., {said}",
          file=sys.stderr, flush=True)  # fmt: skip
