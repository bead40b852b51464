"""Turning a dataset into windows: the samples of one optimizer step, split into micro-batches per process.

A *window* holds the samples the baseline put in one batch: ``B = micro_batch × N × processes`` consecutive samples
of the epoch's seeded order (the epoch's last window holds the rest). Which samples form a window therefore depends
on the seed and on B only — never on how B is split — so ``(b, N, W)`` and ``(b·N·W, 1, 1)`` see the same windows.
A window never spans two epochs.

Inside a window the samples are cut into micro-batches of ``b`` (the last may be short) and dealt round-robin to
the processes. When a short window leaves a process without a micro-batch at some micro-step, that process still
runs one (a copy of the window's first sample) with weight 0, so every process joins every gradient all-reduce.

    >>> w = WindowSpec(10, micro_batch=2, accumulation=2, processes=1, seed=0).epoch(0, rank=0)
    >>> [len(x.micro_batches) for x in w], [len(m) for m in w[-1].micro_batches]
    ([2, 2, 1], [2])
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch.utils.data import default_collate

from finetune import seeding
from finetune.content import Digested, digested_collate, window_content
from finetune.packing import collate_rows, join_samples, pack_rows


@dataclass(frozen=True)
class Window:
    epoch: int
    index: int                          # window number within the epoch
    samples: tuple                      # every sample index of the window, all processes, in epoch order
    micro_batches: tuple                # this process's micro-batches: tuples of sample indices
    active: tuple                       # False where the micro-batch is a weight-0 placeholder
    total_micro_batches: int = 0        # real micro-batches of the window over all processes
    # packed windows: per micro-batch of this process, (real, padded) tokens — its micro-batches are then tuples of
    # rows, each row a tuple of sample indices (finetune.packing)
    token_counts: Optional[tuple] = None
    # training.process_mean: per micro-batch of this process, the baseline process whose samples it holds, of
    # ``group_count`` (each one's own token mean, averaged over them)
    groups: Optional[tuple] = None
    group_count: int = 0
    # training.replay_padding: per micro-batch of this process, the length its baseline micro-batch was padded to
    pad_lengths: Optional[tuple] = None

    @property
    def sample_hash(self) -> str:
        return membership_hash(self.samples)


def membership_hash(sample_ids) -> str:
    """Short hash of a window's membership (order-free): equal windows ⇔ equal hashes (history's window_hash)."""
    return hashlib.sha1(",".join(map(str, sorted(sample_ids))).encode()).hexdigest()[:12]


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True, sample_order: str = "finetune",
                block: Optional[int] = None) -> list[int]:
    """The epoch's sample order: a permutation from (seed, epoch) alone — finetune's own, with ``block`` its block
    order (:func:`block_order`, for a streamed training set), or with ``sample_order: trainer`` the one HF Trainer
    draws (:func:`trainer_epoch_order`)."""
    if not shuffle:
        return list(range(n))
    if sample_order == "trainer":
        return trainer_epoch_order(n, seed, epoch)
    g = seeding.epoch_generator(seed, epoch)
    if block is not None:
        return block_order(n, block, g)
    return torch.randperm(n, generator=g).tolist()


def block_order(n: int, block: int, g: torch.Generator) -> list[int]:
    """The samples cut into blocks of ``block`` consecutive ones, the blocks in a random order and the samples of
    each block in a random order: a stream reads one block at a time, and the order depends on the seed alone.

        >>> sorted(block_order(5, 2, torch.Generator().manual_seed(0))[:2]) in ([0, 1], [2, 3], [4])
        True
    """
    order = []
    for b in torch.randperm(math.ceil(n / block), generator=g).tolist():
        start = b * block
        order += (start + torch.randperm(min(block, n - start), generator=g)).tolist()
    return order


def trainer_epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """HF Trainer's sample order in ``epoch`` for ``seed`` (its ``data_seed`` when set), as transformers 5.23 with
    accelerate 1.15 draw it: the Trainer's ``RandomSampler`` is swapped by ``accelerator.prepare`` for accelerate's
    ``SeedableRandomSampler`` (``use_seedable_sampler`` is on by default), whose ``initial_seed`` is ``data_seed``
    or else ``torch.random.initial_seed()`` — the seed of the Trainer's own ``set_seed(args.seed)``. Each epoch,
    after the Trainer's ``set_epoch(epoch)``, it reseeds a CPU generator with ``initial_seed + epoch`` and yields
    ``torch.randperm(n)`` from it. The Trainer's batch k is then samples ``k·B … (k+1)·B − 1`` of this order
    (``B`` = per-device batch × accumulation × processes), which is finetune's window k.

        >>> g = torch.Generator().manual_seed(42 + 1)
        >>> trainer_epoch_order(5, seed=42, epoch=1) == torch.randperm(5, generator=g).tolist()
        True
    """
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def windows_per_epoch(n: int, micro_batch: int, accum: int, world: int = 1, drop_last: Optional[int] = None) -> int:
    """Optimizer steps per epoch: the windows of ``micro_batch × accum × world`` samples over the epoch's
    ``kept(n, drop_last)`` samples, the last one possibly short."""
    return math.ceil(kept(n, drop_last) / (micro_batch * accum * world))


def kept(n: int, drop_last: Optional[int]) -> int:
    """The samples an epoch trains on: all ``n``, or with ``drop_last`` the largest multiple of it (its order's last
    ``n mod drop_last`` are dropped: torchtune's incomplete last window, the Trainer's incomplete last micro-batch).

        >>> kept(22, 4), kept(22, None)
        (20, 22)
    """
    return n - n % drop_last if drop_last else n


def even_batch_shares(order: list, size: int, processes: int, per_device: int) -> list[list[list[int]]]:
    """Per window of ``size``, the samples each of a baseline's ``processes`` processes (of ``per_device`` samples
    a batch) held, as accelerate's ``BatchSamplerShard`` (``even_batches``, the Trainer's default) hands an epoch in
    ``order`` to them: consecutive batches dealt round-robin, the epoch's short last batch completed with its first
    samples (and a process left without one given them), so that the last window can hold some samples twice. The
    windows are as many as ``order``'s windows of ``size``."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    accumulation = size // (processes * per_device)
    base = BatchSampler(order, batch_size=per_device, drop_last=False)
    ranks = [list(BatchSamplerShard(base, num_processes=processes, process_index=r, split_batches=False,
                                    even_batches=True)) for r in range(processes)]
    return [[[i for batch in batches[w * accumulation:(w + 1) * accumulation] for i in batch] for batches in ranks]
            for w in range(math.ceil(len(ranks[0]) / accumulation))]


