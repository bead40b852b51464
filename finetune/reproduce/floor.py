"""The rounding floor a comparison is judged against: measured on a twin run, or assumed from the tables.

Two runs of the same computation in other layouts differ by rounding alone; how much depends on the precision, the
kernels and the model, so the certificate's tolerances rest on a *floor*:

* **measured** (``finetune compare A B --floor TWIN``): ``TWIN`` is the same run as ``A`` in another layout (another
  ``--batch-size``: the same windows, lr and settings; the smallest micro-batch is the most different from a big
  batch, so it samples the most noise). Per layer and step the floor is the largest ``|A − TWIN|`` up to that step:
  there B may stand ``STEP_FACTOR`` times it from A *or* from TWIN (the nearer of two references: one pair of layouts
  can sit unusually close), at most ``TWIN_FACTOR`` times the largest over the run and never less than the fp32
  tolerance. The weights: ``TWIN_FACTOR`` times their distance. The least tolerance of each layer is the verdict's
  power: the smallest difference it could have seen.
* **assumed** (no twin): fp32 runs keep the fp32 tolerances (docs/exact-steps.md#the-certificate); bf16 / fp16 runs,
  and fp32 runs whose matrix products ran in TF32, get ``TWIN_FACTOR`` × the largest layout difference measured in
  that arithmetic on the runs' kind of device (``ASSUMED``: the 2-core CPU, an H200), and the verdict says that it
  rests on an assumed floor.

Beside the per-step rule, ``one_sided`` catches a shift that stays under the tolerance at every step but always has
the same sign (a dropped or doubled term), and ``moved`` whether the loss moved beyond the tolerance at all: a run
that does not train passes a loose tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

# Megatron-LM's golden values use 1.5–3× the largest deviation among repeated runs of one layout. Across layouts
# the noise of one pair varies more: on SmolLM2 in bf16 (8 steps) the three pairs of (8,1), (4,2), (2,4) stood
# 2.8e-3, 2.4e-3 and 7.6e-4 apart in the loss, so with (2,4) as the twin a layout stands 3.2× the floor from the
# nearer reference; 4× passes it, and the one-word control (1.7e-2) stays above 4× either pair's floor
# (docs/exact-steps.md#bf16-the-floor-measured-on-a-twin).
TWIN_FACTOR = 4.0
# A measured floor's per-step factor: at each step the baseline (or run B) may stand this many times the twin's largest
# distance up to that step from the nearer of the run and its twin, and never more than TWIN_FACTOR × the twin's
# largest over the run (the rule above). Measured (docs/exact-steps.md#bf16-per-step-bands-the-power-stated): bf16,
# a random Llama of hidden size 576, LoRA and full, 12 steps at micro-batch 8, 4, 2 and 1, each layout as the run,
# the twin and the third: the third stood at most 7.9× the twin's distance up to the step (the 99th percentile
# 4.8–7.9; at the early steps, where the twin happened to land close), and at most 2.4× the twin's largest over the
# run. The factor leaves 1.5× room above the largest ratio.
STEP_RATIO = 8.0
STEP_FACTOR = 1.5 * STEP_RATIO
# the fp32 tolerances (the least any floor gives): a step's loss, its grad norm and clipping, the weights
FP32 = {"loss": 1e-4, "grad norm": 1e-3, "weights L2": 1e-4, "weights largest": 1e-5}
# The largest difference between layouts of the sft recipe (SmolLM2, LoRA and full, packing and the chunked head as
# shipped, fp32 sums and window padding on), per arithmetic and the device it was measured on, by
# `python benchmarks/floor.py --precision bf16 --steps 8 --control` (and --steps 64; TF32: the fp32 runs with
# TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1): docs/exact-steps.md#bf16 and #on-a-gpu. Assumed, it is wide: on the CPU the
# one-word control (loss 1.7e-2) sits at the edge of 4× it, and on the H200 inside it, which the verdict says; a
# twin is the way to a floor of the user's own hardware.
ASSUMED = {
    ("bf16", "cpu"): {"loss": 4.2e-3, "grad norm": 1.4e-2, "weights L2": 5.2e-3, "weights largest": 8.6e-2},
    ("bf16", "cuda"): {"loss": 6.6e-3, "grad norm": 8.9e-2, "weights L2": 1.9e-2, "weights largest": 1.0e-1},
    ("tf32", "cuda"): {"loss": 1.9e-4, "grad norm": 1.7e-3, "weights L2": 1.1e-3, "weights largest": 2.7e-2},
}
MEASURED_ON = {"cpu": "a 2-core CPU", "cuda": "an NVIDIA H200"}
# Where the floor is as large as a one-word change of the data, measured beside it: the verdict says so.
WITHIN_FLOOR = {("bf16", "cuda"): "on the H200 a one-word change of the data (loss 1.5e-2 to 2.1e-2 apart) stays "
                                  "inside this floor: equivalent rules out a wrong step, not that"}
# at least this many steps, all of one sign, before a shift is told from noise of either sign (2^(1−n) ≤ 3 %)
SHIFT_STEPS = 6


@dataclass(frozen=True)
class Floor:
    """The tolerances of one comparison and what they rest on. ``kind``: fp32's own tolerances, a floor assumed from
    ``ASSUMED`` (outside it a layer is "not certified": an assumed floor errs both ways), or one measured on a twin."""

    kind: Literal["fp32", "assumed", "measured"]
    overall: dict                                 # layer → the largest difference the floor allows, whole run
    noise: dict = field(default_factory=dict)     # layer → [|A − TWIN| / scale at each step] (measured floors)
    note: str | None = None                       # for the verdict: what the floor rests on
    twin: object = None                           # the twin run read (a runs.Run; measured floors): a second reference
    arithmetic: Optional[str] = None              # an assumed floor's: "bf16", "fp16" or "tf32"
    steps: dict = field(default_factory=dict)     # layer → {optimizer step: its tolerance} (measured floors)
    dropout: bool = False                         # measured on a twin at another dropout seed: dropout's noise

    @property
    def assumed(self) -> bool:
        return self.kind == "assumed"

    def at(self, layer: str, step: int) -> float:
        """The tolerance of ``layer`` at optimizer ``step``: its own where measured per step, else the whole run's."""
        return self.steps.get(layer, {}).get(step, self.overall[layer])


