"""The experience buffer as a Hugging Face dataset: exported from a checkpoint (`exgrpo export`), and read back to seed
a new run's buffer (`ExGRPOConfig.initial_experience`).

An export is a plain `datasets.Dataset` (ready for ``push_to_hub``), one row per stored trajectory, questions in
buffer order and each question's trajectories in stored order:

    question_key     the question's key in the buffer (a hash of its prompt, `buffer.question_key`)
    row              the question's dataset row, as JSON (rows differ in their columns)
    prompt           the row's prompt: the string, or the JSON of its message list
    completion       the completion's text, decoded with the run's tokenizer (special tokens skipped)
    completion_ids   its token ids (int32), EOS included
    behaviour_logps  the behaviour policy's log-prob of each token: the stored float16 values, as float32 (exact)
    num_tokens       len(completion_ids)
    collected_at     the generation batch it was collected in (earlier versions: the optimizer step)
    k                the question's latest success count, out of num_generations
    source           "on_policy", or "offline" when every behaviour log-prob is exactly 0 (probability 1)
    mask, record     multi-turn buffers only: the model mask (1 where the model produced the token; None: every
                     token) and, as JSON, what the reward functions were given beyond the token ids (or None)
    images           buffers with image inputs only: the question's images (a `datasets` Image list, PNG), and in
                     `row` a reference {"exgrpo_image": i} where image i was

Beside the rows, a JSON object says what the ids mean: the export format, the buffer's `num_generations` and the
tokenizer's class and fingerprint (`tokenizer_fingerprint`). An export folder holds it as `exgrpo_export.json`
beside the files of ``save_to_disk`` (``datasets.load_from_disk`` reads the folder as usual); a parquet export holds
the same object in the file's key-value metadata, under the key ``exgrpo_export``. Seeding reads it to tell whether
the token ids can be kept as they are (the same tokenizer) or the text must be tokenized again.

No pickle anywhere: arrow, parquet and JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from .buffer import IDS_DTYPE, LOGPS_DTYPE, MASK_DTYPE, ExperienceBuffer, Trajectory
from .state_file import decode_image, load_checkpoint_buffer, put_row_images, take_row_images

EXPORT_FORMAT = "exgrpo-trl-export"
EXPORT_VERSION = 1
EXPORT_META_FILENAME = "exgrpo_export.json"
PARQUET_META_KEY = b"exgrpo_export"
COLUMNS = (
    "question_key",
    "row",
    "prompt",
    "completion",
    "completion_ids",
    "behaviour_logps",
    "num_tokens",
    "collected_at",
    "k",
    "source",
)
MULTI_TURN_COLUMNS = ("mask", "record")
CHUNK_ROWS = 1024  # trajectories decoded and converted to arrow at a time


class ExportError(ValueError):
    """An export that cannot be written or read: a missing path, another format, another num_generations."""


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what token ids mean: the tokenizer's class, its EOS id and its whole vocabulary (sorted). Two
    tokenizers with the same fingerprint give the same ids for the same text. A processor: its tokenizer's."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    what = [type(tokenizer).__name__, tokenizer.eos_token_id, sorted(tokenizer.get_vocab().items())]
    return hashlib.sha256(json.dumps(what, ensure_ascii=False).encode("utf-8")).hexdigest()


def export_features(multi_turn: bool, images: bool = False) -> datasets.Features:
    features = {
        "question_key": datasets.Value("string"),
        "row": datasets.Value("string"),
        "prompt": datasets.Value("string"),
        "completion": datasets.Value("string"),
        "completion_ids": datasets.List(datasets.Value("int32")),
        "behaviour_logps": datasets.List(datasets.Value("float32")),
        "num_tokens": datasets.Value("int32"),
        "collected_at": datasets.Value("int64"),
        "k": datasets.Value("int32"),
        "source": datasets.Value("string"),
    }
    if multi_turn:
        features["mask"] = datasets.List(datasets.Value("uint8"))
        features["record"] = datasets.Value("string")
    if images:
        features["images"] = datasets.List(datasets.Image())
    return datasets.Features(features)


def _prompt_text(row: dict[str, Any]) -> str:
    prompt = row.get("prompt")
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


def is_offline(trajectory: Trajectory) -> bool:
    """Taken with behaviour probability 1 (an offline solution, or a trajectory seeded with another tokenizer)."""
    return trajectory.logps.size > 0 and not trajectory.logps.any()


def export_meta(buffer: ExperienceBuffer, tokenizer) -> dict[str, Any]:
    """The JSON object stored beside an export's rows."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    return {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_VERSION,
        "num_generations": buffer.num_generations,
        "tokenizer": {"class": type(tokenizer).__name__, "fingerprint": tokenizer_fingerprint(tokenizer)},
        "questions": buffer.num_questions,
        "trajectories": buffer.num_trajectories,
    }


