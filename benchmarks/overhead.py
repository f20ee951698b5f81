"""ExGRPO's step-time overhead over TRL's GRPOTrainer, measured in one process.

Both trainers get the same model, data, reward and configuration; ExGRPO runs with replay on and a warm buffer
(pre-filled so that every step replays rho of its questions, each with several stored candidates to score). They
run in alternating blocks of steps, and the script prints the median optimizer-step time of each, their ratio, and
where ExGRPO's extra time goes.

    python benchmarks/overhead.py                       # default: a scaled-down paper shape on CPU
    python benchmarks/overhead.py --hidden-size 896 --layers 24 --heads 14 --max-completion-length 1024 \
        --device cuda --bf16                            # ~0.5B Qwen2 shape on a GPU

The task is synthetic so that completions have realistic lengths for the model and every question has several
distinct successful completions (a completion is solved when it ends with EOS and holds an even number of digits);
the algorithm is unchanged.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from exgrpo_trl.buffer import Trajectory, question_key
from exgrpo_trl.toy import build_char_tokenizer

TIMED = {
    "plan (sample + broadcast)": "_exgrpo_make_plan",
    "entropy scoring": "_exgrpo_score_entropies",
    "splice": "_exgrpo_apply_plan",
    "collection bookkeeping": "_exgrpo_after_scoring",
    "behaviour log-probs": "_exgrpo_record_behaviour_logps",
    "replay loss term": "_exgrpo_replay_loss",
}


class TimedExGRPOTrainer(ExGRPOTrainer):
    """Accumulates the wall time spent in each ExGRPO-specific method (scoring is also inside the plan)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timings: dict[str, float] = defaultdict(float)
        self.extra_per_step: list[float] = []  # ExGRPO's own seconds in each optimizer step (nested calls once)
        self._depth = 0
        for label, name in TIMED.items():
            setattr(self, name, self._timed(label, getattr(self, name)))

    def training_step(self, *args, **kwargs):
        if self._step % self.current_gradient_accumulation_steps == 0:
            self.extra_per_step.append(0.0)
        return super().training_step(*args, **kwargs)

    def _timed(self, label, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            self._depth += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                elapsed = time.perf_counter() - start
                self.timings[label] += elapsed
                if self._depth == 0 and self.extra_per_step:
                    self.extra_per_step[-1] += elapsed

        return wrapper


def build_model(tokenizer, args) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def make_reward(eos: int, digit_ids: set[int]):
    def even_digits_reward(completion_ids, **kwargs):
        return [float(ids[-1] == eos and sum(t in digit_ids for t in ids) % 2 == 0) for ids in completion_ids]

    return even_digits_reward


@torch.no_grad()
def prefill(trainer: ExGRPOTrainer, dataset: Dataset, reward, args) -> None:
    """Store, for `args.prefill_questions` questions, every distinct successful completion of K samples."""
    model, tokenizer, k = trainer.model, trainer.processing_class, args.num_generations
    buffer = trainer.experience_buffer
    device = next(model.parameters()).device
    for start in range(0, args.prefill_questions, 8):
        rows = [dataset[i] for i in range(start, min(start + 8, args.prefill_questions))]
        prompts = [r["prompt"] for r in rows for _ in range(k)]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
        out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=args.max_completion_length,
                             pad_token_id=tokenizer.pad_token_id)
        completions = out[:, enc["input_ids"].size(1):]
        logps = torch.log_softmax(model(out, attention_mask=(out != tokenizer.pad_token_id) | (
            torch.arange(out.size(1), device=device) < enc["input_ids"].size(1))).logits.float(), -1)
        logps = logps[:, enc["input_ids"].size(1) - 1 : -1].gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        ids_list = []
        for row in completions.tolist():
            ids_list.append(row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
        solved = reward(ids_list)
        for q, row in enumerate(rows):
            group = range(q * k, (q + 1) * k)
            successes = int(sum(solved[i] for i in group))
            trajs = [Trajectory(np.array(ids_list[i]), logps[i, : len(ids_list[i])].cpu().numpy(), 0)
                     for i in group if solved[i]]
            if 0 < successes < k:
                buffer.update_group(question_key(row["prompt"]), successes, row, trajs)
    trainer.exgrpo_state["replay_active"] = True


@contextmanager
def timer(label: str, log: dict):
    start = time.perf_counter()
    yield
    log[label] = time.perf_counter() - start


def step_times(trainer) -> list[float]:
    return [h["step_time"] for h in trainer.state.log_history if "step_time" in h]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--questions-per-step", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--replay-ratio", type=float, default=0.5)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--prefill-questions", type=int, default=64)
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks per trainer")
    p.add_argument("--steps-per-block", type=int, default=6)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)

    tokenizer = build_char_tokenizer()
    digit_ids = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    reward = make_reward(tokenizer.eos_token_id, digit_ids)
    rng = np.random.default_rng(args.seed)
    prompts = sorted({f"{a}+{b}=" for a, b in rng.integers(0, 10**4, size=(4000, 2))})
    dataset = Dataset.from_dict({"prompt": prompts}).shuffle(seed=args.seed)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="exgrpo-overhead-"), per_device_train_batch_size=args.questions_per_step * args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, learning_rate=1e-5,
        logging_steps=1, report_to=[], use_cpu=args.device == "cpu", bf16=args.bf16, gradient_checkpointing=False,
        save_strategy="no", seed=args.seed, loss_type="dr_grpo", scale_rewards="none", disable_tqdm=True,
    )
    model_grpo, model_ex = build_model(tokenizer, args), build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model_grpo.parameters())
    grpo = GRPOTrainer(model=model_grpo, reward_funcs=reward, args=GRPOConfig(**common), train_dataset=dataset,
                       processing_class=tokenizer)
    ex = TimedExGRPOTrainer(model=model_ex, reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer,
                            args=ExGRPOConfig(replay_ratio=args.replay_ratio, replay_start_pass_rate=0.0, **common))
    ex.model.to(ex.accelerator.device)
    prefill(ex, dataset, reward, args)
    buffer = ex.experience_buffer
    candidates = [len(e.trajectories) for e in buffer.questions.values()]
    print(f"model: {n_params / 1e6:.2f}M params; {args.questions_per_step} questions x K={args.num_generations} per "
          f"step; completions up to {args.max_completion_length} tokens; rho={args.replay_ratio}")
    print(f"warm buffer: {buffer.num_questions} questions, {buffer.num_trajectories} trajectories "
          f"(mean {np.mean(candidates):.1f} candidates per question)")

    measured = {"grpo": [], "exgrpo": []}
    fractions = []  # per ExGRPO step: its own extra time / the rest of that same step (robust to load drift)
    for block in range(args.blocks):
        for name, trainer in (("grpo", grpo), ("exgrpo", ex)):
            trainer.args.max_steps = args.steps_per_block
            trainer.state.log_history = []
            if name == "exgrpo":
                trainer.extra_per_step = []
            trainer.train()
            measured[name] += step_times(trainer)[1:]  # the block's first step pays one-off costs
            if name == "exgrpo":
                steps = step_times(trainer)
                fractions += [x / (t - x) for t, x in zip(steps[1:], trainer.extra_per_step[1:])]
        print(f"block {block + 1}/{args.blocks}: GRPO {statistics.median(measured['grpo']):.3f} s/step, "
              f"ExGRPO {statistics.median(measured['exgrpo']):.3f} s/step", flush=True)

    g, e = statistics.median(measured["grpo"]), statistics.median(measured["exgrpo"])
    total_ex_steps = args.blocks * args.steps_per_block
    print()
    print(f"median step time: GRPOTrainer {g:.4f} s, ExGRPOTrainer {e:.4f} s, ratio {e / g:.3f} "
          f"({len(measured['grpo'])} + {len(measured['exgrpo'])} steps)")
    print(f"ExGRPO's own time / the rest of the same step: median {statistics.median(fractions):.3f} "
          f"(quartiles {np.percentile(fractions, 25):.3f}-{np.percentile(fractions, 75):.3f})")
    print("ExGRPO's own time per step (all steps of all blocks):")
    per_step = {label: seconds / total_ex_steps for label, seconds in ex.timings.items()}
    for label in TIMED:
        share = per_step.get(label, 0.0)
        print(f"  {label:<28} {1000 * share:8.2f} ms  ({100 * share / g:5.2f}% of a GRPO step)")
    print(f"buffer at the end: {buffer.num_questions} questions, {buffer.num_trajectories} trajectories, "
          f"{len(buffer.retired)} retired")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"grpo_median_s": g, "exgrpo_median_s": e, "ratio": e / g,
                       "median_extra_fraction": statistics.median(fractions), "per_step_ms":
                       {k: 1000 * v for k, v in per_step.items()}, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
