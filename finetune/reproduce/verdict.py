"""The certificate's verdict machinery, shared by run against run (:mod:`compare`) and run against a baseline
(:mod:`baseline_check`): the record of the layers judged (:class:`Comparison`) and its :class:`Verdict`, how a layer
is judged (:class:`Judgement`: its band, its floor), the layers both kinds of comparison take (the update's settings,
the windows, a per-step series, the clipping, the weights) and the floor measured on a twin run (:func:`twin_floor`).

A verdict is "equivalent", "differs" where a difference is known (settings, windows, their content, a layer outside a
measured floor or fp32's) or "not certified" where the only differences lie outside an assumed floor, which errs both
ways (docs/exact-steps.md#the-certificate); ``finetune compare`` exits 0, 1 or 3 for them (2 is bad input).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from finetune.config import flatten, result_changes
from finetune.errors import ConfigError
from finetune.optimizers import ADAPTIVE
from finetune.reproduce import floor as floors
from finetune.reproduce.floor import FP32
from finetune.reproduce.runs import Run, read_run
from finetune.reproduce.update_settings import setting
from finetune.reproduce.weight_diff import FLIP_SHARE, weight_differences

VerdictKind = Literal["equivalent", "differs", "not certified"]
EXIT_CODES = {"equivalent": 0, "differs": 1, "not certified": 3}


@dataclass(frozen=True)
class Verdict:
    """What a comparison concludes: its ``kind`` and the line that says it (the report's last, the one a model
    card records)."""

    kind: VerdictKind
    line: str

    @property
    def exit_code(self) -> int:
        """``finetune compare``'s exit code: 0 equivalent, 1 differs, 3 not certified (2 is bad input)."""
        return EXIT_CODES[self.kind]


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
    # each judged numeric layer's least tolerance at any step: the smallest difference it could have seen
    power: dict = field(default_factory=dict)
    # what the floor's twin measured where it is not rounding ("dropout noise": a twin at another dropout seed)
    within: str | None = None

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

    def _kind(self) -> VerdictKind:
        """"equivalent"; "differs" where a difference is known (settings, windows, their content, a layer outside a
        measured floor or fp32's); "not certified" where the only differences lie outside an assumed floor."""
        failed = [i for i, (_, ok, _, _) in enumerate(self.checks) if ok is False]
        if not failed:
            return "equivalent"
        return "not certified" if all(i in self.uncertain for i in failed) else "differs"

    @property
    def verdict(self) -> Verdict:
        """The verdict as a record: its kind and its line."""
        kind = self._kind()
        return Verdict(kind, self._line(kind))

    @property
    def equivalent(self) -> bool:
        return self._kind() == "equivalent"

    @property
    def exit_code(self) -> int:
        """``finetune compare``'s exit code: 0 equivalent, 1 differs, 3 not certified (2 is bad input)."""
        return EXIT_CODES[self._kind()]

    def _line(self, kind: VerdictKind) -> str:
        """The verdict's line: its kind, the first difference or what an equivalent verdict rests on, and why."""
        also = f"; {self.qualifier}" if self.qualifier else ""
        if kind == "not certified" and self.unread:
            return f"verdict: not certified — {self.first_difference}; {self.unread}"
        if kind == "not certified":
            return (f"verdict: not certified — {self.first_difference}; outside an assumed floor, which errs both "
                    "ways: measure the floor on this hardware with --floor TWIN (RUN_A's recipe at another "
                    "--batch-size)" + also)
        if kind == "differs":
            return f"verdict: differs — {self.first_difference}" + also
        if self.eight_bit:
            return (f"verdict: the same windows and schedule, loss curves close; no fp32 equivalence claimed — "
                    f"{self.eight_bit}: 8-bit optimizer: not the fp32 step")
        within = f" within {self.within}" if self.within else ""
        return f"verdict: equivalent{within} — rests on " + self.basis() + also + self.power_said()

    def power_said(self) -> str:
        """What "equivalent" rules out: nothing above the least tolerance of each numeric layer (relative; step 1's
        0 where its forward was replayed bit for bit)."""
        if not self.power:
            return ""
        said = ", ".join(f"{name} {'0 (bit for bit)' if value == 0 else f'{value:.1e}'}"
                         for name, value in self.power.items())
        return f"; nothing above — {said} (the smallest differences it could have seen)"

    def report(self) -> str:
        """Each layer, one a line, then the verdict's line."""
        width = max(len(c[0]) for c in self.checks) if self.checks else 10
        mark = {True: "ok", False: "DIFF", None: "info"}
        lines = [f"{'OUT' if i in self.uncertain else mark[ok]:<4}  {name:<{width}}  {detail}"
                 for i, (name, ok, detail, _) in enumerate(self.checks)]
        return "\n".join(lines + [self.verdict.line])

    def basis(self) -> str:
        """What an equivalent verdict rests on: the layers judged, with their tolerances and floors."""
        return "; ".join(self.bases) if self.bases else "nothing could be judged"


