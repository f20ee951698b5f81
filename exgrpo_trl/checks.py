"""What `ExGRPOTrainer` checks when it is built: arguments it cannot train with (one clear error before TRL does any
work) and settings that would train, but not as the user expects (one warning each)."""

from __future__ import annotations

import math
import os
from typing import Any

from trl import GRPOConfig

from .buffer import has_images
from .config import ExGRPOConfig
from .offline import check_offline_arguments
from .replay import replay_never_fires
from .reporting import require_loggers
from .settings import SUPPORTED_LOSS_TYPES

ENVIRONMENT_OWNED_DATA = (
    "ExGRPOTrainer needs a train_dataset with a 'prompt' column when environment_factory is given: without one the "
    "environment picks each question in reset(), so a replayed question's fresh rollouts cannot be put back on it; "
    "pass the questions as a train_dataset (each row is given to reset(**row)), or train with GRPOTrainer."
)
IMAGE_MULTI_TURN = (
    "ExGRPOTrainer does not replay image inputs with tools or environment_factory: a stored trajectory's tool or "
    "environment images are not kept with it; train those with GRPOTrainer, or without images."
)
IMAGE_VLLM = (
    "ExGRPOTrainer with image inputs has not been run with vLLM yet (colocate or server mode; no test could run "
    "vLLM's vision-language models, which need torchvision): generate with transformers (use_vllm=False), or train "
    "with GRPOTrainer."
)


def ends_generation_batch(cfg: GRPOConfig, step: int) -> bool:
    """Whether optimizer step `step` ends a generation batch (TRL generates once per `steps_per_generation *
    num_iterations` micro-batches): a checkpoint there resumes bitwise; one inside a batch generates it again."""
    return step * cfg.gradient_accumulation_steps % (cfg.steps_per_generation * cfg.num_iterations) == 0


def save_steps_inside_generation_batches(cfg: GRPOConfig) -> str | None:
    """A warning when `save_steps` puts checkpoints inside generation batches, else None.

    TRL generates once per `steps_per_generation * num_iterations` micro-batches and trains on that batch until the
    next generation; a checkpoint keeps none of it. A run resumed from a checkpoint inside a generation batch
    generates that batch again, with other samples: it trains on correctly, but not bitwise as the run it came from
    would have. (Saving the rest of the batch instead would mean saving TRL's private buffered inputs, whose layout
    changes between TRL versions; a save_steps on the batch boundaries costs nothing.)"""
    strategy = getattr(cfg.save_strategy, "value", cfg.save_strategy)
    save_steps = cfg.save_steps
    if strategy != "steps" or not save_steps:
        return None
    if save_steps < 1:  # a ratio of the run
        if cfg.max_steps <= 0:
            return None
        save_steps = math.ceil(cfg.max_steps * save_steps)
    save_steps = int(save_steps)
    if ends_generation_batch(cfg, save_steps):
        return None
    micro = cfg.steps_per_generation * cfg.num_iterations  # micro-batches from one generation to the next
    accumulation = cfg.gradient_accumulation_steps
    every = micro // math.gcd(micro, accumulation)  # optimizer steps from one generation boundary to the next
    return (
        f"ExGRPO: save_steps={save_steps} puts checkpoints inside generation batches (one every {every} optimizer "
        f"steps: steps_per_generation={cfg.steps_per_generation} x num_iterations={cfg.num_iterations} / "
        f"gradient_accumulation_steps={accumulation}); a run resumed from one generates that batch again and does not "
        f"continue bitwise. save_steps that are multiples of {every} resume exactly."
    )


def check_prompt_column(dataset, name: str) -> None:
    """GRPOTrainer reads each row's 'prompt' only at the first step, where a missing column is a bare KeyError."""
    columns = getattr(dataset, "column_names", None)  # None: no dataset, or one that does not know its columns
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (its columns: {', '.join(map(repr, columns)) or 'none'}); GRPOTrainer and "
            "ExGRPOTrainer read each question from 'prompt': rename the question column, e.g. "
            "`dataset.rename_column('question', 'prompt')`."
        )


def check_chat_template(params: dict[str, Any]) -> None:
    """Chat-message prompts need a chat template: without one GRPOTrainer fails at the first step with transformers'
    "Cannot use chat template functions" after the model has loaded. Checked on the first training row of a dataset
    that can be indexed, when a tokenizer is given (a processor, or none, is left to TRL)."""
    tokenizer, dataset = params.get("processing_class"), params.get("train_dataset")
    if tokenizer is None or not hasattr(tokenizer, "chat_template") or hasattr(tokenizer, "tokenizer"):
        return
    if getattr(tokenizer, "chat_template", None) or dataset is None or not hasattr(dataset, "__getitem__"):
        return
    try:
        prompt = dataset[0]["prompt"] if len(dataset) else None
    except (KeyError, IndexError, TypeError):
        return
    if isinstance(prompt, list):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"the train_dataset's prompts are chat messages (`exgrpo train` builds them from a 'question' or "
            f"'problem' column), but the tokenizer {name} has no chat template: use a tokenizer with one, or "
            "plain-text prompts"
        )


