"""What a new user of the `exgrpo` command meets first: `--version`, a fast `exgrpo train --help`, errors
that name the cause before any work (no recipe, an output_dir that is a file or cannot be written, a missing
optional package), a reward function that raises reported in one line, Ctrl-C reported in one line with how to go
on, and no transformers deprecation warning for an option nobody set."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import termios
import threading
import time
import warnings
from pathlib import Path

import pytest

from exgrpo_trl.cli import main
from tests.helpers import ROOT, TINY_RECIPE, toy_recipe_args

ENV = {
    **os.environ,
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
}


def _train_args(toy_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *toy_recipe_args(toy_dir, out),
        "--per_device_train_batch_size",
        "16",
        "--generation_batch_size",
        "16",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        "true",
        *extra,
    ]


def _exgrpo() -> list[str]:
    script = Path(sys.executable).parent / "exgrpo"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "exgrpo_trl.cli"]


# ----------------------------------------------------------------------------------------------------- the command
def test_version(capsys):
    from exgrpo_trl import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"exgrpo-trl {__version__}\n"


def test_train_without_a_recipe_says_so(capsys):
    """It used to run TRL's defaults and stop at `Your setup doesn't support bf16/gpu`."""
    for argv in (["train"], ["train", "--max_steps", "3"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [
            "exgrpo train: error: no recipe: exgrpo train --config RECIPE.yaml [--FIELD VALUE ...] (recipes/ holds "
            "examples; exgrpo train --help lists the options)"
        ]


def test_train_help_is_written_out_and_fast():
    """`exgrpo train --help` prints the text `short_help()` builds (kept in the package, so it imports no TRL): it
    took 6-15 s, importing torch, transformers and TRL to build it."""
    from exgrpo_trl.cli import TRAIN_HELP
    from exgrpo_trl.cli.train import short_help

    assert TRAIN_HELP.is_file() and TRAIN_HELP.read_text() == short_help(), (
        "exgrpo_trl/cli/train_help.txt is stale: make style (or python -c 'from exgrpo_trl.cli.train import "
        "write_help; write_help()')"
    )
    start = time.perf_counter()
    run = subprocess.run([*_exgrpo(), "train", "--help"], env=ENV, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert run.returncode == 0 and run.stdout == TRAIN_HELP.read_text()
    assert seconds < 3, f"exgrpo train --help took {seconds:.1f}s"


def test_recipe_mistakes_are_found_before_trl_is_imported(tmp_path):
    """A recipe's typo or bad value took about 5 s to report (TRL, transformers and torch imported first); it is now
    checked against train_options.json (kept current here) before any of them is imported."""
    import json

    from exgrpo_trl.cli.precheck import OPTIONS
    from exgrpo_trl.cli.train import option_table

    assert json.loads(OPTIONS.read_text()) == option_table(), "train_options.json is stale: make style"
    typo = tmp_path / "typo.yaml"
    typo.write_text("learning_rate: 1.0e-4\nlerning_rate: 2\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: ten\nuse_peft: maybe\n")
    cases = [
        (["--config", str(typo)], f"unknown key lerning_rate in {typo} (did you mean learning_rate?)"),
        (["--config", str(bad)], f"max_steps in {bad}: 'ten' is not a valid int value"),
        (["--config", str(TINY_RECIPE), "--max_stepz", "3"], "unknown option --max_stepz (did you mean --max_steps?)"),
        (["--config", str(TINY_RECIPE), "--use_peft=maybe"], "argument --use_peft: invalid bool value: 'maybe'"),
    ]
    check = "import sys, exgrpo_trl.cli as c; c.main(sys.argv[1:]); print(sorted({'torch', 'trl'} & set(sys.modules)))"
    for argv, message in cases:
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", check, "train", *argv], env=ENV, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        assert run.stderr.splitlines() == [f"exgrpo train: error: {message}"], run.stderr
        assert run.stdout.strip() == "[]", run.stdout  # neither torch nor TRL was imported
        assert seconds < 2, f"{seconds:.2f}s"
        print(f"{message}: {seconds:.2f}s")


# What a value error cost before it was checked ahead of torch (issue 53, a 2-core machine at load 2-7): 5-90 s to
# import torch, transformers and TRL first; a misspelt loss_type only at the first step, once the model had loaded; a
# Hub id on a machine without the Hub 53 s of retries.
REFUSED = "import sys, exgrpo_trl.cli as c; print(c.main(sys.argv[1:]), sorted({'torch', 'trl'} & set(sys.modules)))"


def _refusal_cases(tmp_path: Path, toy_dir: Path) -> list[tuple[str, list[str], dict, str]]:
    """(id, argv, environment, the error line as a regular expression)."""
    q = re.escape
    config, model = ["--config", str(TINY_RECIPE)], ["--model_name_or_path", str(toy_dir)]
    data = ["--dataset_name", str(toy_dir / "train.jsonl")]
    base = [*config, *model, *data]
    ranges = tmp_path / "ranges.yaml"
    ranges.write_text(TINY_RECIPE.read_text() + "\nreplay_mu: 1.5\n")
    hub = ["--model_name_or_path", "someorg/not-in-any-cache"]
    no_hub = {"HF_HOME": str(tmp_path / "empty-hf-home")}
    unreachable = {**no_hub, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    on_the_hub = "model_name_or_path someorg/not-in-any-cache is not a local path, so a model on the Hub, and "
    not_there = "is a local path that does not exist"
    return [
        ("range-flag", [*base, "--replay_ratio", "-0.5"], {}, q("replay_ratio must be in [0, 1], got -0.5.")),
        (
            "range-recipe",
            ["--config", str(ranges), *model, *data],
            {},
            q("replay_mu must be in [0, 1] (a success rate), got 1.5."),
        ),
        (
            "loss-type",
            [*base, "--loss_type", "drgrpo"],
            {},
            q("loss_type must be one of grpo, sapo, bnpo, dr_grpo, cispo, dapo, vespo, luspo; got 'drgrpo'"),
        ),
        (
            "group-size",
            [*base, "--num_generations", "1"],
            {},
            q("num_generations must be >= 2 for ExGRPO (a group needs K-1 fresh rollouts beside a replayed one ")
            + ".*",
        ),
        (
            "enum",
            [*base, "--lr_scheduler_type", "constnat"],
            {},
            q("lr_scheduler_type must be one of linear, cosine, ") + ".*" + q("; got 'constnat'"),
        ),
        (
            "clip-and-loss",
            [*base, "--loss_type", "cispo", "--remove_clip_after_replay_start", "true"],
            {},
            q("remove_clip_after_replay_start removes the PPO clip of loss_type in (")
            + ".*"
            + q("has none to remove."),
        ),
        (
            "reward-name",
            [*base, "--reward_funcs", "toy_adition"],
            {},
            q("unknown reward function 'toy_adition': use one of ['math_verify', 'toy_addition'] or a ") + ".*",
        ),
        (
            "reward-module",
            [*base, "--reward_funcs", "my_rewardz:score"],
            {},
            q("reward function 'my_rewardz:score': no module 'my_rewardz' in the folder you launch from") + ".*",
        ),
        (
            "model-path",
            config,
            {},
            q(f"model_name_or_path ./outputs/tiny-toy {not_there} ({tmp_path / 'outputs' / 'tiny-toy'})") + ".*",
        ),
        (
            "data-file",
            [*config, *model, "--dataset_name", "data/train.jsonl"],
            {},
            q(f"dataset_name data/train.jsonl {not_there} ({tmp_path / 'data' / 'train.jsonl'})") + ".*",
        ),
        (
            "seed-export",
            [*base, "--initial_experience", "no-export"],
            {},
            q("initial_experience no-export does not exist: give the folder or parquet file `exgrpo export` wrote"),
        ),
        (
            "hub-offline",
            [*config, *hub, *data],
            {**no_hub, "HF_HUB_OFFLINE": "1"},
            q(on_the_hub + "offline mode is on (HF_HUB_OFFLINE=1) with no copy in the local cache (") + ".*",
        ),
        (
            "hub-unreachable",
            [*config, *hub, *data],
            unreachable,
            q(on_the_hub + "the Hub (http://127.0.0.1:9) cannot be reached (") + ".+" + q(") with no copy") + ".*",
        ),
        (
            "offline-column",
            [*base, "--offline_solutions_column", "nosuch"],
            {},
            q(
                f"offline_solutions_column 'nosuch' is not a column of {toy_dir / 'train.jsonl'} "
                "(its columns: prompt, answer, digits)"
            ),
        ),
        (
            "kept-column",
            [*base, "--keep_columns", "level"],
            {},
            q(
                f"keep_columns lists 'level', which is not a column of {toy_dir / 'train.jsonl'} "
                "(its columns: prompt, answer, digits)"
            ),
        ),
        (
            "push-unreachable",
            [*base, "--push_to_hub", "--hub_model_id", "someorg/tiny-run"],
            {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"},
            q("push_to_hub: the Hub (http://127.0.0.1:9) cannot be reached (")
            + ".+"
            + q("): train without push_to_hub and upload the output folder later (huggingface-cli upload)"),
        ),
        (
            "push-offline",
            [*base, "--push_to_hub", "true", "--hub_model_id", "someorg/tiny-run"],
            {"HF_HUB_OFFLINE": "1"},
            q(
                "push_to_hub: offline mode is on (HF_HUB_OFFLINE=1), so nothing can be pushed: train without "
                "push_to_hub and upload the output folder later (huggingface-cli upload)"
            ),
        ),
        # packages this environment really lacks (vLLM's CPU build lives in its own; wandb is no dependency)
        *[
            (f"missing-{module}", [*base, *flags], {}, q(f"{what} needs {module}, which is not installed: ") + ".*")
            for module, flags, what in (
                ("vllm", ["--use_vllm", "true"], "use_vllm: true"),
                ("wandb", ["--report_to", "wandb"], "report_to: wandb"),
            )  # fmt: skip
            if importlib.util.find_spec(module) is None
        ],
    ]


def test_value_errors_are_refused_before_torch_is_imported(tmp_path, toy_dir):
    """Every kind of value a recipe or a flag can hold that cannot train (an ExGRPO setting out of range, from the
    command line or the recipe; a group size ExGRPO cannot replay in; a value outside its option's closed set, TRL's
    loss_type included; remove_clip with a loss type without a clip; a reward function that cannot be found; a local
    path, a file to seed the buffer from, a Hub id the machine cannot fetch) is one line naming the field, exit code
    2, before torch or TRL is imported."""
    for name, argv, env, line in _refusal_cases(tmp_path, toy_dir):
        start = time.perf_counter()
        command = [sys.executable, "-c", REFUSED, "train", *argv]
        run = subprocess.run(command, cwd=tmp_path, env={**ENV, **env}, capture_output=True, text=True, timeout=120)
        seconds = time.perf_counter() - start
        (error,) = run.stderr.splitlines() or [""]
        assert re.fullmatch("exgrpo train: error: " + line, error), (name, run.stderr[-2000:])
        assert run.stdout.strip() == "2 []", (name, run.stdout)  # exit code 2; neither torch nor TRL was imported
        assert seconds < 10, (name, seconds)
        print(f"{name}: {seconds:.2f}s")


def test_a_cached_hub_model_runs_offline_when_the_hub_cannot_be_reached(tmp_path, monkeypatch):
    """With the Hub unreachable, transformers retried it before reading a cached model (195 s for one step of the
    toy model at load 4-6): the check asks the Hub once, and with the model in the cache turns offline mode on for
    the run (huggingface_hub's flag, and the variable datasets reads when it is imported)."""
    from huggingface_hub import constants

    from exgrpo_trl.cli import precheck

    (tmp_path / "hub" / "models--someorg--cached" / "snapshots" / "abc").mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert precheck.hub_unreachable("http://127.0.0.1:9")  # nothing listens there
    assert "cannot be reached" in precheck.hub_problem("model_name_or_path", "someorg/missing", "model")
    assert constants.HF_HUB_OFFLINE is False
    assert precheck.hub_problem("model_name_or_path", "someorg/cached", "model") is None
    assert constants.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"


def test_the_console_command_trains_a_cached_hub_model_when_the_hub_cannot_be_reached(tmp_path, toy_dir):
    """The case the in-process test above stands for, as a user meets it: `exgrpo train` (the installed console
    command, a fresh process) with a model named by its Hub id that is in the local cache, and a Hub endpoint where
    nothing listens (offline mode not set). Before the check, transformers retried the Hub for 195 s before reading
    the cached copy (one step of the toy model, load 4-6): here the run must finish within 120 s, having trained."""
    import shutil

    repo = tmp_path / "hf-home" / "hub" / "models--someorg--tiny-toy"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(toy_dir, repo / "snapshots" / commit, ignore=shutil.ignore_patterns("*.jsonl"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**ENV, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}
    out = tmp_path / "out"
    command = [str(Path(sys.executable).with_name("exgrpo")), "train", "--config", str(TINY_RECIPE),
               "--model_name_or_path", "someorg/tiny-toy", "--dataset_name", str(toy_dir / "train.jsonl"),
               "--output_dir", str(out), "--max_steps", "2", "--save_strategy", "no"]  # fmt: skip
    start = time.perf_counter()
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    seconds = time.perf_counter() - start
    assert run.returncode == 0, run.stderr[-3000:]
    assert seconds < 120, seconds
    assert (out / "model.safetensors").is_file() and json.loads((out / "trainer_state.json").read_text())[
        "global_step"
    ] == 2
    print(f"cached Hub model, Hub unreachable: {seconds:.1f} s")


def test_closed_sets_are_the_values_trl_documents(tmp_path):
    """Each closed set `exgrpo train` checks before torch loads is exactly the set of values TRL 1.16 documents for
    the option (its help's quoted values, leaving out other options' names and `field="value"` examples): a value
    TRL accepts can never be refused here, nor one it rejects let through. TRL also takes `True` / `False` for
    scale_rewards (group / none), as YAML booleans in a recipe: those pass the check too."""
    from dataclasses import fields

    from trl import GRPOConfig

    from exgrpo_trl.cli import precheck
    from exgrpo_trl.cli.train import CLOSED_SETS

    helps = {f.name: f.metadata["help"] for f in fields(GRPOConfig)}
    for name, values in CLOSED_SETS.items():
        quoted = set(re.findall(r"(?<![=\w])[`']+(\w+)[`']+", helps[name])) - set(helps)
        assert quoted - {"True", "False"} == set(values), (name, sorted(quoted), sorted(values))
    assert {"True", "False"} <= set(re.findall(r"`(True|False)`", helps["scale_rewards"]))
    for value in ("true", "false"):
        recipe = tmp_path / f"{value}.yaml"
        recipe.write_text(TINY_RECIPE.read_text() + f"\nscale_rewards: {value}\n")
        argv = ["--config", str(recipe), "--model_name_or_path", str(ROOT), "--dataset_name", str(TINY_RECIPE)]
        assert precheck.check(argv) is None, value


