"""Scoring a benchmark (avg@k), the summary over benchmarks, and the markdown table beside the paper's rows."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .generators import render_prompt
from .grading import avg_at_k, grade
from .registry import (
    BENCHMARKS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    IN_DISTRIBUTION,
    OUT_OF_DISTRIBUTION,
    PAPER_BACKBONE,
    PAPER_REPORTED_AVERAGES,
    PAPER_RESULTS,
    EvalQuestion,
    LoadedBenchmark,
)

logger = logging.getLogger(__name__)


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
        prompt_ids,
        n=samples,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
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
            records.append(
                {
                    "benchmark": bench.name,
                    "id": question.id,
                    "sample": k,
                    "completion": completion.text,
                    "extracted": result.extracted,
                    "score": result.score,
                    "num_tokens": completion.num_tokens,
                    "truncated": completion.truncated,
                }
            )
        per_question.append(
            {
                "id": question.id,
                "answers": question.answers,
                "scores": scores,
                "mean": sum(scores) / len(scores) if scores else math.nan,
            }
        )
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
    """The algorithm §10 layout: paper benchmarks in the paper's order (those evaluated), the in-distribution average,
    the out-of-distribution ones and their average; other benchmarks after. The paper's two Qwen2.5-Math-7B rows
    come first, when any of the paper's benchmarks was evaluated. A partial average is marked * (the paper's rows then
    use the same benchmarks)."""
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
    if paper_rows and (ind or ood):  # a table of local benchmarks only has nothing of the paper's to set beside
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
    notes = [
        "",
        "Metrics: "
        + ", ".join(
            f"{results[n].get('title', n)} {results[n]['metric']} ({results[n]['num_questions']} questions)"
            for _, n in columns
            if not n.startswith("@")
        )
        + ".",
    ]
    partial = [g for g in summary if summary[g]["benchmarks"] and not summary[g]["complete"]]
    if partial:
        notes.append("* Average over the benchmarks evaluated here; the paper's rows are averaged over the same ones.")
    return "\n".join(lines + notes) + "\n"
