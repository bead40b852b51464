"""How long a plan's run would take: tokens a second and the run's wall time on the card ``--gpu`` names, estimated
from its peak FLOP/s (``finetune.memory.cards``) at an assumed utilization, beside the rate this machine sustained
while the planner measured memory on it.

FLOPs a step computes per token (a multiply-add is 2), with N the parameters that multiply a token's activations
(every parameter but the input embedding, which is a lookup; a head tied to it multiplies and is counted once), N_t
those that train, L blocks of width d and s tokens a row:

    2N forward + 2N backward through the activations + 2N_t weight gradients    (6N when every weight trains)
    + 2N with checkpointing (each block's forward again in backward)
    + 12·L·d·s attention (scores and mixing: 4·L·d·s forward, twice that back; + 4·L·d·s with checkpointing)

The run's tokens are its rows' own (padding not counted): rows × their mean length × epochs, fewer where
``training.max_steps`` stops it first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from finetune.memory.cards import CARDS, speed_card

UTILIZATION = 0.40  # the share of the card's peak a step is assumed to sustain: an assumption, not a measurement


@dataclass(frozen=True)
class Work:
    """What the run computes: its rows and their tokens, and the model's shape for the attention term."""

    rows: int           # rows the run trains on, over every epoch
    tokens: int         # their tokens
    epochs: int
    longest: int        # tokens of the longest row (the attention term's s)
    layers: int         # L (0: no attention term)
    width: int          # d


@dataclass
class Speed:
    """The estimate on a card, and the same figures at the rate measured here. Rates in tokens a second, times in
    seconds; 0 where there is no figure (``card_note`` says why on the card; ``here_flops`` is 0 where the planner's
    micro-steps were not computed: ``--model-config``)."""

    card: str                   # the card whose peak prices it ("" none)
    card_note: str
    precision: str              # what the step computes in: the peak it is held to
    peak_flops: float           # FLOP/s
    utilization: float
    flops_per_token: float
    formula: str                # the terms, named and valued
    parameters: int             # N
    trained: int                # N_t
    attention: int              # the attention term's FLOPs a token
    checkpointing: bool
    tokens_per_second: float
    seconds: float              # the run's estimated wall time on the card
    run_tokens: int
    run_rows: int
    epochs: int
    here_flops: float           # FLOP/s this machine sustained in the planner's last micro-step
    here_tokens_per_second: float
    here_seconds: float
    here: str                   # which machine, and how it was measured
    offload: Optional[object] = None  # under a host level: ``host.OffloadTime``, included in the seconds above


def multiplying(model: torch.nn.Module) -> tuple[int, int]:
    """(N, N_t): ``model``'s parameters that multiply activations, and those that train. Counted by shape, so a 4-bit
    weight counts its elements, not its packed bytes; the input embedding (a lookup) is left out unless the output
    head shares it."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookup = embed.weight if embed is not None and (head is None or head.weight is not embed.weight) else None
    n = trained = 0
    for p in model.parameters():
        if p is lookup:
            continue
        state = getattr(p, "quant_state", None)
        k = math.prod(state.shape) if state is not None else p.numel()
        n, trained = n + k, trained + (k if p.requires_grad else 0)
    return n, trained


def shape_of(model) -> tuple[int, int]:
    """(L, d) of a transformer's config; (0, 0) for a model without one (no attention term)."""
    config = getattr(model, "config", None)
    layers, width = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    return (layers, width) if isinstance(layers, int) and isinstance(width, int) else (0, 0)


def attention_flops(layers: int, width: int, tokens: int, checkpointing: bool) -> int:
    """The attention term of FLOPs a token: 12·L·d·s, 16·L·d·s with checkpointing (the module's docstring)."""
    return (16 if checkpointing else 12) * layers * width * tokens


def flops_per_token(n: int, trained: int, layers: int, width: int, tokens: int, checkpointing: bool) -> tuple:
    """(FLOPs a step computes per token, the formula with its terms valued) — see the module's docstring."""
    again = 2 * n if checkpointing else 0
    attention = attention_flops(layers, width, tokens, checkpointing)
    total = 4 * n + 2 * trained + again + attention
    formula = ("2N forward + 2N backward + 2N_t weight gradients"
               + (" + 2N recompute (checkpointing)" if checkpointing else "")
               + (f" + {16 if checkpointing else 12}·L·d·s attention" if attention else "")
               + f", N {count(n)}, N_t {count(trained)}"
               + (f", L {layers}, d {width}, s {tokens}" if attention else ""))
    return total, formula


def count(n: float) -> str:
    """A number of parameters for people: 135 M, 8.03 B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def measured_rate(model, shape: tuple, seconds: float, checkpointing: bool) -> float:
    """FLOP/s ``model`` sustained computing a micro-step of ``shape`` (rows, tokens a row) in ``seconds``, by
    ``flops_per_token``'s count (0: nothing timed)."""
    rows, tokens = shape
    n, trained = multiplying(model)
    if not rows or not n or seconds <= 0:
        return 0.0
    return rows * tokens * flops_per_token(n, trained, *shape_of(model), tokens, checkpointing)[0] / seconds


def work_of(job, t, effective: int, model) -> Optional[Work]:
    """The run's ``Work`` from its training rows (``job.length_of``), ``t`` (epochs, max_steps) and the effective
    batch; None for a task whose rows have no token length."""
    if job.length_of is None:
        return None
    n = len(job.train_data)
    seen = min(n, job.stream_block or n)  # a stream is not read ahead: its first block stands for it
    lengths = [job.length_of(i) for i in range(seen)]
    rows = t.epochs * n
    if t.max_steps:
        rows = min(rows, t.max_steps * effective)
    layers, width = shape_of(model)
    return Work(rows=rows, tokens=round(rows * sum(lengths) / seen), epochs=t.epochs, longest=max(lengths),
                layers=layers, width=width)


def this_machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"this machine: {os.cpu_count()}-core CPU, no GPU"


def estimate(gpu: str, precision: str, multiplying: tuple[int, int], checkpointing: bool, work: Work,
             here_flops: float) -> Speed:
    """The ``Speed`` of a run of ``work`` computing in ``precision`` (training.mixed_precision) with ``multiplying``
    = (multiplying, trained) parameters (``Profile.multiplying``), on ``gpu`` and at ``here_flops`` (FLOP/s measured
    here; 0: none)."""
    n, trained = multiplying
    per_token, formula = flops_per_token(n, trained, work.layers, work.width, work.longest, checkpointing)
    attention = attention_flops(work.layers, work.width, work.longest, checkpointing)
    card, note = speed_card(gpu, precision)
    peak = CARDS[card].peak(precision) if card else 0.0
    rate = peak * UTILIZATION / per_token if peak else 0.0
    here = here_flops / per_token if here_flops else 0.0
    return Speed(card=card or "", card_note=note, precision=precision, peak_flops=peak, utilization=UTILIZATION,
                 flops_per_token=per_token, formula=formula, parameters=n, trained=trained, attention=attention,
                 checkpointing=checkpointing, tokens_per_second=rate,
                 seconds=work.tokens / rate if rate else 0.0, run_tokens=work.tokens, run_rows=work.rows,
                 epochs=work.epochs, here_flops=here_flops, here_tokens_per_second=here,
                 here_seconds=0.0 if not here else work.tokens / here, here=this_machine())
