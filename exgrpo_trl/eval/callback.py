"""In-training validation: every N optimizer steps, sample on validation benchmarks with the policy being trained,
grade with the evaluation harness's code (`exgrpo_trl.eval`), and log ``eval/<benchmark>/...``.

    callback = ValidationCallback([load_benchmark("math500", limit=100)], steps=10)
    callback.attach(trainer)        # or ScriptArguments.validation_dataset in `exgrpo train`

What it does not touch: the experience buffer, the trainer's RNG streams and its metric accumulators. Generation
calls the model's ``generate`` directly (never the trainer's generate-and-score path, so nothing is replayed,
collected or retired), under `torch.random.fork_rng` (training samples the same rollouts with or without
validation), with the model in eval mode and back to its previous mode afterwards. Logging goes through
`transformers.Trainer.log` (history, progress bar, W&B/TensorBoard, ...) rather than `GRPOTrainer.log`, which would
flush and average the training metrics gathered since the last logging step into this entry; the trainer's
``should_log`` flag is kept, so a step's own training log is still written.

Logged per benchmark: ``eval/<name>/accuracy`` (avg@k over its questions, as a fraction), ``answer_found_rate``,
``clipped_ratio`` (completions that hit `max_new_tokens`), ``mean_completion_length`` (tokens); with several
benchmarks also ``eval/average``, and ``eval/in_distribution_avg`` / ``eval/out_of_distribution_avg`` over the
paper's benchmarks present. Reporting integrations put keys not starting with ``eval_`` under ``train/`` (W&B shows
``train/eval/math500/accuracy``); ``metric_prefix="eval_"`` gives ``eval/math500/accuracy`` there instead.

Several processes: each rank generates for its share of the questions (rank::world_size) inside TRL's
`unwrap_model_for_generation` (which gathers ZeRO-3 parameters), and the per-question scores are gathered before the
averages, so every rank logs the same numbers. Tested on one process.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from .generators import TransformersGenerator
from .registry import BENCHMARKS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, LoadedBenchmark
from .report import evaluate_benchmark

__all__ = ["ValidationCallback"]

logger = logging.getLogger(__name__)


class ValidationCallback(TrainerCallback):
    """Validate every `steps` optimizer steps (the reference run: 10) on `benchmarks`.

    Args:
        benchmarks: loaded with `registry.load_benchmark` (any size; `limit` there keeps it cheap).
        steps: validate when ``global_step % steps == 0``; 0 disables.
        samples: completions per question (avg@k); temperature / top_p: algorithm §9's 0.6 / 1.0 by default.
        max_new_tokens: completion budget (the training recipe's ``max_completion_length`` is a natural choice).
        batch_size: sequences per ``generate`` call.
        seed: sampling seed (the same questions get the same draws at every validation, up to the weights).
        require_think_end: grade like the training reward (no ``</think>``: 0).
        validate_at_start: also validate before the first step (step 0).
        metric_prefix: prefix of the logged keys (default ``eval/``).
    """

    def __init__(
        self,
        benchmarks: Sequence[LoadedBenchmark],
        *,
        steps: int = 10,
        samples: int = 1,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        max_new_tokens: int = 1024,
        batch_size: int = 64,
        seed: int = 0,
        require_think_end: bool = False,
        validate_at_start: bool = False,
        metric_prefix: str = "eval/",
    ):
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if samples < 1 or max_new_tokens < 1 or batch_size < 1:
            raise ValueError("samples, max_new_tokens and batch_size must be >= 1")
        names = [b.name for b in benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"validation benchmarks must have distinct names, got {names}")
        self.benchmarks = list(benchmarks)
        self.steps = steps
        # how each validation samples and grades: `evaluate_benchmark`'s keywords (the seed is offset by the rank)
        self.sampling = dict(samples=samples, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                             seed=seed, require_think_end=require_think_end)  # fmt: skip
        self.batch_size = batch_size
        self.validate_at_start = validate_at_start
        self.metric_prefix = metric_prefix
        self.trainer = None
        self._last_step: int | None = None

    def attach(self, trainer) -> ValidationCallback:
        """Register on `trainer` (the callback needs the trainer to reach its model, tokenizer and log)."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    # -------------------------------------------------------------------------------------------- events
    def on_train_begin(self, args, state, control, **kwargs):
        if self.validate_at_start and self.benchmarks and state.global_step == 0:
            self.validate()
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.steps and self.benchmarks and state.global_step % self.steps == 0:
            self.validate()
        return control

    # -------------------------------------------------------------------------------------------- work
    def _tokenizer(self):
        processing_class = self.trainer.processing_class
        return getattr(processing_class, "tokenizer", None) or processing_class

    def validate(self) -> dict[str, float]:
        """Run one validation now and log it; returns the logged metrics."""
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("ValidationCallback is not attached to a trainer: call callback.attach(trainer).")
        step = trainer.state.global_step
        if self._last_step == step:  # e.g. validate_at_start and a step-0 call; never twice per step
            return {}
        self._last_step = step
        from accelerate.utils import gather_object
        from trl.models import unwrap_model_for_generation

        accelerator = trainer.accelerator
        rank, world = accelerator.process_index, accelerator.num_processes
        tokenizer = self._tokenizer()
        start = time.perf_counter()
        gathered: dict[str, list[dict[str, Any]]] = {}
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            accelerator,
            # as TRL's own generation does: gather ZeRO-3 weights (unless told not to), re-enable gradient
            # checkpointing afterwards with the training settings
            gather_deepspeed3_params=getattr(trainer.args, "ds3_gather_for_generation", True),
            gradient_checkpointing_kwargs=getattr(trainer.args, "gradient_checkpointing_kwargs", None),
        ) as model:
            generator = TransformersGenerator(model, tokenizer, batch_size=self.batch_size, progress=False)
            for bench in self.benchmarks:
                shard = bench.questions[rank::world]
                rows: list[dict[str, Any]] = []
                if shard:
                    result, records = evaluate_benchmark(
                        bench,
                        generator,
                        tokenizer,
                        **{**self.sampling, "seed": self.sampling["seed"] + rank},
                        questions=shard,
                    )
                    by_question: dict[str, list[dict[str, Any]]] = {}
                    for record in records:
                        by_question.setdefault(record["id"], []).append(record)
                    for q in result["per_question"]:
                        recs = by_question.get(q["id"], [])
                        rows.append(
                            {
                                "mean": q["mean"],
                                "n": len(recs),
                                "found": sum(r["extracted"] is not None for r in recs),
                                "truncated": sum(bool(r["truncated"]) for r in recs),
                                "tokens": sum(r["num_tokens"] for r in recs),
                            }
                        )
                gathered[bench.name] = gather_object(rows) if world > 1 else rows

        prefix = self.metric_prefix
        metrics: dict[str, float] = {}
        accuracies: dict[str, float] = {}
        for bench in self.benchmarks:
            rows = gathered[bench.name]
            n = sum(r["n"] for r in rows)
            if not rows or not n:
                continue
            accuracy = sum(r["mean"] for r in rows) / len(rows)
            accuracies[bench.name] = accuracy
            metrics[f"{prefix}{bench.name}/accuracy"] = accuracy
            metrics[f"{prefix}{bench.name}/answer_found_rate"] = sum(r["found"] for r in rows) / n
            metrics[f"{prefix}{bench.name}/clipped_ratio"] = sum(r["truncated"] for r in rows) / n
            metrics[f"{prefix}{bench.name}/mean_completion_length"] = sum(r["tokens"] for r in rows) / n
        if len(accuracies) > 1:
            metrics[f"{prefix}average"] = sum(accuracies.values()) / len(accuracies)
            for group, flag in (("in_distribution_avg", True), ("out_of_distribution_avg", False)):
                values = [
                    a
                    for name, a in accuracies.items()
                    if name in BENCHMARKS and BENCHMARKS[name].in_distribution is flag
                ]
                if values:
                    metrics[f"{prefix}{group}"] = sum(values) / len(values)
        metrics[f"{prefix}validation_seconds"] = time.perf_counter() - start
        metrics = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        # transformers.Trainer.log, not GRPOTrainer.log: the latter would flush the pending training metrics. Its
        # on_log event clears control.should_log, which on a logging step would drop that step's training log: restore.
        control = trainer.control
        should_log = control.should_log
        Trainer.log(trainer, dict(metrics))
        control.should_log = trainer.control.should_log = should_log
        logger.info("validation at step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
        return metrics
