"""Packing inside a window: the window's own samples laid end to end in rows, so padding nearly vanishes while the
window, its item count and its gradient stay the big-batch baseline's.

A row holds whole samples up to ``capacity`` tokens (first-fit decreasing, inside the window only); a micro-batch is
``batch_size`` rows (or as many as a token budget allows), padded to its longest row. First fit fills the rows of
every micro-batch but the last, whose rows are then packed again as short and even as the samples allow. In a row
every sample's ``position_ids`` restart at 0 and there is no attention mask: transformers then builds a
block-diagonal causal mask from the positions, so no sample sees another (it does so only when ``attention_mask``
is None and no KV cache is used — hence ``use_cache=False`` in every packed batch). The first label of every sample
is -100: no token is trained to predict the next sample. A causal LM never predicts a row's first label either, so a
window's shifted label count is exactly the unpacked one.

    >>> pack_rows([0, 1, 2, 3], lambda i: [5, 3, 4, 2][i], capacity=8)
    [(0, 1), (2, 3)]
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Optional

import torch

from finetune.data import right_pad
from finetune.errors import ConfigError
from finetune.items import count_items, is_causal_lm
from finetune.models.forward import compute_loss


def pack_rows(members, length_of, capacity: int, rows_per_batch: Optional[int] = None) -> list[tuple]:
    """Rows of whole samples, each at most ``capacity`` tokens (a longer sample gets a row of its own), by first-fit
    decreasing, fullest first. With ``rows_per_batch`` (the rows of a full micro-batch), the last micro-batch's rows
    are made short and even (:func:`even_last_batch`). Deterministic: ties in length keep the members' order."""
    order = sorted(members, key=lambda i: -length_of(i))
    rows, room = [], []
    for i in order:
        n = length_of(i)
        r = next((k for k, free in enumerate(room) if n <= free), None)
        if r is None:
            rows.append([i])
            room.append(capacity - n)
        else:
            rows[r].append(i)
            room[r] -= n
    rows = fullest_first(rows, length_of)
    if rows_per_batch and len(rows) > 1:
        rows = even_last_batch(order, length_of, capacity, rows, rows_per_batch)
    return [tuple(r) for r in rows]


