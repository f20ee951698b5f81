"""What the recipes say, checked without running any of them (nothing here launches a process or loads a model):
every recipe parses with `exgrpo train`'s parser (TrlParser), opens with its launch commands, and each launch line's
overrides parse; each layout's batch arithmetic holds (512 rows per optimizer step, 1,024 per generation batch, 1,400
steps) and its vLLM server and training GPUs do not overlap; the 7B recipe carries §9's values, the variants differ
from it only where intended, and the recipes' objective matches the reference run's; the accelerate configs load.
Where the recipes have actually run: docs/recipes.md, "Where it has run"."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from exgrpo_trl.cli.train import ScriptArguments, parse_args
from exgrpo_trl.config import ExGRPOConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
ACCELERATE = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))
VLM_RECIPE = ROOT / "recipes" / "qwen2_5_vl_3b.yaml"
# the paper's recipes (text, its batch shape and vLLM layouts); the CPU and the vision-language recipes are apart
GPU_RECIPES = [p for p in RECIPES if p.name not in ("tiny_cpu.yaml", VLM_RECIPE.name)]

# algorithm §9: 128 questions x K = 8 rollouts per step, 2 optimizer updates per step (mini-batch of 64 questions),
# 700 steps.
QUESTIONS_PER_STEP, K, UPDATES_PER_STEP, PAPER_STEPS = 128, 8, 2, 700
ROWS_PER_GENERATION = QUESTIONS_PER_STEP * K  # 1024
ROWS_PER_UPDATE = ROWS_PER_GENERATION // UPDATES_PER_STEP  # 512


@pytest.fixture(autouse=True)
def _bf16_allowed(monkeypatch):
    # The GPU recipes say bf16: true, which TrainingArguments rejects on a machine without a bf16 GPU. Pretend there
    # is one, so that the recipes are parsed exactly as written (use_cpu stays false).
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)


def header(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return lines


def launch_lines(path: Path, marker: str) -> list[str]:
    return [line for line in header(path) if marker in line]


def parse(path: Path, *extra: str):
    return parse_args(["--config", str(path), *extra])


def tokens_of(line: str) -> list[str]:
    """The words of a launch line, without its leading "[node A]" label."""
    return shlex.split(re.sub(r"^\[[^\]]*\]\s*", "", line))


def after_config(line: str, recipe: str) -> list[str]:
    """Command-line overrides that follow `--config recipes/<recipe>` in a launch line."""
    tokens = tokens_of(line)
    i = tokens.index("--config")
    assert tokens[i + 1] == f"recipes/{recipe}"
    return tokens[i + 2 :]


def flag(tokens: list[str], name: str) -> str | None:
    return tokens[tokens.index(name) + 1] if name in tokens else None


# ---------------------------------------------------------------------------------------------------------------
def test_recipe_set():
    assert {p.name for p in RECIPES} == {
        "qwen7b.yaml",
        "qwen7b_colocate.yaml",
        "qwen7b_on_policy.yaml",
        "qwen1.5b.yaml",
        "llama8b_base.yaml",
        "qwen7b_instruct.yaml",
        "qwen7b_offline.yaml",
        "tiny_cpu.yaml",
        "qwen2_5_vl_3b.yaml",
    }
    assert {p.name for p in ACCELERATE} == {"zero3.yaml", "ddp.yaml", "zero3_multinode.yaml", "cpu_ddp.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_parses_and_opens_with_its_launch_command(path):
    script_args, training_args, model_args = parse(path)
    assert isinstance(script_args, ScriptArguments) and isinstance(training_args, ExGRPOConfig)
    assert model_args.model_name_or_path and script_args.dataset_name and training_args.output_dir
    assert training_args.num_generations == K
    assert isinstance(training_args.learning_rate, float)  # YAML "1e-6" would be a string: recipes write 1.0e-6
    commands = launch_lines(path, "accelerate launch") + launch_lines(path, "exgrpo train")
    assert commands, f"{path.name} must open with its launch command"
    assert all(f"--config recipes/{path.name}" in c for c in commands)
    # every override used in a launch line is a valid flag
    for line in launch_lines(path, "accelerate launch"):
        overrides = after_config(line, path.name)
        parse(path, *overrides)
        config_file = flag(tokens_of(line), "--config_file")
        assert (ROOT / config_file).is_file()


def test_vision_language_recipe():
    """Qwen2.5-VL-3B on lmms-lab/multimodal-open-r1-8k-verified (image, problem, solution): the question and answer
    columns named, transformers' generation (image inputs are rejected with vLLM), the batch arithmetic whole."""
    script_args, args, model_args = parse(VLM_RECIPE)
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert script_args.dataset_name == "lmms-lab/multimodal-open-r1-8k-verified"
    assert (script_args.question_column, script_args.answer_column) == ("problem", "solution")
    assert script_args.reward_funcs == ["math_verify"] and not args.use_vllm
    (line,) = launch_lines(VLM_RECIPE, "accelerate launch")
    processes = int(flag(tokens_of(line), "--num_processes"))
    rows_per_update = args.per_device_train_batch_size * processes * args.gradient_accumulation_steps
    assert args.generation_batch_size % rows_per_update == 0 and args.generation_batch_size // K == 32
    assert args.replay_ratio == 0.5 and args.policy_shaping_gamma == 0.1


