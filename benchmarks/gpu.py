"""Where users run it, on one GPU: speed beside TRL's SFTTrainer, an 8 B model on a 16 / 24 GiB card, and what the
exactness defaults cost. One script, one call; every row is measured in the same process on the same device.

    python benchmarks/gpu.py --out runs/gpu-bench           # CUDA: the real sizes, ≤ --budget seconds (default 440)
    python benchmarks/gpu.py --tiny --out /tmp/gpu-bench    # anywhere: tiny sizes, every section (the suite's test)

No weights travel: each model is built from its published config (``tests/assets/llama-3.2-1b``,
``tests/assets/llama-3.1-8b``) with random weights, directly on the device, through finetune's own loading path
(``finetune.models.hf``: ``stand_in`` + ``pretrained`` with the recipe's ``precision_kwargs``, so an NF4 base is
quantized exactly as ``model.quantization: nf4`` quantizes one, then ``apply_peft``). Data: random token ids.

Sections (``--sections``):

* **speed** — tokens/s, MFU and peak memory of finetune (``startup.train_job``: start-up and the loop) and TRL's
  ``SFTTrainer`` (with Liger's kernels where ``liger_kernel`` imports, on CUDA) at the same settings: bf16 autocast,
  rows of exactly ``seq`` tokens (2 048: nothing to pad or pack), the same micro-batch × N, gradient checkpointing on
  both (TRL's default), each tool's default fused AdamW and its own loss head; Llama-3.2-1B full fine-tuning,
  Llama-3.1-8B LoRA (bf16 base), Llama-3.1-8B QLoRA (NF4 base), LoRA r 16 on every projection (the sft recipe's).
* **small** — the small-card promise: 8B QLoRA with the process capped at 16 GiB, 8B LoRA at 24 GiB
  (``torch.cuda.set_per_process_memory_fraction``), ``batch_size: auto`` picking the micro-batch for an effective
  batch of 8; the planner's prediction at the micro-batch kept beside the measured peak of the steady steps. On a CPU
  the peak is not measured (the planner's own allocator record cannot run inside another), and the cap is injected
  (``FINETUNE_FAKE_OOM_ABOVE=2``: a micro-batch of more than two samples runs out of memory, so the run plans 8,
  retries at 4, keeps 2).
* **exact** — the price of exactness: the 1B full run (samples of ``seq``/4 to ``seq`` tokens, packing off so that
  ``pad_to_window`` acts) with ``training.fp32_grad_sums`` / ``training.pad_to_window`` on and off: tokens/s and peak
  at (2, 4), and the bf16 distance of layout (8, 1) from (2, 4) in each setting (largest per-step relative difference
  of the logged loss and grad norm).
* **offload**, **fp16**, **plan** — ``finetune run``, ``plan`` and ``compare`` as a user runs them, on Llama-3.2-1B
  from its config through the clm recipe (``benchmarks/gpu_cli.py`` says how and what each row measures): the full
  fine-tune with ``--offload optimizer`` in a process capped at 16 GiB against ``finetune plan --offload`` (card
  peak, host RSS, tokens/s with and without offload); fp16's loss scale and skipped steps, and ``finetune compare`` of
  (8, 1) against (2, 4); ``plan --model-config`` against ``max_memory_allocated`` of the run it recommends.

FLOPs for MFU: 6·N + 12·L·H·s per trained token (PaLM's count, appendix B: N the parameters less the input embedding,
L layers, H = heads × head dim, s the row length; the attention term counts the full square, as PaLM does). Peak bf16
dense TFLOP/s from the card's name (H100 SXM and H200 989, H100 NVL 835, H100 PCIe 756); LoRA rows use the same N
(the conventional figure; they skip the frozen weights' gradients). Peak memory: ``torch.cuda.max_memory_allocated``
over the training call, weights included; on a CPU the allocator's record (``finetune.memory.measure.PeakMeter``)
plus the weights.

Each row runs on its own: one that cannot run here (a package missing) is written as skipped, one that fails (out of
memory, past its section's share of ``--budget``) as failed, each with the reason, and the rest still runs. ``--out``
gets ``table.md``, ``rows.json`` and ``log.txt``, rewritten after every row, so an interrupted run keeps what it
measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
import gpu_cli  # noqa: E402
import torch  # noqa: E402
from gpu_rows import Bench, Peak, bf16_peak, needs, release, spy_auto_profile  # noqa: E402

from finetune import loop, startup  # noqa: E402
from finetune.config import TrainingConfig  # noqa: E402
from finetune.data import pad_collate  # noqa: E402
from finetune.job import Job  # noqa: E402
from finetune.loading import load_recipe  # noqa: E402

GiB, MiB = 2 ** 30, 2 ** 20
PAD = 0  # the pad id of the collate and of TRL's tokenizer; data ids start above it
SECTIONS = ("speed", "small", "exact", "offload", "fp16", "plan")
SHARE = {"speed": 0.34, "small": 0.14, "exact": 0.10, "offload": 0.24, "fp16": 0.10, "plan": 0.08}  # of --budget


@dataclass(frozen=True)
class Size:
    """What a size trains: the row length, the two models' configs, steps per row and the time budget."""

    seq: int
    models: dict        # "1B" / "8B" → a folder with config.json
    warmup: int         # optimizer steps left out of tokens/s
    timed: int          # optimizer steps timed after them
    small_steps: int    # steps of a batch_size: auto run
    caps: dict          # small-card row → the cap in bytes (None: injected, on a CPU)
    budget: float       # seconds for the whole run


