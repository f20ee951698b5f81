"""`ExGRPOState`: ExGRPO's training state, what a checkpoint holds, apart from the steps of a generation batch.

No trl, transformers or accelerate imports (`scripts/check_imports.py` enforces it). The state is:

- the experience buffer (`buffer`), with when its questions were replayed;
- the clock (`clock`): generation batches made so far, the one unit everything that ages counts in (a trajectory's
  `collected_at`, the reuse limit, the recent draws);
- whether replay is on (`replay_active`: the delayed start, once on, stays on);
- the fresh-question sampler's place in its epochs (`sampler`), and the offline guide's verdicts (`offline`);
- the latest metrics of a generation batch (`latest`), which a log row whose window holds no generation batch shows.

It saves and restores itself with checkpoints, seeds its buffer from an export, wraps TRL's sampler and writes its
metrics into TRL's. `run.ExGRPORun`, the cycle of one generation batch under GRPOTrainer's hooks, reads it and moves it
on; an ExGRPO for another training loop (TRL's AsyncGRPOTrainer) would reuse it as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .buffer import ExperienceBuffer, has_images, question_key, row_key
from .checkpoints import restore_state
from .offline import make_offline_guide
from .sampler import SkipRetiredSampler
from .settings import ExGRPOSettings
from .state_file import save_state

logger = logging.getLogger(__name__)

METRIC_PREFIX = "exgrpo/"
VALUE_METRICS = ("replay/active", "offline/rejected")  # logged as their value, never a window mean
MAIN_ONLY = ("replay/reuse",)  # metrics the main process alone computes (only its buffer knows the recent draws)


def _same(value):
    return value


@dataclass(frozen=True)
class Ranks:
    """The processes of a run, as ExGRPO needs them: one process by default. The trainer passes accelerate's."""

    process_index: int = 0
    num_processes: int = 1
    is_main_process: bool = True
    broadcast: Callable[[Any], Any] = _same  # the main process's object, on every rank
    gather_objects: Callable[[list], list] = _same  # every rank's list, concatenated in rank order
    gather: Callable[[torch.Tensor], torch.Tensor] = _same  # every rank's tensor, concatenated along dim 0


class Messages(NamedTuple):
    """Where ExGRPO's messages go (the trainer passes transformers' logger)."""

    warn: Callable[[str], None] = logger.warning
    info: Callable[[str], None] = logger.info


def dataset_keys(dataset) -> list[str]:
    """Each row's question key (`buffer.row_key`); a dataset without image columns is keyed by its prompts alone,
    read as one column (no row is built)."""
    if not has_images(getattr(dataset, "column_names", None) or []):
        return [question_key(prompt) for prompt in dataset["prompt"]]
    return [row_key(row) for row in dataset]