def rel(a: float, b: float, atol: float = 1e-12) -> float:
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
    steps: Optional[dict] = None    # optimizer step → this layer's tolerance there (a floor measured per step)
    step_tolerances: dict = field(default_factory=dict)  # every layer's steps (the floor's): the grad norm reads it

    def at(self, step) -> float:
        """The tolerance at optimizer ``step``."""
        return self.steps.get(step, self.rtol) if self.steps else self.rtol



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
    pairs = [(s, x, y, z) for s, x, y, z in zip(steps, xs, ys, others) if finite(x) and finite(y)]
    if not pairs:
        c.add(name, None, "not checkable: not logged on both sides")
        return
    worst = c.measured[name] = max(rel(x, y, atol) for _, x, y, _ in pairs)
    nearer = lambda x, y, z: min(rel(x, y, atol), rel(z, y, atol) if finite(z) else math.inf)  # noqa: E731
    bad = next(((s, x, y) for s, x, y, z in pairs if nearer(x, y, z) > judged.at(s)), None)
    least = min(judged.at(s) for s, _, _, _ in pairs)
    if judged.judge and not judged.assumed:
        c.power[name.removesuffix(" curve")] = least
    band = f" (band: {why})" if why else f" (relative to at least {atol:g})" if atol > 1e-12 else ""
    band += "; the nearer of the run and its twin" if judged.twin is not None else ""
    tolerance = f"tolerance {rtol:g}" if not judged.steps else f"tolerance per step {least:.1e} to {rtol:.1e}"
    c.add(name, bad is None, f"max relative difference {worst:.2e} at {len(pairs)} steps{' ' + what if what else ''}"
          f", {tolerance}{band}" + ("" if bad is None else
                                    f"; first above at step {bad[0]}: {bad[1]:.7g} vs {bad[2]:.7g} (tolerance "
                                    f"{judged.at(bad[0]):.1e})"),
          step=None if bad is None else bad[0], basis=f"{name.removesuffix(' curve')} ≤ {rtol:.0e}",
          assumed=judged.assumed)


def finite(x) -> bool:
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
            if finite(x) and finite(y)]
    bad = next(((s, x, y) for s, x, y in rows if rel(x, y) > judged.rtol), None)
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
    if not judged.assumed:
        c.power[f"weights {'L2' if adaptive else 'max'}"] = rtol
    c.add("weights", value <= rtol, f"{measure} {value:.2e}{against} (tolerance {rtol:g}; {why})", step=math.inf,
          basis=f"weights {'L2' if adaptive else 'max'} {value:.1e} ≤ {rtol:.0e}", assumed=judged.assumed)

def same_windows(c: Comparison, ha: list, hb: list, n: int) -> None:
    """Every step's window held the same samples, with the same content, and used the same lr."""
    bad = next((i for i in range(n) if ha[i].get("window_hash") != hb[i].get("window_hash")), None)
    c.add("window samples", bad is None, f"all {n} windows held the same samples" if bad is None else
          f"step {ha[bad]['step']} (epoch {ha[bad]['epoch']}, window {ha[bad]['window']}) held different samples",
          step=None if bad is None else ha[bad]["step"], basis=f"samples and lr at all {n} steps")
    same_content(c, ha, hb, n)
    bad = next((i for i in range(n) if rel(ha[i]["lr"], hb[i]["lr"]) > 1e-9), None)
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



# what finetune's history counts as tokens seen: the same for any layout, as TRL's num_tokens counts them
TOKENS_SEEN = "real tokens (the attention mask) of every window, over every process, cumulative"