@dataclass(frozen=True)
class Workload:
    """One model and what trains of it: the recipe's overrides, the micro-batch × N of the speed rows."""

    label: str
    model: str          # a key of Size.models
    lora: bool
    quantization: str   # none / nf4
    b: int
    n: int
    lr: float

    def overrides(self, config_dir: str) -> list:
        """The sft recipe's settings for this workload (its LoRA: r 16, alpha 32 on the seven projections)."""
        return [f"model.name_or_path={config_dir}", f"peft.enabled={str(self.lora).lower()}",
                f"model.dtype={'bf16' if self.lora else 'fp32'}", f"model.quantization={self.quantization}",
                "training.mixed_precision=bf16"]


WORKLOADS = {
    "1b-full": Workload("Llama-3.2-1B, full fine-tuning", "1B", False, "none", 4, 2, 1e-5),
    "8b-lora": Workload("Llama-3.1-8B, LoRA (bf16 base)", "8B", True, "none", 2, 4, 1e-4),
    "8b-qlora": Workload("Llama-3.1-8B, QLoRA (NF4 base)", "8B", True, "nf4", 2, 4, 1e-4),
}
SMALL = {"8b-qlora-16gib": ("8b-qlora", 16), "8b-lora-24gib": ("8b-lora", 24)}  # row → (workload, cap in GiB)
EXACT = {  # row → (fp32_grad_sums, pad_to_window); the first is finetune's default
    "both-on": (True, True), "fp32-sums-off": (False, True), "pad-off": (True, False), "both-off": (False, False)}
EFFECTIVE = 8  # samples per optimizer step in every row
FAKE_OOM_ABOVE = "2"  # the small-card rows on a CPU: micro-batches above this many samples run out of memory


def sizes(device: torch.device) -> dict:
    assets = C.ROOT / "tests" / "assets"
    return {
        "full": Size(seq=2048, models={"1B": str(assets / "llama-3.2-1b"), "8B": str(assets / "llama-3.1-8b")},
                     warmup=2, timed=4, small_steps=3, caps={"8b-qlora-16gib": 16 * GiB, "8b-lora-24gib": 24 * GiB},
                     budget=440.0),
        "tiny": Size(seq=64, models=tiny_configs(), warmup=1, timed=2, small_steps=2,
                     caps={k: (v * GiB if device.type == "cuda" else None) for k, (_, v) in SMALL.items()},
                     budget=300.0),
    }


