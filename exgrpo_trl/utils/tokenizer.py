"""Loading the tokenizer saved with a model, as the class it was saved as."""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(name_or_path: str, *, revision: str = "main", trust_remote_code: bool = False):
    """The tokenizer saved with a model, as the class it was saved as.

    `AutoTokenizer` maps a folder by its model type: on a folder whose config says ``qwen2`` it returns Qwen's
    byte-level tokenizer even when the folder holds a different (e.g. character-level) tokenizer saved as
    `PreTrainedTokenizerFast`. For a local folder we therefore honour ``tokenizer_class`` from
    ``tokenizer_config.json`` when transformers has that class; Hub ids and everything else go through
    `AutoTokenizer`. Left padding (generation), left truncation.
    """
    tokenizer = None
    config_file = Path(name_or_path) / "tokenizer_config.json"
    if config_file.is_file():
        class_name = json.loads(config_file.read_text()).get("tokenizer_class")
        tokenizer_class = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
        if isinstance(tokenizer_class, type) and issubclass(tokenizer_class, PreTrainedTokenizerBase):
            tokenizer = tokenizer_class.from_pretrained(name_or_path)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(name_or_path: str, *, revision: str = "main", trust_remote_code: bool = False):
    """A vision-language model's processor (`AutoProcessor`), its tokenizer padding and truncating on the left as
    `load_tokenizer`'s does. Raises ValueError, in one line, when `name_or_path` has no processor for images."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or not hasattr(processor, "image_processor"):
        raise ValueError(
            f"the training data has images, but {name_or_path} has no image processor: train a vision-language model"
        )
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def checkpoint_tokenizer(checkpoint: str | Path, tokenizer: str | None = None):
    """The tokenizer `tokenizer` names (a folder or a Hub id), else the one saved in the `checkpoint` folder (TRL saves
    the processing class with every checkpoint). Raises ValueError, in one line, when there is none or it cannot be
    loaded."""
    if tokenizer is None:
        if not any((Path(checkpoint) / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(
                f"{checkpoint} holds no tokenizer ({' or '.join(TOKENIZER_FILES)}); name the run's with --tokenizer "
                "PATH (its model folder or Hub id)"
            )
        tokenizer = str(checkpoint)
    try:
        return load_tokenizer(tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer {tokenizer}: {' '.join(str(e).split())}") from e
