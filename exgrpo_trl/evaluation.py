r"""`exgrpo eval`: the paper's benchmarks (SPEC §9), avg@k, and a table laid out like SPEC §10.

    exgrpo eval --model PATH_OR_HUB_ID \
        --benchmarks aime24,aime25,amc,math500,minerva,olympiad,arc_c,gpqa_diamond,mmlu_pro

writes ``results.json``, ``results.md`` (the paper's rows beside this model's) and ``completions.jsonl`` into
``--output-dir`` and prints the table.

Benchmarks (`BENCHMARKS`; Hub id, config, split, columns). Schemas are those of the datasets' cards on the Hub:

    name          Hub id (config) / split                     columns read                                   default k
    aime24        HuggingFaceH4/aime_2024 / train             problem, answer (str), id                      32
    aime25        MathArena/aime_2025 / train                 problem, answer, problem_idx                   32
    amc           AI-MO/aimo-validation-amc / train           problem, answer (float64), id                  32
    math500       HuggingFaceH4/MATH-500 / test               problem, answer (str), unique_id               1
    minerva       lkevinzc/math-eval / minerva                problem, answer (list of str)                  1
    olympiad      lkevinzc/math-eval / olympiad_bench         problem, answer (list of str)                  1
    arc_c         allenai/ai2_arc (ARC-Challenge) / test      question, choices {text, label}, answerKey, id 1
    gpqa_diamond  Idavidrein/gpqa (gpqa_diamond) / train      Question, Correct Answer, Incorrect Answer 1-3 1
    mmlu_pro      TIGER-Lab/MMLU-Pro / test                   question, options, answer, answer_index,       1
                                                              question_id

(GPQA is gated on the Hub: accept its terms and log in.) AMC, Minerva and OlympiadBench are the sets used in the
Dr.GRPO/LUFFY line of work (83, 272 and 675 problems); ``lkevinzc/math-eval`` is the evaluation set that Dr.GRPO's
oat-based training scripts load (its ``answer`` is a list of accepted answers: any one counts). The exact files the
paper evaluated on were not checked against these (LUFFY's own evaluation reads a local parquet).
Any benchmark can instead be read from a local file of the same schema (``--data NAME=PATH`` or
``--data-dir``), and a name outside the registry with ``--data NAME=PATH`` adds a math benchmark read like training
data (`data.to_math_prompts`: a ``prompt`` column as is, else ``question``/``problem``; ``answer``).

Prompts: the training format (`data.luffy_messages`: LUFFY's system prompt + the question as the user turn, rendered
with the tokenizer's chat template and the generation prompt, as TRL renders training prompts). Multiple-choice
questions list their options after the question as ``A. text`` lines (ARC keeps its order and re-letters numeric
labels ``1-4`` as ``A-D``; GPQA's four answers are shuffled with a fixed per-question seed, the SHA-256 of the
question, so that every run and machine sees the same order; MMLU-Pro keeps its order, up to ten options A-J).
LUFFY's system prompt already asks for the final answer in ``\boxed{}``. A tokenizer without a chat template (the
tiny test tokenizer) gets the messages' contents joined by blank lines.

Which text is graded: the text after the last ``</think>`` when there is one; without ``</think>`` the whole
completion (evaluated models need not emit it: base and instruct baselines do not), unless ``--require-think-end``,
which grades like the training reward (`rewards.MathVerifier`: no ``</think>``, score 0).

Math grading (`grade_math`): if that text holds a complete ``\boxed{...}`` (or ``\fbox{...}``), only the LAST one is
the answer; without any, math-verify's own extraction runs on the whole text ("the answer is 5"). The answer is
compared with each accepted reference answer by `rewards.MathVerifier` (math-verify, reference parsed as
``$answer$``, bounded time, every failure 0). Taking the last box ourselves differs from math-verify on its own, which
reads ``\boxed{1} and \boxed{2}`` as the set {1, 2}: the paper's evaluation grades one final answer.

Letter grading (`extract_choice`, `grade_choice`) on the same text, first rule that gives a valid letter wins:

1. the LAST ``\boxed{...}``, if it names an option: ``C``, ``(C)``, ``C.``, ``\text{C}``, ``C) text``, or exactly the
   text of one option (``\boxed{Paris}``). A last box that names none (``\boxed{42}``, ``\boxed{A, C}``) falls
   through to rule 2; earlier boxes are not consulted.
2. the LAST answer statement: ``answer`` / ``final answer`` / ``correct|best|right option|choice|answer``, then
   optionally ``is``, ``:``, ``=``, ``would/should/must/will be``, then the letter, possibly in ``(..)``, ``[..]``,
   ``**..**`` or ``$..$`` (``Answer: C``, ``The correct answer is (B).``, ``final answer: **D**``).
3. the LAST parenthesised letter ``(C)`` anywhere.
4. the last non-empty line is just a letter (``C``, ``**C**``, ``(C).``) or starts with one (``C) 42``, ``C. 42``).

Letters are capitals within the question's options (A-D for four options): a bare capital in prose is never read
("A cat ...", "I think ..."), a letter past the last option does not count, and no rule means unparsable (score 0).
So with several answers the last box wins over everything, then the last answer statement.

Scores: each completion scores 0 or 1; avg@k = mean over k samples of a question, then mean over questions, in %.
pass@1 is avg@k with k = 1 (the default for every benchmark but AIME24, AIME25 and AMC). Samples, temperature
(0.6), top-p (1.0) and max new tokens (8192) are set per benchmark on the command line (``--samples 4`` or
``--samples aime24=32,math500=4``).

Generation: vLLM when it is importable and a GPU is present (``--backend auto``), else transformers ``generate``
(batched, left-padded, seeded, with a progress bar). Sampling overrides the model's own generation config (top-k
off, no repetition penalty), so that every backend samples the same distribution. The vLLM path is tested only
against PyPI's CPU build of vLLM (in ``.venv-vllm``: greedy completions equal the transformers path's), never on a GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .data import LUFFY_SYSTEM_PROMPT, load_raw_dataset, luffy_messages, to_math_prompts
from .rewards import MathVerifier, answer_section, completion_text

__all__ = [
    "Benchmark",
    "BENCHMARKS",
    "PAPER_RESULTS",
    "PAPER_REPORTED_AVERAGES",
    "EvalQuestion",
    "LoadedBenchmark",
    "Completion",
    "Grade",
    "last_boxed",
    "final_answer_text",
    "normalize_reference",
    "grade_math",
    "extract_choice",
    "grade_choice",
    "grade",
    "avg_at_k",
    "load_benchmark",
    "parse_benchmark_spec",
    "render_prompt",
    "TransformersGenerator",
    "VLLMGenerator",
    "vllm_available",
    "evaluate_benchmark",
    "summarize",
    "markdown_table",
    "main",
]

logger = logging.getLogger(__name__)

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_NEW_TOKENS = 8192
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


# ----------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark lives on the Hub, which columns hold what, and how it is graded.

    `kind` is ``"math"`` (math-verify on `answer_column`) or ``"choice"`` (letter grading); `choice_format` says how
    a choice row lists its options (``"arc"``, ``"gpqa"``, ``"mmlu_pro"``). `samples` is the SPEC §9 default k.
    """

    name: str
    title: str
    hub_id: str
    split: str
    kind: str
    question_column: str
    answer_column: str | None = None
    config: str | None = None
    id_column: str | None = None
    choice_format: str | None = None
    samples: int = 1
    in_distribution: bool = True
    size: int | None = None
    card: str = ""


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "AIME24", "HuggingFaceH4/aime_2024", "train", "math", "problem", "answer",
                  id_column="id", samples=32, size=30,
                  card="https://huggingface.co/datasets/HuggingFaceH4/aime_2024"),
        Benchmark("aime25", "AIME25", "MathArena/aime_2025", "train", "math", "problem", "answer",
                  id_column="problem_idx", samples=32, size=30,
                  card="https://huggingface.co/datasets/MathArena/aime_2025"),
        Benchmark("amc", "AMC", "AI-MO/aimo-validation-amc", "train", "math", "problem", "answer",
                  id_column="id", samples=32, size=83,
                  card="https://huggingface.co/datasets/AI-MO/aimo-validation-amc"),
        Benchmark("math500", "MATH-500", "HuggingFaceH4/MATH-500", "test", "math", "problem", "answer",
                  id_column="unique_id", size=500, card="https://huggingface.co/datasets/HuggingFaceH4/MATH-500"),
        Benchmark("minerva", "Minerva", "lkevinzc/math-eval", "minerva", "math", "problem", "answer",
                  size=272, card="https://huggingface.co/datasets/lkevinzc/math-eval"),
        Benchmark("olympiad", "Olympiad", "lkevinzc/math-eval", "olympiad_bench", "math", "problem", "answer",
                  size=675, card="https://huggingface.co/datasets/lkevinzc/math-eval"),
        Benchmark("arc_c", "ARC-c", "allenai/ai2_arc", "test", "choice", "question", "answerKey",
                  config="ARC-Challenge", id_column="id", choice_format="arc", in_distribution=False, size=1172,
                  card="https://huggingface.co/datasets/allenai/ai2_arc"),
        Benchmark("gpqa_diamond", "GPQA-D", "Idavidrein/gpqa", "train", "choice", "Question", "Correct Answer",
                  config="gpqa_diamond", choice_format="gpqa", in_distribution=False, size=198,
                  card="https://huggingface.co/datasets/Idavidrein/gpqa (gated: accept its terms, then log in)"),
        Benchmark("mmlu_pro", "MMLU-Pro", "TIGER-Lab/MMLU-Pro", "test", "choice", "question", "answer",
                  id_column="question_id", choice_format="mmlu_pro", in_distribution=False, size=12032,
                  card="https://huggingface.co/datasets/TIGER-Lab/MMLU-Pro"),
    )
}
IN_DISTRIBUTION = tuple(n for n, b in BENCHMARKS.items() if b.in_distribution)
OUT_OF_DISTRIBUTION = tuple(n for n, b in BENCHMARKS.items() if not b.in_distribution)

