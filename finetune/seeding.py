"""Seeds and random states, in one place: the seed of a draw keyed by integers (a step, a sample), the generator of
an epoch's sample order, and every random state a checkpoint saves and a resume restores."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def step_seed(*keys: int) -> int:
    """One 63-bit seed from integer keys (e.g. training seed, optimizer step, sample index): the seed of a random
    draw that must not depend on how a window is split into micro-batches."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The generator of epoch ``epoch``'s sample order (``windows.epoch_order``), from (seed, epoch) alone."""
    return torch.Generator().manual_seed(seed * 100_003 + epoch)


def permutation(n: int, seed: int, epoch: int) -> list[int]:
    """finetune's order of ``n`` items in ``epoch``: the windows' sample order when shuffled (a task that orders its
    own items per epoch, as GRPO its prompts, draws the same)."""
    return torch.randperm(n, generator=epoch_generator(seed, epoch)).tolist()


def capture_rng(rank: int, directory: Path) -> None:
    """Write this process's random states (python, numpy, torch, CUDA) into ``directory``: ``rng_<rank>.json`` and
    ``rng_<rank>.safetensors``, without pickle."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    (directory / f"rng_{rank}.json").write_text(json.dumps({
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }))
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = s
    save_file(tensors, str(directory / f"rng_{rank}.safetensors"))


def restore_rng(rank: int, directory: Path) -> None:
    """Set this process's random states to those ``capture_rng`` wrote (CUDA's when the device count is the same)."""
    d = json.loads((directory / f"rng_{rank}.json").read_text())
    random.setstate((d["python"][0], tuple(d["python"][1]), d["python"][2]))
    kind, keys, pos, has_gauss, cached = d["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    tensors = load_file(str(directory / f"rng_{rank}.safetensors"))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
