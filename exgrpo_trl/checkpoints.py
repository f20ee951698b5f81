"""Which checkpoint a run resumes from (the newest COMPLETE one), and which ones rotation deletes.

A process killed while it writes a checkpoint leaves the newest ``checkpoint-N`` folder incomplete. What is there
depends on the moment, because a checkpoint is written in this order:

1. ``exgrpo_state/`` (ExGRPOTrainer, under a temporary name ``.exgrpo_state.tmp-PID`` renamed into place);
2. the model weights (``model.safetensors``, or shards and their index, or a LoRA adapter);
3. ``optimizer.pt``, ``scheduler.pt`` (or DeepSpeed's ``global_step*/``), the RNG states;
4. ``trainer_state.json``; with TRL's ``use_adaptive_entropy``, ``entropy_ctrl_state.json`` after it.

`checkpoint_problems` tells a complete checkpoint from an incomplete one by checking each of these is present and
readable, cheaply (headers and JSON, not the weights): a checkpoint is complete when it has model weights, an
optimizer and scheduler (unless the run saves the model only), a ``trainer_state.json`` that parses, and an ExGRPO
state that state.py's readers accept. A checkpoint without ``exgrpo_state/`` and without a leftover temporary one
was written by plain GRPO: it counts as complete, and the trainer warns on resume that the experience buffer starts
empty. A leftover ``.exgrpo_state.tmp-PID`` is never read: it only tells that the ExGRPO state was never finished.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .state import STATE_DIRNAME, StateFileError, has_state, load_state, read_meta, read_small_arrays

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
ENTROPY_STATE_NAME = "entropy_ctrl_state.json"  # TRL's adaptive entropy coefficient
OPTIMIZER_NAMES = ("optimizer.pt", "optimizer.bin")
SCHEDULER_NAME = "scheduler.pt"
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
STATE_TMP_PREFIX = f".{STATE_DIRNAME}.tmp-"  # state.save_state's temporary folder
CHECKPOINT_PREFIX = "checkpoint-"


def _unreadable_file(path: Path) -> str | None:
    """Why a weights or optimizer file cannot be loaded (its header or archive directory), or None."""
    try:
        if path.stat().st_size == 0:
            return "empty"
        if path.suffix == ".safetensors":
            with safe_open(str(path), "np"):  # reads and checks the header against the file's size
                pass
        elif not zipfile.is_zipfile(path):  # torch.save writes a zip archive; a cut one has no central directory
            return "truncated or not a torch file"
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; any of them means unreadable
        return f"truncated or corrupted ({e})"
    return None


def _model_problem(path: Path, names: set[str], deepspeed: bool) -> str | None:
    for name in WEIGHT_NAMES:
        if name in names:
            why = _unreadable_file(path / name)
            return f"{name} is {why}" if why else None
    for name in INDEX_NAMES:
        if name in names:
            try:
                shards = set(json.loads((path / name).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                return f"{name} is truncated or corrupted ({e})"
            missing = sorted(shards - names)
            return f"shard {missing[0]} of {name} is missing" if missing else None
    subfolders = [n for n in names if (path / n).is_dir()]
    # a LoRA run with several adapters saves each in its own folder; FSDP and DeepSpeed save the model in theirs
    if any((path / n / w).is_file() for n in subfolders for w in WEIGHT_NAMES[2:]):
        return None
    if deepspeed or any("pytorch_model_fsdp" in n for n in names):
        return None
    return "no model weights (model.safetensors, pytorch_model.bin, a sharded index or an adapter)"


def _optimizer_problems(path: Path, names: set[str], deepspeed: bool) -> list[str]:
    if deepspeed:  # DeepSpeed keeps optimizer and scheduler in global_step*/ and loads them itself
        return []
    problems = []
    present = [n for n in OPTIMIZER_NAMES if n in names]
    if present:
        why = _unreadable_file(path / present[0])
        if why:
            problems.append(f"{present[0]} is {why}")
    elif not any("optimizer" in n and (path / n).is_dir() for n in names):  # FSDP's sharded optimizer folder
        problems.append(f"no {OPTIMIZER_NAMES[0]}")
    if SCHEDULER_NAME not in names:
        problems.append(f"no {SCHEDULER_NAME}")
    return problems


def _json_problem(path: Path, names: set[str], name: str, key: str | None = None) -> str | None:
    if name not in names:
        return f"no {name}"
    try:
        content = json.loads((path / name).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{name} is truncated or corrupted ({e})"
    if not isinstance(content, dict) or (key is not None and not isinstance(content.get(key), int)):
        return f"{name} has no {key}" if key else f"{name} is not a JSON object"
    return None


def _trainer_state_problem(path: Path, names: set[str]) -> str | None:
    return _json_problem(path, names, TRAINER_STATE_NAME, "global_step")


def _exgrpo_state_problem(path: Path, names: set[str]) -> str | None:
    if STATE_DIRNAME in names:
        try:
            meta = read_meta(path)
            read_small_arrays(path, meta, ("lengths", "steps"))  # checks the arrays file's header against state.json
        except StateFileError as e:
            return f"unreadable ExGRPO state ({e})"
        return None
    leftovers = sorted(n for n in names if n.startswith(STATE_TMP_PREFIX))
    if leftovers:
        return f"an unfinished ExGRPO state ({leftovers[0]}) and no {STATE_DIRNAME}/"
    return None  # plain GRPO: complete here, the trainer warns on resume


def checkpoint_problems(
    path: str | os.PathLike, *, need_optimizer: bool = True, adaptive_entropy: bool = False
) -> list[str]:
    """Why `path` cannot be resumed from, one short phrase per problem, in the order the checkpoint is written
    (empty: complete). `need_optimizer=False` for runs that save the model only (``save_only_model``);
    `adaptive_entropy` for runs with TRL's ``use_adaptive_entropy`` (its coefficient is saved after the rest)."""
    path = Path(path)
    if not path.is_dir():
        return ["not a folder"]
    names = set(os.listdir(path))
    deepspeed = any(n.startswith("global_step") and (path / n).is_dir() for n in names)
    problems = [_exgrpo_state_problem(path, names), _model_problem(path, names, deepspeed)]
    if need_optimizer:
        problems += _optimizer_problems(path, names, deepspeed)
    problems.append(_trainer_state_problem(path, names))
    if adaptive_entropy:
        problems.append(_json_problem(path, names, ENTROPY_STATE_NAME))
    return [p for p in problems if p]


