"""The ExGRPO section of a model card: the main training values and the experience buffer at the end of training."""

from __future__ import annotations

import json
from typing import Any

from .settings import card_rows

SECTION_TITLE = "## ExGRPO training"


def exgrpo_card_section(args: Any, state: Any, global_step: int) -> str:
    """Markdown for the model card: how ExGRPO was configured (its settings' values, `settings.card_rows`, and the
    main GRPO ones) and what its buffer held when the card was written. `state`: the run's `ExGRPOState`."""
    rows = [
        *card_rows(args),
        ("rollouts per question (K)", args.num_generations),
        ("loss type", args.loss_type),
        ("learning rate", args.learning_rate),
        ("optimizer steps", global_step),
    ]
    buffer = state.buffer
    lines = [
        SECTION_TITLE,
        "",
        "Trained with ExGRPO (Experiential Group Relative Policy Optimization, "
        "[arXiv 2510.02245](https://arxiv.org/abs/2510.02245)) with exgrpo-trl, on TRL's GRPOTrainer.",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        f"Experience buffer at the end of training: {buffer.num_questions} questions, "
        f"{buffer.num_trajectories} trajectories, {len(buffer.retired)} retired questions "
        f"(replay {'active' if state.replay_active else 'not started'}).",
        "",
    ]
    return "\n".join(lines)


def add_section(card_text: str, section: str) -> str:
    """Insert (or replace) the ExGRPO section before the card's citation section, or at the end."""
    if SECTION_TITLE in card_text:
        start = card_text.index(SECTION_TITLE)
        end = card_text.find("\n## ", start + len(SECTION_TITLE))
        card_text = card_text[:start] + card_text[end + 1 :] if end != -1 else card_text[:start]
    anchor = card_text.find("\n## Citations")
    if anchor == -1:
        return card_text.rstrip("\n") + "\n\n" + section
    return card_text[: anchor + 1] + section + "\n" + card_text[anchor + 1 :]


# TRL's card template (trl/templates/lm_model_card.md, TRL 1.16) writes these for a base model it did not find on the
# Hub (a local folder: it passes None) and for a model that is not pushed (no hub_model_id).
NO_HUB_BASE = "[None](https://huggingface.co/None)"
NO_HUB_MODEL = 'model="None"'
DATASET_SENTENCE_END = ".\nIt has been trained using [TRL]"


def fix_local_references(card_text: str, *, base_model: str | None, local_dataset: str | None, output_dir: str) -> str:
    """Replace what TRL's template writes for local things by what is true: the local base model named as a path,
    not linked to huggingface.co/None; the local dataset (TRL was given none, so that it links no Hub dataset) named
    as a path; the usage snippet's ``model="None"`` by the output folder, which `pipeline` loads."""
    base = f"a local model (`{base_model}`)" if base_model else "a local model"
    card_text = card_text.replace(NO_HUB_BASE, base, 1)
    if local_dataset:
        card_text = card_text.replace(
            DATASET_SENTENCE_END, f" on the local dataset `{local_dataset}`{DATASET_SENTENCE_END}", 1
        )
    return card_text.replace(NO_HUB_MODEL, f'model="{output_dir}"')


# TRL's card template (TRL 1.16) shows a chat question for any model; a model trained on other prompts (the toy
# task's "37+48=", a chat template the question does not fit) is better shown with one of its own training prompts.
TRL_QUESTION = (
    'question = "If you had a time machine, but could only go to the past or the future once and never return, which '
    'would you choose and why?"'
)
TRL_CALL = 'output = generator([{"role": "user", "content": question}], max_new_tokens=128, return_full_text=False)[0]'


def fix_quick_start(card_text: str, prompt: Any, max_new_tokens: int) -> str:
    """The card's usage snippet with `prompt` (a training row's prompt: a string, or chat messages) in place of
    TRL's generic question, and the run's completion length; unchanged when the card has no such snippet or the
    prompt is neither (a vision-language prompt keeps TRL's example)."""
    if TRL_QUESTION not in card_text or TRL_CALL not in card_text:
        return card_text
    if isinstance(prompt, str):
        name = "prompt"
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in prompt)
    ):
        name = "messages"
    else:
        return card_text
    call = f"output = generator({name}, max_new_tokens={max_new_tokens}, return_full_text=False)[0]"
    first = f"{name} = {json.dumps(prompt, ensure_ascii=False)}  # a prompt of the training data"
    return card_text.replace(TRL_QUESTION, first).replace(TRL_CALL, call)
