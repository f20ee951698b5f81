"""Two real processes: `accelerate launch --num_processes 2` under DDP (gloo) and under DeepSpeed ZeRO-3, on CPU.

Each launch trains the tiny model with replay on and lowest-entropy trajectory selection
(tests/multiprocess/train_replay.py; with --tools, the calculator task of tests/support/tool_tasks.py, whose rollouts
call tools: DDP by default, ZeRO-3 slow), saves a checkpoint, resumes a second trainer from it, and calls the entropy
scoring directly with candidate counts that split unevenly over the two ranks. Every rank writes what it saw to a JSON
file; the tests compare them:

- each rank really is one of two (a previous configuration silently ran one process, or two worlds of one);
- one logical buffer: trajectories live on rank 0 only, the replay plan is identical on every rank, the retired set
  is the same everywhere, every trajectory of every rank reaches rank 0, and the checkpoint holds rank 0's buffer;
- the same forward passes on every rank at every step (entropy scoring included), so ZeRO-3 cannot hang; a launch
  that hangs or fails fails the test (subprocess timeout, the whole process group killed).

Why the accelerate configs look the way they do: see recipes/accelerate/cpu_ddp.yaml (the shipped CPU config, which
the DDP runs launch) and tests/multiprocess/zero3_cpu.yaml.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MP = ROOT / "tests" / "multiprocess"
LAUNCH_TIMEOUT_S = 300  # a healthy launch takes 20-40 s here; a hang fails the test instead of blocking the suite
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


class LaunchTimeout(AssertionError):
    pass


def launch(
    config: str, out: Path, *script_args: str, timeout: float = LAUNCH_TIMEOUT_S, script: str = "train_replay.py"
) -> list[dict]:
    """`accelerate launch` a script of this folder (default: the training script) on 2 processes; returns each rank's
    record, rank order."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "ACCELERATE_USE_CPU",
        "ACCELERATE_USE_DEEPSPEED",
    ):
        env.pop(var, None)  # leftovers of an enclosing launch must not leak into this one
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / config if "/" in config else MP / config), "--num_processes", "2",
        str(MP / script), "--out", str(out), *script_args,
    ]  # fmt: skip
    log = out / "launch.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise LaunchTimeout(f"launch still running after {timeout:.0f} s (a hang?); log: {log}") from None
        except BaseException:  # interrupted (Ctrl-C, pytest-timeout): leave nothing running
            _stop(proc)
            raise
    tail = log.read_text(errors="replace")[-6000:]
    assert rc == 0, f"launch failed (exit {rc}):\n{tail}"
    records = []
    for rank in range(2):
        path = out / f"rank{rank}.json"
        assert path.is_file(), f"rank {rank} wrote nothing:\n{tail}"
        records.append(json.loads(path.read_text()))
    return records


def _stop(proc: subprocess.Popen) -> None:
    """Stop a launch and every process it started. torchrun starts each rank in a session of its own, so killing
    the launcher's process group does not reach the ranks, and a SIGKILLed launcher leaves them running forever
    (hung in a collective): collect them first, SIGTERM the launcher (torchrun forwards it), then SIGKILL what is
    left, each by its PID."""
    import psutil

    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for rank in ranks:
        try:
            rank.kill()  # psutil checks the PID still names the same process
            rank.wait(timeout=10)
        except psutil.NoSuchProcess:
            pass


def accelerate_config(kind: str) -> str:
    """The accelerate config of 2 CPU processes under `kind`: "ddp" (the shipped one), or "zero3" (skipped without
    deepspeed)."""
    if kind == "zero3" and not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install deepspeed)")
    return "recipes/accelerate/cpu_ddp.yaml" if kind == "ddp" else "zero3_cpu.yaml"


def _launched(tmp_path_factory, kind: str, *extra: str):
    """A module's launch of the training script on 2 processes under `kind` (`accelerate_config`), with the
    uneven-scoring and resume checks and `extra` flags."""
    config = accelerate_config(kind)
    out = tmp_path_factory.mktemp("_".join([kind, *(flag.lstrip("-") for flag in extra)]))
    return out, launch(config, out, "--expect", kind, "--uneven", "--resume", *extra)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return _launched(tmp_path_factory, "ddp")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    return _launched(tmp_path_factory, "zero3")


