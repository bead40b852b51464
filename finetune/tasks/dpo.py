"""Preference tuning (DPO, IPO, hinge) of any ``AutoModelForCausalLM``, with the baseline's steps.

Rows in TRL's preference format: ``prompt`` / ``chosen`` / ``rejected``, each plain text or a list of
``{role, content}`` messages; without ``prompt``, the conversations' shared first turns are the prompt (as TRL's
``extract_prompt``). Plain text becomes a user turn and an assistant turn. Every pair is rendered with the model's
chat template and tokenized as TRL 1.16 does (the completion is what follows the tokens of the prompt rendered with
its generation prompt); the log-probabilities count the completion tokens only.

**The pair is the item.** A micro-batch of ``b`` pairs is one forward of ``2·b`` sequences (the chosen ones, then the
rejected ones), its loss the mean over its pairs; the loop weights it by its share of the window's pairs, so the
window's loss is the mean over all its pairs and ``(b, N)`` takes the step of ``(b·N, 1)`` — a short last window and
a short last micro-batch included. The logged rewards, accuracy, margin and log-probs are window means the same way.
Log-probabilities are sums over completion tokens through the chunked head (``finetune.models.loss_head``): no
``[tokens, vocab]`` logits.

The reference: with LoRA the same model with its adapters disabled (no copy); without, a frozen copy kept in
``model.dtype``; or, with ``model.precompute_ref_log_probs``, its log-probabilities computed once at set-up and kept
per sample (saved with every checkpoint, so that a resumed run uses the very same numbers). Reference log-probs are
computed in eval mode (no dropout).

Default data (``data.source: stdlib-pairs``): the questions of the sft task's ``stdlib-qa`` (what does this function
of the standard library do?), each with its docstring's first paragraph as the chosen answer and another function's
as the rejected one (see ``stdlib_pairs``).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel

from finetune import tables
from finetune.config import BaseDataConfig
from finetune.data import attention_mask, require_columns, right_pad, row_place
from finetune.errors import ConfigError
from finetune.job import CompareHints, Job, TaskContext
from finetune.models import precision
from finetune.models.hf import peft_save_hook
from finetune.models.loss_head import model_sequence_log_probs
from finetune.schema import doc
from finetune.tasks import chat

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
PRECOMPUTE_PAIRS = 8  # pairs per forward when precomputing: fixed, so the numbers never depend on the run's batch


# What compare and reproduce know of this task. TRL's DPOTrainer (LLaMA-Factory's dpo stage too) averages each
# micro-batch's mean loss over the window; its folders hold beta and loss_type.
COMPARE_HINTS = CompareHints(step_settings=("model.beta", "model.loss_type", "model.label_smoothing", "data.too_long"),
                             counted_as_peers=True,
                             mean_of_micro_batches="TRL's DPOTrainer", base_recipe="dpo-smollm2",
                             trl_marks=("beta", "loss_type"), peer_names={"llamafactory": "dpo"},
                             log_marks=("rewards/chosen",),
                             arg_marks=("rpo_alpha", "ref_model_init_kwargs", "f_divergence_type", "use_weighting",
                                        "ld_alpha", "reference_free", "precompute_ref_log_probs", "loss_weights",
                                        "label_smoothing"),
                             objective_names=("dpo", "ipo", "DPOLoss", "RSOLoss", "IPOLoss", "preference_dataset",
                                              "stack_exchange_paired_dataset", "hh_rlhf_helpful_dataset", "DPOConfig"))


@dataclass
class ModelConfig(chat.ChatModelConfig):
    loss_type: Literal["sigmoid", "ipo", "hinge"] = doc(
        "sigmoid: DPO, −log σ(β·Δ); ipo: (Δ/length − 1/(2β))² on per-token log-ratios; hinge: max(0, 1 − β·Δ) "
        "(Δ: the chosen minus the rejected log-ratio to the reference; TRL 1.16's formulas)", "sigmoid")
    beta: float = doc("β: how far the policy may move from the reference (IPO's τ)", 0.1, above=0)
    label_smoothing: float = doc("sigmoid only: the probability that a pair's label is flipped (conservative DPO: "
                                 "−(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ))", 0.0, at_least=0, below=0.5)
    precompute_ref_log_probs: bool = doc(
        "compute the reference log-probs once at set-up and keep them per sample (saved with checkpoints) instead "
        "of a reference forward per micro-batch; without LoRA no frozen copy is then kept", False)


@dataclass
class DataConfig(BaseDataConfig):
    source: str = doc("'stdlib-pairs' (standard-library docstrings: the function's own against another's), a jsonl "
                      "/ json / parquet / csv file, a datasets.save_to_disk folder, or a hub dataset id, with "
                      "prompt / chosen / rejected", "stdlib-pairs")
    split: str = chat.split_field()
    max_length: int = doc("longest prompt + completion, in tokens: longer pairs are dropped or cut (data.too_long)",
                          256, at_least=2)
    too_long: Literal["drop", "keep_start"] = doc(
        "a pair whose prompt + longer completion exceeds data.max_length: dropped (counted at set-up), or each "
        "completion cut to the tokens that fit after the prompt as TRL's DPOTrainer truncates (a prompt that fills "
        "max_length alone is dropped, as TRL drops it)", "drop")
    system_prompt: Optional[str] = chat.system_prompt_field()
    text_rows: Literal["chat", "plain"] = doc(
        "rows of plain text: rendered as a user and an assistant turn with the chat template (chat), or tokenized as "
        "they are with the end token appended to each completion, as TRL's DPOTrainer does (plain; finetune import "
        "sets it for such a baseline)", "chat")
    num_proc: Optional[int] = chat.num_proc_field()
    streaming: bool = chat.streaming_field()
    stream_block: int = chat.stream_block_field()


def validate(cfg, problems: list) -> None:
    m, d = cfg.model, cfg.data
    chat.validate_chat_model(m, problems)
    # Not a field range: whether label_smoothing may be set depends on loss_type.
    if m.label_smoothing and m.loss_type != "sigmoid":
        problems.append(f"model.label_smoothing: applies to loss_type sigmoid only (got loss_type {m.loss_type}); "
                        "set it to 0")
    chat.validate_source(d.source, "stdlib-pairs", problems)
    if d.streaming:
        chat.validate_streaming(d, problems)
        if m.precompute_ref_log_probs:
            problems.append("model.precompute_ref_log_probs: computes every pair's reference ahead, which a stream "
                            "does not read; set it to false with data.streaming")


# ---------------------------------------------------------------------------------------------------------------
# the default data: a function's own docstring against another function's


@functools.lru_cache(maxsize=1)
def stdlib_pairs() -> tuple:
    """Preference pairs from this interpreter's standard library (``chat.stdlib_qa``): for each question "what does
    ``f`` do?", chosen = the first paragraph of ``f``'s docstring, rejected = the first paragraph of another
    function's docstring (the next one in a seeded cycle through every question; never the same text).

    A fair preference: both answers are written by the same authors in the same style and drawn from the same
    length distribution, so neither length nor style nor fluency tells them apart — only whether the answer is
    about the function asked for. Returns ``({"prompt", "chosen", "rejected"}, …)`` in a fixed order.
    """
    rows = chat.stdlib_qa()
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    pairs = [None] * len(rows)
    for k, i in enumerate(order):
        step = 1
        while rows[order[(k + step) % len(rows)]]["completion"] == rows[i]["completion"]:
            step += 1  # a docstring shared by two functions (aliases, overloads) is no wrong answer
        other = rows[order[(k + step) % len(rows)]]
        pairs[i] = {"prompt": rows[i]["prompt"], "chosen": rows[i]["completion"], "rejected": other["completion"]}
    return tuple(pairs)


# ---------------------------------------------------------------------------------------------------------------
# rows → (prompt, chosen, rejected) messages


def _messages(value, what: str, roles=chat.ROLES) -> list:
    """A column as messages: text becomes one turn (user for the prompt, assistant for a completion)."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"has an empty {what!r}")
        return [{"role": "user" if what == "prompt" else "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what!r} must be text or a non-empty list of {{role, content}} messages")
    for j, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{what!r} message {j} is not a {{role, content}} mapping")
        if message["role"] not in roles:
            raise ValueError(f"{what!r} message {j} has unknown role {message['role']!r}; allowed: "
                             f"{', '.join(roles)}")
        if not isinstance(message["content"], str) or not message["content"].strip():
            raise ValueError(f"has an empty {what!r} (message {j} has no text)")
    return [{"role": x["role"], "content": x["content"]} for x in value]


def split_prompt(chosen, rejected) -> tuple:
    """TRL's ``extract_prompt``: the longest shared start of ``chosen`` and ``rejected`` (turns of two
    conversations, or characters of two texts, a space before the split going with the completions) is the prompt.
    Returns (prompt, chosen, rejected)."""
    idx = 0
    while idx < min(len(chosen), len(rejected)) and chosen[idx] == rejected[idx]:
        idx += 1
    if isinstance(chosen, str) and idx and idx < min(len(chosen), len(rejected)) and chosen[idx - 1] == " ":
        idx -= 1
    return chosen[:idx], chosen[idx:], rejected[idx:]


def to_pair(row, system_prompt: Optional[str] = None, plain: bool = False) -> tuple:
    """(prompt, chosen, rejected) message lists of a row — or three texts for a row of plain text with ``plain``
    (``data.text_rows: plain``); ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError("is not a mapping of columns")
    for key in ("chosen", "rejected"):
        if row.get(key) is None:
            raise ValueError(f"has no {key!r}")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if prompt is None:
        if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
            raise ValueError("has no 'prompt', and 'chosen' and 'rejected' are not two texts or two conversations")
        prompt, chosen, rejected = split_prompt(chosen, rejected)
        if not prompt:
            raise ValueError("has no 'prompt', and 'chosen' and 'rejected' share no start to take it from")
    if plain and all(isinstance(x, str) for x in (prompt, chosen, rejected)):  # TRL's non-conversational rows
        for what, text in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not text.strip():
                raise ValueError(f"has an empty {what!r}")
        return prompt, chosen, rejected
    prompt = _messages(prompt, "prompt")
    chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    for what, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1]["role"] != "assistant":
            raise ValueError(f"{what!r} does not end with an assistant turn (nothing to score)")
    if system_prompt and prompt[0]["role"] != "system":
        prompt.insert(0, {"role": "system", "content": system_prompt})
    return prompt, chosen, rejected


# ---------------------------------------------------------------------------------------------------------------
# pairs → token ids


def common_prefix_length(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_pair(tokenizer, prompt, chosen, rejected) -> dict:
    """Token ids as TRL 1.16 makes them: the prompt rendered with its generation prompt, each conversation rendered
    whole; a completion starts where its tokens leave the prompt's (``prompt_ids`` is that shared start). Three texts
    (``data.text_rows: plain``) are tokenized as they are, each completion ending in the end token, as TRL's
    DPOTrainer does with non-conversational rows."""
    def ids(messages, generation=False):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    if isinstance(prompt, str):
        eos = tokenizer.eos_token or ""
        ended = lambda text: text if text.endswith(eos) else text + eos  # noqa: E731
        prompt_ids, with_chosen, with_rejected = (tokenizer(t)["input_ids"] for t in
                                                  (prompt, prompt + ended(chosen), prompt + ended(rejected)))
    else:
        prompt_ids, with_chosen, with_rejected = ids(prompt, True), ids(prompt + chosen), ids(prompt + rejected)
    start = min(common_prefix_length(prompt_ids, with_chosen), common_prefix_length(prompt_ids, with_rejected))
    return {"prompt_ids": prompt_ids[:start], "chosen_ids": with_chosen[start:], "rejected_ids": with_rejected[start:]}


def sample_features():
    """The columns of the cached dpo table: each row's token ids, its length, whether it is dropped as too long or
    its completions are the same, and its refusal (empty when the row is fine)."""
    import datasets  # lazy: 0.6 s on `finetune validate`, which imports this module

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"prompt_ids": ids, "chosen_ids": ids, "rejected_ids": ids,
                              "length": datasets.Value("int32"), "dropped": datasets.Value("bool"),
                              "same": datasets.Value("bool"), "error": datasets.Value("string")})


def encode_row(tokenizer, row, i: int, d: DataConfig) -> dict:
    """Row ``i`` as a pair no longer than ``data.max_length`` (cut as ``data.too_long`` says, or marked dropped), or
    its one-line refusal."""
    empty = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "length": 0, "dropped": True, "same": False,
             "error": ""}
    try:
        sample = encode_pair(tokenizer, *to_pair(row, d.system_prompt, d.text_rows == "plain"))
    except ValueError as e:
        return {**empty, "error": f"data.source: {row_place(d.source, i)} {e}"}
    for key in ("chosen_ids", "rejected_ids"):
        if not sample[key]:
            return {**empty, "error": f"data.source: {row_place(d.source, i)} has an empty {key[:-4]!r} completion "
                                      "once tokenized (the template renders nothing after the prompt)"}
    room = d.max_length - len(sample["prompt_ids"])
    if max(len(sample["chosen_ids"]), len(sample["rejected_ids"])) > room:
        if d.too_long == "drop" or room <= 0:
            return empty
        # TRL cuts each row, prompt + completion, to its first max_length tokens
        sample = {**sample, **{k: sample[k][:room] for k in ("chosen_ids", "rejected_ids")}}
    length = len(sample["prompt_ids"]) + max(len(sample["chosen_ids"]), len(sample["rejected_ids"]))
    return {**sample, "length": length, "dropped": False, "same": sample["chosen_ids"] == sample["rejected_ids"],
            "error": ""}


def tokenized(tokenizer, table, d: DataConfig):
    """Every row of ``table`` encoded (``encode_row``), in its order: built once per data, tokenizer, template and
    the settings that shape a pair, and read memory-mapped from the cache afterwards."""
    how = tables.Encoding("dpo", lambda row, i: encode_row(tokenizer, row, i, d), sample_features(),
                          (d.max_length, d.too_long, d.system_prompt, d.text_rows), d.num_proc)
    return tables.encoded(table, d.source, tokenizer, how)


def placed(samples, split: str):
    """A part of the table whose every pair knows its place (``split``, ``index``): the precomputed reference
    log-probs are kept by it."""
    return tables.Tagged(samples, lambda i: {"split": split, "index": i})


def collate(pad_id: int):
    """``b`` pairs → one batch of ``2·b`` right-padded rows, the chosen completions first, then the rejected ones;
    labels -100 on the prompt and the padding. ``pairs`` (= b) is what the loop counts; ``index`` / ``split``
    find each pair's precomputed reference log-probs."""

    def fn(samples):
        rows = [s["prompt_ids"] + s["chosen_ids"] for s in samples] + \
               [s["prompt_ids"] + s["rejected_ids"] for s in samples]
        prompts = [len(s["prompt_ids"]) for s in samples] * 2
        labels = [[-100] * p + row[p:] for row, p in zip(rows, prompts)]
        return {"input_ids": right_pad(rows, pad_id), "attention_mask": attention_mask(rows),
                "labels": right_pad(labels, -100), "pairs": len(samples),
                "index": torch.tensor([s["index"] for s in samples]), "split": samples[0]["split"]}

    return fn


def count_pairs(batch) -> int:
    """The items of a DPO micro-batch: its pairs (not its 2·b sequences, not its tokens)."""
    return batch["pairs"]


# ---------------------------------------------------------------------------------------------------------------
# the losses (TRL 1.16's formulas)


def completion_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Completion tokens per row (the positions whose log-prob is summed)."""
    return (labels[:, 1:] != -100).sum(1).clamp(min=1)


def preference_loss(policy: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor, m: ModelConfig) -> dict:
    """Per-pair losses and rewards from ``[2·b]`` summed log-probs (chosen rows first) of the policy and the
    reference. Returns ``{"losses": [b], "chosen_rewards", "rejected_rewards", "chosen_logps",
    "rejected_logps"}`` (rewards: β × log-ratio, detached)."""
    chosen, rejected = policy.chunk(2)
    ref_chosen, ref_rejected = reference.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if m.loss_type == "sigmoid":  # TRL 1.16's sigmoid at ε = 0; with ε, conservative DPO (as TRL before 1.0)
        losses = -(1 - m.label_smoothing) * F.logsigmoid(m.beta * delta)
        if m.label_smoothing:
            losses = losses - m.label_smoothing * F.logsigmoid(-m.beta * delta)
    elif m.loss_type == "hinge":
        losses = torch.relu(1 - m.beta * delta)
    elif m.loss_type == "ipo":  # TRL: the log-ratios per completion token, so β means the same for any length
        length_chosen, length_rejected = completion_lengths(labels).chunk(2)
        losses = (chosen_ratio / length_chosen - rejected_ratio / length_rejected - 1 / (2 * m.beta)) ** 2
    else:
        raise ValueError(f"model.loss_type: {m.loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")
    return {"losses": losses, "chosen_rewards": m.beta * chosen_ratio.detach(),
            "rejected_rewards": m.beta * rejected_ratio.detach(), "chosen_logps": chosen.detach(),
            "rejected_logps": rejected.detach()}


def logged_means(out: dict) -> dict:
    """The step's logged terms: means over the micro-batch's pairs (the loop makes them window means)."""
    c, r = out["chosen_rewards"], out["rejected_rewards"]
    return {"rewards/chosen": c.mean(), "rewards/rejected": r.mean(), "rewards/accuracy": (c > r).float().mean(),
            "rewards/margin": (c - r).mean(), "logps/chosen": out["chosen_logps"].mean(),
            "logps/rejected": out["rejected_logps"].mean()}


# ---------------------------------------------------------------------------------------------------------------
# the reference


class Reference:
    """The reference model's summed completion log-probs of a batch, ``[2·b]``.

    * ``adapters``: the trained model itself with its LoRA adapters disabled (nothing copied);
    * ``copy``: a frozen copy of the untuned model (kept in ``dtype``; moved to the batch's device on first use);
    * ``precomputed``: looked up per sample (``index``, ``split``) in tensors filled once by ``precompute``. They are
      the task's state in checkpoints (``state_dict`` / ``load_state_dict``): a resumed run reads the saved numbers
      rather than recomputing them on another layout.
    """

    def __init__(self, kind: str, frozen: Optional[torch.nn.Module] = None, adapters: bool = False):
        self.kind = kind            # adapters | copy | precomputed
        self.frozen = frozen        # copy: the untuned model, frozen
        self.adapters = adapters    # precomputed: from the base under LoRA adapters (disabled while computing)
        self.cache: dict = {}       # precomputed: split → [samples, 2] (chosen, rejected)

    def __call__(self, model, batch) -> torch.Tensor:
        if self.kind == "precomputed":
            index = batch["index"]
            values = self.cache[batch["split"]]
            if values.device != index.device:  # once: the lookup then stays on the device, without a host sync
                values = self.cache[batch["split"]] = values.to(index.device)
            values = values[index]  # [b, 2]: chosen, rejected
            return torch.cat([values[:, 0], values[:, 1]])
        with torch.no_grad():
            if self.kind == "copy":
                device = batch["input_ids"].device
                if next(self.frozen.parameters()).device != device:
                    self.frozen.to(device)
                return model_sequence_log_probs(self.frozen, batch)
            return adapters_off_log_probs(model, batch)

    def precompute(self, model, samples_by_split: dict, collate_fn, device) -> None:
        """The reference log-probs of every sample, ``PRECOMPUTE_PAIRS`` pairs per forward, in eval mode."""
        model.to(device)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for split, samples in samples_by_split.items():
                values = torch.zeros(len(samples), 2, dtype=torch.float32)
                for start in range(0, len(samples), PRECOMPUTE_PAIRS):
                    batch = collate_fn([samples[i] for i in range(start, min(start + PRECOMPUTE_PAIRS,
                                                                                  len(samples)))])
                    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                    logps = adapters_off_log_probs(model, batch) if self.adapters else \
                        model_sequence_log_probs(model, batch)
                    values[start:start + len(logps) // 2] = torch.stack(logps.cpu().chunk(2), 1)
                self.cache[split] = values
        model.train(was_training)

    def state_dict(self) -> dict:
        return {f"ref_log_probs.{split}": values.cpu() for split, values in self.cache.items()}

    def load_state_dict(self, state: dict) -> None:
        self.cache = {key.split(".", 1)[1]: values.float().cpu() for key, values in state.items()}


def adapters_off_log_probs(model, batch) -> torch.Tensor:
    """Log-probs of the base under a peft model: its adapters disabled, in eval mode, outside DDP (no gradient)."""
    peft_model = extract_model_from_parallel(model)
    was_training = peft_model.training
    peft_model.eval()
    try:
        with torch.no_grad(), peft_model.disable_adapter():
            return model_sequence_log_probs(peft_model, batch)
    finally:
        peft_model.train(was_training)


# ---------------------------------------------------------------------------------------------------------------
# the job


def make_loss_fn(m: ModelConfig, reference: Reference):
    def loss_fn(model, batch):
        """Mean preference loss over the micro-batch's pairs, the logged means, and per-pair rewards (for
        evaluation). Chosen and rejected go through the model in one forward."""
        policy = model_sequence_log_probs(model, batch)
        out = preference_loss(policy, reference(model, batch), batch["labels"], m)
        per_pair = torch.stack([out["chosen_rewards"], out["rejected_rewards"], out["chosen_logps"],
                                out["rejected_logps"]], 1)
        return {"loss": out["losses"].mean(), **logged_means(out), "per_pair": per_pair}

    return loss_fn


def eval_step(model, batch, outputs):
    """Per held-out pair: (chosen reward, rejected reward, chosen log-prob, rejected log-prob)."""
    rows = outputs["per_pair"].float().cpu().tolist()
    return rows, [None] * len(rows)


def held_out_metrics(preds: list, refs: list) -> dict:
    """Reward accuracy and margin over every held-out pair (and the policy's own preference by log-prob, which is
    informative at step 0, where every reward is 0)."""
    p = torch.tensor(preds, dtype=torch.float64)
    return {"rewards/accuracy": float((p[:, 0] > p[:, 1]).double().mean()),
            "rewards/margin": float((p[:, 0] - p[:, 1]).mean()),
            "rewards/chosen": float(p[:, 0].mean()), "rewards/rejected": float(p[:, 1].mean()),
            "logps/accuracy": float((p[:, 2] > p[:, 3]).double().mean())}


REFERENCES = {"adapters": "the base with the adapters disabled", "copy": "a frozen copy of the untuned model",
              "precomputed": "log-probs precomputed at set-up"}


def reference_kind(cfg) -> str:
    if cfg.model.precompute_ref_log_probs:
        return "precomputed"
    return "adapters" if cfg.peft.enabled else "copy"


def make_reference(cfg, untuned) -> Reference:
    """The reference of ``reference_kind``: for ``copy``, a frozen copy of the untuned model, taken before anything
    trains."""
    kind = reference_kind(cfg)
    frozen = chat.frozen_copy(untuned, precision.DTYPES[cfg.model.dtype]) if kind == "copy" else None
    return Reference(kind, frozen, adapters=cfg.peft.enabled)


def load_rows(d: DataConfig):
    """The data source's rows as a ``datasets.Dataset``, in its order; one line, before any row is encoded, when they
    lack a pair's columns (``finetune import`` checks its ``--data`` with it too)."""
    if d.source == "stdlib-pairs":
        return chat.builtin_table(stdlib_pairs())
    table = chat.load_table(d.source, d.split)
    require_columns(table, d.source, "dpo", (("chosen", "rejected"),))  # the prompt may be their shared start
    return table


def tokenized_data(tokenizer, d: DataConfig, main: bool) -> chat.TrainingData:
    """The data source's pairs tokenized into the cache, split and the longer ones dropped or cut. Warns about pairs
    whose completions are the same (once, on the ``main`` process)."""
    samples = tokenized(tokenizer, load_rows(d), d)
    val_size, held_out_note = chat.held_out_size(len(samples), d, "stdlib-pairs")
    if held_out_note and main:
        print(held_out_note, flush=True)
    train, val, dropped_train, dropped_val = chat.parts(samples, d, val_size)
    if not len(train):
        raise ConfigError(f"data.max_length: every training pair is longer than {d.max_length} tokens")
    lengths = tables.column(train, "length")
    same = int(tables.column(train, "same").sum() + tables.column(val, "same").sum())
    if same and main:
        print(f"warning: data.source: {same} pairs have chosen identical to rejected; kept (they add no gradient but "
              "count as pairs, as in TRL)", file=sys.stderr, flush=True)
    note = (f"{len(samples)} pairs from {d.source}: {len(train)} train, {len(val)} held out; "
            f"{dropped_train + dropped_val} longer than data.max_length={d.max_length} tokens dropped")
    return chat.TrainingData(train, val if len(val) else None, lambda i: int(lengths[i]), note)


def build(cfg, ctx: TaskContext) -> Job:
    m, d = cfg.model, cfg.data
    tokenizer = chat.load_tokenizer(m)
    # made before the model loads: a bad row is refused first
    data = chat.streamed(d, lambda row, i: encode_row(tokenizer, row, i, d), "pairs") if d.streaming else \
        tokenized_data(tokenizer, d, ctx.main)
    train, val = placed(data.train, "train"), placed(data.val, "val") if data.val is not None else None
    model, reference = chat.tuned_model(cfg, tokenizer, lambda untuned: make_reference(cfg, untuned))
    collate_fn = collate(tokenizer.pad_token_id)
    if reference.kind == "precomputed":
        reference.precompute(model, {"train": train, "val": val or []}, collate_fn, ctx.device)
    if ctx.main:
        print(f"dpo: {data.note}; {m.loss_type} loss, beta {m.beta}; reference: {REFERENCES[reference.kind]}",
              flush=True)
    return Job(
        model=model, train_data=train, val_data=val, tokenizer=tokenizer, collate_fn=collate_fn,
        loss_fn=make_loss_fn(m, reference), count_items=count_pairs, eval_step=eval_step,
        compute_metrics=held_out_metrics, length_of=data.length_of, stream_block=data.stream_block,
        save=peft_save_hook(cfg, tokenizer), checkpointed=[reference] if reference.kind == "precomputed" else [],
    )
