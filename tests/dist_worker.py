"""Run by tests/test_distributed.py under `accelerate launch` (W processes) and in-process (W = 1).

Trains the same tiny models (and the custom-model recipes at small shapes) with the same effective batch and saves,
from the main process, the final weights and the per-step history so the test can compare W = 2 with W = 1.
"""

import json
import sys

import torch

from finetune import distributed, test_fine_tuning
from finetune.loading import load_recipe
from finetune.startup import build_job
from tests.helpers import (
    EXACT,
    MLP,
    SMALL,
    flat,
    pad_collate,
    regression_data,
    tiny_chat_assets,
    tiny_gpt2,
    tiny_pairs_assets,
    token_data,
    train_quietly,
)

# (name, effective batch split, dataset): tails chosen so the last window splits unevenly over 2 processes
CASES = {
    # 41 samples, B = 12: tail of 5 → micro-batches of 3 and 2 on the two ranks
    "mlp_uneven": dict(data=lambda: regression_data(41), model=lambda: MLP(), b=3, effective=12, kw={}),
    # 41 samples, B = 8: tail of 1 → the second rank has no sample and joins with a weight-0 placeholder
    "mlp_idle_rank": dict(data=lambda: regression_data(41), model=lambda: MLP(), b=2, effective=8, kw={}),
    # padded causal LM: token counts differ per rank and per micro-batch
    "gpt2_tokens": dict(data=lambda: token_data(27), model=lambda: tiny_gpt2(), b=2, effective=8,
                        kw={"collate_fn": pad_collate, "packing": False}),
    # packed rows (2 rows a micro-batch): rows and their token counts differ per rank
    "gpt2_packed": dict(data=lambda: token_data(27, hi=20), model=lambda: tiny_gpt2(), b=2, effective=8,
                        kw={"collate_fn": pad_collate, "packing": True}),
    # length-sorted windows cut by a token budget: micro-batch sizes and counts vary per window and per rank
    "gpt2_token_budget": dict(data=lambda: token_data(27, hi=20), model=lambda: tiny_gpt2(), b=2, effective=8,
                              kw={"collate_fn": pad_collate, "sort_within_window": True, "packing": False,
                                  "max_tokens_per_micro_batch": 30,
                                  "length_of": lambda i, d=token_data(27, hi=20): len(d[i]["input_ids"])}),
    # a 4-bit NF4 base (bitsandbytes, loaded by the user as transformers does it) with LoRA adapters: only the
    # adapters train and are compared; the padded token counts differ per rank
    "qlora_nf4": dict(data=lambda: token_data(27), model=lambda: qlora_model(), b=2, effective=8,
                      kw={"collate_fn": pad_collate, "packing": False}, trainable_only=True),
}


