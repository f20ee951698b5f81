"""Which checkpoint a run resumes from (the newest COMPLETE one), and which ones rotation deletes.

A process killed while it writes a checkpoint leaves the newest ``checkpoint-N`` folder incomplete. What is there
depends on the moment, because a checkpoint is written in this order:

1. ``exgrpo_state/`` (ExGRPOTrainer, under a temporary name ``.exgrpo_state.tmp-PID`` renamed into place);
2. the model weights (``model.safetensors``, or shards and their index, or a LoRA adapter);
3. ``optimizer.pt``, ``scheduler.pt`` (or DeepSpeed's ``latest`` and ``global_step*/``), the RNG states;
4. ``trainer_state.json``; with TRL's ``use_adaptive_entropy``, ``entropy_ctrl_state.json`` after it.

`checkpoint_problems` tells a complete checkpoint from an incomplete one by checking each of these is present and
readable, cheaply (headers and JSON, not the weights): a checkpoint is complete when it has model weights, an
optimizer and scheduler (unless the run saves the model only), every rank's RNG state, a ``trainer_state.json`` that
parses, and an ExGRPO state that state_file.py's readers accept. A checkpoint without ``exgrpo_state/`` and without a
leftover temporary one was written by plain GRPO: it counts as complete, and the trainer warns on resume that the
experience buffer starts empty. A leftover ``.exgrpo_state.tmp-PID`` is never read: it only tells that the ExGRPO
state was never finished.

Several processes. The main process writes all of the above but the per-rank files: each rank writes its own RNG
state (``rng_state_{rank}.pth``; a one-process run writes ``rng_state.pth``) and, under DeepSpeed, its own partitions
in ``global_step*/`` (``zero_pp_rank_{rank}_mp_rank_*_{model,optim}_states.pt``). Nothing waits for the other ranks
before ``trainer_state.json``: a rank killed while it writes its own file leaves a checkpoint whose
``trainer_state.json`` the main process finished. So each rank's files must be there and readable, for every rank of
the run that wrote the checkpoint: as many as the ExGRPO state records (``num_processes``), or for a checkpoint that
records none (plain GRPO, older versions), as many as its per-rank files name (at least 2 when there is any).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from .state_file import STATE_DIRNAME, StateFileError, has_state, load_state, read_meta, read_small_arrays

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"
ENTROPY_STATE_NAME = "entropy_ctrl_state.json"  # TRL's adaptive entropy coefficient
OPTIMIZER_NAMES = ("optimizer.pt", "optimizer.bin")
SCHEDULER_NAME = "scheduler.pt"
WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
STATE_TMP_PREFIX = f".{STATE_DIRNAME}.tmp-"  # state_file.save_state's temporary folder
CHECKPOINT_PREFIX = "checkpoint-"
RNG_NAME = "rng_state.pth"  # transformers' RNG state of a one-process run
RNG_RANK = re.compile(r"rng_state_(\d+)\.pth")  # ... and of each rank of a run of several
DEEPSPEED_TAG_FILE = "latest"  # DeepSpeed's file naming the folder it resumes from (global_stepN)
# DeepSpeed's per-rank partition files (ZeRO-3 partitions the model states too; bf16_ for its bf16 optimizer)
ZERO_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt")


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


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _missing_text(what: str, missing: list[int], world: int) -> str:
    """'no rng_state_1.pth (rank 1 of 2)', or for several 'no rng_state_{rank}.pth of ranks 0-7 (of 8)'."""
    if len(missing) == 1:
        return f"no {what.format(rank=missing[0])} (rank {missing[0]} of {world})"
    return f"no {what} of ranks {_ranks_text(missing)} (of {world})"


def _deepspeed_tag(path: Path, names: set[str]) -> tuple[str | None, str | None]:
    """(the ``global_stepN`` folder DeepSpeed resumes from, None) or (None, why there is none)."""
    if DEEPSPEED_TAG_FILE not in names:
        return None, f"no {DEEPSPEED_TAG_FILE} (DeepSpeed's tag file)"
    try:
        tag = (path / DEEPSPEED_TAG_FILE).read_text(encoding="utf-8").strip()
    except (OSError, ValueError) as e:
        return None, f"{DEEPSPEED_TAG_FILE} is unreadable ({e})"
    if not tag or os.sep in tag or not (path / tag).is_dir():
        return None, f"{DEEPSPEED_TAG_FILE} names {tag!r}, which is no folder of the checkpoint"
    return tag, None


def _listing(folder: Path) -> list[str]:
    """The names in `folder`; none when it is gone (a checkpoint deleted while it is looked at)."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _zero_ranks(folder: Path) -> dict[tuple[str, int], set[int]]:
    """DeepSpeed's partition files in `folder`: (model or optim, model-parallel rank) -> data-parallel ranks."""
    ranks: dict[tuple[str, int], set[int]] = {}
    for name in _listing(folder):
        if match := ZERO_FILE.fullmatch(name):
            ranks.setdefault((match[3], int(match[2])), set()).add(int(match[1]))
    return ranks


