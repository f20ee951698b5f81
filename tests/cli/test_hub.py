"""Hub push of a trained model: the full model, a LoRA adapter alone, and the adapter merged into its base model.

The Hub cannot be reached from here. Everything runs for real (training, `Trainer.push_to_hub`, saving, the model card,
the choice of files and patterns) except the two HTTP calls at the end: `HfApi.create_repo` and `HfApi.upload_folder`
are replaced by the local stand-in in `tests/support/hub_stand_in.py`, which records the files the real `upload_folder`
would commit (selected with huggingface_hub's own filter and default ignore patterns) and the call's arguments. The
tests then read what would have been uploaded: file names, weights (loaded back), and the card.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from exgrpo_trl.utils.hub import ADAPTER_FILES, push_trained_model
from tests.helpers import make_model, make_trainer
from tests.support import hub_stand_in

LORA_R, LORA_ALPHA = 4, 8  # scaling alpha / r = 2
LORA_TARGETS = ("q_proj", "v_proj")
SECTION = "## ExGRPO training"
TINY_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml"
BUFFER_LINE = re.compile(
    r"Experience buffer at the end of training: (\d+) questions, (\d+) trajectories, (\d+) retired"
)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The Hub stand-in; any other Hub request fails (offline mode) instead of reaching for the network."""
    record = tmp_path / "hub"
    hub_stand_in.install(record, monkeypatch)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    return record


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("base")
    make_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _train(out, base_dir, tokenizer, *, peft_config=None, **overrides):
    # lr 1e-2: two Adam steps move every LoRA B entry by ~1e-2, so the merged weights differ visibly from the base
    trainer = make_trainer(out, tokenizer, model=str(base_dir),  # a path, as `exgrpo train` passes it: the base
                           peft_config=peft_config, max_steps=2, learning_rate=1e-2, replay_start_pass_rate=0.0,
                           **overrides)  # fmt: skip
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def lora_trainer(tmp_path_factory, base_dir, tokenizer):
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    return _train(tmp_path_factory.mktemp("lora"), base_dir, tokenizer, peft_config=lora)


@pytest.fixture(scope="module")
def full_trainer(tmp_path_factory, base_dir, tokenizer):
    # checkpoints in output_dir: the push must leave them out
    return _train(tmp_path_factory.mktemp("full"), base_dir, tokenizer, save_strategy="steps", save_steps=1)


