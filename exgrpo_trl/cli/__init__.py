"""`exgrpo` command line: `exgrpo demo`, `exgrpo train`, ... Each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Modules are imported only when their subcommand runs.
SUBCOMMANDS = {
    "demo": ("exgrpo_trl.cli.demo", "ExGRPO vs GRPO side by side on a toy task, on a CPU, in minutes"),
    "train": ("exgrpo_trl.cli.train", "train from a YAML recipe (TrlParser; CLI flags override the recipe)"),
    "inspect": ("exgrpo_trl.cli.inspect", "summarise the experience buffer saved in a checkpoint (--plot FILE.png)"),
    "study": ("exgrpo_trl.cli.study", "GRPO vs ExGRPO and ablations on the toy tasks, over seeds, resumable"),
    "eval": ("exgrpo_trl.cli.evaluate", "the paper's benchmarks (avg@k), results.json + a table beside the paper's"),
}


def _usage() -> str:
    lines = ["usage: exgrpo <command> [args...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"exgrpo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)
