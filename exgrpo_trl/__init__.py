"""ExGRPO (Experiential Group Relative Policy Optimization, arXiv 2510.02245) for Hugging Face TRL."""

__version__ = "0.1.0"

from .buffer import ExperienceBuffer
from .config import ExGRPOConfig
from .trainer import ExGRPOTrainer

__all__ = ["ExGRPOConfig", "ExGRPOTrainer", "ExperienceBuffer", "__version__"]
