"""`exgrpo train`: train with ExGRPO from a YAML recipe.

    exgrpo train --config recipes/qwen7b.yaml
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m exgrpo_trl.cli.train --config recipes/qwen7b.yaml

The recipe is parsed by TRL's `TrlParser` over (`ScriptArguments`, `ExGRPOConfig`, `ModelConfig`): every key of the
YAML must be a field of one of the three (an unknown key is an error), and command-line flags override the YAML
(``--learning_rate 2e-6``). Training resumes from the newest complete ``checkpoint-*`` in ``output_dir`` when there
is one (see `resolve_checkpoint`); PEFT/LoRA and quantization come from `ModelConfig` (``use_peft: true``,
``lora_r``, ...). At the end the model (or the LoRA adapter) and a model card are saved to ``output_dir`` and pushed
to the Hub when ``push_to_hub`` is set: the full model, the adapter alone, or with ``merge_adapter_on_push: true``
the adapter merged into its base model.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import transformers
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config
from trl import ScriptArguments as TrlScriptArguments

from ..config import ExGRPOConfig
from ..tasks.math_data import filter_long_prompts, load_math_dataset
from ..tasks.rewards import REWARD_FUNCS, get_reward_funcs
from ..utils.checkpoints import checkpoint_problems, find_resumable_checkpoint
from ..utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

MODEL_CARD_TAGS = ["exgrpo", "grpo", "experience-replay"]


@dataclass
class ScriptArguments(TrlScriptArguments):
    """What the training script needs besides the trainer config and the model config.

    Inherits from TRL's `ScriptArguments`: ``dataset_name`` (Hub id, local file or folder), ``dataset_config``,
    ``dataset_train_split``, ``dataset_test_split``.
    """

    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_verify"],
        metadata={
            "help": f"Reward functions by name ({', '.join(sorted(REWARD_FUNCS))}) or 'module:function' path. "
            "Weights: the config's reward_weights."
        },
    )
    question_column: str | None = field(
        default=None,
        metadata={
            "help": "Column of questions, turned into the paper's prompt (system + user). Default: a 'prompt' column "
            "is used as is (OpenR1-Math-46k, the toy task), else 'question' or 'problem'."
        },
    )
    answer_column: str | None = field(
        default=None,
        metadata={"help": "Column of reference answers. Default: 'answer', else reward_model.ground_truth (verl)."},
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "System prompt for prompts built from a question column (default: LUFFY's, as in the paper; "
            "'' for none). Given explicitly, it also replaces the system message of a dataset's own prompts."
        },
    )
    keep_columns: list[str] = field(
        default_factory=list,
        metadata={"help": "Dataset columns kept beside prompt/answer (reward functions receive them as kwargs)."},
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation data (Hub id, file or folder; its dataset_test_split). Default: dataset_name's "
            "dataset_test_split. Used only when eval_strategy is not 'no'."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Drop training prompts longer than this many tokens (chat template included). TRL 1.16 does "
            "not truncate prompts; the paper's recipe caps them at 1024."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to load instead of the model's own."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preprocessing."})
    validation_dataset: list[str] = field(
        default_factory=list,
        metadata={
            "help": "In-training validation sets (exgrpo_trl.eval.callback.ValidationCallback): benchmark names of "
            "`exgrpo eval` (aime24, math500, ..., read from the Hub), NAME=PATH for a local file of that benchmark's "
            "schema (or, for another NAME, a math file with prompt/question/problem + answer), or a PATH. Graded by "
            "the evaluation harness's code and logged as eval/<name>/...; the experience buffer is not touched."
        },
    )
    validation_steps: int = field(
        default=10, metadata={"help": "Validate every N optimizer steps (the reference run: 10); 0 disables."}
    )
    validation_samples: int = field(default=1, metadata={"help": "Validation completions per question (avg@k)."})
    validation_temperature: float = field(default=0.6, metadata={"help": "Validation sampling temperature."})
    validation_top_p: float = field(default=1.0, metadata={"help": "Validation top-p."})
    validation_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Validation completion budget (default: the config's max_completion_length)."}
    )
    validation_batch_size: int = field(default=64, metadata={"help": "Validation sequences per generate call."})
    validation_limit: int | None = field(
        default=None, metadata={"help": "Validate on the first N questions of each validation set only."}
    )
    merge_adapter_on_push: bool = field(
        default=False,
        metadata={
            "help": "With use_peft and push_to_hub: push the LoRA adapter merged into its base model (a full model "
            "that loads without peft) instead of the adapter alone. The base is reloaded unquantized for the merge."
        },
    )


def build_parser() -> TrlParser:
    return TrlParser((ScriptArguments, ExGRPOConfig, ModelConfig))


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, ExGRPOConfig, ModelConfig]:
    """Parse ``--config RECIPE.yaml`` plus command-line overrides (`sys.argv[1:]` when `argv` is None)."""
    script_args, training_args, model_args = build_parser().parse_args_and_config(args=argv)
    return script_args, training_args, model_args


_TRUE = ("true", "yes", "1")
_FALSE = ("false", "no", "0")


def resolve_checkpoint(training_args: ExGRPOConfig) -> str | None:
    """The checkpoint to resume from (None: a fresh run), from ``resume_from_checkpoint``:

    - unset: the newest COMPLETE ``checkpoint-N`` in ``output_dir`` (`utils.checkpoints`), if any; newer incomplete
      ones (a save interrupted by a crash) are skipped with a warning each, saying why;
    - true (``true``, ``yes``, ``1``; YAML's ``true``): the same, but finding none is an error;
    - false (``false``, ``no``, ``0``): a fresh run, even if ``output_dir`` holds checkpoints;
    - a path: that checkpoint, which must be complete (an error says what it lacks).
    """
    value = training_args.resume_from_checkpoint
    text = str(value).strip().lower() if value is not None else ""
    requirements = dict(
        need_optimizer=not training_args.save_only_model,
        adaptive_entropy=bool(getattr(training_args, "use_adaptive_entropy", False)),
    )
    if text in _FALSE:
        return None
    if text and text not in _TRUE:
        problems = checkpoint_problems(value, **requirements)
        if problems:
            raise ValueError(
                f"Cannot resume from {value}: {'; '.join(problems)}. Give a complete checkpoint, or leave "
                "resume_from_checkpoint unset to resume from the newest complete one in output_dir."
            )
        return str(value)
    checkpoint, skipped = find_resumable_checkpoint(training_args.output_dir, **requirements)
    for path, why in skipped:
        logger.warning("Skipping %s: incomplete (%s), a save that was interrupted?", path, why)
    if checkpoint is None and text in _TRUE:
        raise ValueError(
            f"resume_from_checkpoint is {value} but {training_args.output_dir} holds no complete checkpoint"
            + (f" ({len(skipped)} incomplete, skipped)" if skipped else "")
            + "; leave it unset to start a fresh run when there is none."
        )
    if checkpoint is None and skipped:
        logger.warning("No complete checkpoint in %s: training starts from step 0.", training_args.output_dir)
    return checkpoint


def model_init_kwargs(model_args: ModelConfig, training_args: ExGRPOConfig) -> dict:
    """``from_pretrained`` kwargs for the policy, from `ModelConfig`; explicit ``model_init_kwargs`` win."""
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        # The KV cache is useless with gradient checkpointing and transformers warns about it.
        "use_cache": not training_args.gradient_checkpointing,
    }
    if model_args.load_in_4bit or model_args.load_in_8bit:
        from accelerate import PartialState

        kwargs["device_map"] = {"": PartialState().local_process_index}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.update(training_args.model_init_kwargs or {})
    return kwargs


def _setup_logging(training_args: ExGRPOConfig) -> None:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    logging.getLogger("exgrpo_trl").setLevel(level)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()


def _attach_validation(trainer, script_args: ScriptArguments, training_args: ExGRPOConfig):
    """In-training validation on `validation_dataset` every `validation_steps` steps (a `ValidationCallback`)."""
    from ..eval.callback import ValidationCallback
    from ..eval.registry import load_benchmark, parse_benchmark_spec

    with training_args.main_process_first(desc="validation data"):
        benchmarks = []
        for spec in script_args.validation_dataset:
            name, path = parse_benchmark_spec(spec)
            benchmarks.append(
                load_benchmark(name, path, system_prompt=script_args.system_prompt, limit=script_args.validation_limit)
            )
    callback = ValidationCallback(
        benchmarks,
        steps=script_args.validation_steps,
        samples=script_args.validation_samples,
        temperature=script_args.validation_temperature,
        top_p=script_args.validation_top_p,
        max_new_tokens=script_args.validation_max_new_tokens or training_args.max_completion_length,
        batch_size=script_args.validation_batch_size,
        seed=training_args.seed,
    )
    return callback.attach(trainer)


def train(script_args: ScriptArguments, training_args: ExGRPOConfig, model_args: ModelConfig) -> int:
    from ..trainer import ExGRPOTrainer  # imported here: parsing recipes does not need the trainer
    from ..utils.hub import is_peft_trainer, push_trained_model

    if not model_args.model_name_or_path:
        raise ValueError("model_name_or_path is required (in the recipe or as --model_name_or_path).")
    if not script_args.dataset_name:
        raise ValueError("dataset_name is required (in the recipe or as --dataset_name).")
    if script_args.merge_adapter_on_push and not model_args.use_peft:
        raise ValueError(
            "merge_adapter_on_push needs a LoRA adapter to merge (use_peft: true); without PEFT the full model is "
            "pushed as it is."
        )
    if script_args.dataset_streaming:
        raise ValueError(
            "dataset_streaming is not supported: ExGRPO re-reads questions by index (replay, retirement)."
        )
    _setup_logging(training_args)
    transformers.set_seed(training_args.seed)

    checkpoint = resolve_checkpoint(training_args)
    if checkpoint is not None:  # a warning: silently continuing an old run is a surprise worth a line
        logger.warning("Resuming from checkpoint %s (give another output_dir for a fresh run)", checkpoint)

    tokenizer = load_tokenizer(
        script_args.tokenizer_name_or_path or model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )

    data_kwargs = dict(
        config=script_args.dataset_config,
        question_column=script_args.question_column,
        answer_column=script_args.answer_column,
        system_prompt=script_args.system_prompt,
        keep_columns=script_args.keep_columns,
        num_proc=script_args.dataset_num_proc,
    )
    # Rank 0 prepares (and caches) the data first; the other ranks then read the cache.
    with training_args.main_process_first(desc="dataset preparation"):
        train_dataset = load_math_dataset(
            script_args.dataset_name, split=script_args.dataset_train_split, **data_kwargs
        )
        if script_args.max_prompt_length is not None:
            train_dataset = filter_long_prompts(
                train_dataset, tokenizer, script_args.max_prompt_length, num_proc=script_args.dataset_num_proc
            )
        eval_dataset = None
        if training_args.eval_strategy != "no":
            eval_dataset = load_math_dataset(
                script_args.eval_dataset_name or script_args.dataset_name,
                split=script_args.dataset_test_split,
                **data_kwargs,
            )

    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args)
    trainer = ExGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=get_reward_funcs(script_args.reward_funcs),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )

    if script_args.validation_dataset and script_args.validation_steps > 0:
        _attach_validation(trainer, script_args, training_args)

    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    # _internal_call: with push_to_hub set, Trainer.save_model would also push (a first commit); the push below is the
    # only one.
    trainer.save_model(training_args.output_dir, _internal_call=True)
    logger.info("Model saved to %s", training_args.output_dir)
    card_kwargs = {
        "model_name": (training_args.hub_model_id or Path(training_args.output_dir).name).split("/")[-1],
        "dataset_name": script_args.dataset_name,
        "tags": MODEL_CARD_TAGS,
    }
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(**card_kwargs)
        # Training ran with use_cache off (gradient checkpointing); generation wants it on. An adapter folder holds no
        # config.json (PEFT loads the base model's own).
        trainer.model.config.use_cache = True
        if not is_peft_trainer(trainer):
            trainer.model.config.save_pretrained(training_args.output_dir)

    if training_args.push_to_hub:
        what = "the full model"
        if model_args.use_peft:
            what = "the LoRA adapter merged into its base" if script_args.merge_adapter_on_push else "the LoRA adapter"
        logger.info("Pushing %s to the Hub", what)
        push_trained_model(trainer, merge_adapter=script_args.merge_adapter_on_push, **card_kwargs)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``exgrpo train ARGS`` and ``python -m exgrpo_trl.cli.train ARGS``."""
    return train(*parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
