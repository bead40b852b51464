"""``finetune compare BASELINE RUN``: a finetune run against a baseline another tool trained (any run a source of
``sources.SOURCES`` reads), layer by layer as the certificate (:mod:`compare`) judges two runs: the update's
settings as import carries them, the effective batch and steps, each window's samples in the Trainer's order, the
lr, loss and grad norm at every logged step, the evaluation, the weights. What the baseline does not show (a model
card has no lr, no weights) is said as not checkable; where the steps differ, the verdict names the likeliest cause
(a setting import could not carry, the baseline's own reduction, the adapters' start)."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors.torch import load_file

from finetune.errors import ConfigError
from finetune.reproduce import replay
from finetune.reproduce.architecture import model_difference
from finetune.reproduce.carry import carry, trained_precision
from finetune.reproduce.floor import FP32
from finetune.reproduce.record import Baseline, Imported
from finetune.reproduce.runs import Run, read_run
from finetune.reproduce.sources import read_baseline
from finetune.reproduce.sources.hub import no_step_log
from finetune.reproduce.token_counts import check_tokens
from finetune.reproduce.update_settings import hints, run_settings, setting, settings_of, step_settings
from finetune.reproduce.verdict import (
    UNKNOWN,
    Comparison,
    Judgement,
    check_settings,
    clipping,
    finite,
    per_step,
    rel,
    skipped_detail,
    twin_floor,
    weights,
)
from finetune.windows import WindowSpec, even_batch_windows, membership_hash, trainer_epoch_order

# Where the baseline's loss cannot be replayed exactly, the band it is held to, and why.
MIXED_PRECISION_BAND = 1e-2   # bf16 / fp16 autocast rounds the two runs' matmuls differently

DROPOUT_BAND = 5e-2           # other dropout masks: only the expectation of the loss matches

CARD_ROUNDING = 5e-5          # a model card prints losses with 4 decimals



def loss_band(b, mine: Run) -> tuple[float, str | None]:
    """The relative tolerance of the training loss, and why it is wider than an exact replay's (None: exact)."""
    t = mine.recipe.get("training") or {}
    trained = trained_precision(b)  # what it trained with, not what its arguments asked (fp16 on a CPU is fp32)
    precision = trained[0] if trained and trained[0] != "no" else None
    ours = t.get("mixed_precision")
    if (mine.recipe.get("model") or {}).get("master_weights") is False:
        return MIXED_PRECISION_BAND, ("the weights train in their own low precision (no fp32 master weights) and "
                                      "each side rounds differently; an assumed band: measure the floor on this "
                                      "hardware with --floor TWIN (this reproduction at another --batch-size)")
    if precision or ours not in (None, "no"):
        return MIXED_PRECISION_BAND, (f"mixed precision ({precision or 'fp32'} baseline, {ours or 'no'} here) "
                                      "rounds each side differently; an assumed band: measure the floor on this "
                                      "hardware with --floor TWIN (this reproduction at another --batch-size)")
    cfg, adapter = b.model_config or {}, b.adapter_config or {}
    drops = {k: v for k, v in cfg.items() if ("dropout" in k or k.endswith("pdrop")) and
             isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    if adapter.get("lora_dropout"):
        drops["lora_dropout"] = adapter["lora_dropout"]
    if drops:
        return DROPOUT_BAND, (f"the baseline trained with dropout ({', '.join(f'{k}={v}' for k, v in drops.items())})"
                              ": other masks, only the expectation of the loss matches; measure dropout's noise on a "
                              "twin: this reproduction with --set training.dropout_seed=N, given as --floor TWIN")
    return FP32["loss"], None



def compare_with_baseline(baseline, run, weight_rtol: float | None = None,
                          loss_rtol: float | None = None, twin=None) -> Comparison:
    """Check finetune run ``run`` against ``baseline`` (its path, or the ``Baseline`` already read: then it is not
    read again), in order: effective batch, optimizer steps, the samples of every window (the Trainer's order
    recomputed from the baseline's seed), the lr and the training loss at every logged step (our mean over the steps
    each log entry covers: ``logging_steps`` > 1 logs a mean), the evaluation loss, the weights. Raises ConfigError
    when the two models differ or the baseline is unreadable. ``twin``: a twin of ``run`` (the same reproduction at
    another --batch-size): the bands are then ``floor.TWIN_FACTOR`` × the rounding floor measured between them, not
    the assumed ones."""
    b = baseline if isinstance(baseline, Baseline) else read_baseline(baseline, "compare")
    mine = read_run(run)
    diff = model_difference(b.model_config, mine.model_config)
    if diff:
        raise ConfigError(f"compare: the baseline's model differs from {run}'s: {diff}")
    history, c, unchecked = mine.history, Comparison(), []
    imported = carried(b, mine)  # once per comparison: the settings, the windows and the causes read it
    check_settings(c, run_settings(mine.recipe), step_settings(imported.values, settings_of(mine.recipe)),
                   "the baseline")
    eb, em = b.effective_batch(), mine.metrics.get("effective_batch_size")
    c.add("effective batch", eb == em if eb is not None else None,
          f"{eb} ({b.kind}) vs {em} ({mine.metrics.get('gradient_accumulation_steps')} micro-batches/step)"
          if eb is not None else f"not in the {b.kind}")
    steps = b.max_steps or b.get("schedule_steps")
    c.add("optimizer steps", steps == len(history) if steps else None,
          f"{steps} vs {len(history)}" if steps else f"not in the {b.kind}")
    _check_windows(c, b, mine, imported, unchecked)
    _check_lr(c, b, history, unchecked)
    fl = twin_floor(mine, Path(twin), setting(mine.recipe, "training.optimizer")) if twin is not None else None
    c.within = "dropout noise" if fl is not None and fl.dropout else None
    judged = _judgement(b, mine, fl, loss_rtol)
    kernels = None
    if b.logs:
        # below fp32 a forward's rounding follows its kernels: replayed, step 1 is exact (fp32 has its own band)
        kernels = replay.step_one(c, b, mine) if setting(mine.recipe, "training.mixed_precision") not in \
            (None, "no") else None
        _check_logged_loss(c, b, history, judged)
        _check_logged_norms(c, b, mine, judged, unchecked)
        _check_skipped(c, b, history)
        check_tokens(c, b, mine)
    elif b.card_losses:
        unchecked.append("training loss")
        c.add("loss curve", None, "not checkable: the card's Training Loss is the mean over logging_steps, which "
                                  "the card does not say")
    _check_eval(c, b, mine, judged, CARD_ROUNDING if b.card_only else 0.0)
    if b.weights is None:
        unchecked.append("weights")
        c.add("weights", None, f"not checkable: the {b.kind} holds no weights")
    else:
        weights(c, (mine.weights, load_file(str(b.weights))), setting(mine.recipe, "training.optimizer"),
                Judgement(weight_rtol, assumed=judged.assumed and weight_rtol is None,
                          tolerances=judged.tolerances), against=f" against {b.weights.name}")
    _unread_at_step_one(c, b)
    not_replayed = [f"step 1 not replayed — {kernels.impossible or '; '.join(kernels.differs)}"] \
        if kernels is not None and not kernels.replayed else []
    c.qualifier = "; ".join(not_replayed + _notes(c, b, mine, imported, (judged, unchecked))) or None
    return c


KNOWN = ("settings", "effective batch", "optimizer steps", "window samples", "window content")  # differ for sure


def _unread_at_step_one(c: Comparison, b: Baseline) -> None:
    """Step 1's loss comes before any update: where it differs, the tokens differ, and where import could not read
    some of the baseline's own settings (``Baseline.unknown``: a LLaMA-Factory folder without its YAML, whose
    template and system message are then unknown) the run is "not certified", naming them — not "differs", which a
    difference of the settings carried would make it."""
    failed = [(i, name, step) for i, (name, ok, _, step) in enumerate(c.checks) if ok is False]
    first = min((e["step"] for e in b.logs), default=None)
    at_first = any(name == "loss curve" and step == first for _, name, step in failed)
    if not b.unknown or not at_first or any(name in KNOWN for _, name, _ in failed):
        return
    c.uncertain.update(i for i, _, _ in failed)
    c.unread = (f"step {first}'s loss differs before any update, so the tokens trained differ: import could not "
                f"read {'; '.join(b.unknown)}")


def _judgement(b: Baseline, mine: Run, fl, loss_rtol) -> Judgement:
    """The band the baseline's loss is held to: fp32's, a band assumed for mixed precision or dropout, or ``fl``, the
    floor measured on a twin (at another layout, or another dropout seed: dropout's own noise); ``rtol``: the loss's,
    and the grad norm's as its ``atol`` field is not used here."""
    band, why = loss_band(b, mine)
    if fl is not None:  # the floor measured on this hardware replaces the assumed band
        band, why = fl.overall["loss"], fl.note
    # a band assumed for mixed precision or dropout, not measured: outside it the run is "not certified"
    assumed = fl is None and why is not None and loss_rtol is None
    stepwise = fl is not None and loss_rtol is None  # a user's own tolerance holds at every step
    return Judgement(loss_rtol if loss_rtol is not None else band, assumed=assumed, why=why,
                     tolerances=fl.overall if fl else FP32, steps=fl.steps.get("loss") if stepwise else None,
                     step_tolerances=fl.steps if stepwise else {})


def _notes(c: Comparison, b: Baseline, mine: Run, imported: Imported, judged_unchecked: tuple) -> list:
    """What the verdict says beside its layers: a step of the baseline's engine that is not the big batch's (said
    either way), no step log, a wider band and why, what could not be checked, and a differing run's likeliest
    cause — a setting import could not carry, else the adapters' start (only where no engine step nor such setting
    is left to blame)."""
    judged, unchecked = judged_unchecked
    band, why = judged.rtol, judged.why
    # the baseline's engine's own steps, said either way: they are what its files show it did
    engine = [str(e) for e in imported.engine_steps()]
    cause = [] if c.equivalent or c.unread else uncarried(imported) + short_micro_batch(b, mine)
    return engine + [line for line in (no_step_log(b),) if line] + \
        ([f"loss held to {band:g}" + (f", not {FP32['loss']:g}" if band != FP32["loss"] else "") + f": {why}"]
         if why else []) + \
        ([f"not checkable from the {b.kind}: {', '.join(unchecked)}"] if unchecked else []) + \
        (cause or ([] if engine or c.unread or any(name == "window samples" and ok is False for name, ok, _, _ in
                                                    c.checks)
                   else start_notes(b, mine, c.equivalent)))


def _check_lr(c: Comparison, b: Baseline, history: list, unchecked: list) -> None:
    """The lr the baseline logged at each logged step against this run's at that step."""
    by_step = {h["step"]: h for h in history}
    logs = [e for e in b.logs if e["step"] in by_step]
    rates = [e for e in logs if "learning_rate" in e]
    if not b.logs or not any("learning_rate" in e for e in b.logs):
        unchecked.append("lr schedule")
        c.add("lr schedule", None, f"not checkable: the {b.kind} logs no learning rate" + (
            " for the steps it logs (torchtune logs the next step's, read after the scheduler stepped)"
            if b.logs else ""))
        return
    bad = next((e for e in rates if rel(e["learning_rate"], by_step[e["step"]]["lr"]) > b.lr_rounding), None)
    c.add("lr schedule", bad is None and len(logs) == len(b.logs),
          f"identical at all {len(rates)} logged steps" if bad is None and len(logs) == len(b.logs) else
          f"step {bad['step']}: {bad.get('learning_rate'):.6g} vs {by_step[bad['step']]['lr']:.6g}" if bad else
          f"{len(b.logs) - len(logs)} logged steps are past this run's last step",
          step=bad["step"] if bad else None)


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



def _check_logged_norms(c: Comparison, b: Baseline, mine: Run, judged: Judgement, unchecked: list) -> None:
    """The grad norm the baseline logged at each logged step (the Trainer logs the norm of the step it logs at,
    before clipping, not a mean) against this run's, and the clipping each side applied; held to the loss's band at
    least, and to one step of a low-precision run's dtype."""
    by_step = {h["step"]: h for h in mine.history}
    logged = [e for e in b.logs if e["step"] in by_step and finite(e.get("grad_norm"))]
    if not logged:
        unchecked.append("grad norm")
        c.add("grad norm", None, f"not checkable: the {b.kind} logs no grad_norm (the Trainer computes it only "
                                 "when it clips)")
        return
    least = low_precision_grads(mine.recipe)
    rtol = max(judged.rtol, judged.tolerances["grad norm"], least)
    steps, theirs = [e["step"] for e in logged], [e["grad_norm"] for e in logged]
    ours = [by_step[s]["grad_norm"] for s in steps]
    per = judged.step_tolerances  # a floor measured per step: each step's grad norm at least its loss's tolerance
    at = {s: max(per["grad norm"].get(s, rtol), per["loss"].get(s, rtol), least) for s in steps} if per else None
    norms = Judgement(max(at.values()) if at else rtol, assumed=judged.assumed, why=judged.why, steps=at)
    per_step(c, "grad norm", (steps, ours, theirs), norms, what="before clipping")
    limit = (b.get("max_grad_norm") or None) if "max_grad_norm" in b.args else UNKNOWN
    clipping(c, (steps, ours, theirs), (setting(mine.recipe, "training.max_grad_norm") if mine.recipe else
                                        UNKNOWN, limit), norms)


def _check_skipped(c: Comparison, b: Baseline, history: list) -> None:
    """fp16's skipped steps: a step whose scaled gradient overflowed is not taken (the Trainer then logs its grad
    norm as inf or NaN and does not step its schedule), and must be skipped on both sides, at the steps the baseline
    logged a norm. Said only where either side skipped one."""
    by_step = {h["step"]: h for h in history}
    logged = [e for e in b.logs if e["step"] in by_step and isinstance(e.get("grad_norm"), (int, float))]
    theirs = {e["step"] for e in logged if not math.isfinite(e["grad_norm"])}
    ours = {s for s, h in by_step.items() if h.get("skipped")}
    if not theirs and not ours:
        return
    only = sorted((s, "the baseline" if s in theirs else "this run") for s in (theirs ^ ours) & {e["step"] for e in
                                                                                               logged})
    c.add("skipped steps", not only, skipped_detail(only, sorted(theirs)) +
          ("" if only else f" at the {len(logged)} steps with a logged grad norm"), step=only[0][0] if only else None,
          basis="the same skipped steps")


def carried(b: Baseline, mine: Run) -> Imported:
    """The baseline's settings as ``finetune import`` carries them onto this run's recipe: its model and data
    fields, so that a task's own settings (DPO's beta, GRPO's loss type, TRL's packing) are the baseline's too, the
    adapters it started from (``peft.init_from``: the baseline's start, given to import as --initial-adapter), and
    its tool's own step where the run took it (import --baseline-step: most of the settings that flag adds are the
    run's, so that a run which then changed one of them is still read against that step)."""
    def imported(baseline_step: bool):
        return carry(b, {name: None for name in (mine.recipe.get("model") or {})},
                     set(mine.recipe.get("data") or {}), initial_adapter=setting(mine.recipe, "peft.init_from"),
                     baseline_step=baseline_step)

    plain, own = imported(False), imported(True)
    added = {k: v for k, v in own.values.items() if k not in plain.values or plain.values[k] != v}
    took = 2 * sum(setting(mine.recipe, k) == v for k, v in added.items()) > len(added)
    return own if took else plain


def uncarried(imported: Imported) -> list:
    """The baseline's settings that ``finetune import`` says it cannot carry, as causes."""
    return [f"the baseline's {s.setting}={s.value} is not carried by finetune import ({s.why})"
            for s in imported.skips()]


def short_micro_batch(b: Baseline, mine: Run) -> list:
    """Why a baseline of a task whose trainer averages micro-batch means (``CompareHints.mean_of_micro_batches``:
    the Trainer divides by the number of micro-batches when the loss is not divided by the window's item count)
    differs at each epoch's last step: that window holds a short micro-batch beside full ones, which its trainer
    weights like a full one, where finetune weights each sample alike (the big batch's step). A property of the
    baseline's reduction, not something a run can carry."""
    trainer = hints(mine.recipe).mean_of_micro_batches
    size, n = int(b.get("per_device_train_batch_size") or 0), mine.metrics.get("train_samples")
    accumulation, processes = int(b.get("gradient_accumulation_steps") or 1), b.process_count()
    if trainer is None or not size or not n or processes != 1 or n % size == 0:
        return []
    micro = -(-n // size)                        # micro-batches per epoch, the last one short
    last = (micro - 1) % accumulation + 1     # of them in the epoch's last window
    if last == 1:
        return []
    sizes = " and ".join([str(size)] * (last - 1) + [str(n % size)])
    step = -(-micro // accumulation)
    return [f"the baseline's last window of each epoch (step {step}, ...) held micro-batches of {sizes} samples, "
            f"which {trainer} weights alike (the mean of their means); finetune weights each sample alike, the big "
            "batch's step, so that step differs by construction"]



def start_notes(b, mine: Run, equivalent: bool) -> list:
    """Why a LoRA baseline's steps may part from the first: its random adapters, drawn where the run cannot see,
    unless the run started from the baseline's saved ones (``peft.init_from``). Said only when the runs differ: an
    equivalent verdict shows the start matched (LoRA's B starts at zero, so from step 2 on the steps depend on A)."""
    if equivalent or not b.adapter_config or setting(mine.recipe, "peft.init_from"):
        return []
    where = ("wrapped before SFTTrainer (no peft_config=), they were drawn outside TRL's seeding" if b.trl else
             "drawn in the baseline's own script other than right after set_seed(seed), they differ")
    return [f"if the adapters were {where}: give the adapters saved before the first step as peft.init_from "
            "(certified regardless: the windows, the lr, the settings and step 1)"]



def _check_windows(c: Comparison, b: Baseline, mine: Run, imported: Imported, unchecked: list) -> None:
    """Each window's samples against the Trainer's batch: its order recomputed from the baseline's seed (data_seed
    when set) and effective batch over this run's training set."""
    history, other = mine.history, imported.other_samples
    if other:
        unchecked.append("window samples")
        c.add("window samples", None, f"not checkable: {other}, not this run's samples")
        return
    seed = b.get("data_seed") if b.get("data_seed") is not None else b.get("seed")
    size, epochs = b.effective_batch(), sorted({h["epoch"] for h in history})
    # the training set is this run's (the baseline's data are the user's); older runs do not record its size
    n = mine.metrics.get("train_samples") or (
        sum(h["samples"] for h in history if h["epoch"] == 0) if len(epochs) > 1 else None)
    if seed is None or not size or n is None:
        what = ("the baseline's seed" if seed is None else "the baseline's effective batch" if not size else
                "this run's training-set size (not in its metrics.json)")
        unchecked.append("window samples")
        c.add("window samples", None, f"not checkable: {what} is unknown")
        return
    # membership only: how a window splits does not matter
    replayed = setting(mine.recipe, "training.even_batches")
    windows = WindowSpec(samples=n, micro_batch=size, accumulation=1, processes=1, seed=int(seed),
                         sample_order="trainer", drop_last=setting(mine.recipe, "training.drop_last"),
                         even_batches=tuple(replayed) if replayed else None)
    trainer = {(e, w.index): membership_hash(w.samples) for e in epochs for w in windows.epoch(e)}
    bad = next((h for h in history if trainer.get((h["epoch"], h["window"])) != h.get("window_hash")), None)
    if bad is None and not replayed and b.process_count() > 1 and _repeated_samples(c, b, history, (n, int(seed))):
        return
    order = (mine.recipe.get("training") or {}).get("sample_order", "finetune")
    held = f"the Trainer's batches on {replayed[0]} processes, with the samples even_batches repeats" if replayed \
        else "the Trainer's batches"
    c.add("window samples", bad is None, f"all {len(history)} windows held {held} (seed {seed})"
          if bad is None else f"step {bad['step']} (epoch {bad['epoch']}, window {bad['window']}) held different "
          f"samples than the Trainer's batch (this run: sample_order {order}, seed "
          f"{(mine.recipe.get('training') or {}).get('seed')}; the baseline's seed {seed})",
          step=bad["step"] if bad else None, basis=f"the Trainer's samples in all {len(history)} windows")



def _repeated_samples(c: Comparison, b: Baseline, history: list, set_and_seed: tuple) -> bool:
    """Whether a window of the baseline held a sample twice, said as the difference it is (then True): on several
    processes accelerate's ``even_batches`` (the Trainer's default) completes each epoch's short last batch with the
    epoch's first samples, which finetune's big batch holds once."""
    n, seed = set_and_seed
    step_of = {(h["epoch"], h["window"]): h["step"] for h in history}
    for epoch in sorted({h["epoch"] for h in history}):
        twice = even_batch_repeats(trainer_epoch_order(n, seed, epoch), int(b.get("per_device_train_batch_size")),
                                   b.process_count(), int(b.get("gradient_accumulation_steps") or 1))
        if twice:
            window, samples = twice[0]
            step = step_of.get((epoch, window))
            c.add("window samples", False, f"step {step} (epoch {epoch}, window {window}): the baseline's window held "
                  f"samples {samples} a second time — on {b.process_count()} processes accelerate's even_batches (the "
                  "Trainer's default) completes the epoch's short last batch with its first samples; finetune's big "
                  "batch holds each sample once (import --baseline-step replays them)", step=step)
            return True
    return False


def even_batch_repeats(order: list, per_device: int, processes: int, accumulation: int) -> list:
    """(window, the samples it held that the epoch had already held) for each window of an epoch in ``order`` whose
    processes' batches repeat a sample (``windows.even_batch_windows``)."""
    out, seen = [], set()
    for window, held in enumerate(even_batch_windows(order, per_device * processes * accumulation, processes,
                                                     per_device)):
        twice = sorted({i for i in held if i in seen or held.count(i) > 1})
        seen.update(held)
        if twice:
            out.append((window, twice))
    return out


def _check_logged_loss(c: Comparison, b: Baseline, history: list, judged: Judgement) -> None:
    """Each logged training loss against our mean over the steps it covers (since the previous log entry: the
    Trainer logs the mean over its ``logging_steps`` = ``every`` steps, and over fewer at the end); without
    ``means``, against our loss at its step (torchtune logs the step's own)."""
    logs, rtol, why, assumed = b.logs, judged.rtol, judged.why, judged.assumed
    every, means = int(b.get("logging_steps") or 1), b.logged_loss_is_mean
    worst, bad, previous, least = 0.0, None, 0, rtol
    per = judged.steps  # a floor measured per step: a logged mean is held to the widest of its steps
    for e in logs:
        covered = [h for h in history if (previous if means else e["step"] - 1) < h["step"] <= e["step"]]
        ours = [h["loss"] for h in covered]
        previous = e["step"]
        if not ours or not math.isfinite(e["loss"]):
            continue
        tol = max(per.get(h["step"], rtol) for h in covered) if per else rtol
        least = min(least, tol)
        mean = sum(ours) / len(ours)
        d = rel(e["loss"], mean)
        worst = max(worst, d)
        if d > tol and bad is None:
            bad = (e["step"], e["loss"], mean, tol)
    means_said = "" if every == 1 else f" (each a mean over the {every} steps since the previous log)" if means \
        else f" (each logged step's own loss, every {every} steps)"
    c.measured["loss curve"] = worst
    if not assumed:
        c.power["loss"] = least
    tolerance = f"tolerance {rtol:g}" if not per else f"tolerance per step {least:.1e} to {rtol:.1e}"
    c.add("loss curve", bad is None, f"max relative difference {worst:.2e} at {len(logs)} logged steps{means_said}, "
          f"{tolerance}" + (f" (band: {why})" if why else "") + (
              "" if bad is None else f"; first above at step {bad[0]}: {bad[1]:.6g} vs {bad[2]:.6g} (tolerance "
                                     f"{bad[3]:.1e})"),
          step=bad[0] if bad else None, basis=f"loss ≤ {rtol:.0e} at {len(logs)} logged steps", assumed=assumed)



def _eval_batches(b: Baseline, mine: Run) -> str | None:
    """What the baseline's evaluation averaged when it was not one batch of the held-out set: on several processes
    each process's batches (accelerate's even_batches repeating rows to even them), and on one, several batches
    (their means averaged alike); None when it was one batch, or when the sizes are not known."""
    rows, per_batch = mine.metrics.get("val_samples"), b.get("per_device_eval_batch_size")
    processes = b.process_count()
    if processes > 1:
        return f"{processes} processes' batch means (each process's share of the held-out rows, evened by " \
               "repeating some)"
    if rows and per_batch and rows > int(per_batch):
        return f"{math.ceil(rows / int(per_batch))} batch means (batches of {per_batch} of its {rows} rows)"
    return None


def _check_eval(c: Comparison, b: Baseline, mine: Run, judged: Judgement, rounding: float) -> None:
    """The evaluation losses the baseline holds against this run's at the same steps."""
    rtol, assumed = judged.rtol, judged.assumed
    ours = {v["step"]: v["loss"] for v in mine.metrics.get("val_history", []) if "loss" in v}
    pairs = [(s, loss, ours[s]) for s, loss in b.evals if s in ours]
    if not b.evals:
        c.add("eval loss", None, f"the {b.kind} holds no evaluation")
        return
    if not pairs:
        c.add("eval loss", False, f"this run evaluated at none of the baseline's steps ({[s for s, _ in b.evals]})")
        return
    worst = max(rel(x, y) for _, x, y in pairs)
    batches = _eval_batches(b, mine)
    if batches:  # the Trainer's mean of batch means: not the held-out set's token mean, whatever the weights
        c.add("eval loss", None, f"not judged: the Trainer's eval loss is the mean of its {batches}; finetune's is "
              f"the token mean of every held-out row once (max relative difference {worst:.2e} at steps "
              f"{[s for s, _, _ in pairs]})")
        return
    bad = next(((s, x, y) for s, x, y in pairs if abs(x - y) > rtol * abs(y) + rounding), None)
    c.add("eval loss", bad is None, f"max relative difference {worst:.2e} at steps {[s for s, _, _ in pairs]}" + (
        " (the card's 4 decimals allowed)" if rounding else "") + (
        "" if bad is None else f"; step {bad[0]}: {bad[1]:.6g} vs {bad[2]:.6g} (the Trainer averages per-batch "
                               "means: equal to finetune's token mean when the set is one eval batch)"),
        step=bad[0] if bad else None, basis=f"eval loss ≤ {rtol:.0e}", assumed=assumed)