def token_count(c: Comparison, series: tuple, defined: str, names: tuple = ("RUN_A", "RUN_B"),
                skip: tuple = (frozenset(), "")) -> None:
    """The tokens seen by each logged step (``series``: steps, one side's counts, the other's; None where a side
    logged none), summed over processes and over the run so far: integers, compared exactly — what each logged step
    added since the one before, so that a row whose length changed differs at the step that held it, in any
    precision. ``defined``: what both count; ``names``: the sides, as the report calls them; ``skip``: (the logged
    steps whose additions are not compared, why)."""
    steps, xs, ys = series
    pairs = [(s, int(x), int(y)) for s, x, y in zip(steps, xs, ys) if x is not None and y is not None]
    if not pairs:
        c.add("token count", None, f"not checkable: no step logs a count on both sides ({defined})")
        return
    added = [(s, x - x0, y - y0, since) for (s, x, y), (since, x0, y0) in zip(pairs, [(None, 0, 0)] + pairs)]
    skipped, why = skip
    judged = [a for a in added if a[0] not in skipped]
    left_out = f"; {len(added) - len(judged)} not compared: {why}" if len(judged) < len(added) else ""
    at = next((i for i, (s, x, y, _) in enumerate(added) if x != y and s not in skipped), None)
    if at is None:
        s, x, _ = pairs[-1]
        c.add("token count", True, f"equal at {len(judged)} of {len(pairs)} logged steps ({x} tokens by step {s}; "
              f"{defined}{left_out})" if left_out else f"equal at all {len(pairs)} logged steps ({x} tokens by step "
              f"{s}; {defined})", basis=f"token counts at {len(judged)} steps")
        return
    (s, x, y), (_, dx, dy, since) = pairs[at], added[at]
    c.add("token count", False, f"step {s}: {x} tokens seen in {names[0]} vs {y} in {names[1]} ({dx} vs {dy} since "
          f"{f'step {since}' if since else 'the start'}: the windows held rows of other lengths; {defined}"
          f"{left_out})", step=s)


def same_token_counts(c: Comparison, ha: list, hb: list, n: int) -> None:
    """Two runs' tokens seen at each of their first ``n`` steps (history's ``tokens_seen``), exactly. Said only where
    a run logs them (a text task's batches); a run recorded before they were kept is said as such."""
    logged = [any("tokens_seen" in h for h in x[:n]) for x in (ha, hb)]
    if not any(logged):
        return
    if not all(logged):
        c.add("token count", None, f"not checkable: {'RUN_A' if not logged[0] else 'RUN_B'} recorded no token "
                                   "counts (a run before they were kept)")
        return
    token_count(c, ([h["step"] for h in ha[:n]], [h.get("tokens_seen") for h in ha[:n]],
                    [h.get("tokens_seen") for h in hb[:n]]), TOKENS_SEEN)


def skipped_detail(only: list, skipped: list) -> str:
    """The skipped-steps layer's words (run against run, and against a baseline): the steps skipped on one side
    only (``only``: (step, whose)), else the steps both skipped."""
    if only:
        return "; ".join(f"step {s} skipped in {who} only" for s, who in only[:3])
    return f"the same {len(skipped)} skipped (step{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped))})" \
        if skipped else "none skipped"



def twin_floor(a: Run, twin: Path, optimizer: str | None) -> floors.Floor:
    """The floor measured on ``twin``, which must be ``a``'s computation in another layout (one line otherwise)."""
    t = read_run(twin)
    probe = Comparison()
    if a.config and t.config:  # every setting that changes the steps, as a resumed run is checked
        mine, theirs = flatten(a.config), flatten(t.config)
        # how the twin rounds is the point of it: fp32 sums off round as autocast does (as the peers do)
        # and so are its dropout masks: a twin at another dropout seed measures dropout's noise
        changed = [f"{k} {mine.get(k)!r} vs {theirs.get(k)!r}" for k in result_changes(
            mine, theirs, ("training.fp32_grad_sums", "training.pad_to_window", "training.dropout_seed"))
            if not k.startswith("output.")]
        probe.add("settings", not changed, "; ".join(changed[:3]))
    else:
        probe.add("settings", False, "a run has no config.yaml")
    same_windows(probe, a.history, t.history, min(len(a.history), len(t.history)))
    if len(t.history) != len(a.history):
        probe.add("optimizer steps", False, f"{len(a.history)} vs {len(t.history)}")
    if not probe.equivalent:
        raise ConfigError(f"compare: --floor {twin} is not the same run as RUN_A in another layout "
                          f"({probe.first_difference}); make it with RUN_A's recipe and another --batch-size")
    weights(probe, (a.weights, t.weights), optimizer, Judgement())
    dropout = other_masks(a, t)
    fl = floors.measured(a.history, t.history, probe.measured,
                         f"{twin.name} at {layout_of(t)}" + (", another dropout seed" if dropout else ""))
    return dataclasses.replace(fl, twin=t, dropout=dropout)


def other_masks(a: Run, twin: Run) -> bool:
    """Whether ``twin`` drew other dropout masks than ``a``: both trained keyed dropout layers, at other seeds."""
    return bool(a.dropout_layers and twin.dropout_layers) and a.dropout_seed != twin.dropout_seed


def layout_of(run: Run) -> str:
    """How a run (a :class:`Run`) cut and padded its windows, for the floor's note: its micro-batch, and the
    padding its samples ran at (``training.replay_padding``: the baseline's; else the window's longest under
    ``training.pad_to_window`` in mixed precision, else each micro-batch's own longest)."""
    m, config = run.metrics or {}, run.recipe
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
