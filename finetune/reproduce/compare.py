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

import torch
from safetensors.torch import load_file

from finetune.config import flatten, result_changes
from finetune.errors import ConfigError
from finetune.job import CompareHints
from finetune.optimizers import ADAPTIVE, EIGHT_BIT
from finetune.outputs import pyplot, read_config, read_history, read_metrics
from finetune.registry import task_hints
from finetune.reproduce import floor as floors
from finetune.reproduce.floor import FP32
from finetune.reproduce.record import Baseline
from finetune.reproduce.settings import carry, model_difference
from finetune.reproduce.sources import read_baseline
from finetune.reproduce.sources.hub import no_step_log
from finetune.windows import WindowSpec, membership_hash

# The certificate's tolerances, each far above the rounding floor measured between layouts of the same run and far
# below the smallest real difference its tests must catch (docs/exact-steps.md#the-certificate).
# (finetune.reproduce.floor.FP32 holds them; a bf16 run's, or a measured floor's, are wider)
FP32_LOSS_RTOL = FP32["loss"]                 # a step's window loss (floor: 7e-7 over 128 steps of the sft recipe)
# a step's gradient norm before clipping, and the clipping factor applied: its floor reaches 1.2e-4 at one step of
# 128, where AdamW's amplified rounding had moved a few weights (a changed word in one answer: 1.8e-2)
GRAD_NORM_RTOL = FP32["grad norm"]
FP32_WEIGHT_RTOL = FP32["weights largest"]    # the largest element's difference, stateless optimizers
ADAPTIVE_WEIGHT_RTOL = FP32["weights L2"]     # ‖a − b‖₂ / ‖b‖₂ over every weight, adaptive optimizers
# For the adaptive optimizers (ADAPTIVE: their per-element normalisation turns rounding-level gradients into
# full-size steps) the relative L2 leaves out this share of the elements, the largest differences: an element whose
# gradient is near zero takes a full step of either sign on rounding. A TRL DPOTrainer baseline on SmolLM2 (LoRA,
# AdamW at 5e-4, fp32, 10 steps) ended with 10 of 460,800 adapter elements about one step (5e-4) apart, 1.25e-4 of
# the L2 with them and 4.8e-5 without, every step's loss and grad norm within the fp32 tolerances
# (benchmarks/README.md).
FLIP_SHARE = 1e-4
# the settings of every task that shape each update beyond what the per-step layers see; the rest either does not
# change the steps or shows in them (lr, clipping, batch). A task adds its own (CompareHints.step_settings).
STEP_SETTINGS = ("training.optimizer", "training.weight_decay", "training.momentum", "training.betas",
                 "training.mixed_precision", "model.dtype", "model.quantization", "model.dropout", "peft.enabled",
                 "peft.r", "peft.alpha", "peft.dropout", "peft.target_modules", "peft.modules_to_save",
                 "training.drop_last", "training.loss_divisor", "model.master_weights")
