"""What does accumulation cost in memory, what do checkpointing and the chunked loss head save (and cost in time),
and how close is ``finetune plan``'s prediction of a step's peak?

    PYTHONPATH=. python benchmarks/memory.py --quick     # ~15 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/memory.py             # a larger grid, SmolLM2 at 8 × 512 tokens (~1 h)
    PYTHONPATH=. python benchmarks/memory.py --quick --sections lowprec   # the low-precision rows alone

Models: the pretrained MiniLM (sequence classification) on Python-docs paragraphs padded or cut to 128 tokens; the
clm-pydoc recipe's GPT-2 on 128-token blocks of the Python docs; SmolLM2-135M-Instruct (the sft-smollm2 recipe's
model) on 512-token blocks (``--quick``: 128). Every micro-batch has the same shape, so memory is a function of b.

* **Peak of one optimizer step**, through finetune's loop (``plan_command.training_peak``: two windows of N
  micro-batches of b samples, AdamW; the second step is the steady one): the most bytes allocated at any moment,
  weights included.
  On CUDA ``torch.cuda.max_memory_allocated``; on a CPU the same quantity from the allocator's own record
  (``torch.profiler`` with ``profile_memory``: every allocation and free, in order) — deterministic, unlike the
  process's RSS, which also holds the allocator's cache and the libraries.
* **The planner's prediction** of that peak (``finetune plan``'s model: micro-batches of 1 and 2 samples measured
  per setting, extrapolated), and its error.
* **Activation bytes of one micro-batch**: what a training-mode forward leaves allocated for the backward.
* **Gradient checkpointing** on and off: activation bytes, step peak and time per step (interleaved repetitions,
  medians). For SmolLM2: plain, + checkpointing, + the chunked loss head, + both, and the peak above weights +
  gradients + optimizer state (the part these settings act on); offloading's rows are predicted only (CUDA).
* **Low-precision weights** (section ``lowprec``): SmolLM2 loaded as the sft recipe loads it with ``model.dtype: bf16``,
  ``model.quantization: nf4`` (double quantization), both, and ``training.optimizer: adamw8bit`` in full fine-tuning,
  against the fp32 LoRA and fp32 AdamW rows of the same run, at 2 × 512 tokens (more than one chunk of the loss
  head), fp32 compute, checkpointing and the chunked head on: the fixed part (weights with the 4-bit quantization
  state, gradients, optimizer state), the step peak and the step time. Then TRL's ``SFTTrainer`` (if ``trl`` is
  installed) on the same QLoRA step: its step peak, measured the same way, and tokens/s beside finetune's.

Accumulation keeps only one micro-batch's activations alive at a time; what it adds over a single micro-batch is
the gradient buffer during the second and later forwards (at N = 1 the step's peak comes before the gradients exist)
and the window's inputs, which the loop collates ahead to count its items. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
import torch  # noqa: E402

from finetune import (
    loop,  # noqa: E402
    startup,  # noqa: E402
)
from finetune.config import TrainingConfig  # noqa: E402
from finetune.job import Job  # noqa: E402
from finetune.memory.measure import PeakMeter  # noqa: E402
from finetune.memory.plan import PlanRequest, make_plan  # noqa: E402
from finetune.memory.step import Setting  # noqa: E402
from finetune.models.forward import enable_gradient_checkpointing  # noqa: E402
from finetune.plan_command import training_peak  # noqa: E402

MB = 2 ** 20
SEQ = 128


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def fixed_length(samples, tokenizer, pad_to: int = SEQ) -> list:
    """Every sample exactly ``pad_to`` tokens (cut, or padded with attention_mask 0): equal micro-batches."""
    out = []
    for s in samples:
        ids = list(s["input_ids"][:pad_to])
        mask = [1] * len(ids) + [0] * (pad_to - len(ids))
        out.append({**s, "input_ids": ids + [tokenizer.pad_token_id] * (pad_to - len(ids)), "attention_mask": mask})
    return out


def text_blocks(tokenizer, n: int, seq: int) -> list:
    """``n`` samples of exactly ``seq`` tokens: the Python docs' paragraphs end to end, cut into blocks (no padding:
    the chunked loss head works on real tokens only, so padded samples would make memory depend on the text)."""
    from finetune.tasks.clm import pydoc_paragraphs

    ids = tokenizer("\n\n".join(pydoc_paragraphs()[:4000]))["input_ids"]
    assert len(ids) >= n * seq, "not enough text for the blocks"
    return [{"input_ids": ids[i * seq:(i + 1) * seq]} for i in range(n)]


def clm_collate(samples) -> dict:
    """Blocks of equal length: labels are the inputs (the model shifts them)."""
    from transformers import default_data_collator

    batch = default_data_collator(samples)
    batch["labels"] = batch["input_ids"].clone()
    return batch


def workloads(n: int) -> dict:
    """name → (model, data of n samples of SEQ tokens, collate)."""
    from transformers import default_data_collator

    minilm, mtok = C.minilm()
    ptok = C.pydoc_tokenizer()
    gpt2 = C.tiny_gpt2(ptok)
    texts = C.pydoc_samples(mtok, n, seq_len=SEQ)  # Python-docs paragraphs, in MiniLM's tokens, with a class label
    cls = fixed_length([{**s, "labels": i % 2} for i, s in enumerate(texts)], mtok)
    return {"MiniLM": (minilm, cls, default_data_collator), "GPT-2": (gpt2, text_blocks(ptok, n, SEQ), clm_collate)}


def training(b: int, n: int, steps: int, checkpointing: bool = False, chunked=None,
             optimizer: str = "adamw") -> TrainingConfig:
    """finetune's settings for ``steps`` windows of b × N fixed-length samples (AdamW unless ``optimizer``, unpacked:
    every micro-batch the same shape); ``chunked``: the loss head (None: the loop's default, chunked on a supported
    causal LM)."""
    return TrainingConfig(batch_size=b, gradient_accumulation_steps=n, max_steps=steps, learning_rate=1e-5,
                          shuffle=False, sort_within_window=False, packing=False, gradient_checkpointing=checkpointing,
                          chunked_loss=chunked, optimizer=optimizer)


def finetune_steps(model, data, collate, b: int, n: int, steps: int, checkpointing: bool = False,
                   before_window=None, chunked=None) -> dict:
    """finetune's loop over ``steps`` windows of b × N samples (AdamW); returns its result."""
    job = Job(model=model, train_data=data[:b * n * steps], collate_fn=collate, before_window=before_window)
    with C.quiet():
        t = training(b, n, steps, checkpointing, chunked)
        return startup.train_job(job, t, loop.Reporting(banner=False))


