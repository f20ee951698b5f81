"""ExGRPO's training state on disk: the experience buffer and the trainer's switches, in safetensors and JSON.

Layout, inside a checkpoint folder:

    exgrpo_state/
        buffer.safetensors   token ids (int32) and behaviour log-probs (float16) of every stored trajectory,
                             concatenated, with each trajectory's length and collection step (and, in format
                             2, every token's model mask: uint8, 0 where a tool or an environment inserted it)
        state.json           format version, buffer config, questions (key, bucket, dataset row), retired set,
                             the sampler's random-generator state, the trainer's switches and counters,
                             and a CRC-32 of every array (in format 2, each multi-turn trajectory's record:
                             what the reward functions were given for it beyond its token ids)

Format 1 is the single-turn layout; format 2 adds the optional "model_mask" array and per-question "records", and
is written only when the buffer holds tool-calling or environment trajectories, so a single-turn state is written
exactly as before and older versions of exgrpo-trl still read it. Format 3 adds the images of questions with image
inputs: each image's PNG bytes (lossless: the pixels, and so the question's key, come back exactly) concatenated in
the "image_bytes" array with their sizes in "image_lengths", and in the question's row in state.json a reference
{"exgrpo_image": i} where the image was; it is written only when some buffered question has an image. All three
formats are read (a format-1 state: every token is the model's).

The folder is written under a temporary name and renamed into place, so a crash never leaves a half-written
state behind. No pickle anywhere. Like buffer.py, this module imports nothing from trl, transformers or accelerate.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from .buffer import IDS_DTYPE, LOGPS_DTYPE, MASK_DTYPE, ExperienceBuffer, Trajectory
from .settings import sampling_settings

STATE_DIRNAME = "exgrpo_state"
ARRAYS_FILENAME = "buffer.safetensors"
META_FILENAME = "state.json"
FORMAT_NAME = "exgrpo-trl-state"
FORMAT_VERSION = 3  # the newest format this version writes (1 for a single-turn buffer, 2 with tool tokens)
READABLE_VERSIONS = (1, 2, 3)
# Each trajectory's stamp on the run's clock is saved as "collected_at"; states written before were saved as "steps"
# (the same values): `upgrade_names` renames it as a state is read, the one place that knows the old name.
OLD_ARRAY_NAMES = {"steps": "collected_at"}
IMAGE_REF = "exgrpo_image"  # in a saved row, where an image was: {"exgrpo_image": its index in "image_lengths"}


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
        f"a dataset row stored in the experience buffer holds a value of type {type(value).__name__}, which cannot be "
        "saved as JSON; keep the training dataset's columns to strings, numbers, lists and dicts"
    )


def save_state(directory: str | os.PathLike, buffer: ExperienceBuffer, trainer_state: dict[str, Any]) -> Path:
    """Write `buffer` and `trainer_state` to `directory/exgrpo_state`, atomically. Returns the state folder."""
    directory = Path(directory)
    final = directory / STATE_DIRNAME
    tmp = directory / f".{STATE_DIRNAME}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        buffer_meta = buffer.state_meta()
        images = _take_images(buffer_meta["questions"])
        meta = {
            "format": FORMAT_NAME,
            "format_version": 3 if images else _format_version(buffer),
            "buffer": buffer_meta,
            "trainer": trainer_state,
            "arrays": _write_arrays(tmp / ARRAYS_FILENAME, list(buffer.iter_trajectories()), images),
        }
        text = json.dumps(meta, default=_json_default)  # dumps, not dump: only dumps uses the C encoder
        with open(tmp / META_FILENAME, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


# ---------------------------------------------------------------------------------------------------------- arrays
# buffer.safetensors is written and read here directly, one trajectory at a time, instead of through safetensors'
# save_file / load_file: those need the token arrays concatenated in memory (plus a byte copy on save), i.e. two or
# three times the buffer's size at peak and as many passes over ~1.8 GB at the paper's scale. The file is a
# standard safetensors file all the same (safetensors.safe_open / load_file read it).
_ST_DTYPE = {"int32": "I32", "int64": "I64", "float16": "F16", "float32": "F32", "uint8": "U8"}
_NP_DTYPE = {v: k for k, v in _ST_DTYPE.items()}
_IOV_MAX = 512  # buffers per writev / preadv call (POSIX guarantees at least 16; Linux allows 1024)


def _format_version(buffer: ExperienceBuffer) -> int:
    return 2 if buffer.is_multi_turn else 1


def _is_image(value: Any) -> bool:
    return hasattr(value, "save") and hasattr(value, "mode") and hasattr(value, "size") and hasattr(value, "tobytes")


def take_row_images(row: Any, pieces: list[np.ndarray]) -> Any:
    """`row` with each image in it (an `image` value, the items of an `images` list, images inside the prompt's
    messages) replaced by {"exgrpo_image": i}, its PNG bytes appended to `pieces` as piece i; `row` itself is not
    changed (a copy where an image was)."""
    import io

    if isinstance(row, dict):
        return {k: take_row_images(v, pieces) for k, v in row.items()}
    if isinstance(row, (list, tuple)):
        return [take_row_images(v, pieces) for v in row]
    if not _is_image(row):
        return row
    out = io.BytesIO()
    try:
        row.save(out, format="PNG")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"an image of mode {row.mode} cannot be saved as PNG in the ExGRPO state ({e})") from e
    pieces.append(np.frombuffer(out.getvalue(), dtype=np.uint8))
    return {IMAGE_REF: len(pieces) - 1}


def put_row_images(row: Any, images: list[Any]) -> Any:
    """Undo `take_row_images`: each {"exgrpo_image": i} in `row` becomes images[i]."""
    if isinstance(row, dict):
        if set(row) == {IMAGE_REF}:
            return images[row[IMAGE_REF]]
        return {k: put_row_images(v, images) for k, v in row.items()}
    return [put_row_images(v, images) for v in row] if isinstance(row, list) else row


def count_row_images(row: Any) -> int:
    """How many images a row holds."""
    if isinstance(row, dict):
        return sum(count_row_images(v) for v in row.values())
    if isinstance(row, (list, tuple)):
        return sum(count_row_images(v) for v in row)
    return int(_is_image(row))


def _take_images(questions: list[dict[str, Any]]) -> list[np.ndarray]:
    """Every question's row with its images taken out (`take_row_images`), numbered across the whole buffer."""
    pieces: list[np.ndarray] = []
    for question in questions:
        question["row"] = take_row_images(question["row"], pieces)
    return pieces


