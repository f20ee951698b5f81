"""`exgrpo train` on two CPU processes as a user launches it, and resumed inside an epoch by launching the same
command again: every process fresh (no trainer, accelerate or DeepSpeed state carried over from the first run), the
checkpoint chosen by the command itself.

The data: 12 addition questions; 2 ranks x 8 rows x 2 micro-batches = 32 rows, 4 questions of K = 8, per generation
batch of 2 optimizer steps, so an epoch is 3 generation batches (6 steps). The reward (tests/support/cli_rewards.py:
short_or_always_reward) solves about half of an untrained model's completions, and every completion of the questions
whose prompt starts with "1", which retire the first time they are trained fresh; the sampler skips them from the next
epoch. Launch 1 trains 12 steps straight with a checkpoint every 2; launch 2 starts in another folder holding only a
copy of launch 1's checkpoint-10 (step 4 of the second epoch, after retirements) and trains to step 12. It must end
where launch 1 ended: the same final model bytes and the same ExGRPO state in checkpoint-12; and each launch must exit
0 (under ZeRO-3 a rank used to abort in the interpreter's teardown after a complete run in about 1 launch in 5).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exgrpo_trl.state_file import STATE_DIRNAME, read_meta
from tests.helpers import TINY_RECIPE
from tests.multiprocess.test_multiprocess import LAUNCH_TIMEOUT_S, MP, ROOT, _stop, accelerate_config

QUESTIONS = [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (15, 2), (5, 5), (6, 7), (12, 9), (8, 8), (2, 9), (17, 1),
                                       (4, 4), (9, 3), (7, 6)]]  # fmt: skip


def write_data(path: Path) -> Path:
    with open(path, "w") as f:
        for prompt in QUESTIONS:
            a, b = map(int, prompt[:-1].split("+"))
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b), "digits": 1}) + "\n")
    return path


def launch_train(config: str, out: Path, model: Path, data: Path, log: Path) -> tuple[int, float, str]:
    """`accelerate launch ... -m exgrpo_trl.cli.train` (2 processes): exit code, seconds, the log's tail."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}  # fmt: skip
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / config if "/" in config else MP / config), "--num_processes", "2",
        "-m", "exgrpo_trl.cli.train", "--config", str(TINY_RECIPE), "--model_name_or_path", str(model),
        "--dataset_name", str(data), "--output_dir", str(out), "--reward_funcs",
        "tests.support.cli_rewards:short_or_always_reward", "--per_device_train_batch_size", "8",
        "--generation_batch_size", "32", "--max_steps", "12", "--save_steps", "2", "--save_total_limit", "10",
        "--logging_steps", "1", "--use_cpu", "true",
    ]  # fmt: skip
    start = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except BaseException:
            _stop(proc)
            raise
    return code, time.perf_counter() - start, log.read_text(errors="replace")[-6000:]


@functools.cache
def final_weights(out: Path, kind: str) -> dict:
    """The final model's tensors: model.safetensors under DDP; under ZeRO-3 (whose test config gathers no 16-bit
    model at save) DeepSpeed's partitions of the last step, consolidated."""
    if kind == "ddp":
        from safetensors.torch import load_file

        return load_file(out / "model.safetensors")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(out)))


def logged(out: Path) -> list[dict]:
    rows = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in row.items() if k != "step_time"} for row in rows if "loss" in row]


def state_bytes(checkpoint: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((checkpoint / STATE_DIRNAME).iterdir())}


@pytest.mark.parametrize("kind", ["ddp", pytest.param("zero3", marks=pytest.mark.slow)])
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_exgrpo_train_resumed_by_a_fresh_launch_ends_as_the_straight_run(tmp_path, small_toy_dir, kind):
    config = accelerate_config(kind)
    data = write_data(tmp_path / "questions.jsonl")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, seconds, tail = launch_train(config, straight, small_toy_dir, data, tmp_path / "straight.log")
    assert code == 0, tail
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (10, 12, 2, 4, 6, 8)]
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-10", resumed / "checkpoint-10")
    code, seconds_resumed, tail = launch_train(config, resumed, small_toy_dir, data, tmp_path / "resumed.log")
    assert code == 0, tail
    assert f"Resuming from checkpoint {resumed / 'checkpoint-10'}" in (tmp_path / "resumed.log").read_text()
    assert "exgrpo train: done at step 12." in tail
    for log in ("straight.log", "resumed.log"):  # the CPU recipe turns off DDP's search for unused parameters
        assert "find_unused_parameters=True was specified" not in (tmp_path / log).read_text(), log
    # the epoch the resume landed in skipped the questions retired before it, as the straight run's did
    retired = read_meta(straight / "checkpoint-10")["buffer"]["retired"]
    assert retired, "no question retired before checkpoint-10: the case is not the one this test is about"
    assert final_weights(resumed, kind).keys() == final_weights(straight, kind).keys()
    for name, tensor in final_weights(resumed, kind).items():
        assert torch.equal(tensor, final_weights(straight, kind)[name]), name
    assert state_bytes(resumed / "checkpoint-12") == state_bytes(straight / "checkpoint-12")
    assert logged(resumed)[-2:] == logged(straight)[-2:]  # steps 11 and 12, as logged
    print(f"{kind}: straight launch {seconds:.0f} s, resumed launch {seconds_resumed:.0f} s")