def test_unknown_key_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "recipes" / "tiny_cpu.yaml").read_text() + "\nreplay_ration: 0.5\n")
    with pytest.raises(ValueError, match="replay_ration"):
        parse(bad)


def test_command_line_overrides_the_recipe():
    recipe = ROOT / "recipes" / "tiny_cpu.yaml"
    _, base, _ = parse(recipe)
    assert (base.learning_rate, base.replay_ratio, base.max_steps) == (1e-4, 0.5, 300)
    script_args, args, model_args = parse(
        recipe, "--learning_rate", "3e-4", "--replay_ratio", "0.25", "--max_steps", "7", "--model_name_or_path", "m"
    )
    assert (args.learning_rate, args.replay_ratio, args.max_steps) == (3e-4, 0.25, 7)
    assert model_args.model_name_or_path == "m"
    assert script_args.reward_funcs == ["toy_addition"] and script_args.keep_columns == ["digits"]


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_batch_arithmetic_of_every_launch_layout(path):
    """per-device batch x training processes x gradient accumulation = 512 rows per optimizer step, 1024 rows per
    generation batch = 2 optimizer steps, 1400 optimizer steps = 700 paper steps: in every layout a recipe lists."""
    lines = launch_lines(path, "accelerate launch") + launch_lines(path, "exgrpo train")
    assert lines
    for line in lines:
        overrides = after_config(line, path.name)
        tokens = tokens_of(line)
        processes = int(flag(tokens, "--num_processes") or 1)  # `exgrpo train` runs one process
        _, args, _ = parse(path, *overrides)
        global_micro_batch = args.per_device_train_batch_size * processes
        assert global_micro_batch * args.gradient_accumulation_steps == ROWS_PER_UPDATE, line
        assert args.generation_batch_size == ROWS_PER_GENERATION
        micro_batches_per_generation = args.generation_batch_size // global_micro_batch  # TRL's steps_per_generation
        assert args.generation_batch_size % global_micro_batch == 0
        assert micro_batches_per_generation == UPDATES_PER_STEP * args.gradient_accumulation_steps, line
        assert args.max_steps == PAPER_STEPS * UPDATES_PER_STEP == 1400
        assert args.generation_batch_size // args.num_generations == QUESTIONS_PER_STEP


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_vllm_layout_matches_the_recipe(path):
    script_args, args, model_args = parse(path)
    serve = launch_lines(path, "trl vllm-serve")
    assert args.use_vllm
    if args.vllm_mode == "server":
        assert serve, f"{path.name}: server mode needs its `trl vllm-serve` command"
        for line in serve:
            tokens = tokens_of(line)
            assert flag(tokens, "--model") == model_args.model_name_or_path
            # the server must hold a prompt plus a full completion
            assert int(flag(tokens, "--max-model-len")) >= script_args.max_prompt_length + args.max_completion_length
        # the single-node layout splits the 8 GPUs between vLLM and training, one process per training GPU
        (serve_line,) = [line for line in serve if "CUDA_VISIBLE_DEVICES" in line]
        (train_line,) = [line for line in launch_lines(path, "accelerate launch") if "CUDA_VISIBLE_DEVICES" in line]
        serve_gpus, train_gpus = (
            set(re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)", line).group(1).split(","))
            for line in (serve_line, train_line)
        )
        assert not serve_gpus & train_gpus and len(serve_gpus | train_gpus) == 8
        assert int(flag(tokens_of(serve_line), "--data-parallel-size")) == len(serve_gpus)
        assert int(flag(tokens_of(train_line), "--num_processes")) == len(train_gpus)
    else:
        assert args.vllm_mode == "colocate" and not serve
        assert args.vllm_max_model_length >= script_args.max_prompt_length + args.max_completion_length
        processes = [int(flag(tokens_of(line), "--num_processes")) for line in launch_lines(path, "accelerate launch")]
        assert processes == [8]  # the paper's 8 GPUs, all training


