"""The rows of ``benchmarks/gpu.py`` that run finetune as a user runs it — ``finetune run``, ``plan``, ``compare`` —
on Llama-3.2-1B built from its config: optimizer offload under a 16 GiB cap, fp16's loss scale and its layouts, and
``plan --model-config`` against the run it plans.

The model: the ``clm-pydoc`` recipe, whose task builds a new model with random weights from ``model.config`` (the
sft recipe loads weights from ``model.name_or_path``, and the 1B's weights do not travel). It gets Llama-3.2-1B's
``config.json`` whole, less the token ids and the vocabulary size, which the task takes from its tokenizer; the
tokenizer (``model.tokenizer``) is byte-level with exactly the config's 128 256 ids (the 256 bytes, the end and pad
tokens, the rest never produced). So the model is the 1.24 B-parameter Llama-3.2-1B in every shape, its tied
128 256 × 2 048 embedding and head included, trained on the Python docs cut into rows of ``seq`` byte tokens
(``data.concatenate``: nothing padded). The task builds it on the CPU in fp32, as it builds any config's model; the
run moves it to the card.

Sections (each row on its own, as the rest of the script):

* **offload** — the 1B full fine-tune with ``--offload optimizer`` (DeepSpeed ZeRO-2, the optimizer on the host)
  in a ``finetune run`` process that caps itself at 16 GiB (``torch.cuda.set_per_process_memory_fraction``, set by
  this module's ``--child`` wrapper before ``finetune.cli.main``), at the micro-batch and setting ``finetune plan
  --offload optimizer --gpu 16GiB`` recommends for the same settings (run in the row): the card's peak
  (``torch.cuda.max_memory_allocated`` of that process) and its host RSS (its peak, and its growth from the model
  built to the peak: what the engine adds) against the plan's card and host bytes; then the same without offload at
  the cap and, where it runs out of memory there, uncapped (said in the row): tokens/s with and without.
* **fp16** — ``training.mixed_precision=fp16`` at (2, 4) and at (8, 1): the loss scale (first, last) and the steps
  skipped for an overflow (history's ``loss_scale``, ``skipped``); ``finetune compare`` of the two, its verdict line.
* **plan** — ``finetune plan --model-config`` (allocation-only: the architecture is never built whole) for the card
  and the run of its recommendation, in this process: predicted step peak against ``torch.cuda.max_memory_allocated``
  over the run, weights included.

On a CPU (``--tiny``) every row runs with the tiny stand-in config: the offloaded run without a cap, the run without
offload under an injected one (``FINETUNE_FAKE_OOM_ABOVE=1``: a micro-batch of more than one sample runs out of
memory), so that its fall-back to an uncapped run is exercised; what needs a card (its peak, a real cap, fp16's
kernels) is said to be unmeasured in the row.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from gpu_rows import Peak, Skip

GiB = 2 ** 30
CAP = 16 * GiB  # the card the offload rows are planned for and capped at (on CUDA)
EFFECTIVE = 8   # samples per optimizer step, as in the rest of the script
FAKE_CAP = 1    # on a CPU, the run without offload: micro-batches above this many samples run out of memory
DROPPED = ("architectures", "torch_dtype", "dtype", "transformers_version", "vocab_size", "bos_token_id",
           "eos_token_id", "pad_token_id", "use_cache")  # what the clm task sets itself, or a build ignores
LAYOUTS = ((2, 4), (8, 1))  # the fp16 rows' micro-batch × N
TWIN = 4  # the micro-batch of (2, 4)'s twin, the floor of the fp16 comparison


# ---------------------------------------------------------------------------------------------------------------
# the recipe: the 1B's config, a tokenizer of its vocabulary, the settings every run shares


def byte_tokenizer(vocab: int, folder: Path) -> str:
    """A byte-level tokenizer of exactly ``vocab`` ids saved in ``folder``: the 256 bytes (ByteLevel's alphabet, no
    merges), ``<|endoftext|>`` and ``<pad>``, and unused ids up to ``vocab``, so that the clm task sizes the
    embedding and head as the config does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    ids = {ch: i for i, ch in enumerate(alphabet)}
    ids.update({"<|endoftext|>": len(ids), "<pad>": len(ids) + 1})
    if vocab < len(ids):
        raise ValueError(f"a byte-level tokenizer needs at least {len(ids)} ids; the config has {vocab}")
    ids.update({f"<unused_{i}>": i for i in range(len(ids), vocab)})
    tok = Tokenizer(models.BPE(vocab=ids, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return str(folder)


def recipe_sets(config_dir: str, seq: int, root: Path) -> list:
    """The ``--set`` overrides of every run and plan: clm-pydoc with ``config_dir``'s architecture and a tokenizer
    of its vocabulary, rows of ``seq`` tokens, bf16 autocast, checkpointing, AdamW at a constant lr with clipping
    (the speed rows' settings), effective batch 8, no evaluation, sample, plot or saved model."""
    config = json.loads((Path(config_dir) / "config.json").read_text())
    tokenizer = byte_tokenizer(config["vocab_size"], root / "tokenizer")
    arch = {k: v for k, v in config.items() if k not in DROPPED}
    sets = [f"model.config={flow(arch)}", f"model.tokenizer={tokenizer}", "model.sample_prompt=''",
            f"data.seq_len={seq}", "data.concatenate=true", "data.val_fraction=0",
            f"training.effective_batch_size={EFFECTIVE}", "training.mixed_precision=bf16",
            "training.gradient_checkpointing=true", "training.optimizer=adamw", "training.weight_decay=0",
            "training.lr_scheduler=constant", "training.warmup_steps=0", "training.learning_rate=1e-5",
            "training.max_grad_norm=1.0", "training.seed=0", "training.eval_at_start=false",
            "output.save_model=false", "output.plots=false", "output.tracker=none"]
    return [x for s in sets for x in ("--set", s)]


def flow(value) -> str:
    """``value`` as a YAML flow value for a ``--set`` override: JSON, but each float with a point and a signed
    exponent (YAML 1.1, which the overrides are read with, takes ``1e-05`` for a string)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(flow, value)) + "]"
    return f"{value:.17e}" if isinstance(value, float) else json.dumps(value)


def run_argv(sets: list, b: int, steps: int, out: Path, *extra: str) -> list:
    """``finetune run``'s arguments: the recipe at micro-batch ``b`` (N = 8 ÷ b) for ``steps`` optimizer steps."""
    return ["run", "--recipe", "clm-pydoc", *sets, "--batch-size", str(b), "--max-steps", str(steps), *extra,
            "--output-dir", str(out)]


def as_run(plan: dict) -> list:
    """The ``--set`` overrides that run the plan's recommended setting (its activation levers). RuntimeError where
    the plan recommends a lever that changes the step (8-bit states, another base or compute): not what these rows
    measure."""
    changed = {k: plan[k] for k in ("lever_optimizer", "lever_base", "lever_compute") if plan.get(k)}
    if changed or plan.get("lora"):
        raise RuntimeError(f"finetune plan recommends a setting that changes the step ({changed or 'LoRA'}): "
                           f"{plan['note'][:200]}")
    sets = [f"training.gradient_checkpointing={str(plan['gradient_checkpointing']).lower()}",
            f"training.chunked_loss={str(plan['chunked_loss']).lower()}",
            f"training.activation_offloading={str(plan['activation_offloading']).lower()}"]
    return [x for s in sets for x in ("--set", s)]


def quiet_main(argv: list) -> tuple:
    """``finetune.cli.main(argv)`` in this process: (its exit code, what it printed)."""
    from finetune import cli
    from finetune.distributed import restart_accelerate_state

    restart_accelerate_state()  # each run from a fresh Accelerate, as in its own process
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        code = cli.main(argv)
    sys.stderr.write(printed.getvalue()[-4000:] + said.getvalue()[-4000:])  # into the row's log
    if code not in (0, 1):
        errors = [line for line in said.getvalue().splitlines() if line.startswith("error:")]
        raise RuntimeError(f"finetune {argv[0]} exited {code}: {' '.join(errors)[:300]}")
    return code, printed.getvalue()


def plan_of(sets: list, config_dir: str, gpu: str, *extra: str) -> dict:
    """``finetune plan --model-config config_dir --gpu gpu --json`` (allocation-only) for the run's settings: its
    record. RuntimeError where it does not fit or cannot plan."""
    code, printed = quiet_main(["plan", "--recipe", "clm-pydoc", *sets, "--model-config", config_dir, "--gpu", gpu,
                                "--json", *extra])
    lines = [line for line in printed.splitlines() if line.startswith("{")]
    if code not in (0, 1) or not lines:
        raise RuntimeError(f"finetune plan exited {code}: {printed.strip().splitlines()[-1:]}")
    plan = json.loads(lines[-1])
    if not plan["fits"]:
        raise RuntimeError(f"finetune plan: nothing fits {gpu}: {plan['note']}")
    return plan


def history(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]


def rate(records: list, tokens_per_step: int) -> float:
    """Tokens a second over the steps after the first (it compiles, allocates the optimizer's state, warms up)."""
    timed = records[1:] or records
    return sum(r.get("tokens", tokens_per_step) for r in timed) / sum(r["seconds"] for r in timed)


def step_seconds(records: list) -> float:
    """Seconds an optimizer step takes, over the steps after the first."""
    timed = records[1:] or records
    return sum(r["seconds"] for r in timed) / len(timed)


# ---------------------------------------------------------------------------------------------------------------
# the capped process


def child(out: str, cap: int, argv: list) -> None:
    """In the measured process: the card capped at ``cap`` bytes (0: not), ``finetune.cli.main(argv)``, then what it
    held: the card's peak, the RSS when the model was built (before ``accelerator.prepare``) and at its peak."""
    import psutil

    from finetune import cli, startup

    cuda = torch.cuda.is_available()
    if cuda and cap:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), 0)
    marks = {}
    real = startup.with_optimizers

    def measured(accelerator, model, job, t, shape):
        marks["rss_model_built"] = psutil.Process().memory_info().rss
        return real(accelerator, model, job, t, shape)

    startup.with_optimizers = measured
    code = cli.main(argv)
    marks.update(code=code, rss_peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 card_peak=torch.cuda.max_memory_allocated() if cuda else None)
    Path(out).write_text(json.dumps(marks))
    sys.exit(code)


