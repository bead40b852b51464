"""The cards ``finetune plan --gpu`` knows, one table: each card's memory, and the peak FLOP/s its speed estimate
(``finetune.memory.speed``) divides by. ``--gpu`` also takes a bare size (``8GiB``, ``12GB``, ``24``: GiB).

The peaks are the vendor's published dense figures — never the "with sparsity" ones, which are twice as high and
count 2:4-structured zeros that a fine-tune does not have:

* ``half``: tensor-core matrix multiplies in bf16 with fp32 accumulation, or fp16 on a card without bf16 (Turing,
  Volta, Pascal), TFLOP/s: what a step computing in bf16 / fp16 (``training.mixed_precision``) runs on;
* ``fp32``: plain fp32, TFLOP/s: torch multiplies fp32 matrices in fp32 (TF32 is off unless a user turns it on), so
  a step without mixed precision runs on this.

None: no published figure at hand; the plan then gives no speed estimate for that card and says so.

``link``: the card's host link, PCIe generation × lanes, from the same datasheets and whitepapers (an SXM card's
host link too: its NVLink joins cards, not the host). What a host offload's traffic crosses (``memory.host``), at
the PCI-SIG signalling rate with 128b/130b encoding (``LANE_GBPS``), one direction — a bound: transfers reach
less.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from finetune.errors import ConfigError
from finetune.memory.measure import GiB


@dataclass(frozen=True)
class Card:
    memory_gib: float
    half: Optional[float] = None    # dense bf16 (fp16 where the card has no bf16) tensor TFLOP/s
    fp32: Optional[float] = None    # dense fp32 TFLOP/s
    what: str = ""                  # the variant the figures are of, and where they are published
    link: str = ""                  # host link: "<PCIe generation> x<lanes>" ("" none at hand)

    def peak(self, precision: str) -> Optional[float]:
        """FLOP/s of a step computing in ``precision`` (training.mixed_precision: no / bf16 / fp16)."""
        tflops = self.fp32 if precision == "no" else self.half
        return tflops * 1e12 if tflops else None

    def link_bytes_per_second(self) -> float:
        """Bytes a second the host link carries each way (0: no link at hand)."""
        if not self.link:
            return 0.0
        generation, lanes = self.link.split(" x")
        return LANE_GBPS[generation] * 1e9 * int(lanes)


# GB/s a PCIe lane carries each way: 8, 16, 32 GT/s (PCIe 3.0, 4.0, 5.0) × 128/130 ÷ 8 bits
LANE_GBPS = {"3.0": 8 * 128 / 130 / 8, "4.0": 16 * 128 / 130 / 8, "5.0": 32 * 128 / 130 / 8}


# Sources: NVIDIA's datasheets (H200, H100, A100, L40S, L4, A10, T4, V100, P100) and architecture whitepapers
# (Ada: RTX 4090 / 4080; GA102: RTX 3090 / 3080; Turing: RTX 2080 Ti, reference clocks), their dense columns; the
# links from the same documents (RTX 3060 / 3070 / 4060 / 4070: NVIDIA's product specifications pages).
CARDS = {
    "t4": Card(16, 65, 8.1, "T4 datasheet: fp16 (no bf16)", link="3.0 x16"),
    "v100": Card(16, 125, 15.7, "V100 SXM2 datasheet: fp16 (no bf16); PCIe 112 / 14", link="3.0 x16"),
    "v100-32gb": Card(32, 125, 15.7, "V100 SXM2 datasheet: fp16 (no bf16); PCIe 112 / 14", link="3.0 x16"),
    "p100": Card(16, 18.7, 9.3, "P100 PCIe datasheet: fp16 without tensor cores (no bf16)", link="3.0 x16"),
    "rtx2080ti": Card(11, 53.8, 13.4, "Turing whitepaper, reference clocks: fp16 (no bf16)", link="3.0 x16"),
    "rtx3060": Card(12, link="4.0 x16"), "rtx3070": Card(8, link="4.0 x16"),
    "rtx3080": Card(10, 59.5, 29.8, "GA102 whitepaper", link="4.0 x16"),
    "rtx3090": Card(24, 71, 35.6, "GA102 whitepaper", link="4.0 x16"),
    "rtx4060": Card(8, link="4.0 x8"), "rtx4070": Card(12, link="4.0 x16"), "rtx4070-laptop": Card(8, link="4.0 x8"),
    "rtx4080": Card(16, 97.5, 48.7, "Ada whitepaper", link="4.0 x16"),
    "rtx4090": Card(24, 165.2, 82.6, "Ada whitepaper", link="4.0 x16"),
    "a10": Card(24, 125, 31.2, "A10 datasheet", link="4.0 x16"),
    "a10g": Card(24),  # AWS's variant of the A10: NVIDIA publishes no tensor figure for it, and it is not the A10's
    "l4": Card(24, 121, 30.3, "L4 datasheet", link="4.0 x16"),
    "l40s": Card(48, 362, 91.6, "L40S datasheet", link="4.0 x16"),
    "a100-40gb": Card(40, 312, 19.5, "A100 datasheet (SXM and PCIe alike)", link="4.0 x16"),
    "a100-80gb": Card(80, 312, 19.5, "A100 datasheet (SXM and PCIe alike)", link="4.0 x16"),
    "a100": Card(80, 312, 19.5, "A100 datasheet (SXM and PCIe alike)", link="4.0 x16"),
    "h100": Card(80, 989, 67, "H100 SXM datasheet; PCIe 756 / 51", link="5.0 x16"),
    "h100-80gb": Card(80, 989, 67, "H100 SXM datasheet; PCIe 756 / 51", link="5.0 x16"),
    "h200": Card(141, 989, 67, "H200 SXM datasheet", link="5.0 x16"),
}


def parse_gpu(spec: str) -> int:
    """``t4`` / ``a100-40gb`` / ``8GiB`` / ``12GB`` / ``24`` (GiB) → bytes.

    Raises:
        ConfigError: neither a card of ``CARDS`` nor a size above 0.
    """
    key = spec.strip().lower()
    if key in CARDS:
        return int(CARDS[key].memory_gib * GiB)
    return parse_size(spec, "--gpu", f"a size like 8GiB or one of: {', '.join(sorted(CARDS))}")


def parse_size(spec: str, flag: str, allowed: str = "a size like 64GiB") -> int:
    """``8GiB`` / ``12GB`` / ``24`` (GiB) → bytes; ConfigError naming ``flag`` and ``allowed`` otherwise."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gib|gb|g)?", spec.strip().lower())
    if not m:
        raise ConfigError(f"{flag}: got {spec!r}; give {allowed}")
    size = int(float(m.group(1)) * GiB)
    if size <= 0:
        raise ConfigError(f"{flag}: got {spec!r}; give the memory, more than 0")
    return size


def speed_card(spec: str, precision: str) -> tuple[Optional[str], str]:
    """(the card whose peak prices ``spec``'s speed, or None; what to say about it). A card by name is itself; a bare
    size is the slowest listed card of exactly that memory with a figure for ``precision`` — the estimate is then the
    longest such a card would take, and the plan says which card that is."""
    key = spec.strip().lower()
    if key in CARDS:
        card = CARDS[key]
        return (key, card.what) if card.peak(precision) else \
            (None, f"no published peak at hand for {key} (finetune/memory/cards.py)")
    size = parse_gpu(spec) / GiB
    same = [name for name, card in CARDS.items() if card.memory_gib == size]
    alike = [name for name in same if CARDS[name].peak(precision)]
    if not alike:
        listed = f"no published peak at hand for the {size:g} GiB cards listed ({', '.join(same)})" if same else \
            f"no listed card has {size:g} GiB"
        return None, f"{listed}: name a card that has one (--gpu t4, l4, a100-40gb, …)"
    slowest = min(alike, key=lambda name: CARDS[name].peak(precision))
    return slowest, (f"assumed: the slowest listed {size:g} GiB card ({', '.join(sorted(alike))}); "
                     f"{CARDS[slowest].what}; name the card for its own figure")