def _put_images(questions: list[dict[str, Any]], images: list[Any]) -> None:
    if images:
        for question in questions:
            question["row"] = put_row_images(question["row"], images)


def decode_image(data: bytes):
    """A PIL image from its encoded bytes, loaded (the file handle closed)."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def read_images(directory: str | os.PathLike, meta: dict[str, Any]) -> list[Any]:
    """The images a format-3 state holds, decoded (PIL images), in index order; [] for a state without images."""
    if "image_lengths" not in meta["arrays"]:
        return []
    path = Path(directory) / STATE_DIRNAME / ARRAYS_FILENAME
    arrays = read_small_arrays(directory, meta, ("image_bytes", "image_lengths"))
    data, lengths = arrays["image_bytes"], arrays["image_lengths"]
    if (lengths < 0).any() or int(lengths.sum()) != data.size:
        raise StateFileError(f"ExGRPO state in {path.parent} is inconsistent: image sizes do not add up")
    images, start = [], 0
    for n in lengths.tolist():
        images.append(decode_image(data[start : start + n].tobytes()))
        start += n
    return images


def _saved_arrays(trajectories: list[Trajectory]) -> list[tuple[str, np.dtype, list[np.ndarray]]]:
    """The arrays of the file, each as the list of pieces that concatenate to it (state.json order): four, and the
    model mask when some trajectory holds tool or environment tokens."""
    arrays = [
        ("completion_ids", np.dtype(IDS_DTYPE), [t.completion_ids for t in trajectories]),
        ("logps", np.dtype(LOGPS_DTYPE), [t.logps for t in trajectories]),
        ("lengths", np.dtype(np.int64), [np.array([t.completion_ids.size for t in trajectories], dtype=np.int64)]),
        ("collected_at", np.dtype(np.int64), [np.array([t.collected_at for t in trajectories], dtype=np.int64)]),
    ]
    if any(t.mask is not None for t in trajectories):
        arrays.append(("model_mask", np.dtype(MASK_DTYPE), [t.model_mask() for t in trajectories]))
    return arrays


def _file_order(names_and_dtypes) -> list[str]:
    # widest dtype first, so every array starts aligned to its item size (what safetensors' own writer does)
    return [name for name, dtype in sorted(names_and_dtypes, key=lambda nd: (-nd[1].itemsize, nd[0]))]


def _write_arrays(
    path: Path, trajectories: list[Trajectory], images: list[np.ndarray] = ()
) -> dict[str, dict[str, Any]]:
    """Write the buffer's arrays (and the rows' `images`, PNG bytes) to a safetensors file piece by piece; returns
    state.json's "arrays" entries."""
    arrays = _saved_arrays(trajectories)
    if images:
        lengths = np.array([piece.size for piece in images], dtype=np.int64)
        arrays += [("image_bytes", np.dtype(np.uint8), list(images)), ("image_lengths", np.dtype(np.int64), [lengths])]
    for name, dtype, pieces in arrays:
        for piece in pieces:
            if piece.dtype != dtype or not piece.flags.c_contiguous:
                raise ValueError(f"a stored trajectory's {name} is not a contiguous {dtype} array")
    sizes = {name: sum(p.size for p in pieces) for name, _, pieces in arrays}
    by_name = {name: (dtype, pieces) for name, dtype, pieces in arrays}
    layout = 3 if images else 2 if "model_mask" in by_name else 1  # the arrays' layout
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT_NAME, "version": str(layout)}}
    offset = 0
    order = _file_order((name, dtype) for name, dtype, _ in arrays)
    for name in order:
        dtype = by_name[name][0]
        end = offset + sizes[name] * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPE[dtype.name], "shape": [sizes[name]], "data_offsets": [offset, end]}
        offset = end
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    entries = {}
    with open(path, "wb", buffering=0) as f:
        _write_all(f, [len(header_bytes).to_bytes(8, "little"), header_bytes])
        for name in order:
            pieces = [p for p in by_name[name][1] if p.size]  # contiguous arrays: buffers as they are, no copy
            crc = 0
            for piece in pieces:
                crc = zlib.crc32(piece, crc)
            _write_all(f, pieces)
            entries[name] = {"crc32": crc, "size": sizes[name], "dtype": by_name[name][0].name}
    return {name: entries[name] for name, _, _ in arrays}


