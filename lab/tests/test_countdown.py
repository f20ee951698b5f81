"""Unit tests of the countdown task (lab.countdown): verifier, solver, data, tokenizer, warm start,
evaluation."""

from __future__ import annotations

import ast
import random
import re
import time
from collections import Counter

import pytest
import torch
from datasets import Dataset

from exgrpo_trl.tasks import toy
from lab import countdown
from lab import warm_start as warm_start_cache
from lab.countdown import (
    COUNTDOWN_ALPHABET,
    count_expressions,
    countdown_dataset,
    countdown_reward,
    countdown_splits,
    distinct_correct,
    evaluate_countdown,
    is_held_out,
    min_numbers_needed,
    parse_expression,
    random_expression,
    solve,
)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def score(completion, numbers=(2, 3, 7), target=13) -> float:
    return countdown_reward([completion], [list(numbers)], [target])[0]


# ---------------------------------------------------------------- verifier
@pytest.mark.parametrize(
    "completion",
    ["2*3+7", "3*2+7", "7+2*3", "7+3*2", "(2*3)+7", "((2*3)+7)", " 2*3+7\n", "2*3+7<eos><pad><pad>", "2*3+7<eos>9"],
)
def test_reward_accepts_valid_forms(completion):
    assert score(completion) == 1.0


def test_reward_accepts_subsets_parentheses_and_conversational():
    assert score("3+7", target=10) == 1.0  # a subset of the numbers
    assert score("(7-2)*3", target=15) == 1.0  # parentheses that change the value
    assert score("7-2*3", target=1) == 1.0  # precedence: 7-(2*3), not (7-2)*3
    assert score("7-3-2", target=2) == 1.0  # left associative: (7-3)-2, not 7-(3-2) = 6
    assert score("7-(3-2)", target=6) == 1.0
    assert score([{"role": "assistant", "content": "2*3+7"}]) == 1.0
    # dataset cells as strings, the numbers as a list string or a prompt
    assert countdown_reward(["2*3+7", "2*3+7"], ["2,3,7", "2,3,7:13="], ["13", 13]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("completion", "why"),
    [
        ("2+3+7", "wrong value (12)"),
        ("7*2", "wrong value (14)"),
        ("7+3+3", "3 used twice, given once"),
        ("6+7", "6 not given"),
        ("13", "13 not given"),
        ("26/2", "division"),
        ("2*3+7/1", "division"),
        ("(2*3+7", "unbalanced"),
        ("2*3+7)", "unbalanced"),
        (")2*3+7(", "unbalanced"),
        ("2*3+7=13", "other character"),
        ("2*3 +7", "whitespace inside"),
        ("2**3+7", "no power"),
        ("2*3++7", "no unary plus"),
        ("-2+3*5", "no unary minus"),
        ("07+2*3", "leading zero"),
        ("2*3+7.0", "integers only"),
        ("2(3)+7", "no implicit multiplication"),
        ("()", "empty parentheses"),
        ("", "empty"),
        ("   \n", "empty after stripping"),
        ("<eos>2*3+7", "empty before <eos>"),
        ("abc", "garbage"),
        ("２*3+7", "fullwidth digit"),
        ("٢*3+7", "Arabic-Indic digit"),
        ("2²+7+2", "superscript"),
        ("2×3+7", "multiplication sign"),
        ("2*3+7🙂", "emoji"),
        ("2*3+7\x00", "NUL"),
        (None, "not a string"),
        (b"2*3+7", "bytes"),
    ],
)
def test_reward_rejects(completion, why):
    assert score(completion) == 0.0, why


def test_reward_multiset_numbers():
    assert score("7+3+3", numbers=(3, 3, 7)) == 1.0  # given twice, used twice
    assert score("7+3+3+3", numbers=(3, 3, 7), target=16) == 0.0  # used three times
    assert countdown_reward(["3+5"], ["x,y"], [8]) == [0.0]  # malformed numbers cell
    assert countdown_reward(["3+5"], [[3, 5]], ["eight"]) == [0.0]  # malformed target cell