# settings added after runs were written with their step: a run's config.yaml without one had its default then
ADDED_LATER = {"training.loss_divisor": "items", "model.master_weights": True}
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
        if self.verdict == "not certified":
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
    return {"history": read_history(run, "compare"), "metrics": read_metrics(run), "weights": _weights(run),
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


def setting(config: dict | None, dotted: str):
    """``training.optimizer`` of a resolved config (None when absent)."""
    section, key = dotted.split(".")
    part = (config or {}).get(section)
    return part.get(key) if isinstance(part, dict) else None


def _weights(run: Path) -> dict | None:
    for name in ("model/model.safetensors", "model/adapter_model.safetensors", "model-merged/model.safetensors"):
        if (run / name).is_file():
            return load_file(str(run / name))
    shards = sorted((run / "model").glob("model-*.safetensors")) if (run / "model").is_dir() else []
    if shards:
        out = {}
        for s in shards:
            out.update(load_file(str(s)))
        return out
    return None


def flat(model, trainable_only: bool = False) -> torch.Tensor:
    """The parameters of ``model`` flattened into one fp64 tensor on the CPU; ``trainable_only``: those that train
    (a LoRA model's adapters), as a benchmark of what trains compares them."""
    return torch.cat([p.detach().flatten().double().cpu() for p in model.parameters()
                      if p.requires_grad or not trainable_only])


def rel_diff(a, b, trainable_only: bool = False) -> float:
    """max |a − b| / max |b|: how far weights ``a`` are from ``b``, relative to the largest of ``b``. ``a``, ``b``:
    models (their parameters, see :func:`flat`) or flat tensors.

        >>> rel_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        0.5
    """
    a = a if isinstance(a, torch.Tensor) else flat(a, trainable_only)
    b = b if isinstance(b, torch.Tensor) else flat(b, trainable_only)
    return float((a - b).abs().max() / b.abs().max())


def _rel(a: float, b: float, floor: float = 1e-12) -> float:
    return abs(a - b) / max(abs(a), abs(b), floor)


def compare_runs(run_a, run_b, weight_rtol: float | None = None, loss_rtol: float | None = None,
                 floor=None) -> Comparison:
    """Compare two run directories as the module's docstring says: the settings, the windows, then every step's lr,
    loss, grad norm and clipping, then the weights — at the tolerances of the floor (``floor``: a twin run of
    ``run_a``, the same computation in another layout, whose distance from it is measured; else the floor assumed for
    the runs' precision, finetune.reproduce.floor) unless given. Raises ConfigError when the twin is not the same
    computation as ``run_a``."""
    a, b = read_run(Path(run_a)), read_run(Path(run_b))
    ha, hb = a["history"], b["history"]
    c = Comparison()
    optimizers = [setting(r["config"], "training.optimizer") for r in (a, b)]
    c.eight_bit = next((o for o in optimizers if o in EIGHT_BIT), None)
    fl = twin_floor(a, Path(floor), optimizers[0]) if floor is not None else \
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

    steps = [h["step"] for h in ha[:n]]
    # a loss that sums to about 0 (the task says so) is judged against an absolute floor, and has no one-sided shift
    near_zero = [hints(r["config"]).loss_floor for r in (a, b)]
    near_zero = near_zero[0] if near_zero[0] == near_zero[1] else None
    loss_tol = loss_rtol if loss_rtol is not None else EIGHT_BIT_LOSS_RTOL if c.eight_bit else fl.overall["loss"]
    losses_a, losses_b = [h["loss"] for h in ha[:n]], [h["loss"] for h in hb[:n]]
    th = fl.twin["history"][:n] if fl.twin else None  # the second reference of a measured floor
    loss_assumed = assumed and loss_rtol is None and not c.eight_bit
    per_step(c, "loss curve", steps, losses_a, losses_b, loss_tol, floor=near_zero or 1e-12,
             twin=[h["loss"] for h in th] if th else None, assumed=loss_assumed)
    shift = floors.one_sided(losses_a, losses_b, fl) if near_zero is None else None
    if shift:
        c.add("loss shift", False, shift, step=steps[0], assumed=loss_assumed)
    trained(c, ha[:n], hb[:n], loss_tol, assumed=loss_assumed)
    norms_a, norms_b = [h["grad_norm"] for h in ha[:n]], [h["grad_norm"] for h in hb[:n]]
    # an 8-bit optimizer's state moves the weights, hence the later gradients, as far as the loss's band
    grad_tol = max(fl.overall["grad norm"], loss_tol) if c.eight_bit else fl.overall["grad norm"]
    per_step(c, "grad norm", steps, norms_a, norms_b, grad_tol, what="before clipping",
             twin=[h["grad_norm"] for h in th] if th else None, assumed=assumed)
    clipping(c, steps, norms_a, norms_b, *(setting(r["config"], "training.max_grad_norm") if r["config"] else
                                           UNKNOWN for r in (a, b)), rtol=grad_tol, assumed=assumed)
    judge = weight_rtol is not None or not c.eight_bit
    nearer = fl.twin["weights"] if fl.twin and fl.twin["weights"] is not None and b["weights"] is not None and \
        _weight_distance(fl.twin["weights"], b["weights"], optimizers[0]) < _weight_distance(a["weights"], b["weights"],
                                                                                             optimizers[0]) else None
    weights(c, nearer or a["weights"], b["weights"], optimizers[0] or optimizers[1], weight_rtol, judge,
            tolerances=fl.overall, against=" (from the twin, the nearer reference)" if nearer else "",
            assumed=assumed and weight_rtol is None)
    return c


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
    weights(probe, a["weights"], t["weights"], optimizer, None)
    fl = floors.measured(a["history"], t["history"], probe.measured, twin.name)
    fl.twin = t
    return fl


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


def hints(config: dict | None) -> CompareHints:
    """What the task of a run's resolved config declares for compare (the defaults without a config)."""
    return task_hints(config["task"]) if config and config.get("task") else CompareHints()


def settings_of(config: dict | None) -> tuple:
    """The dotted settings that shape a run's update: every task's, then its task's own."""
    return STEP_SETTINGS + tuple(hints(config).step_settings)


def step_settings(values: dict, names: tuple) -> dict:
    """The settings ``names`` among dotted ``values`` (a run's, or what a baseline says), comparable: the adapted
    modules are a set, so their list is sorted."""
    return {k: sorted(v) if isinstance(v, list) and k.startswith("peft.") else v
            for k, v in values.items() if k in names}


def run_settings(config: dict | None, names: tuple | None = None) -> dict | None:
    """A run's update settings (``names``, else its own ``settings_of``) from its resolved config (None without
    one)."""
    names = names or settings_of(config)
    present = lambda k: k.split(".")[1] in ((config or {}).get(k.split(".")[0]) or {})  # noqa: E731
    return step_settings({k: setting(config, k) if present(k) or k not in ADDED_LATER else ADDED_LATER[k]
                          for k in names}, names) if config else None


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


def per_step(c: Comparison, name: str, steps: list, xs: list, ys: list, rtol: float, what: str = "",
             why: str | None = None, floor: float = 1e-12, twin: list | None = None, assumed: bool = False) -> None:
    """One per-step layer: ``xs[i]`` against ``ys[i]`` at optimizer step ``steps[i]`` (pairs with a non-finite or
    missing value are skipped: DeepSpeed reports no norm when it does not clip), relative to the larger magnitude or
    ``floor``, within ``rtol``. ``twin``: a second reference (the twin a floor was measured on, ``xs``'s run in
    another layout); a step passes when ``ys`` is within ``rtol`` of either."""
    others = twin if twin is not None else [None] * len(steps)
    pairs = [(s, x, y, z) for s, x, y, z in zip(steps, xs, ys, others) if _finite(x) and _finite(y)]
    if not pairs:
        c.add(name, None, "not checkable: not logged on both sides")
        return
    worst = c.measured[name] = max(_rel(x, y, floor) for _, x, y, _ in pairs)
    nearer = lambda x, y, z: min(_rel(x, y, floor), _rel(z, y, floor) if _finite(z) else math.inf)  # noqa: E731
    bad = next(((s, x, y) for s, x, y, z in pairs if nearer(x, y, z) > rtol), None)
    band = f" (band: {why})" if why else f" (relative to at least {floor:g})" if floor > 1e-12 else ""
    band += "; the nearer of the run and its twin" if twin is not None else ""
    c.add(name, bad is None, f"max relative difference {worst:.2e} at {len(pairs)} steps{' ' + what if what else ''}"
          f", tolerance {rtol:g}{band}" + ("" if bad is None else
                                           f"; first above at step {bad[0]}: {bad[1]:.7g} vs {bad[2]:.7g} (tolerance "
                                           f"{rtol:.1e})"),
          step=None if bad is None else bad[0], basis=f"{name.removesuffix(' curve')} ≤ {rtol:.0e}", assumed=assumed)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def clip_factor(norm: float, max_norm) -> float:
    """The factor clipping multiplied a step's gradient by: 1 without clipping or under the limit."""
    return 1.0 if max_norm is None or max_norm <= 0 or norm <= max_norm else max_norm / norm


def clipping(c: Comparison, steps: list, norms_a: list, norms_b: list, max_a, max_b, rtol=GRAD_NORM_RTOL,
             assumed: bool = False) -> None:
    """The clipping factor each step applied, from its grad norm and each side's max_grad_norm: a step clipped on
    one side only (or to another limit) took another update though its gradient was the same. ``rtol``: the grad
    norm's tolerance."""
    if max_a is UNKNOWN or max_b is UNKNOWN:
        c.add("clipping", None, "not checkable: a run does not say its max_grad_norm")
        return
    rows = [(s, clip_factor(x, max_a), clip_factor(y, max_b)) for s, x, y in zip(steps, norms_a, norms_b)
            if _finite(x) and _finite(y)]
    bad = next(((s, x, y) for s, x, y in rows if _rel(x, y) > rtol), None)
    clipped = sum(x < 1 for _, x, _ in rows)
    show = lambda f: "not clipped" if f == 1 else f"scaled by {f:.4g}"  # noqa: E731
    c.add("clipping", bad is None, (f"the same at {len(rows)} steps ({clipped} clipped; max_grad_norm {max_a} vs "
                                    f"{max_b})") if bad is None else
          f"step {bad[0]}: {show(bad[1])} vs {show(bad[2])} (max_grad_norm {max_a} vs {max_b})",
          step=None if bad is None else bad[0], basis="clipping", assumed=assumed)


def weights(c: Comparison, wa: dict | None, wb: dict | None, optimizer: str | None, rtol: float | None,
            judge: bool = True, against: str = "", tolerances: dict = FP32, assumed: bool = False) -> None:
    """The trained weights: the largest element's difference for a stateless optimizer; for an adaptive one, whose
    rounding-level gradients become full-size steps of either sign, the relative L2 difference of all weights."""
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
    rtol = rtol if rtol is not None else tolerances["weights L2" if adaptive else "weights largest"]
    why = (f"{optimizer or 'an unknown optimizer'} amplifies rounding: largest element {biggest:.2e}, not judged"
           if adaptive else f"relative L2 {l2:.2e}")
    if adaptive and flips:  # the few elements a near-zero gradient's rounding sends either way
        why += f"; its {flips} largest element differences ({FLIP_SHARE:.0e} of the elements) left out: {l2:.2e} " \
               "with them"
    if not judge:
        c.add("weights", None, f"relative L2 {l2:.2e}, largest element {biggest:.2e}{against} (not judged: 8-bit "
                               f"optimizer: not the fp32 step, no fp32 tolerance applies)")
        return
    # the weights are where every step ends: a per-step layer that differs names the cause first
    c.add("weights", value <= rtol, f"{measure} {value:.2e}{against} (tolerance {rtol:g}; {why})", step=math.inf,
          basis=f"weights {'L2' if adaptive else 'max'} {value:.1e} ≤ {rtol:.0e}", assumed=assumed)


def _weight_distance(wa: dict | None, wb: dict, optimizer: str | None) -> float:
    """The distance ``weights`` judges: relative L2 for an adaptive optimizer, else the largest element (inf when
    the two cannot be compared)."""
    if wa is None or wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
        return math.inf
    biggest, _, l2, _ = weight_differences(wa, wb)
    return l2 if optimizer in ADAPTIVE or optimizer is None else biggest


def weight_differences(wa: dict, wb: dict) -> tuple[float, float, float, int]:
    """(max |a − b| / max |b|, ‖a − b‖₂ / ‖b‖₂, the same without the ``k`` largest element differences, ``k``) over
    all tensors, in fp64, one pass over each; ``k`` is ``FLIP_SHARE`` of the elements, rounded down."""
    k = int(FLIP_SHARE * sum(b.numel() for b in wb.values()))
    diff_max = ref_max = diff_sq = ref_sq = 0.0
    largest = torch.zeros(0, dtype=torch.float64)  # the k largest |a − b| so far
    for name, b in wb.items():
        b = b.double()
        d = wa[name].double() - b
        diff_max, ref_max = max(diff_max, float(d.abs().max())), max(ref_max, float(b.abs().max()))
        diff_sq, ref_sq = diff_sq + float(d.square().sum()), ref_sq + float(b.square().sum())
        if k:
            largest = torch.cat([largest, d.abs().flatten().topk(min(k, d.numel())).values]).topk(
                min(k, largest.numel() + d.numel())).values
    kept, ref = max(diff_sq - float(largest.square().sum()), 0.0), max(math.sqrt(ref_sq), 1e-30)
    return diff_max / max(ref_max, 1e-30), math.sqrt(diff_sq) / ref, math.sqrt(kept) / ref, k


def plot_comparison(run_a, run_b, path) -> Path:
    plt = pyplot()
    a, b = read_run(Path(run_a))["history"], read_run(Path(run_b))["history"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.5))
    for hist, name, style in ((a, Path(run_a).name, "-"), (b, Path(run_b).name, "--")):
        for ax, key in zip(axes, ("loss", "lr", "grad_norm")):
            ax.plot([h["step"] for h in hist], [h[key] for h in hist], style, label=name)
    return save_curves(fig, axes, ("window loss", "learning rate", "grad norm (before clipping)"), path)


