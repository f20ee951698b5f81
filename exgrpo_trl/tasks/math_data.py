"""Training data in the paper's prompt format: OpenR1-Math-46k, any question/answer dataset, the toy task.

Every loader returns a `datasets.Dataset` with the two columns ExGRPO trains on (plus any `keep_columns`):

- ``prompt``: what TRL feeds the policy. Conversational (``[{"role": "system", ...}, {"role": "user", ...}]``, run
  through the tokenizer's chat template by TRL) or a plain string (used verbatim, e.g. the toy task's ``"37+48="``).
- ``answer``: the reference answer, a string, read by the reward functions (``rewards.math_reward``).

Prompt format. The paper trains on ``Elliott/Openr1-Math-46k-8192``, the set released with LUFFY (Yan et al., 2025,
arXiv 2504.14945). Sources: the ExGRPO README (``python prepare_train.py --dataset_name Elliott/Openr1-Math-46k-8192``;
"only the question field is used in RLVR"), and the ``data/prepare_train.py`` of public LUFFY forks, which write the
dataset's rows to parquet unchanged, so verl renders each row's own ``prompt`` messages with the model's chat
template. That column holds ``[system: LUFFY's reasoning prompt, user: the question]`` (scripts that strip the system
message take ``prompt[1:]``); the reference answer is ``reward_model["ground_truth"]``. Columns of the dataset (verl
schema): ``data_source``, ``prompt`` (list of role/content), ``target`` (list of role/content: the DeepSeek-R1
solution), ``ability``, ``reward_model`` (``ground_truth``, ``style``), ``extra_info`` (``index``, ``split``).
We keep its ``prompt`` as is, and build the same two messages for any other dataset from a question column with
`LUFFY_SYSTEM_PROMPT`: the LUFFY system prompt as quoted by papers that follow Yan et al. (2025). Its ``\n`` are real
newlines, as in a JSON dump of a row quoted in a public repository (not checked against the Hub copy itself).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from ..buffer import IMAGE_COLUMNS

__all__ = [
    "OPENR1_MATH_46K",
    "LUFFY_SYSTEM_PROMPT",
    "QUESTION_COLUMN_CANDIDATES",
    "load_raw_dataset",
    "to_math_prompts",
    "load_math_dataset",
    "filter_long_prompts",
    "luffy_messages",
]

logger = logging.getLogger(__name__)

OPENR1_MATH_46K = "Elliott/Openr1-Math-46k-8192"

LUFFY_SYSTEM_PROMPT = (
    "Your task is to follow a systematic, thorough reasoning process before providing the final solution. "
    "This involves analyzing, summarizing, exploring, reassessing, and refining your thought process through "
    "multiple iterations. Structure your response into two sections: Thought and Solution. In the Thought "
    'section, present your reasoning using the format: "<think>\n {thoughts} </think>\n". Each thought should '
    'include detailed analysis, brainstorming, verification, and refinement of ideas. After "</think>\n," in the '
    "Solution section, provide the final, logical, and accurate answer, clearly derived from the exploration in the "
    "Thought section. If applicable, include the answer in \\boxed{} for closed-form results like multiple choices "
    "or mathematical solutions."
)

# Tried in order when no question column is named and the dataset has no ``prompt`` column.
QUESTION_COLUMN_CANDIDATES = ("question", "problem")
_VERL_ANSWER = ("reward_model", "ground_truth")  # where verl-format datasets (OpenR1-Math-46k) keep the answer
_TMP_PREFIX = "__exgrpo_"
PRODUCED_COLUMNS = ("prompt", "answer")  # the columns every loader returns, whatever the dataset named them
_LOCAL_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def luffy_messages(question: str, system_prompt: str | None = LUFFY_SYSTEM_PROMPT) -> list[dict[str, str]]:
    """``[system, user]`` messages in the paper's format; an empty/None system prompt leaves only the user turn."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return messages


def load_raw_dataset(name_or_path: str, *, split: str = "train", config: str | None = None) -> Dataset:
    """One split of a dataset from a local file (.jsonl/.json/.parquet/.csv: the file is the split), a folder
    written by `Dataset.save_to_disk`, any folder `load_dataset` reads, or a Hub id."""
    path = Path(name_or_path)
    if path.is_file():
        builder = _LOCAL_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"cannot read {path}: expected one of {sorted(_LOCAL_FILE_BUILDERS)} or a dataset folder / Hub id."
            )
        return load_dataset(builder, data_files=str(path), split="train")
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        loaded = load_from_disk(str(path))
        if isinstance(loaded, DatasetDict):
            if split not in loaded:
                raise ValueError(f"{path} has no split {split!r}; it has {sorted(loaded)}.")
            loaded = loaded[split]
        return loaded
    return load_dataset(name_or_path, config, split=split)


