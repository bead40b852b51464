"""Writes the run folders of this directory with the installed libraries' own classes (see PROVENANCE.md): each
arguments file is ``<Config>(...).to_json_string()`` of TRL's or transformers' class, each config.json
``<Config>().to_json_file``; the trainer_state.json logs are small hand-written ones of the columns each trainer logs.

    python tests/assets/corpus/trl/make_runs.py
"""

import json
from pathlib import Path

import transformers
import trl

HERE = Path(__file__).parent
LLAMA = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=256, architectures=["LlamaForCausalLM"])
T5 = transformers.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=256,
                           architectures=["T5ForConditionalGeneration"])


def run(name, args, config, logged: dict) -> None:
    folder = HERE / name
    folder.mkdir(exist_ok=True)
    if args is not None:
        (folder / "training_args.json").write_text(args.to_json_string())
    config.to_json_file(folder / "config.json")
    history = [{"epoch": 0.5 * step, "step": step, "loss": 0.69 - 0.1 * step, "learning_rate": 1e-5, **logged}
               for step in (1, 2)]
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 2, "max_steps": 2, "num_train_epochs": 1,
                                                           "train_batch_size": 4, "log_history": history}, indent=2))


common = {"output_dir": "out", "learning_rate": 5e-6, "per_device_train_batch_size": 4, "report_to": "none",
          "bf16": False}
run("dpo-config-run", trl.DPOConfig(**common), LLAMA, {"rewards/chosen": 0.1, "rewards/margins": 0.2})
run("grpo-config-run", trl.GRPOConfig(**common, num_generations=4), LLAMA, {"reward": 0.5, "reward_std": 0.1})
run("sft-config-run", trl.SFTConfig(**common), LLAMA, {"mean_token_accuracy": 0.4})
run("kto-config-run", trl.KTOConfig(**common), LLAMA, {"rewards/chosen": 0.1, "kl": 0.0})
run("reward-config-run", trl.RewardConfig(**common), LLAMA, {})
run("dpo-log-only", None, LLAMA, {"rewards/chosen": 0.1, "rewards/margins": 0.2})
run("grpo-log-only", None, LLAMA, {"reward": 0.5, "reward_std": 0.1})
run("trainer-clm-run", transformers.TrainingArguments(**common), LLAMA, {})
run("t5-trainer-run", transformers.TrainingArguments(**common), T5, {})
run("t5-seq2seq-run", transformers.Seq2SeqTrainingArguments(**common, predict_with_generate=True), T5, {})