@pytest.fixture(scope="module")
def ddp_tools_run(tmp_path_factory):
    return _launched(tmp_path_factory, "ddp", "--tools")


@pytest.fixture(scope="module")
def zero3_tools_run(tmp_path_factory):
    return _launched(tmp_path_factory, "zero3", "--tools")


@pytest.fixture(scope="module")
def ddp_offline_run(tmp_path_factory):
    return _launched(tmp_path_factory, "ddp", "--offline")


@pytest.fixture(scope="module")
def zero3_offline_run(tmp_path_factory):
    return _launched(tmp_path_factory, "zero3", "--offline")


@pytest.fixture(scope="module")
def ddp_vlm_run(tmp_path_factory):
    return _launched(tmp_path_factory, "ddp", "--vlm")


@pytest.fixture(scope="module")
def zero3_vlm_run(tmp_path_factory):
    return _launched(tmp_path_factory, "zero3", "--vlm")


# The *_tools runs train the calculator task of tests/support/tool_tasks.py, whose rollouts call tools through TRL's
# tool loop:
# ranks run different numbers of tool turns (each as many as its own rows need). ZeRO-3 with tools: ~110 s, slow.
RUNS = ["ddp_run", "zero3_run", "ddp_tools_run", pytest.param("zero3_tools_run", marks=pytest.mark.slow),
        "ddp_offline_run", pytest.param("zero3_offline_run", marks=pytest.mark.slow)]  # fmt: skip


