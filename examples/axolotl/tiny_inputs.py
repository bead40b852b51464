"""The inputs of the axolotl baselines in tests/assets/axolotl-*: the tiny chat model (tests.helpers' 2-layer Llama
with its ChatML tokenizer), its chat rows (OpenAI-style ``messages``, what axolotl's ``chat_template`` data set type
reads), and the same rows in the order axolotl trains them. Run by make_baselines.sh with finetune's environment (it
imports tests.helpers); axolotl then trains from these files in its own environment.

    python examples/axolotl/tiny_inputs.py tests/assets/axolotl-inputs

axolotl 0.21.0 shuffles its data set before the Trainer's sampler even when there is only one
(``axolotl.utils.data.shared.merge_datasets``: ``ds.shuffle(seed=cfg.seed)`` unless ``shuffle_merged_datasets`` is
false): ``chat-axolotl-order.jsonl`` holds the rows in that order (datasets' ``shuffle(seed=42)``, the same
permutation in datasets 5.0 and 5.2): what ``finetune import --data chat.jsonl`` writes beside its recipe
(``tests/test_axolotl_runs.py`` checks the two are the same).
"""

import sys
from pathlib import Path

from datasets import Dataset

from tests.helpers import write_tiny_chat

SEED = 42  # the YAMLs' seed
out = Path(sys.argv[1])
write_tiny_chat(out)  # out/model (weights, tokenizer, ChatML template) and out/chat.jsonl
lines = (out / "chat.jsonl").read_text().splitlines(keepends=True)
order = Dataset.from_dict({"row": list(range(len(lines)))}).shuffle(seed=SEED)["row"]
(out / "chat-axolotl-order.jsonl").write_text("".join(lines[i] for i in order))
print(f"wrote {out}/model, {out}/chat.jsonl and {out}/chat-axolotl-order.jsonl")