def buffer_dataset(buffer: ExperienceBuffer, tokenizer, *, progress: bool = True) -> datasets.Dataset:
    """`buffer` as an export's rows (see the module's docstring), its completions decoded with `tokenizer`."""
    multi_turn = buffer.is_multi_turn
    rows, pngs = {}, {}  # per question: its row with image references, and its images' PNG bytes
    for key, entry in buffer.questions.items():
        pieces: list[np.ndarray] = []
        rows[key] = take_row_images(entry.row, pieces)
        pngs[key] = [{"bytes": piece.tobytes(), "path": None} for piece in pieces]
    with_images = any(pngs.values())
    features = export_features(multi_turn, with_images)
    schema = features.arrow_schema
    flat = [(key, entry, t) for key, entry in buffer.questions.items() for t in entry.trajectories]
    batches = []
    with tqdm(total=len(flat), desc="exporting trajectories", unit="traj", disable=not progress) as bar:
        for start in range(0, len(flat), CHUNK_ROWS):
            chunk = flat[start : start + CHUNK_ROWS]
            texts = tokenizer.batch_decode([t.completion_ids.tolist() for _, _, t in chunk], skip_special_tokens=True)
            columns = {
                "question_key": [key for key, _, _ in chunk],
                "row": [json.dumps(rows[key], ensure_ascii=False) for key, _, _ in chunk],
                "prompt": [_prompt_text(rows[key]) for key, _, _ in chunk],
                "completion": texts,
                "completion_ids": [t.completion_ids for _, _, t in chunk],
                "behaviour_logps": [t.logps.astype(np.float32) for _, _, t in chunk],
                "num_tokens": [int(t.completion_ids.size) for _, _, t in chunk],
                "collected_at": [int(t.collected_at) for _, _, t in chunk],
                "k": [entry.k for _, entry, _ in chunk],
                "source": ["offline" if is_offline(t) else "on_policy" for _, _, t in chunk],
            }
            if multi_turn:
                columns["mask"] = [t.mask for _, _, t in chunk]
                columns["record"] = [
                    None if t.record is None else json.dumps(t.record, ensure_ascii=False) for _, _, t in chunk
                ]
            if with_images:
                columns["images"] = [pngs[key] for key, _, _ in chunk]
            batches.append(pa.RecordBatch.from_pydict(columns, schema=schema))
            bar.update(len(chunk))
    table = pa.Table.from_batches(batches, schema=schema)
    return datasets.Dataset(datasets.table.InMemoryTable(table), info=datasets.DatasetInfo(features=features))


