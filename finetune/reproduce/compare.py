"""``finetune compare RUN_A RUN_B``: did two runs take the same optimizer steps?

"The same step to fp32 rounding" (docs/exact-steps.md#the-certificate) is judged where rounding cannot be amplified:
at every optimizer step, what the optimizer consumed — the window's samples (an order-free hash of their ids) and
their content (an order-free hash of their tokens, ``finetune.content``), its learning rate, its loss, its gradient
norm before clipping and the clipping applied — must agree to fp32 rounding, and the settings that shape the update
(optimizer, betas, weight decay, precision, adapters) must be equal. Each per-step layer names the first step that
differs; the verdict names the earliest. The trained weights are judged last: with a stateless optimizer (SGD)
rounding stays rounding and the largest element may differ by ``FP32["weights largest"]``; an adaptive optimizer (AdamW,
Lion) divides each element's update by its own history, so an element whose gradient is rounding noise takes a full-
size step of either sign, and the weights are then held, as a whole (relative L2), to ``FP32["weights L2"]``, set
from the measured rounding floor. Exit code 0 when equivalent, 1 when a difference is known (settings, windows,
content, a layer outside a measured floor or fp32's), 3 "not certified" when the only differences lie outside an
assumed floor (``Comparison.verdict``; the tolerances: ``floor.FP32``, the machinery: :mod:`verdict`).

Runs with an 8-bit optimizer (``adamw8bit``, ``paged_adamw8bit``) are never called equivalent: their optimizer state
is quantized block-wise, so gradients equal to fp32 rounding (``(b, N)`` against ``(b·N, 1)``) can round to
neighbouring 8-bit codes, and the weights drift apart by far more than fp32 rounding (SmolLM2 QLoRA: 1.6e-3 after 6
steps; docs/low-precision.md). The report says so, checks the windows, the schedule and the loss curve (at
``EIGHT_BIT_LOSS_RTOL``), and prints how far the weights ended apart without judging them (unless ``weight_rtol`` is
given). Exit code 0 then means: the same windows and schedule, loss curves close.
"""

from __future__ import annotations

from pathlib import Path

from finetune.optimizers import ADAPTIVE, EIGHT_BIT
from finetune.reproduce import floor as floors
from finetune.reproduce.runs import read_run
from finetune.reproduce.update_settings import hints, run_settings, setting, settings_of
from finetune.reproduce.verdict import (
    UNKNOWN,
    Comparison,
    Judgement,
    check_settings,
    clipping,
    per_step,
    same_token_counts,
    same_windows,
    skipped_detail,
    twin_floor,
    weights,
)
from finetune.reproduce.weight_diff import weight_distance

# The loss curves of two runs of the same steps with an 8-bit optimizer (their weights drift apart, see above).
EIGHT_BIT_LOSS_RTOL = 1e-2

ROLLOUT_LOGP_ATOL = 1e-4  # old log-probs are recomputed by each run from its own weights: rounding apart


def rollouts(c: Comparison, ra: list | None, rb: list | None) -> None:
    """Online RL: both runs trained on the same rollouts — the same prompts, completion tokens, rewards and
    advantages in every generation batch, and old log-probs within ``ROLLOUT_LOGP_ATOL``. (Without that, equal steps
    are not even expected; with it, the steps are judged as any run's.)"""
    if ra is None and rb is None:
        return
    if ra is None or rb is None:
        c.add("rollouts", False, "only one of the runs recorded rollouts (rollouts.jsonl)")
        return
    exact = ("epoch", "batch", "prompts", "completions", "rewards", "advantages")
    bad = next((i for i, (x, y) in enumerate(zip(ra, rb)) if any(x.get(k) != y.get(k) for k in exact)), None)
    if bad is not None or len(ra) != len(rb):
        where = f"generation batch {ra[bad]['batch']} of epoch {ra[bad]['epoch']}" if bad is not None else \
            f"{len(ra)} vs {len(rb)} generation batches"
        c.add("rollouts", False, f"differ at {where} (prompts, completions, rewards or advantages)")
        return
    worst = max((abs(u - v) for x, y in zip(ra, rb) for p, q in zip(x["old_log_probs"], y["old_log_probs"])
                 for u, v in zip(p, q)), default=0.0)
    c.measured["rollouts"] = worst
    c.add("rollouts", worst <= ROLLOUT_LOGP_ATOL, f"{len(ra)} generation batches: the same completions, rewards and "
          f"advantages; old log-probs within {worst:.1e} (tolerance {ROLLOUT_LOGP_ATOL:g})",
          basis=f"the same rollouts ({len(ra)} generation batches)")


