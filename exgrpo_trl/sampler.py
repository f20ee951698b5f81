"""`SkipRetiredSampler`: fresh questions drawn only among those not retired (algorithm §4), with its place in the
epochs as training state that a checkpoint holds. No trl, transformers or accelerate imports."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)


class SkipRetiredSampler(torch.utils.data.Sampler):
    """Wraps TRL's RepeatSampler so that fresh questions are drawn only among those not retired (algorithm §4), and so
    that where it is in its epochs is training state that a checkpoint can hold.

    The inner sampler permutes `num_samples` positions with its own generator; we point those positions at the rows
    that were not retired when the pass began, so the ordering logic stays TRL's own. An epoch keeps its nominal
    number of batches (the Trainer sized the run from it, so `max_steps` is honoured): when the remaining questions
    run out, a new pass over them begins. With nothing to skip (`retired` stays empty) it yields exactly what the
    inner sampler yields.

    Resuming: the inner generator advances once per pass, and the Trainer does not replay earlier epochs on resume,
    so a resumed run would draw its epoch in the first epoch's order (TRL's GRPOTrainer does). `state_dict` holds the
    epoch being drawn, the inner generator's state when that epoch began, and the questions each of its passes
    excluded; `load_state_dict` makes the next epoch drawn start from there: the same epoch again (a checkpoint inside
    it; the Trainer then skips the batches already trained), or the one after it (a checkpoint at its end: the saved
    epoch is drawn and thrown away first, which only advances the generator as the first run did). The Trainer says
    which epoch it draws through `set_epoch`; without it, epochs are counted.
    """

    def __init__(self, inner, keys_fn: Callable[[], Sequence[str]], retired: set[str]):
        self.inner = inner
        self._keys_fn = keys_fn  # each dataset row's question key (`buffer.row_key`), read once
        self._keys: list[str] | None = None
        self.retired = retired
        self.passes: list[frozenset[str]] = []  # questions excluded by each pass of the current epoch
        self.epoch = -1  # the epoch being drawn (-1: none yet)
        self._next_epoch: int | None = None  # from set_epoch
        self._epoch_start: torch.Tensor | None = None  # the inner generator's state when `epoch` began
        self.resume: dict[str, Any] | None = None  # a saved state_dict, applied by the next epoch drawn

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    @property
    def _generator(self) -> torch.Generator | None:
        return getattr(self.inner, "generator", None)  # TRL's RepeatSampler has one when it shuffles

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: the epoch, the generator's state at its start (base64 bytes, None without a generator) and the
        questions excluded by each pass begun so far."""
        start = self._epoch_start
        return {
            "epoch": self.epoch,
            "generator": None if start is None else base64.b64encode(start.numpy().tobytes()).decode("ascii"),
            "passes": [sorted(p) for p in self.passes],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume = state

    def __iter__(self):
        epoch = self.epoch + 1 if self._next_epoch is None else self._next_epoch
        self._next_epoch = None
        resume, self.resume = self.resume, None
        passes: list[frozenset[str]] = []
        if resume is not None:
            passes = [frozenset(p) for p in resume.get("passes") or []]
            saved_epoch, generator = resume.get("epoch"), self._generator
            if saved_epoch is not None and saved_epoch >= 0:  # older checkpoints saved the passes only
                if generator is not None and resume.get("generator") is not None:
                    raw = base64.b64decode(resume["generator"])
                    generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                if saved_epoch < epoch:  # saved at the end of its epoch: draw that epoch again, unused
                    if saved_epoch + 1 < epoch:
                        logger.warning(
                            f"ExGRPO: the checkpoint's sampler was in epoch {saved_epoch}, the Trainer resumes in "
                            f"epoch {epoch}: the epochs in between cannot be replayed, so the order differs from the "
                            "first run's."
                        )
                    for _ in self._draw(passes):
                        pass
                    passes = []
                elif saved_epoch > epoch:
                    passes = []
        self.epoch = epoch
        generator = self._generator
        self._epoch_start = None if generator is None else generator.get_state()
        yield from self._draw(passes)

    def _draw(self, resume: list[frozenset[str]]):
        """One epoch: passes over the questions not retired, the first ones excluding `resume`'s sets instead."""
        self.passes = []
        nominal, produced, full = len(self.inner), 0, self.inner.num_samples
        while produced < nominal:
            excluded = resume[len(self.passes)] if len(self.passes) < len(resume) else frozenset(self.retired)
            self.passes.append(excluded)
            active = range(full)
            if excluded:
                if self._keys is None:
                    self._keys = list(self._keys_fn())
                active = [i for i, key in enumerate(self._keys) if key not in excluded]
                if len(active) < self.inner.batch_size:
                    logger.warning(
                        f"ExGRPO: only {len(active)} questions are not retired, fewer than one batch "
                        f"({self.inner.batch_size}); drawing from the whole dataset again."
                    )
                    active = range(full)
            self.inner.num_samples = len(active)
            try:
                for position in self.inner:
                    yield active[position]
                    produced += 1
                    if produced == nominal:
                        return
            finally:
                self.inner.num_samples = full