def accelerate_steps(model, data, collate, b: int, n: int, steps: int, before_window=None) -> None:
    """The documented Accelerate loop (``accumulate()``, prepared DataLoader) over ``steps`` windows, AdamW."""
    from accelerate import Accelerator

    C.restart_accelerate_state()
    accelerator = Accelerator(gradient_accumulation_steps=n, cpu=C.DEVICE.type == "cpu")
    opt = C.optimizer_for(model.parameters(), "adamw", 1e-5)
    loader = torch.utils.data.DataLoader(data[:b * n * steps], batch_size=b, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    for i, batch in enumerate(loader):
        if i % n == 0 and before_window is not None:
            before_window(i // n)
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch)["loss"])
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()


def step_peak(model, data, collate, b: int, n: int, checkpointing: bool = False, tool: str = "finetune",
              chunked=None) -> tuple[int, dict]:
    """(the most bytes allocated at any moment of two optimizer steps of b × N, weights included — the second step
    is the steady one: AdamW's moments exist; finetune's history, or None for the hand Accelerate loop)."""
    model = C.copy_model(model).to(C.DEVICE)
    if tool == "finetune":
        job = Job(model=model, train_data=data[:b * n * 2], collate_fn=collate)
        with C.quiet():
            peak, result = training_peak(job, training(b, n, 2, checkpointing, chunked))
        return peak, result["history"]
    held = 0 if C.DEVICE.type == "cuda" else param_bytes(model)
    with PeakMeter(C.DEVICE) as meter:
        accelerate_steps(model, data, collate, b, n, 2)
    return held + meter.peak, None


def plan_for(model, data, collate, effective: int) -> object:
    """``finetune plan``'s model of the step, every setting measured (micro-batches of 1 and 2 samples)."""
    batches = [{k: v.to(C.DEVICE) for k, v in collate(data[:k]).items()} for k in (1, 2)]
    with C.quiet():
        return make_plan(C.copy_model(model).to(C.DEVICE), batches,
                         PlanRequest("80GiB", effective, training(1, 1, 1), every_setting=True),
                         enable_gradient_checkpointing=enable_gradient_checkpointing)


def activation_bytes(model, data, collate, b: int, checkpointing: bool = False) -> int:
    """Bytes a training-mode forward of one micro-batch leaves allocated for its backward."""
    model = C.copy_model(model).to(C.DEVICE).train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    batch = {k: v.to(C.DEVICE) for k, v in collate(data[:b]).items()}
    with PeakMeter(C.DEVICE) as m:
        out = model(**batch)
    del out
    return m.net


def step_seconds(model, data, collate, b: int, checkpointing: bool, steps: int) -> float:
    """Median time of finetune's optimizer steps after the first (N = 1)."""
    result = finetune_steps(C.copy_model(model).to(C.DEVICE), data, collate, b, 1, steps, checkpointing)
    return C.median([h["seconds"] for h in result["history"][1:]])


