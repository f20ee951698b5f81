"""Does a change change nothing? Train every mode a user runs at two commits and compare what came out.

    python scripts/same_behaviour.py BASE             # BASE (a commit) against this working tree
    python scripts/same_behaviour.py BASE HEAD        # two commits
    python scripts/same_behaviour.py BASE --only dr_grpo lora "rollout_func with env_mask"

The modes are every case of the compatibility matrix (`tests/trainer/test_compat_matrix.py`: loss types, reward
scaling, batch layouts, adapters, rewards, multi-turn rollouts), every rollout shape of
`tests/trainer/test_rollout_shapes.py` (a user's `rollout_func`, with and without `env_mask`, images, ...) and image
inputs with TRL's own generation (`tests/trainer/test_vlm.py`'s tiny Qwen2-VL). vLLM is not among them: its server
mode samples without a seed, so two runs of one commit differ. Each is
trained twice, as the tests train it (fixed seed, one CPU thread, 3-6 steps): with replay on from the first step, and
at `replay_ratio=0`. A run's fingerprint is the sha256 of its final weights (every tensor of the state dict, bytes and
dtype), of its experience buffer (the trajectories and metadata it checkpoints, restricted to the fields every version
has: `buffer_hash`) and of its log history (every logged value but wall times; a key only one side logs, a metric
added, is named beside the verdict and the rows are compared on the keys both log). The two commits' code
(`exgrpo_trl`) is taken from each commit in turn; everything else (the tests' models, data, rewards and cases) from
this working tree, so both sides train the same modes the same way. Each side runs in a process of its own, both at
once.

It prints one line per mode and variant (`same`, or what differs: weights, buffer, logs, with the first differing log
entry), then a summary, and exits 0 when every run is the same at both commits, 1 otherwise. A mode that fails at one
commit only (say, a shape the older code rejected) counts as a difference, its error printed. Use it for any change
that says it changes nothing; `docs/development.md` says so.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("replay", "rho0")  # replay on from the first step; replay_ratio=0
WALL_TIME_KEYS = ("runtime", "per_second", "step_time")  # log keys that measure time, not training


# ------------------------------------------------------------------------------------------------ fingerprints
def _sha(items) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(item if isinstance(item, bytes) else str(item).encode())
    return h.hexdigest()


def weights_hash(model) -> str:
    state = model.state_dict()
    return _sha(
        x for name in sorted(state) for x in (name, state[name].dtype, state[name].detach().cpu().numpy().tobytes())
    )


# What a buffer held before the draw's optional rules existed (the fields every version has): a field added since (a
# trajectory's advantage and use count, a new setting's key) is state the older side cannot have, so it is left out of
# the comparison and named in the summary instead (`ADDED`).
BUFFER_CONFIG = ("num_generations", "mu", "sigma", "question_selection", "cooldown", "seed")
QUESTION_FIELDS = ("key", "k", "num_trajectories", "bucket_position", "row", "records")
ADDED = "per trajectory: its advantage when collected and its use count; buffer config: max_age, max_uses, priority"


def buffer_hash(buffer) -> str:
    """sha256 of the buffer as training reads it: every trajectory's token ids, behaviour log-probs, stamp and mask in
    stored order, and the checkpointed metadata (questions, buckets' order, rows, records, the retired set, the
    generator's state, when questions were replayed), restricted to the fields every version has."""
    import numpy as np

    parts = []
    for entry in buffer.questions.values():
        for t in entry.trajectories:
            mask = b"" if t.mask is None else np.ascontiguousarray(t.mask).tobytes()
            parts += [np.ascontiguousarray(t.completion_ids).tobytes(), np.ascontiguousarray(t.logps).tobytes(),
                      str(int(t.collected_at)), mask]  # fmt: skip
    meta = buffer.state_meta()
    meta["config"] = {k: v for k, v in meta["config"].items() if k in BUFFER_CONFIG}
    meta["questions"] = [{k: v for k, v in q.items() if k in QUESTION_FIELDS} for q in meta["questions"]]
    return _sha([*parts, json.dumps(meta, sort_keys=True, default=_plain)])


def _plain(value) -> str:
    """An image in a stored row by its pixels (its repr holds a memory address, another in every run)."""
    from exgrpo_trl.buffer import image_digest

    try:
        return image_digest(value)
    except TypeError:
        return repr(value)


def training_logs(trainer) -> list[dict]:
    return [
        {k: v for k, v in row.items() if not any(t in k for t in WALL_TIME_KEYS)} for row in trainer.state.log_history
    ]


def fingerprint(trainer) -> dict:
    logs = training_logs(trainer)
    return {
        "weights": weights_hash(trainer.model),
        "buffer": buffer_hash(trainer.exgrpo_state.buffer),
        "logs": _sha([json.dumps(logs, sort_keys=True)]),
        "log_rows": logs,
        "replayed": sum(row.get("exgrpo/replay/fraction", 0) > 0 for row in logs),
    }


# ------------------------------------------------------------------------------------------------ the modes
def modes() -> dict[str, object]:
    """Mode name -> a function(out_dir, variant) returning the trained trainer (the tests' own builders)."""
    from exgrpo_trl import ExGRPOTrainer
    from tests.trainer import test_compat_matrix as matrix
    from tests.trainer import test_rollout_shapes as shapes

    matrix.RecordingTrainer = ExGRPOTrainer  # the plain trainer: what users run, whatever the recorder needs

    def case_runner(case):
        def run(out, variant):
            from exgrpo_trl.tasks.toy import build_char_tokenizer
            from tests.helpers import make_model

            tokenizer = build_char_tokenizer()
            model_dir = out / "policy"
            make_model(tokenizer).save_pretrained(model_dir)
            config = dict(case.config) | ({"replay_ratio": 0.0} if variant == "rho0" else {})
            return matrix.build_run(case.setup, config, out / "run", tokenizer, model_dir).trainer

        return run

    def shape_runner(shape):
        def run(out, variant):
            config = {"replay_ratio": 0.0} if variant == "rho0" else {}
            return shapes.train(out, shape, cls=ExGRPOTrainer, replay_start_pass_rate=0.0, **config)[0]

        return run

    def vlm_run(out, variant):  # images with TRL's own generation (the tiny Qwen2-VL)
        from tests.trainer.test_vlm import vlm_trainer

        config = {"replay_ratio": 0.0} if variant == "rho0" else {}
        trainer = vlm_trainer(out, cls=ExGRPOTrainer, replay_start_pass_rate=0.0, steps_per_generation=1,
                              max_steps=6, **config)  # fmt: skip
        trainer.train()
        return trainer

    found = {f"matrix: {case.id}": case_runner(case) for case in matrix.CASES}
    found.update({f"shape: {shape}": shape_runner(shape) for shape in shapes.SHAPES})
    found["images: transformers generation"] = vlm_run
    return found


def run_fingerprints(tree: Path, out: Path, only: list[str]) -> None:
    """In this process: `exgrpo_trl` from `tree`, the tests from this checkout; one JSON line per run to `out`."""
    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    import exgrpo_trl

    where = Path(exgrpo_trl.__file__).resolve().parent
    assert where == (tree / "exgrpo_trl").resolve(), f"exgrpo_trl imported from {where}, not {tree}"
    done = set()
    if out.exists():  # resume: the runs already written are kept
        done = {(r["mode"], r["variant"]) for r in map(json.loads, out.read_text().splitlines())}
    for name, run in modes().items():
        if only and not any(o == name.split(": ", 1)[1] or o == name for o in only):
            continue
        for variant in VARIANTS:
            if (name, variant) in done:
                continue
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="same-behaviour-") as tmp:
                try:
                    record = fingerprint(run(Path(tmp), variant))
                except Exception as error:  # noqa: BLE001 - a mode that fails is a result to compare
                    record = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
            record.update(mode=name, variant=variant, seconds=round(time.perf_counter() - started, 1))
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"  {tree.name}: {name} ({variant}) {record['seconds']} s", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ comparing
def common_keys(a: list[dict], b: list[dict]) -> tuple[list[dict], list[dict], set[str]]:
    """Both sides' log rows restricted to the keys both log, and the keys only one side logs (a metric added)."""
    keys_a = {k for row in a for k in row}
    keys_b = {k for row in b for k in row}
    both = keys_a & keys_b
    return [{k: v for k, v in r.items() if k in both} for r in a], [{k: v for k, v in r.items() if k in both}
                                                                     for r in b], keys_a ^ keys_b  # fmt: skip