class ExGRPOState:
    """ExGRPO's training state in one run (module docstring).

    Args:
        settings: the run's `ExGRPOSettings` (an `ExGRPOConfig` is one; read, never changed).
        num_generations: K, rollouts per question.
        tokenize: `text -> token ids` as the model's completion of its prompt would be (text, then EOS), for offline
            solutions; `max_completion_length`: the longest completion, in tokens.
        ranks: the processes (`Ranks`); messages: where warnings and notes go (`Messages`).
        seed: the seed of the buffer's own random generator (TRL's `seed`).
    """

    def __init__(
        self,
        settings: ExGRPOSettings,
        num_generations: int,
        *,
        tokenize: Callable[[str], list[int]],
        max_completion_length: int,
        ranks: Ranks | None = None,
        messages: Messages | None = None,
        seed: int = 0,
    ):
        self.settings, self.ranks = settings, Ranks() if ranks is None else ranks
        self.messages = Messages() if messages is None else messages
        self.buffer = ExperienceBuffer(num_generations, settings, seed=seed)
        self.offline = make_offline_guide(settings, max_completion_length, tokenize)
        self.sampler: SkipRetiredSampler | None = None
        self.clock = 0  # generation batches made so far (training ones): the next one's number
        self.replay_active = settings.replay_starts_at_once
        self.latest: dict[str, float] = {}  # the latest generation batch's metrics (`log_metrics`)

    @property
    def num_generations(self) -> int:
        return self.buffer.num_generations

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds beside the buffer: whether replay is on, the clock, the sampler's place, the offline
        guide's verdicts, the latest metrics (the log rows after a resume carry them as the uninterrupted run's do),
        and the number of processes that saved it (a checkpoint is complete when each of them wrote its own files:
        `checkpoints.checkpoint_problems`)."""
        state: dict[str, Any] = {"replay_active": self.replay_active, "generation_batches": self.clock}
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        offline = self.offline.state_dict()
        if offline is not None:
            state["offline"] = offline
        state["latest"] = dict(self.latest)
        state["num_processes"] = self.ranks.num_processes
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Read back what `state_dict` saved; a state saved by an older version (no latest metrics, no sampler state,
        no number of processes) loads too. The number of processes is the saving run's, not restored."""
        self.replay_active = bool(state.get("replay_active", self.replay_active))
        self.clock = int(state.get("generation_batches", self.clock))
        latest = state.get("latest") or {}  # the main process's: the others never had its own metrics
        self.latest.update({k: v for k, v in latest.items() if self.ranks.is_main_process or k not in MAIN_ONLY})
        self.offline.load_state_dict(state.get("offline", {}))
        if self.sampler is not None:
            # checkpoints before the sampler's state was saved hold the current epoch's passes only
            self.sampler.load_state_dict(
                state.get("sampler") or {"epoch": None, "passes": state.get("sampler_passes", [])}
            )

    def save(self, checkpoint: str) -> None:
        """The buffer and `state_dict` into `checkpoint`'s state folder (the cycle's pending outcome committed
        first: `ExGRPORun.flush(keep_pending=True)`)."""
        save_state(checkpoint, self.buffer, self.state_dict())

    def restore(self, checkpoint: str, *, updates_per_batch: float | None = None) -> None:
        """The state saved in `checkpoint`; a checkpoint without ExGRPO state (plain GRPO's) leaves it as it is.
        `updates_per_batch`: optimizer updates per generation batch (for checkpoints written before the clock counted
        generation batches: `ExperienceBuffer.restore`)."""
        saved = restore_state(
            checkpoint,
            self.buffer,
            num_generations=self.num_generations,
            is_main_process=self.ranks.is_main_process,
            warn=self.messages.warn,
            updates_per_batch=updates_per_batch,
        )
        if saved is not None:
            self.load_state_dict(saved)

    def seed_buffer(
        self, *, fingerprint: str, tokenize: Callable[[str], list[int]], max_length: int, progress: bool = True
    ) -> None:
        """Fill the buffer from the export the settings name for the run's initial experience (`export.seed_buffer`;
        nothing when they name none). Every rank checks the export's num_generations (one small file read, no
        collective); only the main process, which holds the trajectories, reads the rows: the other ranks need the
        retired set only, and an export carries none. A resume replaces the seeded buffer with the checkpoint's
        (`restore`). `fingerprint`: this run's tokenizer's; `tokenize`, `max_length`: as for offline solutions."""
        from .export import read_export_meta, seed_buffer

        path = self.settings.initial_experience
        if path is None:
            return
        meta = read_export_meta(path, num_generations=self.num_generations)
        if not self.ranks.is_main_process:
            return
        report = seed_buffer(
            self.buffer, path, fingerprint=fingerprint, tokenize=tokenize, max_length=max_length, meta=meta,
            progress=progress, clock=self.clock,
        )  # fmt: skip
        skipped = report.skipped()
        if skipped:
            self.messages.warn(f"ExGRPO: initial_experience {path}: left out {skipped}.")
        how = (
            "tokenized again with this run's tokenizer (the export's differs), as offline trajectories"
            if report.retokenized
            else "with their token ids and behaviour log-probs"
        )
        self.messages.info(
            f"ExGRPO: seeded the experience buffer from {path}: {report.questions} questions, "
            f"{report.trajectories} trajectories, {how}."
        )

    def set_epoch(self, epoch: int) -> None:
        """The epoch the trainer is about to draw, for the sampler (whatever wraps it)."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def wrap_sampler(self, inner, dataset) -> SkipRetiredSampler:
        """TRL's sampler over `dataset`, wrapped so that retired questions are skipped and its place is saved (with
        nothing to skip it yields exactly TRL's indices). A sampler rebuilt after a resume keeps the restored place."""
        retired = self.buffer.retired if self.settings.skips_retired else set()
        sampler = SkipRetiredSampler(inner, lambda: dataset_keys(dataset), retired)
        if self.sampler is not None and self.sampler.resume is not None:
            sampler.resume = self.sampler.resume
        self.sampler = sampler
        return sampler

    # ------------------------------------------------------------------------------------------ metrics
    def add_metrics(self, metrics: dict[str, list[float]], values: dict[str, float]) -> None:
        """A generation batch's metrics (names without the prefix): into TRL's `metrics` (averaged over the logging
        window), and kept as the latest values for the log rows whose window holds no generation batch."""
        for name, value in values.items():
            metrics[METRIC_PREFIX + name].append(float(value))
        self.latest.update({name: float(value) for name, value in values.items()})

    def set_values(self, values: dict[str, float]) -> None:
        """Metrics logged as their value, never a window mean (`VALUE_METRICS`): kept until the next log row."""
        self.latest.update({name: float(value) for name, value in values.items()})

    def log_metrics(self, metrics: dict[str, list[float]]) -> None:
        """Before a training log row is written into TRL's `metrics`: every ExGRPO metric in it, counts and states as
        their value now (the buffer's as it is), a generation batch's metrics as the latest batch's when none fell in
        the window."""
        for name, value in self.latest.items():
            if not metrics.get(METRIC_PREFIX + name) or name in VALUE_METRICS:
                metrics[METRIC_PREFIX + name] = [value]
        if self.ranks.is_main_process:  # only the main process holds the buffer's trajectories
            buffer = self.buffer
            counts = {"questions": buffer.num_questions, "trajectories": buffer.num_trajectories,
                      "retired": len(buffer.retired)}  # fmt: skip
            counts.update({f"bucket_{k}": count for k, count in buffer.bucket_counts().items()})
            for name, value in counts.items():
                metrics[f"{METRIC_PREFIX}buffer/{name}"] = [float(value)]