def _deepspeed_problems(path: Path, names: set[str], world: int) -> list[str]:
    """DeepSpeed's part of a checkpoint: ``latest`` names a folder, every ``.pt`` file in it is readable, and every
    data-parallel rank wrote its partitions (for each kind and model-parallel rank that any rank wrote)."""
    tag, why = _deepspeed_tag(path, names)
    if tag is None:
        return [why]
    folder = path / tag
    problems = []
    for name in sorted(_listing(folder)):
        if name.endswith(".pt") and (why := _unreadable_file(folder / name)):
            problems.append(f"{tag}/{name} is {why}")
    ranks = _zero_ranks(folder)
    model_parallel = len({mp for _, mp in ranks}) or 1
    data_parallel = max(world // model_parallel, max((max(r) + 1 for r in ranks.values()), default=0))
    for (kind, mp), present in sorted(ranks.items()):
        missing = sorted(set(range(data_parallel)) - present)
        if missing:
            what = f"{tag}/zero_pp_rank_{{rank}}_mp_rank_{mp:02d}_{kind}_states.pt"
            problems.append(_missing_text(what, missing, data_parallel))
    return problems


def _rng_problems(path: Path, names: set[str], world: int) -> list[str]:
    """Each rank's RNG state present and readable: ``rng_state.pth`` for a one-process run, else ``rng_state_{i}.pth``
    for every rank i (transformers' `_save_rng_state`)."""
    if world <= 1:
        if RNG_NAME not in names:
            return [f"no {RNG_NAME}"]
        why = _unreadable_file(path / RNG_NAME)
        return [f"{RNG_NAME} is {why}"] if why else []
    problems, missing = [], []
    for rank in range(world):
        name = f"rng_state_{rank}.pth"
        if name not in names:
            missing.append(rank)
        elif why := _unreadable_file(path / name):
            problems.append(f"{name} is {why}")
    if missing:
        problems.insert(0, _missing_text("rng_state_{rank}.pth", missing, world))
    return problems


def writer_world_size(path: str | os.PathLike, recorded: int | None = None) -> int:
    """How many processes wrote the checkpoint at `path`: `recorded` (the ExGRPO state's ``num_processes``) when
    given, else what its per-rank files say: the highest rank named by an RNG state or a DeepSpeed partition, plus 1,
    and at least 2 when any ``rng_state_{i}.pth`` is there (a one-process run writes ``rng_state.pth``). Without a
    record, the last ranks' files missing altogether cannot be told from a smaller run (2 ranks can: rank 0's file
    has the name of a run of several)."""
    return _world_size(Path(path), set(_listing(Path(path))), recorded)


def _world_size(path: Path, names: set[str], recorded: int | None) -> int:
    if recorded is not None:
        return recorded
    world = 1
    rng_ranks = [int(m[1]) for n in names if (m := RNG_RANK.fullmatch(n))]
    if rng_ranks:
        world = max(2, max(rng_ranks) + 1)
    for name in names:
        if name.startswith("global_step") and (path / name).is_dir():
            ranks = _zero_ranks(path / name)
            if ranks:
                data_parallel = max(max(r) + 1 for r in ranks.values())
                world = max(world, data_parallel * len({mp for _, mp in ranks}))
    return world


def _optimizer_problems(path: Path, names: set[str], deepspeed: bool, world: int) -> list[str]:
    if deepspeed:  # DeepSpeed keeps optimizer and scheduler in global_step*/ and loads them itself
        return _deepspeed_problems(path, names, world)
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


def _exgrpo_state_problem(path: Path, names: set[str]) -> tuple[str | None, int | None]:
    """(why the ExGRPO state cannot be read or None, the number of processes it records or None)."""
    if STATE_DIRNAME in names:
        try:
            meta = read_meta(path)
            # checks the arrays file's header against state.json
            read_small_arrays(path, meta, ("lengths", "collected_at"))
        except StateFileError as e:
            return f"unreadable ExGRPO state ({e})", None
        return None, meta["trainer"].get("num_processes")
    leftovers = sorted(n for n in names if n.startswith(STATE_TMP_PREFIX))
    if leftovers:
        return f"an unfinished ExGRPO state ({leftovers[0]}) and no {STATE_DIRNAME}/", None
    return None, None  # plain GRPO: complete here, the trainer warns on resume


def checkpoint_problems(
    path: str | os.PathLike, *, need_optimizer: bool = True, adaptive_entropy: bool = False
) -> list[str]:
    """Why `path` cannot be resumed from, one short phrase per problem, in the order the checkpoint is written
    (empty: complete). `need_optimizer=False` for runs that save the model only (``save_only_model``: no optimizer,
    no RNG states); `adaptive_entropy` for runs with TRL's ``use_adaptive_entropy`` (its coefficient is saved after
    the rest). Each rank's files are checked for every rank of the run that wrote it (`writer_world_size`).

    Every rank of a run calls this on the same files (`resolve_checkpoint`) and reads nothing else: no random
    choice, no clock, no state of its own, so every rank judges every checkpoint alike."""
    path = Path(path)
    if not path.is_dir():
        return ["not a folder"]
    names = set(os.listdir(path))
    deepspeed = any(n.startswith("global_step") and (path / n).is_dir() for n in names)
    state_problem, recorded = _exgrpo_state_problem(path, names)
    problems = [state_problem, _model_problem(path, names, deepspeed)]
    if need_optimizer:
        world = _world_size(path, names, recorded)
        problems += _optimizer_problems(path, names, deepspeed, world)
        problems += _rng_problems(path, names, world)
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
    `state_file.save_state` leaves (at the paper's size a full copy of the buffer, about 1.7 GB). Called before a save
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
    `updates_per_batch`: see `state_file.load_state`."""
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