# ---------------------------------------------------------------------------------------------------------------
# a baseline another tool trained: an HF Trainer / TRL folder or its model card

# Where the baseline's loss cannot be replayed exactly, the band it is held to, and why.
MIXED_PRECISION_BAND = 1e-2   # bf16 / fp16 autocast rounds the two runs' matmuls differently
DROPOUT_BAND = 5e-2           # other dropout masks: only the expectation of the loss matches
CARD_ROUNDING = 5e-5          # a model card prints losses with 4 decimals


def is_finetune_run(path) -> bool:
    return (Path(path) / "history.jsonl").is_file()


def _mine(run: Path) -> dict:
    out = read_run(run)
    out["config"] = out["config"] or {}
    config = run / "model" / "config.json"
    out["model_config"] = json.loads(config.read_text()) if config.is_file() else None
    return out


def loss_band(base, mine: dict) -> tuple[float, str | None]:
    """The relative tolerance of the training loss, and why it is wider than an exact replay's (None: exact)."""
    t = mine["config"].get("training") or {}
    precision = "bf16" if base.get("bf16") else "fp16" if base.get("fp16") else None
    ours = t.get("mixed_precision")
    if (mine["config"].get("model") or {}).get("master_weights") is False:
        return MIXED_PRECISION_BAND, ("the weights train in their own low precision (no fp32 master weights) and "
                                      "each side rounds differently; an assumed band: measure the floor on this "
                                      "hardware with --floor TWIN (this reproduction at another --batch-size)")
    if precision or ours not in (None, "no"):
        return MIXED_PRECISION_BAND, (f"mixed precision ({precision or 'fp32'} baseline, {ours or 'no'} here) "
                                      "rounds each side differently; an assumed band: measure the floor on this "
                                      "hardware with --floor TWIN (this reproduction at another --batch-size)")
    cfg, adapter = base.model_config or {}, base.adapter_config or {}
    drops = {k: v for k, v in cfg.items() if ("dropout" in k or k.endswith("pdrop")) and
             isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    if adapter.get("lora_dropout"):
        drops["lora_dropout"] = adapter["lora_dropout"]
    if drops:
        return DROPOUT_BAND, (f"the baseline trained with dropout ({', '.join(f'{k}={v}' for k, v in drops.items())})"
                              ": other masks, only the expectation of the loss matches")
    return FP32_LOSS_RTOL, None


def compare_with_baseline(baseline, run, weight_rtol: float | None = None,
                          loss_rtol: float | None = None, floor=None) -> Comparison:
    """Check finetune run ``run`` against a baseline another tool trained (read by ``sources.read_baseline``), in order:
    effective batch, optimizer steps, the samples of every window (the Trainer's order recomputed from the
    baseline's seed), the lr and the training loss at every logged step (our mean over the steps each log entry
    covers: ``logging_steps`` > 1 logs a mean), the evaluation loss, the weights. What the baseline does not show
    (a model card has no lr, no weights) is reported as not checkable. Raises ConfigError when the two models differ
    or the baseline is unreadable. ``floor``: a twin of ``run`` (the same reproduction at another --batch-size): the
    bands are then ``floor.TWIN_FACTOR`` × the rounding floor measured between them, not the assumed ones."""
    base, mine = baseline if isinstance(baseline, Baseline) else read_baseline(baseline, "compare"), _mine(Path(run))
    diff = model_difference(base.model_config, mine["model_config"])
    if diff:
        raise ConfigError(f"compare: the baseline's model differs from {run}'s: {diff}")
    history, c, unchecked = mine["history"], Comparison(), []
    card = base.kind == "model card"
    _check_baseline_settings(c, base, mine)

    eb, em = base.effective_batch(), mine["metrics"].get("effective_batch_size")
    c.add("effective batch", eb == em if eb is not None else None,
          f"{eb} ({base.kind}) vs {em} ({mine['metrics'].get('gradient_accumulation_steps')} micro-batches/step)"
          if eb is not None else f"not in the {base.kind}")
    steps = base.max_steps or base.get("schedule_steps")
    c.add("optimizer steps", steps == len(history) if steps else None,
          f"{steps} vs {len(history)}" if steps else f"not in the {base.kind}")
    _check_windows(c, base, history, mine, unchecked)

    by_step = {h["step"]: h for h in history}
    logs = [e for e in base.logs if e["step"] in by_step]
    rates = [e for e in logs if "learning_rate" in e]
    if not base.logs or not any("learning_rate" in e for e in base.logs):
        unchecked.append("lr schedule")
        c.add("lr schedule", None, f"not checkable: the {base.kind} logs no learning rate" + (
            " for the steps it logs (torchtune logs the next step's, read after the scheduler stepped)"
            if base.logs else ""))
    else:
        bad = next((e for e in rates if _rel(e["learning_rate"], by_step[e["step"]]["lr"]) > base.lr_rounding), None)
        c.add("lr schedule", bad is None and len(logs) == len(base.logs),
              f"identical at all {len(rates)} logged steps" if bad is None and len(logs) == len(base.logs) else
              f"step {bad['step']}: {bad.get('learning_rate'):.6g} vs {by_step[bad['step']]['lr']:.6g}" if bad else
              f"{len(base.logs) - len(logs)} logged steps are past this run's last step",
              step=bad["step"] if bad else None)

    band, why = loss_band(base, mine)
    fl = twin_floor(mine, Path(floor), setting(mine["config"], "training.optimizer")) if floor is not None else None
    if fl is not None:  # the floor measured on this hardware replaces the assumed band
        band, why = fl.overall["loss"], fl.note
    # a band assumed for mixed precision or dropout, not measured: outside it the run is "not certified"
    assumed = fl is None and why is not None and loss_rtol is None
    band = loss_rtol if loss_rtol is not None else band
    grad_band = max(band, fl.overall["grad norm"] if fl else GRAD_NORM_RTOL,
                    low_precision_grads(mine["config"]))
    if base.logs:
        _check_logged_loss(c, base.logs, history, band, why, int(base.get("logging_steps") or 1), assumed,
                           base.logged_loss_is_mean)
        _check_logged_norms(c, base, logs, by_step, grad_band, why, mine, unchecked, assumed)
    elif base.card_losses:
        unchecked.append("training loss")
        c.add("loss curve", None, "not checkable: the card's Training Loss is the mean over logging_steps, which "
                                  "the card does not say")
    _check_eval(c, base, mine, band, CARD_ROUNDING if card else 0.0, assumed)

    if base.weights is None:
        unchecked.append("weights")
        c.add("weights", None, f"not checkable: the {base.kind} holds no weights")
    else:
        weights(c, mine["weights"], load_file(str(base.weights)), setting(mine["config"], "training.optimizer"),
                weight_rtol, against=f" against {base.weights.name}", tolerances=fl.overall if fl else FP32,
                assumed=assumed and weight_rtol is None)
    # a differing run's likeliest cause: a setting of the baseline that import could not carry, else the adapters'
    # start (only where no such setting is left to blame)
    cause = [] if c.equivalent else uncarried(base, mine) + short_micro_batch(base, mine)
    notes = [line for line in (no_step_log(base),) if line] + \
        ([f"loss held to {band:g}" + (f", not {FP32_LOSS_RTOL:g}" if band != FP32_LOSS_RTOL else "") + f": {why}"]
         if why else []) + \
        ([f"not checkable from the {base.kind}: {', '.join(unchecked)}"] if unchecked else []) + \
        (cause or start_notes(base, mine, c.equivalent))
    c.qualifier = "; ".join(notes) or None
    return c


def _check_baseline_settings(c: Comparison, base, mine: dict) -> None:
    """The update settings the baseline's arguments and files say (as ``finetune import`` carries them) against this
    run's ``config.yaml``: a run that trained LoRA against a full fine-tuning, or another optimizer, differs."""
    check_settings(c, run_settings(mine["config"]), step_settings(carried(base, mine).values, settings_of(
        mine["config"])), "the baseline")


# the relative spacing of a low-precision number (its machine epsilon): a grad norm computed from such gradients is
# one, and two runs may land one step apart however close their gradients are
SPACING = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}


