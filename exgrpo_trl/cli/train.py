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

import argparse
import atexit
import functools
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import datasets
import torch
import transformers
from trl import GRPOConfig, ModelConfig, TrlParser, get_peft_config, get_quantization_config
from trl import ScriptArguments as TrlScriptArguments

from ..buffer import has_images
from ..checkpoints import checkpoint_step, find_resumable_checkpoint, resolve_checkpoint
from ..config import ExGRPOConfig
from ..offline import offline_columns
from ..reporting import require_loggers
from ..settings import SUPPORTED_LOSS_TYPES
from ..state_file import StateFileError
from ..tasks.math_data import PRODUCED_COLUMNS, filter_long_prompts, load_math_dataset
from ..tasks.rewards import REWARD_FUNCS, get_reward_funcs
from ..utils.requirements import require
from ..utils.threads import limit_cpu_threads
from ..utils.tokenizer import load_processor, load_tokenizer
from . import precheck
from .diskfull import DiskFull, told_when_full
from .interrupt import Interrupted, StopOnInterrupt
from .output import surviving_output

logger = logging.getLogger(__name__)

MODEL_CARD_TAGS = ["exgrpo", "grpo", "experience-replay"]
RUN_COMPLETE_NAME = "exgrpo_run_complete.json"  # in output_dir, written when a run's end-of-run saves are done


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
    log_file: str | None = field(
        default=None,
        metadata={
            "help": "Also append everything this command prints to this file (the log, the progress, and the last "
            "line: where an interrupted run stopped and how to resume it). Unlike `2>&1 | tee FILE`, which a "
            "terminal's Ctrl-C kills with the run, nothing can cut it short."
        },
    )
    merge_adapter_on_push: bool = field(
        default=False,
        metadata={
            "help": "With use_peft and push_to_hub: push the LoRA adapter merged into its base model (a full model "
            "that loads without peft) instead of the adapter alone. The base is reloaded unquantized for the merge."
        },
    )


USAGE = "exgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--debug] [--help-all]"
DESCRIPTION = (
    "Train with ExGRPO from a YAML recipe (recipes/*.yaml). Every key of the recipe is one of the options listed "
    "here or by --help-all, and an option on the command line overrides the recipe (--learning_rate 2e-6). Training "
    "resumes from the newest complete checkpoint in output_dir."
)
# The options of a run most often set on the command line, listed by --help beside ExGRPO's own.
COMMON_OPTIONS = (
    "model_name_or_path",
    "dataset_name",
    "reward_funcs",
    "output_dir",
    "max_steps",
    "learning_rate",
    "num_generations",
    "per_device_train_batch_size",
    "generation_batch_size",
    "max_completion_length",
    "loss_type",
    "save_steps",
    "resume_from_checkpoint",
    "use_peft",
    "push_to_hub",
    "log_file",
)


class UsageError(ValueError):
    """A mistake on the command line or in the recipe (an unknown option, a bad value, a missing file)."""


class _Parser(TrlParser):
    def error(self, message):  # argparse prints its whole usage (230 lines here) before the message, then exits
        raise UsageError(message)


def build_parser() -> TrlParser:
    return _Parser(
        (ScriptArguments, ExGRPOConfig, ModelConfig),
        prog="exgrpo train",
        usage=USAGE,
        description=DESCRIPTION + " --config RECIPE.yaml: the recipe; --debug: show the traceback of an error.",
    )


HELP_WIDTH = 119


