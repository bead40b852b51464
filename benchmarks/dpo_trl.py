"""DPO under accumulation: how far each tool's (b, N) lands from its own (b·N, 1), TRL's DPOTrainer beside finetune.

The same preference pairs (the dpo-smollm2 recipe's stdlib docstring pairs, as conversations) and the same model
(SmolLM2-135M-Instruct from its GGUF file, LoRA rank 8 on q_proj / v_proj, the base with the adapters disabled as the
reference), SGD at a constant learning rate, no clipping, no dropout, sigmoid loss, β = 0.1, one epoch, the samples
in their given order. Each tool trains twice: micro-batches of ``b`` with ``N`` accumulation steps, and one batch of
``b·N``; the pair count leaves a short last window that ends in a short micro-batch (10 pairs in windows of 6:
6 = 3 + 3, then 4 = 3 + 1). Reported: max |Δ(b, N) − Δ(b·N, 1)| / max |Δ(b·N, 1)| over the adapters' weights (Δ: the
change from the initial weights), per tool — and, as a control, the same with the pairs of full windows only
(the largest multiple of b·N in the pair count: 6 of 10), where every micro-batch holds b pairs.

TRL 1.16's DPOTrainer returns each micro-batch's mean loss over its pairs, and HF Trainer divides it by the number of
micro-batches in the window (``loss_is_scaled_for_ga = False``): a micro-batch of 1 pair counts as much as one of 3.

    pip install --no-deps trl==1.16.0      # TRL is not a dependency of finetune
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/dpo_trl.py [--pairs 10 --b 3 --n 2] [--tiny]

``--tiny``: a 2-layer Llama (hidden 72) with SmolLM2's vocabulary and tokenizer instead of SmolLM2 itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

from benchmarks.common import emit_json, machine, quiet, smollm2_path, table, update_diff  # noqa: E402

TARGETS = ["q_proj", "v_proj"]
SYSTEM = "Answer in one sentence."


def pairs(n: int) -> list:
    """The first ``n`` stdlib pairs as conversations with an explicit prompt (TRL's conversational layout)."""
    from finetune.tasks import dpo

    return [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["prompt"]}],
             "chosen": [{"role": "assistant", "content": p["chosen"]}],
             "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in dpo.stdlib_pairs()[:n]]


def lora_weights(model) -> dict:
    return {k: p.detach().double().clone() for k, p in model.named_parameters() if "lora_" in k}


# ---------------------------------------------------------------------------------------------------------------
# TRL


def run_trl(path: str, rows: list, b: int, n: int, lr: float, out: Path) -> tuple:
    """TRL's DPOTrainer with LoRA, SGD, samples in order; (start weights, trained weights, seconds)."""
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):  # the windows of (b, N) and (b·N, 1) then hold the same pairs
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=b, gradient_accumulation_steps=n,
                     learning_rate=lr, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                     num_train_epochs=1, beta=0.1, loss_type=["sigmoid"], max_length=None, report_to=[],
                     save_strategy="no", logging_steps=1, seed=0, use_cpu=True, dataloader_drop_last=False,
                     disable_tqdm=True, bf16=False, fp16=False)
    lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS)
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                      peft_config=lora)
    start = lora_weights(trainer.model)
    began = time.perf_counter()
    trainer.train()
    return start, lora_weights(trainer.model), time.perf_counter() - began


# ---------------------------------------------------------------------------------------------------------------
# finetune


def run_finetune(path: str, data_file: Path, b: int, n: int, lr: float) -> tuple:
    """The dpo task through finetune's loop with the same settings; (start weights, trained weights, seconds)."""
    from finetune import loop, startup
    from finetune.loading import load_recipe

    cfg = load_recipe("dpo-smollm2", [
        f"model.name_or_path={path}", f"data.source={data_file}", "data.val_fraction=0", "data.limit=null",
        "data.system_prompt=null", "data.max_length=1024", "model.dropout=0", f"peft.target_modules={TARGETS}",
        "peft.r=8", "peft.alpha=16", f"training.batch_size={b}", f"training.gradient_accumulation_steps={n}",
        "training.effective_batch_size=null", "training.optimizer=sgd", f"training.learning_rate={lr}",
        "training.lr_scheduler=constant", "training.warmup_steps=0", "training.max_grad_norm=null",
        "training.eval_at_start=false", "training.shuffle=false"])
    job = startup.build_job(cfg)  # seeded, as a run builds it
    start = lora_weights(job.model)
    began = time.perf_counter()
    result = startup.train_job(job, cfg.training, loop.Reporting(banner=False))
    return start, lora_weights(result.model), time.perf_counter() - began


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=10, help="pairs (the control: the largest multiple of b·N)")
    parser.add_argument("--b", type=int, default=3)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama with SmolLM2's vocabulary")
    a = parser.parse_args(argv)
    try:
        import trl
    except ImportError:
        sys.exit("error: trl: not installed; pip install --no-deps trl==1.16.0")
    rows = pairs(a.pairs)
    big = a.b * a.n
    windows = [min(big, a.pairs - k) for k in range(0, a.pairs, big)]
    print(f"machine: {machine()}; trl {trl.__version__}")
    print(f"model: {'tiny 2-layer Llama' if a.tiny else 'SmolLM2-135M-Instruct'}; {a.pairs} pairs, windows "
          f"{' / '.join(map(str, windows))}, (b, N) = ({a.b}, {a.n}) against ({big}, 1); SGD lr {a.lr}, LoRA r 8 "
          f"on {', '.join(TARGETS)}")
    full = a.pairs - a.pairs % big  # the control: every window full, every micro-batch b
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = smollm2_path(a.tiny, tmp)
        for name, run in (("TRL DPOTrainer", lambda r, f, b, n: run_trl(path, r, b, n, a.lr, tmp / f"trl-{b}")),
                          ("finetune", lambda r, f, b, n: run_finetune(path, f, b, n, a.lr))):
            results[name] = {}
            for case, count in (("tail", a.pairs), ("full", full)):
                data_file = tmp / f"pairs-{count}.jsonl"
                data_file.write_text("".join(json.dumps(r) + "\n" for r in rows[:count]))
                with quiet():
                    start, small, _ = run(rows[:count], data_file, a.b, a.n)
                    start_big, one, _ = run(rows[:count], data_file, big, 1)
                assert all(torch.equal(start[k], start_big[k]) for k in start), f"{name}: other initial adapters"
                results[name][case] = update_diff(small, one, start)
                print(f"{name}, {case}: {results[name][case]:.1e}", flush=True)
    print()
    print(table(["tool", f"short last window ({' / '.join(map(str, windows))} pairs)",
                 f"every window full ({' / '.join([str(big)] * (full // big))} pairs, the control)"],
                [[k, f"{v['tail']:.1e}", f"{v['full']:.1e}"] for k, v in results.items()]))
    record = {"benchmark": "dpo_trl", "tiny": a.tiny, "pairs": a.pairs, "b": a.b, "n": a.n, "results": results}
    emit_json(record)
    return record


if __name__ == "__main__":
    main()