def plot(path, record: dict, b: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(4.2 * len(record["models"]), 3.4))
    for ax, (name, res) in zip(axes, record["models"].items()):
        acc = [r for r in res["accumulation"] if r["micro_batch"] == b]
        big = [r for r in res["accumulation"] if r["accum"] == 1]
        ax.plot([r["micro_batch"] * r["accum"] for r in acc], [r["peak_mb"] for r in acc], "o-",
                label=f"micro-batch {b}, N accumulation steps")
        ax.plot([r["micro_batch"] for r in big], [r["peak_mb"] for r in big], "s--", label="one micro-batch (N = 1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("samples per optimizer step")
        ax.set_ylabel("step peak MB")
        ax.set_title(f"{name} ({res['params_mb']:.0f} MB of parameters)", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"![step peak]({Path(path).name})\n")


def smollm2(n: int, seq: int):
    """SmolLM2-135M-Instruct (the sft-smollm2 recipe's model, fp32, dropout off) and ``n`` blocks of ``seq`` tokens
    of the Python docs in its tokenizer: (model, samples, collate)."""
    from finetune.loading import load_recipe
    from finetune.models.forward import set_dropout
    from finetune.tasks import chat

    model, tokenizer = chat.load_model(load_recipe("sft-smollm2").model)
    set_dropout(model, 0.0)
    return model, text_blocks(tokenizer, n, seq), clm_collate


SMOLLM_ROWS = {"plain": Setting(), "+ checkpointing": Setting(checkpointing=True),
               "+ chunked loss": Setting(chunked_loss=True),
               "+ both": Setting(checkpointing=True, chunked_loss=True)}


def smollm_section(quick: bool, record: dict) -> list:
    """SmolLM2: step peak and time for plain, + checkpointing, + chunked loss, + both, and the planner's prediction
    of each; the peak also above weights + gradients + optimizer state. Returns the planner's relative errors."""
    b, seq, n = (2, 128, 2) if quick else (8, 512, 2)
    model, data, collate = smollm2(b * n * 2, seq)
    plan = plan_for(model, data, collate, b * n)
    base = plan.profile(Setting())
    fixed = base.weights + base.gradients + base.optimizer_state
    res, errors, rows = {}, [], []
    for label, setting in SMOLLM_ROWS.items():
        peak, history = step_peak(model, data, collate, b, n, setting.checkpointing, chunked=setting.chunked_loss)
        predicted = plan.predict(b, n, setting)
        errors.append(predicted / peak - 1)
        res[label] = {"peak_mb": peak / MB, "above_fixed_mb": (peak - fixed) / MB, "step_s": history[-1]["seconds"],
                      "planned_mb": predicted / MB}
    plain = res["plain"]
    for label, r in res.items():
        rows.append([label, f"{r['peak_mb']:.0f}", f"{r['above_fixed_mb']:.0f}",
                     f"{r['above_fixed_mb'] / plain['above_fixed_mb']:.2f}", f"{r['step_s']:.1f}",
                     f"{r['step_s'] / plain['step_s']:.2f}", f"{r['planned_mb']:.0f}",
                     f"{r['planned_mb'] / r['peak_mb'] - 1:+.1%}"])
    for label, setting in [("chunked loss + offloading", Setting(chunked_loss=True, offload=True)),
                           ("both + offloading", Setting(checkpointing=True, chunked_loss=True, offload=True))]:
        predicted = plan.predict(b, n, setting)
        rows.append([label + " (CUDA only)", "", "", f"{(predicted - fixed) / MB / plain['above_fixed_mb']:.2f}",
                     "", "", f"{predicted / MB:.0f}", "predicted"])
    print(f"## SmolLM2-135M-Instruct: the step's memory settings ({b} × {seq} tokens, N = {n}, AdamW, fp32)\n")
    print(f"Weights + gradients + optimizer state: {fixed / MB:.0f} MB (the fixed part). Step time: the second "
          "step's, one run each.\n")
    print(C.table(["setting", "step peak MB", "above the fixed part MB", "÷ plain (above)", "step s", "÷ plain",
                   "planner MB", "planner error"], rows))
    ckpt, both = res["+ checkpointing"], res["+ both"]
    record["smollm2"] = {"micro_batch": b, "tokens": seq, "accum": n, "fixed_mb": fixed / MB, "rows": res}
    record["smollm_extra_peak_ratio_both"] = both["above_fixed_mb"] / plain["above_fixed_mb"]
    record["smollm_chunked_saving"] = 1 - both["above_fixed_mb"] / ckpt["above_fixed_mb"]
    record["smollm_time_ratio_both"] = both["step_s"] / plain["step_s"]
    print(f"\nBoth ÷ plain above the fixed part: {record['smollm_extra_peak_ratio_both']:.3f}; the chunked head's "
          f"saving on the checkpointed run: {record['smollm_chunked_saving']:.1%}; both ÷ plain step time: "
          f"{record['smollm_time_ratio_both']:.2f}.\n")
    return errors


# ---------------------------------------------------------------------------------------------------------------
# low-precision weights: bf16 and NF4 bases with LoRA, AdamW8bit, and TRL's SFTTrainer on the same QLoRA step

# label → the sft recipe's overrides. The LoRA rows compare with the fp32 LoRA row, the 8-bit row with fp32 AdamW.
LOW_PRECISION_ROWS = {
    "fp32 base + LoRA": [],
    "bf16 base + LoRA": ["model.dtype=bf16"],
    "NF4 base + LoRA": ["model.quantization=nf4"],
    "NF4 + bf16 base + LoRA": ["model.quantization=nf4", "model.dtype=bf16"],
    "full, AdamW": ["peft.enabled=false"],
    "full, AdamW8bit": ["peft.enabled=false", "training.optimizer=adamw8bit"],
}
BASELINE = {label: "full, AdamW" if "peft.enabled=false" in o else "fp32 base + LoRA"
            for label, o in LOW_PRECISION_ROWS.items()}
QLORA = "NF4 base + LoRA"  # what TRL runs too: `--set model.quantization=nf4` on the recipe


def sft_model(overrides: list, lora: bool = True):
    """The sft-smollm2 recipe's model (SmolLM2-135M-Instruct unless ``overrides`` set ``model.name_or_path``) as the
    sft task loads it (``model.dtype`` / ``model.quantization`` through ``precision_kwargs``, LoRA by
    ``apply_peft``; ``lora=False``: the base it would wrap), dropout off: (model, tokenizer, recipe)."""
    from finetune.loading import load_recipe
    from finetune.models.forward import set_dropout
    from finetune.models.hf import apply_peft, precision_kwargs
    from finetune.tasks import chat

    cfg = load_recipe("sft-smollm2", overrides)
    with C.quiet():
        model, tokenizer = chat.load_model(cfg.model, **precision_kwargs(cfg))
    set_dropout(model, 0.0)
    return (apply_peft(model, cfg.peft, "CAUSAL_LM", "no") if lora else model).train(), tokenizer, cfg


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def quant_state_tensors(model) -> list:
    """bitsandbytes' per-block scales and code books of every 4-bit weight (attributes of the weight, not parameters
    or buffers: ``param_bytes`` does not see them)."""
    out = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:  # double quantization: the scales have scales of their own (state2)
            out += [state.absmax, state.code, getattr(state, "offset", None)]
            state = getattr(state, "state2", None)
    return out


def weight_bytes(model) -> int:
    """What the model holds before a step: parameters, buffers and 4-bit quantization state."""
    return tensor_bytes([*model.parameters(), *model.buffers(), *quant_state_tensors(model)])


def optimizer_bytes(model, optimizer: str) -> tuple[int, int]:
    """(bytes of ``optimizer``'s state for ``model``'s trainable weights, the most bytes a steady step of it allocates
    on top): built by the loop's own ``make_optimizer``, stepped twice on zero gradients (the state exists after the
    first step), the second under the allocator's record. Changes the weights: call it on a model that has done its
    training."""
    from finetune.optim import make_optimizer

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(model, TrainingConfig(optimizer=optimizer, learning_rate=0.0))
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    with PeakMeter(C.DEVICE) as meter:
        opt.step()
    held = tensor_bytes([v for s in opt.state.values() for v in s.values()])
    for p in trainable:
        p.grad = None
    return held, meter.peak


def quantized_share(model) -> dict:
    """For a model with 4-bit layers: the bytes of those layers' weights with their quantization state, and what the
    same weights take in fp32 (the part of the model bitsandbytes quantizes: the projections, not the embedding,
    norms or head)."""
    from finetune.models.precision import quantized_modules

    layers = [m for _, m in quantized_modules(model)]
    if not layers:
        return {}
    held = tensor_bytes([t for m in layers for t in [m.weight, *quant_state_tensors(m)]])
    return {"quantized_layers_mb": held / MB, "quantized_layers_fp32_mb": sum(
        m.weight.quant_state.shape.numel() * 4 for m in layers) / MB}


def step_times(marks: list) -> list:
    """(wall, CPU) seconds between consecutive ``C.clocks()`` marks. CPU time of the process: on this shared machine
    the wall clock also counts the time other jobs held the core."""
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]


