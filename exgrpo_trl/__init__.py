"""ExGRPO (Experiential Group Relative Policy Optimization, arXiv 2510.02245) for Hugging Face TRL."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = [
    "ExGRPOConfig", "ExGRPORun", "ExGRPOSettings", "ExGRPOState", "ExGRPOTrainer", "ExperienceBuffer", "__version__"
]  # fmt: skip

# Lazy attributes: `import exgrpo_trl.tasks.toy` or the CLI should not pay for importing trl.
_LAZY = {
    "ExGRPOConfig": "exgrpo_trl.config",
    "ExGRPORun": "exgrpo_trl.run",
    "ExGRPOSettings": "exgrpo_trl.settings",
    "ExGRPOState": "exgrpo_trl.training_state",
    "ExGRPOTrainer": "exgrpo_trl.trainer",
    "ExperienceBuffer": "exgrpo_trl.buffer",
}

if TYPE_CHECKING:
    from .buffer import ExperienceBuffer
    from .config import ExGRPOConfig
    from .run import ExGRPORun
    from .settings import ExGRPOSettings
    from .trainer import ExGRPOTrainer
    from .training_state import ExGRPOState


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'exgrpo_trl' has no attribute {name!r}")