def write_export(
    dataset: datasets.Dataset,
    meta: dict[str, Any],
    out_dir: str | os.PathLike,
    parquet: str | os.PathLike | None = None,
) -> None:
    """Save `dataset` with ``save_to_disk(out_dir)`` and `meta` as `out_dir/exgrpo_export.json`, and, with
    `parquet`, both as one parquet file (`meta` in its key-value metadata). `out_dir` must not exist, or hold an
    earlier export (which is replaced); the folder is written under a temporary name and renamed into place."""
    out_dir = _checked_out_dir(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        dataset.save_to_disk(str(tmp))
        (tmp / EXPORT_META_FILENAME).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if parquet is not None:
        table = dataset.with_format("arrow")[:]
        metadata = {**(table.schema.metadata or {}), PARQUET_META_KEY: json.dumps(meta).encode("utf-8")}
        pq.write_table(table.replace_schema_metadata(metadata), str(parquet))


def _checked_out_dir(out_dir: str | os.PathLike) -> Path:
    """`out_dir`, when an export may be written there: it does not exist, is empty, or holds an earlier export."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / EXPORT_META_FILENAME).is_file())
    ):
        raise ExportError(f"{out_dir} exists and is not an earlier export: choose another output folder")
    return out_dir


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer,
    parquet: str | os.PathLike | None = None,
    progress: bool = True,
) -> datasets.Dataset:
    """Export the experience buffer saved in `checkpoint` to `out_dir` (``datasets.load_from_disk`` reads it back)
    and, with `parquet`, to that parquet file; `tokenizer` decodes the completions and is fingerprinted. Returns the
    dataset (a plain `datasets.Dataset`, e.g. for ``push_to_hub``)."""
    _checked_out_dir(out_dir)  # before the work
    buffer = load_checkpoint_buffer(checkpoint)
    dataset = buffer_dataset(buffer, tokenizer, progress=progress)
    write_export(dataset, export_meta(buffer, tokenizer), out_dir, parquet)
    return dataset


# ------------------------------------------------------------------------------------------------------ reading back
def read_export_meta(path: str | os.PathLike, *, num_generations: int | None = None) -> dict[str, Any]:
    """The JSON object of the export at `path` (a folder written by `write_export`, or its parquet file), checked:
    its format, and, given `num_generations`, that the buffer it came from had as many (success counts do not carry
    over to another K). Raises ExportError naming the path."""
    path = Path(path)
    try:
        if path.is_dir():
            file = path / EXPORT_META_FILENAME
            if not file.is_file():
                raise ExportError(f"{path} is not an ExGRPO buffer export (no {EXPORT_META_FILENAME})")
            meta = json.loads(file.read_text(encoding="utf-8"))
        elif path.is_file():
            metadata = pq.read_schema(str(path)).metadata or {}
            if PARQUET_META_KEY not in metadata:
                raise ExportError(f"{path} is not an ExGRPO buffer export (no {PARQUET_META_KEY.decode()} metadata)")
            meta = json.loads(metadata[PARQUET_META_KEY])
        else:
            raise ExportError(f"ExGRPO buffer export not found: {path}")
    except ExportError:
        raise
    except (OSError, ValueError, pa.ArrowException) as e:  # JSONDecodeError is a ValueError
        raise ExportError(f"ExGRPO buffer export is unreadable: {path} ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{path} is not an ExGRPO buffer export (format {_get(meta, 'format')!r})")
    if meta.get("format_version") != EXPORT_VERSION:
        raise ExportError(
            f"{path} was written in ExGRPO export format version {meta.get('format_version')!r}, this version of "
            f"exgrpo-trl reads version {EXPORT_VERSION}"
        )
    saved, fingerprint = meta.get("num_generations"), _get(meta.get("tokenizer"), "fingerprint")
    if not isinstance(saved, int) or not isinstance(fingerprint, str):
        raise ExportError(f"{path} is an incomplete ExGRPO buffer export (no num_generations or tokenizer hash)")
    if num_generations is not None and saved != num_generations:
        raise ExportError(
            f"{path} was exported from a run with num_generations={saved}, this run uses {num_generations}: its "
            f"success counts do not carry over. Seed a run with num_generations={saved}, or export another buffer."
        )
    return meta


def _get(meta: Any, key: str) -> Any:
    return meta.get(key) if isinstance(meta, dict) else None


def _export_batches(path: Path) -> tuple[int, Iterator[pa.Table | pa.RecordBatch]]:
    """(number of rows, the rows in arrow batches) of the export at `path`."""
    try:
        if path.is_dir():
            dataset = datasets.load_from_disk(str(path))
            if not isinstance(dataset, datasets.Dataset):
                raise ExportError(f"{path} holds a DatasetDict, not one exported buffer")
            names, num_rows = dataset.column_names, len(dataset)
            batches = dataset.with_format("arrow").iter(batch_size=CHUNK_ROWS)
        else:
            file = pq.ParquetFile(str(path))
            names, num_rows = file.schema_arrow.names, file.metadata.num_rows
            batches = file.iter_batches(batch_size=CHUNK_ROWS)
    except ExportError:
        raise
    except (OSError, ValueError, pa.ArrowException) as e:  # datasets raises FileNotFoundError for a bad folder
        raise ExportError(f"ExGRPO buffer export is unreadable: {path} ({e})") from e
    missing = [name for name in COLUMNS if name not in names]
    if missing:
        raise ExportError(f"ExGRPO buffer export {path} lacks the columns {', '.join(missing)}")
    return num_rows, batches


@dataclass
class SeedReport:
    """What `seed_buffer` put into the buffer, and what it left out (trajectories, except `bad_k`: questions)."""

    questions: int = 0
    trajectories: int = 0
    retokenized: bool = False  # another tokenizer: the text was tokenized again, behaviour log-probs set to 0
    too_long: int = 0  # longer than max_completion_length (after re-tokenizing)
    multi_turn: int = 0  # tool or environment tokens: not re-tokenized (which tokens are the model's is unknown)
    bad_k: int = 0  # questions whose k is not in 1..K-1

    def skipped(self) -> str | None:
        """One line on what was left out, or None."""
        parts = []
        if self.too_long:
            parts.append(f"{self.too_long} trajectories longer than max_completion_length")
        if self.multi_turn:
            parts.append(f"{self.multi_turn} multi-turn trajectories (another tokenizer: cannot be re-tokenized)")
        if self.bad_k:
            parts.append(f"{self.bad_k} questions whose success count k is not in 1..num_generations-1")
        return "; ".join(parts) or None


def _record_batches(part: pa.Table | pa.RecordBatch) -> list[pa.RecordBatch]:
    return part.combine_chunks().to_batches() if isinstance(part, pa.Table) else [part]


def _list_parts(column: pa.ListArray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column's values (as `dtype`) and offsets: row i is values[offsets[i] : offsets[i + 1]]."""
    return column.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False), column.offsets.to_numpy()