def test_qwen7b_recipe_matches_spec():
    script_args, args, model_args = parse(ROOT / "recipes" / "qwen7b.yaml")
    # data and reward
    assert script_args.dataset_name == "Elliott/Openr1-Math-46k-8192"
    assert script_args.dataset_train_split == "train"
    assert script_args.reward_funcs == ["math_verify"]
    assert script_args.max_prompt_length == 1024
    assert model_args.model_name_or_path == "Elliott/Qwen2.5-Math-7B-16k-think"
    assert model_args.dtype == "bfloat16"
    # ExGRPO
    assert args.replay_ratio == 0.5
    assert args.policy_shaping_gamma == 0.1
    assert args.replay_start_pass_rate == 0.35
    assert (args.replay_mu, args.replay_sigma) == (0.5, 1.0)
    assert (args.question_selection, args.trajectory_selection) == ("gaussian", "lowest_entropy")
    assert args.max_trajectory_candidates is None  # every stored trajectory is scored, as in the paper
    assert args.replay_importance_correction is True
    assert args.success_reward_threshold == 1.0 and args.skip_retired_questions is True
    # batch and length
    assert (args.num_generations, args.generation_batch_size) == (8, 1024)
    assert (args.max_steps, args.num_iterations) == (1400, 1)
    # objective
    assert (args.loss_type, args.scale_rewards, args.beta) == ("dr_grpo", "none", 0.0)
    assert args.remove_clip_after_replay_start is True  # the reference run's loss_remove_clip
    assert args.vllm_importance_sampling_correction is False  # the reference has none
    # sampling
    assert (args.max_completion_length, args.temperature, args.top_p) == (8192, 1.0, 1.0)
    # optimiser
    assert args.learning_rate == 1e-6
    assert args.lr_scheduler_type == "constant" and args.warmup_steps == 0
    assert (args.optim, args.weight_decay) == ("adamw_torch", 0.01)
    # precision, memory, generation
    assert args.bf16 is True and args.use_cpu is False
    assert args.gradient_checkpointing is True
    assert (args.use_vllm, args.vllm_mode) == (True, "server")
    # the primary layout: 4 training + 4 vLLM GPUs on one 8-GPU node
    first = launch_lines(ROOT / "recipes" / "qwen7b.yaml", "accelerate launch")[0]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in first and "--num_processes 4" in first
    assert args.per_device_train_batch_size * 4 * args.gradient_accumulation_steps == 512


# The reference run (run_exgrpo.sh): each micro-batch's token-loss sum / 8192 (its response width), gradients averaged
# over 8 GPUs, gradient clip 1.0, AdamW eps 1e-8, entropy 0.001 x token mean once per dynamic micro-batch (M per
# optimizer step, M = 4 assumed: ~2,000 tokens per row x 64 rows per GPU / 32,768 tokens per micro-batch).
REF_GPUS, REF_WIDTH, REF_ENTROPY, REF_CLIP, REF_EPS, M = 8, 8192, 0.001, 1.0, 1e-8, 4


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_paper_recipes_reproduce_the_reference_objective(path):
    _, args, _ = parse(path)
    # TRL's dr_grpo divides by (rows per optimizer step x max_completion_length) = 512 x L: a policy token weighs
    # 1 / (512 L) against the reference's 1 / (8 x 8192); with L = 8192 the reference's loss is 64 x TRL's.
    scale = (ROWS_PER_UPDATE * args.max_completion_length) / (REF_GPUS * REF_WIDTH)
    if args.max_completion_length == REF_WIDTH:
        assert scale == 64
    else:  # qwen1.5b (3,072): the reference's width for that run is unknown; assumed equal to ours, scale 64 again
        assert path.name == "qwen1.5b.yaml"
        scale = ROWS_PER_UPDATE / REF_GPUS
    # entropy: reference weight 0.001 x M against 1 unit of its loss; ours entropy_coef against 1 / scale of it
    assert args.entropy_coef == pytest.approx(REF_ENTROPY * M / scale, rel=1e-12) == 6.25e-5
    assert args.max_grad_norm == pytest.approx(REF_CLIP / scale, rel=1e-12) == 0.015625
    assert args.adam_epsilon == pytest.approx(REF_EPS / scale, rel=1e-12) == 1.5625e-10
    assert args.vllm_importance_sampling_correction is False
    assert args.remove_clip_after_replay_start is True


