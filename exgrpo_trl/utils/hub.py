"""Push a trained model to the Hugging Face Hub: the full model, a LoRA adapter alone, or the adapter merged into its
base model.

    push_trained_model(trainer)                       # full model, or the LoRA adapter alone (adapter_config.json +
                                                      # adapter_model.safetensors)
    push_trained_model(trainer, merge_adapter=True)   # LoRA merged into the base: a plain transformers model

Every path writes the trainer's model card (``README.md``, with the ExGRPO section) next to the weights. The full
model and the adapter go through `Trainer.push_to_hub` (save, card, `HfApi.upload_folder` of ``output_dir``); the
merged model is built from the saved adapter and uploaded with `HfApi.upload_folder`. Call it on every process (saving
is collective under DeepSpeed ZeRO-3); only the main process merges and uploads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, HfApi

__all__ = ["ADAPTER_FILES", "is_peft_trainer", "merge_adapter_into_base", "push_trained_model"]

# What PEFT writes for an adapter. A merged push deletes them from the repo (they may be there from checkpoint pushes
# during training): transformers loads a folder holding adapter_config.json as base + adapter, not as the full model.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# `from_pretrained` kwargs of the training run that also apply to reloading the base model for a merge. Quantization
# and device placement are left out on purpose: the adapter is merged into the unquantized base weights.
_BASE_MODEL_KWARGS = ("revision", "trust_remote_code", "dtype", "attn_implementation")


def is_peft_trainer(trainer) -> bool:
    """Whether the trainer trains a PEFT adapter (LoRA) rather than the full model."""
    from peft import PeftModel

    return isinstance(trainer.accelerator.unwrap_model(trainer.model), PeftModel)


def merge_adapter_into_base(
    adapter_dir: str | os.PathLike,
    *,
    base_model: str | None = None,
    **from_pretrained_kwargs: Any,
):
    """The adapter saved in `adapter_dir` merged into its base model: a plain `transformers` causal LM.

    The base is loaded afresh (`base_model`, default: the adapter's ``base_model_name_or_path``, at its ``revision``)
    in ``dtype="auto"`` unless given, so the merge is also right for a model trained sharded (ZeRO-3) or on a
    quantized base (QLoRA), where the in-memory weights are not the full-precision base.
    """
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    config = PeftConfig.from_pretrained(str(adapter_dir))
    base = base_model or config.base_model_name_or_path
    if not base:
        raise ValueError(
            f"the adapter in {adapter_dir} does not name its base model (base_model_name_or_path is empty: the "
            "policy was built in memory?); pass base_model= (a Hub id or a local folder with the base weights)."
        )
    kwargs = {"dtype": "auto", **from_pretrained_kwargs}
    if base_model is None and config.revision and "revision" not in kwargs:
        kwargs["revision"] = config.revision
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def _card_model_name(trainer) -> str:
    """The name `Trainer.push_to_hub` gives the card: the repo's name, else the output folder's."""
    return (trainer.args.hub_model_id or Path(trainer.args.output_dir).name).split("/")[-1]


def push_trained_model(
    trainer,
    *,
    merge_adapter: bool = False,
    repo_id: str | None = None,
    model_name: str | None = None,
    dataset_name: str | None = None,
    tags: list[str] | None = None,
    commit_message: str = "End of training",
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    merged_dir: str | os.PathLike | None = None,
) -> CommitInfo | None:
    """Save the trained model with its model card into ``output_dir`` and push it to the Hub.

    - Full fine-tuning: the model, tokenizer and card (`Trainer.push_to_hub`).
    - LoRA, ``merge_adapter=False``: the adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``),
      tokenizer and card, also through `Trainer.push_to_hub`; load it with ``PeftModel.from_pretrained(base, repo)``.
    - LoRA, ``merge_adapter=True``: the adapter merged into its base model (`merge_adapter_into_base`), saved with the
      tokenizer and the same card into `merged_dir` (default: a temporary folder, removed afterwards) and uploaded
      with `HfApi.upload_folder`; adapter files already in the repo are deleted in the same commit.

    `repo_id` defaults to ``args.hub_model_id``, else the output folder's name in your namespace (as `Trainer`).
    `model_name`, `dataset_name`, `tags` go to the model card. Returns the upload's `CommitInfo` on the main process,
    None on the others.
    """
    if merge_adapter and not is_peft_trainer(trainer):
        raise ValueError(
            "merge_adapter=True needs a PEFT (LoRA) model, but this trainer trains the full model: push with "
            "merge_adapter=False."
        )
    if repo_id is not None and repo_id != trainer.hub_model_id:
        trainer.args.hub_model_id = repo_id
        trainer.hub_model_id = None  # Trainer creates (or finds) the repo again under the new id
    tags = list(tags) if tags is not None else None  # Trainer.push_to_hub appends the model's tags to this list
    model_name = model_name or _card_model_name(trainer)
    if not merge_adapter:
        return trainer.push_to_hub(
            commit_message=commit_message,
            token=token,
            revision=revision,
            private=private,
            model_name=model_name,
            dataset_name=dataset_name,
            tags=tags,
        )

    # The same steps as Trainer.push_to_hub, with the merged model as what is uploaded.
    from ..trainer import finish_pending_push, save_without_push  # the private names of Trainer it takes

    token = token if token is not None else trainer.args.hub_token
    if trainer.hub_model_id is None:
        trainer.init_hf_repo(token=token, private=private)
    output_dir = trainer.args.output_dir
    save_without_push(trainer, output_dir)  # the adapter; collective under ZeRO-3
    if not trainer.is_world_process_zero():
        return None
    tags = tags or []
    for tag in getattr(trainer.model, "model_tags", None) or []:
        if tag not in tags:
            tags.append(tag)
    trainer.create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
    finish_pending_push(trainer)

    init_kwargs = trainer.args.model_init_kwargs or {}
    base_kwargs = {k: init_kwargs[k] for k in _BASE_MODEL_KWARGS if init_kwargs.get(k) is not None}
    merged = merge_adapter_into_base(output_dir, **base_kwargs)
    with tempfile.TemporaryDirectory(prefix="exgrpo-merged-") as tmp:
        folder = Path(merged_dir) if merged_dir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        merged.save_pretrained(str(folder))
        trainer.processing_class.save_pretrained(str(folder))
        shutil.copyfile(os.path.join(output_dir, "README.md"), folder / "README.md")
        return HfApi().upload_folder(
            repo_id=trainer.hub_model_id,
            folder_path=str(folder),
            commit_message=commit_message,
            token=token,
            revision=revision if revision is not None else trainer.args.hub_revision,
            delete_patterns=list(ADAPTER_FILES),
        )
