"""Run by tests/multiprocess/test_resume_ranks.py under `accelerate launch --num_processes 2` (DDP over gloo, or
DeepSpeed ZeRO-3), never by pytest directly.

One launch, several trainers in turn (the trainer of tests/multiprocess/train_replay.py, on a small dataset so that
questions retire within the run and an epoch is a few steps):

1. ``straight``: trains MAX_STEPS steps uninterrupted, a checkpoint every SAVE_STEPS, all kept;
2. each scenario NAME:STEP resumes a new trainer, in OUT/NAME/out, from copies of the straight run's checkpoints, and
   trains to MAX_STEPS:

   - ``mid:STEP``: checkpoint-STEP alone, resumed from (named explicitly);
   - ``cut:STEP`` and ``missing:STEP``: checkpoint-(STEP - SAVE_STEPS) and checkpoint-STEP, whose
     ``rng_state_1.pth`` (rank 1's RNG state) is cut to half its size or deleted: what rank 1 killed while it writes
     it leaves. The checkpoint is chosen as `exgrpo train` chooses it (`resolve_checkpoint` on every rank, then the
     main process's choice on every rank).

Every rank writes OUT/rank{r}.json: per trainer, a digest of the final weights (gathered under ZeRO-3), the buffer's
state hash, the switches, the sampler's state, the latest figures, the log history without its timings; per
straight-run checkpoint, the sampler's state and the retired set saved in it; per scenario, the checkpoint chosen and
the warnings said.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from exgrpo_trl.checkpoints import resolve_checkpoint
from exgrpo_trl.cli.train import _same_on_every_rank
from exgrpo_trl.state_file import read_meta
from tests.multiprocess.train_replay import build, exit_now
from tests.support.recording import buffer_hash

TIMINGS = ("step_time",)  # a log field that measures time: two equal runs differ in it


def log_rows(log_history: list[dict]) -> list[dict]:
    """The training log rows without their timings and without the end-of-training summary row, which describes the
    process that trained last (its train_loss averages that process's steps only, its train_runtime too)."""
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in log_history if "train_runtime" not in row]


def weights_digest(trainer) -> str:
    """A hash of every parameter, byte for byte; under ZeRO-3 gathered first (a collective: every rank calls it)."""
    params = list(trainer.model.named_parameters())
    gathered = contextlib.nullcontext()
    if trainer.is_deepspeed_enabled:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None)
    h = hashlib.sha256()
    with gathered:
        for name, p in params:
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def summary(trainer) -> dict:
    state = trainer.exgrpo_state
    return {
        "global_step": trainer.state.global_step,
        "weights": weights_digest(trainer),
        "buffer": buffer_hash(state.buffer),
        "retired": sorted(state.buffer.retired),
        "switches": {"replay_active": state.replay_active, "generation_batches": state.clock},
        "sampler": state.sampler.state_dict(),
        "latest": dict(state.latest),
        "log_history": log_rows(trainer.state.log_history),
    }


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def prepare(out: Path, kind: str, step: int, save_steps: int, straight: Path) -> None:
    """The scenario's output folder (main process only): copies of the straight run's checkpoints, damaged."""
    target = out / kind / "out"
    shutil.rmtree(out / kind, ignore_errors=True)
    steps = [step] if kind == "mid" else [step - save_steps, step]
    for s in steps:
        shutil.copytree(straight / f"checkpoint-{s}", target / f"checkpoint-{s}")
    rng = target / f"checkpoint-{step}" / "rng_state_1.pth"
    if kind == "cut":
        os.truncate(rng, rng.stat().st_size // 2)
    elif kind == "missing":
        rng.unlink()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--expect", choices=["ddp", "zero3"], required=True)
    parser.add_argument("--questions", type=int, default=9)
    parser.add_argument("--always-every", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scenario", action="append", default=[], help="NAME:STEP (mid, cut, missing)")
    args = parser.parse_args()
    args.tools = args.vlm = args.offline = False  # what train_replay's build reads besides
    out = Path(args.out)

    straight = build(out / "straight", args, args.max_steps)
    acc = straight.accelerator
    assert acc.num_processes == 2, f"rank sees a world of {acc.num_processes}"
    assert straight.is_deepspeed_enabled == (args.expect == "zero3")
    straight.train()
    record: dict = {"straight": summary(straight), "checkpoints": {}}
    straight_out = out / "straight" / "out"
    for path in sorted(straight_out.glob("checkpoint-*")):
        trainer_state = read_meta(path)["trainer"]
        meta_buffer = read_meta(path)["buffer"]
        record["checkpoints"][path.name] = {
            "sampler": trainer_state["sampler"],
            "retired": sorted(meta_buffer["retired"]),
            "num_processes": trainer_state.get("num_processes"),
        }

    said = Said()
    logging.getLogger("exgrpo_trl").addHandler(said)
    for scenario in args.scenario:
        kind, step = scenario.split(":")
        if acc.is_main_process:
            prepare(out, kind, int(step), args.save_steps, straight_out)
        acc.wait_for_everyone()
        said.lines.clear()
        trainer = build(out / kind, args, args.max_steps)
        if kind == "mid":
            trainer.args.resume_from_checkpoint = str(out / kind / "out" / f"checkpoint-{step}")
        chosen = _same_on_every_rank(resolve_checkpoint(trainer.args))  # as `exgrpo train` chooses
        trainer.train(resume_from_checkpoint=chosen)
        record[scenario] = {
            "chosen": os.path.relpath(chosen, out) if chosen else None,
            "said": [line.replace(str(out), "OUT") for line in said.lines if "Skipping" in line],
            **summary(trainer),
        }

    with open(out / f"rank{acc.process_index}.json", "w") as f:
        json.dump(record, f)
    acc.wait_for_everyone()
    torch.distributed.destroy_process_group()
    exit_now()  # without the interpreter's teardown: see train_replay.exit_now


if __name__ == "__main__":
    sys.exit(main())