def short_help() -> str:
    """`exgrpo train --help`: usage, this command's own flags, ExGRPO's options and the common ones of a run.
    `--help-all` prints the parser's own help, every TRL and transformers option included."""
    actions = {}
    for action in build_parser()._actions:  # the first of a dest: --flag, not the --no_flag HF adds for bools
        actions.setdefault(action.dest, action)
    grpo_fields = {f.name for f in fields(GRPOConfig)}
    exgrpo_fields = [f.name for f in fields(ExGRPOConfig) if f.name not in grpo_fields]
    parser = argparse.ArgumentParser(
        prog="exgrpo train",
        usage=USAGE,
        description=DESCRIPTION,
        add_help=False,
        # a fixed width: the text is written out once (cli/train_help.txt) and printed as is by `exgrpo train --help`
        formatter_class=lambda prog: argparse.ArgumentDefaultsHelpFormatter(prog, width=HELP_WIDTH),
    )
    own = parser.add_argument_group("this command")
    own.add_argument("--config", metavar="RECIPE.yaml", default=argparse.SUPPRESS, help="the recipe (YAML)")
    own.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show its traceback (also EXGRPO_DEBUG=1)",
    )
    own.add_argument("-h", "--help", action="store_true", default=argparse.SUPPRESS, help="this help")
    own.add_argument(
        "--help-all",
        action="store_true",
        default=argparse.SUPPRESS,
        help="every option, TRL's GRPOConfig and ModelConfig and transformers' TrainingArguments included",
    )
    exgrpo = parser.add_argument_group("ExGRPO (ExGRPOConfig; defaults from the paper)")
    for name in exgrpo_fields:
        exgrpo._add_action(actions[name])
    common = parser.add_argument_group("the run (the most used options; --help-all lists every one)")
    for name in COMMON_OPTIONS:
        common._add_action(actions[name])
    return parser.format_help()


def write_help() -> Path:
    """Write `short_help()` to cli/train_help.txt, which `exgrpo train --help` prints without importing TRL, and
    `option_table()` to cli/train_options.json, which `precheck` checks recipes against before TRL is imported (`make
    style` runs this; a test fails when either file is stale)."""
    from . import TRAIN_HELP

    TRAIN_HELP.write_text(short_help())
    sections = [
        json.dumps(section)
        + ": {\n"
        + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(rows.items()))
        for section, rows in sorted(option_table().items())
    ]
    precheck.OPTIONS.write_text("{\n" + "\n},\n".join(sections) + "\n}\n}\n")  # one option a line
    return TRAIN_HELP


# GRPOConfig's string options that take one of a few values which TRL checks only once it trains (a misspelt
# loss_type failed at the first step, after the model had loaded): those values, as TRL 1.16's help for each lists
# them (a test keeps them so), for the check before torch is imported. loss_type: the ones ExGRPO supports, all of
# TRL's.
CLOSED_SETS = {
    "loss_type": SUPPORTED_LOSS_TYPES,
    "scale_rewards": ("group", "batch", "none"),
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_mode": ("server", "colocate"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
}


