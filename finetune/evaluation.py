"""Validation: the item-weighted loss over the whole validation set, and the task's metrics."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, send_to_device
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from finetune import distributed
from finetune.job import Job
from finetune.models.forward import compute_loss

METRICS_DIR = Path(__file__).resolve().parent / "metrics"


@torch.no_grad()
def run_eval(job: Job, model, accelerator: Accelerator, counter, micro_batch: int, num_workers: int = 0) -> dict:
    """The validation metrics, ``micro_batch`` samples at a time. The validation set is sharded over processes with
    no sample repeated; the loss is the mean over every item (``counter``: batch → its items, as in training), and
    ``job.compute_metrics`` sees every prediction. Returns ``{"loss", …metrics}``."""
    world, rank = accelerator.num_processes, accelerator.process_index
    indices = list(range(rank, len(job.val_data), world))
    loader = DataLoader(job.val_data, batch_sampler=[indices[i:i + micro_batch]
                                                     for i in range(0, len(indices), micro_batch)],
                        collate_fn=job.collate_fn, num_workers=num_workers)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    items_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    preds, refs = [], []
    for batch in loader:
        items = counter(batch)
        batch = send_to_device(batch, accelerator.device)
        loss, _, outputs = compute_loss(model, batch, job.loss_fn)
        if items:
            loss_sum += loss.double() * items
            items_sum += items
        if job.eval_step is not None:
            p, r = job.eval_step(model, batch, outputs)
            preds += list(p)
            refs += list(r)
    model.train(was_training)
    if world > 1:
        loss_sum = accelerator.reduce(loss_sum, "sum")
        items_sum = accelerator.reduce(items_sum, "sum")
        preds, refs = gather_object(preds), gather_object(refs)
    record = {"loss": float(loss_sum / items_sum) if float(items_sum) else float("nan")}
    if job.val_loss_metrics is not None:  # e.g. perplexity = exp(loss)
        record.update(job.val_loss_metrics(record["loss"]))
    if job.compute_metrics is not None and preds:
        record.update(job.compute_metrics(preds, refs))
    return record


def report(record: dict, accelerator: Accelerator, log_with=None) -> None:
    """Say an evaluation's record (main process) and log it to the trackers."""
    step = record["step"]
    if distributed.is_main_process():
        tqdm.write("eval " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in record.items()))
    if log_with is not None:
        accelerator.log({f"eval/{k}": v for k, v in record.items() if k not in ("step", "epoch")}, step=step)


def load_metric(name: str):
    """A metric from ``finetune/metrics/<name>/<name>.py`` through ``evaluate`` (no hub access)."""
    import evaluate  # lazy: 3.4 s on every command (this module is on each one's path)

    return evaluate.load(str(METRICS_DIR / name))
