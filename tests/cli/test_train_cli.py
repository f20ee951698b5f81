"""`exgrpo train`: argument handling, tokenizer loading, checkpoint resolution, and a few real training steps of
recipes/tiny_cpu.yaml through the command line (then resumed from its last checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from exgrpo_trl.checkpoints import resolve_checkpoint
from exgrpo_trl.cli.train import load_tokenizer, model_init_kwargs, parse_args
from tests.helpers import ROOT, TINY_RECIPE, toy_recipe_args


def test_load_tokenizer_honours_the_saved_class(toy_dir):
    tok = load_tokenizer(str(toy_dir))
    assert type(tok) is PreTrainedTokenizerFast
    assert len(tok) == 16  # 4 specials + "0123456789+="
    ids = tok("37+48=", add_special_tokens=False)["input_ids"]
    assert ids == [4 + "0123456789+=".index(c) for c in "37+48="]
    assert tok.decode(ids) == "37+48="
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    # what the pitfall looks like: AutoTokenizer maps the qwen2 config to another tokenizer class
    assert type(AutoTokenizer.from_pretrained(str(toy_dir))) is not PreTrainedTokenizerFast


def _minimal_checkpoint(path: Path, step: int) -> None:
    """The files a plain (GRPO) checkpoint of one process needs to count as complete, tiny."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    save_file({"w": np.zeros(1, dtype=np.float32)}, str(path / "model.safetensors"))
    torch.save({}, path / "optimizer.pt")
    torch.save({}, path / "scheduler.pt")
    torch.save({}, path / "rng_state.pth")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_resolve_checkpoint(tmp_path):
    out = tmp_path / "out"
    _, args, _ = parse_args(["--config", str(TINY_RECIPE), "--output_dir", str(out)])
    assert resolve_checkpoint(args) is None  # no output_dir yet
    for step in (5, 12, 9):
        _minimal_checkpoint(out / f"checkpoint-{step}", step)
    assert resolve_checkpoint(args) == str(out / "checkpoint-12")  # the last by step, not by name
    (out / "checkpoint-100").mkdir()  # an interrupted save: skipped (tests/resume/test_resume_after_crash.py)
    assert resolve_checkpoint(args) == str(out / "checkpoint-12")
    _, args, _ = parse_args(
        ["--config", str(TINY_RECIPE), "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-5")]
    )
    assert resolve_checkpoint(args) == str(out / "checkpoint-5")


def test_model_init_kwargs_from_model_config():
    _, args, model_args = parse_args(["--config", str(TINY_RECIPE)])
    assert model_init_kwargs(model_args, args) == {
        "revision": "main",
        "trust_remote_code": False,
        "dtype": "float32",
        "use_cache": True,
    }
    _, args, model_args = parse_args(
        [
            "--config",
            str(TINY_RECIPE),
            "--gradient_checkpointing",
            "true",
            "--attn_implementation",
            "eager",
            "--model_init_kwargs",
            '{"use_cache": true, "low_cpu_mem_usage": true}',
        ]
    )
    assert model_init_kwargs(model_args, args) == {
        "revision": "main",
        "trust_remote_code": False,
        "attn_implementation": "eager",
        "dtype": "float32",
        "use_cache": True,  # explicit model_init_kwargs win over the gradient-checkpointing default (False)
        "low_cpu_mem_usage": True,
    }


def test_peft_comes_from_model_config():
    from trl import get_peft_config

    _, _, model_args = parse_args(["--config", str(TINY_RECIPE), "--use_peft", "true", "--lora_r", "4"])
    peft_config = get_peft_config(model_args)
    assert peft_config.r == 4 and peft_config.lora_alpha == 32


def test_missing_model_or_dataset_is_reported():
    from exgrpo_trl.cli import train as train_module

    script_args, args, model_args = parse_args(["--config", str(TINY_RECIPE)])
    model_args.model_name_or_path = None
    with pytest.raises(ValueError, match="model_name_or_path is required"):
        train_module.train(script_args, args, model_args)
    script_args, args, model_args = parse_args(["--config", str(TINY_RECIPE)])
    script_args.dataset_name = None
    with pytest.raises(ValueError, match="dataset_name is required"):
        train_module.train(script_args, args, model_args)