def check_arguments(params: dict[str, Any]) -> None:
    """Before GRPOTrainer.__init__: the arguments (`params`, bound to GRPOTrainer's signature) ExGRPO cannot train
    with. Without `args`, an ExGRPOConfig of the paper's defaults is put in."""
    if params.get("environment_factory") is not None:
        columns = getattr(params.get("train_dataset"), "column_names", None)
        if params.get("train_dataset") is None or (columns is not None and "prompt" not in columns):
            raise ValueError(ENVIRONMENT_OWNED_DATA)
    config = params.get("args")
    if config is None:
        params["args"] = ExGRPOConfig("ExGRPO")
    elif not isinstance(config, ExGRPOConfig):
        kind = "a GRPOConfig" if isinstance(config, GRPOConfig) else type(config).__name__
        hint = (
            "Convert it with `ExGRPOConfig.from_grpo_config(cfg, **exgrpo_settings)` (same GRPO settings and batch "
            "sizes, ExGRPO's fields as keywords)"
            if isinstance(config, GRPOConfig)
            else "Build one with `ExGRPOConfig(output_dir=..., ...)`"
        )
        raise TypeError(f"ExGRPOTrainer needs an ExGRPOConfig, got {kind}. {hint}.")
    require_loggers(getattr(params["args"], "report_to", None))
    output_dir = getattr(params["args"], "output_dir", None)
    if output_dir and os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise NotADirectoryError(f"output_dir {output_dir} is a file, not a folder; give a folder (output_dir=...)")
    columns = getattr(params.get("train_dataset"), "column_names", None) or []
    if has_images(columns):
        # a rollout function's images are the dataset's (TRL keeps no others), stored with the question's row
        if any(params.get(name) for name in ("tools", "environment_factory")):
            raise NotImplementedError(IMAGE_MULTI_TURN)
        if getattr(params["args"], "use_vllm", False):
            raise NotImplementedError(IMAGE_VLLM)
    check_prompt_column(params.get("train_dataset"), "train_dataset")
    check_chat_template(params)
    check_offline_arguments(params)
    eval_dataset = params.get("eval_dataset")
    for name, dataset in eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]:
        check_prompt_column(dataset, f"eval_dataset[{name!r}]" if name else "eval_dataset")


def check_built(cfg: ExGRPOConfig, loss_type: str) -> list[str]:
    """After GRPOTrainer.__init__ (which resolves the model and the loss): errors for what ExGRPO cannot train, and
    the warnings to log for settings that train but not as expected."""
    if loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(f"ExGRPOTrainer supports loss_type in {SUPPORTED_LOSS_TYPES}, got {loss_type!r}")
    warnings = (replay_never_fires(cfg), save_steps_inside_generation_batches(cfg), emulated_bf16(cfg))
    return [w for w in warnings if w is not None]


def cpu_bf16_kernels() -> str | None:
    """The CPU kernels torch runs ('AVX2', 'AVX512', ...) when they have no native bf16 arithmetic, so that bf16 is
    emulated there; None when they have it (AVX-512 with the BF16 or AMX extensions) or the CPU is not an x86 one
    (not known). `ATEN_CPU_CAPABILITY` (and the CPU itself) decide what torch reports."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("DEFAULT", "NO AVX", "AVX2", "AVX512"):
        return None
    native = capability == "AVX512" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return None if native else capability


def emulated_bf16(cfg) -> str | None:
    """A warning when a run on the CPU trains in bf16 that the CPU's kernels emulate (`cpu_bf16_kernels`): measured
    on the CPU quick start, its 20 updates took 15.9 s with bf16 on AVX2 kernels against 2.2 s in float32."""
    if not (cfg.bf16 and cfg.use_cpu):
        return None
    kernels = cpu_bf16_kernels()
    if kernels is None:
        return None
    return (
        f"ExGRPO: bf16=True on a CPU whose torch kernels ({kernels}) have no native bf16: every step emulates it, "
        "5-9x slower than float32 on the CPU quick starts; set bf16=False (and activation_checkpointing=False, which "
        "on a CPU only adds a second forward pass)."
    )