def test_no_deprecation_warning_for_an_option_not_used():
    """TRL's default `gradient_checkpointing=True` made transformers warn (FutureWarning) on every config and every
    `exgrpo train`; the recipes now use the new name, and the old one still warns when it is set."""
    from exgrpo_trl import ExGRPOConfig
    from exgrpo_trl.cli.train import parse_args

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = ExGRPOConfig(output_dir="out", use_cpu=True, bf16=False)
        assert args.activation_checkpointing is True and args.gradient_checkpointing is True  # TRL's default kept
        _, args, _ = parse_args(["--config", str(TINY_RECIPE)])
        assert args.activation_checkpointing is False and args.gradient_checkpointing is False
        for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
            assert "\ngradient_checkpointing" not in recipe.read_text(), recipe.name
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):
        args = ExGRPOConfig(output_dir="out", use_cpu=True, bf16=False, gradient_checkpointing=False)
    assert args.activation_checkpointing is False


# ----------------------------------------------------------------------------------------------------- output_dir
def test_output_dir_that_is_a_file_fails_before_the_model_loads(toy_dir, tmp_path, capsys):
    (tmp_path / "model").mkdir()  # an empty folder: loading it would fail, with another message
    out = tmp_path / "out"
    out.write_text("not a folder")
    argv = _train_args(toy_dir, out, "--model_name_or_path", str(tmp_path / "model"))
    assert main(argv) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"exgrpo train: error: output_dir {out} is a file, not a folder; give a folder (--output_dir DIR) "
        "(--debug shows the traceback)"
    )