def tiny_configs() -> dict:
    """Two small Llama configs standing in for the 1B (tied embeddings) and the 8B (untied), saved in a temporary
    folder (the recipe names its model by a path)."""
    from transformers import LlamaConfig

    folder = Path(tempfile.mkdtemp(prefix="gpu-bench-configs-"))
    out = {}
    for name, tied in (("1B", True), ("8B", False)):
        LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    tie_word_embeddings=tied).save_pretrained(folder / name)
        out[name] = str(folder / name)
    return out


# ---------------------------------------------------------------------------------------------------------------
# models, data, FLOPs


def recipe(w: Workload, size: Size):
    return load_recipe("sft-smollm2", w.overrides(size.models[w.model]))


def build_base(w: Workload, size: Size, device: torch.device):
    """The workload's model before LoRA, random weights made on ``device``, loaded as the sft task loads its model
    (``model.dtype``, ``model.quantization`` through ``precision_kwargs``; an NF4 base quantized onto the GPU as it
    loads), with the architecture of its config (``stand_in``: the path ``finetune plan --model-config`` builds)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.models.hf import precision_kwargs, pretrained, stand_in

    cfg = recipe(w, size)
    config = AutoConfig.from_pretrained(size.models[w.model])
    with stand_in(config), torch.device(device):
        model = pretrained(AutoModelForCausalLM, size.models[w.model], **precision_kwargs(cfg))
    return model.train(), cfg


def finetune_model(w: Workload, size: Size, device: torch.device):
    """The model finetune trains: the base with the recipe's LoRA (``apply_peft``) when the workload has LoRA."""
    from finetune.models.hf import apply_peft

    model, cfg = build_base(w, size, device)
    return apply_peft(model, cfg.peft, "CAUSAL_LM", cfg.training.mixed_precision) if w.lora else model


def rows_of(n: int, seq: int, vocab: int, lengths: tuple = None, seed: int = 0) -> list:
    """``n`` samples of random token ids (above ``PAD``): ``seq`` tokens each, or a seeded length in ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = seq if lengths is None else int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(PAD + 1, vocab, (k,), generator=g).tolist()})
    return out


def flops_per_token(config_dir: str, seq: int) -> float:
    """6·N + 12·L·H·s (PaLM, appendix B): N the parameters less the input embedding (a tied one counts once, as the
    head), L layers, H heads × head dim, s the row length."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    if not config.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * n + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq


def tokenizer_for_trl():
    """A tokenizer that knows only the pad and end tokens: the data are token ids already, and TRL needs a
    processing class for its collator's pad id (it would otherwise look for one on the hub)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": PAD, "<eos>": PAD + 1}, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


# ---------------------------------------------------------------------------------------------------------------
# measuring


def training(w_b: int, w_n, steps: int, lr: float, **extra) -> TrainingConfig:
    """The finetune settings of every row: bf16 autocast, checkpointing, AdamW (fused) at a constant lr, clipping at
    1.0, no shuffling, no packing (each row is one sample; the exactness rows need unpacked micro-batches)."""
    return TrainingConfig(batch_size=w_b, gradient_accumulation_steps=w_n, max_steps=steps, learning_rate=lr,
                          optimizer="adamw", weight_decay=0.0, lr_scheduler="constant", warmup_steps=0,
                          max_grad_norm=1.0, mixed_precision="bf16", gradient_checkpointing=True, packing=False,
                          shuffle=False, seed=0, **extra)


def train_finetune(model, data, t: TrainingConfig, lengths=None, on_window=None):
    """``startup.train_job`` (start-up's stages and the loop) on ``data``: (a ToolRun with each optimizer step's start
    — the last try of a window retried after an out-of-memory error — and the end, the TrainResult)."""
    starts = {}

    def before_window(state):
        starts[state.optimizer_step] = C.clocks()
        if on_window is not None:
            on_window(state)

    job = Job(model=model, train_data=data, collate_fn=pad_collate(PAD),
              length_of=(lambda i: lengths[i]) if lengths is not None else None, before_window=before_window)
    result = startup.train_job(job, t, loop.Reporting(banner=False))
    run = C.ToolRun("finetune", starts=[starts[k] for k in sorted(starts)], end=C.clocks())
    run.tokens = [h.get("tokens", 0) for h in result.history]
    return run, result


def train_trl(model, data, w: Workload, cfg, steps: int, device: torch.device) -> tuple:
    """TRL's SFTTrainer on the same rows and settings: (a ToolRun with each step's start and the end, the peak,
    the note on what ran)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    run = C.ToolRun("TRL")

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # once a window, its micro-batches fetched
            run.starts.append(C.clocks())

        def on_train_end(self, args, state, control, **kw):
            run.end = C.clocks()

    liger = device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None
    lora = None
    if w.lora:
        from peft import LoraConfig

        p = cfg.peft
        lora = LoraConfig(task_type="CAUSAL_LM", r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                          target_modules=list(p.target_modules))
    with tempfile.TemporaryDirectory(prefix="trl-") as tmp:
        args = SFTConfig(output_dir=tmp, per_device_train_batch_size=w.b, gradient_accumulation_steps=w.n,
                         max_steps=steps, learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0,
                         weight_decay=0.0, max_grad_norm=1.0, bf16=True, gradient_checkpointing=True,
                         gradient_checkpointing_kwargs={"use_reentrant": False}, max_length=None, packing=False,
                         padding_free=False, use_liger_kernel=liger, use_cpu=device.type == "cpu", report_to="none",
                         save_strategy="no", logging_steps=10 ** 6, disable_tqdm=True, dataloader_num_workers=0,
                         seed=0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(data), peft_config=lora,
                             processing_class=tokenizer_for_trl(), callbacks=[Clock()])
        with Peak(device, trainer.model) as peak:
            trainer.train()
    run.tokens = [w.b * w.n * len(data[0]["input_ids"])] * len(run.starts)
    note = "Liger kernels" if liger else ("no Liger (liger-kernel not installed)" if device.type == "cuda" else
                                          "no Liger (CUDA only)")
    if w.quantization != "none":
        note += "; TRL casts the adapters to bf16 (its QLoRA default)"
    return run, peak.bytes, note


