"""`exgrpo` command line: `exgrpo train`, `exgrpo eval`, `exgrpo inspect`, `exgrpo export`. Each subcommand lives in
its own module."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ..utils.requirements import MissingDependency, require

# subcommand -> (module, one-line help). Modules are imported only when their subcommand runs.
SUBCOMMANDS = {
    "train": ("exgrpo_trl.cli.train", "train from a YAML recipe (TrlParser; CLI flags override the recipe)"),
    "inspect": ("exgrpo_trl.cli.inspect", "summarise the experience buffer saved in a checkpoint (--plot FILE.png)"),
    "export": ("exgrpo_trl.cli.export", "write a checkpoint's buffer as a Hugging Face dataset (--out DIR)"),
    "eval": ("exgrpo_trl.cli.evaluate", "the paper's benchmarks (avg@k), results.json + a table beside the paper's"),
}

# What a subcommand needs beyond the core dependencies, checked before its module is even imported: (import name,
# the options that need it; None: the command always does).
REQUIRES = {
    "inspect": [("matplotlib", ("--plot",))],
    "eval": [("vllm", ("--backend vllm",))],
}

# `exgrpo train --help`, written out by `train.short_help()` (a test keeps it current): building it imports TRL,
# transformers and torch, several seconds before anything is printed.
TRAIN_HELP = Path(__file__).with_name("train_help.txt")


def version() -> str:
    from .. import __version__

    return __version__


def _usage() -> str:
    lines = ["usage: exgrpo <command> [args...]", "       exgrpo --version", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "exgrpo <command> --help: that command's options"]
    return "\n".join(lines)


def check_requirements(name: str, args: list[str]) -> None:
    """Raise `MissingDependency` (one line: what to install) when `exgrpo NAME ARGS` needs a missing package."""
    words = [part for arg in args for part in arg.split("=", 1)] if args else []  # --plot=x as --plot x
    for module, options in REQUIRES.get(name, []):
        if options is None:
            require(module, f"exgrpo {name}")
            continue
        for option in options:  # "--plot": the flag is given; "--generator vllm": with that value
            flag, _, value = option.partition(" ")
            at = [i for i, word in enumerate(words) if word == flag]
            if at and (not value or any(words[i + 1 : i + 2] == [value] for i in at)):
                require(module, f"exgrpo {name} {option}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"exgrpo-trl {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"exgrpo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name == "train" and ("-h" in rest or "--help" in rest) and "--help-all" not in rest and TRAIN_HELP.is_file():
        print(TRAIN_HELP.read_text(), end="")
        return 0
    if not any(flag in rest for flag in ("-h", "--help", "--help-all")):
        try:
            check_requirements(name, rest)
        except MissingDependency as e:
            print(f"exgrpo {name}: error: {e}", file=sys.stderr)
            return 1
        if name == "train":  # a recipe's mistake in well under a second, before torch is imported
            from .precheck import check

            mistake = check(rest, before_run=True)
            if mistake is not None:
                print(f"exgrpo train: error: {mistake}", file=sys.stderr)
                return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)