def test_reward_length_and_nesting_limits():
    ones = "+".join(["1"] * 31)  # 61 characters
    at_limit, over = ones + "+10", ones + "+100"
    assert (len(at_limit), len(over)) == (64, 65)
    assert countdown_reward([at_limit], [[1] * 31 + [10]], [41]) == [1.0]
    assert countdown_reward([over], [[1] * 31 + [100]], [131]) == [0.0]  # valid, but longer than 64
    assert score("(" * 8 + "7" + ")" * 8, target=7) == 1.0  # 8 levels: the bound
    assert score("(" * 9 + "7" + ")" * 9, target=7) == 0.0


def test_reward_huge_inputs_are_cheap():
    huge = ["7" * 10_000, "1+" * 5_000 + "1", "(" * 10_000, "x" * 1_000_000]
    start = time.perf_counter()
    assert countdown_reward(huge, [[7]] * 4, [7] * 4) == [0.0] * 4
    assert time.perf_counter() - start < 0.05  # rejected on length, before parsing


def _oracle(text: str):
    """The value by Python's own parser (ast, not eval) of an expression in the verifier's grammar, or None."""
    if set(text) - set("0123456789+-*()"):  # Python also reads "0x1", "1_0", "2 3"...
        return None
    if re.search(r"(?<![0-9])0[0-9]", text):  # Python reads "00" as 0; the grammar has no leading zeros
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub, ast.Mult):
            a, b = value(node.left), value(node.right)
            if a is None or b is None:
                return None
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        return None

    return value(tree)


def test_parser_agrees_with_python_on_random_and_mutated_expressions():
    rng = random.Random(0)
    chars = "0123456789+-*()/ x"
    n_valid = 0
    for _ in range(3000):
        text = random_expression(rng, [rng.randint(0, 12) for _ in range(rng.randint(1, 5))])
        for _ in range(rng.choice((0, 0, 1, 2))):  # mutate: insert, delete or replace one character
            i = rng.randrange(len(text) + 1)
            op = rng.choice("idr")
            if op == "i":
                text = text[:i] + rng.choice(chars) + text[i:]
            elif op == "d":
                text = text[:i] + text[i + 1 :]
            else:
                text = text[:i] + rng.choice(chars) + text[i + 1 :]
        parsed = parse_expression(text)
        expected = _oracle(text) if text else None
        assert (parsed[0] if parsed else None) == expected, text
        if parsed:
            n_valid += 1
            assert sorted(parsed[1]) == sorted(int(t) for t in re.findall(r"[0-9]+", text))
    assert 1500 < n_valid < 3000  # both kinds were exercised


# ---------------------------------------------------------------- expressions and solver
def test_random_expression_minimal_parentheses():
    assert countdown._join("-", "7", 3, "3-2", 1) == "7-(3-2)"  # changes the value without them
    assert countdown._join("+", "7", 3, "3-2", 1) == "7+3-2"  # same value without them
    assert countdown._join("*", "2+3", 1, "4*5", 2) == "(2+3)*4*5"
    assert countdown._join("-", "2*3", 2, "4*5", 2) == "2*3-4*5"
    rng = random.Random(1)
    for _ in range(500):
        numbers = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
        text = random_expression(rng, numbers)
        value, used = parse_expression(text)
        assert used == numbers  # every number once, in the given order
        assert text.count("(") <= max(0, len(numbers) - 2)  # only non-root inner nodes may need a pair


def test_solver_hand_cases():
    assert solve([2, 3]) == {1: {2, 3}, 2: {5, -1, 1, 6}}
    # 13 from 2, 3, 7 needs all three (2*3+7); 21 = 3*7 and 10 = 3+7 need two
    assert (min_numbers_needed([2, 3, 7], 13), min_numbers_needed([2, 3, 7], 21)) == (3, 2)
    assert min_numbers_needed([2, 3, 7], 10) == 2
    assert min_numbers_needed([1, 1, 2], 50) is None  # the most is (1+1)*2 = 4
    assert min_numbers_needed([3, 3, 5, 9], 9) == 1


def test_count_expressions_hand_cases():
    assert count_expressions([1, 2], 3) == 2  # 1+2, 2+1
    assert count_expressions([2, 2], 4) == 2  # 2+2, 2*2 (each order gives the same string)
    # 2*3+7 is the only way to 13; with its commutations written minimally: 2*3+7, 3*2+7, 7+2*3, 7+3*2
    assert count_expressions([2, 3, 7], 13) == 4
    assert count_expressions([2, 3, 7], 50) == 0


