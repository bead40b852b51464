"""Train the worked example's baseline with HF Trainer, on CPU, in seconds.

    HF_HUB_OFFLINE=1 python examples/trainer-baseline/train_with_trainer.py [--out runs/trainer-baseline]

1. writes a tiny Llama-type model built from a config (random weights, seed 0) and a byte-level BPE tokenizer to
   ``runs/tiny-llama`` (unless it is there): the "pretrained" checkpoint both the baseline and finetune start from;
2. fine-tunes it with ``transformers.Trainer`` on the data of ``recipe.yaml`` beside this file (the same tokenized
   samples finetune trains on, in the same indices): per-device batch 8 × accumulation 2, 2 epochs (198 samples:
   12 windows of 16 and a short one of 6 each epoch), AdamW, linear schedule with warm-up ratio 0.1, seed 42,
   every step logged, one evaluation per epoch;
3. leaves in ``--out`` what a Trainer user has: the model, ``training_args.bin``, ``trainer_state.json``, the model
   card ``README.md`` and the arguments as JSON (``training_args.json``).

``--lora`` trains LoRA adapters with the settings of the axolotl config ``tests/assets/axolotl-tiny-llama-lora.yaml``
(axolotl trains with this Trainer), e.g. ``--lora --out runs/trainer-lora-baseline``. ``--tokens-seen all`` (or
``non_padding``) has it log ``num_input_tokens_seen`` too (``tests/test_token_counts.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def write_pretrained(folder: Path) -> None:
    """The tiny Llama and its tokenizer (trained on the Python docs) — the checkpoint a baseline starts from."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.tasks.clm import pydoc_paragraphs, train_tokenizer

    tokenizer = train_tokenizer(pydoc_paragraphs(), vocab_size=512)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/trainer-baseline", help="the Trainer's output folder")
    p.add_argument("--model", default="runs/tiny-llama", help="where the tiny pretrained model is written")
    p.add_argument("--recipe", default=str(HERE / "recipe.yaml"), help="the data (and model) to train on")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (r 8, alpha 16 on q_proj and v_proj: "
                   "the settings of tests/assets/axolotl-tiny-llama-lora.yaml) instead of every weight")
    p.add_argument("--tokens-seen", default="no", choices=["no", "all", "non_padding"],
                   help="the Trainer's include_num_input_tokens_seen: log num_input_tokens_seen at every step")
    args = p.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    from finetune.loading import load_recipe
    from finetune.startup import build_job

    if not (Path(args.model) / "config.json").is_file():
        write_pretrained(Path(args.model))
    lora = ["peft.enabled=true", "peft.r=8", "peft.alpha=16", "peft.target_modules=[q_proj, v_proj]"]
    cfg = load_recipe(args.recipe, [f"model.name_or_path={args.model}", f"training.seed={args.seed}",
                                    *(lora if args.lora else [])])
    # The recipe's tokenized samples, in finetune's indices, and its model: loaded from the checkpoint (and wrapped
    # in its new LoRA adapters, drawn after the same set_seed) as a finetune run with this seed builds it.
    job = build_job(cfg)  # seeded with the recipe's seed (args.seed), then the task's build, told this launch's run
    targs = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=2,
        learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=0.1, optim="adamw_torch", weight_decay=0.01,
        max_grad_norm=1.0, seed=args.seed, logging_steps=1, eval_strategy="epoch", per_device_eval_batch_size=64,
        save_strategy="no", report_to=[], use_cpu=True, remove_unused_columns=False, disable_tqdm=True,
        include_num_input_tokens_seen=args.tokens_seen)
    trainer = Trainer(model=job.model, args=targs, train_dataset=job.train_data, eval_dataset=job.val_data,
                      data_collator=job.collate_fn, processing_class=job.tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    trainer.create_model_card(model_name=Path(args.out).name)
    (Path(args.out) / "training_args.json").write_text(targs.to_json_string())
    print(json.dumps({"out": args.out, "steps": trainer.state.global_step,
                      "final_loss": trainer.state.log_history[-3].get("loss")}))


if __name__ == "__main__":
    main()