def _as_dict(path):
    script_args, args, model_args = parse(path)
    values = {**vars(script_args), **args.to_dict(), **vars(model_args)}
    # bookkeeping, and steps_per_generation (derived from the batch values, checked in the arithmetic test)
    for key in ("output_dir", "logging_dir", "hub_model_id", "run_name", "steps_per_generation"):
        values.pop(key, None)
    return values


def _diff(a, b):
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


@pytest.mark.parametrize(
    "name,expected",
    [
        ("qwen7b_on_policy.yaml", {"replay_ratio"}),
        # (vllm_server_host: the server-mode address, unused when colocated)
        (
            "qwen7b_colocate.yaml",
            {
                "vllm_mode",
                "vllm_gpu_memory_utilization",
                "vllm_max_model_length",
                "vllm_server_host",
                "gradient_accumulation_steps",
            },
        ),
        ("llama8b_base.yaml", {"model_name_or_path", "replay_start_pass_rate"}),
        ("qwen7b_instruct.yaml", {"model_name_or_path"}),
        ("qwen7b_offline.yaml", {"offline_solutions_column"}),
        (
            "qwen1.5b.yaml",
            {
                "model_name_or_path",
                "max_completion_length",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
            },
        ),
    ],
)
def test_variants_differ_from_the_7b_recipe_only_where_intended(name, expected):
    base = _as_dict(ROOT / "recipes" / "qwen7b.yaml")
    variant = _as_dict(ROOT / "recipes" / name)
    assert _diff(base, variant) == expected
    if name == "qwen7b_on_policy.yaml":
        assert variant["replay_ratio"] == 0.0
    if name == "llama8b_base.yaml":
        assert variant["replay_start_pass_rate"] == 0.0  # no delayed start, as in the paper
    if name == "qwen7b_colocate.yaml":
        assert variant["vllm_mode"] == "colocate"
    if name == "qwen7b_offline.yaml":
        assert variant["offline_solutions_column"] == "target" and variant["keep_columns"] == []
        assert variant["offline_guidance"] == "all_groups"  # LUFFY's rule (the default)


def test_offline_recipe_on_the_shipped_sample():
    """The offline recipe's data path on OpenR1-Math-46k's shipped sample (its schema): the `target` column reaches
    the trainer's dataset without a keep_columns entry, each row holds one solution as the guide reads it, and the
    recipe's reward scores every one of them solved, so none would be rejected."""
    from exgrpo_trl.cli.train import data_columns
    from exgrpo_trl.offline import offline_texts
    from exgrpo_trl.tasks.math_data import load_math_dataset
    from exgrpo_trl.tasks.rewards import math_reward

    script_args, args, _ = parse(ROOT / "recipes" / "qwen7b_offline.yaml")
    sample = ROOT / "tests" / "data" / "openr1_math_46k_sample.jsonl"
    columns = data_columns(script_args.keep_columns, args)  # as `exgrpo train` loads it
    dataset = load_math_dataset(str(sample), split="train", keep_columns=columns)
    column = args.offline_solutions_column
    assert set(dataset.column_names) == {"prompt", "answer", column} and len(dataset) == 6
    texts = [offline_texts(row[column], column) for row in dataset]
    assert [len(t) for t in texts] == [1] * 6
    completions = [[{"role": "assistant", "content": t[0]}] for t in texts]  # TRL's conversational completions
    assert math_reward(completions, answer=dataset["answer"]) == [1.0] * 6


def test_tiny_cpu_recipe_settings():
    script_args, args, model_args = parse(ROOT / "recipes" / "tiny_cpu.yaml")
    assert (args.use_cpu, args.bf16, args.gradient_checkpointing) == (True, False, False)
    assert args.learning_rate == 1e-4 and args.max_completion_length == 8
    assert args.report_to == []  # "none"
    assert script_args.reward_funcs == ["toy_addition"]
    assert model_args.dtype == "float32"
    # the 4-head model and a 2,000-step warm start, past the sharp transition at which multi-digit sums are learned
    # (1,500 steps landed on either side of it on different machines); replay from the first batch whatever the
    # warm start reached, so that the recipe cannot hang below the paper's delayed start
    assert "python -m exgrpo_trl.tasks.toy --out outputs/tiny-toy --num-heads 4 --warm-start-steps 2000" in header(
        ROOT / "recipes" / "tiny_cpu.yaml"
    )
    assert args.replay_start_pass_rate == 0.0
    assert model_args.model_name_or_path == "./outputs/tiny-toy"  # path-looking: a missing one fails fast
    assert script_args.dataset_name == "./outputs/tiny-toy/train.jsonl"


