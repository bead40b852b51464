"""What a window held: a hash of its samples' content, beside the hash of their ids (``windows.membership_hash``).

Two runs whose windows hold the same sample *ids* may still have trained on other data: one word of one answer
changed, another tokenizer, another truncation. So every sample the loader hands over is hashed as the task built
it (its token ids and labels, its tensors' bytes — before collation, padding or packing), and a window's hash is
the sum of its samples' digests: free of their order, of how the window is cut into micro-batches, of the processes
(each sums its own, one all-reduce adds them) and of packing. ``finetune compare`` then names the first step whose
window held other content, exactly, in any precision.

    >>> a, b = sample_digest({"input_ids": [1, 2, 3]}), sample_digest({"input_ids": [1, 2, 4]})
    >>> window_content([a, b]) == window_content([b, a]) != window_content([a, a])
    True
"""

from __future__ import annotations

import functools
import hashlib
import struct
from array import array
from collections.abc import Mapping

import numpy as np
import torch

# A sample's digest is LANES numbers of LANE_BITS bits; a window sums them lane by lane in int64, exact for windows
# of up to 2^(63 − LANE_BITS) samples.
LANES, LANE_BITS = 4, 32


def sample_digest(item) -> tuple:
    """The digest of one training sample as the task's dataset returns it (a dict of token lists or tensors, a
    tensor, a tuple of them, text …): ``LANES`` integers."""
    h = hashlib.blake2b(digest_size=LANES * LANE_BITS // 8)
    _feed(h, item)
    return LANE_VALUES.unpack(h.digest())


# the digest's bytes as LANES little-endian unsigned integers of LANE_BITS
LANE_VALUES = struct.Struct(f"<{LANES}I" if LANE_BITS == 32 else f"<{LANES}Q")


def _feed(h, x) -> None:
    """Feed ``x`` to ``h`` with its type and shape, so that [1, 2] + [3] and [1] + [2, 3] differ. (Tensors first and
    a dict's keys from a cache: a sample's digest is the loop's fixed cost per sample, a few microseconds.)"""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        h.update(_tensor_header(x.dtype, tuple(x.shape)))
        # its buffer, not a copy; numpy has no bf16, whose bytes are read through a uint8 view (the same bytes)
        h.update(x.numpy() if x.dtype in NUMPY_DTYPES else x.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(x, Mapping):
        h.update(b"{%d" % len(x))
        for key in sorted(x, key=str):
            h.update(_key_text(str(key)))
            _feed(h, x[key])
    elif isinstance(x, np.ndarray):
        h.update(f"A{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    elif isinstance(x, (list, tuple)):
        h.update(b"[%d" % len(x))
        packed = _int_array(x)
        if packed is not None:  # token lists: one update, not one per token
            h.update(packed)
        else:
            for v in x:
                _feed(h, v)
    elif isinstance(x, str):
        h.update(_text(x))
    elif isinstance(x, bytes):
        h.update(b"b%d:" % len(x) + x)
    else:  # numbers, None, booleans
        h.update(f"{type(x).__name__}:{x!r};".encode())


def _text(x: str) -> bytes:
    encoded = x.encode()
    return b"s%d:" % len(encoded) + encoded


@functools.lru_cache(maxsize=4096)
def _key_text(key: str) -> bytes:
    """A dict key as a string is hashed (the same few keys in every sample)."""
    return _text(key)


NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                torch.uint8, torch.bool}


@functools.lru_cache(maxsize=4096)
def _tensor_header(dtype, shape: tuple) -> bytes:
    """A tensor's dtype and shape as hashed (made once per kind: a sample's fixed cost is in the microseconds)."""
    return f"T{dtype}{shape}".encode()


def _int_array(xs) -> bytes | None:
    """A list of plain ints as int64 bytes (None when it holds anything else)."""
    if not xs or not all(type(v) is int for v in xs):
        return None
    try:
        return b"i" + array("q", xs).tobytes()
    except OverflowError:
        return None


def window_content(digests) -> tuple:
    """The lane-wise sum of sample ``digests``: what one process's part of a window held (add the processes')."""
    return tuple(sum(lane) for lane in zip(*digests)) if digests else (0,) * LANES


def content_hash(lanes) -> str:
    """The window's content hash as history records it (12 hex digits), from its summed lanes."""
    return hashlib.sha1(",".join(map(str, lanes)).encode()).hexdigest()[:12]


class Digested(torch.utils.data.Dataset):
    """The training set as the loop's loader reads it: for a key (a sample index, or a packed row's tuple of them),
    the item to collate and the digests of the samples it holds. ``join``: lays a packed row's samples end to end."""

    def __init__(self, data, join=None):
        self.data, self.join = data, join

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        if self.join is None:
            item = self.data[key]
            return item, (sample_digest(item),)
        items = [self.data[i] for i in key]
        return self.join(items), tuple(map(sample_digest, items))


class digested_collate:  # noqa: N801  (used as a function; a class so that loader workers can pickle it)
    """``collate`` for items of :class:`Digested`: (the micro-batch, the lane sums of its samples' digests)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, pairs):
        return self.collate([item for item, _ in pairs]), window_content([d for _, ds in pairs for d in ds])