def finetune_clocked(model, data, collate, t: TrainingConfig) -> list:
    """``loop.train`` over ``t.max_steps`` windows; returns (wall, CPU) seconds of each optimizer step (from one
    window's start, its micro-batches fetched, to the next's)."""
    marks = []
    job = Job(model=model, train_data=data[:t.batch_size * t.gradient_accumulation_steps * t.max_steps],
              collate_fn=collate, before_window=lambda state: marks.append(C.clocks()))
    with C.quiet():
        startup.train_job(job, t, loop.Reporting(banner=False))
    return step_times([*marks, C.clocks()])


def metered_steps(model, data, collate, t: TrainingConfig) -> tuple[int, list]:
    """(the most bytes allocated at any moment of ``loop.train``, weights included as ``weight_bytes`` counts them;
    each step's (wall, CPU) seconds). ``plan_command.training_peak`` with the 4-bit quantization state counted among the
    weights."""
    held = weight_bytes(model)
    with PeakMeter(C.DEVICE) as meter:
        seconds = finetune_clocked(model, data, collate, t)
    return held + meter.peak, seconds


def trl_trainer(model, tokenizer, cfg, data, b: int, n: int, steps: int, on_step_end=None):
    """TRL's ``SFTTrainer`` on the recipe's NF4 base (before LoRA) with the recipe's LoRA settings, on the same
    blocks, at b × N, fp32 compute (``bf16=False``: its default is bf16), gradient checkpointing on (its default,
    non-reentrant as ours), its default fused AdamW. TRL casts a quantized model's adapters to bf16; they are put back
    to fp32 master weights, as finetune keeps them (so both train the same fp32 adapters on the same NF4 base)."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            on_step_end()

    args = SFTConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), per_device_train_batch_size=b,
                     gradient_accumulation_steps=n, max_steps=steps, learning_rate=1e-5, bf16=False, fp16=False,
                     gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                     max_length=None, packing=False, padding_free=False, use_cpu=C.DEVICE.type == "cpu",
                     report_to="none", save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True,
                     dataloader_num_workers=0, seed=0)
    p = cfg.peft
    lora = LoraConfig(task_type="CAUSAL_LM", r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                      target_modules=list(p.target_modules))
    with C.quiet():
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(data[:b * n * steps]),
                             processing_class=tokenizer, peft_config=lora,
                             callbacks=[StepClock()] if on_step_end else None)
    for q in trainer.model.parameters():
        if q.requires_grad:
            q.data = q.data.float()
    return trainer


def trl_peak(base: list, data, b: int, n: int) -> int:
    """The most bytes allocated at any moment of two optimizer steps of TRL's SFTTrainer, weights (with its LoRA
    adapters) included as for finetune's rows."""
    model, tokenizer, cfg = sft_model([*base, *LOW_PRECISION_ROWS[QLORA]], lora=False)
    trainer = trl_trainer(model, tokenizer, cfg, data, b, n, 2)
    held = weight_bytes(trainer.model)
    with PeakMeter(C.DEVICE) as meter, C.quiet():
        trainer.train()
    shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # nothing saved (save_strategy "no"): an empty folder
    base_model = trainer.model.get_base_model()
    assert getattr(base_model, "is_activation_checkpointing", None) or base_model.is_gradient_checkpointing, \
        "TRL ran without gradient checkpointing"
    return held + meter.peak