def _logits(model, tokenizer):
    ids = tokenizer(["12+34=", "7+8="], padding=True, return_tensors="pt", add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        return model(**ids).logits


def _check_card(text: str, trainer, extra_tags=()):
    assert text.count(SECTION) == 1
    assert "zhan2025exgrpo" in text and "2510.02245" in text
    tags = set(ModelCard(text).data.tags)
    assert {"trl", "grpo", "exgrpo", *extra_tags} <= tags
    buffer = trainer.exgrpo_state.buffer
    m = BUFFER_LINE.search(text)
    assert m and tuple(map(int, m.groups())) == (buffer.num_questions, buffer.num_trajectories, len(buffer.retired))


# ---------------------------------------------------------------------------------------------------------------
def test_full_model_push(full_trainer, tokenizer, hub):
    out = full_trainer.args.output_dir
    commit = push_trained_model(full_trainer, repo_id="tester/tiny-exgrpo-full", tags=["math"])
    (upload,) = hub_stand_in.read_uploads(hub)
    assert upload["repo_id"] == "tester/tiny-exgrpo-full" and commit.commit_url.startswith(
        "https://huggingface.co/tester/tiny-exgrpo-full/commit/"
    )
    assert upload["folder_path"] == str(out)
    files = set(upload["files"])
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not files & set(ADAPTER_FILES)
    # output_dir holds checkpoint-1 and checkpoint-2; Trainer.push_to_hub leaves them out
    assert {"checkpoint-1", "checkpoint-2"} <= set(os.listdir(out))
    assert not any(name.startswith("checkpoint-") for name in files)

    weights = load_file(upload["dir"] / "model.safetensors")
    state = full_trainer.model.state_dict()
    assert set(weights) == {k for k in state if k != "lm_head.weight"}  # tied to the embeddings, saved once
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name
    _check_card((upload["dir"] / "README.md").read_text(), full_trainer, extra_tags=["math"])


def test_merge_needs_an_adapter(full_trainer, hub):
    with pytest.raises(ValueError, match="merge_adapter=True needs a PEFT"):
        push_trained_model(full_trainer, merge_adapter=True, repo_id="tester/nope")
    assert hub_stand_in.read_uploads(hub) == []


def test_adapter_only_push(lora_trainer, base_dir, tokenizer, hub):
    push_trained_model(lora_trainer, repo_id="tester/tiny-exgrpo-lora", tags=["lora"])
    (upload,) = hub_stand_in.read_uploads(hub)
    assert upload["repo_id"] == "tester/tiny-exgrpo-lora"
    files = set(upload["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "tokenizer.json"} <= files
    # the adapter alone: no full weights, no base config
    assert not [
        f
        for f in files
        if f.endswith((".safetensors", ".bin", ".pt"))
        and not f.startswith("adapter_model")
        and f != "training_args.bin"
    ]
    assert "config.json" not in files and "model.safetensors" not in files

    config = json.loads((upload["dir"] / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir)
    assert (config["r"], config["lora_alpha"]) == (LORA_R, LORA_ALPHA)
    assert set(config["target_modules"]) == set(LORA_TARGETS)
    saved = load_file(upload["dir"] / "adapter_model.safetensors")
    expected = get_peft_model_state_dict(lora_trainer.model)
    assert set(saved) == set(expected) and len(saved) == 2 * 2 * len(LORA_TARGETS)  # 2 layers x targets x (A, B)
    for name in saved:
        assert torch.equal(saved[name], expected[name]), name

    # loaded back over the base, the adapter is the trained model
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), upload["dir"])
    torch.testing.assert_close(_logits(reloaded, tokenizer), _logits(lora_trainer.model, tokenizer), rtol=0, atol=1e-6)
    _check_card((upload["dir"] / "README.md").read_text(), lora_trainer, extra_tags=["lora"])


def test_merged_push(lora_trainer, base_dir, tokenizer, hub, tmp_path):
    merged_dir = tmp_path / "merged"
    push_trained_model(lora_trainer, merge_adapter=True, repo_id="tester/tiny-exgrpo-merged", merged_dir=merged_dir)
    assert (merged_dir / "model.safetensors").is_file()  # kept locally when asked for
    (upload,) = hub_stand_in.read_uploads(hub)
    assert upload["repo_id"] == "tester/tiny-exgrpo-merged"
    assert upload["delete_patterns"] == list(ADAPTER_FILES)  # stale adapter files leave the repo in the same commit
    files = set(upload["files"])
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
    assert not files & set(ADAPTER_FILES)

    # merged = base + (alpha / r) * B @ A on every targeted projection, and exactly the base elsewhere
    merged = load_file(upload["dir"] / "model.safetensors")
    base = load_file(base_dir / "model.safetensors")
    adapter = get_peft_model_state_dict(lora_trainer.model)
    assert set(merged) == set(base)
    deltas = {}
    for name, a in adapter.items():
        if name.endswith("lora_A.weight"):
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[name.replace("lora_A", "lora_B")]
            deltas[f"{module}.weight"] = (LORA_ALPHA / LORA_R) * (b @ a)  # (out, r) @ (r, in)
    assert len(deltas) == 2 * len(LORA_TARGETS)
    for name, weight in merged.items():
        if name in deltas:
            assert deltas[name].abs().max() > 1e-3, name  # the adapter was trained: the merge is visible
            torch.testing.assert_close(weight, base[name] + deltas[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(weight, base[name]), name

    # loaded back with plain transformers (no peft), the merged model is the trained model
    reloaded = AutoModelForCausalLM.from_pretrained(upload["dir"])
    assert not hasattr(reloaded, "peft_config")
    torch.testing.assert_close(_logits(reloaded, tokenizer), _logits(lora_trainer.model, tokenizer), rtol=0, atol=1e-5)
    # the trainer still holds its adapter (the merge worked on a reloaded copy)
    assert isinstance(lora_trainer.model, PeftModel)
    _check_card((upload["dir"] / "README.md").read_text(), lora_trainer)


# ---------------------------------------------------------------------------------------------------------------
# `exgrpo train`: the user's choice between the adapter and the merged model
# ---------------------------------------------------------------------------------------------------------------
def test_train_cli_rejects_merge_without_peft(tmp_path):
    from exgrpo_trl.cli import train as train_module

    script_args, args, model_args = train_module.parse_args(
        ["--config", str(TINY_RECIPE), "--output_dir", str(tmp_path), "--merge_adapter_on_push", "true"]
    )
    assert script_args.merge_adapter_on_push is True and not model_args.use_peft
    with pytest.raises(ValueError, match="merge_adapter_on_push needs a LoRA adapter"):
        train_module.train(script_args, args, model_args)


def test_train_cli_pushes_merged_lora(tmp_path, hub):
    from exgrpo_trl.cli import train as train_module
    from exgrpo_trl.tasks.toy import addition_splits, build_tiny_model_dir

    toy = tmp_path / "toy"
    build_tiny_model_dir(toy, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    addition_splits(32, 4, seed=0)[0].to_json(str(toy / "train.jsonl"))
    out = tmp_path / "out"
    argv = [
        "--config", str(TINY_RECIPE), "--model_name_or_path", str(toy), "--dataset_name", str(toy / "train.jsonl"),
        "--output_dir", str(out), "--max_steps", "1", "--save_strategy", "no", "--logging_steps", "1",
        "--per_device_train_batch_size", "16", "--generation_batch_size", "16",
        "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "1e-2",
        "--reward_funcs", "tests.support.cli_rewards:short_completion_reward",
        "--push_to_hub", "true", "--hub_model_id", "tester/tiny-cli-merged", "--merge_adapter_on_push", "true",
    ]  # fmt: skip
    assert train_module.main(argv) == 0

    # output_dir: the adapter (and no base config.json beside it), trained away from the identity
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    lora_b = [t for name, t in load_file(out / "adapter_model.safetensors").items() if "lora_B" in name]
    assert lora_b and max(t.abs().max().item() for t in lora_b) > 1e-3
    (upload,) = hub_stand_in.read_uploads(hub)  # one push, at the end (no checkpoints)
    assert upload["repo_id"] == "tester/tiny-cli-merged"
    files = set(upload["files"])
    assert {"model.safetensors", "config.json", "README.md"} <= files and not files & set(ADAPTER_FILES)
    card = (upload["dir"] / "README.md").read_text()
    assert SECTION in card and str(toy / "train.jsonl") in card
    assert {"trl", "grpo", "exgrpo", "experience-replay"} <= set(ModelCard(card).data.tags)

    tok = train_module.load_tokenizer(str(toy))
    merged = AutoModelForCausalLM.from_pretrained(upload["dir"])
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(toy), out)
    torch.testing.assert_close(_logits(merged, tok), _logits(adapter, tok), rtol=0, atol=1e-5)
