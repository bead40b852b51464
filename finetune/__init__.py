"""finetune: reproduce a big-batch fine-tuning baseline on a small GPU with exact gradient accumulation."""

import logging

from finetune.api import test_fine_tuning
from finetune.config import RecipeConfig, TrainingConfig
from finetune.errors import ConfigError
from finetune.job import Job
from finetune.loading import load_recipe

__all__ = ["test_fine_tuning", "ConfigError", "RecipeConfig", "TrainingConfig", "load_recipe", "Job"]
__version__ = "0.1.0"

# bitsandbytes, which peft imports whenever it is installed, warns on import on CPUs with AVX512-BF16 that an
# optional package with a faster 4-bit inference kernel is missing; training never uses that kernel
# (finetune.models.precision turns it off). Its 8-bit matmul warns that it casts inputs to fp16 on every call
# of every int8 layer in evaluation (docs/low-precision.md says so once). Both would only be noise on every run.
for _name in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
    logging.getLogger(_name).setLevel(logging.ERROR)
