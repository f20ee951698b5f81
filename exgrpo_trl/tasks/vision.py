"""A tiny vision-language model and an image task for trying ExGRPO with images on a CPU: everything built locally,
nothing downloaded. The model is Qwen2-VL shaped (about 88k parameters, random weights, built in well under a second
once transformers is imported) and trainable by TRL's `GRPOTrainer` and `ExGRPOTrainer` on images; the task's
answer is only in the image: every question reads "What colour is the image?" beside a solid-colour square.

- `build_tiny_vlm`: ``(model, processor)``, a `Qwen2VLForConditionalGeneration` of 2 text layers (hidden 32) and a
  1-layer vision tower (embed 32), float32, random weights from a seed, and its processor (`build_tiny_processor`).
  At initialisation the image moves the next token's log-probabilities by about 1e-2: small, but far above float
  noise, so two images can be told apart.
- `build_tiny_processor`: a `Qwen2VLProcessor` (the images-only subclass `TinyQwen2VLProcessor`, see below) assembled
  from parts: the family's image processor (its PIL backend, `Qwen2VLImageProcessorPil`) with pixel limits so small
  that a 28x28 image is 2x2 patches of 14 pixels (one image token after the 2x2 merge) and a 56x56 one 4x4 patches
  (four tokens); a word-level tokenizer (`tokenizers`) over the words the chat template and the task use, with
  Qwen's special tokens (``<|im_start|>``, ``<|im_end|>`` = EOS, ``<|endoftext|>`` = pad, ``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``); and the Qwen2-VL chat template TRL ships
  (`trl.chat_template_utils.qwen2_5_vl_chat_template`, byte-identical to Qwen2-VL's), so a conversational prompt with
  an image block renders as ``<|vision_start|><|image_pad|><|vision_end|>`` and the processor expands the pad to one
  token per merged patch, returning ``pixel_values`` (one row of 3*2*14*14 = 1176 values per patch),
  ``image_grid_thw`` and ``mm_token_type_ids``.
- `save_tiny_vlm`: both written to a folder that `AutoProcessor` / `AutoModelForImageTextToText` load back (in a
  process that imported this module: see `TinyQwen2VLProcessor`).
- `colour_dataset`: solid-colour images whose colour is the answer; every row has the same prompt text
  (`QUESTION`), so only the image tells the rows apart.
- `colour_reward`: 1.0 when the completion contains the answer's colour word, else 0.0.

The colour words are single tokens of the vocabulary, so an untrained model says one of them now and then (a
quarter to a half of its completions) and a group of completions usually has mixed rewards: replay has questions to
store from the first batch. The trainer page's "Quick start on a CPU with images" trains it.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch
from datasets import Dataset, Features, Image, Value
from PIL import Image as PILImage
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoProcessor,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin
from trl.chat_template_utils import qwen2_5_vl_chat_template

COLOURS = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}
QUESTION = "What colour is the image?"

PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
UNK = "<unk>"
SPECIAL_TOKENS = (PAD, IM_START, EOS, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, UNK)
# the words of the chat template's default system prompt, the roles, the question and some answers
WORDS = (
    "\n", "system", "user", "assistant", "You", "are", "a", "helpful", ".", "?", ",", "!", "What", "colour", "color",
    "is", "the", "image", "it", "It", "The", "I", "see", "this", "not", "sure", *COLOURS,
)  # fmt: skip
VOCAB = (*SPECIAL_TOKENS, *WORDS)

# patches of 14 pixels merged 2x2: between one merged patch (28x28 pixels) and 2x2 merged patches (56x56)
MIN_PIXELS = 28 * 28
MAX_PIXELS = 56 * 56


class TinyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor: images only.

    transformers 5 cannot build a video processor, nor even check one's class, without torchvision, which the project
    does not install: `Qwen2VLProcessor(image_processor, tokenizer)` fails in
    `ProcessorMixin.check_argument_for_proper_class` (the video processor mapping is a dummy), and
    `AutoProcessor.from_pretrained` of a Qwen2-VL folder fails on `AutoVideoProcessor`. This subclass has no
    `video_processor` argument, so none is checked, saved or loaded; everything else is Qwen2VLProcessor's (`__call__`,
    the image-token expansion, `mm_token_type_ids`, `apply_chat_template`), and `isinstance(p, Qwen2VLProcessor)`.
    With torchvision installed, a plain `Qwen2VLProcessor` with a `Qwen2VLVideoProcessor` does the same for images.

    Importing this module registers the class with `AutoProcessor` (under a private config class, so Qwen2-VL's own
    mapping is untouched): a folder from `save_tiny_vlm` names it in ``processor_config.json``. In a process that has
    not imported this module, `AutoProcessor.from_pretrained` of that folder silently returns the bare tokenizer.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
        self.video_token = getattr(tokenizer, "video_token", None) or VIDEO_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class _TinyQwen2VLProcessorKey(PreTrainedConfig):
    """Only a key of AutoProcessor's mapping, never instantiated: `AutoProcessor.from_pretrained` finds a registered
    processor class by the name saved in ``processor_config.json``, whatever config class it was registered under."""

    model_type = "tiny_qwen2_vl_images_only"


AutoProcessor.register(_TinyQwen2VLProcessorKey, TinyQwen2VLProcessor, exist_ok=True)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `VOCAB`: words, punctuation and newlines are tokens, spaces are dropped (decoding
    joins tokens with spaces, then glues punctuation back), anything else is ``<unk>``. EOS is ``<|im_end|>`` (the
    end of a chat turn), pad ``<|endoftext|>``, left padding; the special tokens are added tokens, matched in the raw
    text before splitting, and the image and video tokens are its `image_token` / `video_token`."""
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\n|\w+|[^\w\s]"), behavior="isolated"),
        ]
    )
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins with spaces, ` .` -> `.`
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD},
        padding_side="left",
        model_max_length=512,
    )


