"""`RecordingTrainer`: the one ExGRPOTrainer subclass through which tests watch replay from inside.

Used by the single-process replay tests, the vLLM tests (tests/vllm) and the multi-process script
(tests/multiprocess). It adds no behaviour: every override calls `super()`, and the two steps of the run it watches
(`generation_batch` and `flush`, wrapped on the trainer's `exgrpo_run`) call the run's own and hand on their results
unchanged. It records

- `batches`, one dict per training generation batch: ``before`` (the buffer the plan saw: ``questions``,
  ``trajectories`` {key: [completion ids]}, ``retired``, ``active``), ``plan`` (the `ReplayPlan` or None),
  ``prompts`` and ``replay_rows`` (this rank's rows after the plan), ``splice`` (local row -> stored ids),
  ``output`` (TRL's scored batch, cloned), ``buffer_after`` (trajectories once scored), and two lists that the vLLM
  tests fill, ``engine_calls`` and ``syncs``;
- `rec`: ``steps`` (forward passes through the model outside generation per optimizer step, and those of entropy
  scoring alone), ``scoring`` (each `_exgrpo_score_entropies` call), ``flushes`` (what each rank committed), and
  ``after_load`` (`buffer_summary` right after a resume).

`break_padding=True` is a negative control for the multi-process tests: entropy scoring without padding every rank's
share to the same number of rows, so ranks can run different numbers of forward passes (what ZeRO-3 cannot survive).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math

import numpy as np
import torch

from exgrpo_trl import ExGRPOTrainer
from exgrpo_trl.buffer import ExperienceBuffer, image_digest


def _plain(value) -> str:
    """An image in a row by its pixels (its repr holds a memory address), anything else by its text."""
    try:
        return image_digest(value)
    except TypeError:
        return str(value)


def buffer_hash(buffer: ExperienceBuffer) -> str:
    """A hash of the whole buffer state: arrays byte for byte and metadata (rows, buckets, retired, generator)."""
    arrays, meta = buffer.state_dict()
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode())
        h.update(str(arrays[name].dtype).encode())
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    h.update(json.dumps(meta, sort_keys=True, default=_plain).encode())
    return h.hexdigest()


def retired_hash(buffer: ExperienceBuffer) -> str:
    return hashlib.sha256(json.dumps(sorted(buffer.retired)).encode()).hexdigest()


def buffer_summary(buffer: ExperienceBuffer) -> dict:
    """Sizes, hashes and stored completions of a buffer, JSON-ready."""
    return {
        "questions": buffer.num_questions,
        "trajectories": buffer.num_trajectories,
        "tokens": buffer.num_tokens,
        "retired": sorted(buffer.retired),
        "retired_hash": retired_hash(buffer),
        "state_hash": buffer_hash(buffer),
        "stored": {key: [t.completion_ids.tolist() for t in e.trajectories] for key, e in buffer.questions.items()},
    }


def plan_digest(plan) -> str | None:
    """A hash of a replay plan (groups, keys, selected completion ids, behaviour log-probs); None without a plan."""
    if plan is None:
        return None
    h = hashlib.sha256()
    h.update(json.dumps([plan.group_indices, plan.keys, plan.completion_ids, plan.num_groups]).encode())
    for logps in plan.behaviour_logps:
        h.update(logps.numpy().tobytes())
    return h.hexdigest()


class RecordingTrainer(ExGRPOTrainer):
    def __init__(self, *args, break_padding: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[dict] = []
        self.rec: dict = {"steps": [], "scoring": [], "flushes": []}
        self._break_padding = break_padding
        self._generating = False
        self._in_scoring = False
        self.forwards = 0  # forward passes through the model outside generation
        self.scoring_forwards = 0
        self._step_marks = (0, 0)
        self.model.register_forward_pre_hook(self._count_forward)
        run = self.exgrpo_run  # its steps, watched from around (the trainer calls them through its attributes)
        for name in ("generation_batch", "flush"):
            setattr(run, name, getattr(self, f"_record_{name}")(getattr(run, name)))

    def _count_forward(self, module, args):
        if not self._generating:
            self.forwards += 1
            if self._in_scoring:
                self.scoring_forwards += 1

    # ---------------------------------------------------------------------------------------- generation batches
    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            self.batches.append({"engine_calls": [], "syncs": []})
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.batches[-1]["output"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in output.items()}
            self.batches[-1]["buffer_after"] = self.exgrpo_state.buffer.num_trajectories
        return output

    def _record_generation_batch(self, generation_batch):
        @contextlib.contextmanager
        def recorded(inputs, score):
            state = self.exgrpo_state
            buffer, guide = state.buffer, state.offline
            record = self.batches[-1]
            record["before"] = {
                "questions": buffer.num_questions,
                "trajectories": {
                    k: [t.completion_ids.tolist() for t in e.trajectories] for k, e in buffer.questions.items()
                },
                "retired": set(buffer.retired),
                "active": state.replay_active,
            }
            if guide.active:
                record["rejected_before"] = set(guide.rejected)
                record["self_solved_before"] = set(guide.self_solved)
            with generation_batch(inputs, score) as batch:
                rows = batch.rows
                record.update(plan=batch.plan, step=self.state.global_step, prompts=[x["prompt"] for x in rows.inputs],
                              replay_rows=list(rows.replay_rows), splice=dict(rows.splice))  # fmt: skip
                if guide.active:
                    record["offline"] = {local: (row.key, row.index) for local, row in rows.offline.items()}
                    record["offline_rows"] = list(rows.offline.values())
                yield batch

        return recorded

    def _generate_single_turn(self, *args, **kwargs):
        # Generation may stop at a different length on each rank (all sequences finished): not counted.
        self._generating = True
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            self._generating = False

    # ---------------------------------------------------------------------------------------- scoring
    def _exgrpo_score_entropies(self, prompt_ids, completion_ids, masks=None, vision=None):
        before = self.scoring_forwards
        self._in_scoring = True
        try:
            result = self._score(prompt_ids, completion_ids, masks, vision)
        finally:
            self._in_scoring = False
        self.rec["scoring"].append(
            {
                "step": self.state.global_step,
                "candidates": len(completion_ids),
                "forwards": self.scoring_forwards - before,
                "entropies": [round(float(x), 6) for x in result],
            }
        )
        return result

    def _score(self, prompt_ids, completion_ids, masks, vision):
        if not self._break_padding:
            return super()._exgrpo_score_entropies(prompt_ids, completion_ids, masks, vision)
        # The same contiguous shares as the real method, without padding them to the same number of rows: with 2B+1
        # candidates one rank runs two forward passes and the other one.
        from accelerate.utils import gather_object

        total, world, rank = len(completion_ids), self.accelerator.num_processes, self.accelerator.process_index
        per_rank = math.ceil(total / world)
        mine = list(range(rank * per_rank, min((rank + 1) * per_rank, total)))
        values = []
        if mine:
            masks = [None] * total if masks is None else masks
            with torch.no_grad():
                values = self._exgrpo_entropy_scorer().mean_entropies(
                    [prompt_ids[i] for i in mine], [completion_ids[i] for i in mine], [masks[i] for i in mine]
                )
            values = values.tolist()
        return torch.tensor([x for part in gather_object([values]) for x in part])

    # ---------------------------------------------------------------------------------------- collection, steps
    def _record_flush(self, flush):
        def recorded(keep_pending: bool = False):
            pending = self.exgrpo_run.pending
            if pending is not None:
                self.rec["flushes"].append(
                    {
                        "step": self.state.global_step,
                        "trajectories": [
                            [row.key, row.completion_ids]
                            for _, row in sorted(pending.rows.items())
                            if row.completion_ids is not None
                        ],
                        "groups": [[g.group, g.key, g.k] for g in pending.groups],
                    }
                )
            flush(keep_pending=keep_pending)

        return recorded

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        forwards, scoring = self.forwards - self._step_marks[0], self.scoring_forwards - self._step_marks[1]
        self._step_marks = (self.forwards, self.scoring_forwards)
        self.rec["steps"].append({"step": self.state.global_step, "forwards": forwards, "scoring_forwards": scoring})
        return loss

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            state = {k: v for k, v in self.exgrpo_state.state_dict().items() if k not in ("sampler", "latest")}
            self.rec["after_load"] = buffer_summary(self.exgrpo_state.buffer) | {"exgrpo_state": state}
