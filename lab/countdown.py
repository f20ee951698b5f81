"""Countdown, a toy task with many correct outputs per question, in the style of the addition task (`toy`).

Given three or four numbers and a target, write an expression with ``+ - *`` and parentheses that uses each given
number at most once and equals the target::

    prompt "2,3,7:13="   completion "2*3+7"  (also "3*2+7", "7+2*3", "7+3*2", "(2*3)+7", ...)

This is the point of the task: ExGRPO keeps several correct trajectories of a question and replays the one with
the lowest entropy, so a question must have more than one correct completion for that choice to matter.

The numbers are 1-9 (one character each, drawn with replacement, sorted in the prompt), the target 10-99 and
never one of the numbers. Difficulty (column ``difficulty``) is the fewest numbers any solution needs: 2, 3 or 4,
a third of the questions each; ``operands`` is how many are given (3 or 4; difficulty 4 needs 4). An answer is
at most 11 characters ("(9-(2+3))*4"), so 16 completion tokens are enough. Measured on 2,000 generated
questions (`count_expressions`: distinct strings written with minimal parentheses, each operand order counted):
a question has 16.3 valid answers on average (median 12); 98.6% have at least 2, 86.4% at least 3. With three
numbers given: mean 3.9 (median 3; 96% >= 2); with four: mean 21.0 (median 16; 99.6% >= 2).
By difficulty 2/3/4: mean 17.4/16.2/15.5.

- `countdown_reward`: the verifier, a small recursive-descent parser (never `eval`), TRL reward-function shaped.
- `countdown_dataset` / `countdown_splits`: solvable questions, each with one valid ``answer`` and a difficulty;
  a fixed quarter of all questions (`is_held_out`) is kept out of the warm start and makes up eval sets.
- `countdown_warm_start`, `evaluate_countdown`, `distinct_correct`: the lab's cached supervised warm start
  (`lab.warm_start`) and `toy`'s sampled pass@1 evaluation with countdown's alphabet, examples and verifier.

Two calibrated warm starts (`COUNTDOWN_WARM_START`, measured figures there): "medium" (2,000 supervised steps,
held-out pass@1 about 0.40, .64/.37/.22 by difficulty) and "weak" (200 steps, about 0.09). Calibration:
``python -m lab.countdown --cache-dir DIR --steps N [N ...]``.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from datasets import Dataset

from exgrpo_trl.tasks.toy import ALPHABET, EOS, _completion_text, evaluate_pass_at_1, log_accuracy_by

from .warm_start import SupervisedTask, load_or_train_warm_start, warm_start_is_cached

__all__ = [
    "MAX_EXPRESSION_CHARS",
    "MAX_NESTING",
    "parse_expression",
    "countdown_reward",
    "random_expression",
    "solve",
    "min_numbers_needed",
    "count_expressions",
    "is_held_out",
    "countdown_example",
    "countdown_dataset",
    "countdown_splits",
    "countdown_pool_splits",
    "COUNTDOWN_ALPHABET",
    "COUNTDOWN_TASK",
    "COUNTDOWN_MODEL",
    "COUNTDOWN_MAX_COMPLETION",
    "COUNTDOWN_WARM_START",
    "countdown_warm_start",
    "countdown_warm_start_is_cached",
    "evaluate_countdown",
    "distinct_correct",
]

# Longer inputs are rejected before parsing, so a 10,000-character completion costs nothing. Every expression the
# task needs is at most 11 characters ("(9-(2+3))*4"); 64 leaves room for a verbose but valid answer.
MAX_EXPRESSION_CHARS = 64
# The deepest nesting a four-number answer needs is 2; the bound keeps the recursion shallow whatever the input.
MAX_NESTING = 8

NUMBER_RANGE = (1, 9)  # given numbers, drawn with replacement: one character each keeps completions short
TARGET_RANGE = (10, 99)  # the target; below 10 too many questions are one trivial step away


# --------------------------------------------------------------------------------------------------------------
# Verifier
# --------------------------------------------------------------------------------------------------------------
class _Reject(Exception):
    """Raised inside the parser for any input that is not a valid expression; never escapes `parse_expression`."""


class _Parser:
    """Recursive descent over the grammar (integers only, no unary minus, no division)::

    expr   := term (("+" | "-") term)*
    term   := factor ("*" factor)*
    factor := number | "(" expr ")"
    number := "0" | [1-9][0-9]*        (no leading zeros: "07" is not how a given 7 is written)
    """

    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self, depth: int) -> int:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.peek()
            self.pos += 1
            right = self.term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(self, depth: int) -> int:
        value = self.factor(depth)
        while self.peek() == "*":
            self.pos += 1
            value *= self.factor(depth)
        return value

    def factor(self, depth: int) -> int:
        ch = self.peek()
        if ch == "(":
            if depth >= MAX_NESTING:
                raise _Reject("nested too deeply")
            self.pos += 1
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise _Reject("unbalanced parentheses")
            self.pos += 1
            return value
        start = self.pos
        # not str.isdigit: that accepts other scripts' digits ("٣") and superscripts ("²"); "" < "0" ends the loop
        while "0" <= self.peek() <= "9":
            self.pos += 1
        digits = self.text[start : self.pos]
        if not digits:
            raise _Reject(f"expected a number or '(' at {start}")
        if len(digits) > 1 and digits[0] == "0":
            raise _Reject("leading zero")
        self.numbers.append(int(digits))
        return self.numbers[-1]


def parse_expression(text: str) -> tuple[int, list[int]] | None:
    """``(value, numbers used in order)`` of an expression over ``0-9 + - * ( )``, or None if it is not one.

    No whitespace inside, no unary minus, no division; at most `MAX_EXPRESSION_CHARS` characters (checked first)
    and `MAX_NESTING` levels of parentheses. Never raises.
    """
    if not isinstance(text, str) or not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    parser = _Parser(text)
    try:
        value = parser.expr(0)
    except _Reject:
        return None
    if parser.pos != len(text):  # trailing input: ")" without "(", a stray character, "3 4", ...
        return None
    return value, parser.numbers


def _parse_numbers(numbers) -> list[int] | None:
    """The given numbers from a dataset cell: a list of ints, or a string "3,7,2" (or a prompt "3,7,2:12=")."""
    try:
        if isinstance(numbers, str):
            numbers = numbers.split(":")[0].split(",")
        return [int(n) for n in numbers]
    except (TypeError, ValueError):
        return None


def _score(completion, numbers, target) -> float:
    text = _completion_text(completion)
    # TRL decodes with skip_special_tokens, but a caller that does not would leave "<eos>" and padding after it.
    text = text.split(EOS, 1)[0].strip()
    parsed = parse_expression(text)
    given = _parse_numbers(numbers)
    try:
        target = int(target)
    except (TypeError, ValueError):
        return 0.0
    if parsed is None or given is None:
        return 0.0
    value, used = parsed
    if Counter(used) - Counter(given):  # a number not given, or used more often than given
        return 0.0
    return 1.0 if value == target else 0.0


def countdown_reward(completions, numbers, target, **kwargs) -> list[float]:
    """Binary verifier: 1.0 when a completion is an expression that uses only given numbers and equals the target.

    Rules (`parse_expression`): the completion, stripped of surrounding whitespace and cut at the first
    ``<eos>`` text, must parse completely as integers joined by ``+ - *`` with balanced parentheses (no division,
    no unary minus, no whitespace or other character inside, no leading zeros, at most 64 characters and 8
    levels of nesting); every number in it must be a given number, each used at most as often as it is given
    (a multiset: "3,3,5" allows two 3s); its value must equal the target. Not every given number has to be used.
    Never raises on any completion (garbage, unicode, huge input all score 0.0); columns of different lengths are
    a caller's bug and do raise.

    `numbers` cells are lists of ints or strings like "3,7,2". Other dataset columns are ignored, except that
    when both ``difficulty`` and TRL's ``log_metric`` are passed, the accuracy of each difficulty present in the
    batch is logged as ``accuracy/difficulty_{d}``.
    """
    rewards = [_score(c, n, t) for c, n, t in zip(completions, numbers, target, strict=True)]
    log_accuracy_by(kwargs.get("log_metric"), "difficulty", kwargs.get("difficulty"), rewards)
    return rewards


# --------------------------------------------------------------------------------------------------------------
# Expressions and an exhaustive solver
# --------------------------------------------------------------------------------------------------------------
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_ATOM = 3  # a number or a parenthesised expression


def _join(op: str, left: str, left_prec: int, right: str, right_prec: int) -> str:
    """``left op right`` with only the parentheses the value needs (a-(b-c) keeps them, a+(b-c) drops them)."""
    prec = _PRECEDENCE[op]
    if left_prec < prec:
        left = f"({left})"
    if right_prec < prec or (right_prec == prec and op == "-"):
        right = f"({right})"
    return f"{left}{op}{right}"


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def random_expression(rng: random.Random, numbers: list[int]) -> str:
    """A random expression over all of `numbers`, in the given order: random tree shape, random operators."""

    def build(items: list[int]) -> tuple[str, int]:
        if len(items) == 1:
            return str(items[0]), _ATOM
        cut = rng.randint(1, len(items) - 1)
        op = rng.choice("+-*")
        left, left_prec = build(items[:cut])
        right, right_prec = build(items[cut:])
        return _join(op, left, left_prec, right, right_prec), _PRECEDENCE[op]

    return build(list(numbers))[0]


def _submasks(mask: int):
    """Every (a, b) with a | b == mask, a & b == 0, both non-empty (ordered: (a, b) and (b, a) both appear)."""
    a = (mask - 1) & mask
    while a:
        yield a, mask ^ a
        a = (a - 1) & mask


def solve(numbers: list[int]) -> dict[int, set[int]]:
    """``{k: every value some expression over exactly k of the given numbers reaches}``, for k = 1..len(numbers).

    Dynamic programming over subsets of positions (4 numbers: 15 subsets), values only, so it is cheap enough to
    run for every generated question.
    """
    values: dict[int, set[int]] = {1 << i: {n} for i, n in enumerate(numbers)}
    for mask in range(1, 1 << len(numbers)):
        if mask in values:
            continue
        values[mask] = {
            _apply(op, a, b) for x, y in _submasks(mask) for a in values[x] for b in values[y] for op in "+-*"
        }
    by_size: dict[int, set[int]] = defaultdict(set)
    for mask, vals in values.items():
        by_size[mask.bit_count()] |= vals
    return dict(sorted(by_size.items()))


def min_numbers_needed(numbers: list[int], target: int) -> int | None:
    """The fewest given numbers any expression equal to `target` uses (None: unsolvable). The task's difficulty."""
    for k, vals in solve(numbers).items():
        if target in vals:
            return k
    return None


