"""`exgrpo train`'s recipe and options checked before torch, transformers and TRL are imported: a mistake is one line
in a fraction of a second.

Importing TRL, transformers and torch takes 5 s on an idle machine and over a minute on a busy one, and TRL's parser
then finds an unknown key or a bad value. `train_options.json` (written beside this file by `train.write_help`, which
`make style` runs; a test fails when it is stale) lists every option with the kind of value it takes and, where the
values are a closed set, that set, so the following are checked here with the standard library, PyYAML and the
package's torch-free modules alone (`check`):

- the recipe's keys and the command line's options (an unknown one, with the nearest known one);
- each value's kind (int, float, bool) and, for the options with a closed set of values, the value;
- ExGRPO's settings, by `ExGRPOSettings.validate` (the same checks as `ExGRPOConfig`), and those that depend on
  TRL's options (`num_generations_problem`, `clip_removal_problem`);
- the reward functions' names (a registry name, or a ``module:function`` path).

Before a run (`exgrpo train`, not the parser: a recipe for GPUs still parses on a laptop), `package_problem` checks the
optional packages the run will need (``use_vllm``, ``deepspeed``, ``report_to``), `reward_problem` that each reward
function's module can be found, and `check_sources` what the run will read: a local path that does not exist, and a
Hub id the run cannot fetch (offline mode without it in the local cache, or a Hub that cannot be reached: one
request, no retries). What passes is parsed again, in full, by TRL's parser, and TRL's and transformers' own checks
(their configs' ``__post_init__``) run there.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

OPTIONS = Path(__file__).with_name("train_options.json")
_BOOL = {"true", "false", "yes", "no", "1", "0"}
_TRUE = {"true", "yes", "1"}
HUB_TIMEOUT_S = 5.0  # the one request that says whether the Hub can be reached


def option_kind(action) -> str:
    """The kind of value an argparse action takes: int, float, bool, list, str, false (a ``--no_FLAG`` that sets its
    flag to False), or any (its own converter)."""
    if isinstance(action, argparse._StoreFalseAction):
        return "false"
    if action.nargs in ("+", "*"):
        return "list"
    kind = getattr(action.type, "__name__", None)
    return {"int": "int", "float": "float", "str": "str", "string_to_bool": "bool"}.get(kind or "", "any")


def _bad_value(kind: str, value) -> bool:
    """Whether a recipe value (as YAML loaded it) or a command-line string cannot be of `kind`."""
    if value is None or kind not in ("bool", "int", "float"):
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


def _typed(kind: str, value):
    """A command-line string (or a recipe's string) as the option's parser converts it; other values as they are
    (TRL's parser passes a recipe's numbers and lists on unchanged)."""
    if not isinstance(value, str):
        return value
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return value.strip().lower() in _TRUE
    return value


def suggestion(name: str, known: list[str]) -> str:
    """' (did you mean NEAREST?)' for an unknown `name`, or where to find the options."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]}?)" if close else " (exgrpo train --help lists the options)"


def _load_recipe(argv: list[str]) -> tuple[dict, str | None, str | None]:
    """(the recipe's mapping, its path, the mistake that stops there or None)."""
    if "--config" not in argv:
        return {}, None, None
    position = argv.index("--config")
    if position + 1 == len(argv):
        return {}, None, "--config needs the recipe's path: --config RECIPE.yaml"
    recipe = argv[position + 1]
    if not os.path.isfile(recipe):
        return {}, recipe, f"--config {recipe}: no such file"
    import yaml

    try:
        loaded = yaml.safe_load(Path(recipe).read_text()) or {}
    except yaml.YAMLError as e:
        return {}, recipe, f"--config {recipe} is not valid YAML ({' '.join(str(e).split())})"
    if not isinstance(loaded, dict):
        return {}, recipe, f"--config {recipe} must be a mapping of option: value"
    return loaded, recipe, None


def _options_table() -> dict | None:
    if not OPTIONS.is_file():  # an install without the file: TRL's parser checks the keys and values
        return None
    return json.loads(OPTIONS.read_text())


def _given(argv: list[str]) -> list[tuple[str, list[str]]]:
    """The command line's options with their words: ``--name=value`` -> (--name, [value]); ``--name a b`` -> (--name,
    [a, b]), up to the next option; --config and --debug left out."""
    given = []
    for i, word in enumerate(argv):
        if not word.startswith("--") or word in ("--config", "--debug"):
            continue
        name, has_value, inline = word.partition("=")
        words = [inline] if has_value else []
        if not has_value:
            for following in argv[i + 1 :]:
                if following.startswith("--"):
                    break
                words.append(following)
        given.append((name, words))
    return given


def _values(argv: list[str], loaded: dict, options: dict[str, list[str]]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in loaded.items():
        kind, dest = options[f"--{key}"]
        values[dest] = _typed(kind, value)
    for name, words in _given(argv):
        kind, dest = options[name]
        if kind == "false":
            values[dest] = False
        elif kind == "list":
            values[dest] = words
        elif not words:
            values[dest] = True if kind == "bool" else None  # `--use_peft` alone
        else:
            values[dest] = _typed(kind, words[0])
    return values


def check(argv: list[str], before_run: bool = False) -> str | None:
    """The first mistake in `exgrpo train ARGV` that needs no torch to find, as the one-line message, else None.
    `before_run`: also what the run needs from this machine (`package_problem`, `check_sources`), as `exgrpo train`
    asks before it starts (a recipe for GPUs still parses on a laptop)."""
    loaded, recipe, mistake = _load_recipe(argv)
    if mistake is not None:
        return mistake
    table = _options_table()
    if table is None:
        return None
    options: dict[str, list[str]] = table["options"]
    if loaded:
        keys = [name[2:] for name in options]
        for key, value in loaded.items():
            if f"--{key}" not in options:
                return f"unknown key {key} in {recipe}{suggestion(str(key), keys)}"
            kind = options[f"--{key}"][0]
            if _bad_value(kind, value):
                return f"{key} in {recipe}: {value!r} is not a valid {kind} value"
    for name, words in _given(argv):
        if name not in options:
            return f"unknown option {name}{suggestion(name, list(options))}"
        kind = options[name][0]
        if words and _bad_value(kind, words[0]):
            return f"argument {name}: invalid {kind} value: {words[0]!r}"
    values = _values(argv, loaded, options)
    mistake = value_problem(values, table["choices"])
    if mistake is None and before_run:
        mistake = (
            package_problem(values) or reward_problem(values, find_module=True) or push_problem(values)
            or check_sources(values)
        )  # fmt: skip
    return mistake


def push_problem(values: dict[str, Any]) -> str | None:
    """With push_to_hub on, a Hub the end of the run could not push to: offline mode, or no answer to one request
    (transformers found out only at the end, or, with the first checkpoint's push, after its retries)."""
    if values.get("push_to_hub") is not True:
        return None
    from huggingface_hub import constants

    fix = "train without push_to_hub and upload the output folder later (huggingface-cli upload)"
    if _offline("model"):
        return f"push_to_hub: offline mode is on (HF_HUB_OFFLINE=1), so nothing can be pushed: {fix}"
    reason = hub_unreachable(constants.ENDPOINT)
    if reason is not None:
        return f"push_to_hub: the Hub ({constants.ENDPOINT}) cannot be reached ({reason}): {fix}"
    return None


def package_problem(values: dict[str, Any]) -> str | None:
    """An optional package the run will need and that is not installed (TRL finds a missing vLLM once the model has
    loaded, transformers a missing logger when the trainer is built)."""
    from ..reporting import require_loggers
    from ..utils.requirements import require

    try:
        if values.get("use_vllm"):
            require("vllm", "use_vllm: true")
        if values.get("deepspeed"):
            require("deepspeed", "deepspeed (a DeepSpeed config)")
        require_loggers(values.get("report_to"))
    except ImportError as e:
        return str(e)
    return None


def value_problem(values: dict[str, Any], choices: dict[str, list[str]]) -> str | None:
    """The first value that cannot train: one outside its option's closed set, an ExGRPO setting out of range, or a
    reward function that cannot be found."""
    for dest, value in values.items():
        allowed = choices.get(dest)
        if allowed is None or value is None or isinstance(value, bool):  # a bool: YAML's `scale_rewards: false`
            continue
        for item in value if isinstance(value, list) else [value]:
            if str(item) not in allowed:
                return f"{dest} must be one of {', '.join(allowed)}; got {item!r}"
    from ..settings import ExGRPOSettings, clip_removal_problem, num_generations_problem, settings_fields

    given = {f.name: values[f.name] for f in settings_fields() if f.name in values}
    try:
        settings = ExGRPOSettings(**given)  # validate(): the message names the setting
    except (TypeError, ValueError) as e:
        return " ".join(str(e).split())
    if isinstance(values.get("num_generations"), int):
        problem = num_generations_problem(values["num_generations"])
        if problem is not None:
            return problem
    if isinstance(values.get("loss_type"), str):
        problem = clip_removal_problem(settings, values["loss_type"])
        if problem is not None:
            return problem
    return reward_problem(values, find_module=False)


def reward_problem(values: dict[str, Any], find_module: bool) -> str | None:
    """A reward function that is neither a registry name nor a ``module:function`` path, or (`find_module`) whose
    module cannot be found from here."""
    from ..tasks.rewards import reward_func_problem

    names = values.get("reward_funcs") or []
    for name in [names] if isinstance(names, str) else names:
        problem = reward_func_problem(str(name), find_module)
        if problem is not None:
            return problem
    return None


# ----------------------------------------------------------------------------------------------------- what it reads
DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".arrow", ".txt")
# the options that name a model or a dataset: a local path, or a Hub id of that kind of repository
SOURCES = (
    ("model_name_or_path", "model"),
    ("tokenizer_name_or_path", "model"),
    ("dataset_name", "dataset"),
    ("eval_dataset_name", "dataset"),
)


def looks_like_local_path(name: str) -> bool:
    """Whether a model or dataset name can only mean a local path: it starts like one (``/``, ``./``, ``../``,
    ``~``), has more than one ``/`` (a Hub id is ``name`` or ``org/name``), ends like a data file, or its first folder
    exists here."""
    if name.startswith(("/", "./", "../", "~")) or "\\" in name:
        return True
    if name.count("/") > 1 or name.lower().endswith(DATA_SUFFIXES):
        return True
    return "/" in name and os.path.isdir(name.split("/")[0])


def local_path_problem(what: str, name: str) -> str | None:
    """A local path that does not exist, in one line: transformers and datasets would take it for a Hub id and retry
    the Hub for a minute before a connection error."""
    if looks_like_local_path(name) and not os.path.exists(os.path.expanduser(name)):
        return (
            f"{what} {name} is a local path that does not exist ({Path(name).expanduser().resolve()}); create it "
            "first (a recipe's header says how), or give a Hub id (org/name)."
        )
    return None


def check_sources(values: dict[str, Any]) -> str | None:
    """The first model, dataset or file the run would read and cannot: a local path that does not exist, a Hub id
    that cannot be fetched (`hub_problem`), an `initial_experience`, DeepSpeed config or validation file that is not
    there."""
    for what, repo_type in SOURCES:
        name = values.get(what)
        if not isinstance(name, str) or not name:
            continue
        problem = local_path_problem(what, name)
        if problem is None and not os.path.exists(os.path.expanduser(name)):
            problem = hub_problem(what, name, repo_type)
        if problem is not None:
            return problem
    problem = column_problem(values)
    if problem is not None:
        return problem
    from ..settings import missing_files

    problem = missing_files(values)  # ExGRPO's own files (settings.FILE_SETTINGS)
    if problem is not None:
        return problem
    deepspeed = values.get("deepspeed")
    if isinstance(deepspeed, str) and deepspeed.endswith(".json") and not os.path.isfile(deepspeed):
        return f"deepspeed {deepspeed}: no such file"
    for spec in values.get("validation_dataset") or []:
        name, sep, path = str(spec).partition("=")
        if sep and path and re.fullmatch(r"[\w.-]+", name) and not os.path.exists(os.path.expanduser(path)):
            return f"validation_dataset {spec}: no such file {path}"
    return None


def local_columns(path: str) -> list[str] | None:
    """The column names of a local dataset file or folder, read without loading it (the first row of a JSON Lines
    file, a CSV's header, a Parquet file's schema, a saved folder's features); None where that cannot be told."""
    path = os.path.expanduser(path)
    try:
        if os.path.isdir(path):
            info = Path(path) / "dataset_info.json"
            return list(json.loads(info.read_text())["features"]) if info.is_file() else None
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                return list(json.loads(f.readline()))
        if path.endswith(".csv"):
            with open(path, encoding="utf-8", newline="") as f:
                return next(csv.reader(f))
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return list(pq.read_schema(path).names)
    except (OSError, ValueError, KeyError, StopIteration, TypeError, AttributeError):
        return None
    return None


def column_problem(values: dict[str, Any]) -> str | None:
    """A column the run reads from a local dataset that the dataset does not have: the offline solutions' column
    (kept by itself, so never listed in keep_columns) and keep_columns, in one line with the real columns."""
    name = values.get("dataset_name")
    columns = local_columns(name) if isinstance(name, str) and name else None
    if columns is None:
        return None
    shown = ", ".join(columns)
    offline = values.get("offline_solutions_column")
    if isinstance(offline, str) and offline and offline.lower() not in ("none", "null") and offline not in columns:
        return f"offline_solutions_column {offline!r} is not a column of {name} (its columns: {shown})"
    keep = values.get("keep_columns")
    for column in keep if isinstance(keep, list) else []:
        if column not in columns and column not in ("prompt", "answer"):
            return f"keep_columns lists {column!r}, which is not a column of {name} (its columns: {shown})"
    return None


def _offline(repo_type: str) -> bool:
    from huggingface_hub import constants

    datasets_offline = os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return constants.HF_HUB_OFFLINE or (repo_type == "dataset" and datasets_offline)


def hub_cached(repo_id: str, repo_type: str) -> bool:
    """Whether the local cache holds something of Hub repository `repo_id`: a snapshot in the Hub cache, or (a
    dataset) a prepared copy in datasets' cache, which it reads offline."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots"
    if snapshots.is_dir() and any(snapshots.iterdir()):
        return True
    if repo_type != "dataset":
        return False
    home = os.path.expanduser(os.getenv("HF_HOME", os.path.join(constants.default_home, "huggingface")))
    cache = Path(os.path.expanduser(os.getenv("HF_DATASETS_CACHE", os.path.join(home, "datasets"))))

    def plain(text: str) -> str:
        return re.sub(r"[^a-z0-9]", "", text.lower())

    wanted = plain(repo_id.split("/")[-1])
    return cache.is_dir() and any(wanted in plain(entry.name) for entry in cache.iterdir())


@functools.cache
def hub_unreachable(endpoint: str, timeout: float = HUB_TIMEOUT_S) -> str | None:
    """Why the Hub at `endpoint` cannot be reached (one request, no retries), or None when it answers (any HTTP
    status is an answer)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        return " ".join(str(e.reason).split()) or type(e.reason).__name__
    except (TimeoutError, OSError) as e:
        return " ".join(str(e).split()) or f"no answer in {timeout:g} s"
    return None


def hub_problem(what: str, repo_id: str, repo_type: str) -> str | None:
    """Whether the run can fetch Hub id `repo_id` (a `repo_type` repository): with offline mode on (HF_HUB_OFFLINE=1)
    only from the local cache; else the Hub must answer one request, and when it does not (a machine without the
    internet: transformers and datasets retried for about a minute before failing) the run goes on offline if the
    cache holds it."""
    from huggingface_hub import constants

    kind = "a dataset" if repo_type == "dataset" else "a model"
    if _offline(repo_type):
        if hub_cached(repo_id, repo_type):
            return None
        return (
            f"{what} {repo_id} is not a local path, so {kind} on the Hub, and offline mode is on (HF_HUB_OFFLINE=1) "
            f"with no copy in the local cache ({constants.HF_HUB_CACHE}): give a local folder or file, or fetch it "
            "once with the Hub reachable"
        )
    reason = hub_unreachable(constants.ENDPOINT)
    if reason is None:
        return None
    if hub_cached(repo_id, repo_type):
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by datasets when it is imported, after this
        constants.HF_HUB_OFFLINE = True  # read by transformers (huggingface_hub.is_offline_mode)
        print(
            f"exgrpo train: the Hub ({constants.ENDPOINT}) cannot be reached ({reason}); {what} {repo_id} is in the "
            "local cache: training offline (HF_HUB_OFFLINE=1)",
            file=sys.stderr,
        )
        return None
    return (
        f"{what} {repo_id} is not a local path, so {kind} on the Hub, and the Hub ({constants.ENDPOINT}) cannot be "
        f"reached ({reason}) with no copy in the local cache ({constants.HF_HUB_CACHE}): give a local folder or file, "
        "or connect"
    )