# SPEC §10: Qwen2.5-Math-7B, in %.
PAPER_BACKBONE = "Qwen2.5-Math-7B"
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "On-policy (Dr.GRPO)": {
        "aime24": 24.9, "aime25": 15.5, "amc": 59.2, "math500": 84.8, "minerva": 38.2, "olympiad": 49.3,
        "arc_c": 82.6, "gpqa_diamond": 37.4, "mmlu_pro": 49.2,
    },
    "ExGRPO": {
        "aime24": 31.6, "aime25": 18.7, "amc": 66.3, "math500": 87.4, "minerva": 36.0, "olympiad": 50.1,
        "arc_c": 84.7, "gpqa_diamond": 37.4, "mmlu_pro": 52.9,
    },
}
PAPER_REPORTED_AVERAGES: dict[str, dict[str, float]] = {
    "On-policy (Dr.GRPO)": {"in_distribution": 45.3, "out_of_distribution": 56.4},
    "ExGRPO": {"in_distribution": 48.3, "out_of_distribution": 58.3},
}


# ----------------------------------------------------------------------------------------------------------------
# Grading
# ----------------------------------------------------------------------------------------------------------------
class Grade(NamedTuple):
    """One completion's score (0.0 / 1.0) and the answer read from it (None: nothing found)."""

    score: float
    extracted: str | None


