"""Host memory and speed of the experience buffer at the paper's end-of-run size.

    python benchmarks/buffer_memory.py                      # 200,000 trajectories x 1,500 tokens (~1.8 GB of data)
    python benchmarks/buffer_memory.py --trajectories 20000 # a quicker look

Fills an ExperienceBuffer through `update_group` (the trainer's path) with 200,000 trajectories of 1,500 tokens
spread over questions of 1 to 7 trajectories each (the reference run ended with 202,011 trajectories, about 1.77
GB of host memory), then prints:

- resident memory (RSS) before and after, and bytes per stored token: measured (RSS growth / tokens, everything the
  buffer holds included: rows, buckets, per-trajectory objects) and the token data alone (int32 id + float16
  log-prob); the per-trajectory constant is what the RSS growth adds above the token data;
- time to build one step's replay plan for 64 questions on the main process, median wall and CPU time:
  `choose_questions(64)` alone; the trainer's own plan functions (`exgrpo_trl.draw`: draw the questions, shortlist
  the candidate trajectories of each that are broadcast to the ranks, pick one per question, build the plan; the
  entropy forward pass, which runs on the accelerator, stubbed), with every stored trajectory a candidate unless
  ``--max-candidates``; and the same with the broadcast's pickling and unpickling of the drawn questions;
- checkpoint save and load time (`save_state` / `load_state`, safetensors + JSON, CRC-checked; each repeated, the
  loads in fresh processes as on resume), the file sizes, the loaded buffer's resident memory, and what a non-main
  rank loads on resume (the retired set only);
- a machine reference: how long touching as many bytes of fresh memory in a new process and writing them to a file
  take here (on a shared VM both vary several-fold from run to run; they bound what save and load can do).

Targets: <= 6 bytes per stored token (plus a constant per trajectory), <= 10 ms per plan, <= 10 s save + load.
The buffer is released before the checkpoint is loaded back, and neither save nor load concatenates the data in
memory, so about one copy of the data is resident at a time: ~2 GB of RAM and ~1.8 GB of disk at the default size.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exgrpo_trl.buffer import ExperienceBuffer, Trajectory
from exgrpo_trl.draw import choose_questions, draw_questions, select_lowest
from exgrpo_trl.replay import ReplayPlan
from exgrpo_trl.settings import ExGRPOSettings
from exgrpo_trl.state_file import ARRAYS_FILENAME, load_state, save_state

TARGET_BYTES_PER_TOKEN = 6.0
TARGET_PLAN_MS = 10.0
TARGET_SAVE_LOAD_S = 10.0


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def peak_rss_bytes() -> int:
    """VmHWM: this process's peak resident memory (ru_maxrss would carry the parent's peak over into a child)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def fill(buffer: ExperienceBuffer, num_trajectories: int, length: int, seed: int, vocab: int = 151_000) -> int:
    """Add `num_trajectories` trajectories of `length` tokens, 1-7 per question, through update_group. Each
    trajectory owns its arrays (as in training, where they come from Python lists), none is a view of another."""
    rng = np.random.default_rng(seed)
    pool_ids = rng.integers(0, vocab, size=length * 64, dtype=np.int32)  # sliced at random offsets: distinct data
    pool_logps = (-rng.exponential(0.5, size=length * 64)).astype(np.float16)
    k_gen = buffer.num_generations
    added = question = 0
    step = 0
    while added < num_trajectories:
        n = min(int(rng.integers(1, k_gen)), num_trajectories - added)
        trajectories = []
        for j in range(n):
            start = int(rng.integers(0, pool_ids.size - length))
            ids = pool_ids[start : start + length].copy()
            ids[0] = j  # distinct within the question: de-duplication keeps them all
            trajectories.append(Trajectory(ids, pool_logps[start : start + length].copy(), step))
        row = {"prompt": f"Question {question}: " + "x" * 300, "answer": str(question)}
        stored = buffer.update_group(f"q{question:07d}", int(rng.integers(1, k_gen)), row, trajectories)
        assert stored == n
        added += n
        question += 1
        if question % 256 == 0:
            step += 1
    for q in range(question // 50):  # and a retired set (2% of the questions seen)
        buffer.retire(f"retired-{q}")
    return question


def plan_fn(buffer: ExperienceBuffer, n: int, broadcast_pickle: bool, max_candidates: int | None):
    """The main process's share of one replay plan, through the functions `ExGRPORun._plan` calls
    (`exgrpo_trl.replay`): draw n questions and shortlist their candidates, pick one per question, build the plan,
    for a generation batch of 2n groups (rho = 0.5). The entropy forward pass, which runs on the accelerator, is
    replaced by zeros. With `broadcast_pickle` the drawn questions are pickled and unpickled, as torch's
    broadcast_object_list does on the sending and receiving ranks."""

    settings = ExGRPOSettings(max_trajectory_candidates=max_candidates)

    def make():
        drawn = draw_questions(buffer, settings, 2 * n, 0)
        if broadcast_pickle:
            drawn = pickle.loads(pickle.dumps([drawn]))[0]
        chosen = [select_lowest(torch.zeros(len(q.candidates))) for q in drawn]
        plan = ReplayPlan.build(drawn, chosen, 2 * n, clock=0)
        assert len(plan.keys) == n
        return plan

    return make


def _secs(times: list[float]) -> str:
    return f"median {statistics.median(times):.2f} s (" + ", ".join(f"{t:.2f}" for t in times) + ")"


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """Median wall time, max wall time and median CPU time of `fn`, in ms. On a shared machine the CPU time is the
    fairer figure: wall time also counts the time the process waited for a core."""
    fn()  # warm up
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(wall) * 1e3, max(wall) * 1e3, statistics.median(cpu) * 1e3


def load_only(checkpoint: str, num_generations: int) -> None:
    """Child process: load the checkpoint, print JSON (time, RSS growth, a summary to compare) on the last line."""
    gc.collect()
    base = rss_bytes()
    restored = ExperienceBuffer(num_generations)
    t = time.perf_counter()
    load_state(checkpoint, restored)
    load_s = time.perf_counter() - t
    gc.collect()
    growth = rss_bytes() - base
    summary = {
        "questions": restored.num_questions,
        "trajectories": restored.num_trajectories,
        "tokens": restored.num_tokens,
        "buckets": restored.bucket_counts(),
        "retired": len(restored.retired),
    }
    step = max(1, restored.num_questions // 50)
    probe = {
        key: [hashlib.sha256(t.completion_ids.tobytes() + t.logps.tobytes()).hexdigest() for t in e.trajectories]
        for key, e in list(restored.questions.items())[::step]
    }
    other = ExperienceBuffer(num_generations)
    before = rss_bytes()
    t = time.perf_counter()
    load_state(checkpoint, other, with_trajectories=False)
    other_s = time.perf_counter() - t
    gc.collect()
    print(
        json.dumps(
            {
                "load_s": load_s,
                "growth": growth,
                "peak": peak_rss_bytes(),
                "summary": summary,
                "probe": probe,
                "other_s": other_s,
                "other_growth": rss_bytes() - before,
                "other_retired": len(other.retired),
                "other_trajectories": other.num_trajectories,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=200_000)
    parser.add_argument("--length", type=int, default=1_500, help="tokens per trajectory")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--plan-questions", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50, help="plans timed (median reported)")
    parser.add_argument(
        "--max-candidates",
        type=int,
        default=None,
        help="max_trajectory_candidates (default: every stored trajectory, the paper's rule and the "
        "costliest; the library's default is 4)",
    )
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary folder, removed after)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--io-repeats", type=int, default=3, help="checkpoint saves and loads timed (median reported)")
    parser.add_argument("--no-reference", action="store_true", help="skip the machine's memory and disk reference")
    parser.add_argument("--load-only", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.load_only:
        load_only(args.load_only, args.num_generations)
        return 0

    gc.collect()
    base = rss_bytes()
    buffer = ExperienceBuffer(args.num_generations, seed=args.seed)
    t = time.perf_counter()
    questions = fill(buffer, args.trajectories, args.length, args.seed)
    fill_s = time.perf_counter() - t
    gc.collect()
    filled = rss_bytes()
    tokens = buffer.num_tokens
    num_traj = buffer.num_trajectories
    growth = filled - base
    data = tokens * (np.dtype(np.int32).itemsize + np.dtype(np.float16).itemsize)
    print(
        f"buffer: {questions:,} questions, {num_traj:,} trajectories x {args.length:,} tokens = {tokens:,} tokens, "
        f"{len(buffer.retired):,} retired, buckets {buffer.bucket_counts()} (filled in {fill_s:.1f} s)"
    )
    print(f"resident memory: {gib(base)} before, {gib(filled)} after: +{gib(growth)} for the buffer")
    print(
        f"bytes per stored token: {growth / tokens:.3f} measured (RSS growth / tokens, everything included); "
        f"{data / tokens:.3f} of token data (int32 id + float16 log-prob); "
        f"{(growth - data) / num_traj:.0f} bytes per trajectory on top (objects, rows, buckets)"
    )

    # ---------------------------------------------------------------- replay plan
    n = args.plan_questions
    sample_ms, sample_max, sample_cpu = timed(functools.partial(choose_questions, buffer, n, 0), args.repeats)
    cap = args.max_candidates
    plan_ms, plan_max, plan_cpu = timed(plan_fn(buffer, n, False, cap), args.repeats)
    plan_bc_ms, plan_bc_max, plan_bc_cpu = timed(plan_fn(buffer, n, True, cap), args.repeats)
    drawn = draw_questions(buffer, ExGRPOSettings(max_trajectory_candidates=cap), 2 * n, 0)
    candidates = sum(len(q.candidates) for q in drawn)
    pickled = len(pickle.dumps([drawn]))
    print(
        f"replay plan, {n} questions (~{candidates} candidate trajectories), wall median [max] / CPU median of "
        f"{args.repeats}: choose_questions {sample_ms:.2f} [{sample_max:.2f}] / {sample_cpu:.2f} ms; "
        f"the trainer's plan (exgrpo_trl.replay; entropy forward stubbed) {plan_ms:.2f} [{plan_max:.2f}] / "
        f"{plan_cpu:.2f} ms; the same with the broadcast's pickling and unpickling of the drawn questions "
        f"({pickled / 2**20:.1f} MiB) {plan_bc_ms:.2f} [{plan_bc_max:.2f}] / {plan_bc_cpu:.2f} ms"
    )

    # ---------------------------------------------------------------- checkpoint
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="exgrpo-bench-"))
    checkpoint = tmp / "checkpoint-bench"
    try:
        trainer_state = {"replay_active": True, "generation_batches": 700, "sampler_passes": []}
        save_times = []
        for _ in range(args.io_repeats):  # each save replaces the previous one, as a run's next checkpoint would
            t = time.perf_counter()
            state_dir = save_state(checkpoint, buffer, trainer_state)
            save_times.append(time.perf_counter() - t)
        sizes = {p.name: p.stat().st_size for p in state_dir.iterdir()}
        expected = {
            "questions": questions,
            "trajectories": num_traj,
            "tokens": tokens,
            "buckets": buffer.bucket_counts(),
            "retired": len(buffer.retired),
        }
        probe = {
            key: [hashlib.sha256(t.completion_ids.tobytes() + t.logps.tobytes()).hexdigest() for t in e.trajectories]
            for key, e in list(buffer.questions.items())[:: max(1, questions // 50)]
        }
        del buffer  # one copy of the data at a time
        gc.collect()

        # Load in fresh processes (as a resumed run does): the RSS growth is the loaded buffer's footprint alone.
        loads = []
        for _ in range(args.io_repeats):
            child = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--load-only",
                    str(checkpoint),
                    "--num-generations",
                    str(args.num_generations),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if child.returncode != 0:
                print(child.stdout + child.stderr, file=sys.stderr)
                raise SystemExit("loading the checkpoint back failed")
            loads.append(json.loads(child.stdout.strip().splitlines()[-1]))
            assert loads[-1]["summary"] == json.loads(json.dumps(expected)), "the loaded buffer differs"
            assert loads[-1]["probe"] == probe, "stored trajectories differ after loading"
        load_times = [x["load_s"] for x in loads]
        save_s, load_s = statistics.median(save_times), statistics.median(load_times)
        loaded = loads[0]
        print(
            f"checkpoint: save {_secs(save_times)}, load in a fresh process {_secs(load_times)}; median save + "
            f"load {save_s + load_s:.2f} s (best {min(save_times) + min(load_times):.2f} s); files "
            + ", ".join(f"{name} {size / 2**20:,.1f} MiB" for name, size in sorted(sizes.items()))
        )
        print(
            f"loaded back: +{gib(loaded['growth'])} resident ({loaded['growth'] / tokens:.3f} bytes per token), "
            f"peak {gib(loaded['peak'])} in the loading process; peak of this process, saves included: "
            f"{gib(peak_rss_bytes())}"
        )
        print(
            f"a non-main rank on resume (retired set only): {loaded['other_s']:.2f} s, "
            f"+{loaded['other_growth'] / 2**20:.1f} MiB, {loaded['other_retired']:,} retired, "
            f"{loaded['other_trajectories']} trajectories"
        )
        if not args.no_reference:
            # What this machine's memory and disk allow, for reading the figures above: touching as many bytes of
            # fresh memory in a new process, and writing as many bytes to a file in the same folder.
            nbytes = sizes[ARRAYS_FILENAME]
            code = (
                f"import numpy as np, time; t = time.perf_counter(); a = np.ones({nbytes}, np.uint8); "
                "print(time.perf_counter() - t)"
            )
            touch = float(
                subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            )
            block = np.ones(1 << 24, np.uint8)
            t = time.perf_counter()
            with open(tmp / "reference.bin", "wb", buffering=0) as f:
                for _ in range(0, nbytes, block.size):
                    f.write(block)
            write_s = time.perf_counter() - t
            (tmp / "reference.bin").unlink()
            print(
                f"machine reference for {nbytes / 2**20:,.0f} MiB: first touch of fresh memory in a new process "
                f"{touch:.2f} s, plain sequential file write {write_s:.2f} s"
            )
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)

    verdict = {
        "bytes_per_token_measured": round(growth / tokens, 3),
        "bytes_per_token_data": round(data / tokens, 3),
        "bytes_per_trajectory_overhead": round((growth - data) / num_traj, 1),
        "plan_ms": round(plan_ms, 3),
        "plan_cpu_ms": round(plan_cpu, 3),
        "plan_with_broadcast_pickling_ms": round(plan_bc_ms, 3),
        "plan_with_broadcast_pickling_cpu_ms": round(plan_bc_cpu, 3),
        "sample_ms": round(sample_ms, 3),
        "save_s_median": round(save_s, 3),
        "load_s_median": round(load_s, 3),
        "save_s": [round(x, 3) for x in save_times],
        "load_s": [round(x, 3) for x in load_times],
    }
    print("figures: " + json.dumps(verdict))
    checks = [
        ("bytes per token (token data)", data / tokens <= TARGET_BYTES_PER_TOKEN),
        ("replay plan time (wall, broadcast pickling included)", plan_bc_ms <= TARGET_PLAN_MS),
        ("save + load time (medians)", save_s + load_s <= TARGET_SAVE_LOAD_S),
    ]
    print("targets: " + "; ".join(f"{name} {'OK' if ok else 'MISSED'}" for name, ok in checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
