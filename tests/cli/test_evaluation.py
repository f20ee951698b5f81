"""`exgrpo eval` and in-training validation: grading on exact hand-made cases, avg@k, the benchmark registry and its
local copies under tests/data/eval (same schemas as the Hub), the JSON + markdown outputs (scripted completions with
known scores, and a real run of a tiny local model), the `eval` subcommand, and the validation callback (metrics
logged, experience buffer and training untouched)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from exgrpo_trl import eval as ev
from exgrpo_trl.cli import evaluate as ev_cli
from exgrpo_trl.cli.evaluate import parse_per_benchmark
from exgrpo_trl.eval import (
    BENCHMARKS,
    Completion,
    EvalQuestion,
    LoadedBenchmark,
    avg_at_k,
    extract_choice,
    grade,
    grade_choice,
    grade_math,
    last_boxed,
    load_benchmark,
    normalize_reference,
    parse_benchmark_spec,
    registry,
)
from exgrpo_trl.tasks.math_data import LUFFY_SYSTEM_PROMPT, load_raw_dataset, luffy_messages

DATA = Path(__file__).parents[1] / "data" / "eval"


# ---------------------------------------------------------------------------------------------------------------
# Math grading
# ---------------------------------------------------------------------------------------------------------------
def test_last_boxed():
    assert last_boxed(r"\boxed{1} and \boxed{2}") == "2"
    assert last_boxed(r"x = \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"  # nested braces
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{5} then \boxed{6") == "5"  # the last box is left open (truncated): skipped
    assert last_boxed(r"\boxed {3}") == "3"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{}") == ""
    assert last_boxed(None) is None


# (completion, reference answer(s), require_think_end, expected score, expected extracted box), derived by hand.
MATH_CASES = [
    # correct, with and without </think>; equivalent forms
    (r"<think>2/4 = 1/2</think> So $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", False, 1.0, r"\frac{1}{2}"),
    (r"\boxed{0.5}", r"\frac{1}{2}", False, 1.0, "0.5"),
    # wrong
    (r"<think>x</think> \boxed{3}", "4", False, 0.0, "3"),
    # unparsable: no box, nothing math-verify reads as an answer
    ("I have no idea.", "4", False, 0.0, None),
    # no box: math-verify's own extraction on the whole graded text
    ("the answer is 5", "5", False, 1.0, None),
    # several boxes: only the LAST counts (math-verify alone reads "\boxed{1} and finally \boxed{2}" as {1, 2})
    (r"\boxed{1} and finally \boxed{2}", "2", False, 1.0, "2"),
    (r"\boxed{1} and finally \boxed{2}", "1", False, 0.0, "2"),
    (r"The answer is \boxed{2}. Wait, no: \boxed{1}", "1", False, 1.0, "1"),
    # a box in the thought section does not count once there is a </think>
    (r"<think>\boxed{7}</think> \boxed{8}", "8", False, 1.0, "8"),
    (r"<think>\boxed{7}</think> \boxed{8}", "7", False, 0.0, "8"),
    # </think> with nothing after it: no answer
    (r"<think>\boxed{9}</think>", "9", False, 0.0, None),
    # require_think_end: without </think> the completion scores 0 (the training reward's rule)
    (r"\boxed{8}", "8", True, 0.0, None),
    (r"<think>a</think>\boxed{8}", "8", True, 1.0, "8"),
    # truncated last box: the last complete one is graded
    (r"\boxed{5} hmm \boxed{6", "5", False, 1.0, "5"),
    # reference answers given as a list: any of them
    (r"\boxed{x=3}", ["3", "x=3"], False, 1.0, "x=3"),
    (r"\boxed{4}", ["3", "x=3"], False, 0.0, "4"),
    # AMC stores integers as floats
    (r"\boxed{27}", 27.0, False, 1.0, "27"),
    # no reference answer: 0
    (r"\boxed{27}", None, False, 0.0, None),
]


@pytest.mark.parametrize("completion,answers,require_think_end,score,extracted", MATH_CASES)
def test_grade_math_exact(completion, answers, require_think_end, score, extracted):
    assert grade_math(completion, answers, require_think_end=require_think_end) == (score, extracted)


def test_grade_math_reads_conversational_completions_and_never_raises():
    messages = [{"role": "assistant", "content": r"<think>z</think> \boxed{2}"}]
    assert grade_math(messages, "2") == (1.0, "2")
    assert grade_math(None, "2") == (0.0, None)
    assert grade_math(12, "2") == (0.0, None)


def test_normalize_reference():
    assert normalize_reference(27.0) == ["27"]
    assert normalize_reference(2.5) == ["2.5"]
    assert normalize_reference(70) == ["70"]
    assert normalize_reference([" 3 ", "x=3", ""]) == ["3", "x=3"]
    assert normalize_reference(None) == [] and normalize_reference("  ") == []


# ---------------------------------------------------------------------------------------------------------------
# Letter grading
# ---------------------------------------------------------------------------------------------------------------
OPTIONS = ["London", "Paris", "Rome", "Berlin"]
# (text, valid letters, expected letter), derived by hand from the rules in the evaluation module's docstring.
CHOICE_CASES = [
    # rule 1: the last box
    (r"\boxed{C}", "ABCD", "C"),
    (r"The answer is $\boxed{\text{(B)}}$.", "ABCD", "B"),
    (r"\boxed{\textbf{D}}", "ABCD", "D"),
    (r"\boxed{C) Rome}", "ABCD", "C"),
    (r"\boxed{Paris}", "ABCD", "B"),  # the text of one option
    (r"\boxed{A} wait, actually \boxed{D}", "ABCD", "D"),  # several boxes: the last
    ("Answer: B\nSo the final answer is \\boxed{C}", "ABCD", "C"),  # a box beats an answer statement...
    ("\\boxed{B}\nAnswer: C", "ABCD", "B"),  # ...even an earlier box
    # a last box that names no option falls through to the next rules
    ("\\boxed{42}\nAnswer: B", "ABCD", "B"),
    (r"\boxed{E}", "ABCD", None),  # E is not an option of a 4-option question
    (r"\boxed{A, C}", "ABCD", None),  # two letters are not an answer
    # rule 2: the last answer statement
    ("Answer: C", "ABCD", "C"),
    ("The correct answer is (B).", "ABCD", "B"),
    ("Final answer: **D**", "ABCD", "D"),
    ("So the best option is A.", "ABCD", "A"),
    ("Answer: C\nHmm, no. Answer: A", "ABCD", "A"),  # several statements: the last
    ("The answer is at least 5", "ABCD", None),  # lowercase words are not letters
    # rule 3: the last parenthesised letter
    ("(A) is wrong since ..., while (B) fits", "ABCD", "B"),
    # rule 4: the last line is a letter
    ("B", "ABCD", "B"),
    ("Thinking...\n**C**", "ABCD", "C"),
    ("C. 42", "ABCD", "C"),
    # unparsable
    ("I do not know", "ABCDEFGHIJ", None),  # "I" in prose is not read, even with ten options
    ("A cat sat on the mat.", "ABCD", None),
    ("", "ABCD", None),
    # ten options (MMLU-Pro)
    (r"\boxed{J}", "ABCDEFGHIJ", "J"),
]


@pytest.mark.parametrize("text,letters,expected", CHOICE_CASES)
def test_extract_choice_exact(text, letters, expected):
    assert extract_choice(text, letters, OPTIONS) == expected


def test_grade_choice_think_sections():
    text = "<think>Answer: A</think> The answer is \\boxed{B}"
    assert grade_choice(text, "B", "ABCD") == (1.0, "B")
    assert grade_choice(text, "A", "ABCD") == (0.0, "B")
    assert grade_choice("<think>maybe</think>", "A", "ABCD") == (0.0, None)
    assert grade_choice("\\boxed{B}", "B", "ABCD") == (1.0, "B")
    assert grade_choice("\\boxed{B}", "B", "ABCD", require_think_end=True) == (0.0, None)
    q = EvalQuestion("0", "q", ["B"], "choice", "ABCD", OPTIONS)
    assert grade(q, "\\boxed{Paris}") == (1.0, "B")


def test_avg_at_k():
    assert avg_at_k([[1, 0, 1, 1], [0, 0, 0, 1]]) == 0.5  # (3/4 + 1/4) / 2
    assert avg_at_k([[1], [0], [1]]) == pytest.approx(2 / 3)
    assert avg_at_k([[1, 1], [0, 0, 0, 1]]) == 0.625  # (1 + 1/4) / 2: each question weighs the same
    assert math.isnan(avg_at_k([]))


def test_parse_per_benchmark():
    assert parse_per_benchmark("4", int, "samples") == (4, {})
    assert parse_per_benchmark("aime24=32,amc=16", int, "samples") == (None, {"aime24": 32, "amc": 16})
    assert parse_per_benchmark("8, aime24=32", int, "samples") == (8, {"aime24": 32})
    assert parse_per_benchmark(None, int, "samples") == (None, {})
    with pytest.raises(ValueError, match="--samples"):
        parse_per_benchmark("aime24=x", int, "samples")


def test_paper_numbers_average_to_the_reported_ones():
    for row, scores in ev.PAPER_RESULTS.items():
        for group, names in (
            ("in_distribution", registry.IN_DISTRIBUTION),
            ("out_of_distribution", registry.OUT_OF_DISTRIBUTION),
        ):
            mean = sum(scores[n] for n in names) / len(names)
            assert abs(mean - ev.PAPER_REPORTED_AVERAGES[row][group]) < 0.05 + 1e-9, (row, group, mean)


# ---------------------------------------------------------------------------------------------------------------
# Registry and data
# ---------------------------------------------------------------------------------------------------------------
HUB = {  # name: (Hub id, config, split), as documented on the datasets' cards
    "aime24": ("HuggingFaceH4/aime_2024", None, "train"),
    "aime25": ("MathArena/aime_2025", None, "train"),
    "amc": ("AI-MO/aimo-validation-amc", None, "train"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "minerva": ("lkevinzc/math-eval", None, "minerva"),
    "olympiad": ("lkevinzc/math-eval", None, "olympiad_bench"),
    "arc_c": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "gpqa_diamond": ("Idavidrein/gpqa", "gpqa_diamond", "train"),
    "mmlu_pro": ("TIGER-Lab/MMLU-Pro", None, "test"),
}


def test_registry():
    assert list(BENCHMARKS) == list(HUB)
    assert {n: (b.hub.id, b.hub.config, b.hub.split) for n, b in BENCHMARKS.items()} == HUB
    assert registry.IN_DISTRIBUTION == ("aime24", "aime25", "amc", "math500", "minerva", "olympiad")
    assert registry.OUT_OF_DISTRIBUTION == ("arc_c", "gpqa_diamond", "mmlu_pro")
    assert {n: b.samples for n, b in BENCHMARKS.items() if b.samples != 1} == {"aime24": 32, "aime25": 32, "amc": 32}


def test_benchmarks_load_from_the_hub_by_name(monkeypatch):
    calls = []

    def fake_load(name_or_path, *, split="train", config=None):
        calls.append((name_or_path, config, split))
        bench = next(n for n, spec in HUB.items() if spec == (name_or_path, config, split))
        return load_raw_dataset(str(DATA / f"{bench}.jsonl"))

    monkeypatch.setattr(registry, "load_raw_dataset", fake_load)
    for name in BENCHMARKS:
        bench = load_benchmark(name)
        assert bench.source == {"hub_id": HUB[name][0], "config": HUB[name][1], "split": HUB[name][2]}
        assert len(bench.questions) == 2
    assert calls == list(HUB.values())

    def failing(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(registry, "load_raw_dataset", failing)
    with pytest.raises(RuntimeError, match=r"--data aime24=PATH"):
        load_benchmark("aime24")


def test_local_files_give_the_training_prompt_format():
    bench = load_benchmark("aime24", DATA / "aime24.jsonl")
    assert [q.id for q in bench.questions] == ["60", "61"] and bench.samples == 32
    assert bench.questions[0].prompt == luffy_messages("Find the remainder when $2^{10}$ is divided by $1000$.")
    assert bench.questions[0].prompt[0] == {"role": "system", "content": LUFFY_SYSTEM_PROMPT}
    assert bench.questions[0].answers == ["24"]
    # "" drops the system message; limit keeps the first questions
    bench = load_benchmark("math500", data_dir=DATA, system_prompt="", limit=1)
    assert [q.prompt for q in bench.questions] == [[{"role": "user", "content": "Simplify $\\frac{2}{4}$."}]]
    assert bench.questions[0].id == "test/prealgebra/1.json"
    assert [q.answers for q in load_benchmark("aime25", data_dir=DATA).questions] == [["70"], ["588"]]  # int64
    assert [q.answers for q in load_benchmark("amc", data_dir=DATA).questions] == [["27"], ["36"]]  # float64
    assert [q.answers for q in load_benchmark("olympiad", data_dir=DATA).questions] == [["\\sqrt{2}"], ["23"]]


def test_multiple_choice_rows():
    arc = load_benchmark("arc_c", data_dir=DATA, system_prompt="")
    assert [(q.id, q.answers, q.letters) for q in arc.questions] == [
        ("Mercury_0001", ["B"], "ABCD"),
        ("NYSEDREGENTS_0002", ["C"], "ABCD"),  # labels 1-4 re-lettered: answerKey "3" is C
    ]
    assert arc.questions[1].prompt[-1]["content"] == (
        "Which is a liquid at room temperature?\n\nA. iron\nB. salt\nC. water\nD. sand"
    )
    gpqa = load_benchmark("gpqa_diamond", data_dir=DATA, system_prompt="")
    for q, correct in zip(gpqa.questions, ["electron", "newton"]):
        assert q.options[q.letters.index(q.answers[0])] == correct
        assert sorted(q.options) == sorted(set(q.options)) and len(q.options) == 4
    # the shuffle is fixed by the question's text (SHA-256), the same on every run and machine
    assert [q.options for q in gpqa.questions] == [
        ["electron", "photon", "proton", "neutron"],
        ["joule", "watt", "pascal", "newton"],
    ]
    assert [q.answers for q in gpqa.questions] == [["A"], ["D"]]
    mmlu = load_benchmark("mmlu_pro", data_dir=DATA, system_prompt="")
    assert [(q.answers, q.letters) for q in mmlu.questions] == [(["C"], "ABCDEFGHIJ"), (["E"], "ABCDEFGH")]
    assert mmlu.questions[0].prompt[-1]["content"].endswith("\nC. 42\nD. 48\nE. 49\nF. 54\nG. 56\nH. 63\nI. 64\nJ. 72")


def test_custom_math_file_and_specs(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text('{"prompt": "37+48=", "answer": "85"}\n{"prompt": "1+1=", "answer": "2"}\n')
    bench = load_benchmark("toy", path)
    assert [(q.prompt, q.answers, q.kind) for q in bench.questions] == [
        ("37+48=", ["85"], "math"),
        ("1+1=", ["2"], "math"),
    ]
    assert bench.in_distribution is None
    assert parse_benchmark_spec("math500") == ("math500", None)
    assert parse_benchmark_spec(f"toy={path}") == ("toy", str(path))
    assert parse_benchmark_spec(str(path)) == ("toy", str(path))
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("toy")
    with pytest.raises(ValueError):
        parse_benchmark_spec("no_such_benchmark")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "solution": "y"}\n')
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['answer'\]"):
        load_benchmark("math500", bad)


# ---------------------------------------------------------------------------------------------------------------
# The harness with scripted completions (scores known exactly)
# ---------------------------------------------------------------------------------------------------------------
SCRIPT = {  # benchmark -> per question, its completions; hand-graded scores in the comments
    "aime24": [
        [r"<think>..</think> \boxed{24}", r"\boxed{25}", "The answer is 24", "no idea"],  # 1 0 1 0
        [r"\boxed{9} hmm \boxed{10}", r"\boxed{10} no wait \boxed{9}", r"<think>\boxed{9}</think>", "9"],  # 0 1 0 1
    ],  # avg@4 = 50.0
    "aime25": [[r"\boxed{70}"] * 4, [r"\boxed{587}"] * 4],  # 1, 0 -> 50.0
    "amc": [[r"\boxed{27}", r"\boxed{27.0}", r"\boxed{3^3}", r"\boxed{28}"], [r"\boxed{35}"] * 4],  # .75, 0 -> 37.5
    "math500": [[r"\boxed{0.5}"], [r"\boxed{8}"]],  # 1, 0 -> 50.0
    "minerva": [[r"\boxed{6}"], [r"\boxed{4}"]],  # 100.0
    "olympiad": [[r"\boxed{\sqrt{2}}"], [r"\boxed{23}"]],  # 100.0
    "arc_c": [[r"\boxed{B}", "Answer: C"], ["The answer is (C).", r"\boxed{water}"]],  # .5, 1 -> 75.0
    "gpqa_diamond": [[r"\boxed{A}", "I don't know"], [r"\boxed{D}", r"\boxed{newton}"]],  # .5, 1 -> 75.0
    "mmlu_pro": [["Answer: C"], [r"\boxed{E}"]],  # 100.0
}
SCRIPT_SAMPLES = "4,math500=1,minerva=1,olympiad=1,arc_c=2,gpqa_diamond=2,mmlu_pro=1"
EXPECTED = {
    "aime24": 50.0,
    "aime25": 50.0,
    "amc": 37.5,
    "math500": 50.0,
    "minerva": 100.0,
    "olympiad": 100.0,
    "arc_c": 75.0,
    "gpqa_diamond": 75.0,
    "mmlu_pro": 100.0,
}


class ScriptedGenerator:
    """Returns SCRIPT's completions; records the sampling settings it was asked for."""

    backend_name = "scripted"

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, *, n, temperature, top_p, max_new_tokens, seed=0, desc=None):
        self.calls.append(
            {
                "benchmark": desc,
                "n": n,
                "temperature": temperature,
                "top_p": top_p,
                "max_new_tokens": max_new_tokens,
                "prompts": len(prompt_ids),
            }
        )
        script = SCRIPT[desc]
        assert len(prompt_ids) == len(script) and all(len(s) == n for s in script)
        return [[Completion(text, 3, False) for text in texts] for texts in script]


