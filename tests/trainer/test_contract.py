"""Pins the TRL 1.16 internals ExGRPOTrainer relies on, so that a TRL upgrade fails here, loudly."""

import inspect

import pytest
import trl
from trl import GRPOTrainer
from trl.trainer.utils import RepeatSampler

from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer
from tests.helpers import config_kwargs, make_model, make_reward, synthetic_dataset


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_trl_version_is_pinned():
    assert trl.__version__.startswith("1.16."), trl.__version__


def test_hook_signatures():
    assert params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert params(GRPOTrainer._generate_single_turn) == [
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ]
    assert params(GRPOTrainer._calculate_rewards) == [
        "self",
        "inputs",
        "prompts",
        "completions",
        "completion_ids_list",
    ]
    assert params(GRPOTrainer._compute_loss) == ["self", "model", "inputs"]
    # TRL averages each list of `_metrics[mode]` into the row, then clears them (ExGRPO's gauges rely on both)
    assert params(GRPOTrainer.log) == ["self", "logs", "start_time"]
    source = inspect.getsource(GRPOTrainer.log)
    assert "self._metrics[mode].items()" in source and "self._metrics[mode].clear()" in source
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[:6] == [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
    ]
    assert "compute_entropy" in params(GRPOTrainer._get_per_token_logps_and_entropies)
    assert params(GRPOTrainer._get_train_sampler) == ["self", "dataset"]
    assert params(GRPOTrainer._tokenize_prompts) == ["self", "prompts"]
    assert params(RepeatSampler.__init__) == [
        "self",
        "data_source",
        "mini_repeat_count",
        "batch_size",
        "repeat_count",
        "shuffle",
        "seed",
    ]
    init = params(GRPOTrainer.__init__)
    assert {"tools", "rollout_func", "environment_factory", "args", "train_dataset"} <= set(init)


def test_runtime_contract(tmp_path, tokenizer):
    """One real generation batch through the hooks: the attributes read and the keys TRL returns."""
    trainer = ExGRPOTrainer(
        model=make_model(tokenizer),
        reward_funcs=make_reward(tokenizer),
        args=ExGRPOConfig(**config_kwargs(tmp_path, replay_start_pass_rate=0.0)),
        train_dataset=synthetic_dataset(),
        processing_class=tokenizer,
    )
    for name in (
        "_step",
        "eos_token_ids",
        "_tokenizer",
        "reward_weights",
        "_metrics",
        "_pending_extra_logs",
        "num_generations",
        "loss_type",
        "max_completion_length",
        "_logs",
    ):
        assert hasattr(trainer, name), name
    sampler = GRPOTrainer._get_train_sampler(trainer)
    assert isinstance(sampler, RepeatSampler) and sampler.num_samples == 48 and sampler.batch_size == 4
    trainer.model.train()
    inputs = [{"prompt": p, "always": False} for p in synthetic_dataset()["prompt"][:4] for _ in range(8)]
    handed = []  # what the hooks handed on, as `_exgrpo_after_scoring` receives it
    original_after = trainer._exgrpo_after_scoring
    trainer._exgrpo_after_scoring = lambda batch, output: handed.append(batch) or original_after(batch, output)
    output = trainer._generate_and_score_completions(inputs)
    assert {
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "advantages",
        "num_items_in_batch",
    } <= set(output)
    assert output["advantages"].shape == (32,)
    (batch,) = handed
    assert batch.rewards.shape == (32, 1)  # gathered over ranks: (N_global, num reward funcs)
    assert len(batch.completion_ids) == 32
    assert trainer._exgrpo_batch is None  # dropped once scored
    captured = []
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        captured.append(result)
        return result

    GRPOTrainer._get_per_token_logps_and_entropies = spy
    try:
        trainer.current_gradient_accumulation_steps = 1
        trainer._compute_loss(trainer.model, output)
    finally:
        GRPOTrainer._get_per_token_logps_and_entropies = original
    assert len(captured) == 1  # one policy forward per loss pass, which ExGRPO reuses
    assert captured[0][0].shape == output["completion_ids"].shape


def test_environment_owned_data_rejected(tmp_path, tokenizer):
    # tools, environments and rollout functions train (tests/trainer/test_multi_turn.py); an environment that picks
    # its own
    # questions (no train_dataset) cannot have a question replayed, and says so before TRL builds anything
    with pytest.raises(ValueError, match="needs a train_dataset with a 'prompt' column when environment_factory"):
        ExGRPOTrainer(
            model=make_model(tokenizer),
            reward_funcs=make_reward(tokenizer),
            args=ExGRPOConfig(**config_kwargs(tmp_path)),
            processing_class=tokenizer,
            environment_factory=object,
        )


def test_images_and_plain_grpo_config_rejected(tmp_path, tokenizer):
    from datasets import Dataset
    from trl import GRPOConfig

    with pytest.raises(NotImplementedError, match="image inputs"):
        ExGRPOTrainer(
            model=make_model(tokenizer),
            reward_funcs=make_reward(tokenizer),
            args=ExGRPOConfig(**config_kwargs(tmp_path)),
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": ["a"], "image": [None]}),
        )
    with pytest.raises(TypeError, match="needs an ExGRPOConfig, got a GRPOConfig"):
        ExGRPOTrainer(
            model=make_model(tokenizer),
            reward_funcs=make_reward(tokenizer),
            args=GRPOConfig(**config_kwargs(tmp_path)),
            processing_class=tokenizer,
            train_dataset=synthetic_dataset(),
        )