# ---------------------------------------------------------------- data
def test_dataset_every_question_solvable_and_consistent():
    ds = countdown_dataset(400, seed=3)
    assert ds.column_names == ["prompt", "numbers", "target", "operands", "difficulty", "answer"]
    assert len(set(ds["prompt"])) == 400
    assert countdown_reward(ds["answer"], ds["numbers"], ds["target"]) == [1.0] * 400
    for row in ds:
        numbers, target = row["numbers"], row["target"]
        assert row["prompt"] == ",".join(map(str, numbers)) + f":{target}="
        assert numbers == sorted(numbers) and all(1 <= n <= 9 for n in numbers)
        assert len(numbers) == row["operands"] in (3, 4)
        assert 10 <= target <= 99 and target not in numbers
        assert row["difficulty"] == min_numbers_needed(numbers, target) <= row["operands"]
        assert len(parse_expression(row["answer"])[1]) >= row["difficulty"]
        assert len(row["answer"]) + 1 <= countdown.COUNTDOWN_MAX_COMPLETION  # fits with <eos>
    # difficulty drawn uniformly from 2, 3, 4: 133 each, sd ~9.4; 90..180 is more than 4 sd either way
    counts = Counter(ds["difficulty"])
    assert set(counts) == {2, 3, 4} and all(90 <= c <= 180 for c in counts.values()), counts
    assert set(ds.filter(lambda r: r["difficulty"] == 4)["operands"]) == {4}


def test_dataset_deterministic_and_splits_held_out():
    a = countdown_dataset(50, seed=7)
    assert a.to_dict() == countdown_dataset(50, seed=7).to_dict()
    assert a["prompt"] != countdown_dataset(50, seed=8)["prompt"]
    train, eval_ = countdown_splits(300, 100, seed=0)
    assert all(map(is_held_out, eval_["prompt"])) and not any(map(is_held_out, train["prompt"]))
    assert not set(train["prompt"]) & set(eval_["prompt"])
    three = countdown_dataset(30, seed=0, operands=(3,))
    assert set(three["operands"]) == {3} and set(three["difficulty"]) == {2, 3}
    with pytest.raises(ValueError):
        countdown_dataset(1, operands=(1, 3))
    # two numbers from 1-9 reach 10..99 only by + or * (a difference is at most 8): 57 questions, 9 held out
    pairs = {f"{a},{b}:{v}=" for a in range(1, 10) for b in range(a, 10) for v in (a + b, a * b) if 10 <= v <= 99}
    assert len(pairs) == 57
    assert set(countdown_dataset(57, seed=0, operands=(2,))["prompt"]) == pairs
    assert len(countdown_dataset(9, seed=0, operands=(2,), held_out=True)) == 9
    with pytest.raises(ValueError):
        countdown_dataset(58, seed=0, operands=(2,))
    with pytest.raises(ValueError):
        countdown_dataset(10, seed=0, operands=(2,), held_out=True)


def test_held_out_partition_and_supervised_examples():
    # pinned: the calibrated pass@1 figures are on this partition; changing it changes what "held out" means
    prompts = ["2,3,7:13=", "1,5,8,9:50=", "1,2,3:10=", "2,4,6:20=", "3,5,9:40=", "1,1,9:11=", "4,4,4:48="]
    assert [is_held_out(p) for p in prompts] == [True, False, False, True, True, False, True]
    rng = random.Random(0)
    examples = [countdown.countdown_example(rng) for _ in range(300)]
    assert not any(is_held_out(p) for p, _ in examples)  # the warm start never sees an eval question
    numbers = [[int(x) for x in p.split(":")[0].split(",")] for p, _ in examples]
    targets = [int(p.split(":")[1][:-1]) for p, _ in examples]
    assert countdown_reward([a for _, a in examples], numbers, targets) == [1.0] * 300
    rng = random.Random(0)
    assert [countdown.countdown_example(rng) for _ in range(300)] == examples  # rng only