# ---------------------------------------------------------------------------------------------------------------
# A few real steps through the command line
# ---------------------------------------------------------------------------------------------------------------
def _entry_point(name: str) -> list[str]:
    """`exgrpo train` (the installed console script, else the same dispatcher with -m) or `python -m MODULE`."""
    if name == "exgrpo train":
        script = Path(sys.executable).parent / "exgrpo"
        return [str(script), "train"] if script.is_file() else [sys.executable, "-m", "exgrpo_trl.cli", "train"]
    return [sys.executable, "-m", name]


def _run(entry: str, toy_dir: Path, out: Path, max_steps: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        *_entry_point(entry),
        *toy_recipe_args(toy_dir, out),
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "1",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "16",  # 2 questions x 8 rollouts
        "--generation_batch_size",
        "32",  # 2 optimizer steps per generation batch, as in the paper
        *extra,
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_tiny_cpu_recipe_trains_evaluates_and_resumes(toy_dir, tmp_path):
    out = tmp_path / "out"
    evaluate = (
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "2",
        "--per_device_eval_batch_size",
        "16",
        "--eval_dataset_name",
        str(toy_dir / "eval.jsonl"),
    )
    first = _run("exgrpo train", toy_dir, out, 2, *evaluate)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]

    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    step_logs = [e for e in state["log_history"] if "loss" in e]
    assert [e["step"] for e in step_logs] == [1, 2]
    # the toy reward ran (by its registry name) and logged per-difficulty accuracy from the kept `digits` column
    assert "rewards/addition_reward/mean" in step_logs[0]
    assert any(k.startswith("accuracy/digits_") for k in step_logs[0])
    assert any(k.startswith("exgrpo/") for k in step_logs[0])  # the ExGRPO trainer did the training
    # evaluation on the held-out file at step 2
    (eval_log,) = [e for e in state["log_history"] if "eval_loss" in e]
    assert eval_log["step"] == 2 and "eval_rewards/addition_reward/mean" in eval_log
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-2").is_dir()
    assert (out / "model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "exgrpo" in card and "ExGRPO" in card and str(toy_dir / "train.jsonl") in card
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    # the saved tokenizer is still the char tokenizer
    assert len(load_tokenizer(str(out))) == 16
    # the thread count it trains on is shown (docs/cpu.md says so; it was logged at INFO, which the default hides)
    assert "exgrpo train: training on the CPU with 1 torch thread (OMP_NUM_THREADS sets more)" in first.stdout
    # the end of the run says where everything went
    assert first.stdout.splitlines()[-4:] == [
        "exgrpo train: done at step 2.",
        f"  model and tokenizer: {out}",
        f"  model card: {out / 'README.md'}",
        f"  checkpoints: {out / 'checkpoint-1'}, {out / 'checkpoint-2'}",
    ]

    # Same output_dir, more steps: picks up checkpoint-2 by itself and trains only step 3
    # (python -m exgrpo_trl.cli.train)
    second = _run("exgrpo_trl.cli.train", toy_dir, out, 3)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"Resuming from checkpoint {out / 'checkpoint-2'}" in second.stdout + second.stderr
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    # only one step's metrics were printed by the second run
    assert (second.stdout + second.stderr).count("'step_time'") == 1


# ---------------------------------------------------------------------------------------------------------------
# Help and errors: the help leads with what a user of `exgrpo train` needs, errors are one line
# ---------------------------------------------------------------------------------------------------------------
def test_help_leads_with_usage_config_and_exgrpo_options(capsys, monkeypatch):
    from dataclasses import fields

    from trl import GRPOConfig

    from exgrpo_trl import ExGRPOConfig
    from exgrpo_trl.cli import main

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["train", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["usage: exgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--debug] [--help-all]", ""]
    assert lines.index("this command:") < 10
    assert "  --config RECIPE.yaml  the recipe (YAML)" in lines[:15]
    exgrpo_group = lines.index("ExGRPO (ExGRPOConfig; defaults from the paper):")
    assert exgrpo_group < 20 and lines[exgrpo_group + 1].startswith("  --replay_ratio REPLAY_RATIO")
    own = {f.name for f in fields(ExGRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    listed = {line.split()[0][2:] for line in lines if line.startswith("  --")}
    assert own <= listed and {"model_name_or_path", "dataset_name", "output_dir", "learning_rate"} <= listed
    assert "per_device_eval_batch_size" not in listed  # TRL's and transformers' options are behind --help-all
    assert len(lines) < 250  # was 1,518

    assert main(["train", "--help-all"]) == 0
    every = capsys.readouterr().out.splitlines()
    assert every[0] == "usage: exgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--debug] [--help-all]"
    assert any(line.startswith("  --per_device_eval_batch_size") for line in every) and len(every) > 1000


def _bad_recipe(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY_RECIPE.read_text() + "\nreplay_ration: 0.5\n")
    return bad


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--config", "recipes/nope.yaml"], 2, "--config recipes/nope.yaml: no such file"),
        (["--config"], 2, "--config needs the recipe's path: --config RECIPE.yaml"),
        (
            ["--config", str(TINY_RECIPE), "--learning_rte", "1e-4"],
            2,
            "unknown option --learning_rte (did you mean --learning_rate?)",
        ),
        (
            ["--config", str(TINY_RECIPE), "--max_steps", "abc"],
            2,
            "argument --max_steps: invalid int value: 'abc'",  # found before TRL is imported (cli/precheck.py)
        ),
        (
            ["--config", str(TINY_RECIPE), "--replay_ratio", "2"],
            2,
            "replay_ratio must be in [0, 1], got 2.0.",  # before torch is imported (cli/precheck.py)
        ),
        (["--config", "BAD"], 2, "unknown key replay_ration in BAD (did you mean replay_ratio?)"),
        (
            [
                "--config",
                str(TINY_RECIPE),
                "--model_name_or_path",
                "/nowhere/tiny",
                "--dataset_name",
                "/nowhere/t.jsonl",
            ],
            2,
            "model_name_or_path /nowhere/tiny is a local path that does not exist (/nowhere/tiny); create it first "
            "(a recipe's header says how), or give a Hub id (org/name).",
        ),
    ],
    ids=["missing-recipe", "config-without-path", "misspelled-flag", "bad-int", "bad-value", "bad-key", "no-model"],
)
def test_errors_are_one_line(tmp_path, capsys, argv, code, message):
    from exgrpo_trl.cli import main

    bad = str(_bad_recipe(tmp_path))
    argv = [bad if a == "BAD" else a for a in argv]
    assert main(["train", *argv]) == code
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "exgrpo train: error: " + message.replace("BAD", bad)
    assert "Traceback" not in err and "usage:" not in err


def test_debug_shows_the_traceback(monkeypatch):
    from exgrpo_trl.cli.train import main  # `exgrpo train` finds this one before (precheck), without a traceback

    with pytest.raises(ValueError, match=r"replay_ratio must be in \[0, 1\]"):
        main(["train", "--config", str(TINY_RECIPE), "--replay_ratio", "2", "--debug"])
    monkeypatch.setenv("EXGRPO_DEBUG", "1")
    with pytest.raises(ValueError, match=r"replay_ratio must be in \[0, 1\]"):
        main(["train", "--config", str(TINY_RECIPE), "--replay_ratio", "2"])


def test_where_it_went(tmp_path):
    from exgrpo_trl.cli.train import where_it_went

    for name in ("checkpoint-10", "checkpoint-9", "checkpoint-x"):
        (tmp_path / name).mkdir()
    assert where_it_went(str(tmp_path), 10, adapter=True).splitlines() == [
        "exgrpo train: done at step 10.",
        f"  LoRA adapter and tokenizer: {tmp_path}",
        f"  model card: {tmp_path / 'README.md'}",
        f"  checkpoints: {tmp_path / 'checkpoint-9'}, {tmp_path / 'checkpoint-10'}",
    ]
    assert where_it_went(str(tmp_path / "none"), 0, adapter=False).splitlines()[1:] == [
        f"  model and tokenizer: {tmp_path / 'none'}",
        f"  model card: {tmp_path / 'none' / 'README.md'}",
        "  checkpoints: none kept",
    ]


def test_a_run_that_fails_before_training_leaves_no_output_folder(tmp_path, toy_dir, capsys):
    """The output folder is made (and write-tested) before the model loads; a run that then failed (here: a model
    folder with no tokenizer) left it behind, empty. A folder that held something before is never touched."""
    from exgrpo_trl.cli import main

    no_tokenizer = tmp_path / "model"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((toy_dir / "config.json").read_text())
    out = tmp_path / "out"
    argv = ["train", *toy_recipe_args(toy_dir, out), "--model_name_or_path", str(no_tokenizer)]
    assert main(argv) == 1
    assert "exgrpo train: error:" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(argv) == 1
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("column", ["solution", "answer"])
def test_offline_solutions_column_is_kept_without_keep_columns(tmp_path, toy_dir, capsys, column):
    """`--offline_solutions_column solution` alone trains: the column reaches the dataset (it used to fail unless it
    was also in keep_columns, with an error that did not say so). So does the answer column itself, whose reference
    answers are whole completions in the toy task: the command put it into keep_columns, which the loader refused
    (`keep_columns lists 'answer', which is always produced`, issue 53), although the recipe's keep_columns was
    [digits]. One step with 2 questions: every group gets its offline row (exgrpo/offline/groups 1.0)."""
    from exgrpo_trl.cli import main
    from exgrpo_trl.cli.train import data_columns

    rows = [json.loads(line) for line in (toy_dir / "train.jsonl").read_text().splitlines()][:16]
    data = tmp_path / "with_solutions.jsonl"
    data.write_text("".join(json.dumps({**r, "solution": r["answer"]}) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["train", *toy_recipe_args(toy_dir, out), "--dataset_name", str(data), "--offline_solutions_column",
            column, "--max_steps", "1", "--save_strategy", "no", "--per_device_train_batch_size", "16",
            "--generation_batch_size", "16", "--logging_steps", "1"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert [e["exgrpo/offline/groups"] for e in state["log_history"] if "exgrpo/offline/groups" in e] == [1.0]
    _, args, _ = parse_args(["--config", str(TINY_RECIPE), "--offline_solutions_column", column])
    kept = ["digits", "solution"] if column == "solution" else ["digits"]
    assert data_columns(["digits"], args) == kept
    assert data_columns(["digits", "solution"], args) == ["digits", "solution"]


def test_the_offline_column_needs_no_keep_columns_anywhere():
    """The trainer page said to list the offline column in keep_columns, the command keeps it by itself: the page,
    the option's help (exgrpo train --help) and the offline recipe now say the same (issue 53)."""
    from exgrpo_trl.cli import TRAIN_HELP

    page = (ROOT / "docs" / "exgrpo_trainer.md").read_text()
    section = page[page.index("## Offline guidance") : page.index("## How it works inside TRL")]
    assert "`keep_columns: [" not in section and "with no `keep_columns` entry" in section
    assert "`answer` included" in section
    help_text = " ".join(TRAIN_HELP.read_text().split())
    assert "Any column, 'answer' included; `exgrpo train` keeps it in the data by itself (no keep_columns entry)" in (
        help_text
    )
    recipe = (ROOT / "recipes" / "qwen7b_offline.yaml").read_text()
    assert "\nkeep_columns" not in recipe and "without a keep_columns entry" in recipe


def test_chat_prompts_without_a_chat_template_fail_in_one_line_before_training(tmp_path, toy_dir, capsys):
    """A 'question' column becomes a system prompt and a chat turn; the toy tokenizer has no chat template, which
    used to fail at the first step with transformers' own error. Now: one line, before the model trains."""
    from exgrpo_trl.cli import main

    data = tmp_path / "questions.jsonl"
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i), "digits": 1} for i in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    argv = ["train", *toy_recipe_args(toy_dir, out), "--dataset_name", str(data)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "has no chat template" in err and "'question' or 'problem'" in err
    assert "Traceback" not in err and not (out / "trainer_state.json").exists()