def compare_runs(run_a, run_b, weight_rtol: float | None = None, loss_rtol: float | None = None,
                 twin=None) -> Comparison:
    """Compare two run directories as the module's docstring says: the settings, the windows, then every step's lr,
    loss, grad norm and clipping, then the weights — at the tolerances of the floor (``twin``: a twin run of
    ``run_a``, the same computation in another layout, whose distance from it is measured; else the floor assumed for
    the runs' precision, finetune.reproduce.floor) unless given. Raises ConfigError when the twin is not the same
    computation as ``run_a``."""
    a, b = read_run(run_a), read_run(run_b)
    ha, hb = a.history, b.history
    c = Comparison()
    optimizers = [setting(r.config, "training.optimizer") for r in (a, b)]
    c.eight_bit = next((o for o in optimizers if o in EIGHT_BIT), None)
    fl = twin_floor(a, Path(twin), optimizers[0]) if twin is not None else \
        floors.assumed(setting(a.config, "training.mixed_precision") if a.config else None,
                       [r.metrics.get("arithmetic") for r in (a, b)])
    c.qualifier, c.within = fl.note, "dropout noise" if fl.dropout else None
    # the layers held to an assumed floor: outside it, "not certified" (a user's own tolerance is no assumption)
    assumed = fl.assumed
    names = tuple(dict.fromkeys(settings_of(a.config) + settings_of(b.config)))  # both tasks' settings
    check_settings(c, run_settings(b.config, names), run_settings(a.config, names))
    rollouts(c, a.rollouts, b.rollouts)

    ea, eb = a.metrics.get("effective_batch_size"), b.metrics.get("effective_batch_size")
    split = lambda m: f"{m.get('effective_batch_size')} ({m.get('gradient_accumulation_steps')} micro-batches/step)"
    c.add("effective batch", ea == eb, f"{split(a.metrics)} vs {split(b.metrics)}")
    c.add("optimizer steps", len(ha) == len(hb), f"{len(ha)} vs {len(hb)}")
    n = min(len(ha), len(hb))
    same_windows(c, ha, hb, n)
    same_token_counts(c, ha, hb, n)
    skipped_steps(c, ha[:n], hb[:n])
    steps = [h["step"] for h in ha[:n]]
    grad_tol = per_step_losses(c, (a, b), fl, steps, loss_rtol)
    th = fl.twin.history[:n] if fl.twin else None  # the second reference of a measured floor
    norms_a, norms_b = [h["grad_norm"] for h in ha[:n]], [h["grad_norm"] for h in hb[:n]]
    per = fl.steps.get("grad norm") if not c.eight_bit else None  # a floor measured per step
    judged = Judgement(grad_tol, twin=[h["grad_norm"] for h in th] if th else None, assumed=assumed, steps=per)
    per_step(c, "grad norm", (steps, norms_a, norms_b), judged, what="before clipping")
    limits = tuple(setting(r.config, "training.max_grad_norm") if r.config else UNKNOWN for r in (a, b))
    clipping(c, (steps, norms_a, norms_b), limits, judged)
    adaptive = optimizers[0] in ADAPTIVE or optimizers[0] is None
    nearer = fl.twin.weights if fl.twin and fl.twin.weights is not None and b.weights is not None and \
        weight_distance(fl.twin.weights, b.weights, adaptive) < weight_distance(a.weights, b.weights, adaptive) \
        else None
    weights(c, (nearer or a.weights, b.weights), optimizers[0] or optimizers[1],
            Judgement(weight_rtol, assumed=assumed and weight_rtol is None, tolerances=fl.overall,
                      judge=weight_rtol is not None or not c.eight_bit),
            against=" (from the twin, the nearer reference)" if nearer else "")
    return c