def count_expressions(numbers: list[int], target: int) -> int:
    """How many distinct strings, written with minimal parentheses, are valid answers (each operand order counts).

    Exhaustive over every subset of the numbers and every tree: for measuring the task, not for training.
    """
    exprs: dict[int, dict[str, tuple[int, int]]] = {1 << i: {str(n): (n, _ATOM)} for i, n in enumerate(numbers)}
    for mask in range(1, 1 << len(numbers)):
        if mask in exprs:
            continue
        found: dict[str, tuple[int, int]] = {}
        for x, y in _submasks(mask):
            for ls, (lv, lp) in exprs[x].items():
                for rs, (rv, rp) in exprs[y].items():
                    for op in "+-*":
                        found[_join(op, ls, lp, rs, rp)] = (_apply(op, lv, rv), _PRECEDENCE[op])
        exprs[mask] = found
    # repeated numbers ("3,3,5") give the same string from different positions: count strings, not trees
    return len({s for found in exprs.values() for s, (v, _) in found.items() if v == target})


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------
def _prompt(numbers: list[int], target: int) -> str:
    return ",".join(map(str, numbers)) + f":{target}="


def is_held_out(prompt: str) -> bool:
    """Whether a question belongs to the quarter of all questions kept for evaluation (a fixed hash of the prompt).

    There are only 21,735 distinct questions (measured) and a warm start draws 128 per step, so it would see
    nearly every question many times over; it never draws one of these, so their pass@1 is held-out pass@1.
    """
    return zlib.crc32(prompt.encode()) % 4 == 0