def qlora_model():
    """The tiny chat Llama with its linear layers in NF4 (double quantization, fp32 compute) and LoRA adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_assets()["model"], quantization_config=quantization)
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0))


# custom-model recipes through the same loop (22 samples, B = 12: the tail window of 10 splits 6 / 4 over 2 ranks;
# the VAE-GAN with 25, an idle rank): two optimizers, R1, per-sample noise and loss terms must hold across processes
CUSTOM = {
    "vae-digits": ["training.learning_rate=0.2", "model.d_learning_rate=0.1", "model.r1_gamma=5", "data.limit=25"],
    "ode-latent": ["model.ode_memory=checkpoint", "model.solver=rk4", "training.learning_rate=0.5"],
    "video-motion": ["training.learning_rate=0.05", "model.checkpoint_frames=true"],
    # chat SFT on the tiny Llama: assistant-token counts differ per rank; evaluation generates on each rank's share
    "sft-smollm2": ["peft.enabled=false", "training.learning_rate=0.5"],
    # the same rows streamed a block at a time: both processes read each window, each collates its share
    "sft-smollm2:streaming": ["peft.enabled=false", "training.learning_rate=0.5", "data.streaming=true",
                              "data.val_fraction=0", "data.too_long=keep_start", "data.stream_block=5"],
    # preference pairs: pairs per rank differ in the tail; the frozen reference copy; held-out rewards gathered
    "dpo-smollm2": ["peft.enabled=false", "training.learning_rate=0.5"],
    # GRPO: the processes take turns at the generation batch's chunks of 2 prompts and gather them; token counts
    # (dapo) summed over the ranks; 22 prompts × 4 completions in generation batches of 24: the last holds 16, its
    # second window 4
    "grpo-smollm2": ["peft.enabled=false", "training.learning_rate=0.5", "model.generation_batch_size=24",
                     "model.generation_chunk=2", "training.epochs=1"],
}


COLLECTIVES = ("barrier", "all_reduce", "all_gather", "all_gather_object", "gather_object", "broadcast",
               "broadcast_object_list", "all_gather_into_tensor", "reduce_scatter_tensor")


def record_collectives() -> list:
    """The names of the torch.distributed calls this process makes from Python, in order."""
    calls = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(torch.distributed, name, recorded(name, getattr(torch.distributed, name)))
    return calls


def run(name, processes):
    if name in CUSTOM:
        if name.startswith(("sft", "grpo")):
            tiny_chat_assets()
        if name.startswith("dpo"):
            tiny_pairs_assets()
        recipe = name.split(":")[0]  # recipe:variant
        cfg = load_recipe(recipe, [*SMALL[recipe], *EXACT, "training.batch_size=3",
                                 f"training.gradient_accumulation_steps={4 // processes}", *CUSTOM[name]])
        job = build_job(cfg)  # seeded, and told the run (TaskContext), as a recipe run builds it
        generated = count_generated(job)
        result = train_quietly(job, cfg.training)
    else:
        case = CASES[name]
        torch.manual_seed(0)
        model = case["model"]()
        n = case["effective"] // (case["b"] * processes)
        result = test_fine_tuning(model, train_data=case["data"](), val_data=case["data"]()[:9],
                                  batch_size=case["b"], gradient_accumulation_steps=n, optimizer="sgd",
                                  learning_rate=0.3, max_grad_norm=None, n_epochs=2, seed=11, **case["kw"])
    # the launcher's RANK, which the package asks, names the same main process as Accelerate
    assert distributed.is_main_process() == result["accelerator"].is_main_process
    trainable_only = CASES.get(name, {}).get("trainable_only", False)
    return {"weights": flat(result["model"], trainable_only).tolist(), "lr": result["lr_history"],
            "history": [{k: v for k, v in h.items() if k != "seconds"} for h in result["history"]],
            "val": result["val_history"], "effective": result["effective_batch_size"],
            "processes": result["accelerator"].num_processes, "main": result["accelerator"].is_main_process,
            "shutdown_at_exit": bool(distributed._shutdown_registered),
            **(rollouts_of(job, generated) if name.startswith("grpo") else {})}


def count_generated(job) -> list:
    """For a grpo job: a list that grows by the prompts this process samples completions for."""
    generator = getattr(job.before_window, "__self__", None)
    if generator is None or not hasattr(generator, "sample"):
        return []
    counted, sample = [], generator.sample
    generator.sample = lambda prompts, device: counted.extend(p["id"] for p in prompts) or sample(prompts, device)
    return counted


def rollouts_of(job, generated: list) -> dict:
    """The run's rollouts (completion tokens, rewards) and the prompts this process generated for."""
    log = next(c for c in job.checkpointed if hasattr(c, "log")).log
    return {"rollouts": [{k: r[k] for k in ("epoch", "batch", "prompts", "completions", "rewards")} for r in log],
            "generated": generated}


if __name__ == "__main__":
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else [*CASES, *CUSTOM]
    calls = record_collectives()
    out = {}
    for name in names:
        out[name] = run(name, processes=int(sys.argv[2]))
        out[name]["collectives"], calls[:] = list(calls), []
    if all(v["main"] for v in out.values()):
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