def option_table() -> dict:
    """Every ``--option`` of `exgrpo train` with the kind of value it takes (`precheck.option_kind`) and the field it
    sets, and the closed sets of values: argparse's choices (transformers' enums, ModelConfig's literals) and
    `CLOSED_SETS`."""
    actions = build_parser()._actions
    options = {o: [precheck.option_kind(a), a.dest] for a in actions for o in a.option_strings if o.startswith("--")}
    choices = {a.dest: [str(getattr(c, "value", c)) for c in a.choices] for a in actions if a.choices}
    choices.update({name: list(values) for name, values in CLOSED_SETS.items()})
    return {"choices": choices, "options": options}


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, ExGRPOConfig, ModelConfig]:
    """Parse ``--config RECIPE.yaml`` plus command-line overrides (`sys.argv[1:]` when `argv` is None). A missing
    recipe, an unknown key or option (with the nearest known one) and a value of the wrong type are UsageErrors."""

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in argv:  # else TRL's defaults run (bf16 on, no model) and fail somewhere unrelated
        raise UsageError(
            "no recipe: exgrpo train --config RECIPE.yaml [--FIELD VALUE ...] (recipes/ holds examples; "
            "exgrpo train --help lists the options)"
        )
    mistake = precheck.check(argv)  # the recipe file, its keys and the plain values, as `exgrpo train` checks first
    if mistake is not None:
        raise UsageError(mistake)
    recipe = argv[argv.index("--config") + 1]
    parser = build_parser()
    *parsed, from_recipe, from_command_line = parser.parse_args_and_config(
        args=argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for where, unknown in ((f"in {recipe}", from_recipe), ("", from_command_line)):
        names = [item for item in unknown if item.startswith("--")] or unknown
        if names:
            raise UsageError(f"unknown {'key' if where else 'option'} {_with_suggestion(names[0], known, where)}")
    script_args, training_args, model_args = parsed
    return script_args, training_args, model_args


def _with_suggestion(name: str, known: list[str], where: str) -> str:
    """'--learning_rte (did you mean --learning_rate?)'; recipe keys are named without the dashes."""
    if where:
        return f"{name.lstrip('-')} {where}" + precheck.suggestion(name.lstrip("-"), [k.lstrip("-") for k in known])
    return name + precheck.suggestion(name, known)


def _check_local_paths(script_args: ScriptArguments, model_args: ModelConfig) -> None:
    """A local path that does not exist fails here, in one line (`exgrpo train` finds it before torch is imported;
    this is for `python -m exgrpo_trl.cli.train` and `accelerate launch`)."""
    for what, _ in precheck.SOURCES:  # ModelConfig holds the model's name, ScriptArguments the others
        name = getattr(model_args if what == "model_name_or_path" else script_args, what)
        problem = precheck.local_path_problem(what, name) if name else None
        if problem is not None:
            raise FileNotFoundError(problem)


def check_output_dir(output_dir: str) -> None:
    """`output_dir` must be a folder this process can write to: checked (and created) before the model loads, not
    found out at the first checkpoint, hours in. Writing a file is the test (permission bits say nothing to root, and
    nothing about a read-only file system)."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output_dir {output_dir} is a file, not a folder; give a folder (--output_dir DIR)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".exgrpo-write-test-"):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise PermissionError(
            f"output_dir {output_dir} is not a folder this process can write to ({why}); give another one "
            "(--output_dir DIR)"
        ) from e


class RewardFunctionError(RuntimeError):
    """A reward function raised: the message names it and its exception; the traceback is behind --debug."""


def reporting_errors(func: Callable) -> Callable:
    """`func` (a reward function) with its exceptions re-raised as a `RewardFunctionError` naming it. Its name, which
    TRL logs the rewards under, and whether it is async are kept."""
    name = getattr(func, "__name__", type(func).__name__)

    def error(e: Exception) -> RewardFunctionError:
        return RewardFunctionError(f"reward function {name} raised {type(e).__name__}: {' '.join(str(e).split())}")

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args, **kwargs):
            try:
                return await func(*args, **kwargs)
            except Exception as e:
                raise error(e) from e

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as e:
            raise error(e) from e

    return wrapper


def data_columns(keep_columns: list[str], training_args: ExGRPOConfig) -> list[str]:
    """The dataset columns kept beside prompt and answer: `keep_columns`, then `offline_data_columns`."""
    return [*keep_columns, *offline_data_columns(keep_columns, training_args)]


def offline_data_columns(keep_columns: list[str], training_args: ExGRPOConfig) -> list[str]:
    """The offline solutions' column, kept by itself (offline guidance reads it from the training rows; a user need
    not list it at all). It may be any column, ``answer`` included: that one is always there (`PRODUCED_COLUMNS`),
    the reference answers as `answer_column` reads them, so it is not asked for again."""
    return [c for c in offline_columns(training_args) if c not in keep_columns and c not in PRODUCED_COLUMNS]


def model_init_kwargs(model_args: ModelConfig, training_args: ExGRPOConfig, vision: bool = False) -> dict:
    """``from_pretrained`` kwargs for the policy, from `ModelConfig`; explicit ``model_init_kwargs`` win. `vision`: a
    vision-language model, whose constructor takes no ``use_cache`` (its text config holds it)."""
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
        # The KV cache is useless with gradient checkpointing and transformers warns about it.
        "use_cache": None if vision else not training_args.gradient_checkpointing,
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


def _same_on_every_rank(checkpoint: str | None) -> str | None:
    """The main process's choice of checkpoint, on every rank. Each rank has judged the same files by the same
    deterministic rule (`checkpoint_problems` reads nothing but them), and nothing writes to output_dir until every
    rank is past this point (the first write is a save, after collectives that need every rank): so each rank already
    chose the same checkpoint, and raised the same error where there is one. The broadcast is for file systems that
    can show the ranks of several machines different views of files written moments ago (a network file system's
    caches). One process: returned as is."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    if PartialState().num_processes == 1:
        return checkpoint
    return broadcast_object_list([checkpoint])[0]


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
    """One run of `exgrpo train`: the checks that need no model, then `_train_in`."""
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
    # The optional packages the run will need, before any work (TRL finds a missing vLLM once the model has loaded).
    if training_args.use_vllm:
        require("vllm", "use_vllm: true")
    if training_args.deepspeed:
        require("deepspeed", "deepspeed (a DeepSpeed config)")
    require_loggers(training_args.report_to)  # transformers finds out after the model has loaded
    _check_local_paths(script_args, model_args)
    created = not Path(training_args.output_dir).expanduser().exists()
    check_output_dir(training_args.output_dir)
    try:
        return _train_in(script_args, training_args, model_args)
    except BaseException:
        # a run that fails before writing anything leaves no empty output folder behind
        out = Path(training_args.output_dir).expanduser()
        if created and out.is_dir() and not any(p.is_file() for p in out.rglob("*")):
            shutil.rmtree(out, ignore_errors=True)
        raise


