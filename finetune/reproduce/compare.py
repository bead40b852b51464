"""``finetune compare RUN_A RUN_B``: did two runs take the same optimizer steps?

"The same step to fp32 rounding" (docs/exact-steps.md#the-certificate) is judged where rounding cannot be amplified:
at every optimizer step, what the optimizer consumed — the window's samples (an order-free hash of their ids) and
their content (an order-free hash of their tokens, ``finetune.content``), its learning rate, its loss, its gradient
norm before clipping and the clipping applied — must agree to fp32 rounding, and the settings that shape the update
(optimizer, betas, weight decay, precision, adapters) must be equal. Each per-step layer names the first step that
differs; the verdict names the earliest. The trained weights are judged last: with a stateless optimizer (SGD)
rounding stays rounding and the largest element may differ by ``FP32_WEIGHT_RTOL``; an adaptive optimizer (AdamW,
Lion) divides each element's update by its own history, so an element whose gradient is rounding noise takes a full-
size step of either sign, and the weights are then held, as a whole (relative L2), to ``ADAPTIVE_WEIGHT_RTOL``, set
from the measured rounding floor. Exit code 0 when equivalent, 1 when a difference is known (settings, windows,
content, a layer outside a measured floor or fp32's), 3 "not certified" when the only differences lie outside an
assumed floor (``Comparison.verdict``).

Runs with an 8-bit optimizer (``adamw8bit``, ``paged_adamw8bit``) are never called equivalent: their optimizer state
is quantized block-wise, so gradients equal to fp32 rounding (``(b, N)`` against ``(b·N, 1)``) can round to
neighbouring 8-bit codes, and the weights drift apart by far more than fp32 rounding (SmolLM2 QLoRA: 1.6e-3 after 6
steps; docs/low-precision.md). The report says so, checks the windows, the schedule and the loss curve (at
``EIGHT_BIT_LOSS_RTOL``), and prints how far the weights ended apart without judging them (unless ``weight_rtol`` is
given). Exit code 0 then means: the same windows and schedule, loss curves close.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from finetune.config import flatten, result_changes
from finetune.errors import ConfigError
from finetune.optimizers import ADAPTIVE, EIGHT_BIT
from finetune.outputs import read_config, read_history, read_metrics
from finetune.reproduce import floor as floors
from finetune.reproduce.floor import FP32
from finetune.reproduce.update_settings import hints, run_settings, setting, settings_of
from finetune.reproduce.weight_diff import FLIP_SHARE, saved_weights, weight_differences, weight_distance

# The certificate's tolerances, each far above the rounding floor measured between layouts of the same run and far
# below the smallest real difference its tests must catch (docs/exact-steps.md#the-certificate).
# (finetune.reproduce.floor.FP32 holds them; a bf16 run's, or a measured floor's, are wider)
FP32_LOSS_RTOL = FP32["loss"]                 # a step's window loss (floor: 7e-7 over 128 steps of the sft recipe)

# a step's gradient norm before clipping, and the clipping factor applied: its floor reaches 1.2e-4 at one step of
# 128, where AdamW's amplified rounding had moved a few weights (a changed word in one answer: 1.8e-2)
GRAD_NORM_RTOL = FP32["grad norm"]

FP32_WEIGHT_RTOL = FP32["weights largest"]    # the largest element's difference, stateless optimizers

ADAPTIVE_WEIGHT_RTOL = FP32["weights L2"]     # ‖a − b‖₂ / ‖b‖₂ over every weight, adaptive optimizers

# The loss curves of two runs of the same steps with an 8-bit optimizer (their weights drift apart, see above).
EIGHT_BIT_LOSS_RTOL = 1e-2


@dataclass
class Comparison:
    checks: list = field(default_factory=list)   # (name, ok, detail, step); ok None: reported, not judged
    bases: list = field(default_factory=list)    # what each passed judgement rests on, for the verdict line
    measured: dict = field(default_factory=dict)  # each layer's largest difference, as a number (benchmarks read it)
    eight_bit: str | None = None                 # the 8-bit optimizer a run used: no fp32 equivalence to claim
    qualifier: str | None = None                 # what an "equivalent" verdict rests on (a band, unchecked items)
    # the failed layers that were judged against an assumed floor, not a measured one: outside it is not known to
    # differ (an assumed floor errs both ways), so alone they make the verdict "not certified"
    uncertain: set = field(default_factory=set)
    # why the uncertain layers are not known to differ, when it is not an assumed floor (settings a source left unread)
    unread: str | None = None

    def add(self, name: str, ok, detail: str, step: int | None = None, basis: str | None = None,
            assumed: bool = False) -> None:
        """One layer's result; ``step``: the first optimizer step at which a per-step layer differs; ``basis``: what
        the layer rests on when it passes (its tolerance and floor), said in the verdict; ``assumed``: its tolerance
        comes from an assumed floor."""
        self.checks.append((name, ok, detail, step))
        if ok and basis:
            self.bases.append(basis)
        if ok is False and assumed:
            self.uncertain.add(len(self.checks) - 1)

    @property
    def first_difference(self) -> str | None:
        """The first failing check that is known to differ (an assumed floor's only when there is no other), the
        ones that are not per step first, else the per-step layer that differs at the earliest step."""
        failed = [(i, name, detail, step) for i, (name, ok, detail, step) in enumerate(self.checks) if ok is False]
        failed = [f for f in failed if f[0] not in self.uncertain] or failed
        if not failed:
            return None
        whole = [f for f in failed if f[3] is None]
        _, name, detail, _ = whole[0] if whole else min(failed, key=lambda f: f[3])
        return f"{name}: {detail}"

    @property
    def verdict(self) -> str:
        """"equivalent"; "differs" where a difference is known (settings, windows, their content, a layer outside a
        measured floor or fp32's); "not certified" where the only differences lie outside an assumed floor."""
        failed = [i for i, (_, ok, _, _) in enumerate(self.checks) if ok is False]
        if not failed:
            return "equivalent"
        return "not certified" if all(i in self.uncertain for i in failed) else "differs"

    @property
    def equivalent(self) -> bool:
        return self.verdict == "equivalent"

    @property
    def exit_code(self) -> int:
        """``finetune compare``'s exit code: 0 equivalent, 1 differs, 3 not certified (2 is bad input)."""
        return {"equivalent": 0, "differs": 1, "not certified": 3}[self.verdict]

    def report(self) -> str:
        width = max(len(c[0]) for c in self.checks) if self.checks else 10
        mark = {True: "ok", False: "DIFF", None: "info"}
        lines = [f"{'OUT' if i in self.uncertain else mark[ok]:<4}  {name:<{width}}  {detail}"
                 for i, (name, ok, detail, _) in enumerate(self.checks)]
        if self.verdict == "not certified" and self.unread:
            lines.append(f"verdict: not certified — {self.first_difference}; {self.unread}")
        elif self.verdict == "not certified":
            lines.append(f"verdict: not certified — {self.first_difference}; outside an assumed floor, which errs "
                         "both ways: measure the floor on this hardware with --floor TWIN (RUN_A's recipe at "
                         "another --batch-size)" + (f"; {self.qualifier}" if self.qualifier else ""))
        elif not self.equivalent:
            lines.append(f"verdict: differs — {self.first_difference}" + (f"; {self.qualifier}" if self.qualifier
                                                                         else ""))
        elif self.eight_bit:
            lines.append(f"verdict: the same windows and schedule, loss curves close; no fp32 equivalence "
                         f"claimed — {self.eight_bit}: 8-bit optimizer: not the fp32 step")
        else:
            lines.append("verdict: equivalent — rests on " + self.basis() + (f"; {self.qualifier}" if self.qualifier
                                                                           else ""))
        return "\n".join(lines)

    def basis(self) -> str:
        """What an equivalent verdict rests on: the layers judged, with their tolerances and floors."""
        return "; ".join(self.bases) if self.bases else "nothing could be judged"


def read_run(run: Path) -> dict:
    return {"history": read_history(run, "compare"), "metrics": read_metrics(run), "weights": saved_weights(run),
            "config": read_config(run), "rollouts": _rollouts(run)}


def _rollouts(run: Path) -> list | None:
    """A GRPO run's rollouts.jsonl (one record per generation batch); None without one."""
    path = run / "rollouts.jsonl"
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def _rel(a: float, b: float, atol: float = 1e-12) -> float:
    return abs(a - b) / max(abs(a), abs(b), atol)


@dataclass(frozen=True)
class Judgement:
    """How a layer is judged: its relative tolerance (``rtol``; None: the floor's own for the weights), the absolute
    value a relative difference is taken against at least (``atol``: a loss that sums to about 0), a second
    reference (``twin``: the twin run a floor was measured on, as the layer's values), whether the tolerance comes
    from an assumed floor (``assumed``: outside it is "not certified"), why the band is wider than fp32's (``why``),
    the floor's tolerances (``tolerances``) and whether to judge at all (``judge``: an 8-bit optimizer's weights are
    reported, not judged)."""

    rtol: Optional[float] = None
    atol: float = 1e-12
    twin: Optional[list] = None
    assumed: bool = False
    why: Optional[str] = None
    tolerances: dict = field(default_factory=lambda: dict(FP32))
    judge: bool = True


def compare_runs(run_a, run_b, weight_rtol: float | None = None, loss_rtol: float | None = None,
                 twin=None) -> Comparison:
    """Compare two run directories as the module's docstring says: the settings, the windows, then every step's lr,
    loss, grad norm and clipping, then the weights — at the tolerances of the floor (``twin``: a twin run of
    ``run_a``, the same computation in another layout, whose distance from it is measured; else the floor assumed for
    the runs' precision, finetune.reproduce.floor) unless given. Raises ConfigError when the twin is not the same
    computation as ``run_a``."""
    a, b = read_run(Path(run_a)), read_run(Path(run_b))
    ha, hb = a["history"], b["history"]
    c = Comparison()
    optimizers = [setting(r["config"], "training.optimizer") for r in (a, b)]
    c.eight_bit = next((o for o in optimizers if o in EIGHT_BIT), None)
    fl = twin_floor(a, Path(twin), optimizers[0]) if twin is not None else \
        floors.assumed(setting(a["config"], "training.mixed_precision") if a["config"] else None,
                       [r["metrics"].get("arithmetic") for r in (a, b)])
    c.qualifier = fl.note
    # the layers held to an assumed floor: outside it, "not certified" (a user's own tolerance is no assumption)
    assumed = fl.source.startswith("assumed")
    names = tuple(dict.fromkeys(settings_of(a["config"]) + settings_of(b["config"])))  # both tasks' settings
    check_settings(c, run_settings(b["config"], names), run_settings(a["config"], names))
    rollouts(c, a["rollouts"], b["rollouts"])

    ea, eb = a["metrics"].get("effective_batch_size"), b["metrics"].get("effective_batch_size")
    split = lambda m: f"{m.get('effective_batch_size')} ({m.get('gradient_accumulation_steps')} micro-batches/step)"
    c.add("effective batch", ea == eb, f"{split(a['metrics'])} vs {split(b['metrics'])}")
    c.add("optimizer steps", len(ha) == len(hb), f"{len(ha)} vs {len(hb)}")
    n = min(len(ha), len(hb))
    same_windows(c, ha, hb, n)
    skipped_steps(c, ha[:n], hb[:n])
    steps = [h["step"] for h in ha[:n]]
    grad_tol = per_step_losses(c, (a, b), fl, steps, loss_rtol)
    th = fl.twin["history"][:n] if fl.twin else None  # the second reference of a measured floor
    norms_a, norms_b = [h["grad_norm"] for h in ha[:n]], [h["grad_norm"] for h in hb[:n]]
    judged = Judgement(grad_tol, twin=[h["grad_norm"] for h in th] if th else None, assumed=assumed)
    per_step(c, "grad norm", (steps, norms_a, norms_b), judged, what="before clipping")
    limits = tuple(setting(r["config"], "training.max_grad_norm") if r["config"] else UNKNOWN for r in (a, b))
    clipping(c, (steps, norms_a, norms_b), limits, judged)
    adaptive = optimizers[0] in ADAPTIVE or optimizers[0] is None
    nearer = fl.twin["weights"] if fl.twin and fl.twin["weights"] is not None and b["weights"] is not None and \
        weight_distance(fl.twin["weights"], b["weights"], adaptive) < weight_distance(a["weights"], b["weights"],
                                                                                       adaptive) else None
    weights(c, (nearer or a["weights"], b["weights"]), optimizers[0] or optimizers[1],
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
    near_zero = [hints(r["config"]).loss_atol for r in (a, b)]
    near_zero = near_zero[0] if near_zero[0] == near_zero[1] else None
    loss_tol = loss_rtol if loss_rtol is not None else EIGHT_BIT_LOSS_RTOL if c.eight_bit else fl.overall["loss"]
    losses_a, losses_b = [h["loss"] for h in a["history"][:n]], [h["loss"] for h in b["history"][:n]]
    th = fl.twin["history"][:n] if fl.twin else None
    assumed = fl.source.startswith("assumed") and loss_rtol is None and not c.eight_bit
    per_step(c, "loss curve", (steps, losses_a, losses_b),
             Judgement(loss_tol, atol=near_zero or 1e-12, twin=[h["loss"] for h in th] if th else None,
                       assumed=assumed))
    shift = floors.one_sided(losses_a, losses_b, fl) if near_zero is None else None
    if shift:
        c.add("loss shift", False, shift, step=steps[0], assumed=assumed)
    trained(c, a["history"][:n], b["history"][:n], loss_tol, assumed=assumed)
    # an 8-bit optimizer's state moves the weights, hence the later gradients, as far as the loss's band
    return max(fl.overall["grad norm"], loss_tol) if c.eight_bit else fl.overall["grad norm"]


def same_windows(c: Comparison, ha: list, hb: list, n: int) -> None:
    """Every step's window held the same samples, with the same content, and used the same lr."""
    bad = next((i for i in range(n) if ha[i].get("window_hash") != hb[i].get("window_hash")), None)
    c.add("window samples", bad is None, f"all {n} windows held the same samples" if bad is None else
          f"step {ha[bad]['step']} (epoch {ha[bad]['epoch']}, window {ha[bad]['window']}) held different samples",
          step=None if bad is None else ha[bad]["step"], basis=f"samples and lr at all {n} steps")
    same_content(c, ha, hb, n)
    bad = next((i for i in range(n) if _rel(ha[i]["lr"], hb[i]["lr"]) > 1e-9), None)
    c.add("lr schedule", bad is None, "identical" if bad is None else
          f"step {ha[bad]['step']}: {ha[bad]['lr']:.6g} vs {hb[bad]['lr']:.6g}",
          step=None if bad is None else ha[bad]["step"])


def same_content(c: Comparison, ha: list, hb: list, n: int) -> None:
    """Every step's window held the same content (its samples' token ids and labels, or their bytes: history's
    ``content_hash``): exact in any precision, so a changed word of the data differs at the step it entered. Runs
    recorded before content hashes were kept show which samples only; that is said."""
    older = [name for name, h in (("RUN_A", ha), ("RUN_B", hb)) if any("content_hash" not in x for x in h[:n])]
    if older:
        c.add("window content", None, f"not checkable: {' and '.join(older)} recorded no content hashes (a run "
                                      "before they were kept): only which samples each window held is checked")
        return
    bad = next((i for i in range(n) if ha[i]["content_hash"] != hb[i]["content_hash"]), None)
    c.add("window content", bad is None, f"all {n} windows held the same tokens" if bad is None else
          f"step {ha[bad]['step']} (epoch {ha[bad]['epoch']}, window {ha[bad]['window']}): the window held other "
          "tokens (another sample's content: the data, its tokenization or truncation differ)",
          step=None if bad is None else ha[bad]["step"], basis=f"the content of all {n} windows")


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


def skipped_detail(only: list, skipped: list) -> str:
    """The skipped-steps layer's words (run against run, and against a baseline): the steps skipped on one side
    only (``only``: (step, whose)), else the steps both skipped."""
    if only:
        return "; ".join(f"step {s} skipped in {who} only" for s, who in only[:3])
    return f"the same {len(skipped)} skipped (step{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))})" \
        if skipped else "none skipped"


def twin_floor(a: dict, twin: Path, optimizer: str | None) -> floors.Floor:
    """The floor measured on ``twin``, which must be ``a``'s computation in another layout (one line otherwise)."""
    t = read_run(twin)
    probe = Comparison()
    if a["config"] and t["config"]:  # every setting that changes the steps, as a resumed run is checked
        mine, theirs = flatten(a["config"]), flatten(t["config"])
        # how the twin rounds is the point of it: fp32 sums off round as autocast does (as the peers do)
        changed = [f"{k} {mine.get(k)!r} vs {theirs.get(k)!r}" for k in result_changes(
            mine, theirs, ("training.fp32_grad_sums", "training.pad_to_window")) if not k.startswith("output.")]
        probe.add("settings", not changed, "; ".join(changed[:3]))
    else:
        probe.add("settings", False, "a run has no config.yaml")
    same_windows(probe, a["history"], t["history"], min(len(a["history"]), len(t["history"])))
    if len(t["history"]) != len(a["history"]):
        probe.add("optimizer steps", False, f"{len(a['history'])} vs {len(t['history'])}")
    if not probe.equivalent:
        raise ConfigError(f"compare: --floor {twin} is not the same run as RUN_A in another layout "
                          f"({probe.first_difference}); make it with RUN_A's recipe and another --batch-size")
    weights(probe, (a["weights"], t["weights"]), optimizer, Judgement())
    fl = floors.measured(a["history"], t["history"], probe.measured, f"{twin.name} at {layout_of(t)}")
    fl.twin = t
    return fl


def layout_of(run: dict) -> str:
    """How a run (``read_run``'s) cut and padded its windows, for the floor's note: its micro-batch, and the
    padding its samples ran at (``training.replay_padding``: the baseline's; else the window's longest under
    ``training.pad_to_window`` in mixed precision, else each micro-batch's own longest)."""
    m, config = run["metrics"] or {}, run["config"] or {}
    total, n = m.get("effective_batch_size"), m.get("gradient_accumulation_steps")
    micro = f"micro-batch {total // n}" if total and n else "micro-batch unknown"
    replay = setting(config, "training.replay_padding")
    mixed = setting(config, "training.mixed_precision") not in (None, "no")
    sums = ", weight-gradient sums rounded per micro-batch" if mixed and setting(
        config, "training.fp32_grad_sums") is False else ""
    if replay:
        per_device, multiple = replay
        return f"{micro}, padded as the baseline's micro-batches of {per_device}" + (
            f", to a multiple of {multiple}" if multiple > 1 else "") + sums
    return f"{micro}, padded to " + ("the window's longest" if mixed and setting(config, "training.pad_to_window")
                                     is not False else "each micro-batch's longest") + sums


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


def check_settings(c: Comparison, ours: dict | None, theirs: dict | None, whose: str = "") -> None:
    """The update's settings beyond what the per-step layers see: each one ``theirs`` holds against ``ours``
    (``whose``: the other side's name in the report, when it is a baseline)."""
    if ours is None or theirs is None:
        c.add("settings", None, "not checkable: a run has no config.yaml")
        return
    if not theirs:
        c.add("settings", None, f"not checkable: {whose} says none of the update's settings")
        return
    differ = [f"{k} {theirs[k]}{' in ' + whose if whose else ''} vs {ours.get(k)}" for k in theirs
              if ours.get(k) != theirs[k]]
    same = f"{whose}'s {len(theirs)} update settings" if whose else (
        f"the same update: {theirs.get('training.optimizer')}" + (" (8-bit optimizer: not the fp32 step)"
                                                                  if c.eight_bit else "") +
        f", {len(theirs) - 1} other settings equal")
    c.add("settings", not differ, "; ".join(differ) if differ else same, basis="settings")


UNKNOWN = object()  # a side whose clipping setting is not known


def per_step(c: Comparison, name: str, series: tuple, judged: Judgement, what: str = "") -> None:
    """One per-step layer: ``series`` = (optimizer steps, xs, ys); ``xs[i]`` against ``ys[i]`` (pairs with a
    non-finite or missing value are skipped: DeepSpeed reports no norm when it does not clip), relative to the larger
    magnitude or ``judged.atol``, within ``judged.rtol``. ``judged.twin``: a second reference (the twin a floor was
    measured on, ``xs``'s run in another layout); a step passes when ``ys`` is within ``rtol`` of either."""
    steps, xs, ys = series
    rtol, atol, why = judged.rtol, judged.atol, judged.why
    others = judged.twin if judged.twin is not None else [None] * len(steps)
    pairs = [(s, x, y, z) for s, x, y, z in zip(steps, xs, ys, others) if _finite(x) and _finite(y)]
    if not pairs:
        c.add(name, None, "not checkable: not logged on both sides")
        return
    worst = c.measured[name] = max(_rel(x, y, atol) for _, x, y, _ in pairs)
    nearer = lambda x, y, z: min(_rel(x, y, atol), _rel(z, y, atol) if _finite(z) else math.inf)  # noqa: E731
    bad = next(((s, x, y) for s, x, y, z in pairs if nearer(x, y, z) > rtol), None)
    band = f" (band: {why})" if why else f" (relative to at least {atol:g})" if atol > 1e-12 else ""
    band += "; the nearer of the run and its twin" if judged.twin is not None else ""
    c.add(name, bad is None, f"max relative difference {worst:.2e} at {len(pairs)} steps{' ' + what if what else ''}"
          f", tolerance {rtol:g}{band}" + ("" if bad is None else
                                           f"; first above at step {bad[0]}: {bad[1]:.7g} vs {bad[2]:.7g} (tolerance "
                                           f"{rtol:.1e})"),
          step=None if bad is None else bad[0], basis=f"{name.removesuffix(' curve')} ≤ {rtol:.0e}",
          assumed=judged.assumed)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def clip_factor(norm: float, max_norm) -> float:
    """The factor clipping multiplied a step's gradient by: 1 without clipping or under the limit."""
    return 1.0 if max_norm is None or max_norm <= 0 or norm <= max_norm else max_norm / norm


def clipping(c: Comparison, series: tuple, limits: tuple, judged: Judgement) -> None:
    """The clipping factor each step applied, from its grad norm and each side's max_grad_norm (``limits``; UNKNOWN:
    not said): a step clipped on one side only (or to another limit) took another update though its gradient was the
    same. ``series``: (steps, norms_a, norms_b); ``judged.rtol``: the grad norm's tolerance."""
    steps, norms_a, norms_b = series
    max_a, max_b = limits
    if max_a is UNKNOWN or max_b is UNKNOWN:
        c.add("clipping", None, "not checkable: a run does not say its max_grad_norm")
        return
    rows = [(s, clip_factor(x, max_a), clip_factor(y, max_b)) for s, x, y in zip(steps, norms_a, norms_b)
            if _finite(x) and _finite(y)]
    bad = next(((s, x, y) for s, x, y in rows if _rel(x, y) > judged.rtol), None)
    clipped = sum(x < 1 for _, x, _ in rows)
    show = lambda f: "not clipped" if f == 1 else f"scaled by {f:.4g}"  # noqa: E731
    c.add("clipping", bad is None, (f"the same at {len(rows)} steps ({clipped} clipped; max_grad_norm {max_a} vs "
                                    f"{max_b})") if bad is None else
          f"step {bad[0]}: {show(bad[1])} vs {show(bad[2])} (max_grad_norm {max_a} vs {max_b})",
          step=None if bad is None else bad[0], basis="clipping", assumed=judged.assumed)


def weights(c: Comparison, pair: tuple, optimizer: str | None, judged: Judgement, against: str = "") -> None:
    """The trained weights ``pair`` (theirs, ours; dicts of tensors): the largest element's difference for a
    stateless optimizer; for an adaptive one, whose rounding-level gradients become full-size steps of either sign,
    the relative L2 difference of all weights. ``judged.rtol`` None: the floor's tolerance (``judged.tolerances``)."""
    wa, wb = pair
    if wa is None or wb is None:
        c.add("weights", False, "a run has no saved model to compare", step=math.inf)
        return
    if wa.keys() != wb.keys():
        c.add("weights", False, f"different parameter names ({len(wa)} vs {len(wb)} tensors)", step=math.inf)
        return
    shape = next((k for k in wa if wa[k].shape != wb[k].shape), None)
    if shape:
        c.add("weights", False, f"{shape}: shape {tuple(wa[shape].shape)} vs {tuple(wb[shape].shape)}",
              step=math.inf)
        return
    biggest, l2, kept, flips = weight_differences(wa, wb)
    c.measured.update({"weights L2": kept, "weights largest": biggest})
    adaptive = optimizer in ADAPTIVE or optimizer is None
    measure, value = ("relative L2", kept) if adaptive else ("largest element", biggest)
    rtol = judged.rtol if judged.rtol is not None else judged.tolerances["weights L2" if adaptive else
                                                                         "weights largest"]
    why = (f"{optimizer or 'an unknown optimizer'} amplifies rounding: largest element {biggest:.2e}, not judged"
           if adaptive else f"relative L2 {l2:.2e}")
    if adaptive and flips:  # the few elements a near-zero gradient's rounding sends either way
        why += f"; its {flips} largest element differences ({FLIP_SHARE:.0e} of the elements) left out: {l2:.2e} " \
               "with them"
    if not judged.judge:
        c.add("weights", None, f"relative L2 {l2:.2e}, largest element {biggest:.2e}{against} (not judged: 8-bit "
                               f"optimizer: not the fp32 step, no fp32 tolerance applies)")
        return
    # the weights are where every step ends: a per-step layer that differs names the cause first
    c.add("weights", value <= rtol, f"{measure} {value:.2e}{against} (tolerance {rtol:g}; {why})", step=math.inf,
          basis=f"weights {'L2' if adaptive else 'max'} {value:.1e} ≤ {rtol:.0e}", assumed=judged.assumed)