@pytest.fixture(params=RUNS)
def run(request):
    return request.getfixturevalue(request.param)


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_each_rank_sees_a_world_of_two(run, request):
    _, ranks = run
    assert [r["world"]["process_index"] for r in ranks] == [0, 1]
    assert [r["world"]["is_main_process"] for r in ranks] == [True, False]
    for r in ranks:
        world = r["world"]
        assert world["num_processes"] == 2 and world["backend"] == "gloo", world
        if request.node.callspec.params["run"].startswith("zero3"):
            assert world["distributed_type"] == "DistributedType.DEEPSPEED", world
            assert world["engine"] == "DeepSpeedEngine" and world["zero_stage"] == 3, world
        else:
            assert world["distributed_type"] == "DistributedType.MULTI_CPU", world
            assert world["engine"] == "DistributedDataParallel", world
        assert r["global_step"] == 8


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_replay_plan_is_identical_on_every_rank(run, request):
    _, (r0, r1) = run
    assert r0["plans"] == r1["plans"]
    plans = [p["plan"] for p in r0["plans"]]
    assert len(plans) == 4 and plans[0] is None  # 8 steps, a generation batch every 2; the buffer starts empty
    # (the calculator task's buffer holds 2-3 questions at first: a plan may repeat the previous one)
    distinct = 2 if request.node.callspec.params["run"].endswith("tools_run") else 3
    assert all(plans[1:]) and len(set(plans[1:])) == distinct, plans
    assert all(p["num_replayed"] == 2 for p in r0["plans"][1:])  # floor(0.7 * 3 groups)
    assert r0["resumed"]["plans"] == r1["resumed"]["plans"] and r0["resumed"]["plans"][0]["plan"]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_same_forward_passes_on_every_rank(run):
    _, (r0, r1) = run
    assert r0["steps"] == r1["steps"] and len(r0["steps"]) == 8
    assert r0["resumed"]["steps"] == r1["resumed"]["steps"]
    # entropy scoring ran (sharded over the ranks) and took the same forward passes on each
    assert r0["scoring"] == r1["scoring"]
    assert sum(s["scoring_forwards"] for s in r0["steps"]) == sum(s["forwards"] for s in r0["scoring"][:3]) > 0
    assert all(len(s["entropies"]) == s["candidates"] for s in r0["scoring"])


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_uneven_candidates_do_not_hang(run):
    """1, 3 and 2B+1 candidates (B = the scoring chunk, 6 rows) over 2 ranks: one rank's share is larger. Shares
    are padded to the same number of rows, so both ranks run 1, 1 and 2 forward passes, and the sharded result
    equals scoring every candidate on one rank. (Under ZeRO-3 an unpadded 2B+1 split hangs: see the slow test.)"""
    _, (r0, r1) = run
    assert r0["uneven"] == r1["uneven"]
    assert [u["candidates"] for u in r0["uneven"]] == [1, 3, 13]
    assert [u["forwards"] for u in r0["uneven"]] == [1, 1, 2]
    for u in r0["uneven"]:
        assert len(u["sharded"]) == u["candidates"] and u["max_abs_diff"] < 1e-5, u


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_one_logical_buffer_on_the_main_process(run):
    _, (r0, r1) = run
    b0, b1 = r0["buffer"], r1["buffer"]
    assert b0["trajectories"] > 0 and b0["tokens"] > 0 and b0["questions"] > 0
    assert (b1["questions"], b1["trajectories"], b1["tokens"]) == (0, 0, 0)  # host memory does not grow with ranks
    assert b0["retired"] and b0["retired_hash"] == b1["retired_hash"]  # the sampler's view agrees everywhere
    assert r0["exgrpo_state"] == r1["exgrpo_state"]

    # Every trajectory a rank handed over reached rank 0 (unless its question retired since), and rank 0 stores
    # nothing else. Rank 1 holds part of the batch, including part of a group that spans both ranks.
    stored = {key: {tuple(ids) for ids in trajectories} for key, trajectories in b0["stored"].items()}
    handed = {0: set(), 1: set()}
    for rank, record in enumerate((r0, r1)):
        for flush in record["flushes"]:
            handed[rank] |= {(key, tuple(ids)) for key, ids in flush["trajectories"]}
    for rank in (0, 1):
        missing = {(k, ids) for k, ids in handed[rank] if k in stored and ids not in stored[k]}
        assert not missing, (rank, missing)
    assert {(k, ids) for k, all_ids in stored.items() for ids in all_ids} <= handed[0] | handed[1]
    assert any(k in stored and ids in stored[k] for k, ids in handed[1]), "nothing of rank 1 reached the buffer"
    assert all(k not in stored for k in b0["retired"])


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_checkpoint_holds_rank0_buffer_and_resume_restores_it_on_every_rank(run):
    from exgrpo_trl.buffer import ExperienceBuffer
    from exgrpo_trl.state_file import load_state
    from tests.support.recording import buffer_hash, retired_hash

    out, (r0, r1) = run
    saved = ExperienceBuffer(8)
    trainer_state = load_state(out / "out" / "checkpoint-8", saved)
    assert buffer_hash(saved) == r0["buffer"]["state_hash"]
    assert retired_hash(saved) == r1["buffer"]["retired_hash"]
    assert trainer_state["replay_active"] and trainer_state["generation_batches"] == 4
    # resume: rank 0 gets the whole buffer back, rank 1 the retired set only; then training goes on in step
    a0, a1 = r0["resumed"]["after_load"], r1["resumed"]["after_load"]
    assert a0["state_hash"] == r0["buffer"]["state_hash"]
    assert a1["questions"] == 0 and a1["retired_hash"] == r0["buffer"]["retired_hash"]
    assert a0["exgrpo_state"] == a1["exgrpo_state"] == r0["exgrpo_state"]
    assert r0["resumed"]["global_step"] == r1["resumed"]["global_step"] == 10
    assert r1["resumed"]["buffer"]["trajectories"] == 0 < r0["resumed"]["buffer"]["trajectories"]


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("tools_run", ["ddp_tools_run", pytest.param("zero3_tools_run", marks=pytest.mark.slow)])
def test_tool_trajectories_reach_the_buffer_with_their_masks(tools_run, request):
    """Every success of the calculator task went through a tool: the buffer rank 0 holds only multi-turn
    trajectories, with their model masks, and the checkpoint keeps them (state format 2)."""
    from exgrpo_trl.state_file import read_meta

    out, (r0, r1) = request.getfixturevalue(tools_run)
    assert r0["masked_trajectories"] == r0["buffer"]["trajectories"] > 0 and r1["masked_trajectories"] == 0
    assert read_meta(out / "out" / "checkpoint-8")["format_version"] == 2