_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    r"""The content of the last complete ``\boxed{...}`` / ``\fbox{...}`` (nested braces matched), or None.

    A box left open (a truncated completion) is skipped, and the last complete one before it is returned.
    """
    if not isinstance(text, str):
        return None
    for match in reversed(list(_BOX_START.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def final_answer_text(completion: Any, require_think_end: bool = False) -> str | None:
    """The text that is graded: after the last ``</think>``; without one, the whole completion, or None when
    `require_think_end` (the training reward's rule)."""
    text = completion_text(completion)
    section = answer_section(text)
    if section is None:
        return None if require_think_end else text
    return section


def normalize_reference(value: Any) -> list[str]:
    """Reference answer(s) as a list of strings: a list gives alternatives, an integral float its integer
    (AMC stores 27.0 for 27), None or blanks nothing."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in normalize_reference(v)]
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return [str(int(value))]
        return [repr(value)]
    text = str(value).strip()
    return [text] if text else []


_EVAL_VERIFIER: MathVerifier | None = None


def _verifier() -> MathVerifier:
    global _EVAL_VERIFIER
    if _EVAL_VERIFIER is None:
        # The think/no-think decision is taken in final_answer_text; the verifier then scores the text it is given.
        _EVAL_VERIFIER = MathVerifier(require_think_end=False)
    return _EVAL_VERIFIER


def grade_math(
    completion: Any,
    answers: Any,
    *,
    require_think_end: bool = False,
    verifier: MathVerifier | None = None,
) -> Grade:
    r"""1.0 when the final answer equals one of `answers` (math-verify), else 0.0; never raises.

    The final answer is the last complete ``\boxed{}`` of `final_answer_text`, else that whole text (math-verify's
    own extraction). `extracted` is the last box's content (None when there is none).
    """
    references = normalize_reference(answers)
    section = final_answer_text(completion, require_think_end)
    if section is None or not section.strip() or not references:
        return Grade(0.0, None)
    boxed = last_boxed(section)
    target = "\\boxed{" + boxed + "}" if boxed is not None else section
    verifier = verifier or _verifier()
    for reference in references:
        if verifier.score(target, reference) == 1.0:
            return Grade(1.0, boxed)
    return Grade(0.0, boxed)


_LATEX_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_LETTER_ONLY = re.compile(r"[(\[]?\s*([A-Z])\s*[)\]]?\s*[.:]?")
_LETTER_LEAD = re.compile(r"[(\[]?([A-Z])[)\].:]\s+\S")
_ANSWER_STATEMENT = re.compile(
    r"(?i:\b(?:final\s+)?answer\b|\b(?:correct|best|right)\s+(?:option|choice|answer)\b)"
    r"(?:\s*(?i:is|would\s+be|should\s+be|must\s+be|will\s+be|=|:))?"
    r"\s*(?i:option|choice)?"
    r"[\s*_$]*[(\[]?\s*([A-Z])\s*[)\]]?"
    r"(?![A-Za-z0-9])"
)
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")


def _clean_fragment(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, _LATEX_WRAPPER.sub(r"\1", text)
    text = text.replace("$", "").replace("**", "").replace("__", "")
    text = text.strip().strip("*_`").strip()
    return re.sub(r"[.!。]+$", "", text).strip()


def _normalize_option(text: str) -> str:
    return re.sub(r"\s+", " ", _clean_fragment(str(text))).strip(" .,;:").lower()


def _letter_of_fragment(
    fragment: str, letters: str, options: Sequence[str] | None = None, *, match_options: bool = True
) -> str | None:
    text = _clean_fragment(fragment)
    match = _LETTER_ONLY.fullmatch(text)
    if match:
        return match.group(1) if match.group(1) in letters else None
    match = _LETTER_LEAD.match(text)
    if match and match.group(1) in letters:
        return match.group(1)
    if match_options and options:
        key = _normalize_option(text)
        hits = [
            letters[i] for i, option in enumerate(options[: len(letters)]) if key and _normalize_option(option) == key
        ]
        if len(hits) == 1:
            return hits[0]
    return None


def extract_choice(text: str | None, letters: str = "ABCD", options: Sequence[str] | None = None) -> str | None:
    """The option letter a text answers with, by the rules of the module docstring (boxed > answer statement >
    parenthesised letter > last line), or None (unparsable). `letters` are the valid letters, in option order;
    `options` their texts (for ``\\boxed{option text}``)."""
    if not isinstance(text, str) or not text.strip():
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        letter = _letter_of_fragment(boxed, letters, options)
        if letter is not None:
            return letter
    for match in reversed(list(_ANSWER_STATEMENT.finditer(text))):
        if match.group(1) in letters:
            return match.group(1)
    for match in reversed(list(_PAREN_LETTER.finditer(text))):
        if match.group(1) in letters:
            return match.group(1)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if lines:
        return _letter_of_fragment(lines[-1], letters, match_options=False)
    return None


def grade_choice(
    completion: Any,
    answer: str,
    letters: str = "ABCD",
    options: Sequence[str] | None = None,
    *,
    require_think_end: bool = False,
) -> Grade:
    """1.0 when the letter read from the graded text (`extract_choice`) is `answer`, else 0.0."""
    letter = extract_choice(final_answer_text(completion, require_think_end), letters, options)
    return Grade(1.0 if letter is not None and letter == str(answer).strip() else 0.0, letter)


def avg_at_k(scores: Sequence[Sequence[float]]) -> float:
    """Mean over questions of the mean over each question's samples (a fraction; NaN for no questions)."""
    per_question = [sum(s) / len(s) for s in scores if len(s)]
    return sum(per_question) / len(per_question) if per_question else math.nan


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class EvalQuestion:
    """One question: its prompt (messages, or a plain string kept verbatim), accepted answers, and for multiple
    choice the valid letters and the option texts."""

    id: str
    prompt: Any
    answers: list[str]
    kind: str = "math"
    letters: str | None = None
    options: list[str] | None = None


@dataclass
class LoadedBenchmark:
    name: str
    title: str
    kind: str
    questions: list[EvalQuestion]
    in_distribution: bool | None = None  # None: not one of the paper's benchmarks (no average)
    samples: int = 1
    source: dict[str, Any] = field(default_factory=dict)


def grade(question: EvalQuestion, completion: Any, *, require_think_end: bool = False) -> Grade:
    """Grade one completion of `question` by its kind."""
    if question.kind == "choice":
        return grade_choice(
            completion, question.answers[0], question.letters or "", question.options,
            require_think_end=require_think_end,
        )
    return grade_math(completion, question.answers, require_think_end=require_think_end)


def _choice_prompt(question: str, options: Sequence[str]) -> str:
    lines = [f"{LETTERS[i]}. {str(option).strip()}" for i, option in enumerate(options)]
    return question.strip() + "\n\n" + "\n".join(lines)


def _gpqa_order(question: str, n: int) -> list[int]:
    seed = int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:8], "big")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def _choice_row(spec: Benchmark, row: dict[str, Any]) -> tuple[str, list[str], str]:
    """(question, options in display order, correct letter) of one multiple-choice row."""
    question = str(row[spec.question_column])
    if spec.choice_format == "arc":
        choices = row["choices"]
        texts, labels = list(choices["text"]), [str(label).strip() for label in choices["label"]]
        key = str(row["answerKey"]).strip()
        if key not in labels:
            raise ValueError(f"ARC row {row.get('id')}: answerKey {key!r} not among labels {labels}")
        return question, texts, LETTERS[labels.index(key)]
    if spec.choice_format == "gpqa":
        answers = [row["Correct Answer"]] + [row[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
        answers = [str(a).strip() for a in answers]
        order = _gpqa_order(question, len(answers))
        return question, [answers[i] for i in order], LETTERS[order.index(0)]
    if spec.choice_format == "mmlu_pro":
        options = [str(o) for o in row["options"]]
        index = row.get("answer_index")
        letter = LETTERS[int(index)] if index is not None else str(row["answer"]).strip()
        if row.get("answer") is not None and str(row["answer"]).strip() != letter:
            raise ValueError(f"MMLU-Pro row {row.get('question_id')}: answer {row['answer']!r} != index {index}")
        return question, options, letter
    raise ValueError(f"unknown choice format {spec.choice_format!r}")


def _registry_questions(spec: Benchmark, dataset, system_prompt: str | None) -> list[EvalQuestion]:
    system = LUFFY_SYSTEM_PROMPT if system_prompt is None else system_prompt
    questions = []
    for i, row in enumerate(dataset):
        qid = str(row[spec.id_column]) if spec.id_column and row.get(spec.id_column) is not None else str(i)
        if spec.kind == "math":
            answers = normalize_reference(row[spec.answer_column])
            if not answers:
                raise ValueError(f"{spec.name} row {qid} has no reference answer in {spec.answer_column!r}")
            prompt = luffy_messages(str(row[spec.question_column]).strip(), system)
            questions.append(EvalQuestion(qid, prompt, answers))
        else:
            question, options, letter = _choice_row(spec, row)
            letters = LETTERS[: len(options)]
            prompt = luffy_messages(_choice_prompt(question, options), system)
            questions.append(EvalQuestion(qid, prompt, [letter], "choice", letters, options))
    return questions


def _check_columns(spec: Benchmark, dataset, where: str) -> None:
    needed = {spec.question_column}
    if spec.choice_format == "arc":
        needed |= {"choices", "answerKey"}
    elif spec.choice_format == "gpqa":
        needed |= {"Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"}
    elif spec.choice_format == "mmlu_pro":
        needed |= {"options", "answer"}
    else:
        needed.add(spec.answer_column)
    missing = sorted(needed - set(dataset.column_names))
    if missing:
        raise ValueError(
            f"{where} lacks column(s) {missing} of benchmark {spec.name!r} (it has {dataset.column_names}); "
            f"expected the schema of {spec.hub_id}."
        )


def find_local_file(data_dir: str | Path, name: str) -> Path | None:
    """``DIR/NAME.jsonl`` (or .json, .parquet, .csv, or a folder ``DIR/NAME``) if present."""
    base = Path(data_dir)
    for suffix in _LOCAL_SUFFIXES:
        if (base / f"{name}{suffix}").is_file():
            return base / f"{name}{suffix}"
    return base / name if (base / name).is_dir() else None


def load_benchmark(
    name: str,
    path: str | Path | None = None,
    *,
    system_prompt: str | None = None,
    limit: int | None = None,
    data_dir: str | Path | None = None,
) -> LoadedBenchmark:
    """A benchmark's questions in the training prompt format.

    `name` is a registry name (`BENCHMARKS`) or any other name with a `path` (a math set read like training data).
    The data come from `path`, else from `data_dir` (``NAME.jsonl`` ...), else from the Hub. `limit` keeps the
    first questions (smoke runs). `system_prompt`: None for LUFFY's, "" for none.
    """
    if path is None and data_dir is not None:
        path = find_local_file(data_dir, name)
    spec = BENCHMARKS.get(name)
    if spec is None:
        if path is None:
            raise ValueError(
                f"unknown benchmark {name!r}: use one of {list(BENCHMARKS)}, or give a local file as {name}=PATH."
            )
        raw = load_raw_dataset(str(path))
        if limit is not None:
            raw = raw.select(range(min(limit, len(raw))))
        rows = to_math_prompts(raw, system_prompt=system_prompt)
        questions = [
            EvalQuestion(str(i), row["prompt"], normalize_reference(row["answer"])) for i, row in enumerate(rows)
        ]
        return LoadedBenchmark(name, name, "math", questions, None, 1, {"path": str(path)})

    if path is not None:
        raw, source = load_raw_dataset(str(path)), {"path": str(path)}
    else:
        source = {"hub_id": spec.hub_id, "config": spec.config, "split": spec.split}
        try:
            raw = load_raw_dataset(spec.hub_id, split=spec.split, config=spec.config)
        except Exception as exc:  # noqa: BLE001 - add what to do about it
            raise RuntimeError(
                f"could not load benchmark {name!r} from the Hub ({spec.hub_id}, config={spec.config}, "
                f"split={spec.split}): {exc}. Pass a local copy of the same schema with --data {name}=PATH. "
                f"Card: {spec.card}"
            ) from exc
    _check_columns(spec, raw, str(path or spec.hub_id))
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    questions = _registry_questions(spec, raw, system_prompt)
    return LoadedBenchmark(name, spec.title, spec.kind, questions, spec.in_distribution, spec.samples, source)


_SPEC_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def parse_benchmark_spec(spec: str) -> tuple[str, str | None]:
    """``NAME`` (registry, from the Hub), ``NAME=PATH`` (a local file) or ``PATH`` (name: the file's stem)."""
    spec = spec.strip()
    name, sep, path = spec.partition("=")
    if sep and _SPEC_NAME.match(name) and path:
        return name, path
    if spec in BENCHMARKS:
        return spec, None
    candidate = Path(spec)
    if candidate.exists():
        return candidate.stem if candidate.is_file() else candidate.name, spec
    raise ValueError(f"benchmark {spec!r}: not one of {list(BENCHMARKS)}, not NAME=PATH, and no such file.")


# ----------------------------------------------------------------------------------------------------------------
# Prompts and generation
# ----------------------------------------------------------------------------------------------------------------
_WARNED_NO_TEMPLATE = False


def render_prompt(prompt: Any, tokenizer) -> str:
    """A prompt as the text the model reads: a string as is; messages through the tokenizer's chat template with
    the generation prompt (as TRL renders training prompts), or joined by blank lines without a template."""
    global _WARNED_NO_TEMPLATE
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    if not _WARNED_NO_TEMPLATE:
        logger.warning("the tokenizer has no chat template: message prompts are joined as plain text")
        _WARNED_NO_TEMPLATE = True
    return "\n\n".join(str(m["content"]) for m in prompt) + "\n\n"


@dataclass
class Completion:
    text: str
    num_tokens: int
    truncated: bool


class TransformersGenerator:
    """Sampling with transformers ``generate``: prompts x n sequences, in batches of `batch_size` sequences
    (longest prompts first, left padding), seeded without touching the caller's RNG, with a tqdm bar."""

    def __init__(self, model, tokenizer, *, batch_size: int = 32, progress: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.progress = batch_size, progress

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        configured = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (configured, self.tokenizer.eos_token_id):
            if value is None:
                continue
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v not in ids:
                    ids.append(int(v))
        return ids

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int = 0,
        desc: str | None = None,
    ) -> list[list[Completion]]:
        import torch
        from tqdm.auto import tqdm
        from transformers import GenerationConfig

        model = self.model
        eos = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        sample = temperature > 0
        config = dict(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=eos or None, pad_token_id=pad,
                      num_return_sequences=1, repetition_penalty=1.0)
        if sample:
            config.update(temperature=temperature, top_p=top_p, top_k=0)
        generation_config = GenerationConfig(**config)

        jobs = [i for i in range(len(prompt_ids)) for _ in range(n)]
        order = sorted(range(len(jobs)), key=lambda j: (-len(prompt_ids[jobs[j]]), j))
        done: list[Completion | None] = [None] * len(jobs)
        device = next(model.parameters()).device
        rng_devices = []
        if device.type == "cuda":
            rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
        was_training = model.training
        model.eval()
        bar = tqdm(
            total=len(jobs), desc=desc or "generating", unit="seq", disable=not self.progress, dynamic_ncols=True
        )
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices):
                torch.manual_seed(seed)
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    rows = [list(prompt_ids[jobs[j]]) for j in chunk]
                    width = max(len(r) for r in rows)
                    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
                    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
                    for r, ids in enumerate(rows):
                        if ids:
                            input_ids[r, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                            attention_mask[r, width - len(ids) :] = 1
                    out = model.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention_mask.to(device),
                        generation_config=generation_config,
                    )
                    for j, ids in zip(chunk, out[:, width:].tolist()):
                        done[j] = self._completion(ids, eos)
                    bar.update(len(chunk))
        finally:
            bar.close()
            model.train(was_training)
        grouped: list[list[Completion]] = [[] for _ in prompt_ids]
        for j, completion in enumerate(done):
            grouped[jobs[j]].append(completion)
        return grouped

    def _completion(self, ids: list[int], eos: list[int]) -> Completion:
        stop = next((i for i, t in enumerate(ids) if t in eos), None)
        kept = ids if stop is None else ids[:stop]
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return Completion(text, len(ids) if stop is None else stop + 1, stop is None)


def vllm_available() -> bool:
    """vLLM importable AND a CUDA GPU present (the `auto` backend's test)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _request_seed(seed: int, name: str | None, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class VLLMGenerator:
    """Sampling with vLLM (one engine for all benchmarks). Same interface as `TransformersGenerator`.

    Prompts go in as token ids (tokenized by the same code as the transformers path) and completions are decoded by
    our `tokenizer` from vLLM's token ids (so both paths share tokenization and decoding); sampling is set fully
    (temperature, top-p, max tokens, seed; top-k off, no repetition penalty, whatever the model's generation config
    says), and ``finish_reason == "length"`` marks a truncated completion. `llm_kwargs` go to ``vllm.LLM``
    (e.g. ``{"enforce_eager": true}``). No GPU test here: checked only against PyPI's CPU build of vLLM.
    """

    def __init__(
        self,
        model: str,
        tokenizer,
        *,
        tokenizer_path: str | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        seed: int = 0,
        revision: str | None = None,
        trust_remote_code: bool = False,
        progress: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
    ):
        from vllm import LLM

        kwargs = dict(
            model=model, tokenizer=tokenizer_path or model, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, seed=seed, revision=revision,
            trust_remote_code=trust_remote_code,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        kwargs.update(llm_kwargs or {})
        self.llm = LLM(**kwargs)
        self.tokenizer = tokenizer
        self.progress = progress

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int = 0,
        desc: str | None = None,
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        # One seed per request (from the run's seed, the benchmark and the question's position): reproducible, and
        # unlike one shared seed, different questions do not reuse the same random draws.
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=-1, repetition_penalty=1.0,
                           max_tokens=max_new_tokens, seed=_request_seed(seed, desc, i))
            for i in range(len(prompt_ids))
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        if desc and self.progress:
            logger.info("generating: %s", desc)
        outputs = self.llm.generate(prompts, params, use_tqdm=self.progress)
        return [
            [
                Completion(
                    self.tokenizer.decode(list(o.token_ids), skip_special_tokens=True),
                    len(o.token_ids),
                    o.finish_reason == "length",
                )
                for o in out.outputs
            ]
            for out in outputs
        ]


# ----------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------
def metric_name(samples: int) -> str:
    return "pass@1" if samples == 1 else f"avg@{samples}"


def evaluate_benchmark(
    bench: LoadedBenchmark,
    generator,
    tokenizer,
    *,
    samples: int,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    seed: int = 0,
    require_think_end: bool = False,
    questions: Sequence[EvalQuestion] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generate `samples` completions per question, grade them, and return (result, completion records).

    result: ``score`` (avg@k in %), ``metric``, settings, ``per_question`` (id, answers, scores, mean), and
    ``answer_found_rate`` (completions with an answer read: a box for math, a letter for choice),
    ``truncated_rate``, ``mean_completion_tokens``. `questions` overrides the benchmark's (a shard).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    questions = bench.questions if questions is None else list(questions)
    texts = [render_prompt(q.prompt, tokenizer) for q in questions]
    prompt_ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    start = time.perf_counter()
    outputs = generator.generate(
        prompt_ids, n=samples, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
        desc=bench.name,
    )
    per_question, records = [], []
    found = truncated = tokens = total = 0
    for question, completions in zip(questions, outputs):
        scores = []
        for k, completion in enumerate(completions):
            result = grade(question, completion.text, require_think_end=require_think_end)
            scores.append(result.score)
            found += result.extracted is not None
            truncated += completion.truncated
            tokens += completion.num_tokens
            total += 1
            records.append({
                "benchmark": bench.name, "id": question.id, "sample": k, "completion": completion.text,
                "extracted": result.extracted, "score": result.score, "num_tokens": completion.num_tokens,
                "truncated": completion.truncated,
            })
        per_question.append({
            "id": question.id, "answers": question.answers, "scores": scores,
            "mean": sum(scores) / len(scores) if scores else math.nan,
        })
    accuracy = avg_at_k([q["scores"] for q in per_question])
    result = {
        "name": bench.name,
        "title": bench.title,
        "kind": bench.kind,
        "in_distribution": bench.in_distribution,
        "source": bench.source,
        "metric": metric_name(samples),
        "score": 100.0 * accuracy,
        "num_questions": len(questions),
        "samples": samples,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "answer_found_rate": found / total if total else math.nan,
        "truncated_rate": truncated / total if total else math.nan,
        "mean_completion_tokens": tokens / total if total else math.nan,
        "seconds": time.perf_counter() - start,
        "per_question": per_question,
    }
    return result, records


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """In- and out-of-distribution averages (mean of the benchmarks' scores, the paper's way), over the paper's
    benchmarks that were evaluated; ``complete`` says whether all of that group's benchmarks were."""
    summary = {}
    for group, names in (("in_distribution", IN_DISTRIBUTION), ("out_of_distribution", OUT_OF_DISTRIBUTION)):
        present = [n for n in names if n in results]
        summary[group] = {
            "score": _mean(results[n]["score"] for n in present),
            "benchmarks": present,
            "complete": len(present) == len(names),
        }
    return summary


def _paper_average(row: str, group: str, present: Sequence[str], complete: bool) -> float | None:
    if not present:
        return None
    if complete:
        return PAPER_REPORTED_AVERAGES[row][group]
    return _mean(PAPER_RESULTS[row][n] for n in present)


def _fmt(value: float | None) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def markdown_table(results: dict[str, dict[str, Any]], label: str, *, paper_rows: bool = True) -> str:
    """The SPEC §10 layout: paper benchmarks in the paper's order (those evaluated), the in-distribution average,
    the out-of-distribution ones and their average; other benchmarks after. The paper's two Qwen2.5-Math-7B rows
    come first. A partial average is marked * (the paper's rows then use the same benchmarks)."""
    summary = summarize(results)
    ind = [n for n in IN_DISTRIBUTION if n in results]
    ood = [n for n in OUT_OF_DISTRIBUTION if n in results]
    extra = [n for n in results if n not in BENCHMARKS]
    columns: list[tuple[str, str]] = [(BENCHMARKS[n].title, n) for n in ind]
    star = {g: "" if summary[g]["complete"] else "*" for g in summary}
    if ind:
        columns.append(("ID avg." + star["in_distribution"], "@in_distribution"))
    columns += [(BENCHMARKS[n].title, n) for n in ood]
    if ood:
        columns.append(("OOD avg." + star["out_of_distribution"], "@out_of_distribution"))
    columns += [(results[n].get("title", n), n) for n in extra]

    def row(name: str, cell: Callable[[str], float | None]) -> str:
        return "| " + " | ".join([name] + [_fmt(cell(key)) for _, key in columns]) + " |"

    lines = [
        "| Model | " + " | ".join(title for title, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    if paper_rows:
        for paper_row in PAPER_RESULTS:
            def paper_cell(key: str, paper_row: str = paper_row) -> float | None:
                if key.startswith("@"):
                    group = key[1:]
                    present = summary[group]["benchmarks"]
                    return _paper_average(paper_row, group, present, summary[group]["complete"])
                return PAPER_RESULTS[paper_row].get(key)

            lines.append(row(f"{paper_row} (paper, {PAPER_BACKBONE})", paper_cell))

    def own_cell(key: str) -> float | None:
        if key.startswith("@"):
            return summary[key[1:]]["score"]
        return results[key]["score"]

    lines.append(row(f"**{label}**", own_cell))
    notes = ["", "Metrics: " + ", ".join(
        f"{results[n].get('title', n)} {results[n]['metric']} ({results[n]['num_questions']} questions)"
        for _, n in columns if not n.startswith("@")
    ) + "."]
    partial = [g for g in summary if summary[g]["benchmarks"] and not summary[g]["complete"]]
    if partial:
        notes.append("* Average over the benchmarks evaluated here; the paper's rows are averaged over the same ones.")
    return "\n".join(lines + notes) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------
def parse_per_benchmark(text: str | None, cast: Callable[[str], Any], what: str) -> tuple[Any, dict[str, Any]]:
    """``"4"`` -> (4, {}); ``"aime24=32,amc=16"`` -> (None, {...}); ``"8,aime24=32"`` -> (8, {"aime24": 32})."""
    default, per = None, {}
    if text is None:
        return default, per
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            if sep:
                per[name.strip()] = cast(value.strip())
            else:
                default = cast(part)
        except ValueError as exc:
            raise ValueError(f"--{what}: cannot read {part!r} ({exc})") from exc
    return default, per


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exgrpo eval",
        description="Evaluate a model on the ExGRPO paper's benchmarks (SPEC §9) and write results.json, "
        "results.md (laid out like the paper's table, its numbers beside yours) and completions.jsonl.",
    )
    parser.add_argument("--model", required=True, help="model folder or Hub id")
    parser.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                        help=f"comma-separated, of {', '.join(BENCHMARKS)} (default: all) or names given with --data")
    parser.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                        help="read a benchmark from a local file of its Hub schema (repeatable); a NAME outside the "
                        "registry adds a math benchmark with prompt/question/problem + answer columns")
    parser.add_argument("--data-dir", default=None,
                        help="folder with local benchmark files NAME.jsonl/.json/.parquet/.csv")
    parser.add_argument("--samples", default=None,
                        help="samples per question: N for all, or NAME=N,... "
                        "(default: 32 for aime24, aime25, amc; 1 else)")
    parser.add_argument("--temperature", default=str(DEFAULT_TEMPERATURE), help="T or NAME=T,... (default 0.6)")
    parser.add_argument("--top-p", default=str(DEFAULT_TOP_P), help="P or NAME=P,... (default 1.0)")
    parser.add_argument("--max-new-tokens", default=str(DEFAULT_MAX_NEW_TOKENS), help="N or NAME=N,... (default 8192)")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only the first N questions of each benchmark")
    parser.add_argument("--system-prompt", default=None,
                        help="system prompt (default: LUFFY's, as in training; '' for none)")
    parser.add_argument("--require-think-end", action="store_true",
                        help="grade like the training reward: a completion without </think> scores 0")
    parser.add_argument("--backend", choices=("auto", "transformers", "vllm"), default="auto",
                        help="auto: vLLM if importable and a GPU is present, else transformers")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto, bfloat16, float16, float32)")
    parser.add_argument("--device", default=None,
                        help="transformers backend: device (default: cuda if available, else cpu)")
    parser.add_argument("--batch-size", type=int, default=64, help="transformers backend: sequences per generate call")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM")
    parser.add_argument("--max-model-len", type=int, default=None, help="vLLM")
    parser.add_argument("--vllm-kwargs", default=None,
                        help='vLLM: more vllm.LLM arguments as JSON, e.g. \'{"enforce_eager": true}\'')
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="default: eval_results/<model folder name>")
    parser.add_argument("--name", default=None, help="row label in the table (default: the model's folder name)")
    parser.add_argument("--no-completions", action="store_true", help="do not write completions.jsonl")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _resolve_dtype(dtype: str):
    if dtype == "auto":
        return "auto"
    import torch

    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved


