"""The rows LLaMA-Factory packs for a YAML with ``packing: true``, by its own data loader, as JSON lines (input ids,
labels, position ids, attention mask): run in LLaMA-Factory's environment by make_baselines.sh.

    python examples/llamafactory/packed_rows.py examples/llamafactory/sft-packed.yaml OUT.jsonl
"""

import json
import sys

import yaml
from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
from llamafactory.hparams import get_train_args
from llamafactory.model import load_tokenizer

args = yaml.safe_load(open(sys.argv[1]))
args["output_dir"] = args["output_dir"] + "-rows"  # nothing is trained or written there
model_args, data_args, training_args, _, _ = get_train_args(args)
tokenizer_module = load_tokenizer(model_args)
template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
rows = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)["train_dataset"]
with open(sys.argv[2], "w") as f:
    for row in rows:
        f.write(json.dumps({k: row[k] for k in ("input_ids", "labels", "position_ids", "attention_mask")}) + "\n")