# ---------------------------------------------------------------------------------------------------------------
# accelerate configs
# ---------------------------------------------------------------------------------------------------------------
def test_accelerate_configs_load_and_say_what_they_are():
    from accelerate.commands.config.config_args import load_config_from_file  # rejects unknown keys

    zero3 = load_config_from_file(str(ROOT / "recipes/accelerate/zero3.yaml"))
    assert zero3.distributed_type == "DEEPSPEED" and zero3.deepspeed_config["zero_stage"] == 3
    assert zero3.mixed_precision == "bf16" and zero3.num_machines == 1
    ddp = load_config_from_file(str(ROOT / "recipes/accelerate/ddp.yaml"))
    assert ddp.distributed_type == "MULTI_GPU" and ddp.mixed_precision == "bf16"
    multi = load_config_from_file(str(ROOT / "recipes/accelerate/zero3_multinode.yaml"))
    assert multi.distributed_type == "DEEPSPEED" and multi.deepspeed_config["zero_stage"] == 3
    assert (multi.num_machines, multi.num_processes) == (2, 16)
    for path in ACCELERATE:
        assert launch_lines(path, "accelerate launch"), f"{path.name} must open with an example launch command"


def test_cpu_processes_config_launches_the_tiny_recipe_with_its_batch():
    """recipes/accelerate/cpu_ddp.yaml: CPU processes under torchrun (MULTI_GPU is what makes accelerate start
    num_processes of them; use_cpu keeps them on the CPU, over gloo), no mixed precision; its launch line is
    `exgrpo train`'s with the tiny recipe, and its per-device batch keeps the recipe's 128 rows per optimizer step
    over its 2 processes. tests/multiprocess launches its DDP runs with this file; it ran this line once (4 steps, two
    processes, 11.5 s at load 4.1)."""
    from accelerate.commands.config.config_args import load_config_from_file

    path = ROOT / "recipes" / "accelerate" / "cpu_ddp.yaml"
    config = load_config_from_file(str(path))
    assert (config.distributed_type, config.use_cpu, config.mixed_precision) == ("MULTI_GPU", True, "no")
    assert (config.num_processes, config.num_machines) == (2, 1)
    (line,) = [line for line in launch_lines(path, "accelerate launch") if line.startswith("accelerate launch")]
    tokens = tokens_of(line)
    assert tokens[:4] == ["accelerate", "launch", "--config_file", "recipes/accelerate/cpu_ddp.yaml"]
    assert tokens[4:7] == ["-m", "exgrpo_trl.cli.train", "--config"]
    _, single, _ = parse(ROOT / "recipes" / "tiny_cpu.yaml")
    _, args, _ = parse(ROOT / "recipes" / "tiny_cpu.yaml", *after_config(line, "tiny_cpu.yaml"))
    rows = args.per_device_train_batch_size * config.num_processes * args.gradient_accumulation_steps
    assert rows == single.per_device_train_batch_size * single.gradient_accumulation_steps == 128
    assert "recipes/accelerate/cpu_ddp.yaml" in (ROOT / "tests" / "multiprocess" / "test_multiprocess.py").read_text()


def test_docs_list_every_recipe():
    for page in (ROOT / "recipes" / "README.md", ROOT / "docs" / "recipes.md"):
        text = page.read_text()
        for path in RECIPES + ACCELERATE:
            assert path.name in text, (page.name, path.name)


def test_every_paper_recipe_says_in_its_header_that_it_was_never_trained():
    """The recipes for GPUs have been parsed and checked, never trained here: each says so in its opening comment,
    where a user who opens only the recipe reads it (the CPU recipe is the one that has run)."""
    for path in RECIPES:
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
        said = "Never trained by this project" in "\n".join(header) or "not run by this project" in "\n".join(header)
        assert said == (path.name != "tiny_cpu.yaml"), path.name
