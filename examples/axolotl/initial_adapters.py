"""The LoRA adapters an axolotl run started from (it saves none before its first step), drawn by replaying its
start with axolotl's own code: ``seed_model_initialization`` then ``setup_model_and_tokenizer``, as
``axolotl.train.setup_model_and_trainer`` does (axolotl 0.21.0 calls ``set_seed(seed)`` again right before
``get_peft_model``). Run with axolotl's environment by make_baselines.sh:

    /work/ax-venv/bin/python examples/axolotl/initial_adapters.py examples/axolotl/sft-lora.yaml OUT_DIR
"""

import sys

from axolotl.cli.config import load_cfg
from axolotl.train import seed_model_initialization, setup_model_and_tokenizer

out = sys.argv[2]
cfg = load_cfg(sys.argv[1], output_dir=out)  # axolotl appends its debug.log to output_dir: not the run's folder
seed_model_initialization(cfg)
model, _tokenizer, _peft_config, _processor = setup_model_and_tokenizer(cfg)
model.save_pretrained(out)
print(f"wrote {out}")