def rel_distance(a: list, b: list) -> float:
    """max over steps of |a − b| / |b|."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def speed_rows(bench: Bench, until: float) -> None:
    size, device = bench.size, bench.device
    steps = size.warmup + size.timed
    peak_flops = bf16_peak(device)
    for key, w in WORKLOADS.items():
        flops = flops_per_token(size.models[w.model], size.seq)
        for tool in ("finetune", "trl"):
            def measure(w=w, tool=tool, flops=flops):
                if w.quantization != "none":
                    needs("bitsandbytes", "QLoRA's NF4 base")
                if tool == "trl":
                    needs("trl", "the TRL rows")
                data = rows_of(w.b * w.n * steps, size.seq, vocab(size, w))
                if tool == "finetune":
                    model = finetune_model(w, size, device)
                    with Peak(device, model) as peak:
                        run, _ = train_finetune(model, data, training(w.b, w.n, steps, w.lr))
                    run.tokens = [w.b * w.n * size.seq] * len(run.starts)
                    note, held = "its defaults: chunked loss head, fp32 weight-gradient sums", peak.bytes
                else:
                    model, cfg = build_base(w, size, device)
                    run, held, note = train_trl(model, data, w, cfg, steps, device)
                return figures(run, size.warmup, flops, peak_flops, held, w, note)

            bench.row("speed", f"{key}/{tool}", f"{w.label} · {'finetune' if tool == 'finetune' else 'TRL SFTTrainer'}",
                      measure, until)


def vocab(size: Size, w: Workload) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(size.models[w.model]).vocab_size


def figures(run, warmup: int, flops: float, peak_flops, held: int, w: Workload, note: str) -> dict:
    tps = run.rate("tokens", skip=warmup)
    return {"micro_batch": w.b, "accumulation": w.n, "steps": len(run.starts), "timed_steps": len(run.starts) - warmup,
            "tokens_per_s": tps, "mfu": tps * flops / peak_flops if peak_flops else None,
            "flops_per_token": flops, "peak_bytes": held, "note": note}


def small_rows(bench: Bench, until: float) -> None:
    size, device = bench.size, bench.device
    for key, (workload, gib) in SMALL.items():
        w = WORKLOADS[workload]

        def measure(w=w, cap=size.caps[key]):
            if w.quantization != "none":
                needs("bitsandbytes", "QLoRA's NF4 base")
            data = rows_of(EFFECTIVE * size.small_steps, size.seq, vocab(size, w))
            model = finetune_model(w, size, device)
            t = training("auto", None, size.small_steps, w.lr, effective_batch_size=EFFECTIVE)
            release()
            printed, box = io.StringIO(), {}
            if device.type == "cuda":
                # the record restarts at the second step, a steady one (the first plans, may retry after an
                # out-of-memory error, and makes the optimizer's state)
                with capped(cap, device), spy_auto_profile(box), Peak(device, model) as peak, \
                        contextlib.redirect_stdout(printed):
                    run, result = train_finetune(model, data, t, on_window=lambda s: s.optimizer_step == 1 and
                                                 peak.restart())
                over = "the steady steps (from the second)"
            else:
                with capped(cap, device), spy_auto_profile(box), contextlib.redirect_stdout(printed):
                    run, result = train_finetune(model, data, t)
                peak = None  # the planner measures with the allocator's record, which cannot run inside another
                over = "not measurable on cpu (the planner's own allocator record cannot nest in another)"
            print(printed.getvalue(), end="")
            kept = result.history[-1]["micro_batch_size"]
            planned = re.search(r"batch_size auto: micro-batch (\d+) ×", printed.getvalue())
            predicted = box["profile"].step_peak(kept, EFFECTIVE // kept) if "profile" in box else None
            run.tokens = [EFFECTIVE * size.seq] * len(run.starts)
            return {"cap_bytes": cap,
                    "cap": f"{gib} GiB" if cap else f"injected: FINETUNE_FAKE_OOM_ABOVE={FAKE_OOM_ABOVE}",
                    "planned_micro_batch": int(planned.group(1)) if planned else None,
                    "oom_retries": [int(b) for b in re.findall(r"out of memory at micro-batch (\d+):",
                                                               printed.getvalue())],
                    "micro_batch": kept, "accumulation": EFFECTIVE // kept, "steps": result.optimizer_steps,
                    "steps_asked": size.small_steps, "predicted_bytes": predicted,
                    "peak_bytes": peak.bytes if peak else None, "peak_over": over,
                    "tokens_per_s": run.rate("tokens", skip=1) if len(run.starts) > 1 else None}

        bench.row("small", key, f"{w.label}, batch_size auto, a {gib} GiB card", measure, until)


@contextlib.contextmanager
def capped(cap, device: torch.device):
    """The process capped at ``cap`` bytes of the card (CUDA), or on a CPU every micro-batch of more than two samples
    out of memory (``FINETUNE_FAKE_OOM_ABOVE``; not one: the planner's own probes are of one and two samples, and
    one that runs out of memory ends the run); undone on leaving."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), device)
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return
    before = os.environ.get("FINETUNE_FAKE_OOM_ABOVE")
    os.environ["FINETUNE_FAKE_OOM_ABOVE"] = FAKE_OOM_ABOVE
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FINETUNE_FAKE_OOM_ABOVE", None)
        else:
            os.environ["FINETUNE_FAKE_OOM_ABOVE"] = before


