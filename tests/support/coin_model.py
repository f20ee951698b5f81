"""A stand-in for a math model in the documentation's quick starts: a tiny Llama whose every next token is uniform
over a six-word vocabulary, three of which are whole final answers (``</think>\\boxed{42}`` twice,
``</think>\\boxed{7}`` once). Under the `math_verify` reward, on questions whose answer is 42, it solves about half of
its completions (0.49 measured over 800 sampled sequences), whatever the question: every success count lands in a
middle bucket, a generation batch's Pass@1 clears the delayed start (0.35), and ExGRPO replays from its second
generation batch. It has a chat template, so conversational prompts work as they do with a real model."""

from __future__ import annotations

import json
from pathlib import Path

ANSWER = "42"
VOCAB = ["<pad>", "<eos>", "<unk>", "</think>\\boxed{42}", "</think> \\boxed{42}", "</think>\\boxed{7}"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}{% endif %}"
)


def build_coin_model_dir(out: str | Path) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tests.helpers import tiny_config

    out = Path(out)
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    # Llama, not Qwen2: AutoTokenizer (what the trainer uses given a model name) maps a qwen2 folder to Qwen's
    # byte-level tokenizer whatever the folder holds, and this word-level one would be lost.
    config = tiny_config(LlamaConfig, vocab_size=len(VOCAB), max_position_embeddings=4096, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # zero logits: every token equally likely, at every position
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def write_math_questions(path: str | Path, n: int) -> str:
    """`n` questions in the paper data's layout (conversational `prompt`, the reference answer in `reward_model`), all
    answered by 42, as a JSON-lines file `load_math_dataset` reads like the Hub set."""
    with open(path, "w") as f:
        for i in range(n):
            prompt = [{"role": "user", "content": f"Question {i}: what is {i} + {42 - i}?"}]
            f.write(json.dumps({"prompt": prompt, "reward_model": {"ground_truth": ANSWER, "style": "rule"}}) + "\n")
    return str(path)