def _random_question(
    rng: random.Random, operands: tuple[int, ...], held_out: bool | None
) -> tuple[list[int], int, str, int, int]:
    """(sorted numbers, target, an expression reaching it, operands, difficulty) of one random question.

    The difficulty (`min_numbers_needed`) is drawn first, uniformly from 2..max(operands), then the number of
    operands uniformly among those >= it: left to chance, half the questions would need only two numbers and 7%
    all four. The target is the value of a random expression over a random subset of at least `difficulty` of
    the numbers, so every question is solvable and the expression proves it; draws whose value is outside
    `TARGET_RANGE`, is one of the numbers, or is reachable with fewer numbers are redrawn whole (numbers too:
    "1,1,2" reaches nothing above 9), and so are questions on the wrong side of `is_held_out` (None: either).
    """
    lo, hi = NUMBER_RANGE
    difficulty = rng.randint(2, max(operands))
    k = rng.choice([o for o in operands if o >= difficulty])
    while True:
        numbers = sorted(rng.randint(lo, hi) for _ in range(k))
        chosen = rng.sample(numbers, rng.randint(difficulty, k))  # a random subset in a random order
        expression = random_expression(rng, chosen)
        target = parse_expression(expression)[0]
        if not TARGET_RANGE[0] <= target <= TARGET_RANGE[1] or target in numbers:
            continue
        if held_out is not None and is_held_out(_prompt(numbers, target)) != held_out:
            continue
        if min_numbers_needed(numbers, target) == difficulty:
            return numbers, target, expression, k, difficulty


