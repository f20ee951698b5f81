"""The model card `ExGRPOTrainer` writes (`output_dir/README.md`): ExGRPO named, the paper cited (title, arXiv id,
BibTeX), the tags trl / grpo / exgrpo in the YAML header, the main training values, and the experience buffer at the
end of training, equal to the trainer's own."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import ModelCard

from exgrpo_trl.buffer import ExperienceBuffer
from exgrpo_trl.card import SECTION_TITLE, add_section, exgrpo_card_section
from exgrpo_trl.settings import ExGRPOSettings
from tests.helpers import make_model, make_trainer, synthetic_dataset

TITLE = "ExGRPO: Learning to Reason from Experience"
BUFFER_LINE = re.compile(
    r"Experience buffer at the end of training: (\d+) questions, (\d+) trajectories, (\d+) retired questions "
    r"\(replay (active|not started)\)\."
)
# Values away from the defaults, so that each one is known to come from this run's config.
SETTINGS = dict(
    replay_ratio=0.25,
    policy_shaping_gamma=0.2,
    replay_start_pass_rate=0.2,
    num_generations=4,
    per_device_train_batch_size=16,  # 4 questions x K = 4
    trajectory_selection="random",
    loss_type="bnpo",
    learning_rate=3e-4,
    max_steps=3,
)


@pytest.fixture(scope="module")
def card_run(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("card")
    # every 4th question is always solved: groups at K/K retire, so the retired count is not trivially 0
    trainer = make_trainer(out, tokenizer, train_dataset=synthetic_dataset(always_every=4), **SETTINGS)
    trainer.train()
    trainer.create_model_card(model_name="tiny-exgrpo", dataset_name="toy/addition", tags=["math"])
    return trainer, (out / "out" / "README.md").read_text()


def test_card_names_exgrpo_and_cites_the_paper(card_run):
    _, text = card_run
    assert f"This model was trained with ExGRPO, a method introduced in [{TITLE}]" in text
    assert "(https://huggingface.co/papers/2510.02245)" in text
    bibtex = text[text.index("@article{zhan2025exgrpo,") :]
    assert f"title        = {{{{{TITLE}}}}}" in bibtex.split("\n}")[0]
    assert "eprint       = {arXiv:2510.02245}" in bibtex.split("\n}")[0]
    assert "[arXiv 2510.02245](https://arxiv.org/abs/2510.02245)" in text  # in the ExGRPO section


def test_card_tags_in_yaml_header(card_run):
    _, text = card_run
    assert text.startswith("---\n")
    data = ModelCard(text).data
    assert {"trl", "grpo", "exgrpo", "math"} <= set(data.tags)
    assert data.datasets == "toy/addition" or data.datasets == ["toy/addition"]


def test_card_training_values(card_run):
    trainer, text = card_run
    assert trainer.state.global_step == 3
    section = text[text.index(SECTION_TITLE) :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([^|]+?) \|$", section, flags=re.M))
    # every setting the card shows (settings.CARD_LABELS), with this run's value, then the main GRPO values
    assert rows == {
        "setting": "value",
        "replay ratio (rho)": "0.25",
        "delayed start (batch Pass@1 >; 0 or None: from the first step)": "0.2",
        "bucket Gaussian centre (mu, a success rate)": "0.5",
        "bucket Gaussian width (sigma, successes)": "1.0",
        "question selection": "gaussian",
        "reuse limit (generation batches a replayed question sits out)": "0",
        "trajectory selection": "random",
        "trajectory candidates scored (None: every stored one)": "4",
        "policy shaping gamma (None: plain importance ratio)": "0.2",
        "importance correction": "True",
        "offline solutions column (None: no offline guidance)": "None",
        "offline guidance (which fresh groups get a solution)": "all_groups",
        "rollouts per question (K)": "4",
        "loss type": "bnpo",
        "learning rate": "0.0003",
        "optimizer steps": "3",
    }


def test_card_buffer_summary_is_the_trainers(card_run):
    trainer, text = card_run
    buffer = trainer.exgrpo_state.buffer
    (match,) = BUFFER_LINE.findall(text)
    questions, trajectories, retired, replay = match
    assert (int(questions), int(trajectories), int(retired)) == (
        buffer.num_questions,
        buffer.num_trajectories,
        len(buffer.retired),
    )
    # a run where each number means something: replay switched on, and the buffer collected and retired questions
    assert replay == "active" and trainer.exgrpo_state.replay_active
    assert buffer.num_questions > 0 and buffer.num_trajectories >= buffer.num_questions and len(buffer.retired) > 0


def test_card_section_sits_before_citations_once(card_run):
    trainer, text = card_run
    assert text.count(SECTION_TITLE) == 1
    assert text.index(SECTION_TITLE) < text.index("## Citations")
    # writing the card again replaces the section instead of adding a second one
    trainer.create_model_card(model_name="tiny-exgrpo")
    assert (Path(trainer.args.output_dir) / "README.md").read_text().count(SECTION_TITLE) == 1


# ---------------------------------------------------------------------------------------------------------------
# The section on its own (exgrpo_trl.card)
# ---------------------------------------------------------------------------------------------------------------
def _args(**overrides):
    """The settings with `overrides`, and the GRPO values the card shows."""
    settings = ExGRPOSettings(**overrides)
    for name, value in dict(num_generations=8, loss_type="dr_grpo", learning_rate=1e-6).items():
        setattr(settings, name, value)
    return settings


def _state(buffer, replay_active):
    return SimpleNamespace(buffer=buffer, replay_active=replay_active)


def test_section_ablation_values_and_buffer_counts():
    import numpy as np

    from exgrpo_trl.buffer import Trajectory

    buffer = ExperienceBuffer(4)
    traj = lambda ids: Trajectory(np.array(ids, dtype=np.int32), np.zeros(len(ids), dtype=np.float16), 0)  # noqa: E731
    buffer.update_group("a", 2, {"prompt": "a"}, [traj([5, 1]), traj([6, 1])])
    buffer.update_group("b", 1, {"prompt": "b"}, [traj([7, 1])])
    buffer.update_group("c", 4, None, [])  # K/K: retired
    args = _args(policy_shaping_gamma=None, replay_start_pass_rate=None)
    section = exgrpo_card_section(args, _state(buffer, True), 12)
    assert "| policy shaping gamma (None: plain importance ratio) | None |" in section
    assert "| delayed start (batch Pass@1 >; 0 or None: from the first step) | None |" in section
    assert "| optimizer steps | 12 |" in section
    assert BUFFER_LINE.findall(section) == [("2", "3", "1", "active")]
    assert BUFFER_LINE.findall(exgrpo_card_section(_args(), _state(ExperienceBuffer(4), False), 0)) == [
        ("0", "0", "0", "not started")
    ]


def test_add_section_inserts_before_citations_and_replaces():
    card = "---\ntags: [trl]\n---\n\n# Card\n\ntext\n\n## Citations\n\ncite\n"
    first = add_section(card, f"{SECTION_TITLE}\n\nold\n")
    assert first == "---\ntags: [trl]\n---\n\n# Card\n\ntext\n\n" + f"{SECTION_TITLE}\n\nold\n\n## Citations\n\ncite\n"
    second = add_section(first, f"{SECTION_TITLE}\n\nnew\n")
    assert second.count(SECTION_TITLE) == 1 and "old" not in second and "new\n\n## Citations" in second
    assert add_section("# Card\n\nno citations\n", "S\n") == "# Card\n\nno citations\n\nS\n"


# ---------------------------------------------------------------------------------------------------------------
# Local base model and dataset, model not pushed: no links to huggingface.co/None or to a path as a Hub dataset
# ---------------------------------------------------------------------------------------------------------------
def _card_for(tmp_path, tokenizer, model, dataset_name):
    trainer = make_trainer(tmp_path, tokenizer, model=model)
    trainer.create_model_card(model_name="tiny", dataset_name=dataset_name)
    return trainer, (tmp_path / "out" / "README.md").read_text()


def test_card_of_a_local_model_and_dataset_links_nothing_that_is_not_there(tmp_path, tokenizer):
    model_dir, data = tmp_path / "model", tmp_path / "train.jsonl"
    make_model(tokenizer).save_pretrained(model_dir)
    synthetic_dataset().to_json(str(data))
    trainer, text = _card_for(tmp_path, tokenizer, str(model_dir), str(data))
    assert "huggingface.co/None" not in text and 'model="None"' not in text
    assert "huggingface.co/datasets" not in text
    assert (
        f"This model is a fine-tuned version of a local model (`{model_dir}`) on the local dataset `{data}`.\n"
        "It has been trained using [TRL]"
    ) in text
    output_dir = trainer.args.output_dir
    assert f'generator = pipeline("text-generation", model="{output_dir}", device_map="auto")' in text
    card = ModelCard(text)
    assert card.data.base_model is None and card.data.datasets is None  # no Hub ids that are not Hub ids


def test_card_of_hub_names_keeps_the_links(tmp_path, tokenizer):
    model = make_model(tokenizer)
    model.config._name_or_path = "Qwen/Qwen2.5-Math-1.5B"  # as loaded from the Hub
    _, text = _card_for(tmp_path, tokenizer, model, "open-r1/OpenR1-Math-46k")
    assert (
        "This model is a fine-tuned version of [Qwen/Qwen2.5-Math-1.5B](https://huggingface.co/Qwen/Qwen2.5-Math-1.5B)"
        " on the [open-r1/OpenR1-Math-46k](https://huggingface.co/datasets/open-r1/OpenR1-Math-46k) dataset."
    ) in text
    assert ModelCard(text).data.datasets == "open-r1/OpenR1-Math-46k"


def test_fix_local_references_on_trls_template():
    from trl.trainer.utils import generate_model_card

    from exgrpo_trl.card import fix_local_references

    card = generate_model_card(
        base_model=None, model_name="m", hub_model_id=None, dataset_name=None, tags=[], wandb_url=None,
        trackio_url=None, trainer_name="ExGRPO",
    )  # fmt: skip
    text = fix_local_references(str(card), base_model=None, local_dataset="d.jsonl", output_dir="out")
    assert "This model is a fine-tuned version of a local model on the local dataset `d.jsonl`.\n" in text
    assert 'model="out"' in text and "None" not in text.split("---", 2)[2].split("## Citations")[0]


def test_card_says_whether_offline_guidance_was_on_and_its_mode():
    state = _state(SimpleNamespace(num_questions=0, num_trajectories=0, retired=set()), False)
    column, mode = (
        "offline solutions column (None: no offline guidance)",
        "offline guidance (which fresh groups get a solution)",
    )
    off = exgrpo_card_section(_args(), state, 0)
    assert f"| {column} | None |" in off and f"| {mode} | all_groups |" in off
    on = exgrpo_card_section(_args(offline_solutions_column="target", offline_guidance="unsolved"), state, 0)
    assert f"| {column} | target |" in on and f"| {mode} | unsolved |" in on


def _another_value(f):
    """A valid value of ExGRPOSettings field `f` other than its default, derived from its type and default."""
    from exgrpo_trl.settings import OFFLINE_GUIDANCE, QUESTION_SELECTIONS, REPLAY_PRIORITIES, TRAJECTORY_SELECTIONS

    choices = {"question_selection": QUESTION_SELECTIONS, "trajectory_selection": TRAJECTORY_SELECTIONS,
               "offline_guidance": OFFLINE_GUIDANCE, "replay_priority": REPLAY_PRIORITIES}  # fmt: skip
    if f.name in choices:
        return next(c for c in choices[f.name] if c != f.default)
    if f.name in ("replay_max_age", "replay_max_uses"):  # int | None defaulting to None
        return 3
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, (int, float)):
        return f.default + 1 if f.name in ("replay_cooldown", "max_trajectory_candidates") else f.default / 2 or 0.25
    return "a-column" if "column" in f.name else "an-export"  # str | None defaulting to None


def test_every_setting_set_away_from_its_default_is_on_the_card():
    """Derived from the dataclass, so that a new setting cannot be left off the card: every field has a label, and a
    run that sets any one of them to another value shows that value under its label (the main settings always)."""
    from dataclasses import fields

    from exgrpo_trl.settings import CARD_ALWAYS, CARD_LABELS, ExGRPOSettings

    assert set(CARD_LABELS) == {f.name for f in fields(ExGRPOSettings)}
    state = _state(SimpleNamespace(num_questions=0, num_trajectories=0, retired=set()), False)
    default_rows = set(re.findall(r"^\| ([^|]+?) \|", exgrpo_card_section(_args(), state, 0), flags=re.M))
    assert {CARD_LABELS[n] for n in CARD_ALWAYS} <= default_rows
    assert not {CARD_LABELS[n] for n in CARD_LABELS if n not in CARD_ALWAYS} & default_rows  # only when set
    for f in fields(ExGRPOSettings):
        value = _another_value(f)
        card = exgrpo_card_section(_args(**{f.name: value}), state, 0)
        assert f"| {CARD_LABELS[f.name]} | {value} |" in card, f.name


def test_card_usage_snippet_shows_a_training_prompt(card_run):
    """TRL's template shows every model a chat question about a time machine; the card shows the run's first training
    prompt (the synthetic task's "0+0=") and its completion length (max_completion_length 12) instead."""
    trainer, text = card_run
    assert trainer.train_dataset[0]["prompt"] == "0+0="
    assert "time machine" not in text
    assert 'prompt = "0+0="  # a prompt of the training data\n' in text
    assert "output = generator(prompt, max_new_tokens=12, return_full_text=False)[0]" in text


def test_a_chat_prompt_goes_into_the_snippet_as_messages():
    from exgrpo_trl.card import TRL_CALL, TRL_QUESTION, fix_quick_start

    card = f"```python\n{TRL_QUESTION}\n{TRL_CALL}\n```\n"
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert fix_quick_start(card, messages, 64) == (
        '```python\nmessages = [{"role": "user", "content": "What is 2+2?"}]  # a prompt of the training data\n'
        "output = generator(messages, max_new_tokens=64, return_full_text=False)[0]\n```\n"
    )
    images = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    assert fix_quick_start(card, images, 64) == card  # a vision-language prompt: TRL's example stays
