"""ExGRPO's step-time overhead over TRL's GRPOTrainer, measured in one process.

Both trainers get the same model, data, reward and configuration; ExGRPO runs with replay on and a warm buffer
(pre-filled so that every step replays rho of its questions, each with several stored candidates to score). They
take turns step by step (each in its own thread, one running at a time, so drifts in the machine's speed fall on
both alike), and the script prints the median optimizer-step time of each, their ratio, the median of the ratios of
steps run back to back, and where ExGRPO's time differs: its own code (planning, entropy scoring, splice,
bookkeeping, loss) and generation (replayed groups sample K-1 rows, not K).

    python benchmarks/overhead.py                       # default: a scaled-down paper shape on CPU
    python benchmarks/overhead.py --max-trajectory-candidates none   # the paper's selection: score every one
    python benchmarks/overhead.py --replay-max-age 2 --replay-priority advantage   # the literature's draw rules
    python benchmarks/overhead.py --hidden-size 1024 --intermediate-size 5120 --layers 24 --heads 16 \
        --min-completion-length 1024 --max-completion-length 2048 --device cuda --bf16
                                                        # ~0.48B Qwen2 shape on a GPU, 1-2k-token completions

The task is synthetic so that completions have realistic lengths for the model and every question has several
distinct successful completions (a completion is solved when it ends with EOS and holds an even number of digits);
the algorithm is unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import threading
import time
from collections import defaultdict

import numpy as np
import torch
from datasets import Dataset
from transformers import Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from exgrpo_trl import draw as draw_module
from exgrpo_trl.buffer import Trajectory, question_key
from exgrpo_trl.tasks.toy import ALPHABET, SPECIAL_TOKENS, build_char_tokenizer, build_tiny_model

DRAW_FUNCTIONS = {name: getattr(draw_module, name) for name in ("draw_questions", "count_uses")}
CHAR_VOCAB = len(SPECIAL_TOKENS) + len(ALPHABET)  # the character tokenizer; a grown one adds fillers after it
# label -> the method timed: the run's steps (`exgrpo_trl.run.ExGRPORun`) and the trainer's entropy scoring
TIMED = {
    "plan (sample + broadcast)": "run._plan",
    "entropy scoring": "_exgrpo_score_entropies",
    "splice": "run._rows",
    "collection bookkeeping": "run.finish",
    "behaviour log-probs": "run.record_behaviour",
    "replay loss term": "run.replay_term",
}


class TimedExGRPOTrainer(ExGRPOTrainer):
    """Accumulates the wall time spent in each ExGRPO-specific method (scoring is also inside the plan)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.timings: dict[str, float] = defaultdict(float)
        self.extra_per_step: list[float] = []  # ExGRPO's own seconds in each optimizer step (nested calls once)
        self.scored_rows: list[int] = []  # stored trajectories scored per generation batch
        self._depth = 0
        for label, name in TIMED.items():
            owner = self.exgrpo_run if name.startswith("run.") else self
            name = name.removeprefix("run.")
            setattr(owner, name, self._timed(label, getattr(owner, name)))
        # the draw's own rules (eligibility, the questions, use counts; scoring apart), inside the plan: per call
        self.draw_seconds: list[float] = []
        for name, function in DRAW_FUNCTIONS.items():  # the draw looks them up at each call; `restore` puts them back
            setattr(draw_module, name, self._draw_timed(function))

    @staticmethod
    def restore() -> None:
        for name, function in DRAW_FUNCTIONS.items():
            setattr(draw_module, name, function)

    def _draw_timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if function.__name__ == "draw_questions":
                    self.draw_seconds.append(0.0)
                self.draw_seconds[-1] += time.perf_counter() - start

        return wrapper

    def _exgrpo_score_entropies(self, prompt_ids, completion_ids, masks=None, vision=None):
        self.scored_rows.append(len(completion_ids))
        return super()._exgrpo_score_entropies(prompt_ids, completion_ids, masks, vision)

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
    """The benchmark's Qwen2 model; with a grown vocabulary, `stop_token_ids(tokenizer, args)` end generation."""
    model = build_tiny_model(
        tokenizer,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_key_value_heads=getattr(args, "kv_heads", None),
        intermediate_size=getattr(args, "intermediate_size", None) or args.hidden_size * 4,
        max_position_embeddings=max(4096, args.max_completion_length + 64),
        seed=args.seed,
    )
    model.generation_config.eos_token_id = stop_token_ids(tokenizer, args)
    return model