def capped_run(argv: list, cap, out: Path, fake_above: int = None) -> dict:
    """``argv`` (``finetune run``'s) in a process of its own through ``child``, capped at ``cap`` bytes of the card
    (None: not), or with ``fake_above`` a micro-batch of more than that many samples out of memory
    (``FINETUNE_FAKE_OOM_ABOVE``, a CPU's stand-in for a cap): its marks. RuntimeError with the run's last line where
    it fails, starting "out of memory" where it ran out."""
    import finetune

    marks = out.parent / f"{out.name}.json"
    # the same finetune as this process, whichever checkout that is
    inherited = {k: v for k, v in os.environ.items() if k != "FINETUNE_FAKE_OOM_ABOVE"}
    env = {**inherited, "PYTHONPATH": str(Path(finetune.__file__).resolve().parent.parent),
           "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0", "TOKENIZERS_PARALLELISM": "false",
           **({"FINETUNE_FAKE_OOM_ABOVE": str(fake_above)} if fake_above else {})}
    proc = subprocess.run([sys.executable, __file__, "--child", str(marks), str(cap or 0), *argv],
                          capture_output=True, text=True, env=env, timeout=1200)
    sys.stderr.write((proc.stdout + proc.stderr)[-6000:])
    if proc.returncode != 0 or not marks.exists():
        said = (proc.stdout + proc.stderr).lower()
        last = next((line for line in reversed((proc.stderr or proc.stdout).strip().splitlines()) if line.strip()),
                    "")
        raise RuntimeError(("out of memory: " if "out of memory" in said else "") + f"exit {proc.returncode}: "
                           f"{last[:240]}")
    return json.loads(marks.read_text())


