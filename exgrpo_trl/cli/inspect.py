"""`exgrpo inspect CHECKPOINT_DIR`: what the experience buffer saved in a checkpoint holds.

    exgrpo inspect out/checkpoint-700
    exgrpo inspect out/checkpoint-700 --plot buffer.png     # bucket histogram and trajectory lengths
    exgrpo inspect out/checkpoint-700 --json                # the same summary, machine-readable
    exgrpo inspect out/checkpoint-700 --verify              # also read every array (in chunks), check its CRC-32
    exgrpo inspect out/checkpoint-700 --show 3              # then 3 stored questions, their completions as text

Reads `exgrpo_state/state.json`, the header of `exgrpo_state/buffer.safetensors` and, from its arrays, only the
per-trajectory lengths and collection steps (a few bytes per trajectory), so it is quick on a buffer of millions of
tokens and never loads a model, a trainer, torch or trl. All reading goes through state.py's reader, so inspect
checks a state exactly as a resume does. A missing, truncated or corrupted state is reported with
the file it concerns, and the command exits with status 1.

`--show N` also prints the first N stored questions (buffer order): the prompt, k, and each trajectory's completion
decoded with the tokenizer saved in the checkpoint folder (or `--tokenizer PATH`), its length and the step it was
collected at. It reads the whole buffer, as a resume does, and loads the tokenizer (transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..buffer import CLOCK
from ..state_file import (
    ARRAYS_FILENAME,
    META_FILENAME,
    STATE_DIRNAME,
    StateFileError,
    checkpoint_folder,
    count_row_images,
    load_checkpoint_buffer,
    read_meta,
    read_small_arrays,
    verify_arrays,
)

SMALL_ARRAYS = ("lengths", "collected_at")  # the only arrays read (one entry per trajectory)


def _missing_state_hint(checkpoint: Path) -> str:
    if not checkpoint.is_dir():
        return f"{checkpoint} is not a folder"
    checkpoints = sorted(
        (p for p in checkpoint.glob("checkpoint-*") if p.is_dir()),
        key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1,
    )
    if checkpoints:
        return f"{checkpoint} looks like an output folder; its checkpoints: {', '.join(p.name for p in checkpoints)}"
    return f"{checkpoint} holds no {STATE_DIRNAME}/ folder (a plain GRPO checkpoint?)"


def summarize(checkpoint: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """The summary `exgrpo inspect` prints, as a dict. Raises StateFileError for a missing or damaged state."""
    checkpoint = checkpoint_folder(checkpoint)
    state_dir = checkpoint / STATE_DIRNAME
    if not (state_dir / META_FILENAME).exists():
        hint = _missing_state_hint(checkpoint)
        raise StateFileError(f"ExGRPO state file is missing: {state_dir / META_FILENAME} ({hint})")
    meta = read_meta(checkpoint)
    if verify:
        verify_arrays(checkpoint, meta)  # every array, every CRC-32, read in chunks
    # header checked against state.json, so its sizes and dtypes are those of the file
    small, arrays = read_small_arrays(checkpoint, meta, SMALL_ARRAYS), meta["arrays"]
    lengths, steps = small["lengths"].astype(np.int64), small["collected_at"].astype(np.int64)

    buffer = meta["buffer"]  # read_meta checked the type of every field used here
    k_gen = buffer["config"]["num_generations"]
    questions = [(q["k"], q["num_trajectories"]) for q in buffer["questions"]]
    retired = len(buffer["retired"])
    num_trajectories = sum(n for _, n in questions)
    num_tokens, num_ids = int(lengths.sum()), arrays["completion_ids"]["size"]
    if num_trajectories != lengths.size or steps.size != lengths.size or num_tokens != num_ids:
        raise StateFileError(
            f"ExGRPO state in {state_dir} is inconsistent: {num_trajectories} trajectories listed, {lengths.size} "
            f"lengths and {steps.size} stamps saved, lengths add up to {num_tokens} tokens for "
            f"{num_ids} ids"
        )

    owner_k = np.repeat(
        np.array([k for k, _ in questions], dtype=np.int64), np.array([n for _, n in questions], dtype=np.int64)
    )  # bucket of each trajectory
    buckets = {}
    for k in range(1, k_gen):
        in_bucket = owner_k == k
        buckets[k] = {
            "questions": sum(1 for qk, _ in questions if qk == k),
            "trajectories": int(in_bucket.sum()),
            "tokens": int(lengths[in_bucket].sum()),
        }
    itemsize = {name: np.dtype(a["dtype"]).itemsize for name, a in arrays.items()}
    token_bytes = num_tokens * (itemsize["completion_ids"] + itemsize["logps"])
    per_trajectory_bytes = lengths.size * (itemsize["lengths"] + itemsize["collected_at"])
    files = {name: (state_dir / name).stat().st_size for name in (ARRAYS_FILENAME, META_FILENAME)}
    trainer = meta["trainer"]
    clock = trainer.get("generation_batches")
    ages = clock - steps if clock is not None and buffer.get("clock") == CLOCK else None
    uses = np.array([u for q in buffer["questions"] for u in q.get("uses", [0] * q["num_trajectories"])], np.int64)
    config = buffer["config"]
    return {
        "path": str(state_dir),
        "format_version": meta["format_version"],
        "num_generations": k_gen,
        "questions": len(questions),
        "trajectories": num_trajectories,
        "retired": retired,
        "buckets": buckets,
        "tokens": num_tokens,
        "length": {
            "mean": float(lengths.mean()) if lengths.size else 0.0,
            "min": int(lengths.min()) if lengths.size else 0,
            "max": int(lengths.max()) if lengths.size else 0,
        },
        "collected_steps": [int(steps.min()), int(steps.max())] if steps.size else None,
        # generation batches since each trajectory was collected (None: a state whose stamps are optimizer steps)
        "age": None
        if ages is None or not ages.size
        else {"min": int(ages.min()), "median": float(np.median(ages)), "max": int(ages.max())},
        "uses": {"replays": int(uses.sum()), "replayed": int((uses > 0).sum()), "max": int(uses.max(initial=0))},
        "rules": {
            "max_age": config.get("max_age"),
            "max_uses": config.get("max_uses"),
            "priority": config.get("priority", "gaussian"),
            "cooldown": config.get("cooldown", 0),
        },
        # what a trajectory's stamp counts: generation batches; optimizer steps in states written before the clock
        "collected_unit": "generation batches" if buffer.get("clock") == CLOCK else "steps",
        "bytes": {
            "token_data": token_bytes,
            "per_token": token_bytes / num_tokens if num_tokens else 0.0,
            "per_trajectory_arrays": per_trajectory_bytes,
            "files": files,
            "total_on_disk": sum(files.values()),
        },
        "trainer": {
            "replay_active": trainer.get("replay_active"),
            "generation_batches": trainer.get("generation_batches"),
        },
        "verified": verify,
        "_lengths": lengths,  # for the plot; dropped from the printed summary
    }


def format_summary(s: dict[str, Any]) -> str:
    k_gen = s["num_generations"]
    b = s["bytes"]
    lines = [
        f"ExGRPO state  {s['path']}  (format version {s['format_version']})",
        f"questions     {s['questions']:,}",
        f"trajectories  {s['trajectories']:,}",
        f"retired       {s['retired']:,}",
        f"stored tokens {s['tokens']:,}"
        + (
            f"  (per trajectory: mean {s['length']['mean']:.1f}, min {s['length']['min']}, max {s['length']['max']})"
            if s["trajectories"]
            else ""
        ),
        (
            f"bytes         {b['token_data']:,} of token ids + log-probs ({b['per_token']:.2f} per token), "
            f"{b['per_trajectory_arrays']:,} of lengths + stamps; on disk {b['files'][ARRAYS_FILENAME]:,} "
            f"({ARRAYS_FILENAME}) + {b['files'][META_FILENAME]:,} ({META_FILENAME})"
        ),
    ]
    if s["collected_steps"]:
        first, last = s["collected_steps"]
        lines.append(f"collected at  {s.get('collected_unit', 'steps')} {first} to {last}")
    if s.get("age"):
        a = s["age"]
        lines.append(f"age           {a['min']} to {a['max']} generation batches (median {a['median']:g})")
    u, r = s["uses"], s["rules"]
    lines.append(f"replayed      {u['replays']:,} replays of {u['replayed']:,} stored trajectories (most: {u['max']})")
    limits = [
        f"age limit {r['max_age']}" if r["max_age"] is not None else "no age limit",
        f"use cap {r['max_uses']}" if r["max_uses"] is not None else "no use cap",
        f"reuse limit {r['cooldown']}" if r["cooldown"] else "no reuse limit",
        f"priority {r['priority']}",
    ]
    lines.append(f"draw rules    {', '.join(limits)}")
    t = s["trainer"]
    active = {True: "on", False: "off (delayed start)"}.get(t["replay_active"], "unknown")
    lines.append(f"replay        {active}; {t['generation_batches']} generation batches so far")
    lines.append(f"buckets       k successes out of K={k_gen}:")
    lines.append(f"  {'k':>4}  {'questions':>10}  {'trajectories':>12}  {'tokens':>12}")
    for k, c in s["buckets"].items():
        lines.append(f"  {k:>4}  {c['questions']:>10,}  {c['trajectories']:>12,}  {c['tokens']:>12,}")
    if s["verified"]:
        lines.append("verified      every array read and its CRC-32 checked")
    return "\n".join(lines)


def show_questions(checkpoint: str | Path, n: int, tokenizer: str | None = None) -> list[dict[str, Any]]:
    """The first `n` stored questions (buffer order), each with its prompt, k and trajectories (the completion decoded
    with the checkpoint's tokenizer, or `tokenizer`; its token count; the generation batch it was collected in; in a
    state written before the clock counted generation batches, the optimizer step). Reads the whole
    buffer, checked as a resume reads it. Raises StateFileError, or ValueError when there is no tokenizer."""
    from ..utils.tokenizer import checkpoint_tokenizer  # transformers: only for --show

    checkpoint = checkpoint_folder(checkpoint)
    decoder = checkpoint_tokenizer(checkpoint, tokenizer)
    buffer = load_checkpoint_buffer(checkpoint)
    shown = []
    for key in list(buffer.questions)[:n]:
        entry = buffer.questions[key]
        ids = [t.completion_ids.tolist() for t in entry.trajectories]
        texts = decoder.batch_decode(ids, skip_special_tokens=True) if ids else []
        trajectories = [
            {
                "completion": text,
                "num_tokens": len(t_ids),
                "collected_at": t.collected_at,
                "uses": t.uses,
                "advantage": t.advantage,
            }
            for text, t_ids, t in zip(texts, ids, entry.trajectories)
        ]
        question = {"key": key, "prompt": entry.row.get("prompt"), "images": count_row_images(entry.row)}
        shown.append({**question, "k": entry.k, "trajectories": trajectories})
    return shown


def _indented(text: str, indent: str = "    ") -> list[str]:
    return [indent + line for line in text.splitlines()] or [indent + "(empty)"]


def _prompt_lines(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return _indented(prompt)
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):  # chat messages
        return [line for m in prompt for line in _indented(f"{m.get('role')}: {m.get('content')}")]
    return _indented(json.dumps(prompt, ensure_ascii=False))


def format_shown(shown: list[dict[str, Any]], num_questions: int, num_generations: int) -> str:
    """`--show`'s text: each question's prompt, k and trajectories, after a line saying how many are shown."""
    lines = ["", f"shown         {len(shown):,} of {num_questions:,} questions (buffer order)"]
    for i, q in enumerate(shown, 1):
        n = len(q["trajectories"])
        count = f"{n} trajector{'y' if n == 1 else 'ies'}"
        images = f", {q['images']} image{'' if q['images'] == 1 else 's'}" if q.get("images") else ""
        lines += ["", f"question {i}  k {q['k']} of {num_generations}, {count}{images}  (key {q['key']})", "  prompt"]
        lines += _prompt_lines(q["prompt"])
        for j, t in enumerate(q["trajectories"], 1):
            extra = f", replayed {t.get('uses', 0)} time{'' if t.get('uses') == 1 else 's'}"
            if t.get("advantage") is not None:
                extra += f", advantage {t['advantage']:+.4g} when collected"
            lines.append(
                f"  trajectory {j}: {t['num_tokens']} tokens, collected in generation batch {t['collected_at']}{extra}"
            )
            lines += _indented(t["completion"])
    return "\n".join(lines)


def plot(s: dict[str, Any], path: str | Path):
    """Bucket histogram (questions per success count) and the distribution of stored trajectory lengths, saved to
    `path`. Returns the (closed) matplotlib figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from e

    fig, (ax_b, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    ks = list(s["buckets"])
    counts = [s["buckets"][k]["questions"] for k in ks]
    bars = ax_b.bar(ks, counts, color="#4C72B0")
    ax_b.bar_label(bars, labels=[f"{c:,}" for c in counts], fontsize=8)
    ax_b.set_xticks(ks, [f"{k}/{s['num_generations']}" for k in ks])
    ax_b.set_xlabel("bucket (latest successes out of K)")
    ax_b.set_ylabel("questions")
    ax_b.set_title(f"{s['questions']:,} questions, {s['retired']:,} retired")

    lengths = s["_lengths"]
    if lengths.size:
        low, high = int(lengths.min()), int(lengths.max())
        # one bar per length when there are few distinct lengths, else 50 bins
        bins = np.arange(low, high + 2) - 0.5 if high - low < 50 else 50
        ax_l.hist(lengths, bins=bins, color="#55A868")
        ax_l.axvline(lengths.mean(), color="k", linestyle="--", linewidth=1, label=f"mean {lengths.mean():.1f}")
        ax_l.legend()
    else:
        ax_l.text(0.5, 0.5, "no stored trajectories", ha="center", va="center", transform=ax_l.transAxes)
    ax_l.set_xlabel("completion length (tokens)")
    ax_l.set_ylabel("trajectories")
    ax_l.set_title(f"{s['trajectories']:,} trajectories, {s['tokens']:,} tokens")
    for ax in (ax_b, ax_l):
        # counts start at 0; with nothing to count matplotlib centres the y-axis on 0 (about -0.05..0.05), where
        # MaxNLocator finds no integers and falls back to fractions: 0..1 then
        ax.set_ylim(0, max(ax.get_ylim()[1], 1))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_l.xaxis.set_major_locator(MaxNLocator(integer=True))  # lengths are whole tokens
    fig.suptitle(s["path"], fontsize=9)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)  # out of pyplot's list of open figures; the object stays readable
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exgrpo inspect",
        description="Summarise the ExGRPO experience buffer saved in a checkpoint folder.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (holding exgrpo_state/), or the exgrpo_state folder")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the bucket histogram and the trajectory lengths")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--verify", action="store_true", help="read every array and check its CRC-32 (slower)")
    parser.add_argument(
        "--show",
        type=_positive,
        metavar="N",
        help="then print N stored questions: prompt, k, each trajectory's completion as text, its length and step",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="with --show: decode with this tokenizer (a folder or a Hub id), not the one saved in the checkpoint",
    )
    return parser


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = summarize(args.checkpoint, verify=args.verify)
        shown = show_questions(args.checkpoint, args.show, args.tokenizer) if args.show else None
        if args.plot:
            plot(summary, args.plot)
    except (StateFileError, RuntimeError, ValueError) as e:  # ValueError: --show without a tokenizer
        print(f"exgrpo inspect: {e}", file=sys.stderr)
        return 1
    printable = {k: v for k, v in summary.items() if not k.startswith("_")}
    if shown is not None:
        printable["shown"] = shown
    try:
        if args.json:
            print(json.dumps(printable, indent=2))
        else:
            print(format_summary(printable))
            if args.plot:
                print(f"plot          {args.plot}")
            if shown is not None:
                print(format_shown(shown, summary["questions"], summary["num_generations"]))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
    except BrokenPipeError:
        # The reader left (`exgrpo inspect ... | head`): stop quietly, as Unix tools do. What is still buffered would
        # fail again at exit, so stdout goes to devnull (the recipe of Python's `signal` documentation).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
