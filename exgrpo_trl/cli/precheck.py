"""`exgrpo train`'s recipe and options checked before TRL is imported: a typo is one line in well under a second.

Importing TRL, transformers and torch takes about 5 s, and TRL's parser then finds an unknown key or a bad value.
`train_options.json` (written beside this file by `train.write_help`, which `make style` runs; a test fails when it
is stale) lists every option with the kind of value it takes, so the recipe's keys, the command line's options and
the plain values of both are checked here with the standard library and PyYAML alone. What passes is parsed again,
in full, by TRL's parser.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from pathlib import Path

OPTIONS = Path(__file__).with_name("train_options.json")
_BOOL = {"true", "false", "yes", "no", "1", "0"}


def option_kind(action) -> str:
    """The kind of value an argparse action takes: int, float, bool, list, str, or any (its own converter)."""
    if action.nargs in ("+", "*"):
        return "list"
    kind = getattr(action.type, "__name__", None)
    return {"int": "int", "float": "float", "str": "str", "string_to_bool": "bool"}.get(kind or "", "any")


def _bad_value(kind: str, value) -> bool:
    """Whether a recipe value (as YAML loaded it) or a command-line string cannot be of `kind`."""
    if value is None or kind in ("any", "list", "str"):
        return False
    if kind == "bool":
        return not isinstance(value, bool) and str(value).strip().lower() not in _BOOL
    if isinstance(value, bool):  # YAML's true is no number
        return True
    try:
        number = float(value) if kind == "float" else int(value)
    except (TypeError, ValueError):
        return True
    return kind == "float" and math.isnan(number) and not isinstance(value, float)


def suggestion(name: str, known: list[str]) -> str:
    """' (did you mean NEAREST?)' for an unknown `name`, or where to find the options."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else " (exgrpo train --help lists the options)"


def check(argv: list[str]) -> str | None:
    """The first mistake in `exgrpo train ARGV` that needs no TRL to find, as the one-line message, else None."""
    loaded, recipe = {}, None
    if "--config" in argv:
        position = argv.index("--config")
        if position + 1 == len(argv):
            return "--config needs the recipe's path: --config RECIPE.yaml"
        recipe = argv[position + 1]
        if not os.path.isfile(recipe):
            return f"--config {recipe}: no such file"
        import yaml

        try:
            loaded = yaml.safe_load(Path(recipe).read_text()) or {}
        except yaml.YAMLError as e:
            return f"--config {recipe} is not valid YAML ({' '.join(str(e).split())})"
        if not isinstance(loaded, dict):
            return f"--config {recipe} must be a mapping of option: value"
    if not OPTIONS.is_file():  # an install without the file: TRL's parser checks the keys and values
        return None
    kinds: dict[str, str] = json.loads(OPTIONS.read_text())
    if loaded:
        keys = [name[2:] for name in kinds]
        for key, value in loaded.items():
            if f"--{key}" not in kinds:
                return f"unknown key {key} in {recipe}{suggestion(str(key), keys)}"
            if _bad_value(kinds[f"--{key}"], value):
                return f"{key} in {recipe}: {value!r} is not a valid {kinds[f'--{key}']} value"
    for i, word in enumerate(argv):
        if not word.startswith("--") or word in ("--config", "--debug"):
            continue
        name, has_value, inline = word.partition("=")
        if name not in kinds:
            return f"unknown option {name}{suggestion(name, list(kinds))}"
        following = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        value = inline if has_value else following
        if value is not None and _bad_value(kinds[name], value):
            return f"argument {name}: invalid {kinds[name]} value: {value!r}"
    return None