def _make_unwritable(path: Path) -> str:
    """Make `path` unwritable even for root (an immutable folder); returns how, or skips when it cannot."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return "chmod"
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("running as root where chattr +i does not work: no folder is unwritable")
    return "chattr"


def test_unwritable_output_dir_fails_before_the_model_loads(toy_dir, tmp_path, capsys):
    """It was found at the first checkpoint save (hours in, on a GPU)."""
    (tmp_path / "model").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    how = _make_unwritable(out)
    try:
        assert main(_train_args(toy_dir, out, "--model_name_or_path", str(tmp_path / "model"))) == 1
    finally:
        subprocess.run(["chattr", "-i", str(out)]) if how == "chattr" else out.chmod(0o755)
    line = capsys.readouterr().err.splitlines()[-1]
    assert line.startswith(f"exgrpo train: error: output_dir {out} is not a folder this process can write to (")
    assert line.endswith("); give another one (--output_dir DIR) (--debug shows the traceback)")


# ----------------------------------------------------------------------------------------------------- reward errors
def test_a_reward_function_that_raises_is_one_line(toy_dir, tmp_path, capsys):
    """It printed TRL's 50-line traceback; the line names the function and its exception, --debug shows the rest."""
    argv = _train_args(
        toy_dir, tmp_path / "out", "--max_steps", "1", "--reward_funcs", "tests.support.cli_rewards:broken_reward"
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "exgrpo train: error: reward function broken_reward raised KeyError: 'rows' (--debug shows the traceback)"
    )
    assert "Traceback" not in err
    from exgrpo_trl.cli.train import RewardFunctionError

    with pytest.raises(RewardFunctionError) as raised:
        main([*argv, "--debug"])
    assert isinstance(raised.value.__cause__, KeyError)  # the reward's own traceback, behind --debug