def countdown_example(rng: random.Random, operands: Iterable[int] = (3, 4)) -> tuple[str, str]:
    """One supervised example ``(prompt, answer)``: a random question that is not held out, and the random
    expression it was made from (so the answers to one question vary from draw to draw)."""
    numbers, target, expression, _, _ = _random_question(rng, tuple(operands), held_out=False)
    return _prompt(numbers, target), expression


def countdown_dataset(
    n: int,
    *,
    seed: int = 0,
    operands: Iterable[int] = (3, 4),
    held_out: bool | None = None,
    exclude: Iterable[str] | None = None,
) -> Dataset:
    """`n` unique solvable questions; only held-out ones (`is_held_out`) if `held_out`, none if False, either if
    None; prompts in `exclude` are left out.

    Columns: ``prompt`` ("2,3,7:13="), ``numbers`` ([2, 3, 7], sorted), ``target`` (13), ``operands`` (how many
    numbers are given), ``difficulty`` (`min_numbers_needed`: 2, 3 or 4, about a third each; see
    `_random_question`) and ``answer`` (one valid expression, the one the target was made from).
    There are 21,735 questions, 5,397 of them held out, but only 505 with three numbers and difficulty 2 (116 held
    out): once the questions of one (operands, difficulty) kind are used up, the other kinds fill in for it;
    ValueError when (nearly) all are used up.
    """
    operands = tuple(operands)
    if not operands or min(operands) < 2:
        raise ValueError(f"operands must be >= 2, got {operands}")
    rng = random.Random(seed)
    taken = set(exclude or ())
    rows = {key: [] for key in ("prompt", "numbers", "target", "operands", "difficulty", "answer")}
    misses = 0
    while len(rows["prompt"]) < n:
        numbers, target, expression, k, difficulty = _random_question(rng, operands, held_out)
        prompt = _prompt(numbers, target)
        if prompt in taken:
            misses += 1
            # a draw of a used-up kind misses and the next draw tries again, so the other kinds fill in for it;
            # only when (nearly) every kind is used up do misses run on this long
            if misses > 2000:
                raise ValueError(f"cannot draw {n} unique questions with operands {operands}")
            continue
        misses = 0
        taken.add(prompt)
        for key, value in zip(rows, (prompt, numbers, target, k, difficulty, expression)):
            rows[key].append(value)
    return Dataset.from_dict(rows)