# ---------------------------------------------------------------------------------------------------------------
# the sections


def needs_deepspeed() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise Skip("deepspeed is not installed (training.offload runs through DeepSpeed)")


def offload_rows(bench, until: float) -> None:
    size, cuda = bench.size, bench.device.type == "cuda"
    steps, cap = 1 + size.timed, CAP if cuda else None  # one step warms up: the host's optimizer step is slow
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-offload-"))
    sets = recipe_sets(size.models["1B"], size.seq, root)
    tokens = EFFECTIVE * size.seq
    kept = {}

    def offloaded():
        needs_deepspeed()
        plan = plan_of(sets, size.models["1B"], "16GiB", "--offload", "optimizer")
        kept["plan"] = plan
        b = plan["micro_batch_size"]
        marks = capped_run(run_argv([*sets, *as_run(plan)], b, steps, root / "optimizer", "--offload", "optimizer"),
                           cap, root / "optimizer")
        grown = marks["rss_peak"] - marks["rss_model_built"]
        records = history(root / "optimizer")
        kept["tokens_per_s"] = rate(records, tokens)
        priced = ((plan.get("speed") or {}).get("offload") or {})  # the plan's price of the host's step and link
        return {"offload": "optimizer", "micro_batch": b, "accumulation": EFFECTIVE // b, "steps": steps,
                "setting": {k: plan[k] for k in ("gradient_checkpointing", "chunked_loss", "activation_offloading")},
                "cap": "16 GiB" if cap else "none (cpu)",
                "card_peak_bytes": marks["card_peak"], "planned_card_bytes": plan["step_peak"],
                "rss_peak_bytes": marks["rss_peak"], "rss_grown_bytes": grown, "planned_host_bytes": plan["host"],
                "tokens_per_s": kept["tokens_per_s"], "plan_note": plan["note"],
                "step_seconds": step_seconds(records), "planned_host_step_seconds": priced.get("host_seconds"),
                "planned_link_bytes": priced.get("link_bytes"), "planned_host_step_timed": priced.get("timed"),
                "note": "" if cuda else "no card: its peak and the cap are not measured on a CPU; the host's RSS is"}

    def plain():
        plan = kept.get("plan")
        b = plan["micro_batch_size"] if plan else 2
        extra = [*as_run(plan)] if plan else []
        note = "" if plan else "the offload row's plan is missing: micro-batch 2, checkpointing; "
        try:  # on a CPU the cap is injected: a micro-batch of more than FAKE_CAP samples runs out of memory
            marks = capped_run(run_argv([*sets, *extra], b, steps, root / "none"), cap, root / "none",
                               None if cuda else FAKE_CAP)
            run_dir, uncapped = root / "none", False
            note += "at the 16 GiB cap" if cuda else f"at the injected cap (FINETUNE_FAKE_OOM_ABOVE={FAKE_CAP})"
        except RuntimeError as e:
            if not str(e).startswith("out of memory"):
                raise
            run_dir, uncapped = root / "none-uncapped", True
            marks = capped_run(run_argv([*sets, *extra], b, steps, run_dir), None, run_dir)
            note += ("ran out of memory at the 16 GiB cap; measured uncapped" if cuda else
                     f"ran out of memory at the injected cap (FINETUNE_FAKE_OOM_ABOVE={FAKE_CAP}, a CPU's stand-in "
                     "for the card's); measured without it")
        tps = rate(history(run_dir), tokens)
        return {"offload": "none", "micro_batch": b, "accumulation": EFFECTIVE // b, "steps": steps,
                "uncapped": uncapped, "card_peak_bytes": marks["card_peak"], "rss_peak_bytes": marks["rss_peak"],
                "rss_grown_bytes": marks["rss_peak"] - marks["rss_model_built"], "tokens_per_s": tps,
                "offload_speed_ratio": kept["tokens_per_s"] / tps if "tokens_per_s" in kept else None, "note": note}

    bench.row("offload", "1b-optimizer-16gib", "Llama-3.2-1B full, --offload optimizer, a 16 GiB card", offloaded,
              until)
    bench.row("offload", "1b-none-16gib", "Llama-3.2-1B full, no offload, a 16 GiB card", plain, until)


