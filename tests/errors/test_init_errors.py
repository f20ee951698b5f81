"""Mistakes a user makes when building an ExGRPOTrainer, met at init with a message that says what to do:
a plain GRPOConfig (and the conversion the message points to), a dataset without a 'prompt' column."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from tests.helpers import config_kwargs, make_model, make_reward, make_trainer, synthetic_dataset

GRPO_CONFIG_MESSAGE = (
    "ExGRPOTrainer needs an ExGRPOConfig, got a GRPOConfig. Convert it with "
    "`ExGRPOConfig.from_grpo_config(cfg, **exgrpo_settings)` (same GRPO settings and batch sizes, ExGRPO's fields as "
    "keywords)."
)


def test_plain_grpo_config_error_points_to_the_conversion(tmp_path, tokenizer):
    with pytest.raises(TypeError) as info:
        ExGRPOTrainer(  # by hand: a GRPOConfig for ExGRPOTrainer, the mistake under test (make_trainer pairs them)
            model=make_model(tokenizer),
            reward_funcs=make_reward(tokenizer),
            args=GRPOConfig(**config_kwargs(tmp_path)),
            processing_class=tokenizer,
            train_dataset=synthetic_dataset(),
        )
    assert str(info.value) == GRPO_CONFIG_MESSAGE


@pytest.mark.parametrize(
    "batch",
    [
        {},
        {"steps_per_generation": 4},  # generation batch derived from it
        {"generation_batch_size": 64, "gradient_accumulation_steps": 2},  # steps_per_generation derived
        {"gradient_accumulation_steps": 3, "scale_rewards": True, "report_to": "all", "gradient_checkpointing": True},
    ],
    ids=["default", "steps_per_generation", "generation_batch_size", "normalised-fields"],
)
def test_from_grpo_config_keeps_every_grpo_setting(tmp_path, batch):
    """The conversion the old message suggested fails on any finished GRPOConfig ('generation_batch_size' and
    'steps_per_generation' can not be both configured); from_grpo_config gives every GRPOConfig field its value."""
    grpo = GRPOConfig(**{**config_kwargs(tmp_path, per_device_train_batch_size=8, num_generations=4), **batch})
    with pytest.raises(ValueError, match="'generation_batch_size' and 'steps_per_generation' can not be both"):
        ExGRPOConfig(**{f.name: getattr(grpo, f.name) for f in dataclasses.fields(grpo) if f.init})

    ex = ExGRPOConfig.from_grpo_config(grpo, replay_ratio=0.25, question_selection="uniform")
    assert type(ex) is ExGRPOConfig
    assert {f.name: getattr(ex, f.name) for f in dataclasses.fields(GRPOConfig)} == {
        f.name: getattr(grpo, f.name) for f in dataclasses.fields(GRPOConfig)
    }
    assert (ex.replay_ratio, ex.question_selection, ex.replay_mu) == (0.25, "uniform", 0.5)  # the rest: defaults


def test_from_grpo_config_takes_exgrpo_fields_only(tmp_path):
    grpo = GRPOConfig(**config_kwargs(tmp_path))
    with pytest.raises(TypeError) as info:
        ExGRPOConfig.from_grpo_config(grpo, learning_rate=1.0, replay_ratio=0.5)
    assert str(info.value) == (
        "from_grpo_config takes ExGRPO's own fields only, got learning_rate; set GRPOConfig fields on the GRPOConfig "
        "itself."
    )
    with pytest.raises(TypeError, match="from_grpo_config needs a GRPOConfig, got dict"):
        ExGRPOConfig.from_grpo_config({})
    with pytest.raises(ValueError, match=r"replay_ratio must be in \[0, 1\]"):  # ExGRPO's validation still runs
        ExGRPOConfig.from_grpo_config(grpo, replay_ratio=2.0)


def test_converted_config_trains_like_the_original(tmp_path, tokenizer):
    """Two optimizer steps per generation batch, set through steps_per_generation: with replay off, ExGRPOTrainer on
    the converted config ends with GRPOTrainer's parameters on the original, bitwise."""
    grpo = make_trainer(
        tmp_path, tokenizer, cls=GRPOTrainer, max_steps=2, per_device_train_batch_size=16, steps_per_generation=2
    )
    grpo.train()
    ex = ExGRPOTrainer(  # by hand: its config is the conversion under test, not one make_trainer builds
        model=make_model(tokenizer),
        reward_funcs=make_reward(tokenizer),
        args=ExGRPOConfig.from_grpo_config(grpo.args, replay_ratio=0.0),
        train_dataset=synthetic_dataset(),
        processing_class=tokenizer,
    )
    assert (ex.args.generation_batch_size, ex.args.steps_per_generation) == (32, 2)
    ex.train()
    for (name, p), (_, q) in zip(grpo.model.named_parameters(), ex.model.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("where", ["train_dataset", "eval_dataset", "eval_dataset['math']"])
def test_dataset_without_prompt_column_is_named_at_init(tmp_path, tokenizer, where):
    no_prompt = Dataset.from_dict({"question": ["1+1="], "answer": ["2"]})
    train_dataset, extra = None, {}  # None: make_trainer's synthetic dataset
    if where == "train_dataset":
        train_dataset = no_prompt
    elif where == "eval_dataset":
        extra["eval_dataset"] = no_prompt
    else:
        extra["eval_dataset"] = {"math": no_prompt, "other": synthetic_dataset()}
    with pytest.raises(ValueError) as info:
        make_trainer(tmp_path, tokenizer, train_dataset=train_dataset, trainer_kwargs=extra)
    assert str(info.value) == (
        f"{where} has no 'prompt' column (its columns: 'question', 'answer'); GRPOTrainer and ExGRPOTrainer read each "
        "question from 'prompt': rename the question column, e.g. `dataset.rename_column('question', 'prompt')`."
    )


def test_an_output_dir_that_is_a_file_is_one_clear_error(tmp_path, tokenizer):
    """Through the Python API it was transformers' bare `FileExistsError: [Errno 17] File exists`, raised after the
    model had been set up; now the same one line as `exgrpo train`, before anything loads."""
    taken = tmp_path / "out"
    taken.write_text("a file where the run's folder should be")
    with pytest.raises(NotADirectoryError, match=r"^output_dir .*out is a file, not a folder; give a folder"):
        make_trainer(tmp_path, tokenizer)
    assert taken.read_text() == "a file where the run's folder should be"


def test_a_missing_logger_is_one_line_before_any_work(tmp_path, tokenizer):
    """`report_to="wandb"` without wandb installed ended in transformers' 11-frame traceback from the Trainer's
    callbacks, after the model was set up."""
    import importlib.util

    missing = [name for name in ("wandb", "trackio") if importlib.util.find_spec(name) is None]
    if not missing:
        pytest.skip("every logger is installed here")
    with pytest.raises(ImportError, match=rf"^report_to: {missing[0]} needs {missing[0]}, which is not installed"):
        make_trainer(tmp_path, tokenizer, report_to=missing[0])
    assert not (tmp_path / "out").exists()  # nothing written