def make_generator(args: argparse.Namespace, tokenizer):
    """The generation backend the arguments ask for: (generator, backend name)."""
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if vllm_available() else "transformers"
    if backend == "vllm":
        generator = VLLMGenerator(
            args.model, tokenizer, tokenizer_path=args.tokenizer, dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len, seed=args.seed, revision=args.revision,
            trust_remote_code=args.trust_remote_code, progress=not args.no_progress,
            llm_kwargs=json.loads(args.vllm_kwargs) if args.vllm_kwargs else None,
        )
        return generator, backend
    import torch
    from transformers import AutoModelForCausalLM

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kwargs = {"dtype": _resolve_dtype(args.dtype), "trust_remote_code": args.trust_remote_code}
    if args.revision:
        kwargs["revision"] = args.revision
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).to(device)
    model.eval()
    return TransformersGenerator(model, tokenizer, batch_size=args.batch_size, progress=not args.no_progress), backend


def run_evaluation(args: argparse.Namespace, generator=None, tokenizer=None) -> dict[str, Any]:
    """Everything `main` does after parsing; `generator` / `tokenizer` may be given (tests, notebooks)."""
    local = {}
    for item in args.data:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--data expects NAME=PATH, got {item!r}")
        local[name.strip()] = path.strip()
    names = [n.strip() for n in args.benchmarks.split(",") if n.strip()]
    if not names:
        raise ValueError("--benchmarks is empty")
    for n in names:
        if n not in BENCHMARKS and n not in local:
            raise ValueError(
                f"unknown benchmark {n!r}: use {', '.join(BENCHMARKS)} or give it a file with --data {n}=PATH"
            )
    samples_default, samples_per = parse_per_benchmark(args.samples, int, "samples")
    temp_default, temp_per = parse_per_benchmark(args.temperature, float, "temperature")
    top_p_default, top_p_per = parse_per_benchmark(args.top_p, float, "top-p")
    tokens_default, tokens_per = parse_per_benchmark(args.max_new_tokens, int, "max-new-tokens")
    for option, per in (("samples", samples_per), ("temperature", temp_per), ("top-p", top_p_per),
                        ("max-new-tokens", tokens_per)):
        unknown = sorted(set(per) - set(names))
        if unknown:
            raise ValueError(f"--{option} names benchmark(s) {unknown} that are not evaluated ({names})")

    benchmarks = [
        load_benchmark(n, local.get(n), system_prompt=args.system_prompt, limit=args.limit, data_dir=args.data_dir)
        for n in names
    ]
    if tokenizer is None:
        from .train import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer or args.model, revision=args.revision or "main",
                                   trust_remote_code=args.trust_remote_code)
    backend = getattr(generator, "backend_name", type(generator).__name__) if generator is not None else None
    if generator is None:
        generator, backend = make_generator(args, tokenizer)

    label = args.name or Path(str(args.model).rstrip("/")).name
    output_dir = Path(args.output_dir or Path("eval_results") / label)
    output_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    all_records: list[dict[str, Any]] = []
    def pick(per: dict[str, Any], default: Any, fallback: Any, name: str) -> Any:
        return per.get(name, default if default is not None else fallback)

    for bench in benchmarks:
        result, records = evaluate_benchmark(
            bench, generator, tokenizer,
            samples=pick(samples_per, samples_default, bench.samples, bench.name),
            temperature=pick(temp_per, temp_default, DEFAULT_TEMPERATURE, bench.name),
            top_p=pick(top_p_per, top_p_default, DEFAULT_TOP_P, bench.name),
            max_new_tokens=pick(tokens_per, tokens_default, DEFAULT_MAX_NEW_TOKENS, bench.name),
            seed=args.seed,
            require_think_end=args.require_think_end,
        )
        results[bench.name] = result
        all_records.extend(records)
        logger.info("%s: %s = %.1f", bench.name, result["metric"], result["score"])

    from . import __version__

    report = {
        "model": args.model,
        "label": label,
        "backend": backend,
        "exgrpo_trl_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seed": args.seed,
        "system_prompt": "luffy" if args.system_prompt is None else args.system_prompt,
        "require_think_end": args.require_think_end,
        "limit": args.limit,
        "benchmarks": results,
        "averages": summarize(results),
        "paper": {"backbone": PAPER_BACKBONE, "results": PAPER_RESULTS, "reported_averages": PAPER_REPORTED_AVERAGES},
    }
    table = markdown_table(results, label)
    settings = ", ".join(
        f"{r['title']}: k={r['samples']}, T={r['temperature']}, top-p={r['top_p']}, max {r['max_new_tokens']} tokens"
        for r in results.values()
    )
    graded = (
        "completions without </think> score 0" if args.require_think_end
        else "graded after the last </think> when present, else the whole completion"
    )
    markdown = (
        f"# Evaluation of `{args.model}`\n\n{table}\n"
        f"Backend: {backend}; seed {args.seed}; {graded}."
        f"\n\nSettings: {settings}.\n"
    )
    (output_dir / "results.json").write_text(json.dumps(_json_safe(report), indent=2, ensure_ascii=False) + "\n")
    (output_dir / "results.md").write_text(markdown)
    if not args.no_completions:
        with open(output_dir / "completions.jsonl", "w") as f:
            for record in all_records:
                f.write(json.dumps(_json_safe(record), ensure_ascii=False) + "\n")
    report["output_dir"] = str(output_dir)
    report["markdown"] = markdown
    return report


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``exgrpo eval ARGS`` and ``python -m exgrpo_trl.evaluation ARGS``."""
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(name)s - %(message)s")
    report = run_evaluation(args)
    print(report["markdown"])
    written = "results.json, results.md" + ("" if args.no_completions else ", completions.jsonl")
    print(f"Wrote {written} to {report['output_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