def _args(*argv):
    return ev_cli.build_arg_parser().parse_args(list(argv))


def test_scripted_run_gives_the_hand_derived_table(tmp_path, tokenizer):
    generator = ScriptedGenerator()
    out = tmp_path / "out"
    args = _args(
        "--model",
        "some/model",
        "--name",
        "fake",
        "--data-dir",
        str(DATA),
        "--samples",
        SCRIPT_SAMPLES,
        "--temperature",
        "0.6,aime24=1.0",
        "--max-new-tokens",
        "64",
        "--output-dir",
        str(out),
    )
    report = ev_cli.run_evaluation(args, generator=generator, tokenizer=tokenizer)

    results = json.loads((out / "results.json").read_text())
    assert list(results["benchmarks"]) == list(BENCHMARKS)
    assert {n: r["score"] for n, r in results["benchmarks"].items()} == EXPECTED
    assert results["averages"]["in_distribution"] == {
        "score": pytest.approx((50 + 50 + 37.5 + 50 + 100 + 100) / 6),
        "benchmarks": list(registry.IN_DISTRIBUTION),
        "complete": True,
    }
    assert results["averages"]["out_of_distribution"]["score"] == pytest.approx(250 / 3)
    aime = results["benchmarks"]["aime24"]
    assert (aime["metric"], aime["samples"], aime["temperature"], aime["top_p"], aime["max_new_tokens"]) == (
        "avg@4",
        4,
        1.0,
        1.0,
        64,
    )
    assert [q["scores"] for q in aime["per_question"]] == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]]
    assert aime["answer_found_rate"] == 4 / 8  # a box after the last </think>: 2 of q60, 2 of q61
    assert results["benchmarks"]["math500"]["metric"] == "pass@1"
    assert results["benchmarks"]["arc_c"]["answer_found_rate"] == 1.0
    assert results["benchmarks"]["gpqa_diamond"]["answer_found_rate"] == 3 / 4  # "I don't know": no letter
    assert results["paper"]["results"] == ev.PAPER_RESULTS and results["backend"] == "scripted"
    # the generator was asked for the configured settings
    assert [(c["benchmark"], c["n"], c["temperature"]) for c in generator.calls][:4] == [
        ("aime24", 4, 1.0),
        ("aime25", 4, 0.6),
        ("amc", 4, 0.6),
        ("math500", 1, 0.6),
    ]

    md = (out / "results.md").read_text()
    assert md == report["markdown"]
    assert (
        "| Model | AIME24 | AIME25 | AMC | MATH-500 | Minerva | Olympiad | ID avg. | ARC-c | GPQA-D | MMLU-Pro "
        "| OOD avg. |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| On-policy (Dr.GRPO) (paper, Qwen2.5-Math-7B) | 24.9 | 15.5 | 59.2 | 84.8 | 38.2 | 49.3 | 45.3 | 82.6 "
        "| 37.4 | 49.2 | 56.4 |\n"
        "| ExGRPO (paper, Qwen2.5-Math-7B) | 31.6 | 18.7 | 66.3 | 87.4 | 36.0 | 50.1 | 48.3 | 84.7 | 37.4 | 52.9 "
        "| 58.3 |\n"
        "| **fake** | 50.0 | 50.0 | 37.5 | 50.0 | 100.0 | 100.0 | 64.6 | 75.0 | 75.0 | 100.0 | 83.3 |\n"
    ) in md
    assert "AIME24 avg@4 (2 questions)" in md and "MATH-500 pass@1 (2 questions)" in md

    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(records) == sum(len(s) * len(s[0]) for s in SCRIPT.values())
    assert records[1] == {
        "benchmark": "aime24",
        "id": "60",
        "sample": 1,
        "completion": r"\boxed{25}",
        "extracted": "25",
        "score": 0.0,
        "num_tokens": 3,
        "truncated": False,
    }


