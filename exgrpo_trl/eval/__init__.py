r"""Evaluation: the paper's benchmarks (algorithm §9), grading, generators, avg@k reports, the in-training callback.

    registry.py     the benchmarks (Hub ids, columns), the paper's numbers, loading questions from the Hub or a file
    grading.py      one completion -> 0/1: math answers (last box, math-verify) and letter choices
    generators.py   sampling completions: transformers ``generate`` or vLLM, seeded
    report.py       avg@k per benchmark, the summary, the markdown table beside the paper's rows
    callback.py     `ValidationCallback`: the same benchmarks during training (``eval/<benchmark>/...`` metrics)
    completions.py  side-by-side completions of two models (the notebook's before/after view)

The command line is ``exgrpo eval`` (`exgrpo_trl.cli.evaluate`): it writes ``results.json``, ``results.md`` and
``completions.jsonl`` into ``--output-dir`` and prints the table.

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
data (`tasks.math_data.to_math_prompts`: a ``prompt`` column as is, else ``question``/``problem``; ``answer``).

Prompts: the training format (`tasks.math_data.luffy_messages`: LUFFY's system prompt + the question as the user turn,
rendered
with the tokenizer's chat template and the generation prompt, as TRL renders training prompts). Multiple-choice
questions list their options after the question as ``A. text`` lines (ARC keeps its order and re-letters numeric
labels ``1-4`` as ``A-D``; GPQA's four answers are shuffled with a fixed per-question seed, the SHA-256 of the
question, so that every run and machine sees the same order; MMLU-Pro keeps its order, up to ten options A-J).
LUFFY's system prompt already asks for the final answer in ``\boxed{}``. A tokenizer without a chat template (the
tiny test tokenizer) gets the messages' contents joined by blank lines.

Which text is graded: the text after the last ``</think>`` when there is one; without ``</think>`` the whole
completion (evaluated models need not emit it: base and instruct baselines do not), unless ``--require-think-end``,
which grades like the training reward (`tasks.rewards.MathVerifier`: no ``</think>``, score 0).

Math grading (`grade_math`): if that text holds a complete ``\boxed{...}`` (or ``\fbox{...}``), only the LAST one is
the answer; without any, math-verify's own extraction runs on the whole text ("the answer is 5"). The answer is
compared with each accepted reference answer by `tasks.rewards.MathVerifier` (math-verify, reference parsed as
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

from .generators import Completion, TransformersGenerator, VLLMGenerator, render_prompt, vllm_available
from .grading import Grade, avg_at_k, extract_choice, final_answer_text, grade, grade_choice, grade_math, last_boxed
from .registry import (
    BENCHMARKS,
    PAPER_REPORTED_AVERAGES,
    PAPER_RESULTS,
    Benchmark,
    EvalQuestion,
    LoadedBenchmark,
    load_benchmark,
    normalize_reference,
    parse_benchmark_spec,
)
from .report import evaluate_benchmark, markdown_table, summarize

__all__ = [
    "BENCHMARKS",
    "PAPER_REPORTED_AVERAGES",
    "PAPER_RESULTS",
    "Benchmark",
    "Completion",
    "EvalQuestion",
    "Grade",
    "LoadedBenchmark",
    "TransformersGenerator",
    "VLLMGenerator",
    "avg_at_k",
    "evaluate_benchmark",
    "extract_choice",
    "final_answer_text",
    "grade",
    "grade_choice",
    "grade_math",
    "last_boxed",
    "load_benchmark",
    "markdown_table",
    "normalize_reference",
    "parse_benchmark_spec",
    "render_prompt",
    "summarize",
    "vllm_available",
]