def build_tiny_processor(max_pixels: int = MAX_PIXELS) -> TinyQwen2VLProcessor:
    """The processor of the tiny model: `Qwen2VLImageProcessorPil` (images resized to between 28x28 and 56x56
    pixels, or `max_pixels`), the tokenizer of `build_tiny_tokenizer` and TRL's Qwen2-VL chat template."""
    image_processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=max_pixels)
    return TinyQwen2VLProcessor(
        image_processor=image_processor, tokenizer=build_tiny_tokenizer(), chat_template=qwen2_5_vl_chat_template
    )


def tiny_vlm_config(tokenizer, text: dict | None = None, vision: dict | None = None) -> Qwen2VLConfig:
    """A `Qwen2VLConfig`: 2 text layers (hidden 32, 2 heads of 16, 1 KV head, M-RoPE sections 2+3+3 of the 8
    rotary pairs), a 1-layer vision tower (embed 32, 2 heads, 14-pixel patches, 2x2 merge into the text width) and
    the tokenizer's vocabulary and ids. `text` and `vision` replace fields of either (a larger shape for a GPU:
    a GPU's benchmark); the vision tower's output width follows the text's hidden size."""
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
        ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END),
    )}  # fmt: skip
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    vision_config = dict(
        depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2,
    )  # fmt: skip
    text_config.update(text or {})
    vision_config.update(vision or {}, hidden_size=text_config["hidden_size"])
    return Qwen2VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False, **ids)