def test_partial_table_averages_the_paper_over_the_same_benchmarks(tmp_path, tokenizer):
    args = _args(
        "--model",
        "m",
        "--name",
        "fake",
        "--benchmarks",
        "aime24,math500,arc_c",
        "--data-dir",
        str(DATA),
        "--samples",
        "4,math500=1,arc_c=2",
        "--output-dir",
        str(tmp_path),
        "--no-completions",
    )
    report = ev_cli.run_evaluation(args, generator=ScriptedGenerator(), tokenizer=tokenizer)
    md = report["markdown"]
    assert "| Model | AIME24 | MATH-500 | ID avg.* | ARC-c | OOD avg.* |" in md
    assert "| ExGRPO (paper, Qwen2.5-Math-7B) | 31.6 | 87.4 | 59.5 | 84.7 | 84.7 |" in md  # (31.6 + 87.4) / 2
    assert "| **fake** | 50.0 | 50.0 | 50.0 | 75.0 | 75.0 |" in md
    assert "* Average over the benchmarks evaluated here" in md
    assert report["averages"]["in_distribution"]["complete"] is False
    assert not (tmp_path / "completions.jsonl").exists()


def test_bad_arguments(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="unknown benchmark 'nope'"):
        ev_cli.run_evaluation(
            _args("--model", "m", "--benchmarks", "nope", "--output-dir", str(tmp_path)),
            generator=ScriptedGenerator(),
            tokenizer=tokenizer,
        )
    with pytest.raises(ValueError, match="not evaluated"):
        ev_cli.run_evaluation(
            _args(
                "--model",
                "m",
                "--benchmarks",
                "aime24",
                "--samples",
                "amc=4",
                "--data-dir",
                str(DATA),
                "--output-dir",
                str(tmp_path),
            ),
            generator=ScriptedGenerator(),
            tokenizer=tokenizer,
        )


