"""Run by tests/multiprocess/test_multiprocess.py under `accelerate launch --num_processes 2` (DDP over gloo, or
DeepSpeed ZeRO-3), never by pytest directly.

Trains the tiny model of tests/helpers.py with replay on and lowest-entropy trajectory selection, and writes what
the test compares to OUT/rank{r}.json:

- the world as each rank sees it (num_processes, distributed type, ZeRO stage, model engine class);
- per generation batch: a hash of the replay plan (groups, keys, selected completion ids, behaviour log-probs), the
  number of candidates scored for entropy and the rows this rank scored;
- per optimizer step: the forward passes through the model outside generation (loss, old log-probs, entropy
  scoring), which must be equal on every rank, and the forward passes of entropy scoring alone;
- the trajectories this rank handed to the main process at each flush, and the buffer as this rank holds it after
  training (sizes, a hash of its state, the retired set), host RSS;
- with --uneven: `_exgrpo_score_entropies` called directly with candidate counts that split unevenly over 2 ranks
  (1, 3, 2B+1 with B the scoring chunk size), compared with unsharded scoring;
- with --resume: a second trainer resumes from the last checkpoint; the buffer each rank holds right after loading;
- with --tools: the calculator task of tests/support/tool_tasks.py instead, whose rollouts call tools through TRL's
  tool loop
  (a rank runs as many tool turns as its own rows need), every 6th question always solved so that some retire;
- with --offline: offline guidance (algorithm §11) from a `solution` column: per generation batch the global rows this
  rank gave an offline solution, and the guide's state (rejected solutions, questions solved) after training;
- with --vlm: the tiny Qwen2-VL of exgrpo_trl/tasks/vision.py on its colour questions (the answer is in the image).

Options are plain argv flags so the launch command stays short.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from tests.helpers import make_model, make_reward, make_trainer, synthetic_dataset
from tests.support.recording import RecordingTrainer, buffer_summary, plan_digest


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def plans(trainer: RecordingTrainer) -> list[dict]:
    """Per generation batch: the step, a hash of the plan, and how many questions it replays."""
    out = []
    for batch in trainer.batches:
        entry = {"step": batch["step"], "plan": plan_digest(batch["plan"])}
        if batch["plan"] is not None:
            entry["num_replayed"] = len(batch["plan"].keys)
        out.append(entry)
    return out


def world_info(trainer) -> dict:
    acc = trainer.accelerator
    info = {
        "num_processes": acc.num_processes,
        "process_index": acc.process_index,
        "is_main_process": acc.is_main_process,
        "distributed_type": str(acc.distributed_type),
        "backend": acc.state.backend,
        "engine": type(trainer.model_wrapped).__name__,
        "zero_stage": None,
    }
    if hasattr(trainer.model_wrapped, "zero_optimization_stage"):
        info["zero_stage"] = trainer.model_wrapped.zero_optimization_stage()
    return info


def tool_setup():
    """(tokenizer, model, dataset, reward, trainer keywords) of the calculator task with tools."""
    from tests.support.tool_tasks import (
        add,
        build_tool_tokenizer,
        calculator_dataset,
        calculator_reward,
        make_tool_model,
        mul,
    )

    def reward(completions, answer, always, **kwargs):
        return [1.0 if a else r for r, a in zip(calculator_reward(completions, answer), always)]

    tokenizer = build_tool_tokenizer()
    dataset = calculator_dataset(24).add_column("always", [i % 6 == 0 for i in range(24)])
    return tokenizer, make_tool_model(tokenizer), dataset, reward, {"tools": [add, mul]}


def build(out: Path, args, max_steps: int, break_padding: bool = False) -> RecordingTrainer:
    from exgrpo_trl.tasks.toy import build_char_tokenizer

    if args.tools:
        tokenizer, model, dataset, reward, extra = tool_setup()
    elif args.vlm:  # the tiny Qwen2-VL: questions are images (every prompt's text is the same), the processor's
        from exgrpo_trl.tasks.vision import build_tiny_processor, colour_dataset, colour_reward, save_tiny_vlm

        # loaded from a folder, as a user's model is: once ZeRO-3 is set up, a model built from its config is
        # partitioned while transformers initialises its weights (the resumed trainer's would fail there)
        model_dir = out / f"tiny-vlm-rank{os.environ.get('LOCAL_RANK', '0')}"
        if not model_dir.exists():
            save_tiny_vlm(model_dir)
        model, tokenizer, dataset = str(model_dir), build_tiny_processor(), colour_dataset(24, seed=1)
        reward, extra = colour_reward, {}
    else:
        tokenizer = build_char_tokenizer()
        dataset = synthetic_dataset(n=args.questions, always_every=args.always_every)
        model, reward = make_model(tokenizer), make_reward(tokenizer)
        extra = {}
        if args.offline:  # a 2-character solution (solved), every fourth a 7-character one (rejected)
            solutions = [["1234567"] if i % 4 == 1 else ["12"] for i in range(len(dataset))]
            dataset = dataset.add_column("solution", solutions)
    return make_trainer(
        out,
        tokenizer,
        cls=RecordingTrainer,
        model=model,
        reward_funcs=reward,
        train_dataset=dataset,
        trainer_kwargs={"break_padding": break_padding, **extra},
        per_device_train_batch_size=6,  # 12 rows per rank per generation batch: the middle group spans both ranks
        steps_per_generation=2,
        num_generations=8,
        max_steps=max_steps,
        replay_ratio=0.7,  # 3 groups per generation batch: 2 replayed (groups 1 and 2; group 1 spans both ranks)
        replay_start_pass_rate=0.0,
        trajectory_selection="lowest_entropy",
        save_strategy="steps",
        save_steps=args.save_steps,
        use_cpu=True,  # without it accelerate finds no backend on a machine without CUDA: a world of 1 on each rank
        seed=args.seed,
        **({"max_completion_length": 32, "learning_rate": 1e-3} if args.tools else {}),
        **({"offline_solutions_column": "solution"} if args.offline else {}),
    )


def uneven_scoring(trainer: RecordingTrainer) -> list[dict]:
    """Score candidate counts that split unevenly over the ranks, directly, and compare with unsharded scoring."""
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # a processor's tokenizer
    chunk = trainer.args.per_device_train_batch_size
    prompts = [tokenizer(f"{i % 10}+{i % 7}=")["input_ids"] for i in range(2 * chunk + 1)]
    rng = np.random.default_rng(0)
    completions = [
        rng.integers(4, 16, size=int(rng.integers(1, 9))).tolist() + [tokenizer.eos_token_id] for _ in prompts
    ]
    results = []
    trainer.model.eval()
    for n in (1, 3, 2 * chunk + 1):
        before = trainer.scoring_forwards
        sharded = trainer._exgrpo_score_entropies(prompts[:n], completions[:n])
        forwards = trainer.scoring_forwards - before
        trainer._in_scoring = True  # every rank scores all n here: the same forward passes again
        try:
            with torch.no_grad():
                full = trainer._exgrpo_entropy_scorer().mean_entropies(prompts[:n], completions[:n]).cpu()
        finally:
            trainer._in_scoring = False
        results.append(
            {
                "candidates": n,
                "forwards": forwards,
                "sharded": [float(x) for x in sharded],
                "max_abs_diff": float((sharded - full).abs().max()),
            }
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--questions", type=int, default=24, help="questions in the synthetic dataset")
    parser.add_argument("--always-every", type=int, default=6, help="every Nth question is always solved")
    parser.add_argument("--expect", choices=["ddp", "zero3"], required=True)
    parser.add_argument("--uneven", action="store_true", help="call _exgrpo_score_entropies with uneven counts")
    parser.add_argument("--resume", action="store_true", help="resume a second trainer from the last checkpoint")
    parser.add_argument("--break-padding", action="store_true", help="negative control: unequal forward passes")
    parser.add_argument("--tools", action="store_true", help="the calculator task, its rollouts calling tools")
    parser.add_argument("--offline", action="store_true", help="offline guidance from a solution column")
    parser.add_argument("--vlm", action="store_true", help="a tiny vision-language model on image questions")
    args = parser.parse_args()
    out = Path(args.out)
    t0 = time.time()

    trainer = build(out, args, args.max_steps, break_padding=args.break_padding)
    info = world_info(trainer)  # before train(): the engine is not built yet, only the state
    record: dict = {"world_before_train": info}
    rank = trainer.accelerator.process_index
    # The checks that were silently skipped before: a real world of 2 on every rank.
    assert trainer.accelerator.num_processes == 2, f"rank sees a world of {trainer.accelerator.num_processes}"
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 2

    trainer.train()
    record["world"] = world_info(trainer)
    if args.expect == "zero3":
        assert record["world"]["distributed_type"] == "DistributedType.DEEPSPEED", record["world"]
        assert record["world"]["zero_stage"] == 3, record["world"]
    else:
        assert record["world"]["distributed_type"] == "DistributedType.MULTI_CPU", record["world"]
        assert record["world"]["engine"] == "DistributedDataParallel", record["world"]
    record["train_seconds"] = time.time() - t0
    record.update(trainer.rec)
    record["plans"] = plans(trainer)
    record["buffer"] = buffer_summary(trainer.exgrpo_state.buffer)
    record["masked_trajectories"] = sum(t.mask is not None for t in trainer.exgrpo_state.buffer.iter_trajectories())
    # the state every rank holds alike (the latest metrics are the main process's own: `experience.MAIN_ONLY`)
    record["exgrpo_state"] = {
        k: v for k, v in trainer.exgrpo_state.state_dict().items() if k not in ("sampler", "latest")
    }
    record["global_step"] = trainer.state.global_step
    if args.offline:
        record["offline_rows"] = [sorted(r.global_row for r in b["offline_rows"]) for b in trainer.batches]
        record["offline_state"] = trainer.exgrpo_state.offline.state_dict()
    if args.uneven:
        record["uneven"] = uneven_scoring(trainer)
    record["rss_mb"] = rss_mb()
    record["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if args.resume:
        checkpoint = out / "out" / f"checkpoint-{trainer.state.global_step}"
        resumed = build(out, args, args.max_steps + 2)
        resumed.train(resume_from_checkpoint=str(checkpoint))
        record["resumed"] = {
            "after_load": resumed.rec.get("after_load"),
            "global_step": resumed.state.global_step,
            "plans": plans(resumed),
            "steps": resumed.rec["steps"],
            "buffer": buffer_summary(resumed.exgrpo_state.buffer),
        }

    record["seconds"] = time.time() - t0
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump(record, f)
    trainer.accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    exit_now()


def exit_now() -> None:
    """Exit 0 without the interpreter's teardown, once everything is written: a multi-process run on CPU under ZeRO-3
    sometimes aborts one rank there ("terminate called without an active exception", a C++ thread of torch's or
    DeepSpeed's CPU communication destroyed while joinable: about 1 launch in 5 here), even with the process group
    torn down first, after the run and its records are complete. What these tests check is written by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