def low_precision_grads(config: dict | None) -> float:
    """A run whose weights train without fp32 master weights has gradients, and grad norms, in ``model.dtype``: the
    least band its grad norm can be held to is one step of that dtype (a twin that rounds to the same value measures
    a floor of 0). 0 for any other run."""
    if setting(config, "model.master_weights") is not False:
        return 0.0
    return SPACING.get(setting(config, "model.dtype"), 0.0)


def _check_logged_norms(c: Comparison, base, logs: list, by_step: dict, rtol: float, why, mine: dict,
                        unchecked: list, assumed: bool = False) -> None:
    """The grad norm the baseline logged at each logged step (the Trainer logs the norm of the step it logs at,
    before clipping, not a mean) against this run's, and the clipping each side applied."""
    logged = [e for e in logs if _finite(e.get("grad_norm"))]
    if not logged:
        unchecked.append("grad norm")
        c.add("grad norm", None, f"not checkable: the {base.kind} logs no grad_norm (the Trainer computes it only "
                                 "when it clips)")
        return
    steps, theirs = [e["step"] for e in logged], [e["grad_norm"] for e in logged]
    ours = [by_step[s]["grad_norm"] for s in steps]
    per_step(c, "grad norm", steps, ours, theirs, rtol, what="before clipping", why=why, assumed=assumed)
    limit = (base.get("max_grad_norm") or None) if "max_grad_norm" in base.args else UNKNOWN
    clipping(c, steps, ours, theirs, setting(mine["config"], "training.max_grad_norm") if mine["config"] else
             UNKNOWN, limit, rtol=rtol, assumed=assumed)