def test_reporting_errors_keeps_what_trl_reads():
    """TRL logs a reward under its __name__ and awaits the async ones: the wrapper keeps both."""
    import asyncio
    import inspect

    from exgrpo_trl.cli.train import reporting_errors

    async def judge(completions, **kwargs):
        return [1.0 for _ in completions]

    def plain(completions, **kwargs):
        return [0.5 for _ in completions]

    assert reporting_errors(plain).__name__ == "plain" and reporting_errors(plain)(["a"]) == [0.5]
    wrapped = reporting_errors(judge)
    assert wrapped.__name__ == "judge" and inspect.iscoroutinefunction(wrapped)
    assert asyncio.run(wrapped(["a", "b"])) == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_is_one_line_and_rerunning_resumes(toy_dir, tmp_path):
    """SIGINT during step 3 (the reward's third call): the step finishes, a checkpoint is saved at its end (it ends a
    generation batch, so the checkpoint resumes bitwise: the steps since the last save are not lost), and one line says
    where and how to go on, exit code 130, no traceback (it was 37 lines); rerunning the command does resume there."""
    out = tmp_path / "out"
    argv = [
        *_exgrpo(),
        *_train_args(toy_dir, out, "--max_steps", "4", "--save_steps", "100"),
        "--reward_funcs",
        "tests.support.cli_rewards:interrupting_reward",
    ]
    run = subprocess.run(
        argv, env={**ENV, "EXGRPO_TEST_INTERRUPT_AT": "3"}, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 130, run.stderr[-3000:]
    assert run.stderr.splitlines()[-1] == (
        f"exgrpo train: interrupted at step 3 of 4; rerun the same command to resume from the newest checkpoint, "
        f"{out / 'checkpoint-3'}"
    )
    assert "Traceback" not in run.stderr

    again = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Resuming from checkpoint {out / 'checkpoint-3'}" in again.stdout + again.stderr
    assert "exgrpo train: done at step 4." in again.stdout
    assert "Warning" not in again.stderr, again.stderr  # nothing about options the recipe does not use

    # the interrupted-and-resumed run ends bitwise where a run never interrupted ends
    from safetensors.torch import load_file

    straight = tmp_path / "straight"
    argv = [*_exgrpo(), *_train_args(toy_dir, straight, "--max_steps", "4", "--save_steps", "100")]
    subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300, check=True)
    resumed, never = load_file(out / "model.safetensors"), load_file(straight / "model.safetensors")
    assert resumed.keys() == never.keys() and all(resumed[k].equal(never[k]) for k in never)