def head_peaks(model, tokens: int) -> dict:
    """The loss heads alone: the most bytes allocated by a forward and backward of TRL's fused head (with the
    entropy and top-1 outputs SFTTrainer asks of it) and of finetune's chunked head, over ``tokens`` random hidden
    states through ``model``'s frozen output layer (what TRL's step holds beyond finetune's is mostly here)."""
    from trl.kernels import ChunkedLogProbFunction

    from finetune.models.loss_head import Head, chunked_linear_cross_entropy

    weight = model.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, weight.shape[0], (tokens,), generator=g)
    out = {}
    for tool in ("finetune", "TRL"):
        hidden = torch.randn(tokens, weight.shape[1], generator=g).to(weight).requires_grad_()
        with PeakMeter(C.DEVICE) as meter:
            if tool == "TRL":  # SFTTrainer's call: 32 768-word vocabulary tiles, log-probs, entropy and top-1
                loss = -ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0,
                                                     ("log_probs", "entropy", "is_top1"))[0].sum()
            else:
                loss = chunked_linear_cross_entropy(hidden, Head(weight), targets)
            loss.backward()
        out[tool] = meter.peak
    return out


def tokens_per_second(tool: str, base: list, data, b: int, n: int, seq: int, steps: int) -> tuple:
    """(wall, CPU) tokens per second of ``steps`` optimizer steps of QLoRA at b × N (the first step, a warm-up, left
    out) through finetune's loop or TRL's SFTTrainer, with the same settings, without the profiler. Each step is
    timed from the end of the previous one's update: its window's micro-batches fetched, forward, backward, update."""
    if tool == "finetune":
        model, _, _ = sft_model([*base, *LOW_PRECISION_ROWS[QLORA]])
        seconds = finetune_clocked(model, data, clm_collate, training(b, n, steps, True, True))[1:]
    else:
        model, tokenizer, cfg = sft_model([*base, *LOW_PRECISION_ROWS[QLORA]], lora=False)
        ends = []
        trainer = trl_trainer(model, tokenizer, cfg, data, b, n, steps, lambda: ends.append(C.clocks()))
        with C.quiet():
            trainer.train()
        shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
        seconds = step_times(ends)
    assert len(seconds) == steps - 1
    return tuple(b * n * seq * len(seconds) / sum(s[k] for s in seconds) for k in (0, 1))