def countdown_splits(n_train: int, n_eval: int, *, seed: int = 0, **kwargs) -> tuple[Dataset, Dataset]:
    """A train set of questions the warm start may have seen, and an eval set of held-out ones (`is_held_out`);
    `countdown_dataset` kwargs apply."""
    eval_set = countdown_dataset(n_eval, seed=2 * seed + 1, held_out=True, **kwargs)
    train_set = countdown_dataset(n_train, seed=2 * seed, held_out=False, **kwargs)
    return train_set, eval_set


# Questions drawn for the whole-pool splits: 16,000 of the 16,338 outside the held-out quarter (the draw slows down
# sharply as the last kinds run out: 16,300 fails), and 5,000 of the 5,397 held-out ones.
POOL_TRAIN_QUESTIONS = 16000
POOL_HELD_OUT_QUESTIONS = 5000


def countdown_pool_splits(n_train: int, n_eval: int, *, cache_dir=None, seed: int = 0) -> tuple[Dataset, Dataset]:
    """A train set of up to nearly every question outside the held-out quarter, and an eval set with the same mix.

    Drawn to exhaustion, the questions are no longer a third of each difficulty: the three-number and two-number
    kinds run out first, so the whole pool is mostly four-number questions (16,000 questions: 44% need all four
    numbers, 36% three, 12% two with four given, 8% three numbers given) and hard for a small model. The eval set is
    `n_eval` questions drawn at random from held-out questions drawn as deep into their pool (5,000 of 5,397 for
    16,000 train questions), which have the same mix (44.7%, 36.2%, 11.2%, 7.9%). Both are written to `cache_dir`
    (when given) as JSON Lines and read back from there: drawing them takes one to two minutes.
    """
    if n_train > POOL_TRAIN_QUESTIONS or n_eval > POOL_HELD_OUT_QUESTIONS:
        raise ValueError(
            f"countdown_pool_splits: at most {POOL_TRAIN_QUESTIONS} train and {POOL_HELD_OUT_QUESTIONS} eval questions"
        )
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"countdown-pool-{n_train}-{n_eval}-seed{seed}"
        if (path / "train.jsonl").is_file() and (path / "eval.jsonl").is_file():
            return Dataset.from_json(str(path / "train.jsonl")), Dataset.from_json(str(path / "eval.jsonl"))
    train_set = countdown_dataset(n_train, seed=2 * seed, held_out=False)
    # held-out questions drawn as deep into their pool as the train set into its own, so the kinds run out alike
    depth = max(n_eval, round(n_train * POOL_HELD_OUT_QUESTIONS / POOL_TRAIN_QUESTIONS))
    held_out = countdown_dataset(depth, seed=2 * seed + 1, held_out=True)
    eval_set = held_out.select(sorted(random.Random(seed).sample(range(len(held_out)), n_eval)))
    if path is not None:
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        train_set.to_json(str(tmp / "train.jsonl"))
        eval_set.to_json(str(tmp / "eval.jsonl"))
        try:
            os.replace(tmp, path)
        except OSError:  # another process wrote it first: same seed, same questions
            shutil.rmtree(tmp, ignore_errors=True)
    return train_set, eval_set


