"""ExGRPO at a real vocabulary size on one device: the checks a GPU run needs before a paper-scale recipe.

1. smoke: ExGRPOTrainer trains from a saved model folder with replay on from the first step, stores successful
   completions, saves checkpoints, and a second trainer resumes from the last one (buffer restored exactly) and
   replays again.
2. memory: the peak memory of entropy scoring (the no-grad forward over stored trajectories that precedes a step)
   against TRL's training forward and backward on the same rows (per-device batch x long completions).
3. numerics: at learning rate 0, the importance weights w = exp(logp_now - logp_stored) of replayed rows: what
   float16 storage of the behaviour log-probs and recomputation in the training dtype give (1 in exact arithmetic).

    python benchmarks/real_vocab.py                                  # tiny, on the CPU (the default suite runs this)
    python benchmarks/real_vocab.py --device cuda --bf16 --vocab-size 151936 --hidden-size 896 --layers 24 \\
        --heads 14 --kv-heads 2 --intermediate-size 4864 --min-completion-length 1024 --max-completion-length 2048 \\
        --memory-rows 2 --memory-completion-length 8192 --json figures.json
                                                       # Qwen2.5-0.5B's shape; memory at the 7B recipe's batch
    accelerate launch --config_file recipes/accelerate/zero3.yaml --num_processes 1 benchmarks/real_vocab.py \\
        --checks smoke --device cuda --bf16 ...        # the smoke under DeepSpeed ZeRO-3
    python benchmarks/real_vocab.py --checks smoke --rollout-func ...   # rollouts from a user's rollout_func

`--rollout-func` generates through a rollout function of TRL's documented shape (the tests' `make_rollout`: the
trainer's model sampling through `generate`, returning `prompt_ids`, `completion_ids`, `logprobs` and a per-row field
`draw` the reward receives, no `env_mask`) instead of TRL's own generation; the smoke then also counts the replayed
rows whose reward saw the field stored with their trajectory.

The task is overhead.py's (a completion is solved when it ends with a stop token and holds an even number of marked
tokens); an untrained model samples nearly uniformly over the vocabulary, so filler ids join EOS in its generation
config's stop list (real configs list several too), enough for completions to end between the two lengths.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # overhead's builders
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository: the tests' rollout function
from overhead import add_task_arguments, build_model, build_task, trainer_config  # noqa: E402

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from exgrpo_trl.scoring import pad_prompt_completion
from exgrpo_trl.state_file import STATE_DIRNAME

CHECKS = ("smoke", "memory", "numerics")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.set_defaults(
        hidden_size=64, layers=2, heads=2, vocab_size=512, questions_per_step=4, max_completion_length=24,
        min_completion_length=8,
    )  # fmt: skip
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="train in bfloat16 (the model is saved and loaded in it)")
    p.add_argument(
        "--micro-batch-rows", type=int, default=8, help="rows per micro-batch (per_device_train_batch_size)"
    )
    p.add_argument("--generation-batches", type=int, default=2, help="before the save; the resumed run adds one")
    p.add_argument(
        "--replay-cooldown", type=int, default=0, help="ExGRPOConfig.replay_cooldown (the reuse limit; 0: off)"
    )
    p.add_argument("--memory-rows", type=int, default=2, help="rows scored at once (the 7B recipe's per-device batch)")
    p.add_argument("--memory-prompt-length", type=int, default=256)
    p.add_argument("--memory-completion-length", type=int, default=64, help="the 7B recipe: 8192")
    p.add_argument("--rollout-func", action="store_true", help="generate through a rollout_func (module docstring)")
    p.add_argument("--output-dir", default=None, help="checkpoints and the model folder (default: a temporary one)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c]
    unknown = set(args.checks) - set(CHECKS)
    if unknown:
        p.error(f"--checks: unknown {', '.join(sorted(unknown))}; known: {', '.join(CHECKS)}")
    return args


def save_model(args, tokenizer, folder: Path) -> int:
    """The model folder a user's recipe would name, in the training dtype (ZeRO-3 partitions it while loading);
    returns its number of parameters."""
    model = build_model(tokenizer, args)
    if args.bf16:
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return n_params


def make_trainer(args, model_dir, tokenizer, reward, dataset, output_dir, **overrides) -> ExGRPOTrainer:
    questions, k, rows = args.questions_per_step, args.num_generations, args.micro_batch_rows
    config = trainer_config(
        args,
        output_dir=str(output_dir),
        per_device_train_batch_size=rows,
        steps_per_generation=questions * k // rows,  # one generation batch = questions x K rows
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        beta=0.0,
        replay_ratio=args.replay_ratio,
        replay_start_pass_rate=0.0,  # replay from the first step (the weak-base setting)
        replay_cooldown=args.replay_cooldown,
    )
    config.update(overrides)
    extra = {}
    if args.rollout_func:
        from tests.support.rollouts import FieldLog, make_rollout

        log = FieldLog()
        reward, extra["rollout_func"] = log.reward(reward), make_rollout(log=log)
    trainer = ExGRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=ExGRPOConfig(**config),
        train_dataset=dataset,
        processing_class=tokenizer,
        **extra,
    )
    trainer.field_log = log if args.rollout_func else None
    return trainer


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def count_replays(trainer) -> list[int]:
    """A list that receives the number of replayed groups of each generation batch the trainer plans (the plans
    themselves: `trainer.plans`)."""
    counts, plan = [], trainer.exgrpo_run._plan
    trainer.plans = []

    def counting(*a, **kw):
        result = plan(*a, **kw)
        counts.append(0 if result is None else len(result.group_indices))
        trainer.plans.append(result)
        return result

    trainer.exgrpo_run._plan = counting
    return counts


def buffer_digest(buffer, default=str) -> tuple:
    """Everything the buffer holds, comparable with == (`default`: how the JSON text renders what it cannot hold)."""
    arrays, meta = buffer.state_dict()
    return json.dumps(meta, sort_keys=True, default=default), {k: v.tobytes() for k, v in arrays.items()}


def train_from_checkpoint(trainer, checkpoint, digest=buffer_digest):
    """Resume `trainer` from `checkpoint` and train on; returns `digest` of its buffer as the checkpoint restored it,
    before any new step."""
    loaded = {}
    original = trainer._load_optimizer_and_scheduler

    def load_and_look(checkpoint_dir):
        original(checkpoint_dir)
        loaded["digest"] = digest(trainer.exgrpo_state.buffer)

    trainer._load_optimizer_and_scheduler = load_and_look
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return loaded.get("digest")


def check_smoke(args, model_dir, tokenizer, reward, dataset, out: Path) -> dict:
    n = args.generation_batches
    trainer = make_trainer(args, model_dir, tokenizer, reward, dataset, out / "run")
    replays = count_replays(trainer)
    spg = trainer.args.steps_per_generation
    trainer.args.max_steps = n * spg
    trainer.args.save_strategy, trainer.args.save_steps = "steps", spg
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    checkpoint = out / "run" / f"checkpoint-{n * spg}"
    saved = buffer_digest(trainer.exgrpo_state.buffer)
    lengths = logged(trainer, "completions/mean_length")
    figures = {
        "optimizer_steps": trainer.state.global_step,
        "seconds": round(seconds, 1),
        "replayed_groups_per_generation_batch": replays,
        "buffer_questions": trainer.exgrpo_state.buffer.num_questions,
        "buffer_trajectories": trainer.exgrpo_state.buffer.num_trajectories,
        "retired": len(trainer.exgrpo_state.buffer.retired),
        "mean_completion_length": round(statistics.mean(lengths), 1) if lengths else None,
        "checkpoint_has_buffer": (checkpoint / STATE_DIRNAME).is_dir(),
        "deepspeed_zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
        if trainer.is_deepspeed_enabled
        else None,
    }
    if trainer.field_log is not None:
        figures.update(rollout_func_calls=trainer.field_log.calls, **fields_of_replayed_rows(trainer))
    del trainer
    _free(args)

    resumed = make_trainer(args, model_dir, tokenizer, reward, dataset, out / "run")
    resumed.args.max_steps = (n + 1) * spg
    replays_after = count_replays(resumed)
    restored = train_from_checkpoint(resumed, checkpoint)
    figures.update(
        resumed_from_step=n * spg,
        resumed_to_step=resumed.state.global_step,
        buffer_restored_exactly=restored == saved,
        replayed_groups_after_resume=replays_after,
        buffer_trajectories_after_resume=resumed.exgrpo_state.buffer.num_trajectories,
    )
    return figures


def fields_of_replayed_rows(trainer) -> dict:
    """Of the replayed rows (one process), how many reached the reward with the field stored with their trajectory."""
    k, draws = trainer.num_generations, trainer.field_log.draws
    rows = [(b, j, g * k) for b, plan in enumerate(trainer.plans) if plan is not None
            for j, g in enumerate(plan.group_indices)]  # fmt: skip
    own = sum(draws[b][row] == trainer.plans[b].record(j).get("fields", {}).get("draw") for b, j, row in rows)
    return {"replayed_rows": len(rows), "replayed_rows_with_their_field": own}


def _free(args) -> None:
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def _peak_bytes(args, fn) -> int | None:
    """Peak device memory that `fn` adds on top of what is allocated before it (None on the CPU)."""
    _free(args)
    if not args.device.startswith("cuda"):
        fn()
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def check_memory(args, model_dir, tokenizer, reward, dataset, out: Path) -> dict:
    """Entropy scoring of `memory_rows` stored trajectories (one chunk: the per-device batch) against TRL's training
    forward and backward of the same rows, activation checkpointing on as in the paper-scale recipes."""
    trainer = make_trainer(
        args, model_dir, tokenizer, reward, dataset, out / "memory", per_device_train_batch_size=args.memory_rows,
        steps_per_generation=None, generation_batch_size=args.memory_rows * args.num_generations,
        gradient_checkpointing=True,
    )  # fmt: skip
    rows, vocab = args.memory_rows, len(tokenizer)
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(16, vocab, (rows, args.memory_prompt_length), generator=generator).tolist()
    completions = torch.randint(16, vocab, (rows, args.memory_completion_length), generator=generator).tolist()
    model = trainer.model  # already on the device

    def scoring():
        model.eval()
        trainer._exgrpo_score_entropies(prompts, completions)

    def training():
        model.train()
        input_ids, attention_mask, completion_mask = pad_prompt_completion(
            prompts, completions, tokenizer.pad_token_id, device=trainer.accelerator.device
        )
        with trainer.accelerator.autocast():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_mask.size(1), batch_size=rows, compute_entropy=True
            )
        loss = -(logps * completion_mask).sum() / completion_mask.sum()  # (B, C) -> scalar
        loss.backward()
        model.zero_grad(set_to_none=True)

    scoring_bytes = _peak_bytes(args, scoring)
    training_bytes = _peak_bytes(args, training)
    gib = 2**30
    figures = {
        "rows": rows,
        "tokens_per_row": args.memory_prompt_length + args.memory_completion_length,
        "scoring_peak_gib": None if scoring_bytes is None else round(scoring_bytes / gib, 2),
        "training_peak_gib": None if training_bytes is None else round(training_bytes / gib, 2),
    }
    if scoring_bytes is not None:
        figures["scoring_over_training"] = round(scoring_bytes / training_bytes, 3)
    return figures


def check_numerics(args, model_dir, tokenizer, reward, dataset, out: Path) -> dict:
    """Learning rate 0: the model that stored a trajectory is the model that replays it, so w = 1 up to rounding."""
    trainer = make_trainer(args, model_dir, tokenizer, reward, dataset, out / "numerics", learning_rate=0.0)
    replays = count_replays(trainer)
    trainer.args.max_steps = args.generation_batches * trainer.args.steps_per_generation
    trainer.train()
    figures = {
        "replayed_groups_per_generation_batch": replays,
        "logged_is_weight_mean": _mean(logged(trainer, "exgrpo/replay/is_weight_mean")),
        "logged_is_weight_max": max(logged(trainer, "exgrpo/replay/is_weight_max"), default=None),
    }
    # Every stored trajectory re-scored with TRL's forward, in micro-batches as training would: |log w| per token.
    buffer, model, device = trainer.exgrpo_state.buffer, trainer.model, trainer.accelerator.device
    model.eval()
    pairs = [
        (tokenizer(entry.row["prompt"])["input_ids"], trajectory)
        for entry in buffer.questions.values()
        for trajectory in entry.trajectories
    ]
    gaps, storage = [], []
    with torch.no_grad():
        for start in range(0, len(pairs), args.micro_batch_rows):
            chunk = pairs[start : start + args.micro_batch_rows]
            input_ids, attention_mask, completion_mask = pad_prompt_completion(
                [p for p, _ in chunk], [t.completion_ids.tolist() for _, t in chunk], tokenizer.pad_token_id, device
            )
            with trainer.accelerator.autocast():
                logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, completion_mask.size(1), batch_size=len(chunk)
                )
            for row, (_, trajectory) in enumerate(chunk):
                stored = torch.as_tensor(trajectory.logps, dtype=torch.float32)
                gaps.append((logps[row, : len(stored)].float().cpu() - stored).abs())
                # float16 storage alone moves a log-prob by at most half its spacing there
                storage.append(torch.as_tensor(np.spacing(np.abs(trajectory.logps)).astype(np.float32) / 2))
    if gaps:
        every, rounding = torch.cat(gaps), torch.cat(storage)
        figures.update(
            rescored_trajectories=len(gaps),
            rescored_tokens=every.numel(),
            abs_log_w_mean=float(every.mean()),
            abs_log_w_max=float(every.max()),
            abs_log_w_p99=float(every.quantile(0.99)) if every.numel() <= 16_000_000 else None,
            float16_half_spacing_max=float(rounding.max()),
            # what recomputation adds beyond float16 storage (0 up to float32 rounding when nothing else differs)
            excess_over_storage_max=float((every - rounding).max()),
        )
    return figures


def _mean(values):
    return statistics.mean(values) if values else None


def main(argv=None) -> int:
    args = parse_args(argv)
    tokenizer, reward, dataset = build_task(args)
    out = Path(args.output_dir or tempfile.mkdtemp(prefix="exgrpo-real-vocab-"))
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    n_params = save_model(args, tokenizer, model_dir)
    figures = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "params_millions": round(n_params / 1e6, 1),
        "vocab_size": len(tokenizer),
        "completion_length": [args.min_completion_length, args.max_completion_length],
        "dtype": "bfloat16" if args.bf16 else "float32",
    }
    print(json.dumps(figures), flush=True)
    checks = {"smoke": check_smoke, "memory": check_memory, "numerics": check_numerics}
    for name in args.checks:
        start = time.perf_counter()
        figures[name] = checks[name](args, str(model_dir), tokenizer, reward, dataset, out)
        figures[name]["wall_s"] = round(time.perf_counter() - start, 1)
        _free(args)  # the check's trainers and models are gone with its frame
        print(f"{name}: {json.dumps(figures[name])}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
    failed = _failures(figures)
    for failure in failed:
        print(f"FAILED: {failure}", flush=True)
    return 1 if failed else 0


def _failures(figures: dict) -> list[str]:
    """What the checks promise: replay, storage and an exact resume; scoring no larger than the training step."""
    failures = []
    smoke = figures.get("smoke")
    if smoke:
        if sum(smoke["replayed_groups_per_generation_batch"]) == 0 or sum(smoke["replayed_groups_after_resume"]) == 0:
            failures.append("smoke: no replayed group before or after the resume")
        if smoke["buffer_trajectories"] == 0:
            failures.append("smoke: nothing stored")
        if not (smoke["checkpoint_has_buffer"] and smoke["buffer_restored_exactly"]):
            failures.append("smoke: the checkpoint's buffer was not restored exactly")
    memory = figures.get("memory")
    if memory and memory.get("scoring_over_training", 0) > 1:
        failures.append("memory: entropy scoring peaks above the training step")
    numerics = figures.get("numerics")
    if numerics and not math.isfinite(numerics.get("abs_log_w_max", 0.0)):
        failures.append("numerics: a non-finite importance weight")
    return failures


if __name__ == "__main__":
    sys.exit(main())