def side_by_side(record: dict, ours_peak: int, base: list, data, b: int, n: int, seq: int, steps: int,
                 reps: int) -> None:
    """TRL's SFTTrainer against finetune on the same QLoRA step: step peaks (finetune's from its NF4 row) and
    tokens/s (``reps`` interleaved runs of ``steps`` optimizer steps each); into ``record`` the two ratios (None
    without trl)."""
    record["qlora_peak_vs_trl"] = record["qlora_speed_vs_trl"] = None
    try:
        import trl
    except ImportError:
        print("\nTRL is not installed (pip install trl): no side-by-side rows.\n")
        return
    theirs = trl_peak(base, data, b, n)
    model, _, _ = sft_model([*base, *LOW_PRECISION_ROWS[QLORA]], lora=False)
    heads = head_peaks(model, b * (seq - 1))
    del model
    speed = {"finetune": [], "TRL": []}  # (wall, CPU) tokens/s of each run
    for r in range(reps):  # interleaved, the order rotated: a busy phase of the machine hits both alike
        for tool in (("finetune", "TRL") if r % 2 == 0 else ("TRL", "finetune")):
            speed[tool].append(tokens_per_second(tool, base, data, b, n, seq, steps))
    tps = {tool: [C.median([run[k] for run in runs]) for k in (0, 1)] for tool, runs in speed.items()}
    print(f"\n## QLoRA side by side: finetune and TRL {trl.__version__} SFTTrainer ({b} × {seq} tokens, N = {n})\n")
    print("The same NF4 base (double quantization, fp32 compute) loaded the same way, LoRA r, alpha and targets, fp32 "
          "adapters, blocks, micro-batch and accumulation; gradient checkpointing on both; fused AdamW. Tokens/s: "
          f"{steps} optimizer steps, the first left out, median of {reps} interleaved run(s) each, without the "
          "profiler; on the process's CPU time (the wall clock beside it).\n")
    print(C.table(["tool", "step peak MB", "tokens/s (CPU time)", "tokens/s (wall)"],
                  [["finetune", f"{ours_peak / MB:.0f}", f"{tps['finetune'][1]:.1f}", f"{tps['finetune'][0]:.1f}"],
                   ["TRL SFTTrainer", f"{theirs / MB:.0f}", f"{tps['TRL'][1]:.1f}", f"{tps['TRL'][0]:.1f}"],
                   ["finetune ÷ TRL", f"{ours_peak / theirs:.3f}", f"{tps['finetune'][1] / tps['TRL'][1]:.3f}",
                    f"{tps['finetune'][0] / tps['TRL'][0]:.3f}"]]))
    print(f"\nThe loss heads alone, forward and backward over {b * (seq - 1)} tokens: finetune's chunked head "
          f"{heads['finetune'] / MB:.0f} MB, TRL's fused head {heads['TRL'] / MB:.0f} MB (on a CPU, without Triton, "
          "it scores every position in [tokens, 32 768] fp32 tiles and computes each tile's softmax terms as whole "
          "temporaries).")
    record["qlora_peak_vs_trl"] = ours_peak / theirs
    record["qlora_speed_vs_trl"] = tps["finetune"][1] / tps["TRL"][1]
    record["trl"] = {"version": trl.__version__, "peak_mb": theirs / MB, "finetune_peak_mb": ours_peak / MB,
                     "head_peak_mb": heads["TRL"] / MB, "finetune_head_peak_mb": heads["finetune"] / MB,
                     "tokens_per_s_wall_cpu": speed, "speed_vs_trl_wall": tps["finetune"][0] / tps["TRL"][0]}