def fp16_rows(bench, until: float) -> None:
    size, cuda = bench.size, bench.device.type == "cuda"
    steps = size.warmup + size.timed
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-fp16-"))
    # each run saves its model: compare holds the weights too
    sets = [*recipe_sets(size.models["1B"], size.seq, root), "--set", "training.mixed_precision=fp16", "--set",
            "output.save_model=true"]
    runs = {}

    def trained(b: int) -> tuple:
        out = root / f"fp16-{b}x{EFFECTIVE // b}"
        if b not in runs:
            code, printed = quiet_main(run_argv(sets, b, steps, out))
            if code != 0:
                raise RuntimeError(f"finetune run exited {code}: {printed.strip().splitlines()[-1:]}")
            runs[b] = history(out)
        return out, runs[b]

    def scale_of(records: list, b: int) -> dict:
        scales = [r.get("loss_scale") for r in records]
        return {"micro_batch": b, "accumulation": EFFECTIVE // b, "steps": len(records),
                "skipped_steps": sum(bool(r["skipped"]) for r in records),
                "skipped_at": [k + 1 for k, r in enumerate(records) if r["skipped"]],
                "loss_scale_first": scales[0], "loss_scale_last": scales[-1],
                "tokens_per_s": rate(records, EFFECTIVE * size.seq),
                "note": "" if cuda else "fp16 autocast on the CPU (torch's GradScaler): not the card's kernels"}

    def one_layout(b=LAYOUTS[0][0]):
        return scale_of(trained(b)[1], b)

    def compared(b=LAYOUTS[1][0]):
        """(8, 1) against (2, 4), the rounding floor measured against (2, 4)'s twin at (4, 2)."""
        a_dir, _ = trained(LAYOUTS[0][0])
        b_dir, records = trained(b)
        twin, _ = trained(TWIN)
        code, printed = quiet_main(["compare", str(a_dir), str(b_dir), "--floor", str(twin)])
        line = next((x for x in printed.splitlines() if x.startswith("verdict:")), None)
        if line is None:
            raise RuntimeError(f"finetune compare exited {code} without a verdict")
        return {**scale_of(records, b), "against": f"{LAYOUTS[0][0]} × {LAYOUTS[0][1]}, floor from "
                f"{TWIN} × {EFFECTIVE // TWIN}", "verdict": line}

    bench.row("fp16", "1b-2x4", "Llama-3.2-1B full, fp16 at 2 × 4: the loss scale", one_layout, until)
    bench.row("fp16", "1b-8x1-vs-2x4", "Llama-3.2-1B full, fp16 at 8 × 1 against 2 × 4: finetune compare", compared,
              until)