def even_batch_windows(order: list, size: int, processes: int, per_device: int) -> list[list[int]]:
    """The samples each window held over all the baseline's processes (:func:`even_batch_shares`)."""
    return [[i for share in window for i in share] for window in even_batch_shares(order, size, processes, per_device)]


def packed_micro_batches(samples, length_of, capacity: int, rows_per_batch: int, max_tokens: Optional[int]):
    """The window's samples packed into rows, cut into micro-batches of rows; with each micro-batch its (real,
    padded) tokens (padded: rows × the longest row, as ``packing.collate_rows`` pads)."""
    full_batch = max_tokens // capacity if max_tokens else rows_per_batch  # rows of a full micro-batch
    rows = pack_rows(samples, length_of, capacity, full_batch)
    row_len = {row: sum(length_of(i) for i in row) for row in rows}
    chunks = token_budget_chunks(rows, row_len.__getitem__, max_tokens) if max_tokens else \
        [tuple(rows[i:i + rows_per_batch]) for i in range(0, len(rows), rows_per_batch)]
    counts = [(sum(row_len[r] for r in c), len(c) * max(row_len[r] for r in c)) for c in chunks]
    return chunks, counts


def token_budget_chunks(members, length_of, max_tokens: int) -> list[tuple]:
    """Cut ``members`` (in order) into micro-batches of at most ``max_tokens`` padded tokens each."""
    chunks, chunk, longest = [], [], 0
    for i in members:
        n = length_of(i)
        if chunk and (len(chunk) + 1) * max(longest, n) > max_tokens:
            chunks.append(tuple(chunk))
            chunk, longest = [], 0
        chunk.append(i)
        longest = max(longest, n)
    if chunk:
        chunks.append(tuple(chunk))
    return chunks


