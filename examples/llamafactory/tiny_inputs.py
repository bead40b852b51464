"""The inputs of the LLaMA-Factory baselines in tests/assets/llamafactory/: the tiny chat model (tests.helpers'
2-layer Llama with its ChatML tokenizer), its chat rows and preference pairs in the format LLaMA-Factory reads
(OpenAI-style ``messages``), and the ``dataset_info.json`` that names them. Run by make_baselines.sh with finetune's
environment (it imports tests.helpers); LLaMA-Factory then trains from these files in its own environment.

    python examples/llamafactory/tiny_inputs.py tests/assets/llamafactory
"""

import json
import sys
from pathlib import Path

from tests.helpers import pair_rows, write_tiny_chat

out = Path(sys.argv[1])
write_tiny_chat(out)  # out/model (weights, tokenizer, ChatML template) and out/chat.jsonl
(out / "data").mkdir(exist_ok=True)
(out / "chat.jsonl").rename(out / "data" / "chat.jsonl")
pairs = [r for r in pair_rows() if isinstance(r.get("prompt"), list)]  # the conversational pairs, prompt explicit
# LLaMA-Factory's sharegpt ranking rows: the prompt's turns, then one chosen and one rejected message
(out / "data" / "pairs.jsonl").write_text("".join(json.dumps({
    "messages": r["prompt"], "chosen": r["chosen"][0], "rejected": r["rejected"][0]}) + "\n" for r in pairs))
tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
        "system_tag": "system"}
info = {"tiny_chat": {"file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                      "tags": tags},
        "tiny_pairs": {"file_name": "pairs.jsonl", "formatting": "sharegpt", "ranking": True,
                       "columns": {"messages": "messages", "chosen": "chosen", "rejected": "rejected"},
                       "tags": tags}}
(out / "data" / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")
print(f"wrote {out}/model and {out}/data ({len(pairs)} pairs)")
