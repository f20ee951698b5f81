"""`exgrpo export CHECKPOINT --out DIR`: the experience buffer saved in a checkpoint, as a Hugging Face dataset.

    exgrpo export out/checkpoint-700 --out buffer-700                        # datasets.load_from_disk("buffer-700")
    exgrpo export out/checkpoint-700 --out buffer-700 --parquet buffer-700.parquet
    exgrpo export out/checkpoint-700 --out buffer-700 --tokenizer Qwen/Qwen2.5-Math-7B

One row per stored trajectory (the columns are listed in `exgrpo_trl.export`), completions decoded with the
tokenizer saved in the checkpoint folder (TRL saves it there with the model), or the one `--tokenizer` names. The
folder also holds `exgrpo_export.json`: the buffer's num_generations and the tokenizer's fingerprint, which
`initial_experience` reads to seed a new run with it. The state is read and checked as a resume reads it; a missing,
truncated or corrupted state, or no tokenizer, is reported in one line and the command exits with status 1.
"""

from __future__ import annotations

import argparse
import sys

from ..state_file import STATE_DIRNAME, StateFileError, checkpoint_folder
from .diskfull import told_when_full
from .inspect import _missing_state_hint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exgrpo export",
        description="Write the ExGRPO experience buffer saved in a checkpoint as a Hugging Face dataset (one row per "
        "stored trajectory): a save_to_disk folder, and optionally one parquet file. A new run seeds its buffer from "
        "either with initial_experience.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (holding exgrpo_state/), or the exgrpo_state folder")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="the dataset's folder (datasets.load_from_disk reads it)"
    )
    parser.add_argument("--parquet", metavar="FILE", help="also write the rows as one parquet file")
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="decode with this tokenizer (a folder or a Hub id) instead of the one saved in the checkpoint folder",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..export import ExportError, export_checkpoint  # datasets and transformers: after --help
    from ..utils.tokenizer import checkpoint_tokenizer

    checkpoint = checkpoint_folder(args.checkpoint)
    try:
        if not checkpoint.is_dir() or not (checkpoint / STATE_DIRNAME).is_dir():
            raise StateFileError(f"no ExGRPO state to export: {_missing_state_hint(checkpoint)}")
        tokenizer = checkpoint_tokenizer(checkpoint, args.tokenizer)
        with told_when_full(args.out, f"the export to {args.out}", lambda: "run the same command again"):
            dataset = export_checkpoint(checkpoint, args.out, tokenizer=tokenizer, parquet=args.parquet)
    except (StateFileError, ExportError, ValueError, OSError) as e:
        print(f"exgrpo export: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    questions = len(set(dataset["question_key"]))
    where = args.out + (f" and {args.parquet}" if args.parquet else "")
    print(f"exgrpo export: {len(dataset):,} trajectories of {questions:,} questions written to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