def assumed(precision: str | None, arithmetics=()) -> Floor:
    """The floor without a twin: fp32's tolerances, or ``TWIN_FACTOR`` × the layout noise measured in this
    arithmetic (16-bit autocast, or fp32 matrix products in TF32) on the runs' kind of device (``arithmetics``: each
    run's record, :func:`arithmetic`; a run without one is taken as a CPU run in IEEE fp32), the wider of the two."""
    tf32 = any((x or {}).get("tf32") for x in arithmetics)
    full = precision in ("no", None, "fp32")
    kind = ("tf32" if tf32 else None) if full else precision
    if kind is None:
        return Floor("fp32", dict(FP32))
    devices = sorted({(x or {}).get("device", "cpu") for x in arithmetics} or {"cpu"})
    keys = [assumed_key(kind, d) for d in devices]
    tables = [ASSUMED[k] for k in keys]
    where = " and ".join(MEASURED_ON.get(d, d) + ("" if k[0] == kind else f" (in {k[0]}: {kind} is not measured "
                                                  "there, and bf16's coarser rounding bounds it)")
                         for d, k in zip(devices, keys))
    caveat = "; ".join(WITHIN_FLOOR[k] for k in keys if k in WITHIN_FLOOR)
    return Floor("assumed", {k: max(TWIN_FACTOR * max(t[k] for t in tables), FP32[k]) for k in FP32}, arithmetic=kind,
                 note=f"rests on an assumed {kind} floor ({TWIN_FACTOR:g} × the layout noise measured on {where}, "
                      f"docs/exact-steps.md#bf16){'; ' + caveat if caveat else ''}; measure it on this hardware: "
                      "finetune compare A B --floor TWIN")


def assumed_key(kind: str, device: str) -> tuple:
    """The entry of ``ASSUMED`` for ``kind``'s arithmetic on ``device``: its own, else CUDA's; fp16 where it was not
    measured takes bf16's, whose 8-bit significand rounds more coarsely than fp16's 11."""
    tried = [(kind, device), *([("bf16", device)] if kind == "fp16" else []), (kind, "cuda"), ("bf16", "cuda")]
    return next(key for key in tried if key in ASSUMED)


