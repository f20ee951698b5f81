"""A tiny model and a toy verifiable task for trying ExGRPO on a laptop CPU: integer addition, a ~1M-parameter Qwen2
model and a character tokenizer.

Everything here is built locally (no downloads):

- `build_char_tokenizer`: a character-level tokenizer over ``0-9 + =`` (or another alphabet) and four specials.
- `build_tiny_model`: a ~1M-parameter Qwen2-shaped causal LM (float32, tied embeddings, head size 64).
- `addition_dataset` / `addition_splits`: "37+48=" -> "85", difficulty = number of digits of the operands.
- `addition_reward`: the binary verifier (exact match of the stripped completion), TRL reward-function shaped.
- `warm_start`: a short supervised phase to a moderate pass rate.
- `evaluate_pass_at_1`: sampled pass@1 per question and by difficulty.

Addition is the default everywhere; another task (the lab's Countdown) plugs into the tokenizer, the warm start and
the evaluation through an `alphabet`, an `example` generator and a `reward_fn`.

Command line: ``python -m exgrpo_trl.tasks.toy --out DIR [--warm-start-steps N]`` writes a model folder (model +
tokenizer, loadable with ``AutoModelForCausalLM`` and ``PreTrainedTokenizerFast``) and ``train.jsonl`` /
``eval.jsonl`` in DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..utils.threads import cpu_threads, default_cpu_threads

__all__ = [
    "SPECIAL_TOKENS",
    "ALPHABET",
    "build_char_tokenizer",
    "load_char_tokenizer",
    "build_tiny_model",
    "build_tiny_model_dir",
    "addition_dataset",
    "addition_splits",
    "addition_reward",
    "warm_start",
    "evaluate_pass_at_1",
]

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
ALPHABET = tuple("0123456789+=")


# --------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------
def build_char_tokenizer(
    save_dir: str | os.PathLike | None = None, *, alphabet: Iterable[str] = ALPHABET, vocab_size: int | None = None
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character of `alphabet` (``0-9 + =``), plus
    ``<pad> <eos> <bos> <unk>``.

    Ids: specials 0-3 in that order, then the alphabet in its order, so an alphabet that extends `ALPHABET` at the
    end keeps every addition id. No special token is added on encode; left padding.
    `vocab_size` grows the vocabulary to that many tokens with fillers ``<f0>``, ``<f1>``, ... after the alphabet
    (encoding never produces them; a model sampling them decodes to their names): the width of a real model's logits
    for benchmarks that measure what the vocabulary costs.
    The `Fuse` decoder makes ``batch_decode`` join characters without spaces (exact-match rewards need it).
    """
    alphabet = tuple(alphabet)
    if len(set(alphabet)) != len(alphabet) or any(len(ch) != 1 for ch in alphabet):
        raise ValueError(f"alphabet must be distinct single characters, got {alphabet}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(
                f"vocab_size must be at least {len(vocab)} (the specials and the alphabet), got {vocab_size}"
            )
        vocab.update({f"<f{i}>": len(vocab) + i for i in range(vocab_size - len(vocab))})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        padding_side="left",
        truncation_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def load_char_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Reload a tokenizer saved by `build_char_tokenizer`.

    Deliberately not `AutoTokenizer`: on a folder whose config says ``qwen2`` it returns Qwen's byte-level
    tokenizer instead of this one.
    """
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    return tokenizer


# --------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------
def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 64,
    num_key_value_heads: int | None = None,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM, float32, tied embeddings, about 1.05M parameters by default.

    Deterministic from `seed`; the caller's global torch RNG is left untouched.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}).")
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads or num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        **ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(**ids)
    return model


def build_tiny_model_dir(out_dir: str | os.PathLike, **kwargs) -> str:
    """Build the char tokenizer and a tiny model (`build_tiny_model` kwargs) and save both into `out_dir`."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, **kwargs)
    out_dir = str(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# --------------------------------------------------------------------------------------------------------------
# Task
# --------------------------------------------------------------------------------------------------------------
def _operand_range(digits: int) -> tuple[int, int]:
    """Inclusive range of non-negative integers written with exactly `digits` digits (0-9 for one digit)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def _digits_of_prompt(prompt: str) -> int | None:
    """The digit class of a prompt "a+b=", or None if it is not one (operands of different lengths, ...)."""
    if not prompt.endswith("=") or prompt.count("+") != 1:
        return None
    a, b = prompt[:-1].split("+")
    if not (a.isdigit() and b.isdigit()) or len(a) != len(b):
        return None
    if len(a) > 1 and (a[0] == "0" or b[0] == "0"):
        return None
    return len(a)


def _random_problem(rng: random.Random, digits: int) -> tuple[str, str]:
    lo, hi = _operand_range(digits)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return f"{a}+{b}=", str(a + b)


def addition_dataset(
    n: int,
    *,
    min_digits: int = 1,
    max_digits: int = 4,
    seed: int = 0,
    exclude: Iterable[str] | None = None,
) -> Dataset:
    """`n` unique addition questions: columns ``prompt`` ("37+48="), ``answer`` ("85"), ``digits`` (difficulty).

    Both operands of a question have the same number of digits, drawn uniformly from [min_digits, max_digits]
    for each question. Prompts in `exclude` are left out. A digit class whose questions are used up (there are
    only 100 one-digit questions) is dropped from the draw, and the remaining draws go to the other classes.
    """
    if min_digits < 1 or max_digits < min_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    rng = random.Random(seed)
    taken = set(exclude or ())
    capacity, used = {}, {}
    for d in range(min_digits, max_digits + 1):
        lo, hi = _operand_range(d)
        capacity[d] = (hi - lo + 1) ** 2
        used[d] = 0
    for prompt in taken:
        d = _digits_of_prompt(prompt)
        if d in used:
            used[d] += 1
    if n > sum(capacity[d] - used[d] for d in capacity):
        raise ValueError(f"cannot draw {n} unique questions with {min_digits}-{max_digits} digits")
    rows = {"prompt": [], "answer": [], "digits": []}
    for _ in range(n):
        open_classes = [d for d in capacity if used[d] < capacity[d]]
        d = rng.choice(open_classes)
        while True:  # terminates: class d has at least one free question
            prompt, answer = _random_problem(rng, d)
            if prompt not in taken:
                break
        taken.add(prompt)
        used[d] += 1
        rows["prompt"].append(prompt)
        rows["answer"].append(answer)
        rows["digits"].append(d)
    return Dataset.from_dict(rows)


def addition_splits(n_train: int, n_eval: int, *, seed: int = 0, **kwargs) -> tuple[Dataset, Dataset]:
    """A train set and a held-out eval set with no eval prompt in train (`addition_dataset` kwargs apply)."""
    eval_set = addition_dataset(n_eval, seed=2 * seed + 1, **kwargs)
    train_set = addition_dataset(n_train, seed=2 * seed, exclude=set(eval_set["prompt"]), **kwargs)
    return train_set, eval_set


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):  # conversational
        return str(completion[-1].get("content", ""))
    return str(completion)


def addition_reward(completions, answer, **kwargs) -> list[float]:
    """Binary verifier: 1.0 when the completion, stripped, equals the answer, else 0.0.

    TRL calls reward functions with every dataset column as a keyword argument; all but ``answer`` are ignored,
    except that when both ``digits`` and TRL's ``log_metric`` are passed, the accuracy of each difficulty
    present in the batch is logged as ``accuracy/digits_{d}``.
    """
    rewards = [
        1.0 if _completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer, strict=True)
    ]
    log_accuracy_by(kwargs.get("log_metric"), "digits", kwargs.get("digits"), rewards)
    return rewards


def log_accuracy_by(log_metric, name: str, groups, rewards: list[float]) -> None:
    """With TRL's `log_metric` and a column `groups` (a difficulty per row), log the mean reward of each group present
    as ``accuracy/{name}_{group}``; nothing without either."""
    if not callable(log_metric) or groups is None:
        return
    by_group = defaultdict(list)
    for g, r in zip(groups, rewards, strict=True):
        by_group[int(g)].append(r)
    for g in sorted(by_group):
        log_metric(f"accuracy/{name}_{g}", sum(by_group[g]) / len(by_group[g]))


# --------------------------------------------------------------------------------------------------------------
# Supervised warm start
# --------------------------------------------------------------------------------------------------------------
def _encode_chars(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    vocab = tokenizer.get_vocab()
    unk = tokenizer.unk_token_id
    return [vocab.get(ch, unk) for ch in text]


def _supervised_batch(
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    batch_size: int,
    min_digits: int,
    max_digits: int,
    example: Callable[[random.Random], tuple[str, str]] | None = None,
) -> dict[str, torch.Tensor]:
    """Left-padded ``prompt + answer + <eos>`` rows; labels only on answer tokens and <eos> (-100 elsewhere).

    Rows are addition problems with `min_digits`-`max_digits` digits, or ``example(rng)`` when given.
    """
    seqs, n_prompt = [], []
    for _ in range(batch_size):
        if example is None:
            prompt, answer = _random_problem(rng, rng.randint(min_digits, max_digits))
        else:
            prompt, answer = example(rng)
        p = _encode_chars(tokenizer, prompt)
        seqs.append(p + _encode_chars(tokenizer, answer) + [tokenizer.eos_token_id])
        n_prompt.append(len(p))
    width = max(len(s) for s in seqs)
    input_ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, n_prompt)):
        start = width - len(s)
        input_ids[i, start:] = torch.tensor(s)
        attention_mask[i, start:] = 1
        labels[i, start + n :] = torch.tensor(s[n:])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def warm_start(
    model,
    tokenizer: PreTrainedTokenizerFast,
    *,
    steps: int = 1000,
    batch_size: int = 128,
    lr: float = 2e-3,
    warmup: int = 100,
    seed: int = 0,
    min_digits: int = 1,
    max_digits: int = 4,
    progress: bool = True,
    example: Callable[[random.Random], tuple[str, str]] | None = None,
    threads: int | None = None,
) -> dict:
    """Supervised training on freshly generated addition problems (loss on answer tokens and <eos> only).

    On a CPU it runs on `threads` torch threads (default: OMP_NUM_THREADS, else 1; `utils.threads`), then restores
    the process's thread count: two threads on a busy 2-core machine are 5-17 times slower than one.

    `example`, when given, replaces addition: each row is ``example(rng)``, one ``(prompt, answer)`` drawn with `rng`
    only, and `min_digits` / `max_digits` are unused; the tokenizer must cover its characters.

    AdamW (weight decay 0.01), linear warm-up over `warmup` steps, then cosine decay from `lr` to `lr / 10`;
    gradient clip 1.0.
    Problems come from a private `random.Random(seed)`; the global RNGs are not used. Trains `model` in place
    and returns ``{"losses": [per-step loss], "seconds": float, "steps": int}``.

    Measured here (1 CPU thread, ~0.21 s/step; 2 threads on an idle machine ~0.12 s/step), seed 0, held-out
    sampled pass@1 at T=1.0 by digits: multi-digit sums are learned in a sharp phase transition. With 4 heads of
    32: 1000 steps .29 (.96/.16/.01/.00), 1200 steps .31 (.99/.24/.01/.00), 1500 steps .76 (.99/.85/.69/.53),
    2000 steps .87 (1.0/.95/.86/.66). With 2 heads of 64 the plateau lasts longer (2000 steps: .28, 2-digit .10).
    """
    rng = random.Random(seed)
    was_training = model.training
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 10% of lr
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    device = next(model.parameters()).device
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="warm start (supervised)", disable=not progress, unit="step", dynamic_ncols=True)
    on_cpu = contextlib.nullcontext() if device.type != "cpu" else cpu_threads(threads)
    try:
        with on_cpu:
            for _ in bar:
                batch = _supervised_batch(tokenizer, rng, batch_size, min_digits, max_digits, example)
                batch = {k: v.to(device) for k, v in batch.items()}
                loss = model(**batch).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                losses.append(loss.item())
                if len(losses) % 10 == 0:
                    bar.set_postfix(loss=f"{sum(losses[-10:]) / 10:.3f}")
    finally:
        bar.close()
        model.train(was_training)
    return {"losses": losses, "seconds": time.perf_counter() - start, "steps": steps}


# --------------------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate_pass_at_1(
    model,
    tokenizer: PreTrainedTokenizerFast,
    dataset,
    *,
    samples: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    seed: int = 0,
    progress: bool = True,
    reward_fn: Callable[..., list[float]] | None = None,
    difficulty_key: str = "digits",
    return_completions: bool = False,
) -> dict:
    """Sampled pass@1: for each question, the fraction of `samples` sampled completions that are correct.

    `dataset` needs ``prompt`` and ``answer`` columns (and ``digits`` for the per-difficulty split). Returns
    ``{"overall": mean over questions, "by_digits": {d: mean over questions with d digits},
    "per_question": [pass rate of each question, in dataset order]}``. Sampling is seeded (global torch RNG
    forked, so the caller's is untouched); `temperature` 0 means greedy. `batch_size` counts sequences.

    Other tasks: `reward_fn` (default `addition_reward`) is called TRL-style, ``reward_fn(completions, **columns)``
    with every column but ``prompt`` repeated per sample; `difficulty_key` names the column of the per-difficulty
    split, returned as ``"by_{difficulty_key}"``; `return_completions` adds ``"completions"``: each question's
    sampled texts.
    """
    reward_fn = addition_reward if reward_fn is None else reward_fn
    prompts = list(dataset["prompt"])
    columns = {c: list(dataset[c]) for c in dataset.column_names if c != "prompt"}
    digits = list(dataset[difficulty_key]) if difficulty_key in dataset.column_names else None
    questions_per_batch = max(1, batch_size // samples)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    per_question: list[float] = []
    completions: list[list[str]] = []
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    sample = temperature > 0
    gen_kwargs = dict(
        do_sample=sample,
        max_new_tokens=max_new_tokens,
        num_return_sequences=samples,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if sample:
        gen_kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            starts = range(0, len(prompts), questions_per_batch)
            for i in tqdm(starts, desc="evaluating pass@1", disable=not progress, unit="batch", dynamic_ncols=True):
                chunk = prompts[i : i + questions_per_batch]
                enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
                out = model.generate(**enc, **gen_kwargs)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                repeated = {
                    c: [v for v in vs[i : i + questions_per_batch] for _ in range(samples)]
                    for c, vs in columns.items()
                }
                rewards = reward_fn(texts, **repeated)
                for q in range(len(chunk)):
                    per_question.append(sum(rewards[q * samples : (q + 1) * samples]) / samples)
                    completions.append(texts[q * samples : (q + 1) * samples])
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    by_digits: dict[int, float] = {}
    if digits is not None:
        groups = defaultdict(list)
        for d, p in zip(digits, per_question):
            groups[int(d)].append(p)
        by_digits = {d: sum(v) / len(v) for d, v in sorted(groups.items())}
    overall = sum(per_question) / len(per_question) if per_question else math.nan
    result = {"overall": overall, f"by_{difficulty_key}": by_digits, "per_question": per_question}
    if return_completions:
        result["completions"] = completions
    return result


# --------------------------------------------------------------------------------------------------------------
# python -m exgrpo_trl.tasks.toy --out DIR
# --------------------------------------------------------------------------------------------------------------
def _write_jsonl(dataset: Dataset, path: Path) -> None:
    with open(path, "w") as f:
        for row in dataset:
            f.write(json.dumps(row) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m exgrpo_trl.tasks.toy",
        description="Write a tiny Qwen2 model + char tokenizer (optionally warm-started) and the toy addition "
        "task as train.jsonl / eval.jsonl into one folder.",
    )
    parser.add_argument("--out", required=True, help="output folder (model, tokenizer, train.jsonl, eval.jsonl)")
    parser.add_argument("--warm-start-steps", type=int, default=0, help="supervised warm-start steps (0: none)")
    parser.add_argument(
        "--num-heads", type=int, default=2, help="attention heads (hidden 128: 2 heads of 64, 4 of 32)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=default_cpu_threads(),
        help="CPU threads (default: OMP_NUM_THREADS, else 1: a second thread gains under 2x at this size, and slows "
        "the warm start down 5-17 times when another process is busy)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(max(1, args.threads))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, num_heads=args.num_heads, seed=args.seed)
    if args.warm_start_steps > 0:
        info = warm_start(model, tokenizer, steps=args.warm_start_steps, seed=args.seed, progress=not args.no_progress)
        print(f"warm start: {info['steps']} steps in {info['seconds']:.0f}s, final loss {info['losses'][-1]:.4f}")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    train, eval_ = addition_splits(args.n_train, args.n_eval, seed=args.seed)
    _write_jsonl(train, out / "train.jsonl")
    _write_jsonl(eval_, out / "eval.jsonl")
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {out}: model ({n_params:,} parameters), tokenizer, "
        f"train.jsonl ({len(train)}), eval.jsonl ({len(eval_)})"
    )
    held_out = evaluate_pass_at_1(model, tokenizer, eval_, samples=8, seed=args.seed, progress=False)
    mix = training_mix(train)
    batch = evaluate_pass_at_1(model, tokenizer, mix, samples=8, seed=args.seed, progress=False)
    print(f"held-out pass@1 {held_out['overall']:.3f} ({_by_digits(held_out)}; {len(eval_)} questions, balanced)")
    print(pass_at_1_line(batch))
    return 0


TRAINING_MIX_QUESTIONS = 256


def training_mix(train: Dataset, n: int = TRAINING_MIX_QUESTIONS) -> Dataset:
    """The first `n` questions of the training file: drawn in random order, so they hold its mix of difficulties
    (1-digit sums run out at 100, so a 2,000-question file leans to 3- and 4-digit sums). The delayed start reads
    the pass@1 of training batches, which are drawn from this mix, not from the balanced held-out set."""
    return train.select(range(min(n, len(train))))


def _by_digits(result: dict) -> str:
    return ", ".join(f"{d} digit{'s' if d > 1 else ''} {v:.2f}" for d, v in result["by_digits"].items())


def pass_at_1_line(result: dict, replay_start: float = 0.35) -> str:
    """What a model's pass@1 on the training mix (`training_mix`) means for a run of it: the delayed start switches
    replay on once a training batch's pass@1 is above `replay_start` (the paper's 0.35)."""
    overall = result["overall"]
    if overall > replay_start:
        then = f"above the paper's delayed start {replay_start}: with it, replay switches on within the first batches"
    else:
        then = (
            f"not above the paper's delayed start {replay_start}: with it, replay would wait (train the warm start "
            "longer, or replay from the first batch with replay_start_pass_rate: 0, as recipes/tiny_cpu.yaml does)"
        )
    return (
        f"training-mix pass@1 {overall:.3f} ({_by_digits(result)}; the first {len(result['per_question'])} questions "
        f"of train.jsonl, 8 samples each; what the delayed start reads): {then}"
    )


if __name__ == "__main__":
    sys.exit(main())