# --------------------------------------------------------------------------------------------------------------
# Tokenizer, warm start, evaluation (the addition task's machinery in `toy` and `lab.warm_start`, with countdown's
# pieces)
# --------------------------------------------------------------------------------------------------------------
# Appended after addition's alphabet, so "0-9 + =" keep their addition ids: 22 tokens with the four specials.
COUNTDOWN_ALPHABET = ALPHABET + tuple("-*(),:")
# Bump the name whenever the questions, answers or alphabet change: it keys the warm-start cache.
COUNTDOWN_TASK = SupervisedTask(name="countdown-v1", alphabet=COUNTDOWN_ALPHABET, example=countdown_example)
# The toy model of the addition task (lab/study/tasks.py TOY_MODEL): ~1.05M parameters, four heads of 32.
COUNTDOWN_MODEL = dict(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=512)
# The longest answer the task needs is 11 characters, plus <eos>; 16 leaves some room.
COUNTDOWN_MAX_COMPLETION = 16


# The two calibrated starts, in supervised steps (seed 0; `load_or_train_warm_start`'s defaults: batch 128, lr 2e-3,
# 100 warm-up steps; model `COUNTDOWN_MODEL`); how they were measured: docs/study.md, "Countdown's warm starts".
COUNTDOWN_WARM_START = {"medium": 2000, "weak": 200}


def countdown_warm_start(cache_dir, start: str | int = "medium", *, seed: int = 0, progress: bool = True, **kwargs):
    """A (model, tokenizer) warm-started on countdown, trained once and then loaded from `cache_dir`.

    `start` names a calibrated start in `COUNTDOWN_WARM_START` ("medium", "weak") or gives the number of supervised
    steps. `lab.warm_start.load_or_train_warm_start` with `COUNTDOWN_TASK` and `COUNTDOWN_MODEL`; `kwargs` override its
    settings (batch_size, lr, model shape, ...).
    """
    steps = COUNTDOWN_WARM_START[start] if isinstance(start, str) else int(start)
    kwargs = {**COUNTDOWN_MODEL, **kwargs}
    return load_or_train_warm_start(
        cache_dir, steps=steps, seed=seed, progress=progress, task=COUNTDOWN_TASK, **kwargs
    )


def countdown_warm_start_is_cached(cache_dir, start: str | int = "medium", *, seed: int = 0, **kwargs) -> bool:
    """Whether `countdown_warm_start` with the same arguments would load without training."""
    steps = COUNTDOWN_WARM_START[start] if isinstance(start, str) else int(start)
    kwargs = {**COUNTDOWN_MODEL, **kwargs}
    return warm_start_is_cached(cache_dir, steps=steps, seed=seed, task=COUNTDOWN_TASK, **kwargs)


def evaluate_countdown(model, tokenizer, dataset, **kwargs) -> dict:
    """Sampled pass@1 on countdown questions: `toy.evaluate_pass_at_1` with `countdown_reward`.

    Returns its ``overall``, ``per_question``, ``by_difficulty`` and ``completions`` (each question's sampled
    texts), plus ``by_operands``. `kwargs` go to `evaluate_pass_at_1` (samples, temperature, seed, ...).
    """
    kwargs = {"max_new_tokens": COUNTDOWN_MAX_COMPLETION, **kwargs}
    result = evaluate_pass_at_1(
        model,
        tokenizer,
        dataset,
        reward_fn=countdown_reward,
        difficulty_key="difficulty",
        return_completions=True,
        **kwargs,
    )
    groups = defaultdict(list)
    for k, p in zip(dataset["operands"], result["per_question"]):
        groups[int(k)].append(p)
    result["by_operands"] = {k: sum(v) / len(v) for k, v in sorted(groups.items())}
    return result


def distinct_correct(dataset, completions: list[list[str]], *, min_correct: int = 2, max_correct: int = 7):
    """Mean number of distinct correct completions per question, over questions with `min_correct` to
    `max_correct` correct samples; returns ``(mean, number of such questions)`` (``(nan, 0)`` if none).

    What ExGRPO's trajectory selection can choose among: a question that is always solved or never solved is not
    replayed, and for one solved several times the lowest-entropy correct trajectory is picked.
    """
    counts = []
    for numbers, target, texts in zip(dataset["numbers"], dataset["target"], completions):
        rewards = countdown_reward(texts, [numbers] * len(texts), [target] * len(texts))
        correct = [t.strip() for t, r in zip(texts, rewards) if r == 1.0]
        if min_correct <= len(correct) <= max_correct:
            counts.append(len(set(correct)))
    return (sum(counts) / len(counts) if counts else float("nan")), len(counts)