@dataclass(frozen=True)
class WindowSpec:
    """How a run's samples become windows (``epoch``: every window of one, as one process sees it), settled once at
    start-up (``startup.assemble``) and read by the loop's stream, the banner and ``finetune compare``."""

    samples: int                        # the training set's size
    micro_batch: int
    accumulation: int                   # N
    processes: int
    seed: int
    epochs: int = 1
    shuffle: bool = True
    sample_order: str = "finetune"
    sort_key: Optional[Callable] = None     # sample index → length: each window ordered by it (less padding)
    length_of: Optional[Callable] = None    # sample index → tokens, for token budgets and packing
    max_tokens: Optional[int] = None        # padded tokens per micro-batch (its size then varies)
    pack_capacity: Optional[int] = None     # tokens per packed row; None: not packed
    block: Optional[int] = None             # a streamed training set: shuffled in blocks of this many (block_order)
    drop_last: Optional[int] = None         # each epoch keeps the largest multiple of this many samples (kept())
    even_batches: Optional[tuple] = None    # a baseline's (processes, per-device batch): even_batch_windows()
    process_mean: bool = False              # with even_batches: micro-batches cut per baseline process (cut())
    replay: Optional[tuple] = None          # training.replay_padding: (per-device batch, pad multiple) (cut())

    @classmethod
    def of(cls, t, shape, samples: int, length_of: Optional[Callable] = None,
           pack_length_of: Optional[Callable] = None, pack_capacity: Optional[int] = None,
           block: Optional[int] = None) -> WindowSpec:
        """The spec of a run with settings ``t`` (a TrainingConfig) in ``shape`` over ``samples`` samples whose
        lengths the task gives as ``length_of`` (and which it streams in blocks of ``block``). Windows are sorted by
        length unless ``t.sort_within_window`` says otherwise, whenever the lengths are known."""
        replay = tuple(t.replay_padding) if getattr(t, "replay_padding", None) else None
        # replayed micro-batches are the baseline's, in its sampler order: sorting would regroup them
        sort = t.sort_within_window if t.sort_within_window is not None else length_of is not None and not replay
        return cls(samples, shape.micro_batch, shape.accumulation, shape.processes, t.seed, t.epochs, t.shuffle,
                   t.sample_order, sort_key=length_of if sort else None, length_of=pack_length_of or length_of,
                   max_tokens=t.max_tokens_per_micro_batch, pack_capacity=pack_capacity, block=block,
                   drop_last=getattr(t, "drop_last", None),
                   even_batches=tuple(t.even_batches) if getattr(t, "even_batches", None) else None,
                   process_mean=bool(getattr(t, "process_mean", False)), replay=replay)

    @property
    def per_epoch(self) -> int:
        return windows_per_epoch(self.samples, self.micro_batch, self.accumulation, self.processes, self.drop_last)

    def with_micro_batch(self, shape) -> WindowSpec:
        """The same windows cut as ``shape`` cuts them (``batch_size: auto`` after an out-of-memory error)."""
        return dataclasses.replace(self, micro_batch=shape.micro_batch, accumulation=shape.accumulation)

    def epoch(self, epoch: int, rank: int = 0) -> list[Window]:
        """Every window of ``epoch`` as process ``rank`` sees it."""
        return list(self.windows(epoch, rank))

    def windows(self, epoch: int, rank: int = 0, first: int = 0):
        """Yield the windows of ``epoch`` from window ``first`` on, as process ``rank`` sees them, each cut when it
        is reached: a streamed window's lengths are read only then."""
        order = epoch_order(self.samples, self.seed, epoch, self.shuffle, self.sample_order, self.block)
        order = order[:kept(self.samples, self.drop_last)]  # the dropped tail: the order's last samples
        size = self.micro_batch * self.accumulation * self.processes
        held = even_batch_shares(order, size, *self.even_batches) if self.even_batches else None
        for w in range(first, self.per_epoch):
            samples = [i for share in held[w] for i in share] if held else order[w * size:(w + 1) * size]
            shares = held[w] if held and self.process_mean else None
            yield Window(epoch, w, tuple(samples), *self.cut(samples, rank, shares))

    def cut(self, samples: list, rank: int, shares: Optional[list] = None) -> tuple:
        """(process ``rank``'s micro-batches, whether each is real, all real micro-batches, their token counts when
        packed, the baseline process each holds and how many there were — with ``shares``) of a window of
        ``samples``.

        ``sort_key`` (sample index → length), when given, orders the window's samples by length before they are cut
        into micro-batches: membership is unchanged, padding shrinks. ``max_tokens`` (with ``length_of``) cuts
        micro-batches of varying size, each at most that many padded tokens (``samples × longest``) — a sample
        longer than the budget goes alone. ``pack_capacity`` (with ``length_of``) packs the window's samples into
        rows of at most that many tokens and cuts micro-batches of ``micro_batch`` rows (or by ``max_tokens``).
        ``shares`` (``training.process_mean``): the samples each baseline process held, cut one share at a time, so
        that no micro-batch mixes two. ``replay`` (``training.replay_padding``): micro-batches cut from the
        baseline's (:meth:`replayed_chunks`), each with the length its baseline micro-batch was padded to."""
        b, world = self.micro_batch, self.processes
        owners = lengths = None
        if self.pack_capacity:
            chunks, counts = packed_micro_batches(samples, self.length_of, self.pack_capacity, b, self.max_tokens)
            placeholder = ((samples[0],),)
        elif self.replay:
            cut = [self.replayed_chunks(share) for share in shares or [samples]]
            chunks, owners = [c for part in cut for c, _ in part], [g for g, part in enumerate(cut) for _ in part]
            counts, placeholder, lengths = None, (samples[0],), [n for part in cut for _, n in part]
            owners = owners if shares is not None else None
        elif shares is not None:
            cut = [self.plain_chunks(share) for share in shares]
            chunks, owners = [c for part in cut for c in part], [g for g, part in enumerate(cut) for _ in part]
            counts, placeholder = None, (samples[0],)
        else:
            chunks, counts, placeholder = self.plain_chunks(samples), None, (samples[0],)
        steps = math.ceil(len(chunks) / world)
        mine, active = [], []
        for s in range(steps):
            j = s * world + rank
            mine.append(chunks[j] if j < len(chunks) else placeholder)
            active.append(j < len(chunks))
        mine_counts = tuple(counts[s * world + rank] if a else (0, 0) for s, a in enumerate(active)) \
            if counts else None
        groups = tuple(owners[s * world + rank] if a else 0 for s, a in enumerate(active)) if owners else None
        # a placeholder runs at the padded length of the window's first micro-batch, which holds its sample
        pads = tuple(lengths[s * world + rank] if a else lengths[0] for s, a in enumerate(active)) \
            if lengths else None
        return tuple(mine), tuple(active), len(chunks), mine_counts, groups, len(shares) if shares else 0, pads

    def replayed_chunks(self, samples) -> list[tuple]:
        """(micro-batch, its padded length) for ``samples`` as a baseline of ``replay = (per-device batch, pad
        multiple)`` cut them: consecutive runs of its per-device batch in sampler order — each process took whole
        per-device batches of a window, so these are its micro-batches on any number of processes — each padded
        to its longest row rounded up to the multiple, and split into micro-batches of at most ``micro_batch``
        here, unsorted, each padded to that same length.

            >>> spec = WindowSpec(8, 2, 4, 1, 0, replay=(4, 8), length_of=[3, 9, 5, 1, 2, 2, 7, 4].__getitem__)
            >>> spec.replayed_chunks(list(range(8)))
            [((0, 1), 16), ((2, 3), 16), ((4, 5), 8), ((6, 7), 8)]
        """
        per_device, multiple = self.replay
        out = []
        for start in range(0, len(samples), per_device):
            batch = samples[start:start + per_device]
            padded = -(-max(self.length_of(i) for i in batch) // multiple) * multiple
            out += [(tuple(batch[i:i + self.micro_batch]), padded) for i in range(0, len(batch), self.micro_batch)]
        return out

    def plain_chunks(self, samples) -> list[tuple]:
        """``samples`` in micro-batches of ``micro_batch`` (or of at most ``max_tokens`` padded tokens), ordered by
        ``sort_key`` when given."""
        members = sorted(samples, key=self.sort_key) if self.sort_key is not None else samples
        return token_budget_chunks(members, self.length_of, self.max_tokens) if self.max_tokens else \
            [tuple(members[i:i + self.micro_batch]) for i in range(0, len(members), self.micro_batch)]


def stream_windows(job, spec: WindowSpec, rank: int, epoch: int, first: int, pin_memory: bool = False,
                   num_workers: int = 0):
    """Yield (window, its micro-batches for this process, windows in its epoch, what this process's part of the
    window held: ``content.window_content``) from window ``first`` of ``epoch`` to the end of the last epoch, as
    ``spec`` cuts them. Each window's micro-batches are collated ahead, so they can be counted before the first
    backward. The position comes in as arguments: the stream depends on nothing the loop mutates. Windows are cut one
    at a time, as the loader reaches them."""
    packed = spec.pack_capacity is not None
    data = Digested(job.train_data, join=join_samples if packed else None)
    collate = digested_collate(collate_rows if packed else job.collate_fn or default_collate)
    for e in range(epoch, spec.epochs):
        # one stream of windows read twice: by the loader's sampler (ahead, with workers) and by this loop
        for_sampler, todo = itertools.tee(spec.windows(e, rank, first if e == epoch else 0))
        # The loader gets its own generator: iter() would otherwise draw a seed from the global RNG, and a run
        # resumed mid-epoch would then see different dropout masks than the uninterrupted one.
        loader = torch.utils.data.DataLoader(
            data, batch_sampler=WindowSampler(for_sampler), collate_fn=collate, num_workers=num_workers,
            pin_memory=pin_memory, generator=torch.Generator().manual_seed(spec.seed + e))
        batches = iter(loader)
        for window in todo:
            loaded = [next(batches) for _ in window.micro_batches]
            # a weight-0 placeholder (a copy of the window's first sample) is not part of what the window held
            held = window_content([lanes for (_, lanes), real in zip(loaded, window.active) if real])
            yield window, [batch for batch, _ in loaded], spec.per_epoch, held


class WindowSampler(torch.utils.data.Sampler):
    """Batch sampler for a DataLoader: yields this process's micro-batches of ``windows`` in order (read once, as the
    loader asks)."""

    def __init__(self, windows: Iterable[Window]):
        self.windows = windows

    def __iter__(self):
        for w in self.windows:
            yield from (list(mb) for mb in w.micro_batches)