def test_reward_logs_accuracy_by_difficulty():
    logged = []
    rewards = countdown_reward(
        ["3+7", "2*3+7", "7", "3*7"],
        numbers=[[2, 3, 7]] * 4,
        target=[10, 13, 13, 21],
        difficulty=[2, 3, 3, 2],
        prompt=["ignored"] * 4,
        log_metric=lambda name, value: logged.append((name, value)),
    )
    assert rewards == [1.0, 1.0, 0.0, 1.0]
    assert logged == [("accuracy/difficulty_2", 1.0), ("accuracy/difficulty_3", 0.5)]


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_extends_addition_ids_and_round_trips():
    tok = toy.build_char_tokenizer(alphabet=COUNTDOWN_ALPHABET)
    addition = toy.build_char_tokenizer()
    assert len(tok) == 22
    assert {k: v for k, v in tok.get_vocab().items() if k in addition.get_vocab()} == addition.get_vocab()
    text = "1,5,8,9:50=(9+1)*5-8"
    ids = tok(text)["input_ids"]
    # 0-9 -> 4..13, "+" 14, "=" 15 as in addition; then "-" 16, "*" 17, "(" 18, ")" 19, "," 20, ":" 21
    assert ids == [5, 20, 9, 20, 12, 20, 13, 21, 9, 4, 15, 18, 13, 14, 5, 19, 17, 9, 16, 12]
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    assert tok.batch_decode([ids]) == [text]


def test_supervised_batch_with_countdown_examples():
    tok = toy.build_char_tokenizer(alphabet=COUNTDOWN_ALPHABET)
    batch = toy._supervised_batch(tok, random.Random(0), 16, 1, 4, countdown.countdown_example)
    assert tok.unk_token_id not in batch["input_ids"].tolist()[0]
    for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"], batch["labels"]):
        text = tok.decode(ids[mask.bool()])
        prompt, answer = text.split("=")
        assert prompt.count(":") == 1 and answer.endswith("<eos>")
        assert int((labels != -100).sum()) == len(answer) - len("<eos>") + 1  # answer characters + <eos>
        assert tok.decode(labels[labels != -100]) == answer


# ---------------------------------------------------------------- warm start
def test_warm_start_cache_hit(tmp_path, monkeypatch):
    kw = dict(seed=1, batch_size=8, hidden_size=64, num_heads=1, num_layers=1, intermediate_size=64)
    assert not countdown.countdown_warm_start_is_cached(tmp_path, 3, **kw)
    model, tok = countdown.countdown_warm_start(tmp_path, 3, progress=False, **kw)
    assert countdown.countdown_warm_start_is_cached(tmp_path, 3, **kw)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].name.startswith("warm-start-countdown-v1-3steps-seed1-")
    assert len(tok) == 22 and model.config.vocab_size == 22
    # the same settings without the task are an addition entry, another key
    assert not warm_start_cache.warm_start_is_cached(tmp_path, steps=3, **kw)

    def boom(*args, **kwargs):
        raise AssertionError("warm start trained again on a cache hit")

    monkeypatch.setattr(warm_start_cache, "warm_start", boom)
    again, tok2 = countdown.countdown_warm_start(tmp_path, 3, progress=False, **kw)
    assert again.warm_start_path == model.warm_start_path
    sd, sd2 = model.state_dict(), again.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert tok2("2,3,7:13=2*3+7")["input_ids"] == tok("2,3,7:13=2*3+7")["input_ids"]
    with pytest.raises(AssertionError, match="trained again"):
        countdown.countdown_warm_start(tmp_path, 4, progress=False, **kw)


def test_named_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(countdown, "load_or_train_warm_start", lambda cache_dir, **kw: calls.append(kw))
    countdown.countdown_warm_start("d", "weak")
    countdown.countdown_warm_start("d", hidden_size=64)
    assert [c["steps"] for c in calls] == [200, 2000]  # the calibrated steps; "medium" is the default
    assert calls[0]["task"] is countdown.COUNTDOWN_TASK and calls[0]["seed"] == 0
    assert (calls[0]["num_heads"], calls[0]["hidden_size"], calls[1]["hidden_size"]) == (4, 128, 64)
    with pytest.raises(KeyError):
        countdown.countdown_warm_start("d", "strong")