def carried(base, mine: dict):
    """The baseline's settings as ``finetune import`` carries them onto this run's recipe: its model and data
    fields, so that a task's own settings (DPO's beta, GRPO's loss type, TRL's packing) are the baseline's too, the
    adapters it started from (``peft.init_from``: the baseline's start, given to import as --initial-adapter), and
    its tool's own step where the run took it (import --baseline-step: most of the settings that flag adds are the
    run's, so that a run which then changed one of them is still read against that step)."""
    def imported(own_step: bool):
        return carry(base, {name: None for name in (mine["config"].get("model") or {})},
                     set(mine["config"].get("data") or {}), initial_adapter=setting(mine["config"], "peft.init_from"),
                     own_step=own_step)

    plain, own = imported(False), imported(True)
    added = {k: v for k, v in own.values.items() if k not in plain.values or plain.values[k] != v}
    took = 2 * sum(setting(mine["config"], k) == v for k, v in added.items()) > len(added)
    return own if took else plain


def uncarried(base, mine: dict) -> list:
    """The baseline's settings that ``finetune import`` says it cannot carry (``name=value — why``), as causes."""
    lines = [line.removeprefix("not carried: ") for line in carried(base, mine).not_carried
             if line.startswith("not carried: ") and "=" in line.split(" — ")[0]]
    return [f"the baseline's {line.split(' — ')[0]} is not carried by finetune import ({line.split(' — ', 1)[-1]})"
            for line in lines]