def even_last_batch(order, length_of, capacity: int, rows: list, per_batch: int) -> list:
    """``rows`` (first fit of ``order``, fullest first) packed again so that the last micro-batch wastes less.

    A micro-batch is padded to its longest row, and first fit leaves the last micro-batch's rows part-empty and
    uneven. So keep its number of rows r and find (by bisection) the narrowest width w at which first fit still
    places the window into the full micro-batches' rows of ``capacity`` plus r rows of w. Kept only when it pads
    less. Samples only move between rows of the same window: the step does not change."""
    full = (len(rows) - 1) // per_batch * per_batch
    tail = len(rows) - full
    spill = sum(map(length_of, order)) - full * capacity  # tokens the full micro-batches cannot hold
    lo, hi, best = max(1, -(-spill // tail)), capacity, None
    while lo <= hi:
        width = (lo + hi) // 2
        fitted = first_fit(order, length_of, [capacity] * full + [width] * tail)
        if fitted is None:
            lo = width + 1
        else:
            best, hi = fitted, width - 1
    if best is None:
        return rows
    best = fullest_first([r for r in best if r], length_of)
    return best if padded_tokens(best, length_of, per_batch) < padded_tokens(rows, length_of, per_batch) else rows


def fullest_first(rows: list, length_of) -> list:
    return sorted(rows, key=lambda row: -sum(map(length_of, row)))


def padded_tokens(rows: list, length_of, per_batch: int) -> int:
    """Tokens of ``rows`` (fullest first) cut into micro-batches of ``per_batch``, each padded to its longest."""
    fills = [sum(map(length_of, r)) for r in rows]
    return sum(len(fills[k:k + per_batch]) * fills[k] for k in range(0, len(fills), per_batch))


def first_fit(order, length_of, sizes: list) -> Optional[list]:
    """Each sample of ``order`` into the first row with room, rows of the given ``sizes``; None if one fits nowhere."""
    rows, room = [[] for _ in sizes], list(sizes)
    for i in order:
        n = length_of(i)
        r = next((k for k, free in enumerate(room) if n <= free), None)
        if r is None:
            return None
        rows[r].append(i)
        room[r] -= n
    return rows


def _tokens(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def packable_sample(sample) -> bool:
    """A causal-LM sample packing understands: ``input_ids`` (a token sequence) and optionally token ``labels`` of
    the same length. Other keys are not packed (the set-up check compares the job's loss with and without them)."""
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        return False
    ids = sample["input_ids"]
    if isinstance(ids, torch.Tensor) and ids.dim() != 1:
        return False
    labels = sample.get("labels")
    return labels is None or (not isinstance(labels, (int, float)) and len(_tokens(labels)) == len(_tokens(ids)))


class PackedRows(torch.utils.data.Dataset):
    """A view of a dataset whose items are rows: ``view[(i, j, k)]`` is samples i, j, k laid end to end."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, row: tuple) -> dict:
        return join_samples([self.data[i] for i in row])


def join_samples(samples: list) -> dict:
    """Samples laid end to end in one row: their tokens, labels (each sample's first one -100) and positions (each
    restarting at 0)."""
    ids, labels, positions = [], [], []
    for sample in samples:
        x = _tokens(sample["input_ids"])
        y = _tokens(sample["labels"]) if sample.get("labels") is not None else list(x)
        y[0] = -100  # not trained to predict a sample from the one before it
        ids += x
        labels += y
        positions += range(len(x))
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def collate_rows(rows: list) -> dict:
    """Right-pad packed rows to the longest. The padding is a block of its own (positions restart at 0, labels
    -100), so it neither sees nor is seen by a sample."""
    longest = max(len(r["input_ids"]) for r in rows)
    positions = [list(r["position_ids"]) + list(range(longest - len(r["position_ids"]))) for r in rows]
    batch = {"input_ids": right_pad([r["input_ids"] for r in rows], 0),
             "labels": right_pad([r["labels"] for r in rows], -100),
             "position_ids": right_pad(positions, 0), "use_cache": False}
    if "attention_mask" in rows[0]:  # rows whose samples attend to each other (knapsack_row) say so with a mask
        batch["attention_mask"] = right_pad([r["attention_mask"] for r in rows], 0)
    return batch


# ---------------------------------------------------------------------------------------------------------------
# set-up: is packing exact for this model?


@torch.no_grad()
def packing_problem(model, data, length_of, loss_fn=None, rtol: float = 1e-4):
    """On the actual model and the job's own loss path: do two short training samples packed in one row give the
    logits, and the item-weighted loss, each gives alone? Returns None when they do, else what differs. Catches a
    model whose attention ignores packed positions and a ``loss_fn`` that drops ``position_ids``."""
    picks = sorted(range(min(len(data), 64)), key=length_of)[:2]
    rows = PackedRows([{"input_ids": _tokens(data[i]["input_ids"])[:16]} for i in picks])
    device = next(model.parameters()).device
    on = lambda batch: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}  # noqa: E731
    packed, alone = on(collate_rows([rows[(0, 1)]])), [on(collate_rows([rows[(k,)]])) for k in (0, 1)]
    was_training = model.training
    model.eval()  # dropout off: the comparison must be deterministic
    try:
        logits = lambda b: model(**{k: v for k, v in b.items() if k != "labels"}).logits[0].float()  # noqa: E731
        whole, parts = logits(packed), torch.cat([logits(b) for b in alone])
        if (whole - parts).abs().max() > rtol * max(1.0, float(parts.abs().max())):
            return "its attention lets packed samples see each other (it ignores position_ids)"
        try:
            items = [count_items(b, causal=True) for b in alone]
            separate = sum(float(compute_loss(model, b, loss_fn)[0]) * n for b, n in zip(alone, items)) / sum(items)
            together = float(compute_loss(model, packed, loss_fn)[0])
        except Exception as error:  # a loss_fn written for padded batches
            return f"the job's loss_fn cannot take a packed batch ({type(error).__name__}: {error})"
        if abs(together - separate) > rtol * max(abs(separate), 1e-12):
            return "the job's loss on a packed row differs from its samples' (does its loss_fn drop position_ids?)"
        return None
    finally:
        model.train(was_training)


def decide_packing(requested, model, data, length_of, loss_fn):
    """Whether this run packs: (sample length function to pack by, or None; the banner's word on it).

    ``requested`` is ``training.packing``: True refuses with one line when packing would not be exact; None packs
    where it is exact and keeps sorted windows otherwise. Without ``Job.length_of`` the lengths are read from the
    samples (the Python API's causal LMs pack too)."""
    if requested is False:
        return None, "off (training.packing=false)"
    name = type(model.get_base_model() if hasattr(model, "get_base_model") else model).__name__
    if not is_causal_lm(model):
        reason = "the model is not a causal LM"
    elif len(data) < 2 or not packable_sample(data[0]):
        reason = "samples are not token sequences (input_ids, optional token labels)"
    else:
        if length_of is None:
            lengths = [len(_tokens(data[i]["input_ids"])) for i in range(len(data))]
            length_of = lengths.__getitem__
        reason = packing_problem(model, data, length_of, loss_fn)
    if reason is None:
        return length_of, "on (each window's samples packed in rows; the same windows and steps)"
    if requested:
        raise ConfigError(f"training.packing: cannot pack for {name}: {reason}; set training.packing=false")
    return None, f"off ({name}: {reason}); sorted windows instead"


# ---------------------------------------------------------------------------------------------------------------
# the whole set packed before sampling, as LLaMA-Factory 0.9.5 packs it (data.pack=knapsack)


def greedy_knapsack(lengths: list, capacity: int) -> list:
    """Sample indices in knapsacks of at most ``capacity`` tokens, as LLaMA-Factory's ``greedy_knapsack`` fills them:
    lengths sorted, each knapsack taking the longest that still fits until none does; of equal lengths the sample
    seen last goes first (its ``length2indexes[length].pop()``). Every length must be at most ``capacity``.

        >>> greedy_knapsack([3, 5, 2, 3], capacity=8)
        [[1, 3], [0, 2]]
    """
    by_length: dict = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    numbers, sacks = sorted(lengths), []
    while numbers:
        sack, room = [], capacity
        while (k := bisect.bisect(numbers, room)) > 0:
            n = numbers.pop(k - 1)
            room -= n
            sack.append(by_length[n].pop())
        sacks.append(sack)
    return sacks


def contiguous_groups(n: int, shards: int, group: int) -> list:
    """Row ranges packed together: ``datasets``' contiguous shards of ``n`` rows (``Dataset.map(num_proc=shards)``,
    at most one per row), each cut into batches of ``group`` rows (``map(batched=True, batch_size=group)``)."""
    shards = max(1, min(shards, n))
    div, mod = divmod(n, shards)
    out = []
    for k in range(shards):
        start = div * k + min(k, mod)
        end = start + div + (1 if k < mod else 0)
        out += [range(s, min(s + group, end)) for s in range(start, end, group)]
    return out


def knapsack_row(samples: list, width: int, pad_id: int, apart: bool = False) -> dict:
    """Samples laid end to end as LLaMA-Factory lays a knapsack: their tokens and labels as they are, positions
    restarting at each, then padding to ``width`` (pad tokens at position 0, labels -100). The attention mask is all
    ones, padding too: the samples attend to each other (without neat_packing it builds no block mask). ``apart``
    (its neat_packing, a block-diagonal mask): no mask, so that transformers keeps each sample to itself by its
    restarting positions, as :func:`join_samples`' rows."""
    ids, labels, positions = [], [], []
    for sample in samples:
        x = _tokens(sample["input_ids"])
        ids += x
        labels += _tokens(sample["labels"]) if sample.get("labels") is not None else x
        positions += range(len(x))
    pad = width - len(ids)
    row = {"input_ids": ids + [pad_id] * pad, "labels": labels + [-100] * pad, "position_ids": positions + [0] * pad}
    return row if apart else {**row, "attention_mask": [1] * width}
