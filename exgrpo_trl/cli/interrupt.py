"""Ctrl-C during `exgrpo train`: save a checkpoint that resumes bitwise and stop, the same step on every rank
(`StopOnInterrupt`); what the command then says (`Interrupted`)."""

from __future__ import annotations

import contextlib
import signal
import threading

import torch
from transformers import TrainerCallback

from ..checkpoints import find_resumable_checkpoint
from ..checks import ends_generation_batch


class StopOnInterrupt(TrainerCallback):
    """Ctrl-C (SIGINT) during training saves a checkpoint and stops at the end of the first optimizer step that ends a
    generation batch (at most `steps_per_generation` steps on), so that the checkpoint resumes bitwise; a second
    Ctrl-C stops at once. Every rank stops at the same step: the request is reduced over the ranks at the steps that
    end a generation batch, the only ones a run can stop at (one collective per generation batch, not per step)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.requested = False
        self.stopped_at: int | None = None

    def handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextlib.contextmanager
    def installed(self):
        """The handler, while the block runs (the main thread only: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGINT, self.handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def on_step_end(self, args, state, control, **kwargs):
        if not ends_generation_batch(args, state.global_step):  # the same on every rank
            return control
        requested = self.requested
        if self.accelerator.num_processes > 1:  # a collective, at the same steps on every rank
            flag = torch.tensor([float(requested)], device=self.accelerator.device)
            requested = bool(self.accelerator.reduce(flag, reduction="max").item())
        if requested:
            control.should_save = control.should_training_stop = True
            self.stopped_at = state.global_step
        return control


class Interrupted(Exception):
    """Training stopped by Ctrl-C (KeyboardInterrupt) at `step`."""

    def __init__(self, step: int, max_steps: int, output_dir: str):
        super().__init__(step, max_steps, output_dir)
        self.step, self.max_steps, self.output_dir = step, max_steps, output_dir

    def __str__(self) -> str:
        checkpoint, _ = find_resumable_checkpoint(self.output_dir)
        of = f" of {self.max_steps}" if self.max_steps and self.max_steps > 0 else ""
        if checkpoint is None:
            then = "no checkpoint was saved yet, so rerunning the same command starts again from step 0"
        else:
            then = f"rerun the same command to resume from the newest checkpoint, {checkpoint}"
        return f"interrupted at step {self.step}{of}; {then}"