def _column(batch: pa.RecordBatch, name: str) -> list:
    return batch.column(name).to_pylist() if name in batch.schema.names else [None] * batch.num_rows


def seed_buffer(
    buffer: ExperienceBuffer,
    path: str | os.PathLike,
    *,
    fingerprint: str,
    tokenize: Callable[[str], list[int]],
    max_length: int | None,
    meta: dict[str, Any] | None = None,
    progress: bool = True,
    clock: int = 0,
) -> SeedReport:
    """Fill `buffer` from the export at `path`: each question with its row, its k and its trajectories.

    `fingerprint`: this run's tokenizer's (`tokenizer_fingerprint`). When it is the export's, the trajectories keep
    their token ids and behaviour log-probs; otherwise each completion's text is tokenized again with `tokenize`
    (as the model's completion would be: the text, then EOS) and taken as offline, behaviour log-probs all 0.
    Left out (and counted in the report): trajectories longer than `max_length` tokens, multi-turn trajectories when
    re-tokenizing, and questions whose k is not in 1..K-1. Raises ExportError for an export of another K.
    The trajectories are put on this run's clock: stamped `clock` (the generation batch the run seeds at, 0), not the
    exporting run's, so that their age counts from the seeding (the export's `collected_at` is the other run's
    clock)."""
    path = Path(path)
    if meta is None:
        meta = read_export_meta(path, num_generations=buffer.num_generations)
    report = SeedReport(retokenized=meta["tokenizer"]["fingerprint"] != fingerprint)
    questions: dict[str, tuple[dict[str, Any], int, list[Trajectory]]] = {}  # in the export's order
    num_rows, batches = _export_batches(path)
    with tqdm(total=num_rows, desc="seeding the experience buffer", unit="traj", disable=not progress) as bar:
        for batch in (b for part in batches for b in _record_batches(part)):
            ids_values, ids_offsets = _list_parts(batch.column("completion_ids"), IDS_DTYPE)
            logps_values, logps_offsets = _list_parts(batch.column("behaviour_logps"), LOGPS_DTYPE)
            keys, rows, ks = (_column(batch, n) for n in ("question_key", "row", "k"))
            images = _column(batch, "images")  # per row: the question's images as {"bytes", "path"}, or None
            texts, masks, records = (_column(batch, n) for n in ("completion", "mask", "record"))
            for i, key in enumerate(keys):
                if key not in questions:
                    row = json.loads(rows[i])
                    if images[i]:
                        row = put_row_images(row, [decode_image(image["bytes"]) for image in images[i]])
                    questions[key] = (row, int(ks[i]), [])
                if report.retokenized and masks[i] is not None:
                    report.multi_turn += 1
                    continue
                if report.retokenized:
                    ids = np.asarray(tokenize(texts[i]), dtype=IDS_DTYPE)
                    logps, mask = np.zeros(ids.size, dtype=LOGPS_DTYPE), None
                else:
                    ids = ids_values[ids_offsets[i] : ids_offsets[i + 1]].copy()
                    logps = logps_values[logps_offsets[i] : logps_offsets[i + 1]].copy()
                    mask = None if masks[i] is None else np.asarray(masks[i], dtype=MASK_DTYPE)
                if max_length is not None and ids.size > max_length:
                    report.too_long += 1
                    continue
                record = None if records[i] is None else json.loads(records[i])
                questions[key][2].append(Trajectory(ids, logps, clock, mask, record))
            bar.update(batch.num_rows)
    for key, (row, k, trajectories) in questions.items():
        if not 1 <= k < buffer.num_generations:
            report.bad_k += 1
            continue
        added = buffer.update_group(key, k, row, trajectories)
        report.trajectories += added
        report.questions += bool(added)
    return report