def checkpoint_step(name: str) -> int | None:
    """N for a folder named ``checkpoint-N``, else None."""
    if not name.startswith(CHECKPOINT_PREFIX) or not name[len(CHECKPOINT_PREFIX) :].isdigit():
        return None
    return int(name[len(CHECKPOINT_PREFIX) :])


def find_resumable_checkpoint(
    output_dir: str | os.PathLike, **requirements
) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete ``checkpoint-N`` in `output_dir` (None if there is none), and the newer ones passed over,
    each with why: ``(path, "no trainer_state.json; no optimizer.pt")``. `requirements`: `checkpoint_problems`'s."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None, []
    steps = {}
    for name in os.listdir(output_dir):
        step = checkpoint_step(name)
        if step is not None and (output_dir / name).is_dir():
            steps[step] = str(output_dir / name)
    skipped = []
    for step in sorted(steps, reverse=True):
        problems = checkpoint_problems(steps[step], **requirements)
        if not problems:
            return steps[step], skipped
        skipped.append((steps[step], "; ".join(problems)))
    return None, skipped


def remove_state_leftovers(output_dir: str | os.PathLike) -> list[str]:
    """Remove every ``.exgrpo_state.tmp-PID`` folder in `output_dir`'s checkpoints: what a process killed inside
    `state.save_state` leaves (at the paper's size a full copy of the buffer, about 1.7 GB). Called before a save
    writes its own; such a folder is never read. Returns the paths removed."""
    removed = []
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return removed
    for checkpoint in output_dir.iterdir():
        if checkpoint_step(checkpoint.name) is None or not checkpoint.is_dir():
            continue
        for leftover in checkpoint.glob(f"{STATE_TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(str(leftover))
    return removed


def rotate_checkpoints(
    output_dir: str | os.PathLike, save_total_limit: int | None, *, keep: Iterable[str] = (), **requirements
) -> list[str]:
    """Delete checkpoints so that at most `save_total_limit` complete ones remain; returns the paths deleted.

    Incomplete checkpoints (`checkpoint_problems`, with `requirements`) go first, whatever their step: what a crash
    left half-written, or half-deleted by an earlier rotation. Then the complete ones with the lowest steps, never
    one in `keep` (the checkpoint just written, the best one). Ordered by step, not by folder time: deleting files
    inside a folder refreshes its time, so a half-deleted checkpoint looked like the newest one.
    """
    if save_total_limit is None or save_total_limit <= 0:
        return []
    output_dir = Path(output_dir)
    keep = {str(Path(p).resolve()) for p in keep}
    found = sorted(
        (step, path)
        for path in output_dir.iterdir()
        if (step := checkpoint_step(path.name)) is not None and path.is_dir()
    )
    deleted, complete = [], []
    for step, path in found:
        if str(path.resolve()) not in keep and checkpoint_problems(path, **requirements):
            deleted.append(path)
        else:
            complete.append((step, path))
    excess = len(complete) - max(save_total_limit, sum(str(p.resolve()) in keep for _, p in complete))
    for _, path in complete:
        if excess <= 0:
            break
        if str(path.resolve()) not in keep:
            deleted.append(path)
            excess -= 1
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return [str(p) for p in deleted]


def restore_state(
    checkpoint: str | os.PathLike,
    buffer,
    *,
    num_generations: int,
    is_main_process: bool,
    warn: Callable[[str], None],
    updates_per_batch: float | None = None,
) -> dict[str, Any] | None:
    """Restore the experience buffer saved in `checkpoint` into `buffer`, and return ExGRPO's saved trainer state
    (None, after a warning, when the checkpoint holds no ExGRPO state: plain GRPO's).

    A buffer saved with another `num_generations` cannot carry over (its success buckets and retirement depend on K):
    ValueError. Other sampling settings may differ: the run's config wins, with a warning naming them (main process).
    Only the main process loads the trajectories; the others need the retired set (for the sampler).
    `updates_per_batch`: see `state.load_state`."""
    if not has_state(checkpoint):
        warn(
            f"ExGRPO: {checkpoint} holds no ExGRPO state (a plain GRPO checkpoint?): training resumes with an "
            "empty experience buffer and the delayed-start switch from the config."
        )
        return None
    meta = read_meta(checkpoint)
    saved_k = meta["buffer"]["config"]["num_generations"]
    if saved_k != num_generations:
        raise ValueError(
            f"{checkpoint} was trained with num_generations={saved_k}, this run uses {num_generations}: its "
            f"experience buffer's success counts do not carry over. Resume with num_generations={saved_k}, or "
            "start a fresh run in another output_dir."
        )
    changes = buffer.config_changes(meta["buffer"]["config"])
    if changes and is_main_process:
        what = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())
        warn(
            f"ExGRPO: {checkpoint} was saved with other replay settings; this run's config is used ({what}). "
            "The buffer's questions, trajectories and random state are restored as saved."
        )
    return load_state(
        checkpoint, buffer, with_trajectories=is_main_process, meta=meta, updates_per_batch=updates_per_batch
    )


