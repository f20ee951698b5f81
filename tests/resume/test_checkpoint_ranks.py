"""What "complete" means for a checkpoint written by several processes (issue 51), on checkpoint folders made by hand.

Each rank writes files of its own: its RNG state (``rng_state_{rank}.pth``; one process writes ``rng_state.pth``)
and, under DeepSpeed, its partitions in ``global_step*/``. A checkpoint is complete only when each of them is there
and readable, for every rank of the run that wrote it: as many as its ExGRPO state records, or as its files name.
Fast: no training, files of a few bytes written by torch.save, safetensors and state.save_state.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from exgrpo_trl.buffer import ExperienceBuffer
from exgrpo_trl.checkpoints import (
    checkpoint_problems,
    find_resumable_checkpoint,
    resolve_checkpoint,
    rotate_checkpoints,
    writer_world_size,
)
from exgrpo_trl.cli.train import parse_args
from exgrpo_trl.state_file import save_state
from tests.helpers import TINY_RECIPE

TAG = "global_step4"


def make_checkpoint(path: Path, world: int, *, deepspeed: bool = False, record: bool = True) -> Path:
    """A complete checkpoint as `world` processes write it (DeepSpeed ZeRO-3's layout with `deepspeed`), its ExGRPO
    state recording `world` (none without `record`: a plain GRPO checkpoint, or one of an older version)."""
    path.mkdir(parents=True)
    if record:
        save_state(path, ExperienceBuffer(8), {"replay_active": True, "generation_batches": 2, "num_processes": world})
    if deepspeed:
        (path / "latest").write_text(TAG)
        (path / TAG).mkdir()
        for rank in range(world):
            for kind in ("model", "optim"):
                torch.save({"rank": rank}, path / TAG / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
    else:
        save_file({"w": np.zeros(2, np.float32)}, str(path / "model.safetensors"))
        torch.save({"state": {}}, path / "optimizer.pt")
    torch.save({}, path / "scheduler.pt")
    names = ["rng_state.pth"] if world == 1 else [f"rng_state_{rank}.pth" for rank in range(world)]
    for name in names:
        torch.save({"cpu": torch.random.get_rng_state()}, path / name)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    return path


def cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def empty(path: Path) -> None:
    os.truncate(path, 0)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("deepspeed", [False, True])
@pytest.mark.parametrize("record", [True, False])
def test_complete_checkpoints_of_any_world(tmp_path, world, deepspeed, record):
    checkpoint = make_checkpoint(tmp_path / "checkpoint-4", world, deepspeed=deepspeed, record=record)
    assert checkpoint_problems(checkpoint) == []
    assert writer_world_size(checkpoint, world if record else None) == world


RNG_1 = "rng_state_1.pth"
DAMAGED = {
    # what rank 1 killed while it writes its RNG state leaves: the file cut short, or nothing written yet
    "rng cut": (2, lambda c: cut(c / RNG_1), ["rng_state_1.pth is truncated or not a torch file"]),
    "rng empty": (2, lambda c: empty(c / RNG_1), ["rng_state_1.pth is empty"]),
    "rng missing": (2, lambda c: (c / RNG_1).unlink(), ["no rng_state_1.pth (rank 1 of 2)"]),
    "two of four missing, one cut": (
        4,
        lambda c: [(c / "rng_state_1.pth").unlink(), (c / "rng_state_3.pth").unlink(), cut(c / "rng_state_2.pth")],
        ["no rng_state_{rank}.pth of ranks 1, 3 (of 4)", "rng_state_2.pth is truncated or not a torch file"],
    ),
    "one process, rng cut": (
        1,
        lambda c: cut(c / "rng_state.pth"),
        ["rng_state.pth is truncated or not a torch file"],
    ),
    "one process, rng missing": (1, lambda c: (c / "rng_state.pth").unlink(), ["no rng_state.pth"]),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_rank_file_cut_or_missing_makes_it_incomplete(tmp_path, case):
    world, damage, problems = DAMAGED[case]
    checkpoint = make_checkpoint(tmp_path / "checkpoint-4", world)
    damage(checkpoint)
    assert checkpoint_problems(checkpoint) == problems
    assert checkpoint_problems(checkpoint, need_optimizer=False) == []  # save_only_model: no RNG states written


PARTITION = f"{TAG}/zero_pp_rank_1_mp_rank_00_optim_states.pt"
DEEPSPEED_DAMAGED = {
    "partition cut": (lambda c: cut(c / PARTITION), [f"{PARTITION} is truncated or not a torch file"]),
    "partition empty": (lambda c: empty(c / PARTITION), [f"{PARTITION} is empty"]),
    "partition missing": (lambda c: (c / PARTITION).unlink(), [f"no {PARTITION} (rank 1 of 2)"]),
    "no latest": (lambda c: (c / "latest").unlink(), ["no latest (DeepSpeed's tag file)"]),
    "latest names nothing": (
        lambda c: (c / "latest").write_text("global_step8"),
        ["latest names 'global_step8', which is no folder of the checkpoint"],
    ),
    "partition and rng": (
        lambda c: [(c / PARTITION).unlink(), empty(c / RNG_1)],
        [f"no {PARTITION} (rank 1 of 2)", "rng_state_1.pth is empty"],
    ),
}


@pytest.mark.parametrize("case", list(DEEPSPEED_DAMAGED))
def test_zero3_partitions_of_every_rank(tmp_path, case):
    damage, problems = DEEPSPEED_DAMAGED[case]
    checkpoint = make_checkpoint(tmp_path / "checkpoint-4", 2, deepspeed=True)
    damage(checkpoint)
    assert checkpoint_problems(checkpoint) == problems


def test_the_world_size_without_a_record_comes_from_the_files(tmp_path):
    """A checkpoint whose ExGRPO state records no world size (plain GRPO, older versions): the ranks its files name.
    Rank 0's RNG file alone says several processes wrote it (one process writes rng_state.pth): 2 at least."""
    plain = make_checkpoint(tmp_path / "plain", 2, record=False)
    (plain / RNG_1).unlink()
    assert writer_world_size(plain) == 2
    assert checkpoint_problems(plain) == ["no rng_state_1.pth (rank 1 of 2)"]
    zero = make_checkpoint(tmp_path / "zero", 3, deepspeed=True, record=False)
    for rank in (1, 2):
        (zero / f"rng_state_{rank}.pth").unlink()
    assert writer_world_size(zero) == 3  # the partitions name 3 ranks
    assert checkpoint_problems(zero) == ["no rng_state_{rank}.pth of ranks 1-2 (of 3)"]
    # the record wins over the files: 4 processes, the last one's files all missing
    recorded = make_checkpoint(tmp_path / "recorded", 4)
    (recorded / "rng_state_3.pth").unlink()
    assert writer_world_size(recorded, 4) == 4 and checkpoint_problems(recorded) == [
        "no rng_state_3.pth (rank 3 of 4)"
    ]


def test_skipped_with_the_one_process_warning_and_rotated_first(tmp_path, caplog):
    """`exgrpo train` skips a checkpoint rank 1 left half-written, with the warning a one-process run gives, and
    resumes from the one before; rotation deletes it first."""
    out = tmp_path / "out"
    make_checkpoint(out / "checkpoint-2", 2)
    make_checkpoint(out / "checkpoint-4", 2)
    cut(out / "checkpoint-4" / RNG_1)
    _, args, _ = parse_args(["--config", str(TINY_RECIPE), "--output_dir", str(out)])
    with caplog.at_level(logging.WARNING, logger="exgrpo_trl.checkpoints"):
        assert resolve_checkpoint(args) == str(out / "checkpoint-2")
    assert [r.getMessage() for r in caplog.records] == [
        f"Skipping {out / 'checkpoint-4'}: incomplete (rng_state_1.pth is truncated or not a torch file), a save "
        "that was interrupted?"
    ]
    make_checkpoint(out / "checkpoint-6", 2)
    assert rotate_checkpoints(out, 2, keep=[out / "checkpoint-6"]) == [str(out / "checkpoint-4")]
    assert find_resumable_checkpoint(out) == (str(out / "checkpoint-6"), [])