def _as_a_terminal_starts_it() -> None:
    """In the child: Ctrl-C's default action, as a terminal's shell has it (a suite started in the background, with
    `&`, has SIGINT ignored, and an ignored signal is inherited: tee would survive it), and the pseudo-terminal as
    the controlling terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _in_a_terminal(script: str, cwd: Path, env: dict) -> tuple[int, str]:
    """Run the shell command line `script` as a terminal runs it: bash in a session of its own, a pseudo-terminal as
    its controlling terminal and its stdin, stdout and stderr; returns bash's exit status and what the terminal
    showed (its lines, carriage returns removed)."""
    master, slave = os.openpty()
    shell = subprocess.Popen(
        ["bash", "-c", script],
        cwd=cwd,
        env=env,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_as_a_terminal_starts_it,
    )
    os.close(slave)
    shown = bytearray()

    def read_the_terminal():
        with contextlib.suppress(OSError):  # EIO once the session has ended
            while chunk := os.read(master, 65536):
                shown.extend(chunk)

    reader = threading.Thread(target=read_the_terminal, daemon=True)
    reader.start()
    try:
        status = shell.wait(timeout=300)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
        reader.join(timeout=10)
        os.close(master)
    return status, shown.decode(errors="replace").replace("\r", "")


@pytest.mark.parametrize("redirect", ["2>&1", "2>err.log"])
def test_ctrl_c_through_tee_saves_the_step_and_says_where(toy_dir, tmp_path, redirect):
    """`exgrpo train ... 2>&1 | tee` in a terminal, Ctrl-C during step 3: the terminal sends SIGINT to the whole
    command line, tee dies, and the trainer's next write to the pipe ended the run (exit 1, no checkpoint of step 3,
    no message; with `2>err.log | tee`, the same). Now the step ends, its checkpoint is saved, the exit code is 130 and
    the resume line reaches the user: on the terminal (the pipe is gone), in stderr's file when it is one, and in
    --log_file. Then the same command resumes from that checkpoint. (The reward sends SIGINT to the process group at
    its third call and waits until tee has gone, so that the run writes to a pipe with no reader.)"""
    out = tmp_path / "out"
    argv = [*_exgrpo(), *_train_args(toy_dir, out, "--max_steps", "4", "--save_steps", "100", "--log_file", "run.log")]
    interrupted = [*argv, "--reward_funcs", "tests.support.cli_rewards:interrupting_reward"]
    script = f"trap true INT; {shlex.join(interrupted)} {redirect} | tee tee.log; echo ${{PIPESTATUS[0]}} > status"
    env = {**ENV, "EXGRPO_TEST_INTERRUPT_AT": "3", "EXGRPO_TEST_INTERRUPT_GROUP": "1"}
    _, terminal = _in_a_terminal(script, tmp_path, env)

    line = (
        f"exgrpo train: interrupted at step 3 of 4; rerun the same command to resume from the newest checkpoint, "
        f"{out / 'checkpoint-3'}"
    )
    assert (tmp_path / "status").read_text().split() == ["130"], terminal[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert terminal.splitlines()[-1] == line, terminal[-3000:]  # after what tee showed before it died
    assert (tmp_path / "run.log").read_text().splitlines()[-1] == line
    assert "'loss'" in (tmp_path / "run.log").read_text()  # the whole log, the training rows included
    if redirect == "2>err.log":
        assert (tmp_path / "err.log").read_text().splitlines()[-1] == line
    for text in (terminal, (tmp_path / "run.log").read_text()):
        assert "Broken pipe" not in text and "Traceback" not in text

    if redirect == "2>&1":  # the same command, this time not interrupted, goes on from checkpoint-3
        again = subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"Resuming from checkpoint {out / 'checkpoint-3'}" in again.stdout + again.stderr
        assert "exgrpo train: done at step 4." in again.stdout
        assert "Resuming from checkpoint" in (tmp_path / "run.log").read_text()  # appended to the same log


# ----------------------------------------------------------------------------------------------------- dependencies
HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {hidden!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
"""