def _train_in(script_args: ScriptArguments, training_args: ExGRPOConfig, model_args: ModelConfig) -> int:
    """`train` once the arguments are checked and `output_dir` is a writable folder."""
    from ..trainer import ExGRPOTrainer, save_without_push
    from ..utils.hub import is_peft_trainer, push_trained_model

    _setup_logging(training_args)
    transformers.set_seed(training_args.seed)
    if training_args.use_cpu or not torch.cuda.is_available():
        # two torch threads on a busy 2-core machine are 5-17 times slower than one (utils/threads.py)
        threads = limit_cpu_threads()
        if training_args.process_index == 0:  # printed, not logged: the default log level hides INFO
            print(f"exgrpo train: {cpu_threads_line(threads)}", flush=True)

    checkpoint = _same_on_every_rank(resolve_checkpoint(training_args))
    complete = already_complete(training_args, checkpoint)
    if complete is not None:
        print(complete)
        return 0
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
        keep_columns=script_args.keep_columns,  # and the offline solutions' column, named by its own option
        offline_columns=offline_data_columns(script_args.keep_columns, training_args),
        num_proc=script_args.dataset_num_proc,
    )
    # Rank 0 prepares (and caches) the data first; the other ranks then read the cache.
    with training_args.main_process_first(desc="dataset preparation"):
        train_dataset = load_math_dataset(
            script_args.dataset_name, split=script_args.dataset_train_split, **data_kwargs
        )
        vision = has_images(train_dataset.column_names)
        if vision:  # a vision-language model: its processor
            from ..tasks import vision as _tiny_vlm  # noqa: F401 - registers the processor class save_tiny_vlm writes

            tokenizer = load_processor(
                script_args.tokenizer_name_or_path or model_args.model_name_or_path,
                revision=model_args.model_revision,
                trust_remote_code=training_args.trust_remote_code,
            )
        if script_args.max_prompt_length is not None:  # text tokens (an image adds its own)
            train_dataset = filter_long_prompts(
                train_dataset,
                getattr(tokenizer, "tokenizer", tokenizer),
                script_args.max_prompt_length,
                num_proc=script_args.dataset_num_proc,
            )
        eval_dataset = None
        if training_args.eval_strategy != "no":
            eval_dataset = load_math_dataset(
                script_args.eval_dataset_name or script_args.dataset_name,
                split=script_args.dataset_test_split,
                **data_kwargs,
            )

    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args, vision)
    trainer = ExGRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[reporting_errors(f) for f in get_reward_funcs(script_args.reward_funcs)],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )

    if script_args.validation_dataset and script_args.validation_steps > 0:
        _attach_validation(trainer, script_args, training_args)

    stop = StopOnInterrupt(trainer.accelerator)
    trainer.add_callback(stop)
    try:
        with stop.installed():
            train_result = trainer.train(resume_from_checkpoint=checkpoint)
    except KeyboardInterrupt:
        raise Interrupted(trainer.state.global_step, trainer.state.max_steps, training_args.output_dir) from None
    if stop.stopped_at is not None and stop.stopped_at < trainer.state.max_steps:
        raise Interrupted(trainer.state.global_step, trainer.state.max_steps, training_args.output_dir)
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    save_without_push(trainer, training_args.output_dir)  # the push below is the only one
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

    pushed = None
    if training_args.push_to_hub:
        what = "the full model"
        if model_args.use_peft:
            what = "the LoRA adapter merged into its base" if script_args.merge_adapter_on_push else "the LoRA adapter"
        logger.info("Pushing %s to the Hub", what)
        pushed = push_trained_model(trainer, merge_adapter=script_args.merge_adapter_on_push, **card_kwargs)
    if trainer.accelerator.is_main_process:
        mark_complete(training_args.output_dir, trainer.state.global_step, trainer.state.max_steps)
        print(where_it_went(training_args.output_dir, trainer.state.global_step, is_peft_trainer(trainer), pushed))
    return 0