# ---------------------------------------------------------------- evaluation
class _ScriptedModel(torch.nn.Module):
    """A causal-LM stand-in whose `generate` returns scripted completions for each prompt, in order."""

    def __init__(self, tokenizer, script):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tok = tokenizer
        self.script = script  # prompt -> list of completions, one per sample

    def generate(self, input_ids, attention_mask, num_return_sequences, max_new_tokens, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            texts = self.script[self.tok.decode(ids[mask.bool()])]
            assert len(texts) == num_return_sequences
            for text in texts:
                new = self.tok(text)["input_ids"] + [self.tok.eos_token_id]
                rows.append(ids.tolist() + (new + [self.tok.pad_token_id] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(rows)


def test_evaluate_countdown_aggregates_exactly():
    tok = toy.build_char_tokenizer(alphabet=COUNTDOWN_ALPHABET)
    ds = Dataset.from_dict(
        {
            "prompt": ["2,3,7:13=", "3,7,9:21=", "1,2,3,4:25=", "5,5,9:50="],
            "numbers": [[2, 3, 7], [3, 7, 9], [1, 2, 3, 4], [5, 5, 9]],
            "target": [13, 21, 25, 50],
            "operands": [3, 3, 4, 3],
            "difficulty": [3, 2, 4, 3],
            "answer": ["2*3+7", "3*7", "(4+1)*(3+2)", "5*9+5"],
        }
    )
    script = {
        "2,3,7:13=": ["2*3+7", "7+2*3", "2*3+7", "2+3"],  # 3 correct, 2 distinct
        "3,7,9:21=": ["3*7", "7*3", "9+9+3", "(3*7)"],  # 3 correct ("9+9+3" reuses 9), 3 distinct
        "1,2,3,4:25=": ["(4+1)*(3+2)", "(1+4)*(2+3)", "4*3*2+1", "(4+1)*(3+2)"],  # 4 correct, 3 distinct
        "5,5,9:50=": ["5*5", "5*9", "", "((("],  # none
    }
    model = _ScriptedModel(tok, script)
    res = evaluate_countdown(model, tok, ds, samples=4, batch_size=8, progress=False)
    assert res["per_question"] == [0.75, 0.75, 1.0, 0.0]
    assert res["by_difficulty"] == {2: 0.75, 3: 0.375, 4: 1.0}  # min_numbers_needed: 3, 2, 4, 3
    assert res["by_operands"] == {3: 0.5, 4: 1.0}
    assert res["overall"] == 0.625
    assert res["completions"] == [script[p] for p in ds["prompt"]]
    # questions with 2..7 correct of 4: the first three (2, 3 and 3 distinct); with 2..3 correct: the first two
    assert distinct_correct(ds, res["completions"]) == (pytest.approx(8 / 3, abs=1e-12), 3)
    assert distinct_correct(ds, res["completions"], max_correct=3) == (2.5, 2)


def test_calibration_cli_prints_one_json_line_per_start(tmp_path, capsys):
    import json

    args = ["--cache-dir", str(tmp_path), "--steps", "1", "2", "--eval-questions", "4", "--samples", "2"]
    assert countdown.main([*args, "--no-progress"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["steps"] for line in lines] == [1, 2]
    assert set(lines[0]) >= {"pass_at_1", "by_difficulty", "by_operands", "warm_start_s", "distinct_correct_2_7"}
    assert len(list(tmp_path.iterdir())) == 2


def test_never_solved_shares_by_hand(monkeypatch):
    from datasets import Dataset

    questions = Dataset.from_dict({"numbers": [[1, 2, 3], [2, 5, 7]], "target": [9, 70]})
    # question 0: its 2nd and 4th samples solve it ((1+2)*3 = 9); question 1: never ("2*5" is 10, "7*2" is 14)
    texts = [["1+2", "(1+2)*3", "3*2", "3*(2+1)"], ["2*5", "7*2", "2+5", "x"]]
    monkeypatch.setattr(countdown, "evaluate_countdown", lambda *a, **k: {"overall": 0.25, "completions": texts})
    found = countdown.never_solved_shares(None, None, questions, samples=4, seed=0, within=(1, 2))
    # within 1 sample both are unsolved; within 2 (and all 4) only question 1
    assert found == {"pass_at_1": 0.25, "never_solved_within": {1: 1.0, 2: 0.5, 4: 0.5}}
