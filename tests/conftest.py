"""Shared fixtures: a tiny Qwen2-shaped model and a char tokenizer built locally, and a synthetic verifiable task.

The synthetic reward makes an untrained model score about half of its rollouts, so groups land in every success
bucket without any warm start: a completion counts as solved when it ends with EOS within 6 tokens. Rows whose
`always` column is True are solved whatever the completion, so their groups are K/K and the question retires.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tokenizer():
    from exgrpo_trl.tasks.toy import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A saved tiny toy model and its char tokenizer (exgrpo_trl.tasks.toy), loadable by name like a Hub model."""
    from exgrpo_trl.tasks.toy import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def make_model(tokenizer, seed: int = 0):
    from exgrpo_trl.tasks.toy import build_tiny_model

    return build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, seed=seed)


def synthetic_dataset(n: int = 48, always_every: int = 8):
    from datasets import Dataset

    prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)][:n]
    return Dataset.from_dict({"prompt": prompts, "always": [i % always_every == 0 for i in range(n)]})


def make_reward(tokenizer):
    eos = tokenizer.eos_token_id

    def short_answer_reward(completion_ids, always, **kwargs):
        return [1.0 if (a or (eos in ids and len(ids) <= 6)) else 0.0 for ids, a in zip(completion_ids, always)]

    return short_answer_reward


def config_kwargs(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=12,
        learning_rate=1e-4,
        max_steps=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
        loss_type="dr_grpo",
        scale_rewards="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return kwargs


ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
# The top folders of this machine's absolute paths (the workspace, temporary files, home folders), spelled without
# slashes so that the checks for them do not name a machine path themselves; no committed file may hold "/NAME/".
WORKSPACE = "work"
MACHINE_DIRS = ("tmp", WORKSPACE, "root", "home")


def toy_recipe_args(toy_dir, out) -> list[str]:
    """`exgrpo train` arguments: the CPU recipe on a toy model folder (`toy_dir`), writing into `out`."""
    return ["--config", str(TINY_RECIPE), "--model_name_or_path", str(toy_dir), "--dataset_name",
            str(toy_dir / "train.jsonl"), "--output_dir", str(out)]  # fmt: skip


def _write_toy_dir(out, **model_kwargs):
    """A tiny model + char tokenizer and the toy task, written the way `python -m exgrpo_trl.tasks.toy --out` does."""
    from exgrpo_trl.tasks.toy import addition_splits, build_tiny_model_dir

    build_tiny_model_dir(out, **model_kwargs)
    train, eval_ = addition_splits(64, 8, seed=0)
    train.to_json(str(out / "train.jsonl"))
    eval_.to_json(str(out / "eval.jsonl"))
    return out


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """The toy model folder with the builder's default shape, its train.jsonl (64 questions) and eval.jsonl (8)."""
    return _write_toy_dir(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="session")
def small_toy_dir(tmp_path_factory):
    """The same with a smaller model (hidden 64, 2 layers): for tests that start many training processes."""
    return _write_toy_dir(tmp_path_factory.mktemp("small-toy"), hidden_size=64, num_layers=2, intermediate_size=128)