def per_step_losses(c: Comparison, runs: tuple, fl: floors.Floor, steps: list, loss_rtol) -> float:
    """The loss curve (and its one-sided shift) of two runs at the floor ``fl``; the grad norm's tolerance that
    follows from it."""
    a, b = runs
    n = len(steps)
    # a loss that sums to about 0 (the task says so) is judged against an absolute floor, and has no one-sided shift
    near_zero = [hints(r.config).loss_atol for r in (a, b)]
    near_zero = near_zero[0] if near_zero[0] == near_zero[1] else None
    loss_tol = loss_rtol if loss_rtol is not None else EIGHT_BIT_LOSS_RTOL if c.eight_bit else fl.overall["loss"]
    losses_a, losses_b = [h["loss"] for h in a.history[:n]], [h["loss"] for h in b.history[:n]]
    th = fl.twin.history[:n] if fl.twin else None
    assumed = fl.assumed and loss_rtol is None and not c.eight_bit
    per_step(c, "loss curve", (steps, losses_a, losses_b),
             Judgement(loss_tol, atol=near_zero or 1e-12, twin=[h["loss"] for h in th] if th else None,
                       assumed=assumed, steps=fl.steps.get("loss") if loss_rtol is None and not c.eight_bit else None))
    shift = floors.one_sided(losses_a, losses_b, fl) if near_zero is None else None
    if shift:
        c.add("loss shift", False, shift, step=steps[0], assumed=assumed)
    trained(c, a.history[:n], b.history[:n], loss_tol, assumed=assumed)
    # an 8-bit optimizer's state moves the weights, hence the later gradients, as far as the loss's band
    return max(fl.overall["grad norm"], loss_tol) if c.eight_bit else fl.overall["grad norm"]


def skipped_steps(c: Comparison, ha: list, hb: list) -> None:
    """The same steps skipped (fp16's overflow, or ``on_nonfinite: skip``) at the same loss scale: a step taken on
    one side only is another update, whatever its loss. Said only where a run skipped a step or scaled its loss."""
    if not any(h.get("skipped") or "loss_scale" in h for h in (*ha, *hb)):
        return
    only = [(x["step"], "RUN_A" if x.get("skipped") else "RUN_B") for x, y in zip(ha, hb)
            if bool(x.get("skipped")) != bool(y.get("skipped"))]
    scale = next(((x, y) for x, y in zip(ha, hb) if x.get("loss_scale") != y.get("loss_scale")), None)
    skipped = [x["step"] for x in ha if x.get("skipped")]
    if scale is not None and not only:
        detail = f"step {scale[0]['step']}: loss scale {scale[0].get('loss_scale')} vs {scale[1].get('loss_scale')}"
    else:
        detail = skipped_detail(only, skipped) + \
            (" at the same loss scales" if not only and any("loss_scale" in h for h in ha) else "")
    c.add("skipped steps", not only and scale is None, detail,
          step=only[0][0] if only else scale[0]["step"] if scale else None, basis="the same skipped steps")


def trained(c: Comparison, ha: list, hb: list, tolerance: float, assumed: bool = False) -> None:
    """Whether the runs trained: a loss that moved on one side only differs; one that moved on neither is said
    (then any two such runs would agree)."""
    moved = floors.moved(ha, tolerance), floors.moved(hb, tolerance)
    if all(moved):
        return
    if any(moved):
        c.add("trained", False, f"the loss moved beyond {tolerance:.0e} in {'RUN_A' if moved[0] else 'RUN_B'} only",
              step=ha[-1]["step"] if ha else None, assumed=assumed)
        return
    c.add("trained", None, f"neither run's loss moved beyond the tolerance ({tolerance:.0e}) from its first step to "
                           "its last: equivalent steps, but no sign that either trained")