# ---------------------------------------------------------------------------------------------------------------
# The whole harness on a tiny local model
# ---------------------------------------------------------------------------------------------------------------
def test_whole_harness_on_a_tiny_model(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    assert (
        ev_cli.main(
            [
                "--model",
                tokenizer_dir,
                "--data-dir",
                str(DATA),
                "--samples",
                "2,math500=1",
                "--max-new-tokens",
                "4",
                "--system-prompt",
                "",
                "--backend",
                "transformers",
                "--batch-size",
                "8",
                "--output-dir",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["backend"] == "transformers" and list(results["benchmarks"]) == list(BENCHMARKS)
    records = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    questions = {
        (n, q.id): q for n in BENCHMARKS for q in load_benchmark(n, data_dir=DATA, system_prompt="").questions
    }
    for name, result in results["benchmarks"].items():
        k = 1 if name == "math500" else 2
        metric = "pass@1" if k == 1 else "avg@2"
        assert (result["samples"], result["num_questions"], result["metric"]) == (k, 2, metric)
        mine = [r for r in records if r["benchmark"] == name]
        assert len(mine) == 2 * k
        for r in mine:  # every stored score is what grading the stored text gives
            assert r["score"] == grade(questions[(name, r["id"])], r["completion"]).score
            assert 1 <= r["num_tokens"] <= 4 and (not r["truncated"] or r["num_tokens"] == 4)
        per_q = [[r["score"] for r in mine if r["id"] == q["id"]] for q in result["per_question"]]
        assert [q["scores"] for q in result["per_question"]] == per_q
        assert result["score"] == pytest.approx(100 * avg_at_k(per_q))
    md = (out / "results.md").read_text()
    assert md.splitlines()[2].startswith("| Model | AIME24 | AIME25 | AMC | MATH-500 | Minerva | Olympiad | ID avg. |")
    assert f"| **{Path(tokenizer_dir).name}** |" in md


def test_transformers_generator_is_seeded_and_leaves_the_global_rng_alone(tokenizer_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tokenizer_dir)
    gen = ev.TransformersGenerator(model, tokenizer, batch_size=4, progress=False)
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "5+5=")]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = gen.generate(ids, n=3, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    b = gen.generate(ids, n=3, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=7)
    assert a == b and [len(x) for x in a] == [3, 3]
    assert all(c.num_tokens <= 5 and (not c.truncated or c.num_tokens == 5) for x in a for c in x)
    greedy = gen.generate(ids, n=2, temperature=0.0, top_p=1.0, max_new_tokens=5)
    assert greedy[0][0] == greedy[0][1]


def test_eval_subcommand_is_registered(capsys):
    from exgrpo_trl import cli

    assert cli.SUBCOMMANDS["eval"][0] == "exgrpo_trl.cli.evaluate"
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--help"])
    assert exc.value.code == 0
    assert "--benchmarks" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# In-training validation
# ---------------------------------------------------------------------------------------------------------------
def _toy_validation_set(n: int = 4) -> LoadedBenchmark:
    from exgrpo_trl.tasks.toy import addition_dataset

    rows = addition_dataset(n, max_digits=2, seed=5)
    questions = [EvalQuestion(str(i), p, [a]) for i, (p, a) in enumerate(zip(rows["prompt"], rows["answer"]))]
    return LoadedBenchmark("toy", "toy", "math", questions)


def _train(tmp_path, tokenizer, validate: bool):
    from exgrpo_trl.eval.callback import ValidationCallback
    from tests.helpers import make_trainer

    trainer = make_trainer(tmp_path, tokenizer, max_steps=4, replay_start_pass_rate=0.0)
    seen = []
    if validate:
        callback = ValidationCallback([_toy_validation_set()], steps=2, samples=2, max_new_tokens=4)
        callback.attach(trainer)
        original = callback.validate

        def validate_and_check():
            before = trainer.exgrpo_state.buffer.state_dict()
            metrics = original()
            after = trainer.exgrpo_state.buffer.state_dict()
            seen.append((before, after, trainer.model.training))
            return metrics

        callback.validate = validate_and_check
    trainer.train()
    return trainer, seen


def _same_buffer(a, b) -> bool:
    import numpy as np

    (arrays_a, meta_a), (arrays_b, meta_b) = a, b
    return (
        meta_a == meta_b
        and arrays_a.keys() == arrays_b.keys()
        and all(np.array_equal(arrays_a[k], arrays_b[k]) for k in arrays_a)
    )


def test_validation_callback_logs_and_leaves_buffer_and_training_untouched(tmp_path, tokenizer):
    import torch

    plain, _ = _train(tmp_path / "plain", tokenizer, validate=False)
    validated, seen = _train(tmp_path / "validated", tokenizer, validate=True)

    # validation ran at steps 2 and 4, logged eval/toy/... through the trainer's log history
    logs = [e for e in validated.state.log_history if "eval/toy/accuracy" in e]
    assert [e["step"] for e in logs] == [2, 4]
    for e in logs:
        assert 0.0 <= e["eval/toy/accuracy"] <= 1.0 and 0.0 <= e["eval/toy/clipped_ratio"] <= 1.0
        assert 1.0 <= e["eval/toy/mean_completion_length"] <= 4.0
        assert not any(k.startswith(("rewards/", "loss")) for k in e)  # training metrics stay in their own entries
    # the buffer was in use (replay on from step 1) and validation did not change it
    assert validated.exgrpo_state.buffer.num_trajectories > 0
    assert len(seen) == 2 and all(_same_buffer(before, after) and training for before, after, training in seen)
    # and training went exactly as without validation: same buffer, same weights, same logged training metrics
    assert _same_buffer(plain.exgrpo_state.buffer.state_dict(), validated.exgrpo_state.buffer.state_dict())
    for (name, p), (_, q) in zip(plain.model.named_parameters(), validated.model.named_parameters()):
        assert torch.equal(p, q), name
    train_logs = lambda t: [  # noqa: E731
        {k: v for k, v in e.items() if "time" not in k and "runtime" not in k and "per_second" not in k}
        for e in t.state.log_history
        if "loss" in e
    ]
    assert [e["step"] for e in validated.state.log_history if "loss" in e] == [1, 2, 3, 4]  # none dropped
    assert train_logs(plain) == train_logs(validated)


def test_validation_scores_are_the_graders(tmp_path, tokenizer, monkeypatch):
    """With a scripted generator the logged accuracy is exactly the hand-derived avg@k."""
    from types import SimpleNamespace

    from exgrpo_trl.eval import callback as callbacks
    from exgrpo_trl.eval.callback import ValidationCallback

    class Scripted:
        def __init__(self, *args, **kwargs):
            pass

        def generate(self, prompt_ids, *, n, **kwargs):
            # question i: the first i+1 of n samples right ("85"-style exact answers via math-verify)
            return [[Completion(a if s <= i else "0", 2, False) for s in range(n)] for i, a in enumerate(answers)]

    bench = _toy_validation_set(3)
    answers = [q.answers[0] for q in bench.questions]
    monkeypatch.setattr(callbacks, "TransformersGenerator", Scripted)
    from accelerate import Accelerator

    from tests.helpers import make_model

    model = make_model(tokenizer)
    model.gradient_checkpointing_enable()
    logged = []
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=10),
        processing_class=tokenizer,
        model_wrapped=model,
        accelerator=Accelerator(cpu=True),
        add_callback=lambda cb: None,
        control=SimpleNamespace(should_log=True),
        args=SimpleNamespace(ds3_gather_for_generation=True, gradient_checkpointing_kwargs={"use_reentrant": False}),
    )
    monkeypatch.setattr(callbacks.Trainer, "log", lambda self, logs: logged.append(logs))
    callback = ValidationCallback([bench], steps=10, samples=3, max_new_tokens=4).attach(trainer)
    metrics = callback.validate()
    assert metrics["eval/toy/accuracy"] == pytest.approx((1 / 3 + 2 / 3 + 3 / 3) / 3)
    assert metrics["eval/toy/answer_found_rate"] == 0.0  # no boxes
    assert metrics["eval/toy/clipped_ratio"] == 0.0 and metrics["eval/toy/mean_completion_length"] == 2.0
    assert logged == [metrics]
    assert trainer.control.should_log is True  # the step's own training log is not cancelled
    assert model.is_gradient_checkpointing  # switched off for generation, back on afterwards
    assert callback.validate() == {}  # never twice for one step


def test_train_script_wires_validation(tmp_path):
    """`exgrpo train` with validation_dataset: eval/<name>/accuracy lands in trainer_state.json every N steps."""
    from exgrpo_trl.cli.train import parse_args, train
    from exgrpo_trl.tasks.toy import addition_splits, build_tiny_model_dir

    toy = tmp_path / "toy"
    build_tiny_model_dir(toy)
    train_set, eval_set = addition_splits(32, 4, seed=0)
    train_set.to_json(str(toy / "train.jsonl"))
    eval_set.to_json(str(toy / "eval.jsonl"))
    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
    out = tmp_path / "out"
    script_args, training_args, model_args = parse_args(
        [
            "--config",
            str(tiny),
            "--model_name_or_path",
            str(toy),
            "--dataset_name",
            str(toy / "train.jsonl"),
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--logging_steps",
            "1",
            "--per_device_train_batch_size",
            "16",
            "--generation_batch_size",
            "32",
            "--validation_dataset",
            f"addition={toy / 'eval.jsonl'}",
            "--validation_steps",
            "1",
            "--validation_samples",
            "2",
            "--disable_tqdm",
            "true",
        ]
    )
    assert script_args.validation_dataset == [f"addition={toy / 'eval.jsonl'}"]
    assert (script_args.validation_steps, script_args.validation_samples) == (1, 2)
    assert train(script_args, training_args, model_args) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    logs = [e for e in state["log_history"] if "eval/addition/accuracy" in e]
    assert [e["step"] for e in logs] == [1, 2]
    assert all(e["eval/addition/mean_completion_length"] <= 8 for e in logs)  # the recipe's max_completion_length


def test_a_table_of_local_benchmarks_only_has_no_paper_rows():
    """`exgrpo eval` on a local benchmark printed the paper's two rows filled with dashes, nothing of theirs to set
    beside it. With one of the paper's benchmarks in the run, its rows are there (checked above)."""
    from exgrpo_trl.eval.report import markdown_table

    local = {"mine": {"score": 40.0, "metric": "pass@1", "num_questions": 5, "title": "Mine"}}
    md = markdown_table(local, "run")
    assert md.splitlines()[:3] == ["| Model | Mine |", "|---|---:|", "| **run** | 40.0 |"]
    assert "paper" not in md
