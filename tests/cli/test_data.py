"""Data loading in the paper's prompt format, on small local files with the schema of OpenR1-Math-46k."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import Dataset

from exgrpo_trl.tasks.math_data import (
    LUFFY_SYSTEM_PROMPT,
    OPENR1_MATH_46K,
    filter_long_prompts,
    load_math_dataset,
    load_raw_dataset,
    luffy_messages,
    to_math_prompts,
)

DATA = Path(__file__).parents[1] / "data"
OPENR1_SAMPLE = DATA / "openr1_math_46k_sample.jsonl"
QA_SAMPLE = DATA / "qa_sample.jsonl"


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_default_dataset_is_the_papers():
    assert OPENR1_MATH_46K == "Elliott/Openr1-Math-46k-8192"


def test_luffy_system_prompt_text():
    assert LUFFY_SYSTEM_PROMPT.startswith("Your task is to follow a systematic, thorough reasoning process")
    # real newlines inside the quoted format, a literal backslash before boxed
    assert 'using the format: "<think>\n {thoughts} </think>\n".' in LUFFY_SYSTEM_PROMPT
    assert 'After "</think>\n," in the Solution section' in LUFFY_SYSTEM_PROMPT
    assert "include the answer in \\boxed{} for closed-form results" in LUFFY_SYSTEM_PROMPT
    assert LUFFY_SYSTEM_PROMPT.endswith("like multiple choices or mathematical solutions.")


def test_sample_file_has_the_openr1_schema():
    raw = load_raw_dataset(str(OPENR1_SAMPLE))
    assert raw.column_names == ["data_source", "prompt", "target", "ability", "reward_model", "extra_info"]
    assert [m["role"] for m in raw[0]["prompt"]] == ["system", "user"]
    assert set(raw[0]["reward_model"]) == {"ground_truth", "style"}


def test_openr1_rows_keep_their_prompt_and_take_the_ground_truth():
    rows = _rows(OPENR1_SAMPLE)
    ds = load_math_dataset(str(OPENR1_SAMPLE))
    assert ds.column_names == ["prompt", "answer"]  # the R1 trajectory (`target`) and metadata are dropped
    assert len(ds) == len(rows) == 6
    for got, row in zip(ds, rows):
        assert got["answer"] == row["reward_model"]["ground_truth"]
        assert [(m["role"], m["content"]) for m in got["prompt"]] == [(m["role"], m["content"]) for m in row["prompt"]]
    assert ds[1]["answer"] == "\\frac{1}{2}"
    assert ds[1]["prompt"][0]["content"] == LUFFY_SYSTEM_PROMPT
    assert ds[1]["prompt"][1]["content"] == "Simplify $\\frac{3}{4} - \\frac{1}{4}$."


def test_parquet_and_saved_folder_load_the_same(tmp_path):
    reference = load_math_dataset(str(OPENR1_SAMPLE))
    raw = load_raw_dataset(str(OPENR1_SAMPLE))
    raw.to_parquet(str(tmp_path / "train.parquet"))
    raw.save_to_disk(str(tmp_path / "saved"))
    for source in (tmp_path / "train.parquet", tmp_path / "saved"):
        assert load_math_dataset(str(source)).to_list() == reference.to_list()


def test_unreadable_file_type(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="cannot read"):
        load_raw_dataset(str(path))


def test_question_answer_dataset_gets_the_papers_prompt():
    ds = load_math_dataset(str(QA_SAMPLE), question_column="problem", answer_column="final_answer")
    assert ds.column_names == ["prompt", "answer"]
    assert ds[0]["prompt"] == [
        {"role": "system", "content": LUFFY_SYSTEM_PROMPT},
        {"role": "user", "content": "If 3 pencils cost 45 cents, how many cents do 7 pencils cost?"},
    ]
    assert ds["answer"] == ["105", "2", "55"]
    # the question column is found by name when not given ("problem")
    assert load_math_dataset(str(QA_SAMPLE), answer_column="final_answer").to_list() == ds.to_list()


def test_missing_columns_name_the_column_and_list_the_columns():
    expected_columns = "['problem', 'final_answer', 'source']"
    with pytest.raises(ValueError) as err:
        load_math_dataset(str(QA_SAMPLE))  # no 'answer', no reward_model
    assert "answer column 'answer'" in str(err.value) and expected_columns in str(err.value)
    with pytest.raises(ValueError) as err:
        load_math_dataset(str(QA_SAMPLE), answer_column="solution")
    assert "answer column 'solution'" in str(err.value) and expected_columns in str(err.value)
    with pytest.raises(ValueError) as err:
        load_math_dataset(str(QA_SAMPLE), question_column="question", answer_column="final_answer")
    assert "question column 'question'" in str(err.value) and expected_columns in str(err.value)
    no_question = Dataset.from_dict({"text": ["1+1"], "answer": ["2"]})
    with pytest.raises(ValueError) as err:
        to_math_prompts(no_question)
    assert "question column 'question'" in str(err.value) and "['text', 'answer']" in str(err.value)
    with pytest.raises(ValueError) as err:
        load_math_dataset(str(QA_SAMPLE), answer_column="final_answer", keep_columns=["difficulty"])
    assert "'difficulty'" in str(err.value) and expected_columns in str(err.value)


def test_keep_columns_and_system_prompt_override():
    ds = load_math_dataset(str(QA_SAMPLE), answer_column="final_answer", keep_columns=["source"], system_prompt="")
    assert ds.column_names == ["source", "prompt", "answer"]
    assert ds["source"] == ["gsm-like", "number-theory", "arithmetic"]
    assert [m["role"] for m in ds[0]["prompt"]] == ["user"]  # "" means no system message

    replaced = load_math_dataset(str(OPENR1_SAMPLE), system_prompt="Be brief.")
    assert [(m["role"], m["content"]) for m in replaced[0]["prompt"]] == [
        ("system", "Be brief."),
        ("user", "What is the sum of the interior angles of a convex hexagon, in degrees?"),
    ]
    stripped = load_math_dataset(str(OPENR1_SAMPLE), system_prompt="")
    assert [m["role"] for m in stripped[0]["prompt"]] == ["user"]


def test_plain_string_prompts_are_used_verbatim():
    toy = Dataset.from_dict({"prompt": ["37+48=", "1+2="], "answer": ["85", "3"], "digits": [2, 1]})
    ds = to_math_prompts(toy, keep_columns=["digits"])
    assert ds.to_list() == [
        {"prompt": "37+48=", "answer": "85", "digits": 2},
        {"prompt": "1+2=", "answer": "3", "digits": 1},
    ]
    assert to_math_prompts(toy).column_names == ["prompt", "answer"]


def test_non_string_answers_become_strings_and_missing_ones_fail():
    ds = to_math_prompts(Dataset.from_dict({"question": ["q"], "answer": [42]}))
    assert ds[0]["answer"] == "42"
    with pytest.raises(ValueError, match="no answer"):
        to_math_prompts(Dataset.from_dict({"question": ["q"], "reward_model": [{"ground_truth": None}]}))


def test_luffy_messages():
    assert luffy_messages("Q") == [
        {"role": "system", "content": LUFFY_SYSTEM_PROMPT},
        {"role": "user", "content": "Q"},
    ]
    assert luffy_messages("Q", None) == [{"role": "user", "content": "Q"}]


def test_filter_long_prompts_counts_tokens_as_trl_does(tokenizer):
    # char tokenizer: one token per character
    strings = Dataset.from_dict({"prompt": ["1+2=", "12+34=", "123+456="], "answer": ["3", "46", "579"]})
    assert filter_long_prompts(strings, tokenizer, 6)["prompt"] == ["1+2=", "12+34="]
    assert filter_long_prompts(strings, tokenizer, 5)["prompt"] == ["1+2="]

    # messages go through the chat template with the generation prompt: here content + "=" per message
    # (a fresh tokenizer object: the session fixture is shared with other tests)
    tokenizer_with_template = type(tokenizer)(tokenizer_object=tokenizer.backend_tokenizer)
    tokenizer_with_template.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    chats = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "1+2"}], [{"role": "user", "content": "12+34"}]],
            "answer": ["3", "46"],
        }
    )
    kept = filter_long_prompts(chats, tokenizer_with_template, 4)  # "1+2=" is 4 tokens, "12+34=" is 6
    assert [p[0]["content"] for p in kept["prompt"]] == ["1+2"]
    with pytest.raises(ValueError, match="> 0"):
        filter_long_prompts(chats, tokenizer_with_template, 0)


def test_the_progress_bar_says_what_the_map_does(monkeypatch):
    """It said "math prompts" over the toy addition data too, whose plain prompts are only kept."""
    seen = []
    real_map = Dataset.map

    def recording_map(self, *args, **kwargs):
        seen.append(kwargs.get("desc"))
        return real_map(self, *args, **kwargs)

    monkeypatch.setattr(Dataset, "map", recording_map)
    to_math_prompts(Dataset.from_dict({"prompt": ["37+48="], "answer": ["85"]}))
    to_math_prompts(Dataset.from_dict({"problem": ["What is 2+2?"], "answer": ["4"]}))
    assert seen == ["prompt and answer columns", "questions -> math prompts"]


def test_a_missing_offline_solutions_column_is_named_as_such():
    """The offline solutions' column is kept by itself (no keep_columns entry): a dataset without it is told so, with
    its columns, and not told to edit keep_columns (which the user never set)."""
    toy = Dataset.from_dict({"prompt": ["1+1="], "answer": ["2"], "digits": [1]})
    with pytest.raises(ValueError) as info:
        to_math_prompts(toy, offline_columns=["nosuch"])
    assert str(info.value) == (
        "the dataset has no offline solutions column 'nosuch'; its columns are ['prompt', 'answer', 'digits']. Set "
        "offline_solutions_column to one of them."
    )
    kept = to_math_prompts(toy.add_column("solution", [["2"]]), keep_columns=["digits"], offline_columns=["solution"])
    assert sorted(kept.column_names) == ["answer", "digits", "prompt", "solution"]