def _without(hidden: set[str], code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where the packages `hidden` cannot be imported (as if not installed)."""
    script = HIDE.format(hidden=hidden) + code
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120
    )


def test_math_reward_without_math_verify_fails_at_once(tmp_path):
    """It scored every answer 0.0 (logged at debug level): a run would train for days against a zero reward."""
    code = (
        "from exgrpo_trl.tasks.rewards import math_reward\n"
        "try:\n"
        "    print(math_reward(['<think>ok</think> The answer is \\\\boxed{42}'], answer=['42']))\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    run = _without({"math_verify"}, code, tmp_path)
    assert run.stdout.splitlines() == [
        "ImportError: the math_verify reward needs math_verify, which is not installed: "
        "pip install 'math-verify[antlr4-13-2]'"
    ], run.stdout + run.stderr


def test_math_reward_scores_a_correct_answer():
    from exgrpo_trl.tasks.rewards import math_reward

    assert math_reward(["<think>ok</think> The answer is \\boxed{42}"], answer=["42"]) == [1.0]


@pytest.mark.parametrize(
    "hidden, argv, message",
    [
        (
            "matplotlib",
            ["inspect", "nowhere/checkpoint-1", "--plot=buffer.png"],
            "exgrpo inspect: error: exgrpo inspect --plot needs matplotlib, which is not installed: pip install "
            "'matplotlib' (or, in the repository's folder, pip install '.[demo]')",
        ),
        (
            "math_verify",
            ["eval", "--model", "nowhere", "--benchmarks", "math500"],
            "exgrpo eval: error: exgrpo eval needs math_verify, which is not installed: pip install "
            "'math-verify[antlr4-13-2]'",
        ),
        (
            "vllm",
            ["eval", "--model", "nowhere", "--benchmarks", "math500", "--backend", "vllm"],
            "exgrpo eval: error: exgrpo eval --backend vllm needs vllm, which is not installed: pip install "
            "'vllm' (or, in the repository's folder, pip install '.[vllm]')",
        ),
    ],
    ids=["inspect-plot", "eval", "eval-vllm"],
)
def test_a_missing_optional_package_stops_the_command_at_once(tmp_path, hidden, argv, message):
    """Checked before any work: a command that needs an optional package names it in one line, before it imports
    anything heavy or writes anything."""
    start = time.perf_counter()
    run = _without({hidden}, f"from exgrpo_trl.cli import main; sys.exit(main({argv!r}))", tmp_path)
    assert run.returncode == 1 and run.stderr.splitlines() == [message], run.stderr[-3000:]
    assert time.perf_counter() - start < 30 and not (tmp_path / "demo-out").exists()


# ----------------------------------------------------------------------------------------------------- CPU threads
@pytest.fixture
def two_threads(monkeypatch):
    """torch on 2 threads (its default on a 2-core machine), OMP_NUM_THREADS unset; restored afterwards."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield torch
    torch.set_num_threads(before)


def test_toy_warm_start_runs_on_one_thread(tmp_path, monkeypatch, two_threads):
    """On a busy 2-core machine 2 threads made the warm start 5-17 times slower (docs/performance.md); one thread
    unless OMP_NUM_THREADS or --threads says otherwise."""
    from exgrpo_trl.tasks import toy

    argv = [
        "--out",
        str(tmp_path / "toy"),
        "--warm-start-steps",
        "1",
        "--n-train",
        "8",
        "--n-eval",
        "4",
        "--no-progress",
    ]
    assert toy.main(argv) == 0 and two_threads.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert toy.main(argv) == 0 and two_threads.get_num_threads() == 2
    assert toy.main([*argv, "--threads", "1"]) == 0 and two_threads.get_num_threads() == 1


def test_demo_warm_start_runs_on_one_thread(tmp_path, monkeypatch, two_threads):
    """The demo's warm start runs in its own process before the two one-thread arms: one thread there too."""
    from types import SimpleNamespace

    from lab import demo, study

    seen = []

    class Stop(Exception):
        pass

    def load(*args):
        seen.append(two_threads.get_num_threads())
        raise Stop

    task = SimpleNamespace(
        name="countdown-weak",
        description="",
        steps=1,
        prompts_per_step=1,
        num_generations=8,
        learning_rate=1.0,
        eval_every=1,
        warm_start_steps=1,
        load=load,
    )
    monkeypatch.setattr(study, "build_tasks", lambda quick, overrides: {"countdown-weak": task})
    with pytest.raises(Stop):
        demo.main(["--out", str(tmp_path / "demo"), "--no-progress"])
    assert seen == [1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--use_vllm", "true"],
            "use_vllm: true needs vllm, which is not installed: pip install 'vllm' (or, in the repository's folder, "
            "pip install '.[vllm]')",
        ),
        (
            ["--deepspeed", str(ROOT / "tests" / "multiprocess" / "ds_zero3.json")],
            "deepspeed (a DeepSpeed config) needs deepspeed, which is not installed: pip install "
            "'deepspeed' (or, in the repository's folder, pip install '.[deepspeed]')",
        ),
        (
            ["--report_to", "wandb"],  # not installed in the test environment
            "report_to: wandb needs wandb, which is not installed: pip install wandb",
        ),
    ],
    ids=["vllm", "deepspeed", "wandb"],
)
def test_train_checks_the_packages_its_recipe_needs_first(tmp_path, monkeypatch, capsys, argv, message):
    """TRL finds a missing vLLM only after the model has loaded; the recipe says what the run will need, and `exgrpo
    train` checks it with the recipe's values, before the paths (./outputs/tiny-toy is not there). Here in a process
    that has torch loaded, each package made missing by hand; that the check runs before torch is imported is shown
    in a fresh process, with the packages this environment really lacks, by the `missing-*` cases of
    `test_value_errors_are_refused_before_torch_is_imported`."""
    from exgrpo_trl.utils import requirements

    monkeypatch.setattr(requirements, "missing", lambda module: module in ("vllm", "deepspeed"))
    assert main(["train", "--config", str(TINY_RECIPE), "--output_dir", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"exgrpo train: error: {message}"]
