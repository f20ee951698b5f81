"""ExGRPO's training state on disk: the experience buffer and the trainer's switches, in safetensors and JSON.

Layout, inside a checkpoint folder:

    exgrpo_state/
        buffer.safetensors   token ids (int32) and behaviour log-probs (float16) of every stored trajectory,
                             concatenated, with each trajectory's length and collection step
        state.json           format version, buffer config, questions (key, bucket, dataset row), retired set,
                             the sampler's random-generator state, the trainer's switches and counters,
                             and a CRC-32 of every array

The folder is written under a temporary name and renamed into place, so a crash never leaves a half-written
state behind. No pickle anywhere. Like buffer.py, this module imports nothing from trl, transformers or accelerate.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from .buffer import ExperienceBuffer

STATE_DIRNAME = "exgrpo_state"
ARRAYS_FILENAME = "buffer.safetensors"
META_FILENAME = "state.json"
FORMAT_NAME = "exgrpo-trl-state"
FORMAT_VERSION = 1


class StateFileError(RuntimeError):
    """A saved ExGRPO state that cannot be used: missing, truncated, corrupted, or of another format version."""


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"))


def _json_default(value: Any):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(
        f"a dataset row stored in the experience buffer holds a value of type {type(value).__name__}, which cannot be saved as "
        "JSON; keep the training dataset's columns to strings, numbers, lists and dicts"
    )


def save_state(directory: str | os.PathLike, buffer: ExperienceBuffer, trainer_state: dict[str, Any]) -> Path:
    """Write `buffer` and `trainer_state` to `directory/exgrpo_state`, atomically. Returns the state folder."""
    directory = Path(directory)
    final = directory / STATE_DIRNAME
    tmp = directory / f".{STATE_DIRNAME}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    arrays, meta = buffer.state_dict()
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "buffer": meta,
        "trainer": trainer_state,
        "arrays": {name: {"crc32": _crc32(a), "size": int(a.size), "dtype": str(a.dtype)} for name, a in arrays.items()},
    }
    save_file(arrays, str(tmp / ARRAYS_FILENAME), metadata={"format": FORMAT_NAME, "version": str(FORMAT_VERSION)})
    with open(tmp / META_FILENAME, "w", encoding="utf-8") as f:
        json.dump(meta, f, default=_json_default)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def has_state(directory: str | os.PathLike) -> bool:
    return (Path(directory) / STATE_DIRNAME).is_dir()


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and check `state.json` (format and version); raises StateFileError naming the file."""
    path = Path(directory) / STATE_DIRNAME / META_FILENAME
    if not path.is_file():
        raise StateFileError(f"ExGRPO state file is missing: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFileError(f"ExGRPO state file is truncated or corrupted: {path} ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise StateFileError(f"{path} is not an ExGRPO state file (format {meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StateFileError(
            f"{path} was written in ExGRPO state format version {meta.get('format_version')}, this version of "
            f"exgrpo-trl reads version {FORMAT_VERSION}"
        )
    for section in ("buffer", "trainer", "arrays"):
        if section not in meta:
            raise StateFileError(f"ExGRPO state file is incomplete (no '{section}'): {path}")
    return meta


def read_arrays(directory: str | os.PathLike, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """Read `buffer.safetensors` and check every array against the sizes and CRC-32s recorded in state.json."""
    path = Path(directory) / STATE_DIRNAME / ARRAYS_FILENAME
    if not path.is_file():
        raise StateFileError(f"ExGRPO buffer file is missing: {path}")
    try:
        arrays = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise StateFileError(f"ExGRPO buffer file is truncated or corrupted: {path} ({e})") from e
    for name, expected in meta["arrays"].items():
        array = arrays.get(name)
        if array is None or array.size != expected["size"] or str(array.dtype) != expected["dtype"]:
            raise StateFileError(f"ExGRPO buffer file does not match its state.json (array '{name}'): {path}")
        if _crc32(array) != expected["crc32"]:
            raise StateFileError(f"ExGRPO buffer file is corrupted (checksum of '{name}' differs): {path}")
    return arrays


def load_state(
    directory: str | os.PathLike, buffer: ExperienceBuffer | None, *, with_trajectories: bool = True
) -> dict[str, Any]:
    """Restore `buffer` from `directory/exgrpo_state` and return the saved trainer state.

    With `with_trajectories=False` (processes that hold no trajectories) only state.json is read and `buffer`, if
    given, gets the retired set alone.
    """
    meta = read_meta(directory)
    if buffer is not None:
        if with_trajectories:
            arrays = read_arrays(directory, meta)
            try:
                buffer.load_state_dict(arrays, meta["buffer"])
            except (KeyError, ValueError, TypeError) as e:
                path = Path(directory) / STATE_DIRNAME
                raise StateFileError(f"ExGRPO state in {path} is inconsistent: {e}") from e
        else:
            buffer.retired.clear()
            buffer.retired.update(meta["buffer"]["retired"])
    return meta["trainer"]
