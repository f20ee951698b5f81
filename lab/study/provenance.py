"""What made a run: the machine (CPU model, the kernels torch picked for it, thread count: `lab.warm_start.machine`),
the code (git commit, whether the tree had uncommitted changes), the library versions, the fully resolved training
config, and the identity of what it trained from (hashes of the warm-start weights, the training
pool and the held-out set). Every run JSON holds it (`provenance`); a confirmatory run refuses to start from a tree
with uncommitted changes to tracked files (`require_clean`), so that its commit says exactly what code made it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

# The folder that holds `lab/`, the checkout whose commit a run records; children run `python -m lab.study` from there
# (the lab is not installed).
LAB_ROOT = Path(__file__).resolve().parents[2]
# The libraries whose versions a run records (python's own is added).
LIBRARIES = ("torch", "trl", "transformers", "accelerate", "datasets", "numpy")
# Config fields that name places on the machine that ran, not how it trained: left out of the record.
MACHINE_FIELDS = ("output_dir", "logging_dir", "hub_model_id", "hub_token", "push_to_hub_token")


class DirtyTree(RuntimeError):
    """A confirmatory run asked to start from a tree with uncommitted changes to tracked files."""


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(root: str | Path) -> dict[str, Any]:
    """The commit checked out at `root` and the tracked files with uncommitted changes (untracked files, such as the
    runs being written, do not count). Outside a git checkout: commit None."""
    root = Path(root)
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
    changed = sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"commit": commit.strip(), "dirty": changed}


def require_clean(root: str | Path) -> dict[str, Any]:
    """`git_state`, or DirtyTree when `root` is not a git checkout or has uncommitted changes to tracked files."""
    state = git_state(root)
    if state["commit"] is None:
        raise DirtyTree(f"{root} is not a git checkout: a confirmatory run records the commit that made it")
    if state["dirty"]:
        shown = ", ".join(state["dirty"][:5]) + (" ..." if len(state["dirty"]) > 5 else "")
        raise DirtyTree(
            f"uncommitted changes to tracked files ({shown}): a confirmatory run starts only from a committed tree "
            "(commit or stash them, or run from a worktree of the registered commit)"
        )
    return state


def versions() -> dict[str, str | None]:
    """python's version and each of `LIBRARIES`' installed versions (None when not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def weights_digest(model) -> str:
    """sha256 of a model's state dict (`lab.warm_start.weights_sha256`: each tensor's name, dtype, shape and bytes)."""
    from ..warm_start import weights_sha256

    return weights_sha256(model)


def rows_digest(dataset) -> str:
    """sha256 of a dataset's rows in order, each as sorted-key JSON: the same questions in the same order."""
    h = hashlib.sha256()
    for row in dataset:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def resolved_config(config) -> dict[str, Any]:
    """Every field of a (GRPO or ExGRPO) config as it trained, JSON-able, without the fields that name places on the
    machine (`MACHINE_FIELDS`)."""
    values = config.to_dict()
    return json.loads(json.dumps({k: v for k, v in sorted(values.items()) if k not in MACHINE_FIELDS}, default=str))


def provenance(root: str | Path, *, config, warm_start, train_set, eval_set, confirmatory: bool) -> dict[str, Any]:
    """The record of what made a run (module docstring). `confirmatory`: refuse a tree with uncommitted changes."""
    from ..warm_start import machine

    state = require_clean(root) if confirmatory else git_state(root)
    return {
        "machine": machine(),
        "commit": state["commit"],
        "uncommitted_changes": state["dirty"],
        "confirmatory": confirmatory,
        "versions": versions(),
        "config": resolved_config(config),
        "warm_start_sha256": weights_digest(warm_start),
        "train_pool_sha256": rows_digest(train_set),
        "held_out_sha256": rows_digest(eval_set),
    }