def measured(a_history: list, twin_history: list, weights: dict, twin_name: str) -> Floor:
    """The floor from a twin of run A, per step: at each step, per layer, ``STEP_FACTOR`` × the largest relative
    ``|A − TWIN|`` up to that step, at most ``TWIN_FACTOR`` × the largest over the run (``overall``) and at least the
    fp32 tolerance — the twin's distance where the step is, not only the run's largest, which let an early step's
    change hide under a late step's drift; up to the step, as one step's distance is a single heavy-tailed draw
    (SmolLM2: another layout stood 5× the twin's distance at step 3). The weights from their distance (``weights``:
    layer → the twin's difference), ``TWIN_FACTOR`` × it."""
    noise, overall, steps = {}, {}, {}
    for layer, key in (("loss", "loss"), ("grad norm", "grad_norm")):
        noise[layer] = [rel(x.get(key), y.get(key)) for x, y in zip(a_history, twin_history)]
        running = [max(noise[layer][:i + 1]) for i in range(len(noise[layer]))]
        overall[layer] = max(TWIN_FACTOR * max(noise[layer], default=0.0), FP32[layer])
        steps[layer] = {x["step"]: max(min(STEP_FACTOR * d, overall[layer]), FP32[layer])
                        for x, d in zip(a_history, running)}
    for layer in ("weights L2", "weights largest"):
        overall[layer] = max(TWIN_FACTOR * weights.get(layer, 0.0), FP32[layer])
    worst = ", ".join(f"{k} {max(v, default=0):.1e}" for k, v in noise.items())
    return Floor("measured", overall, noise=noise, steps=steps,
                 note=f"floor measured on {twin_name} (largest {worst}; each step held to {STEP_FACTOR:g}× the "
                      f"twin's largest distance up to it, at most {TWIN_FACTOR:g}× the run's largest, at least "
                      "fp32's)")


def rel(x, y) -> float:
    """|x − y| relative to the larger magnitude (0 for a pair not logged on both sides as finite numbers: a skipped
    fp16 step's inf or NaN grad norm is no rounding to take a floor from; the skipped-steps layer judges it)."""
    if not isinstance(x, (int, float)) or not isinstance(y, (int, float)) or not math.isfinite(x) or \
            not math.isfinite(y):
        return 0.0
    return abs(x - y) / max(abs(x), abs(y), 1e-12)


def one_sided(xs: list, ys: list, fl: Floor) -> str | None:
    """A shift of ``ys`` from ``xs`` (losses, step by step) that has one sign at every step and a mean above
    ``TWIN_FACTOR`` × the floor's mean noise (measured, or the assumed tolerance / ``TWIN_FACTOR``); None when there is
    none. Noise of either sign takes one sign at ``n`` steps with probability 2^(1−n)."""
    pairs = [(x, y) for x, y in zip(xs, ys) if isinstance(x, (int, float)) and isinstance(y, (int, float))]
    if len(pairs) < SHIFT_STEPS:
        return None
    signed = [(y - x) / max(abs(x), abs(y), 1e-12) for x, y in pairs]
    if not (all(s > 0 for s in signed) or all(s < 0 for s in signed)):
        return None
    noise = fl.noise.get("loss")
    typical = sum(noise) / len(noise) if noise else fl.overall["loss"] / TWIN_FACTOR
    mean = sum(signed) / len(signed)
    if abs(mean) <= TWIN_FACTOR * typical:
        return None
    return (f"the loss is {'above' if mean > 0 else 'below'} at all {len(signed)} steps, by {abs(mean):.2e} on "
            f"average ({TWIN_FACTOR:g}× the floor's mean noise: {TWIN_FACTOR * typical:.2e})")


def moved(history: list, tolerance: float) -> bool:
    """Whether the run's loss moved beyond ``tolerance`` (relative) between its first and last step."""
    losses = [h["loss"] for h in history if isinstance(h.get("loss"), (int, float))]
    return len(losses) > 1 and rel(losses[0], losses[-1]) > tolerance