def cpu_threads_line(threads: int) -> str:
    """What `exgrpo train` says about the CPU threads it trains on (one unless OMP_NUM_THREADS says more)."""
    more = "OMP_NUM_THREADS sets more" if threads == 1 else "from OMP_NUM_THREADS"
    return f"training on the CPU with {threads} torch thread{'' if threads == 1 else 's'} ({more})"


def mark_complete(output_dir: str, global_step: int, max_steps: int) -> None:
    """Written last, once the model, its card and any push are done: a rerun of the same command then has nothing
    left to do. A run killed before it (during the end-of-run saves) is finished by the rerun instead."""
    path = Path(output_dir) / RUN_COMPLETE_NAME
    tmp = path.with_name(f".{RUN_COMPLETE_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"global_step": global_step, "max_steps": max_steps}) + "\n")
    os.replace(tmp, path)


def already_complete(training_args: ExGRPOConfig, checkpoint: str | None) -> str | None:
    """The line `exgrpo train` prints instead of training when the run in output_dir has reached max_steps and its
    end-of-run saves were finished (`mark_complete`); None when there is training (or a final save) left to do."""
    if checkpoint is None:
        return None
    try:
        saved = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
        done = json.loads((Path(training_args.output_dir) / RUN_COMPLETE_NAME).read_text())
    except (OSError, ValueError):
        return None
    # max_steps from the recipe, or (an epoch-based run) the total the saved run computed from its epochs
    max_steps = training_args.max_steps if training_args.max_steps > 0 else saved.get("max_steps")
    step = saved.get("global_step")
    if not isinstance(step, int) or not isinstance(max_steps, int) or step < max_steps:
        return None
    if done.get("global_step") != step:
        return None  # the end-of-run saves of this step were cut short: resume (training nothing) and redo them
    out = Path(training_args.output_dir).resolve()
    return (
        f"exgrpo train: the run in {out} is already complete (step {step} of max_steps {max_steps}); its model is in "
        f"{out} and its last checkpoint is {Path(checkpoint).resolve()}. Nothing to train: raise max_steps to train "
        "on from there, or give another output_dir for a new run."
    )


def where_it_went(output_dir: str, global_step: int, adapter: bool, pushed=None) -> str:
    """The end-of-run summary: where the model, its card and the checkpoints are (and the Hub repo, if pushed)."""
    out = Path(output_dir).resolve()
    checkpoints = sorted(
        (p.name for p in out.glob("checkpoint-*") if checkpoint_step(p.name) is not None), key=checkpoint_step
    )
    lines = [
        f"exgrpo train: done at step {global_step}.",
        f"  {'LoRA adapter' if adapter else 'model'} and tokenizer: {out}",
        f"  model card: {out / 'README.md'}",
        f"  checkpoints: {', '.join(str(out / c) for c in checkpoints) if checkpoints else 'none kept'}",
    ]
    if pushed is not None:
        lines.append(f"  pushed to: {getattr(pushed, 'repo_url', None) or pushed}")
    return "\n".join(lines)


# Errors reported in one line (the traceback with --debug): what a user can act on, from the recipe, the command line,
# the files and the checkpoint. Anything else (a bug) keeps its traceback.
REPORTED_ERRORS = (
    ValueError,
    TypeError,
    OSError,
    ImportError,
    NotImplementedError,
    StateFileError,
    RewardFunctionError,
)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``exgrpo train ARGS`` and ``python -m exgrpo_trl.cli.train ARGS``."""
    # TRL 1.16 reads the model's `is_gradient_checkpointing` around generation, which transformers 5 deprecates: a
    # warning about TRL's code, shown whether checkpointing is on or off, that a user can do nothing about.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("EXGRPO_DEBUG", "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    if "--help-all" in argv:
        print(build_parser().format_help())
        return 0
    if "-h" in argv or "--help" in argv:
        print(short_help())
        return 0
    # a stdout or stderr whose reader is gone (`| tee` killed by Ctrl-C) never stops the run (cli/output.py)
    with surviving_output() as output:
        try:
            script_args, training_args, model_args = parse_args(argv)
            output.also_to(script_args.log_file)
            out = training_args.output_dir
            with told_when_full(out, f"into {out}", lambda: resume_hint(out)):
                code = train(script_args, training_args, model_args)
            on_cpu = training_args.use_cpu or not torch.cuda.is_available()
        except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C: where training stopped and how to go on, in one line
            if debug:
                raise
            what = str(e) if isinstance(e, Interrupted) else "interrupted before training started; nothing was saved"
            output.tell(f"\nexgrpo train: {what}")
            return 130
        except REPORTED_ERRORS as e:
            if debug:
                raise
            message = " ".join(str(e).split()) or type(e).__name__  # one line, whatever the message's own layout
            if isinstance(e, UsageError):
                output.tell(f"exgrpo train: error: {message}")
                return 2
            after_progress = "\n" if isinstance(e, DiskFull) else ""  # a progress bar may hold the line
            output.tell(f"{after_progress}exgrpo train: error: {message} (--debug shows the traceback)")
            return 1
    end_distributed_run(on_cpu)  # a complete run of several CPU processes exits here, with 0
    return code


def resume_hint(output_dir: str) -> str:
    """What running the same command again does, from the checkpoints complete in `output_dir`."""
    checkpoint, _ = find_resumable_checkpoint(output_dir)
    if checkpoint is None:
        return "run the same command again (no complete checkpoint was saved yet: it starts from step 0)"
    return f"run the same command again to resume from the newest complete checkpoint, {checkpoint}"


def end_distributed_run(on_cpu: bool) -> None:
    """After a complete run of several CPU processes (`accelerate launch`), everything written: every rank waits for
    the others, the process group is torn down, the exit handlers run (loggers finishing their runs), and the process
    exits 0 without the rest of the interpreter's teardown. There, under DeepSpeed ZeRO-3 on CPU, one rank was seen
    to abort ("terminate called without an active exception": a C++ communication thread destroyed while joinable)
    after the run had saved everything, so that a complete run exited non-zero. One process, and runs on GPUs, return
    as usual."""
    dist = torch.distributed
    if not on_cpu or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    dist.barrier()
    dist.destroy_process_group()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