def plan_rows(bench, until: float) -> None:
    size, device = bench.size, bench.device
    steps = size.warmup + size.timed
    root = Path(tempfile.mkdtemp(prefix="gpu-bench-plan-"))
    gpu = f"{torch.cuda.get_device_properties(device).total_memory // GiB}GiB" if device.type == "cuda" else "16GiB"

    def measure():
        sets = recipe_sets(size.models["1B"], size.seq, root)
        plan = plan_of(sets, size.models["1B"], gpu)
        b = plan["micro_batch_size"]
        with Peak(device) as held:  # max_memory_allocated on CUDA, the allocator's record on a CPU
            code, printed = quiet_main(run_argv([*sets, *as_run(plan)], b, steps, root / "run"))
        if code != 0:
            raise RuntimeError(f"finetune run exited {code}: {printed.strip().splitlines()[-1:]}")
        return {"gpu": gpu, "micro_batch": b, "accumulation": EFFECTIVE // b, "steps": steps,
                "checkpointing": plan["gradient_checkpointing"], "chunked_loss": plan["chunked_loss"],
                "predicted_bytes": plan["step_peak"], "peak_bytes": held.bytes,
                "predicted_vs_measured": plan["step_peak"] / held.bytes,
                "tokens_per_s": rate(history(root / "run"), EFFECTIVE * size.seq),
                "note": "max_memory_allocated over the run" if device.type == "cuda" else
                "the allocator's record over the run (no card)"}

    bench.row("plan", "1b-model-config", f"Llama-3.2-1B full, plan --model-config for {gpu} against its run",
              measure, until)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
