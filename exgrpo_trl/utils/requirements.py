"""Optional dependencies, checked before a command does any work.

A command that needs a package outside the core dependencies calls `require` first, so that a missing package is one
line naming what to install, at once, and not a `ModuleNotFoundError` after minutes of training. `find_spec` only
looks the package up: nothing is imported.
"""

from __future__ import annotations

import importlib.util

__all__ = ["MissingDependency", "OPTIONAL", "require", "missing"]

# import name -> (distribution to pip install, the exgrpo-trl extra that brings it)
OPTIONAL = {
    "matplotlib": ("matplotlib", "demo"),
    "vllm": ("vllm", "vllm"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "nbclient": ("nbclient", "notebook"),
    "math_verify": ("math-verify[antlr4-13-2]", None),  # a core dependency: only a broken environment lacks it
}


class MissingDependency(ImportError):
    """A package a command or option needs is not installed; the message says what to install."""


def missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a parent package that fails to import, or a module with no spec
        return True


def require(module: str, what: str) -> None:
    """Raise `MissingDependency` when `module` cannot be imported. `what` names who needs it (``exgrpo eval``,
    ``--plot``, ``use_vllm``) and starts the message."""
    if not missing(module):
        return
    dist, extra = OPTIONAL.get(module, (module, None))
    # what a user can run: the package is installed from a clone or a wheel, not from an index
    how = f"pip install '{dist}'" + (f" (or, in the repository's folder, pip install '.[{extra}]')" if extra else "")
    raise MissingDependency(f"{what} needs {module}, which is not installed: {how}")