def short_micro_batch(base, mine: dict) -> list:
    """Why a baseline of a task whose trainer averages micro-batch means (``CompareHints.mean_of_micro_batches``:
    the Trainer divides by the number of micro-batches when the loss is not divided by the window's item count)
    differs at each epoch's last step: that window holds a short micro-batch beside full ones, which its trainer
    weights like a full one, where finetune weights each sample alike (the big batch's step). A property of the
    baseline's reduction, not something a run can carry."""
    trainer = hints(mine["config"]).mean_of_micro_batches
    b, n = int(base.get("per_device_train_batch_size") or 0), mine["metrics"].get("train_samples")
    accumulation, processes = int(base.get("gradient_accumulation_steps") or 1), int(base.get("num_devices") or 1)
    if trainer is None or not b or not n or processes != 1 or n % b == 0:
        return []
    micro = -(-n // b)                        # micro-batches per epoch, the last one short
    last = (micro - 1) % accumulation + 1     # of them in the epoch's last window
    if last == 1:
        return []
    sizes = " and ".join([str(b)] * (last - 1) + [str(n % b)])
    step = -(-micro // accumulation)
    return [f"the baseline's last window of each epoch (step {step}, ...) held micro-batches of {sizes} samples, "
            f"which {trainer} weights alike (the mean of their means); finetune weights each sample alike, the big "
            "batch's step, so that step differs by construction"]


def start_notes(base, mine: dict, equivalent: bool) -> list:
    """Why a LoRA baseline's steps may part from the first: its random adapters, drawn where the run cannot see,
    unless the run started from the baseline's saved ones (``peft.init_from``). Said only when the runs differ: an
    equivalent verdict shows the start matched (LoRA's B starts at zero, so from step 2 on the steps depend on A)."""
    if equivalent or not base.adapter_config or setting(mine["config"], "peft.init_from"):
        return []
    where = ("wrapped before SFTTrainer (no peft_config=), they were drawn outside TRL's seeding" if base.trl else
             "drawn in the baseline's own script other than right after set_seed(seed), they differ")
    return [f"if the adapters were {where}: give the adapters saved before the first step as peft.init_from "
            "(certified regardless: the windows, the lr, the settings and step 1)"]


def _check_windows(c: Comparison, base, history: list, mine: dict, unchecked: list) -> None:
    """Each window's samples against the Trainer's batch: its order recomputed from the baseline's seed (data_seed
    when set) and effective batch over this run's training set."""
    other = carried(base, mine).other_samples
    if other:
        unchecked.append("window samples")
        c.add("window samples", None, f"not checkable: {other}, not this run's samples")
        return
    seed = base.get("data_seed") if base.get("data_seed") is not None else base.get("seed")
    size, epochs = base.effective_batch(), sorted({h["epoch"] for h in history})
    # the training set is this run's (the baseline's data are the user's); older runs do not record its size
    n = mine["metrics"].get("train_samples") or (
        sum(h["samples"] for h in history if h["epoch"] == 0) if len(epochs) > 1 else None)
    if seed is None or not size or n is None:
        what = ("the baseline's seed" if seed is None else "the baseline's effective batch" if not size else
                "this run's training-set size (not in its metrics.json)")
        unchecked.append("window samples")
        c.add("window samples", None, f"not checkable: {what} is unknown")
        return
    # membership only: how a window splits does not matter
    windows = WindowSpec(samples=n, micro_batch=size, accumulation=1, processes=1, seed=int(seed),
                         sample_order="trainer", drop_last=setting(mine["config"], "training.drop_last"))
    trainer = {(e, w.index): membership_hash(w.samples) for e in epochs for w in windows.epoch(e)}
    bad = next((h for h in history if trainer.get((h["epoch"], h["window"])) != h.get("window_hash")), None)
    order = (mine["config"].get("training") or {}).get("sample_order", "finetune")
    c.add("window samples", bad is None, f"all {len(history)} windows held the Trainer's batches (seed {seed})"
          if bad is None else f"step {bad['step']} (epoch {bad['epoch']}, window {bad['window']}) held different "
          f"samples than the Trainer's batch (this run: sample_order {order}, seed "
          f"{(mine['config'].get('training') or {}).get('seed')}; the baseline's seed {seed})",
          step=bad["step"] if bad else None, basis=f"the Trainer's samples in all {len(history)} windows")


def _check_logged_loss(c: Comparison, logs: list, history: list, rtol: float, why, every: int,
                       assumed: bool = False, means: bool = True) -> None:
    """Each logged training loss against our mean over the steps it covers (since the previous log entry: the
    Trainer logs the mean over its ``logging_steps`` = ``every`` steps, and over fewer at the end); without
    ``means``, against our loss at its step (torchtune logs the step's own)."""
    worst, bad, previous = 0.0, None, 0
    for e in logs:
        ours = [h["loss"] for h in history if (previous if means else e["step"] - 1) < h["step"] <= e["step"]]
        previous = e["step"]
        if not ours or not math.isfinite(e["loss"]):
            continue
        mean = sum(ours) / len(ours)
        d = _rel(e["loss"], mean)
        worst = max(worst, d)
        if d > rtol and bad is None:
            bad = (e["step"], e["loss"], mean)
    per = "" if every == 1 else f" (each a mean over the {every} steps since the previous log)" if means else \
        f" (each logged step's own loss, every {every} steps)"
    c.measured["loss curve"] = worst
    c.add("loss curve", bad is None, f"max relative difference {worst:.2e} at {len(logs)} logged steps{per}, "
          f"tolerance {rtol:g}" + (f" (band: {why})" if why else "") + (
              "" if bad is None else f"; first above at step {bad[0]}: {bad[1]:.6g} vs {bad[2]:.6g}"),
          step=bad[0] if bad else None, basis=f"loss ≤ {rtol:.0e} at {len(logs)} logged steps", assumed=assumed)


def _check_eval(c: Comparison, base, mine: dict, rtol: float, rounding: float, assumed: bool = False) -> None:
    ours = {v["step"]: v["loss"] for v in mine["metrics"].get("val_history", []) if "loss" in v}
    pairs = [(s, loss, ours[s]) for s, loss in base.evals if s in ours]
    if not base.evals:
        c.add("eval loss", None, f"the {base.kind} holds no evaluation")
        return
    if not pairs:
        c.add("eval loss", False, f"this run evaluated at none of the baseline's steps ({[s for s, _ in base.evals]})")
        return
    worst = max(_rel(x, y) for _, x, y in pairs)
    bad = next(((s, x, y) for s, x, y in pairs if abs(x - y) > rtol * abs(y) + rounding), None)
    c.add("eval loss", bad is None, f"max relative difference {worst:.2e} at steps {[s for s, _, _ in pairs]}" + (
        " (the card's 4 decimals allowed)" if rounding else "") + (
        "" if bad is None else f"; step {bad[0]}: {bad[1]:.6g} vs {bad[2]:.6g} (the Trainer averages per-batch "
                               "means: equal to finetune's token mean when the set is one eval batch)"),
        step=bad[0] if bad else None, basis=f"eval loss ≤ {rtol:.0e}", assumed=assumed)


def plot_against_baseline(baseline, run, path) -> Path:
    """The baseline's logged loss and lr over this run's (its loss as the same means over the logged steps)."""
    plt = pyplot()
    b = baseline if isinstance(baseline, Baseline) else read_baseline(baseline, "compare")
    hist = read_run(Path(run))["history"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    logs = b.logs or [{"step": s, "loss": v} for s, v in b.card_losses]
    axes[0].plot([e["step"] for e in logs], [e["loss"] for e in logs], "-", label=f"{b.kind} {b.path.name}")
    axes[0].plot([h["step"] for h in hist], [h["loss"] for h in hist], "--", label=Path(run).name)
    if b.evals:
        axes[0].plot([s for s, _ in b.evals], [v for _, v in b.evals], "o", label="baseline eval")
    if any("learning_rate" in e for e in logs):
        axes[1].plot([e["step"] for e in logs], [e["learning_rate"] for e in logs], "-", label="baseline")
    axes[1].plot([h["step"] for h in hist], [h["lr"] for h in hist], "--", label=Path(run).name)
    return save_curves(fig, axes, ("training loss", "learning rate"), path)


def save_curves(fig, axes, titles, path) -> Path:
    """Title, label and save the side-by-side curves of ``compare --plot``."""
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return Path(path)
