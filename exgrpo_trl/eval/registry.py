"""The paper's benchmarks (algorithm §9): the registry, the paper's numbers (algorithm §10), and loading a benchmark's
questions from the Hub or a local file of the same schema."""

from __future__ import annotations

import hashlib
import logging
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..tasks.math_data import LUFFY_SYSTEM_PROMPT, load_raw_dataset, luffy_messages, to_math_prompts

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
class HubSource:
    """Where a benchmark lives on the Hub: dataset id, split, config, its number of questions there, its card."""

    id: str
    split: str
    config: str | None = None
    size: int | None = None
    card: str = ""


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark lives on the Hub (`hub`), which columns hold what, and how it is graded.

    `kind` is ``"math"`` (math-verify on `answer_column`) or ``"choice"`` (letter grading); `choice_format` says how
    a choice row lists its options (``"arc"``, ``"gpqa"``, ``"mmlu_pro"``). `samples` is the algorithm §9 default k.
    """

    name: str
    title: str
    hub: HubSource
    kind: str
    question_column: str
    answer_column: str | None = None
    id_column: str | None = None
    choice_format: str | None = None
    samples: int = 1
    in_distribution: bool = True


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "aime24",
            "AIME24",
            HubSource(
                "HuggingFaceH4/aime_2024",
                "train",
                size=30,
                card="https://huggingface.co/datasets/HuggingFaceH4/aime_2024",
            ),
            "math",
            "problem",
            "answer",
            id_column="id",
            samples=32,
        ),
        Benchmark(
            "aime25",
            "AIME25",
            HubSource(
                "MathArena/aime_2025", "train", size=30, card="https://huggingface.co/datasets/MathArena/aime_2025"
            ),
            "math",
            "problem",
            "answer",
            id_column="problem_idx",
            samples=32,
        ),
        Benchmark(
            "amc",
            "AMC",
            HubSource(
                "AI-MO/aimo-validation-amc",
                "train",
                size=83,
                card="https://huggingface.co/datasets/AI-MO/aimo-validation-amc",
            ),
            "math",
            "problem",
            "answer",
            id_column="id",
            samples=32,
        ),
        Benchmark(
            "math500",
            "MATH-500",
            HubSource(
                "HuggingFaceH4/MATH-500",
                "test",
                size=500,
                card="https://huggingface.co/datasets/HuggingFaceH4/MATH-500",
            ),
            "math",
            "problem",
            "answer",
            id_column="unique_id",
        ),
        Benchmark(
            "minerva",
            "Minerva",
            HubSource(
                "lkevinzc/math-eval", "minerva", size=272, card="https://huggingface.co/datasets/lkevinzc/math-eval"
            ),
            "math",
            "problem",
            "answer",
        ),
        Benchmark(
            "olympiad",
            "Olympiad",
            HubSource(
                "lkevinzc/math-eval",
                "olympiad_bench",
                size=675,
                card="https://huggingface.co/datasets/lkevinzc/math-eval",
            ),
            "math",
            "problem",
            "answer",
        ),
        Benchmark(
            "arc_c",
            "ARC-c",
            HubSource(
                "allenai/ai2_arc",
                "test",
                config="ARC-Challenge",
                size=1172,
                card="https://huggingface.co/datasets/allenai/ai2_arc",
            ),
            "choice",
            "question",
            "answerKey",
            id_column="id",
            choice_format="arc",
            in_distribution=False,
        ),
        Benchmark(
            "gpqa_diamond",
            "GPQA-D",
            HubSource(
                "Idavidrein/gpqa",
                "train",
                config="gpqa_diamond",
                size=198,
                card="https://huggingface.co/datasets/Idavidrein/gpqa (gated: accept its terms, then log in)",
            ),
            "choice",
            "Question",
            "Correct Answer",
            choice_format="gpqa",
            in_distribution=False,
        ),
        Benchmark(
            "mmlu_pro",
            "MMLU-Pro",
            HubSource(
                "TIGER-Lab/MMLU-Pro", "test", size=12032, card="https://huggingface.co/datasets/TIGER-Lab/MMLU-Pro"
            ),
            "choice",
            "question",
            "answer",
            id_column="question_id",
            choice_format="mmlu_pro",
            in_distribution=False,
        ),
    )
}
IN_DISTRIBUTION = tuple(n for n, b in BENCHMARKS.items() if b.in_distribution)
OUT_OF_DISTRIBUTION = tuple(n for n, b in BENCHMARKS.items() if not b.in_distribution)

# algorithm §10: Qwen2.5-Math-7B, in %.
PAPER_BACKBONE = "Qwen2.5-Math-7B"
PAPER_RESULTS: dict[str, dict[str, float]] = {
    "On-policy (Dr.GRPO)": {
        "aime24": 24.9,
        "aime25": 15.5,
        "amc": 59.2,
        "math500": 84.8,
        "minerva": 38.2,
        "olympiad": 49.3,
        "arc_c": 82.6,
        "gpqa_diamond": 37.4,
        "mmlu_pro": 49.2,
    },
    "ExGRPO": {
        "aime24": 31.6,
        "aime25": 18.7,
        "amc": 66.3,
        "math500": 87.4,
        "minerva": 36.0,
        "olympiad": 50.1,
        "arc_c": 84.7,
        "gpqa_diamond": 37.4,
        "mmlu_pro": 52.9,
    },
}
PAPER_REPORTED_AVERAGES: dict[str, dict[str, float]] = {
    "On-policy (Dr.GRPO)": {"in_distribution": 45.3, "out_of_distribution": 56.4},
    "ExGRPO": {"in_distribution": 48.3, "out_of_distribution": 58.3},
}


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
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
            f"expected the schema of {spec.hub.id}."
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
        source = {"hub_id": spec.hub.id, "config": spec.hub.config, "split": spec.hub.split}
        try:
            raw = load_raw_dataset(spec.hub.id, split=spec.hub.split, config=spec.hub.config)
        except Exception as exc:  # noqa: BLE001 - add what to do about it
            raise RuntimeError(
                f"could not load benchmark {name!r} from the Hub ({spec.hub.id}, config={spec.hub.config}, "
                f"split={spec.hub.split}): {exc}. Pass a local copy of the same schema with --data {name}=PATH. "
                f"Card: {spec.hub.card}"
            ) from exc
    _check_columns(spec, raw, str(path or spec.hub.id))
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