@pytest.mark.parametrize("offline_run", ["ddp_offline_run", pytest.param("zero3_offline_run", marks=pytest.mark.slow)])
def test_offline_rows_on_both_ranks_and_one_guide_state(offline_run, request):
    """Offline guidance over two ranks: a fresh group's first row gets its solution on whichever rank holds it (group
    g's first row is global row 8g; rank 0 holds rows 0-11 of each generation batch, rank 1 rows 12-23; once replay
    has stored questions, groups 1 and 2 are replayed and only group 0 is fresh), and every rank ends with the same
    rejected solutions and solved questions: the same decisions everywhere."""
    out, (r0, r1) = request.getfixturevalue(offline_run)
    rows0, rows1 = r0["offline_rows"], r1["offline_rows"]
    assert all(g % 8 == 0 and g < 12 for batch in rows0 for g in batch)
    assert all(g % 8 == 0 and 12 <= g < 24 for batch in rows1 for g in batch)
    assert any(rows0) and any(rows1)
    assert r0["offline_state"] == r1["offline_state"] and r0["offline_state"]["rejected"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.timeout(300)
def test_negative_control_unpadded_shares_hang_under_zero3(tmp_path):
    """The harness catches a hang: scoring 2B+1 candidates in unpadded shares (2 forward passes on rank 0, 1 on
    rank 1) never finishes under ZeRO-3, and the launch is killed at its timeout."""
    with pytest.raises(LaunchTimeout):
        launch(
            "zero3_cpu.yaml",
            tmp_path,
            "--expect",
            "zero3",
            "--uneven",
            "--break-padding",
            "--max-steps",
            "2",
            "--save-steps",
            "100",
            timeout=90,
        )


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
@pytest.mark.parametrize("vlm_run", ["ddp_vlm_run", "zero3_vlm_run"])
def test_image_questions_replay_in_step_on_every_rank(vlm_run, request):
    """The tiny Qwen2-VL on image questions over 2 processes: the same plans (image questions, their stored rows) and
    the same forward passes on every rank, entropy scoring with images sharded evenly, one buffer on the main process
    (keys that hold the images), and a resume that gives rank 0 the whole buffer back, images included."""
    from exgrpo_trl.buffer import ExperienceBuffer, row_key
    from exgrpo_trl.state_file import load_state
    from tests.support.recording import buffer_hash

    out, (r0, r1) = request.getfixturevalue(vlm_run)
    assert [r["world"]["num_processes"] for r in (r0, r1)] == [2, 2] and r0["global_step"] == 8
    assert r0["plans"] == r1["plans"] and any(p["plan"] for p in r0["plans"])
    assert r0["steps"] == r1["steps"] and r0["scoring"] == r1["scoring"]
    assert [u["forwards"] for u in r0["uneven"]] == [1, 1, 2] and all(u["max_abs_diff"] < 1e-5 for u in r0["uneven"])
    assert r0["buffer"]["trajectories"] > 0 and r1["buffer"]["trajectories"] == 0
    saved = ExperienceBuffer(8)
    load_state(out / "out" / "checkpoint-8", saved)
    assert buffer_hash(saved) == r0["buffer"]["state_hash"]  # images and all, as rank 0 held it
    assert all(row_key(e.row) == key and e.row["image"] is not None for key, e in saved.questions.items())
    assert r0["resumed"]["after_load"]["state_hash"] == r0["buffer"]["state_hash"]
    assert r0["resumed"]["plans"] == r1["resumed"]["plans"] and r0["resumed"]["steps"] == r1["resumed"]["steps"]
