"""Session fixtures: the char tokenizer, a saved tiny model, and toy model folders with their data (built from
`tests.helpers`)."""

from __future__ import annotations

import os

import pytest

from tests.helpers import write_toy_dir

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


@pytest.fixture(scope="session")
def toy_dir(tmp_path_factory):
    """The toy model folder with the builder's default shape, its train.jsonl (64 questions) and eval.jsonl (8)."""
    return write_toy_dir(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="session")
def small_toy_dir(tmp_path_factory):
    """The same with a smaller model (hidden 64, 2 layers): for tests that start many training processes."""
    return write_toy_dir(tmp_path_factory.mktemp("small-toy"), hidden_size=64, num_layers=2, intermediate_size=128)