def _missing(dataset: Dataset, what: str, column: str, hint: str) -> ValueError:
    return ValueError(f"the dataset has no {what} column {column!r}; its columns are {dataset.column_names}. {hint}")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def to_math_prompts(
    dataset: Dataset,
    *,
    question_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = None,
    keep_columns: Sequence[str] = (),
    offline_columns: Sequence[str] = (),
    num_proc: int | None = None,
) -> Dataset:
    """Map a dataset to ``prompt`` + ``answer`` (+ `keep_columns`, + `offline_columns`: the offline solutions'
    column, kept as keep_columns are but named by `offline_solutions_column`), dropping every other column.

    Prompt:
      - `question_column` given: the paper's two messages built from it (`system_prompt`, default
        `LUFFY_SYSTEM_PROMPT`; "" for none);
      - else a ``prompt`` column is used as is (messages, e.g. OpenR1-Math-46k, or a plain string, e.g. the toy
        task); a `system_prompt` given explicitly replaces (or adds) the system message of message prompts;
      - else the first of `QUESTION_COLUMN_CANDIDATES` present, as with `question_column`.
    Answer: `answer_column` if given, else ``answer``, else ``reward_model["ground_truth"]`` (verl format).
    Images: an ``image`` or ``images`` column is kept as it is (TRL puts the images into the first user message).

    A missing column raises a `ValueError` naming it and listing the columns the dataset has.
    """
    columns = dataset.column_names

    # Answer source
    if answer_column is not None:
        if answer_column not in columns:
            raise _missing(dataset, "answer", answer_column, "Set answer_column to the column holding the answers.")
        answer_source: tuple[str, ...] = (answer_column,)
    elif "answer" in columns:
        answer_source = ("answer",)
    elif _VERL_ANSWER[0] in columns:
        answer_source = _VERL_ANSWER
    else:
        raise _missing(
            dataset,
            "answer",
            "answer",
            "Set answer_column (a verl-format 'reward_model' column with 'ground_truth' also works).",
        )

    # Prompt source
    if question_column is not None:
        if question_column not in columns:
            raise _missing(dataset, "question", question_column, "Set question_column to the column of questions.")
        mode, source = "question", question_column
    elif "prompt" in columns:
        mode, source = "prompt", "prompt"
    else:
        found = [c for c in QUESTION_COLUMN_CANDIDATES if c in columns]
        if not found:
            raise _missing(
                dataset,
                "question",
                QUESTION_COLUMN_CANDIDATES[0],
                f"Set question_column (tried {list(QUESTION_COLUMN_CANDIDATES)}, and no 'prompt' column either).",
            )
        mode, source = "question", found[0]

    for column in offline_columns:
        if column not in columns:
            raise _missing(dataset, "offline solutions", column, "Set offline_solutions_column to one of them.")
    keep_columns = [*keep_columns, *(c for c in offline_columns if c not in keep_columns)]
    for column in keep_columns:
        if column in PRODUCED_COLUMNS:
            raise ValueError(f"keep_columns lists {column!r}, which is always produced: remove it from keep_columns.")
        if column not in columns:
            raise _missing(dataset, "kept", column, "Remove it from keep_columns.")

    build_system = LUFFY_SYSTEM_PROMPT if system_prompt is None else system_prompt

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        answer = row[answer_source[0]]
        if len(answer_source) == 2:
            answer = (answer or {}).get(answer_source[1])
        if answer is None:
            raise ValueError(f"a row has no answer in {'.'.join(answer_source)!r}: {row}")
        if mode == "question":
            prompt: Any = luffy_messages(str(row[source]), build_system)
        else:
            prompt = row[source]
            if system_prompt is not None and _is_messages(prompt):
                prompt = [m for m in prompt if m["role"] != "system"]
                if system_prompt:
                    prompt = [{"role": "system", "content": system_prompt}, *prompt]
            elif not (isinstance(prompt, str) or _is_messages(prompt)):
                raise ValueError(f"a 'prompt' must be a string or a list of role/content messages, got {prompt!r}")
        # Written under temporary names: a map that rewrites a column in place keeps that column's old type
        # (an int64 answer would be cast back from its string).
        return {_TMP_PREFIX + "prompt": prompt, _TMP_PREFIX + "answer": str(answer)}

    keep = set(keep_columns) | {c for c in IMAGE_COLUMNS if c in columns}  # a question's images go with it
    drop = [c for c in columns if c not in keep]
    # the progress bar says what is done: questions become the paper's prompts; prompts are only kept
    desc = "questions -> math prompts" if mode == "question" else "prompt and answer columns"
    mapped = dataset.map(convert, remove_columns=drop, num_proc=num_proc, desc=desc)
    return mapped.rename_columns({_TMP_PREFIX + "prompt": "prompt", _TMP_PREFIX + "answer": "answer"})


def load_math_dataset(
    name_or_path: str = OPENR1_MATH_46K,
    *,
    split: str = "train",
    config: str | None = None,
    question_column: str | None = None,
    answer_column: str | None = None,
    system_prompt: str | None = None,
    keep_columns: Sequence[str] = (),
    offline_columns: Sequence[str] = (),
    num_proc: int | None = None,
) -> Dataset:
    """`load_raw_dataset` then `to_math_prompts`: OpenR1-Math-46k by default, any question/answer set otherwise."""
    raw = load_raw_dataset(name_or_path, split=split, config=config)
    return to_math_prompts(
        raw,
        question_column=question_column,
        answer_column=answer_column,
        system_prompt=system_prompt,
        keep_columns=keep_columns,
        offline_columns=offline_columns,
        num_proc=num_proc,
    )


def filter_long_prompts(
    dataset: Dataset, tokenizer, max_prompt_length: int, *, num_proc: int | None = None
) -> Dataset:
    """Drop rows whose prompt, as TRL will tokenize it (chat template with the generation prompt for messages),
    is longer than `max_prompt_length` tokens. TRL 1.16 does not truncate prompts; the reference recipe keeps
    prompts within 1024 tokens by filtering its data, which this reproduces."""
    if max_prompt_length <= 0:
        raise ValueError(f"max_prompt_length must be > 0, got {max_prompt_length}.")

    def fits(row: dict[str, Any]) -> bool:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
        return len(ids) <= max_prompt_length

    before = len(dataset)
    kept = dataset.filter(fits, num_proc=num_proc, desc=f"prompts <= {max_prompt_length} tokens")
    if len(kept) < before:
        logger.warning("dropped %d of %d prompts longer than %d tokens", before - len(kept), before, max_prompt_length)
    return kept
