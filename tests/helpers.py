"""What the tests share: the tiny models and datasets they train, the trainer settings they start from, and the
repository's paths. Fixtures built from these are in conftest.py.

The synthetic reward makes an untrained model score about half of its rollouts, so groups land in every success
bucket without any warm start: a completion counts as solved when it ends with EOS within 6 tokens. Rows whose
`always` column is True are solved whatever the completion, so their groups are K/K and the question retires.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
# The top folders of this machine's absolute paths (the workspace, temporary files, home folders), spelled without
# slashes so that the checks for them do not name a machine path themselves; no committed file may hold "/NAME/".
WORKSPACE = "work"
MACHINE_DIRS = ("tmp", WORKSPACE, "root", "home")


def tiny_config(config_class, tokenizer=None, **fields):
    """A tiny model config of `config_class` (Qwen2Config, LlamaConfig, ...): hidden 32, 1 layer of 2 heads,
    intermediate 64, the tokenizer's vocabulary and special ids; `fields` override. The one place the tests' tiny
    model shapes start from (the char-tokenizer models of `make_model` come from the package's `build_tiny_model`)."""
    defaults = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    if tokenizer is not None:
        defaults.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    return config_class(**{**defaults, **fields})


def make_reward_model(tokenizer):
    """A tiny randomly initialised reward model (one label) over the char tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    # outputs spread over about +-1, so that its weighted reward visibly moves advantages
    config = tiny_config(Qwen2Config, tokenizer, num_labels=1, initializer_range=0.5)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return Qwen2ForSequenceClassification(config).eval()


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


def make_trainer(
    tmp_path,
    tokenizer,
    *,
    cls=None,
    model=None,
    model_seed: int = 0,
    reward_funcs=None,
    train_dataset=None,
    callbacks=None,
    peft_config=None,
    trainer_kwargs=None,
    **config,
):
    """The one way the tests build a trainer: `cls` (default ExGRPOTrainer; TRL's GRPOTrainer, or a subclass of
    either) on the tiny model (`make_model`, seed `model_seed`), the synthetic reward and dataset unless given, with
    `config_kwargs(tmp_path, **config)`: an ExGRPOConfig for ExGRPOTrainer and its subclasses, a GRPOConfig otherwise
    (ExGRPO's own fields are then an error, as they would be for GRPOConfig). `tokenizer` is the processing class;
    `model` may be a model or a path; `reward_funcs=[]` gives none (an environment that owns its reward);
    `callbacks`, `peft_config` and `trainer_kwargs` (the constructor's other keywords: `tools`,
    `environment_factory`, `rollout_func`, `eval_dataset`, a subclass's own, ...) go to the trainer."""
    from trl import GRPOConfig

    from exgrpo_trl import ExGRPOConfig, ExGRPOTrainer

    cls = ExGRPOTrainer if cls is None else cls
    config_cls = ExGRPOConfig if issubclass(cls, ExGRPOTrainer) else GRPOConfig
    return cls(
        model=make_model(tokenizer, seed=model_seed) if model is None else model,
        reward_funcs=make_reward(tokenizer) if reward_funcs is None else reward_funcs,
        args=config_cls(**config_kwargs(tmp_path, **config)),
        train_dataset=synthetic_dataset() if train_dataset is None else train_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
        **(trainer_kwargs or {}),
    )


def toy_recipe_args(toy_dir, out) -> list[str]:
    """`exgrpo train` arguments: the CPU recipe on a toy model folder (`toy_dir`), writing into `out`."""
    return ["--config", str(TINY_RECIPE), "--model_name_or_path", str(toy_dir), "--dataset_name",
            str(toy_dir / "train.jsonl"), "--output_dir", str(out)]  # fmt: skip


def write_toy_dir(out, **model_kwargs):
    """A tiny model + char tokenizer and the toy task, written the way `python -m exgrpo_trl.tasks.toy --out` does."""
    from exgrpo_trl.tasks.toy import addition_splits, build_tiny_model_dir

    build_tiny_model_dir(out, **model_kwargs)
    train, eval_ = addition_splits(64, 8, seed=0)
    train.to_json(str(out / "train.jsonl"))
    eval_.to_json(str(out / "eval.jsonl"))
    return out


def state_of(buffer):
    """A buffer's saved state as plain lists and JSON, for comparing two buffers."""
    arrays, meta = buffer.state_dict()
    return {k: v.tolist() for k, v in arrays.items()}, json.loads(json.dumps(meta))