def stop_token_ids(tokenizer, args) -> list[int]:
    """EOS, and with a grown vocabulary (`--vocab-size`) as many filler ids as it takes for an untrained model, which
    samples nearly uniformly over the vocabulary, to stop about half-way between the minimum and the maximum
    completion length (real generation configs list several stop ids too; TRL ends a completion at any of them)."""
    fillers = len(tokenizer) - CHAR_VOCAB
    if fillers <= 0:
        return [tokenizer.eos_token_id]
    span = max(1, args.max_completion_length - args.min_completion_length)
    count = min(fillers, math.ceil(2 * len(tokenizer) / span))
    return [tokenizer.eos_token_id, *range(len(tokenizer) - count, len(tokenizer))]


def make_reward(stop_ids: list[int], marked_ids: set[int]):
    """Solved: the completion ends with a stop token and holds an even number of marked tokens (about half)."""
    stops = set(stop_ids)

    def even_marked_reward(completion_ids, **kwargs):
        return [float(ids[-1] in stops and sum(t in marked_ids for t in ids) % 2 == 0) for ids in completion_ids]

    return even_marked_reward


@torch.no_grad()
def prefill(trainer: ExGRPOTrainer, dataset: Dataset, reward, args) -> None:
    """Store, for `args.prefill_questions` questions, every distinct successful completion of K samples."""
    model, tokenizer, k = trainer.model, trainer.processing_class, args.num_generations
    buffer = trainer.exgrpo_state.buffer
    device = next(model.parameters()).device
    for start in range(0, args.prefill_questions, 8):
        rows = [dataset[i] for i in range(start, min(start + 8, args.prefill_questions))]
        prompts = [r["prompt"] for r in rows for _ in range(k)]
        enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left").to(device)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            max_new_tokens=args.max_completion_length,
            min_new_tokens=args.min_completion_length,
            pad_token_id=tokenizer.pad_token_id,
        )
        completions = out[:, enc["input_ids"].size(1) :]
        logps = torch.log_softmax(
            model(
                out,
                attention_mask=(out != tokenizer.pad_token_id)
                | (torch.arange(out.size(1), device=device) < enc["input_ids"].size(1)),
            ).logits.float(),
            -1,
        )
        logps = logps[:, enc["input_ids"].size(1) - 1 : -1].gather(-1, completions.unsqueeze(-1)).squeeze(-1)
        stops, ids_list = set(stop_token_ids(tokenizer, args)), []
        for row in completions.tolist():
            end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
            ids_list.append(row[: end + 1])
        solved = reward(ids_list)
        for q, row in enumerate(rows):
            group = range(q * k, (q + 1) * k)
            successes = int(sum(solved[i] for i in group))
            trajs = [
                Trajectory(np.array(ids_list[i]), logps[i, : len(ids_list[i])].cpu().numpy(), 0)
                for i in group
                if solved[i]
            ]
            if 0 < successes < k:
                buffer.update_group(question_key(row["prompt"]), successes, row, trajs)
    trainer.exgrpo_state.replay_active = True


def time_generation(trainer) -> list[float]:
    """Record the seconds of each call of TRL's generation hook (ExGRPO's override included) on `trainer`."""
    seconds: list[float] = []
    method = trainer._generate_single_turn

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    trainer._generate_single_turn = wrapper
    return seconds


