"""The token-count layer against another tool's run: the tokens seen its log holds at each logged step
(``Baseline.token_counts``: TRL's ``num_tokens``, the Trainer's ``num_input_tokens_seen``) against this run's
history (``tokens_seen``, ``padded_tokens_seen``), compared exactly by ``verdict.token_count`` where both count the
same thing, and said as not checkable where they do not."""

from __future__ import annotations

from finetune.reproduce.record import Baseline, TokenCounts
from finetune.reproduce.runs import Run
from finetune.reproduce.update_settings import hints, setting
from finetune.reproduce.verdict import Comparison, token_count


def check_tokens(c: Comparison, b: Baseline, mine: Run) -> None:
    """The tokens seen the baseline logged at each logged step against this run's, as exact integers: where the
    baseline counts its padding (the Trainer's ``all``), which depends on its micro-batches, against this run's
    padded tokens only where it replayed their padding (``training.replay_padding``). Said only where the baseline
    logs a count."""
    logged = b.token_counts
    if logged is None:
        return
    why = uncounted(logged, mine.recipe, setting(mine.recipe, "training.replay_padding")) or \
        dropped_tail(mine.recipe)
    if why:
        c.add("token count", None, f"not checkable: {why}")
        return
    ours = {h["step"]: h.get("padded_tokens_seen" if logged.padding else "tokens_seen") for h in mine.history}
    steps = [s for s, _ in logged.counts if s in ours]
    theirs = dict(logged.counts)
    token_count(c, (steps, [theirs[s] for s in steps], [ours[s] for s in steps]),
                logged.defined + ("; here the padded tokens of the baseline's micro-batches, replayed" if
                                  logged.padding else ""), names=("the baseline", "this run"),
                skip=gathered_tails(b, mine, steps))


def uncounted(logged: TokenCounts, recipe: dict, replayed) -> str | None:
    """Why the baseline's count is not this run's to compare (None: it is): the trainer of this run's task counts
    batches of its own (``CompareHints.counted_as_peers``); what it counts is not known; it counts padding this run
    did not replay (``replayed``: ``training.replay_padding``)."""
    if not hints(recipe).counted_as_peers:
        return f"{logged.key} of a {(recipe or {}).get('task')} run counts that trainer's own batches"
    if logged.padding is None:
        return "what it counts is not known (include_num_input_tokens_seen not read)"
    if logged.padding and not replayed:
        return ("it counts the padding of the baseline's micro-batches (include_num_input_tokens_seen: all), "
                "which this run did not replay (training.replay_padding)")
    return None


def dropped_tail(recipe: dict) -> str | None:
    """Why this run's count is not its baseline's where its rows end earlier (None: they do not): training on the
    assistant's turns with ``data.turn_end: stripped``, finetune drops the template's text after each row's last
    turn (ChatML's newline), which TRL 1.16 tokenizes untrained (``apply_chat_template`` of the whole
    conversation: 223 tokens against 219 at the first step of ``tests/test_trl_runs.py``'s assistant-only run) —
    a token no earlier one attends to, so the steps are the same, but not the count."""
    if setting(recipe, "data.train_on") in ("assistant", "assistant_turns") and \
            setting(recipe, "data.turn_end") in (None, "stripped"):
        return ("this run drops the template's text after each row's last assistant turn (data.turn_end: stripped, "
                "untrained), which the baseline's tool tokenizes: its rows are longer by it")
    return None


def gathered_tails(b: Baseline, mine: Run, steps: list) -> tuple:
    """(the logged steps whose additions TRL under-counts, why). TRL gathers each micro-batch's count with
    accelerate's ``gather_for_metrics`` (the Trainer's own ``num_input_tokens_seen``: ``gather``), which at the end
    of the data loader keeps only the first ``remainder`` processes' values, ``remainder`` = rows mod (per-device
    batch × processes): where it is below the processes, an epoch's last step leaves out the others' last
    micro-batch."""
    rows, per_device = mine.metrics.get("train_samples"), int(b.get("per_device_train_batch_size") or 0)
    processes = b.process_count()
    if b.token_counts.key != "num_tokens" or processes < 2 or not rows or not per_device or \
            b.get("dataloader_drop_last"):
        return frozenset(), ""
    remainder = rows % (per_device * processes)
    if not 0 < remainder < processes:
        return frozenset(), ""
    ends = {max(h["step"] for h in mine.history if h["epoch"] == e) for e in {h["epoch"] for h in mine.history}}
    skipped = frozenset(s for s, before in zip(steps, [0] + steps) if any(before < t <= s for t in ends))
    return skipped, (f"each epoch's last step, whose last micro-batch TRL counts on {remainder} of its "
                     f"{processes} processes only ({rows} rows, {per_device} per device: at the end of the data "
                     f"loader accelerate's gather_for_metrics keeps the values of the first {rows} mod "
                     f"{per_device * processes} processes)")