def build_tiny_vlm(
    seed: int = 0, text: dict | None = None, vision: dict | None = None, max_pixels: int = MAX_PIXELS
) -> tuple[Qwen2VLForConditionalGeneration, TinyQwen2VLProcessor]:
    """`(model, processor)`: a tiny `Qwen2VLForConditionalGeneration` (float32, random weights drawn under
    `torch.manual_seed(seed)` without moving the global generator) and its processor (`build_tiny_processor`). The
    generation config ends on ``<|im_end|>`` and pads with ``<|endoftext|>``; the same seed gives the same weights.
    `text` and `vision` change the shape (`tiny_vlm_config`), `max_pixels` the processor's largest image."""
    processor = build_tiny_processor(max_pixels)
    tokenizer = processor.tokenizer
    config = tiny_vlm_config(tokenizer, text, vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model, processor


def save_tiny_vlm(
    path: str | os.PathLike,
    seed: int = 0,
    text: dict | None = None,
    vision: dict | None = None,
    dtype=None,
    max_pixels: int = MAX_PIXELS,
) -> str:
    """Write the tiny model (`build_tiny_vlm(seed)`) and its processor to `path` (made if missing), about 400 KB;
    returns the path as a string, which a trainer can be given as its model (`AutoProcessor.from_pretrained` of it
    needs this module imported, see `TinyQwen2VLProcessor`). `text`, `vision`: the shape (`tiny_vlm_config`);
    `dtype`: the weights' saved dtype (default float32); `max_pixels`: the processor's largest image."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, processor = build_tiny_vlm(seed, text, vision, max_pixels)
    if dtype is not None:
        model = model.to(dtype)
        model.config.dtype = dtype
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def colour_image(colour: str, size: int = 28, shade: tuple[int, int, int] = (0, 0, 0)) -> PILImage.Image:
    """A `size` x `size` RGB PIL image of one solid colour of `COLOURS`, each channel moved inwards (0 up, 255 down)
    by `shade`'s amount for it."""
    rgb = tuple(c + d if c < 128 else c - d for c, d in zip(COLOURS[colour], shade, strict=True))
    return PILImage.new("RGB", (size, size), rgb)


def vlm_prompt(question: str = QUESTION) -> list[dict]:
    """A conversational prompt: one user message, an image placeholder block then the question's text block. TRL
    (`prepare_multimodal_messages`) puts the row's `image` into the placeholder."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def colour_dataset(n: int = 16, seed: int = 0, size: int = 28, colours=None, shades: int = 0) -> Dataset:
    """A `datasets.Dataset` of `n` rows: `prompt` (`vlm_prompt()`, the same for every row), `image` (a solid
    `size`-pixel square, the `Image` feature: PNG bytes in the table, a PIL image when read) and `answer` (its colour
    word). Colours are drawn uniformly from `colours` (default: every one of `COLOURS`) by `random.Random(seed)`.
    `shades` > 0 moves each channel of each image inwards by 0 to `shades` (drawn after the colours), so that the rows
    are (nearly all) different questions, ExGRPO keying a question by its text and its image's pixels, with six
    answers; with 0 the images of a colour are the same, six questions in all."""
    names = list(COLOURS if colours is None else colours)
    rng = random.Random(seed)
    answers = [rng.choice(names) for _ in range(n)]
    offsets = [tuple(rng.randint(0, shades) for _ in range(3)) if shades else (0, 0, 0) for _ in answers]
    features = Features(
        {
            "prompt": [{"role": Value("string"), "content": [{"type": Value("string"), "text": Value("string")}]}],
            "image": Image(),
            "answer": Value("string"),
        }
    )
    return Dataset.from_dict(
        {"prompt": [vlm_prompt() for _ in answers],
         "image": [colour_image(a, size, shade) for a, shade in zip(answers, offsets, strict=True)],
         "answer": answers},
        features=features,
    )  # fmt: skip


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    parts = []
    for message in completion:  # conversational: a list of messages, content a string or a list of blocks
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(block.get("text") or "" for block in content if isinstance(block, dict))
    return " ".join(parts)


def colour_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 for each completion whose words (lower-cased, punctuation split off) include its
    row's `answer`, else 0.0. Completions may be strings or lists of chat messages."""
    return [
        1.0 if a.lower() in re.findall(r"\w+", _completion_text(c).lower()) else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]
