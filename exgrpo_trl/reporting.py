"""`report_to`: the loggers transformers reports to that need a package of their own, checked before any work (the
trainer when it is built, `exgrpo train` before torch is imported). Standard library only."""

from __future__ import annotations

import importlib.util

# `report_to` value -> the package its transformers callback imports
LOGGERS = {"wandb": "wandb", "trackio": "trackio", "tensorboard": "tensorboard", "mlflow": "mlflow"}


def require_loggers(report_to) -> None:
    """One line (ImportError) when a logger named in `report_to` ("wandb", ["wandb", "trackio"]) is not installed:
    transformers finds out when the Trainer is built, in a long traceback, after the model has loaded."""
    for name in [report_to] if isinstance(report_to, str) else list(report_to or []):
        module = LOGGERS.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ImportError(f"report_to: {name} needs {module}, which is not installed: pip install {module}")