# ------------------------------------------------------------------------------------------------ resolution
_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")


def resolve_checkpoint(training_args) -> str | None:
    """The checkpoint to resume from (None: a fresh run), from ``resume_from_checkpoint``:

    - unset: the newest COMPLETE ``checkpoint-N`` in ``output_dir``, if any; newer incomplete ones (a save
      interrupted by a crash) are skipped with a warning each, saying why;
    - true (``true``, ``yes``, ``1``; YAML's ``true``): the same, but finding none is an error;
    - false (``false``, ``no``, ``0``): a fresh run, even if ``output_dir`` holds checkpoints;
    - a path: that checkpoint, which must be complete (an error says what it lacks).
    """
    value = training_args.resume_from_checkpoint
    text = str(value).strip().lower() if value is not None else ""
    requirements = dict(
        need_optimizer=not training_args.save_only_model,
        adaptive_entropy=bool(getattr(training_args, "use_adaptive_entropy", False)),
    )
    if text in _FALSE:
        return None
    if text and text not in _TRUE:
        problems = checkpoint_problems(value, **requirements)
        if problems:
            raise ValueError(
                f"Cannot resume from {value}: {'; '.join(problems)}. Give a complete checkpoint, or leave "
                "resume_from_checkpoint unset to resume from the newest complete one in output_dir."
            )
        return str(value)
    checkpoint, skipped = find_resumable_checkpoint(training_args.output_dir, **requirements)
    for path, why in skipped:
        logger.warning("Skipping %s: incomplete (%s), a save that was interrupted?", path, why)
    if checkpoint is None and text in _TRUE:
        raise ValueError(
            f"resume_from_checkpoint is {value} but {training_args.output_dir} holds no complete checkpoint"
            + (f" ({len(skipped)} incomplete, skipped)" if skipped else "")
            + "; leave it unset to start a fresh run when there is none."
        )
    if checkpoint is None and skipped:
        logger.warning("No complete checkpoint in %s: training starts from step 0.", training_args.output_dir)
    return checkpoint