def exact_rows(bench: Bench, until: float) -> None:
    size, device = bench.size, bench.device
    w = WORKLOADS["1b-full"]
    steps = size.warmup + size.timed
    data = rows_of(EFFECTIVE * steps, size.seq, vocab(size, w), lengths=(size.seq // 4, size.seq))
    lengths = [len(s["input_ids"]) for s in data]
    pristine = {}

    def fresh():  # one random init for every run of the section (a copy each), so layouts differ only in layout
        if "model" not in pristine:
            pristine["model"] = finetune_model(w, size, device)
        return copy.deepcopy(pristine["model"])

    for key, (sums, pad) in EXACT.items():
        def measure(sums=sums, pad=pad):
            flags = {"fp32_grad_sums": sums, "pad_to_window": pad}
            model = fresh()
            with Peak(device, model) as peak:
                run, small = train_finetune(model, data, training(2, 4, steps, w.lr, **flags), lengths)
            del model
            _, big = train_finetune(fresh(), data, training(8, 1, steps, w.lr, **flags), lengths)
            return {"fp32_grad_sums": sums, "pad_to_window": pad, "micro_batch": 2, "accumulation": 4,
                    "steps": len(run.starts), "tokens_per_s": run.rate("tokens", skip=size.warmup),
                    "peak_bytes": peak.bytes,
                    "loss_distance": rel_distance(big.loss_history, small.loss_history),
                    "grad_norm_distance": rel_distance(big.grad_norm_history, small.grad_norm_history),
                    "padded_share": 1 - sum(small.history[k].get("tokens", 0) for k in range(steps)) /
                    max(sum(small.history[k].get("padded_tokens", 0) for k in range(steps)), 1)}

        bench.row("exact", key, f"fp32_grad_sums {'on' if sums else 'off'}, pad_to_window {'on' if pad else 'off'}",
                  measure, until)
    pristine.clear()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=["full", "tiny"], help="full: the 1B / 8B shapes at 2048 tokens (the default "
                   "with CUDA); tiny: small Llamas at 64 tokens (the default without)")
    p.add_argument("--tiny", action="store_const", const="tiny", dest="size", help="the same as --size tiny")
    p.add_argument("--out", default="runs/gpu-bench", help="folder for table.md, rows.json and log.txt")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--budget", type=float, help="seconds for the whole run (full 440, tiny 300); each section gets "
                   "its share, a row past it is written as skipped")
    p.add_argument("--force-fail", action="append", default=[], metavar="ROW_ID",
                   help="make this row fail (e.g. speed/8b-lora/trl): the negative control of the row guard")
    args = p.parse_args(argv)
    # with its index: torch.cuda.set_per_process_memory_fraction refuses an index-less "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if C.DEVICE.type == "cuda" else C.DEVICE
    args.size = args.size or ("full" if device.type == "cuda" else "tiny")
    if device.type == "cpu":  # as the other benchmarks: on a busy CPU a second thread waits for a core (tiny ops 5×)
        torch.set_num_threads(1)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    size = sizes(device)[args.size]
    bench = Bench(args, size, device)
    total = sum(SHARE[s] for s in chosen)
    runners = {"speed": speed_rows, "small": small_rows, "exact": exact_rows, "offload": gpu_cli.offload_rows,
               "fp16": gpu_cli.fp16_rows, "plan": gpu_cli.plan_rows}
    for section in chosen:  # a section's unspent time passes on to the next
        left = bench.deadline - time.perf_counter()
        share = SHARE[section] / total
        total -= SHARE[section]
        runners[section](bench, time.perf_counter() + left * share)
    rows = bench.write()
    bench.say(f"\n{(bench.out / 'table.md').read_text()}")
    failed = [r["id"] for r in bench.rows if r["status"] == "failed"]
    bench.say(f"done in {bench.elapsed():.0f} s: {len(bench.rows)} rows, {len(failed)} failed"
              + (f" ({', '.join(failed)})" if failed else "") + f"; {bench.out}/table.md, rows.json, log.txt")
    bench.log.close()
    return {"rows": rows}


if __name__ == "__main__":
    main()