def low_precision_section(record: dict, b: int, seq: int, n: int, timed_steps: int, reps: int,
                          base: tuple = ()) -> None:
    """SmolLM2 with a bf16 or NF4 base + LoRA and AdamW8bit full fine-tuning against the fp32 rows: the fixed part
    (weights + gradients + optimizer state), the step peak and the step time, at b × ``seq`` tokens, N = n; then TRL's
    SFTTrainer on the same QLoRA step: its step peak, and tokens/s against finetune's (``timed_steps`` optimizer
    steps, ``reps`` interleaved runs each). ``base``: recipe overrides under every row's (a test's tiny model)."""
    base = list(base)
    _, tokenizer, _ = sft_model([*base, "peft.enabled=false"])
    # an all-ones attention mask: the batches TRL's collator makes of the same blocks
    data = [{**s, "attention_mask": [1] * seq} for s in text_blocks(tokenizer, b * n * max(timed_steps, 2), seq)]
    res = {}
    for label, overrides in LOW_PRECISION_ROWS.items():
        model, _, cfg = sft_model([*base, *overrides])
        weights = weight_bytes(model)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        optimizer = cfg.training.optimizer
        peak, seconds = metered_steps(model, data, clm_collate, training(b, n, 2, True, True, optimizer))
        state, update = optimizer_bytes(model, optimizer)
        res[label] = {"weights_mb": weights / MB, "gradients_mb": trainable * 4 / MB, "optimizer_mb": state / MB,
                      "update_temporaries_mb": update / MB,
                      "fixed_mb": (weights + trainable * 4 + state) / MB, "peak_mb": peak / MB,
                      "step_s": seconds[-1][1], "step_wall_s": seconds[-1][0], **quantized_share(model)}
        del model
    rows = []
    for label, r in res.items():
        ref = res[BASELINE[label]]
        rows.append([label, f"{r['weights_mb']:.1f}", f"{r['gradients_mb']:.1f}", f"{r['optimizer_mb']:.1f}",
                     f"{r['fixed_mb']:.1f}", f"{r['fixed_mb'] / ref['fixed_mb']:.3f}", f"{r['peak_mb']:.0f}",
                     f"{r['peak_mb'] / ref['peak_mb']:.3f}", f"{r['peak_mb'] - r['fixed_mb']:.0f}",
                     f"{r['update_temporaries_mb']:.0f}", f"{r['step_s']:.1f}", f"{r['step_s'] / ref['step_s']:.2f}"])
    name = Path(cfg.model.name_or_path).stem.split(".")[0]
    print(f"## {name}: low-precision weights ({b} × {seq} tokens, N = {n}, fp32 compute, gradient "
          "checkpointing and the chunked loss head on)\n")
    print("Ratios against the fp32 row of the same kind: fp32 LoRA for the LoRA rows, fp32 AdamW for AdamW8bit. Step "
          "time: the second step's CPU time, one run each, under the allocator's record.\n")
    print(C.table(["setting", "weights MB", "gradients MB", "optimizer MB", "fixed part MB", "÷ fp32", "step peak MB",
                   "÷ fp32", "peak above the fixed part MB", "optimizer step's temporaries MB", "step s (CPU)",
                   "÷ fp32"], rows))

    side_by_side(record, res[QLORA]["peak_mb"] * MB, base, data, b, n, seq, timed_steps, reps)
    lora, q = res["fp32 base + LoRA"], res[QLORA]
    record["qlora_fixed_ratio"] = q["fixed_mb"] / lora["fixed_mb"]
    record["low_precision"] = {"micro_batch": b, "tokens": seq, "accum": n, "rows": res}
    print(f"\nNF4 + LoRA's fixed part ÷ fp32 LoRA's: {record['qlora_fixed_ratio']:.3f}. The quantized layers alone: "
          f"{q['quantized_layers_mb']:.1f} MB against {q['quantized_layers_fp32_mb']:.1f} MB in fp32 "
          f"({q['quantized_layers_mb'] / q['quantized_layers_fp32_mb']:.3f}×). The adapters alone (fp32 weights, "
          f"gradients and AdamW moments, the same on every base) are {4 * lora['gradients_mb']:.1f} MB "
          f"({4 * lora['gradients_mb'] / lora['fixed_mb']:.3f}× fp32 LoRA's fixed part).\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller grid (~1-2 min on 2 CPU cores)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (memory does not depend on it)")
    p.add_argument("--plot", metavar="PNG", help="also draw step peak against samples per step into this file")
    p.add_argument("--sections", default="small,smollm2,lowprec",
                   help="small (MiniLM and GPT-2), smollm2, lowprec (bf16 / NF4 bases, AdamW8bit, TRL); "
                        "comma-separated (default: all three)")
    args = p.parse_args(argv)
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    b = 4 if args.quick else 8
    accums = [1, 4] if args.quick else [1, 2, 4, 8]
    reps = 3 if args.quick else 5
    loads = workloads(b * max(accums) * 2) if "small" in sections else {}
    print(f"# Memory\n\n{C.machine()}\n`{' '.join(['python', *sys.argv])}`; AdamW, fp32; "
          f"{'CUDA max_memory_allocated' if C.DEVICE.type == 'cuda' else 'CPU allocator record'}\n")
    record = {"benchmark": "memory", "quick": args.quick, "device": C.DEVICE.type, "models": {}}
    worst, errors = 0.0, []
    for name, (model, data, collate) in loads.items():
        params = param_bytes(model)
        res = {"params_mb": params / MB, "accumulation": [], "checkpointing": {}}
        plan = plan_for(model, data, collate, b * max(accums))
        head = any(p.setting.chunked_loss for p in plan.profiles)  # the loop's default: chunked where it applies
        base, _ = step_peak(model, data, collate, b, 1)
        rows = []
        for mb, n in [(b, n) for n in accums] + [(b * n, 1) for n in accums[1:]]:
            peak = base if (mb, n) == (b, 1) else step_peak(model, data, collate, mb, n)[0]
            hand = step_peak(model, data, collate, mb, n, tool="accelerate")[0] if mb == b and n > 1 else None
            act = activation_bytes(model, data, collate, mb)
            planned = plan.predict(mb, n, Setting(chunked_loss=head))
            errors.append(planned / peak - 1)
            rows.append([f"{mb} × {n}", mb * n, f"{act / MB:.1f}", f"{peak / MB:.1f}", f"{peak / base:.3f}",
                         f"{hand / MB:.1f}" if hand else "", f"{planned / MB:.1f} ({planned / peak - 1:+.1%})"])
            res["accumulation"].append({"micro_batch": mb, "accum": n, "activation_mb": act / MB,
                                        "peak_mb": peak / MB, "peak_vs_one_micro_batch": peak / base,
                                        "hand_accelerate_peak_mb": hand / MB if hand else None,
                                        "planned_mb": planned / MB})
            if mb == b and n > 1:
                worst = max(worst, peak / base)
        print(f"## {name} ({params / MB:.1f} MB of parameters, {SEQ} tokens a sample): accumulation vs a bigger "
              f"micro-batch\n")
        print(C.table(["b × N", "samples / step", "activations of one micro-batch MB", "finetune step peak MB",
                       f"÷ peak of {b} × 1", "hand Accelerate step peak MB", "planner MB (error)"], rows))

        ck_rows, times = [], {False: [], True: []}
        for r in range(reps):  # time: interleaved, memory: once (it is deterministic)
            for flag in ((False, True) if r % 2 == 0 else (True, False)):
                times[flag].append(step_seconds(model, data, collate, b, flag, steps=2 if args.quick else 4))
        for flag in (False, True):
            act = activation_bytes(model, data, collate, b, flag)
            peak = step_peak(model, data, collate, b, 1, flag)[0]
            planned = plan.predict(b, 1, Setting(checkpointing=flag, chunked_loss=head))
            errors.append(planned / peak - 1)
            sec = C.median(times[flag])
            res["checkpointing"]["on" if flag else "off"] = {"activation_mb": act / MB, "peak_mb": peak / MB,
                                                            "step_s": sec, "planned_mb": planned / MB}
            ck_rows.append(["on" if flag else "off", f"{act / MB:.1f}", f"{peak / MB:.1f}", f"{sec * 1000:.0f}",
                            f"{planned / MB:.1f} ({planned / peak - 1:+.1%})"])
        off, on = res["checkpointing"]["off"], res["checkpointing"]["on"]
        ck_rows.append(["on ÷ off", f"{on['activation_mb'] / off['activation_mb']:.2f}",
                        f"{on['peak_mb'] / off['peak_mb']:.2f}", f"{on['step_s'] / off['step_s']:.2f}", ""])
        print(f"\n## {name}: gradient checkpointing (b = {b}, N = 1; step time: median of {reps} interleaved "
              "runs)\n")
        print(C.table(["checkpointing", "activations of one micro-batch MB", "step peak MB", "step ms",
                       "planner MB (error)"], ck_rows))
        print()
        record["models"][name] = res
    if args.plot and loads:
        plot(args.plot, record, b)
    if "smollm2" in sections:
        errors += smollm_section(args.quick, record)
    if "lowprec" in sections:
        # 2 × 512 tokens: more than one chunk of the loss head (341 tokens at SmolLM2's vocabulary)
        low_precision_section(record, 2, 512, *((1, 3, 1) if args.quick else (2, 4, 2)))
    record["accumulation_peak_vs_one_micro_batch"] = worst
    record["plan_max_abs_error"] = max(abs(e) for e in errors) if errors else None
    record["seconds"] = round(time.perf_counter() - start, 1)
    if errors:
        print(f"Largest step peak of {b} × N over {b} × 1: {worst or float('nan'):.3f}. Largest planner error: "
              f"{record['plan_max_abs_error']:.1%} over {len(errors)} rows.")
    print(f"Total {record['seconds']} s.\n")
    C.emit_json(record)
    return record


if __name__ == "__main__":
    main()