class _Turns:
    """Lets named threads run one optimizer step each in turn (the others wait), until each has finished.

    Turns go A B, B A, A B, ... A/A runs (`--aa`, two GRPOTrainers) on the 2-core CPU machine gave ratios of 0.982 to
    1.012 and step-by-step medians of 0.987 to 1.011 with 2 threads; with OMP_NUM_THREADS=1 the trainer that took
    the first turn measured 3-5% slower, in this order and in strict alternation alike. Check with `--aa`.
    """

    def __init__(self, names: list[str]):
        self.order, self.active = list(names), set(names)
        self.schedule = self.order + self.order[::-1]  # A B B A, repeated
        self.position = 0
        self.turn = names[0]
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self.cond:
            if finished:
                self.active.discard(name)
            for _ in range(len(self.schedule)):
                self.position += 1
                candidate = self.schedule[self.position % len(self.schedule)]
                if candidate in self.active:
                    self.turn = candidate
                    break
            self.cond.notify_all()


class _TakeTurns(TrainerCallback):
    def __init__(self, turns: _Turns, name: str):
        self.turns, self.name = turns, name

    def on_step_end(self, args, state, control, **kwargs):
        self.turns.pass_on(self.name)
        self.turns.wait(self.name)


def run_in_lockstep(trainers: dict, steps: int) -> None:
    """Train every trainer for `steps` optimizer steps, one step of each in turn, each in its own thread.

    Only one trainer runs at any moment, and step i of each runs next to step i of the others, so slow drifts in the
    machine's speed (other tenants, clocks) fall on all of them alike; TRL's `step_time` covers each step alone.
    """
    turns = _Turns(list(trainers))
    errors = []

    def work(name, trainer):
        turns.wait(name)
        try:
            trainer.args.max_steps = steps
            trainer.add_callback(_TakeTurns(turns, name))
            trainer.train()
        except BaseException as error:  # re-raised in the caller
            errors.append(error)
        finally:
            turns.pass_on(name, finished=True)

    threads = [threading.Thread(target=work, args=item, name=item[0]) for item in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def step_times(trainer) -> list[float]:
    return [h["step_time"] for h in trainer.state.log_history if "step_time" in h]


def add_task_arguments(p: argparse.ArgumentParser) -> None:
    """The model and batch shape, and the seed (shared with benchmarks/candidate_cap.py)."""
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: 4 x hidden size)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=None, help="key-value heads (default: --heads; Qwen2.5-0.5B: 2)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="grow the character vocabulary to this many tokens (Qwen2.5: 151936): the logits' real width",
    )
    p.add_argument("--questions-per-step", type=int, default=16)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--replay-ratio", type=float, default=0.5)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument(
        "--min-completion-length",
        type=int,
        default=0,
        help="EOS is suppressed before this many tokens (long completions from an untrained model, e.g. "
        "1024 for the GPU shape)",
    )
    p.add_argument(
        "--continuous-batching",
        action="store_true",
        help="generate with transformers' continuous batching (GRPOConfig.use_transformers_continuous_batching, "
        "TRL's paged engine) instead of plain generate",
    )
    p.add_argument("--prefill-questions", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)


def build_task(args):
    """The char tokenizer (grown to `args.vocab_size`), the reward and a shuffled dataset of distinct "a+b=" prompts.

    Marked tokens: the digits, and every even filler id of a grown vocabulary (an untrained model rarely samples a
    digit among 150k tokens)."""
    tokenizer = build_char_tokenizer(vocab_size=getattr(args, "vocab_size", None))
    marked = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)} | set(range(CHAR_VOCAB, len(tokenizer), 2))
    rng = np.random.default_rng(args.seed)
    prompts = sorted({f"{a}+{b}=" for a, b in rng.integers(0, 10**4, size=(4000, 2))})
    dataset = Dataset.from_dict({"prompt": prompts}).shuffle(seed=args.seed)
    return tokenizer, make_reward(stop_token_ids(tokenizer, args), marked), dataset


