"""What a run leaves in its output directory: metrics.json, PNG plots, the final model."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_model as save_safetensors

from finetune.card import write_cards
from finetune.errors import ConfigError
from finetune.state import ema

PLOTTED = (("loss", "window loss (mean over the window's items)"), ("lr", "learning rate"),
           ("grad_norm", "grad norm (total L2, before clipping)"))


def read_history(run_dir, command: str = "run") -> list[dict]:
    """The records of a run's ``history.jsonl`` (one per optimizer step); ConfigError naming ``command`` when there
    is none or a line is not a record."""
    path = Path(run_dir) / "history.jsonl"
    if not path.is_file():
        raise ConfigError(f"{command}: {run_dir} is not a run directory (no history.jsonl)")
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(f"{command}: {path} line {number} is not a step record (JSON with a step)")
        records.append(record)
    return records


def read_metrics(run_dir) -> dict:
    """A run's ``metrics.json`` ({} when there is none); ConfigError when it is not a JSON object."""
    path = Path(run_dir) / "metrics.json"
    if not path.is_file():
        return {}
    try:
        metrics = json.loads(path.read_text(errors="replace"))
    except ValueError:
        metrics = None
    if not isinstance(metrics, dict):
        raise ConfigError(f"metrics: {path} is not a JSON object")
    return metrics


def read_config(run_dir) -> dict | None:
    """The run's resolved ``config.yaml`` (every ``finetune run`` writes one); None if it has none."""
    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config if isinstance(config, dict) else None


def summary(result: dict) -> dict:
    """The JSON-safe part of a run's result."""
    keys = ("optimizer_steps", "skipped_steps", "micro_batches", "effective_batch_size",
            "gradient_accumulation_steps", "total_steps", "train_samples", "val_samples", "final_loss", "final_metrics",
            "val_history", "tokens", "padded_tokens")
    out = {k: result[k] for k in keys if k in result}
    if result.get("padded_tokens"):
        out["padding_efficiency"] = result["tokens"] / result["padded_tokens"]
    out.update(result.get("extra_metrics", {}))
    return out


def write_metrics(result: dict, out_dir) -> Path:
    path = Path(out_dir) / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary(result), indent=2, default=_json_default) + "\n")
    return path


def _json_default(x):
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return str(x)


def pyplot():
    """``matplotlib.pyplot`` drawing to files (the Agg backend), imported at first use: 0.3 s that every command
    would pay at the top (this module is on each one's path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(history: list, out_dir, val_history, ema_beta: float) -> list:
    """loss (with its moving average at ``ema_beta``, training.ema_beta, and validation points), lr and grad-norm
    curves over optimizer steps, one PNG each."""
    plt = pyplot()
    paths = []
    steps = [h["step"] for h in history]
    mem_key = next((k for k in ("mem_reserved_mib", "mem_allocated_mib", "mem_rss_mib") if k in history[-1]), None)
    plotted = PLOTTED + (((mem_key, f"memory ({mem_key[4:-4]}, MiB)"),) if mem_key else ())
    for key, title in plotted:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        values = [h.get(key, float("nan")) for h in history]
        ax.plot(steps, values, lw=1, label=key)
        if key == "loss":
            averages, avg = [], None
            for v in values:
                avg = ema(avg, v, ema_beta)
                averages.append(float("nan") if avg is None else avg)
            ax.plot(steps, averages, lw=2, label=f"EMA ({ema_beta:g})")
            vals = [(v["step"], v["loss"]) for v in val_history if "loss" in v]
            if vals:
                ax.plot(*zip(*vals), "o-", label="validation")
            ax.legend()
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(out_dir) / f"{'memory' if key == mem_key else key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def save_model(model: torch.nn.Module, out_dir, tokenizer=None, save_hook=None) -> Path:
    """save_pretrained for HF / peft models, else safetensors of the state dict (``model.safetensors``). Called on
    the main process only, which is the process that writes (transformers writes on global rank 0 alone inside a
    process group; the main process is rank 0)."""
    target = Path(out_dir) / "model"
    target.mkdir(parents=True, exist_ok=True)
    if save_hook is not None:
        save_hook(model, target)
    elif hasattr(model, "save_pretrained"):
        model.save_pretrained(target, safe_serialization=True, is_main_process=True)
    else:
        save_safetensors(model, str(target / "model.safetensors"))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(target)
    return target


def write_outputs(o, job, result, out_dir: Path, ema_beta: float) -> None:
    """What the recipe's output section ``o`` asks for: metrics.json, plots (the loss's moving average at
    ``ema_beta``), the model (main process only), and the closing line."""
    if job.summarize is not None:
        result.extra_metrics.update(job.summarize(result.model, out_dir))
    write_metrics(result, out_dir)
    if o.plots and result.history:
        write_plots(result.history, out_dir, result.val_history, ema_beta)
    if o.save_model:
        save_model(result.model, out_dir, job.tokenizer, job.save)
        settings = read_config(out_dir)
        if settings is not None:  # a recipe's run: the card that publishes and reproduces it
            write_cards(Path(out_dir), settings, read_metrics(out_dir), result.history)
    final = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.final_metrics.items())
    pad = f"; padding {1 - result.tokens / result.padded_tokens:.0%}" if result.padded_tokens else ""
    print(f"done: {result.optimizer_steps} optimizer steps in {result.extra_metrics['train_seconds']} s;"
          f" {final}{pad}; outputs in {out_dir}", flush=True)


def arithmetic(device) -> dict:
    """What a run's rounding depends on beyond its settings, kept in its metrics.json for the floor: the kind and
    name of the device, and whether its fp32 matrix products ran in TF32 (torch's float32 matmul precision, or
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``, both of which torch's flag reports); on a CPU the threads its kernels
    split their work over (oneDNN partitions a bf16 product by them), and torch's version (its kernels): what a
    replay of a baseline's kernels needs the same (``reproduce.replay``)."""
    if device.type != "cuda":
        return {"device": device.type, "name": platform.processor() or platform.machine(), "tf32": False,
                "threads": torch.get_num_threads(), "torch": torch.__version__}
    return {"device": "cuda", "name": torch.cuda.get_device_name(device),
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32), "torch": torch.__version__,
            "cuda": torch.version.cuda}