def first_log_difference(a: list[dict], b: list[dict]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                return f"log row {i} {key!r}: {x.get(key)!r} -> {y.get(key)!r}"
    return f"{len(a)} -> {len(b)} log rows"


def compare(base: dict[tuple, dict], head: dict[tuple, dict]) -> list[tuple[str, str, str]]:
    """(mode, variant, verdict) for every run of either side: 'same', or what differs."""
    rows = []
    for key in sorted(set(base) | set(head)):
        a, b = base.get(key), head.get(key)
        if a is None or b is None:
            verdict = f"only at {'HEAD' if a is None else 'BASE'}"
        elif "error" in a or "error" in b:
            verdict = "same (both failed)" if a.get("error") == b.get("error") else (
                f"fails at {'BASE' if 'error' in a else 'HEAD'}: {(a if 'error' in a else b)['error']}"
                if ("error" in a) != ("error" in b) else f"fails differently: {a['error']} / {b['error']}"
            )  # fmt: skip
        else:
            logs_a, logs_b, one_side = common_keys(a["log_rows"], b["log_rows"])
            differ = [part for part in ("weights", "buffer") if a[part] != b[part]] + (["logs"] if logs_a != logs_b
                                                                                      else [])  # fmt: skip
            verdict = "same" if not differ else "DIFFERS: " + ", ".join(differ)
            if "logs" in differ:
                verdict += f" ({first_log_difference(logs_a, logs_b)})"
            if one_side:
                verdict += f" (logged at one side only: {', '.join(sorted(one_side))})"
        rows.append((*key, verdict))
    return rows


def read(path: Path) -> dict[tuple, dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {(r["mode"], r["variant"]): r for r in records}


# ------------------------------------------------------------------------------------------------ two commits
@contextlib.contextmanager
def checkout(ref: str | None, parent: Path):
    """The tree of commit `ref` (a detached worktree, removed afterwards), or this working tree for None."""
    if ref is None:
        yield REPO
        return
    path = parent / f"tree-{ref.replace('/', '_')}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), ref], check=True,
                   capture_output=True, text=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True)


def start(tree: Path, out: Path, only: list[str], work: Path) -> subprocess.Popen:
    """A process that fingerprints `tree`'s `exgrpo_trl` (linked alone into `work`, ahead of this checkout); the
    trainers' own output goes to a log beside `out`, the progress lines to the terminal."""
    link_dir = work / f"path-{tree.name}"
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "exgrpo_trl"
    if not link.exists():
        link.symlink_to(tree / "exgrpo_trl", target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(link_dir), str(REPO)]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--fingerprint", str(tree), "--out", str(out), "--only", *only]
    with out.with_suffix(".log").open("a") as log:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", nargs="?", help="the commit before the change")
    p.add_argument("head", nargs="?", default=None, help="the commit after it (default: this working tree)")
    p.add_argument("--only", nargs="*", default=[], help="mode names (a matrix case id or a rollout shape)")
    p.add_argument("--out", help="with --fingerprint: the JSON-lines file; else a folder for both sides' records "
                   "(kept, so that a run stopped halfway resumes)")  # fmt: skip
    p.add_argument("--fingerprint", metavar="TREE", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.fingerprint:
        run_fingerprints(Path(args.fingerprint), Path(args.out), args.only)
        return 0
    if not args.base:
        p.error("name the commit before the change (BASE)")
    for ref in filter(None, [args.base, args.head]):
        if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
                          capture_output=True).returncode:  # fmt: skip
            p.error(f"{ref!r} is not a commit of this repository")
    work = Path(tempfile.mkdtemp(prefix="same-behaviour-"))
    records = Path(args.out) if args.out else work
    records.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with checkout(args.base, work) as base_tree, checkout(args.head, work) as head_tree:
        outs = [records / "base.jsonl", records / "head.jsonl"]
        procs = [start(tree, out, args.only, work) for tree, out in zip((base_tree, head_tree), outs)]
        codes = [proc.wait() for proc in procs]
    if any(codes):
        print(f"same_behaviour: a fingerprinting process exited with {codes}", file=sys.stderr)
        return 2
    rows = compare(read(outs[0]), read(outs[1]))
    head_name = args.head or "the working tree"
    print(
        f"\nsame_behaviour: {args.base} against {head_name}, {len(rows)} runs ({time.perf_counter() - started:.0f} s)"
    )
    for mode, variant, verdict in rows:
        status, _, detail = verdict.partition(": ")
        if verdict.startswith("same"):  # "same", "same (both failed)", "same (logged at one side only: ...)"
            status, detail = "same", verdict[len("same") :].strip()
        status = "same" if status == "same" else "DIFFERS" if status == "DIFFERS" else "FAILS"
        print(
            f"  {status:<8} {mode} [{variant}]" + (f": {verdict if status == 'FAILS' else detail}" if detail else "")
        )
    same = sum(v.startswith("same") for _, _, v in rows)
    replayed = sum(
        r["replayed"] > 0 for r in read(outs[1]).values() if r.get("variant") == "replay" and "replayed" in r
    )
    print(f"{same} of {len(rows)} the same; replay fired in {replayed} of the replay-on runs; records in {records}")
    print(f"(not compared, as only newer versions hold them: {ADDED})")
    return 0 if same == len(rows) and rows else 1


if __name__ == "__main__":
    sys.exit(main())