def trainer_config(args, **overrides) -> dict:
    """The configuration fields every trainer of these benchmarks shares (`overrides` replace them): the paper's
    objective (dr_grpo, no std scaling), a step logged each step, nothing saved, no activation checkpointing."""
    config = dict(
        output_dir=overrides.pop("output_dir", None) or tempfile.mkdtemp(prefix="exgrpo-benchmark-"),
        per_device_train_batch_size=args.questions_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        generation_kwargs={"min_new_tokens": args.min_completion_length} if args.min_completion_length else None,
        learning_rate=1e-5,
        loss_type="dr_grpo",
        scale_rewards="none",
        logging_steps=1,
        report_to=[],
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
        use_transformers_continuous_batching=getattr(args, "continuous_batching", False),
    )
    config.update(overrides)
    return config


def _cap(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per trainer, taken in turns")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps of each trainer left out of the figures")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument(
        "--max-trajectory-candidates",
        type=_cap,
        default=ExGRPOConfig.max_trajectory_candidates,
        help="ExGRPOConfig.max_trajectory_candidates (default: the library's, "
        f"{ExGRPOConfig.max_trajectory_candidates}); 'none' scores every stored trajectory, as the paper",
    )
    p.add_argument(
        "--aa",
        action="store_true",
        help="A/A check of the harness: time two GRPOTrainers against each other (expect a ratio of 1)",
    )
    p.add_argument("--replay-max-age", type=int, default=None, help="ExGRPOConfig.replay_max_age (default: off)")
    p.add_argument("--replay-max-uses", type=int, default=None, help="ExGRPOConfig.replay_max_uses (default: off)")
    p.add_argument("--replay-priority", default="gaussian", help="ExGRPOConfig.replay_priority (default: gaussian)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)

    tokenizer, reward, dataset = build_task(args)
    common = trainer_config(args)
    model_grpo, model_ex = build_model(tokenizer, args), build_model(tokenizer, args)
    cap = {"max_trajectory_candidates": args.max_trajectory_candidates}
    rules = {"replay_max_age": args.replay_max_age, "replay_max_uses": args.replay_max_uses,
             "replay_priority": args.replay_priority}  # fmt: skip
    n_params = sum(p.numel() for p in model_grpo.parameters())
    grpo = GRPOTrainer(
        model=model_grpo,
        reward_funcs=reward,
        args=GRPOConfig(**common),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    if args.aa:
        other = GRPOTrainer(
            model=model_ex,
            reward_funcs=reward,
            args=GRPOConfig(**common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        run_in_lockstep({"grpo": grpo, "grpo again": other}, args.steps)
        a, b = step_times(grpo)[args.warmup_steps :], step_times(other)[args.warmup_steps :]
        paired = [y / x for x, y in zip(a, b)]
        print(
            f"A/A: GRPOTrainer {statistics.median(a):.4f} s, the same again {statistics.median(b):.4f} s, ratio "
            f"{statistics.median(b) / statistics.median(a):.3f}; step-by-step ratio median "
            f"{statistics.median(paired):.3f} (quartiles {np.percentile(paired, 25):.3f}-"
            f"{np.percentile(paired, 75):.3f})"
        )
        return 0
    ex = TimedExGRPOTrainer(
        model=model_ex,
        reward_funcs=reward,
        train_dataset=dataset,
        processing_class=tokenizer,
        args=ExGRPOConfig(replay_ratio=args.replay_ratio, replay_start_pass_rate=0.0, **cap, **rules, **common),
    )
    ex.model.to(ex.accelerator.device)
    prefill(ex, dataset, reward, args)
    buffer = ex.exgrpo_state.buffer
    candidates = [len(e.trajectories) for e in buffer.questions.values()]
    print(
        f"model: {n_params / 1e6:.2f}M params; {args.questions_per_step} questions x K={args.num_generations} per "
        f"step; completions up to {args.max_completion_length} tokens; rho={args.replay_ratio}; "
        f"max_trajectory_candidates={args.max_trajectory_candidates}; draw rules: "
        + ", ".join(f"{k}={v}" for k, v in rules.items())
    )
    print(
        f"warm buffer: {buffer.num_questions} questions, {buffer.num_trajectories} trajectories "
        f"(mean {np.mean(candidates):.1f} candidates per question)"
    )

    generation = {"grpo": time_generation(grpo), "exgrpo": time_generation(ex)}
    try:
        run_in_lockstep({"grpo": grpo, "exgrpo": ex}, args.steps)
    finally:
        ex.restore()
    skip = args.warmup_steps  # the first steps pay one-off costs (data loader, optimizer state, allocator)
    measured = {"grpo": step_times(grpo)[skip:], "exgrpo": step_times(ex)[skip:]}
    generation = {name: seconds[skip:] for name, seconds in generation.items()}
    paired = [e / g for g, e in zip(measured["grpo"], measured["exgrpo"])]  # step i of each, run back to back
    # per ExGRPO step: its own extra time / the rest of that same step
    fractions = [x / (t - x) for t, x in zip(measured["exgrpo"], ex.extra_per_step[skip:])]

    g, e = statistics.median(measured["grpo"]), statistics.median(measured["exgrpo"])
    total_ex_steps = args.steps
    print()
    print(
        f"median step time: GRPOTrainer {g:.4f} s, ExGRPOTrainer {e:.4f} s, ratio {e / g:.3f} "
        f"({len(measured['grpo'])} + {len(measured['exgrpo'])} steps)"
    )
    print(
        f"step-by-step ratio (ExGRPO step i / GRPO step i): median {statistics.median(paired):.3f} "
        f"(quartiles {np.percentile(paired, 25):.3f}-{np.percentile(paired, 75):.3f})"
    )
    gen_g, gen_e = statistics.median(generation["grpo"]), statistics.median(generation["exgrpo"])
    print(
        f"generation per step: GRPOTrainer {1000 * gen_g:.1f} ms, ExGRPOTrainer {1000 * gen_e:.1f} ms "
        f"({1000 * (gen_e - gen_g):+.1f} ms: replayed groups sample K-1 rows, not K)"
    )
    print(
        f"ExGRPO's own code / the rest of the same step: median {statistics.median(fractions):.3f} "
        f"(quartiles {np.percentile(fractions, 25):.3f}-{np.percentile(fractions, 75):.3f})"
    )
    print("ExGRPO's own time per step (mean over all steps):")
    per_step = {label: seconds / total_ex_steps for label, seconds in ex.timings.items()}
    for label in TIMED:
        share = per_step.get(label, 0.0)
        print(f"  {label:<28} {1000 * share:8.2f} ms  ({100 * share / g:5.2f}% of a GRPO step)")
    draws = ex.draw_seconds[skip:] or ex.draw_seconds
    print(
        f"the draw's own rules per generation batch (eligibility, the questions, use counts; scoring apart): median "
        f"{1000 * statistics.median(draws) if draws else float('nan'):.3f} ms, max {1000 * max(draws, default=0):.3f} "
        f"ms over {len(draws)} batches"
    )
    print(
        f"stored trajectories scored per step: mean {np.mean(ex.scored_rows):.1f} "
        f"(max {max(ex.scored_rows, default=0)})"
    )
    print(
        f"buffer at the end: {buffer.num_questions} questions, {buffer.num_trajectories} trajectories, "
        f"{len(buffer.retired)} retired"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "grpo_median_s": g,
                    "exgrpo_median_s": e,
                    "ratio": e / g,
                    "paired_ratio_median": statistics.median(paired),
                    "median_extra_fraction": statistics.median(fractions),
                    "draw_median_s": statistics.median(draws) if draws else None,
                    "rules": rules,
                    "generation_median_s": {"grpo": gen_g, "exgrpo": gen_e},
                    "step_times_s": measured,
                    "generation_s": generation,
                    "per_step_ms": {k: 1000 * v for k, v in per_step.items()},
                    "args": vars(args),
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