# --------------------------------------------------------------------------------------------------------------
def never_solved_shares(model, tokenizer, dataset, *, samples: int, seed: int, within=(8, 16)) -> dict:
    """How hard `dataset` is for `model`: sampled pass@1, and the share of questions none of the first n samples
    solved, for each n of `within` and for all `samples` (what a GRPO run drawing each question a few times, K rollouts
    a draw, would leave unsolved if the model did not learn)."""
    result = evaluate_countdown(model, tokenizer, dataset, samples=samples, seed=seed, progress=False)
    solved = [
        countdown_reward(texts, [row["numbers"]] * len(texts), [row["target"]] * len(texts))
        for row, texts in zip(dataset, result["completions"])
    ]
    shares = {n: sum(1 for r in solved if not any(r[:n])) / len(solved) for n in (*within, samples)}
    return {"pass_at_1": result["overall"], "never_solved_within": shares}


# python -m lab.countdown --cache-dir DIR --steps N [N ...]: the calibration of the warm starts
# --------------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import time

    import torch

    parser = argparse.ArgumentParser(
        prog="python -m lab.countdown",
        description="Warm-start countdown models (cached) and print held-out sampled pass@1, one JSON line each.",
    )
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--steps", type=int, nargs="+", required=True, help="supervised warm-start steps")
    parser.add_argument("--seed", type=int, default=0, help="warm-start seed")
    parser.add_argument("--eval-questions", type=int, default=240)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--pool-probe",
        type=int,
        default=0,
        metavar="N",
        help="instead: N random questions of the study's 16,000-question training pool (seed 100), --samples each, "
        "and the share none of the first 8, 16 and all samples solved (how the hard point's start was chosen)",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    if args.pool_probe:
        pool = countdown_pool_splits(POOL_TRAIN_QUESTIONS, 1000, cache_dir=args.cache_dir, seed=0)[0]
        probe = pool.select(sorted(random.Random(100).sample(range(len(pool)), args.pool_probe)))
        for steps in args.steps:
            model, tokenizer = countdown_warm_start(args.cache_dir, steps, seed=args.seed, progress=False)
            found = never_solved_shares(model, tokenizer, probe, samples=args.samples, seed=100)
            shares = {str(n): round(v, 4) for n, v in found["never_solved_within"].items()}
            line = {"steps": steps, "pass_at_1": round(found["pass_at_1"], 4), "never_solved_within": shares}
            print(json.dumps(line), flush=True)
        return 0
    eval_set = countdown_splits(0, args.eval_questions, seed=0)[1]
    for steps in args.steps:
        model, tokenizer = countdown_warm_start(args.cache_dir, steps, seed=args.seed, progress=not args.no_progress)
        meta = json.loads((Path(model.warm_start_path) / "warm_start.json").read_text())
        start = time.perf_counter()
        res = evaluate_countdown(model, tokenizer, eval_set, samples=args.samples, progress=not args.no_progress)
        mean, n = distinct_correct(eval_set, res["completions"])
        line = {
            "steps": steps,
            "seed": args.seed,
            "warm_start_s": round(meta["seconds"], 1),
            "final_loss": meta["final_loss"],
            "eval_s": round(time.perf_counter() - start, 1),
            "pass_at_1": round(res["overall"], 4),
            "by_difficulty": {d: round(v, 4) for d, v in res["by_difficulty"].items()},
            "by_operands": {k: round(v, 4) for k, v in res["by_operands"].items()},
            "distinct_correct_2_7": [round(mean, 3), n],
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
