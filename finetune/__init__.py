"""finetune: reproduce a big-batch fine-tuning baseline on a small GPU with exact gradient accumulation."""

from finetune.api import test_fine_tuning
from finetune.config import ConfigError, RecipeConfig, TrainingConfig, load_recipe
from finetune.job import Job

__all__ = ["test_fine_tuning", "ConfigError", "RecipeConfig", "TrainingConfig", "load_recipe", "Job"]
__version__ = "0.1.0"