def _nbytes(buffer) -> int:
    return buffer.nbytes if isinstance(buffer, (np.ndarray, memoryview)) else len(buffer)


def _advance(buffers: list, done: int) -> list:
    """What is left of `buffers` once their first `done` bytes are transferred (a short read or write)."""
    while buffers and done >= _nbytes(buffers[0]):
        done -= _nbytes(buffers[0])
        buffers = buffers[1:]
    if buffers and done:
        buffers = [memoryview(buffers[0]).cast("B")[done:], *buffers[1:]]
    return buffers


def _write_all(f, buffers: list) -> None:
    """Write every buffer in order: writev in batches where the platform has it, handling short writes."""
    if not hasattr(os, "writev"):
        for buffer in buffers:
            f.write(buffer)
        return
    fd = f.fileno()
    for start in range(0, len(buffers), _IOV_MAX):
        batch = buffers[start : start + _IOV_MAX]
        total = sum(_nbytes(b) for b in batch)
        written = os.writev(fd, batch)
        while written < total:  # a short write: go on from where it stopped
            batch, total = _advance(batch, written), total - written
            written = os.writev(fd, batch)


def _read_header(path: Path) -> tuple[int, dict[str, tuple[str, int, int, int]]]:
    """Parse a safetensors header: (start of the data, {name: (numpy dtype, size, begin, end)}), checked against
    the file's size. Raises StateFileError for a missing, truncated or malformed file."""
    if not path.is_file():
        raise StateFileError(f"ExGRPO buffer file is missing: {path}")
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if file_size < 8 or n <= 0 or 8 + n > file_size:
                raise ValueError(f"header length {n} does not fit a file of {file_size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        entries, end_of_data = {}, 0
        for name, value in header.items():
            if name == "__metadata__":
                continue
            dtype = _NP_DTYPE[value["dtype"]]
            begin, end = (int(x) for x in value["data_offsets"])
            size = int(np.prod(value["shape"], dtype=np.int64))
            if end - begin != size * np.dtype(dtype).itemsize or begin < 0:
                raise ValueError(f"array '{name}' has offsets {begin}..{end} for {size} {dtype} values")
            entries[name] = (dtype, size, begin, end)
            end_of_data = max(end_of_data, end)
        upgrade_names(entries)
        if 8 + n + end_of_data != file_size:
            raise ValueError(f"the header describes {8 + n + end_of_data} bytes, the file has {file_size}")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise StateFileError(f"ExGRPO buffer file is truncated or corrupted: {path} ({e})") from e
    return 8 + n, entries


def _check_header(path: Path, entries: dict, meta: dict[str, Any]) -> None:
    for name, expected in meta["arrays"].items():
        entry = entries.get(name)
        if entry is None or entry[1] != expected["size"] or entry[0] != expected["dtype"]:
            raise StateFileError(f"ExGRPO buffer file does not match its state.json (array '{name}'): {path}")


def _read_into(fd: int, arrays: list[np.ndarray], offset: int, path: Path, crc: int = 0) -> int:
    """Fill `arrays`, in order, from the file at `offset`; returns the CRC-32 of the bytes read (continuing `crc`)."""
    arrays = [a for a in arrays if a.size]  # writable contiguous arrays: read into as they are
    for start in range(0, len(arrays), _IOV_MAX):
        batch = arrays[start : start + _IOV_MAX]
        pending, left = batch, sum(a.nbytes for a in batch)
        while left:
            if hasattr(os, "preadv"):
                got = os.preadv(fd, pending, offset)
            else:
                os.lseek(fd, offset, os.SEEK_SET)
                got = os.readv(fd, pending)
            if got <= 0:
                raise StateFileError(f"ExGRPO buffer file is truncated or corrupted: {path} (unexpected end of file)")
            offset, left = offset + got, left - got
            if left:  # a short read: go on from where it stopped
                pending = _advance(pending, got)
        for array in batch:
            crc = zlib.crc32(array, crc)
    return crc


def _read_checked(fd: int, path: Path, data_start: int, entries: dict, meta: dict[str, Any], name: str) -> np.ndarray:
    """One array of the file, whole, after its CRC-32 is checked against state.json."""
    dtype, size, begin, _ = entries[name]
    array = np.empty(size, dtype=dtype)
    if _read_into(fd, [array], data_start + begin, path) != meta["arrays"][name]["crc32"]:
        raise StateFileError(f"ExGRPO buffer file is corrupted (checksum of '{name}' differs): {path}")
    return array


def _check_listed(path: Path, meta: dict[str, Any], names) -> None:
    missing = set(names) - set(meta["arrays"])
    if missing:
        raise StateFileError(f"ExGRPO state file lists no arrays {sorted(missing)}: {path.parent / META_FILENAME}")


def read_small_arrays(
    directory: str | os.PathLike, meta: dict[str, Any], names: Iterable[str]
) -> dict[str, np.ndarray]:
    """Read only the arrays `names` of `buffer.safetensors` (meant for the per-trajectory "lengths" and
    "collected_at", a few bytes per trajectory), each whole, after checking the file's header against state.json,
    and check their CRC-32s. The other arrays are not read. Raises StateFileError naming the file."""
    names = tuple(names)
    path = Path(directory) / STATE_DIRNAME / ARRAYS_FILENAME
    _check_listed(path, meta, names)
    data_start, entries = _read_header(path)
    _check_header(path, entries, meta)
    with open(path, "rb", buffering=0) as f:
        return {name: _read_checked(f.fileno(), path, data_start, entries, meta, name) for name in names}


def read_trajectories(directory: str | os.PathLike, meta: dict[str, Any]) -> list[Trajectory]:
    """Read every stored trajectory straight from `buffer.safetensors` into its own arrays (no whole-file copy in
    memory), checking sizes against state.json and every array's CRC-32. Raises StateFileError naming the file."""
    path = Path(directory) / STATE_DIRNAME / ARRAYS_FILENAME
    _check_listed(path, meta, ("completion_ids", "logps", "lengths", "collected_at"))
    data_start, entries = _read_header(path)
    _check_header(path, entries, meta)
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        lengths, steps = (_read_checked(fd, path, data_start, entries, meta, n) for n in ("lengths", "collected_at"))
        if steps.size != lengths.size or (lengths < 0).any() or int(lengths.sum()) != entries["completion_ids"][1]:
            raise StateFileError(
                f"ExGRPO state in {path.parent} is inconsistent: {lengths.size} lengths adding up to "
                f"{int(lengths.sum())} tokens, {steps.size} stamps, {entries['completion_ids'][1]} token ids"
            )
        pieces = {}
        per_token = [("completion_ids", IDS_DTYPE), ("logps", LOGPS_DTYPE)]
        if "model_mask" in meta["arrays"]:  # format 2 with tool or environment tokens
            per_token.append(("model_mask", MASK_DTYPE))
        for name, dtype in per_token:
            if entries[name][1] != entries["completion_ids"][1]:
                raise StateFileError(f"ExGRPO state in {path.parent} is inconsistent: {entries[name][1]} {name}")
            pieces[name] = [np.empty(int(n), dtype=dtype) for n in lengths]
            if _read_into(fd, pieces[name], data_start + entries[name][2], path) != meta["arrays"][name]["crc32"]:
                raise StateFileError(f"ExGRPO buffer file is corrupted (checksum of '{name}' differs): {path}")
    masks = pieces.get("model_mask", [None] * len(pieces["logps"]))
    return [
        Trajectory(ids, logps, int(step), mask)
        for ids, logps, step, mask in zip(pieces["completion_ids"], pieces["logps"], steps.tolist(), masks)
    ]


def verify_arrays(directory: str | os.PathLike, meta: dict[str, Any], chunk_bytes: int = 1 << 24) -> None:
    """Check every array of `buffer.safetensors` against state.json (sizes, CRC-32s), reading it in chunks: memory
    stays at one chunk whatever the buffer's size. Raises StateFileError naming the file."""
    path = Path(directory) / STATE_DIRNAME / ARRAYS_FILENAME
    data_start, entries = _read_header(path)
    _check_header(path, entries, meta)
    chunk = np.empty(chunk_bytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        for name, expected in meta["arrays"].items():
            _, _, begin, end = entries[name]
            crc, position = 0, data_start + begin
            while position < data_start + end:
                part = chunk[: min(chunk_bytes, data_start + end - position)]
                crc = _read_into(f.fileno(), [part], position, path, crc)
                position += part.size
            if crc != expected["crc32"]:
                raise StateFileError(f"ExGRPO buffer file is corrupted (checksum of '{name}' differs): {path}")


def has_state(directory: str | os.PathLike) -> bool:
    return (Path(directory) / STATE_DIRNAME).is_dir()


def checkpoint_folder(path: str | os.PathLike) -> Path:
    """The folder holding `exgrpo_state/`: `path` itself, or its parent when `path` is the state folder."""
    path = Path(path)
    if path.name == STATE_DIRNAME and (path / META_FILENAME).exists():
        return path.parent
    return path


def load_checkpoint_buffer(checkpoint: str | os.PathLike) -> ExperienceBuffer:
    """The buffer saved in `checkpoint` (a checkpoint folder, or its `exgrpo_state` folder), read and checked as a
    resume reads it. Raises StateFileError naming the file."""
    checkpoint = checkpoint_folder(checkpoint)
    meta = read_meta(checkpoint)
    buffer = ExperienceBuffer(meta["buffer"]["config"]["num_generations"])
    load_state(checkpoint, buffer, meta=meta)
    return buffer


def upgrade_names(arrays: dict[str, Any]) -> None:
    """Rename, in place, the arrays an older state saved under another name (`OLD_ARRAY_NAMES`): state.json's list,
    the file header's entries and the arrays read whole all go through here."""
    for old, new in OLD_ARRAY_NAMES.items():
        if old in arrays and new not in arrays:
            arrays[new] = arrays.pop(old)


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and check `state.json`: format, version, and the shape of every field the readers use (so that a state
    file of the wrong shape is reported, not met later as a KeyError). Raises StateFileError naming the file."""
    path = Path(directory) / STATE_DIRNAME / META_FILENAME
    if not path.is_file():
        raise StateFileError(f"ExGRPO state file is missing: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    # ValueError: also an integer of too many digits; RecursionError: arrays nested too deep
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise StateFileError(f"ExGRPO state file is truncated or corrupted: {path} ({e})") from e
    if not isinstance(meta, dict):
        raise StateFileError(
            f"ExGRPO state file is malformed (it holds {_describe(meta)}, expected an object): {path}"
        )
    if meta.get("format") != FORMAT_NAME:
        raise StateFileError(f"{path} is not an ExGRPO state file (format {meta.get('format')!r})")
    _field(path, meta, "format_version", "", "an integer")
    if isinstance(meta.get("arrays"), dict):
        upgrade_names(meta["arrays"])
    if meta["format_version"] not in READABLE_VERSIONS:  # before the shape checks: another shape, perhaps
        raise StateFileError(
            f"{path} was written in ExGRPO state format version {meta['format_version']}, this version of "
            f"exgrpo-trl reads version {' or '.join(map(str, READABLE_VERSIONS))}"
        )
    _check_shape(path, meta)
    return meta


# ------------------------------------------------------------------------------------------------ state.json shape
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number, though Python's is


_KINDS = {  # how a field's expected kind is named in messages -> the test
    "an object": lambda v: isinstance(v, dict),
    "an array": lambda v: isinstance(v, list),
    "a string": lambda v: isinstance(v, str),
    "a boolean": lambda v: isinstance(v, bool),
    "an integer": _is_int,
    "a non-negative integer": lambda v: _is_int(v) and v >= 0,
    "a positive integer": lambda v: _is_int(v) and v > 0,
    "a number": lambda v: _is_int(v) or isinstance(v, float),
    "a number or null": lambda v: v is None or _is_int(v) or isinstance(v, float),
    "an integer or null": lambda v: v is None or _is_int(v),
    "an object or null": lambda v: v is None or isinstance(v, dict),
    "a string or null": lambda v: v is None or isinstance(v, str),
    "a pair": lambda v: isinstance(v, list) and len(v) == 2,
}
# A setting's default -> the kind its saved value must be
_KIND_OF = {float: "a number", str: "a string", int: "a non-negative integer", type(None): "an integer or null"}


def _describe(value) -> str:
    """A JSON value as a message names it: containers and strings by kind, other values as written."""
    for kind in ("an object", "an array", "a string"):
        if _KINDS[kind](value):
            return kind
    return json.dumps(value)


def _expect(path: Path, name: str, value, kind: str):
    if not _KINDS[kind](value):
        raise StateFileError(
            f"ExGRPO state file is malformed ('{name}' is {_describe(value)}, expected {kind}): {path}"
        )
    return value


def _field(path: Path, parent: dict, key: str, where: str, kind: str, *, optional: bool = False):
    """`parent[key]`, checked to be of `kind`; `where` names `parent` in messages."""
    name = f"{where}.{key}" if where else key
    if key not in parent:
        if optional:
            return None
        raise StateFileError(f"ExGRPO state file is incomplete (no '{name}'): {path}")
    return _expect(path, name, parent[key], kind)


def _check_shape(path: Path, meta: dict[str, Any]) -> None:
    """Every field of state.json that load_state, buffer.restore, the trainer and `exgrpo inspect` read, by type;
    whether the values fit together (sizes, buckets) is checked where they are used."""
    for section in ("buffer", "trainer", "arrays"):
        _field(path, meta, section, "", "an object")

    arrays = meta["arrays"]
    for name in ("completion_ids", "logps", "lengths", "collected_at"):
        _field(path, arrays, name, "arrays", "an object")
    for name, entry in arrays.items():  # every listed array is checked against the file, so every one is read
        _expect(path, f"arrays.{name}", entry, "an object")
        _field(path, entry, "dtype", f"arrays.{name}", "a string")
        _field(path, entry, "size", f"arrays.{name}", "a non-negative integer")
        _field(path, entry, "crc32", f"arrays.{name}", "a non-negative integer")

    buffer = meta["buffer"]
    config = _field(path, buffer, "config", "buffer", "an object")
    _field(path, config, "num_generations", "buffer.config", "an integer")
    _field(path, config, "seed", "buffer.config", "an integer or null")
    for key, default in sampling_settings().values():  # the buffer's settings, of their default's kind; a state
        # written before a setting existed lacks it (it had the default: `ExperienceBuffer.config_changes`)
        _field(path, config, key, "buffer.config", _KIND_OF[type(default)], optional=True)
    _field(path, buffer, "rng_state", "buffer", "an object")  # its content is numpy's to judge
    for i, question in enumerate(_field(path, buffer, "questions", "buffer", "an array")):
        where = f"buffer.questions[{i}]"
        _expect(path, where, question, "an object")
        for key, kind in (
            ("key", "a string"),
            ("k", "an integer"),
            ("num_trajectories", "a non-negative integer"),
            ("row", "an object"),
        ):
            _field(path, question, key, where, kind)
        _field(path, question, "bucket_position", where, "an integer", optional=True)  # older states lack it
        for j, record in enumerate(_field(path, question, "records", where, "an array", optional=True) or []):
            _expect(path, f"{where}.records[{j}]", record, "an object or null")  # format 2 only
        for j, uses in enumerate(_field(path, question, "uses", where, "an array", optional=True) or []):
            _expect(path, f"{where}.uses[{j}]", uses, "a non-negative integer")  # states before the count: none
        for j, value in enumerate(_field(path, question, "advantages", where, "an array", optional=True) or []):
            _expect(path, f"{where}.advantages[{j}]", value, "a number or null")
    for i, key in enumerate(_field(path, buffer, "retired", "buffer", "an array")):
        _expect(path, f"buffer.retired[{i}]", key, "a string")
    # when questions were replayed: in generation batches ("clock", "replayed_at", "recent"); states written before
    # counted draws ("draws", "replayed_at", "recent_draws"), and states before the reuse limit have none of these
    _field(path, buffer, "clock", "buffer", "a string", optional=True)
    _field(path, buffer, "draws", "buffer", "a non-negative integer", optional=True)
    for key, draw in (_field(path, buffer, "replayed_at", "buffer", "an object", optional=True) or {}).items():
        _expect(path, f"buffer.replayed_at[{key!r}]", draw, "an integer")
    for i, keys in enumerate(_field(path, buffer, "recent_draws", "buffer", "an array", optional=True) or []):
        for j, key in enumerate(_expect(path, f"buffer.recent_draws[{i}]", keys, "an array")):
            _expect(path, f"buffer.recent_draws[{i}][{j}]", key, "a string")
    for i, entry in enumerate(_field(path, buffer, "recent", "buffer", "an array", optional=True) or []):
        at, keys = _expect(path, f"buffer.recent[{i}]", entry, "a pair")
        _expect(path, f"buffer.recent[{i}][0]", at, "an integer")
        for j, key in enumerate(_expect(path, f"buffer.recent[{i}][1]", keys, "an array")):
            _expect(path, f"buffer.recent[{i}][1][{j}]", key, "a string")

    # the trainer's switches: optional (a state may be saved with none), typed when present
    trainer = meta["trainer"]
    _field(path, trainer, "replay_active", "trainer", "a boolean", optional=True)
    _field(path, trainer, "generation_batches", "trainer", "a non-negative integer", optional=True)
    _field(path, trainer, "num_processes", "trainer", "a positive integer", optional=True)  # newer checkpoints
    for name, value in (_field(path, trainer, "latest", "trainer", "an object", optional=True) or {}).items():
        _expect(path, f"trainer.latest.{name}", value, "a number")  # the latest figures (newer checkpoints)
    passes = _field(path, trainer, "sampler_passes", "trainer", "an array", optional=True)  # older checkpoints
    _check_passes(path, passes, "sampler_passes")
    sampler = _field(path, trainer, "sampler", "trainer", "an object", optional=True)
    if sampler is not None:  # where the fresh-question sampler is in its epochs
        _field(path, sampler, "epoch", "trainer.sampler", "an integer")
        _field(path, sampler, "generator", "trainer.sampler", "a string or null")
        _check_passes(path, _field(path, sampler, "passes", "trainer.sampler", "an array"), "sampler.passes")


def _check_passes(path: Path, passes: list | None, name: str) -> None:
    for i, keys in enumerate(passes or []):
        for j, key in enumerate(_expect(path, f"trainer.{name}[{i}]", keys, "an array")):
            _expect(path, f"trainer.{name}[{i}][{j}]", key, "a string")


def read_arrays(directory: str | os.PathLike, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    """Read `buffer.safetensors` whole and check every array against the sizes and CRC-32s recorded in state.json.
    (Loading a buffer goes through `read_trajectories`, checking one through `verify_arrays`: neither holds the
    whole file in memory.)"""
    path = Path(directory) / STATE_DIRNAME / ARRAYS_FILENAME
    if not path.is_file():
        raise StateFileError(f"ExGRPO buffer file is missing: {path}")
    try:
        arrays = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise StateFileError(f"ExGRPO buffer file is truncated or corrupted: {path} ({e})") from e
    upgrade_names(arrays)
    for name, expected in meta["arrays"].items():
        array = arrays.get(name)
        if array is None or array.size != expected["size"] or str(array.dtype) != expected["dtype"]:
            raise StateFileError(f"ExGRPO buffer file does not match its state.json (array '{name}'): {path}")
        if _crc32(array) != expected["crc32"]:
            raise StateFileError(f"ExGRPO buffer file is corrupted (checksum of '{name}' differs): {path}")
    return arrays


def load_state(
    directory: str | os.PathLike,
    buffer: ExperienceBuffer | None,
    *,
    with_trajectories: bool = True,
    meta: dict[str, Any] | None = None,
    updates_per_batch: float | None = None,
) -> dict[str, Any]:
    """Restore `buffer` from `directory/exgrpo_state` and return the saved trainer state.

    With `with_trajectories=False` (processes that hold no trajectories) only state.json is read and `buffer`, if
    given, gets the retired set alone. `meta`: state.json as `read_meta` already returned it (not read again).
    `updates_per_batch`: optimizer updates per generation batch, for the trajectories of states that stamped them
    with the optimizer step (`ExperienceBuffer.restore`).
    """
    if meta is None:
        meta = read_meta(directory)
    if buffer is not None:
        if with_trajectories:
            trajectories = read_trajectories(directory, meta)
            _put_images(meta["buffer"]["questions"], read_images(directory, meta))
            clock = meta["trainer"].get("generation_batches")
            try:
                buffer.restore(meta["buffer"], trajectories, clock=clock, updates_per_batch=updates_per_batch)
            except (KeyError, ValueError, TypeError) as e:
                path = Path(directory) / STATE_DIRNAME
                raise StateFileError(f"ExGRPO state in {path} is inconsistent: {e}") from e
        else:
            buffer.retired.clear()
            buffer.retired.update(meta["buffer"]["retired"])
    return meta["trainer"]
