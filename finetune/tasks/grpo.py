"""GRPO: online RL on a chat model with verifiable rewards, each optimizer step the step of the big batch.

A *generation batch* is ``generation_batch_size`` completions (TRL's name and unit; null: the effective batch, one
generation per optimizer step as at TRL's defaults): ``num_generations`` sampled completions for each of its prompts,
scored by the reward functions, their advantages normalised per prompt group. It is then trained for
``num_iterations × generation_batch_size / effective`` optimizer steps, each over ``effective`` completions (the
shared loop's window). It belongs to the run being reproduced: neither the micro-batch nor the process count moves
it, so every layout of the run takes the same rollouts and steps. Every loss type is defined by its loss over one
optimizer step's completions — all of them, on every process — and finetune's window weighting
(``steps.loss_weight``) makes ``(b, N)`` take that step:

* ``grpo``: the mean over completions of each completion's mean token loss (the item: a completion);
* ``bnpo`` / ``dapo``: the sum of token losses over the step's completion tokens divided by their number (the item:
  a completion token) — at the big batch the two are one loss; they differ in the peers only in where a
  micro-batch's normaliser breaks accumulation;
* ``dr_grpo``: the sum of token losses divided by ``completions × max_completion_length`` (the item: a completion,
  worth ``max_completion_length`` token slots).

The token loss is PPO's clipped surrogate, ``−min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A)`` with ``ρ = exp(logp − old)``,
plus ``β`` times the k3 estimate of the KL to the reference, as TRL 1.16 writes them (docs/grpo.md).

The loop's windows run in order over a virtual sequence of completion slots (``RolloutSlots``); the collate keeps
only slot numbers, and ``before_window`` generates a generation batch when the next window needs one, so a window's
micro-batches read the rollouts at their forward. Generation never depends on the training split: every process
generates the whole batch, in chunks of ``generation_chunk`` prompts, each chunk seeded from (seed, epoch, batch,
chunk), with the random state of training put back afterwards.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Optional

import numpy as np
import torch
from accelerate.utils import gather_object

from finetune import tables
from finetune.config import BaseDataConfig
from finetune.data import require_columns, split_samples
from finetune.errors import ConfigError
from finetune.job import CompareHints, Job, TaskContext
from finetune.models.forward import shards_weights
from finetune.models.hf import peft_save_hook
from finetune.schema import doc
from finetune.seeding import permutation, step_seed
from finetune.tasks import chat

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


# What compare and reproduce know of this task. Its loss is a sum of centred advantages times ratios near 1: it sums
# to about 0 (1e-8 at a first step), where a relative difference is rounding over nothing, so the loss layer is judged
# relative to max(|a|, |b|, 1e-3), i.e. to 1e-7 absolute at the fp32 tolerance (tests/test_grpo.py plants a 1e-6
# difference that it must still catch). A GRPOTrainer folder holds num_generations beside DPO's beta and loss_type.
COMPARE_HINTS = CompareHints(
    step_settings=tuple(f"model.{name}" for name in (
        "beta", "loss_type", "num_generations", "num_iterations", "epsilon", "epsilon_high", "temperature", "top_p",
        "max_completion_length", "scale_rewards", "reward_weights", "use_bias_correction_kl",
        "generation_batch_size")),
    loss_atol=1e-3, base_recipe="grpo-smollm2", trl_marks=("beta", "loss_type", "num_generations"),
    log_marks=("reward_std",), arg_marks=("num_generations", "reward_funcs", "reward_weights", "scale_rewards",
                                          "steps_per_generation", "epsilon_high"),
    objective_names=("grpo", "GRPOLoss", "GRPOSimpleLoss", "GRPOCompletionLoss", "GRPOConfig"))


@dataclass
class ModelConfig(chat.ChatModelConfig):
    # finetune's steps_per_generation counted optimizer steps and defaulted to N, so the rollouts followed the
    # micro-batch; TRL's field of that name counts micro-batches. Neither belongs to the run, so it is refused.
    RETIRED: ClassVar[dict] = {"steps_per_generation": (
        "replaced by model.generation_batch_size, in completions (your steps_per_generation × the effective batch; "
        "null: the effective batch), which no micro-batch or process count changes")}
    # training.rollouts was a shared key only grpo read; a recipe that still gives it there is carried here, with a
    # note, for a release (config.carry_moved)
    MOVED: ClassVar[dict] = {"rollouts": "training.rollouts"}
    reward_funcs: list = doc(
        "reward functions, each 'module:function' or 'path/to/file.py:function', called as TRL calls its "
        "reward_funcs: f(prompts=…, completions=…, completion_ids=…, **extra columns) → one float per completion",
        dataclasses.MISSING, default_factory=lambda: ["finetune.tasks.grpo:sum_reward"])
    reward_weights: Optional[list] = doc("weight of each reward function (null: 1 each)", None)
    num_generations: int = doc("completions sampled per prompt (the group its advantages are normalised in)", 4,
                               at_least=2)
    generation_batch_size: Optional[int] = doc(
        "completions sampled and scored together, then trained on for generation_batch_size / effective batch "
        "optimizer steps (TRL's generation_batch_size); a multiple of the effective batch. null: the effective batch "
        "(one generation per optimizer step, TRL's default)", None, at_least=1)
    num_iterations: int = doc("times each generation batch is trained on (μ)", 1, at_least=1)
    temperature: float = doc("sampling temperature (also divides the logits of every log-prob)", 1.0, above=0)
    top_p: float = doc("nucleus sampling: keep the smallest set of tokens with this much probability", 1.0,
                       above=0, at_most=1)
    max_completion_length: int = doc("tokens sampled per completion at most", 16, at_least=1)
    epsilon: float = doc("clipping ε of the ratio (lower side)", 0.2, at_least=0)
    epsilon_high: Optional[float] = doc("clipping ε of the ratio's upper side (null: epsilon)", None, at_least=0)
    beta: float = doc("weight of the KL to the reference model (0: no reference kept, as TRL's default)", 0.0,
                      at_least=0)
    use_bias_correction_kl: bool = doc(
        "multiply each token's KL by its importance ratio (TRL 1.16's default: the unbiased reverse-KL gradient); "
        "only with beta > 0", True)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = doc(
        "how token losses are averaged over an optimizer step's completions (module docstring; docs/grpo.md)",
        "dapo")
    scale_rewards: Literal["group", "batch", "none"] = doc(
        "advantage = reward − its group's mean, divided by the group's std (group), the generation batch's std "
        "(batch), or nothing (none)", "group")
    generation_chunk: int = doc("prompts generated together: fixed, so completions never depend on the training "
                                "split", 8, at_least=1)
    max_prompt_length: int = doc("longest prompt in tokens (with its chat template); longer ones are refused", 128,
                                 at_least=1)
    rollouts: Optional[str] = doc(
        "a run's rollouts.jsonl to train on instead of generating (replays that run's rollouts, so that its steps "
        "can be reproduced exactly); null: generate", None)


@dataclass
class DataConfig(BaseDataConfig):
    source: str = doc("'sums' (arithmetic prompts with an answer column), or a jsonl / json / parquet / csv file, "
                      "a datasets.save_to_disk folder or a hub dataset id with a prompt column (text or messages) "
                      "and any other columns the reward functions read", "sums")
    split: str = chat.split_field()
    system_prompt: Optional[str] = chat.system_prompt_field()
    count: int = doc("prompts 'sums' makes", 200)
    max_operand: int = doc("largest operand of 'sums' (operands from 1; smaller ones are easier sums)", 49,
                           at_least=1)
    num_proc: Optional[int] = chat.num_proc_field()


def validate(cfg, problems: list) -> None:
    m, d = cfg.model, cfg.data
    chat.validate_chat_model(m, problems)
    if not m.reward_funcs:
        problems.append("model.reward_funcs: give at least one 'module:function'")
    if m.reward_weights is not None and len(m.reward_weights) != len(m.reward_funcs or []):
        problems.append(f"model.reward_weights: {len(m.reward_weights)} weights for {len(m.reward_funcs or [])} "
                        "reward functions; give one each, or null")
    chat.validate_source(d.source, "sums", problems)


# ---------------------------------------------------------------------------------------------------------------
# prompts and rewards


def sums(count: int, seed: int = 0, max_operand: int = 49) -> list:
    """Arithmetic prompts ("What is 12 plus 7?"), operands 1 to ``max_operand``, with their ``answer``: a reward a
    program can check."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        a, b = (int(x) for x in torch.randint(1, max_operand + 1, (2,), generator=g))
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} plus {b}? Answer with the number only."}],
                     "answer": str(a + b)})
    return rows


def completion_text(completion) -> str:
    """A completion's text: TRL passes conversational completions as ``[{"role": "assistant", "content": …}]``."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def sum_reward(prompts, completions, answer, **_) -> list:
    """1 when the completion's first number is the answer, 0.2 when it holds a number at all, else 0."""
    scores = []
    for completion, right in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion_text(completion))
        scores.append(1.0 if numbers and numbers[0] == str(right) else 0.2 if numbers else 0.0)
    return scores


def stated_sum(text: str):
    """The number a completion gives as its answer: the one after its first "=" ("7 + 4 = 11"), else its first
    number ("11", "The answer is 11."); None when it holds no number."""
    after = re.search(r"=\s*(-?\d+)", text)
    numbers = re.findall(r"-?\d+", text)
    return after.group(1) if after else numbers[0] if numbers else None


def answer_reward(prompts, completions, answer, **_) -> list:
    """1 when the completion gives the right sum (``stated_sum``: "11", "7 + 4 = 11"), 0.1 when it gives another
    number, else 0: it pays for correctness, not for a format, so one number for every prompt earns little."""
    scores = []
    for completion, right in zip(completions, answer):
        said = stated_sum(completion_text(completion))
        scores.append(1.0 if said == str(right) else 0.1 if said is not None else 0.0)
    return scores


def load_reward(spec: str):
    """The function ``spec`` names: 'package.module:function' or 'path/to/file.py:function'."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"model.reward_funcs: {spec!r} is not 'module:function' or 'file.py:function'")
    try:
        if where.endswith(".py"):
            loader = importlib.util.spec_from_file_location(Path(where).stem, Path(where).expanduser())
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        return getattr(module, name)
    except Exception as error:  # the user's module: any failure to load it is bad input
        raise ConfigError(f"model.reward_funcs: cannot load {spec!r} ({type(error).__name__}: "
                          f"{str(error).splitlines()[0][:160] if str(error) else ''})") from None


def load_rewards(m: ModelConfig) -> list:
    """(spec, function, weight) for each reward function, loaded once."""
    return [(spec, load_reward(spec), w) for spec, w in zip(m.reward_funcs, m.reward_weights or
                                                              [1.0] * len(m.reward_funcs))]


def score(funcs: list, prompts: list, texts: list, completion_ids: list) -> list:
    """Weighted sum of the reward functions, one float per completion, called with TRL's arguments: ``prompts``
    (one prompt entry per completion) as given, the completions as text or, for a conversational prompt, as
    ``[{"role": "assistant", …}]``, and every other column of the prompt's row; a wrong count is refused."""
    conversational = isinstance(prompts[0]["prompt"], list)
    completions = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
    extras = {k: [p["row"][k] for p in prompts] for k in prompts[0]["row"] if k != "prompt"}
    total = [0.0] * len(completions)
    for spec, f, w in funcs:
        got = list(f(prompts=[p["prompt"] for p in prompts], completions=completions, completion_ids=completion_ids,
                     **extras))
        if len(got) != len(completions):
            raise ConfigError(f"model.reward_funcs: {spec} returned {len(got)} rewards for {len(completions)} "
                              "completions; return one float per completion")
        total = [t + w * float(r) for t, r in zip(total, got)]
    return total


def advantages(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Group-normalised advantages (TRL's): reward − its group's mean, over the group's (or batch's) std + 1e-4."""
    grouped = rewards.view(-1, group)
    centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "group":
        return centred / (grouped.std(1).repeat_interleave(group) + 1e-4)
    if scale == "batch":
        return centred / (rewards.std() + 1e-4)
    return centred


# ---------------------------------------------------------------------------------------------------------------
# the rollouts: a generation batch, and the slots the loop's windows run over


@dataclass(frozen=True)
class GenerationSchedule:
    """When the run generates and which completion each slot trains on: ``effective`` completions a step,
    ``per_generation`` steps a generation batch, ``iterations`` passes over it, ``group`` completions a prompt."""

    prompts: int
    effective: int
    per_generation: int
    iterations: int
    group: int

    @property
    def batch_completions(self) -> int:
        return self.per_generation * self.effective

    @property
    def batch_prompts(self) -> int:
        return self.batch_completions // self.group

    def locate(self, slot: int) -> tuple[int, int]:
        """(generation batch, completion within it) of an epoch's completion slot."""
        span = self.batch_completions * self.iterations
        batch, offset = divmod(slot, span)
        size = min(self.batch_prompts, self.prompts - batch * self.batch_prompts) * self.group
        return batch, offset % size

    def __len__(self) -> int:
        return self.prompts * self.group * self.iterations


class RolloutSlots(torch.utils.data.Dataset):
    """The training set the loop sees: one slot per completion trained on, in order; a sample is its slot number."""

    def __init__(self, schedule: GenerationSchedule):
        self.schedule = schedule

    def __len__(self) -> int:
        return len(self.schedule)

    def __getitem__(self, i: int) -> dict:
        return {"slot": i}


def collate_slots(samples: list) -> dict:
    return {"slot": torch.tensor([s["slot"] for s in samples])}


class Rollouts:
    """The current generation batch, made by ``generate`` and read by the loss; its tensors are saved with every
    checkpoint (``Job.checkpointed``), so that a resumed run trains on the very rollouts it left."""

    def __init__(self):
        self.key = (-1, -1)         # (epoch, generation batch)
        self.samples: list = []     # per completion: ids, prompt_length, advantage, old / ref log-probs, reward
        self.log: list = []         # every generation batch's record, written to rollouts.jsonl

    def state_dict(self) -> dict:
        if not self.samples:
            return {"key": torch.tensor(self.key)}
        s = self.samples
        return {"key": torch.tensor(self.key), "ids": pad([x["ids"] for x in s]),
                "lengths": torch.tensor([len(x["ids"]) for x in s]),
                "prompt_lengths": torch.tensor([x["prompt_length"] for x in s]),
                "advantage": torch.tensor([x["advantage"] for x in s], dtype=torch.float64),
                "reward": torch.tensor([x["reward"] for x in s], dtype=torch.float64),
                "old": pad([x["old"] for x in s]), "ref": pad([x["ref"] for x in s])}

    def load_state_dict(self, state: dict) -> None:
        self.key = tuple(int(k) for k in state["key"])
        self.samples = [] if "ids" not in state else [
            {"ids": state["ids"][i, :n], "prompt_length": int(p), "advantage": float(a), "reward": float(r),
             "old": state["old"][i, :n - int(p)], "ref": state["ref"][i, :n - int(p)]}
            for i, (n, p, a, r) in enumerate(zip(state["lengths"].tolist(), state["prompt_lengths"].tolist(),
                                                 state["advantage"].tolist(), state["reward"].tolist()))]


def pad(rows: list, device=None) -> torch.Tensor:
    """Rows of different lengths, right-padded with zeros into one tensor (on ``device``)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True).to(device)


def token_log_probs(model, ids: list, prompt_lengths: list, temperature: float, device) -> list:
    """Each sequence's completion-token log-probs under ``model`` (logits divided by ``temperature``), one padded
    forward for the given sequences."""
    batch, mask = pad(ids, device), pad([torch.ones_like(x) for x in ids], device)
    logits = model(input_ids=batch, attention_mask=mask, use_cache=False).logits[:, :-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(-1, batch[:, 1:, None]).squeeze(-1)
    return [logps[i, p - 1:len(x) - 1] for i, (x, p) in enumerate(zip(ids, prompt_lengths))]


# ---------------------------------------------------------------------------------------------------------------
# the loss


def token_losses(m: ModelConfig, logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, adv: torch.Tensor):
    """(PPO-clipped surrogate + β·KL per token, KL per token, clipped or not per token)."""
    ratio = torch.exp(logps - old)
    high = m.epsilon if m.epsilon_high is None else m.epsilon_high
    clipped = torch.clamp(ratio, 1 - m.epsilon, 1 + high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    kl = torch.exp(ref - logps) - (ref - logps) - 1 if m.beta else torch.zeros_like(logps)
    if m.beta and m.use_bias_correction_kl:
        kl = kl * ratio
    return loss + m.beta * kl, kl, (ratio != clipped).float()


def reduce(m: ModelConfig, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as the mean over its items (``count_items``): completions (grpo, dr_grpo) or
    completion tokens (bnpo, dapo), so that the window's weighting gives the step's loss."""
    if m.loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1)).mean()
    if m.loss_type == "dr_grpo":
        return (per_token * mask).sum() / (mask.shape[0] * m.max_completion_length)
    return (per_token * mask).sum() / mask.sum()


def make_count(m: ModelConfig, rollouts: Rollouts, schedule: GenerationSchedule):
    def count(batch) -> int:
        if "slot" not in batch:  # held-out prompts
            return len(batch["prompts"])
        if m.loss_type in ("grpo", "dr_grpo"):
            return len(batch["slot"])
        samples = [rollouts.samples[schedule.locate(s)[1]] for s in batch["slot"].tolist()]
        return sum(len(x["ids"]) - x["prompt_length"] for x in samples)
    return count


def make_loss_fn(m: ModelConfig, rollouts: Rollouts, schedule: GenerationSchedule, reward_eval):
    def loss_fn(model, batch):
        if "slot" not in batch:
            return reward_eval(model, batch)
        samples = [rollouts.samples[schedule.locate(s)[1]] for s in batch["slot"].tolist()]
        device = batch["slot"].device
        logps = token_log_probs(model, [x["ids"] for x in samples], [x["prompt_length"] for x in samples],
                                m.temperature, device)
        mask = pad([torch.ones(len(x)) for x in logps], device)
        adv = torch.tensor([x["advantage"] for x in samples], device=device)[:, None]
        per_token, kl, clipped = token_losses(m, pad(logps), pad([x["old"] for x in samples], device),
                                              pad([x["ref"] for x in samples], device), adv)
        return {"loss": reduce(m, per_token, mask), "kl": reduce(m, kl, mask).detach(),
                "clip_ratio": reduce(m, clipped, mask).detach()}
    return loss_fn


# ---------------------------------------------------------------------------------------------------------------
# generation


@dataclass(frozen=True)
class Drawn:
    """What a ``Generator`` draws its generation batches from and scores them with: the training prompts, the
    schedule of generation batches, the reward functions, the reference model (None without a KL term) and a
    baseline's rollouts to replay (``model.rollouts``, read before the model loaded; None: generate)."""

    prompts: Prompts
    schedule: GenerationSchedule
    funcs: list
    reference: object = None
    replay: Optional[dict] = None


class Generator:
    """Makes the generation batch a window needs (``before_window``): each process generates its share of the
    chunks, and every process ends up holding the whole batch (``shared_chunks``) in ``rollouts``."""

    def __init__(self, m: ModelConfig, ctx: TaskContext, model, tokenizer, drawn: Drawn, rollouts: Rollouts):
        self.m, self.seed, self.model, self.tokenizer = m, ctx.seed, model, tokenizer
        # where this process generates and its share of the chunks; agree: a refusal stops every process alike
        self.device, self.processes, self.rank, self.agree = ctx.device, ctx.processes, ctx.rank, ctx.agree
        self.prompts, self.schedule, self.rollouts = drawn.prompts, drawn.schedule, rollouts
        self.funcs, self.reference = drawn.funcs, drawn.reference
        self.replay_path, self.replay = m.rollouts, drawn.replay

    def before_window(self, state) -> None:
        batch, _ = self.schedule.locate(state.next_window * self.schedule.effective)
        if self.rollouts.key != (state.epoch, batch):
            self.generate(state.epoch, batch)

    @torch.no_grad()
    def generate(self, epoch: int, batch: int) -> None:
        order = permutation(len(self.prompts), self.seed, epoch)
        L = self.schedule
        chosen = [self.prompts[i] for i in order[batch * L.batch_prompts:(batch + 1) * L.batch_prompts]]
        if self.replay is not None:
            return self.replayed(epoch, batch, chosen)
        was_training = self.model.training
        self.model.eval()
        samples = self.shared_chunks(epoch, batch, chosen)
        self.model.train(was_training)
        rewards = [x["reward"] for x in samples]
        adv = advantages(torch.tensor(rewards, dtype=torch.float64), L.group, self.m.scale_rewards)
        for x, a in zip(samples, adv.tolist()):
            x["advantage"] = a
        self.rollouts.key, self.rollouts.samples = (epoch, batch), samples
        self.rollouts.log.append({"epoch": epoch, "batch": batch, "prompts": [p["id"] for p in chosen],
                                  "completions": [x["ids"][x["prompt_length"]:].tolist() for x in samples],
                                  "rewards": rewards, "advantages": adv.tolist(),
                                  "old_log_probs": [x["old"].tolist() for x in samples],
                                  **({"ref_log_probs": [x["ref"].tolist() for x in samples]} if self.m.beta else {})})

    def shared_chunks(self, epoch: int, batch: int, chosen: list) -> list:
        """The generation batch's completions, each scored and with its old (and reference) log-probs, in prompt
        order. Its chunks of ``generation_chunk`` prompts are dealt round-robin to the processes and gathered: a
        chunk's sampling is seeded from (seed, epoch, batch, chunk) alone and its log-probs are taken on the same
        weights on every process, so the batch is the same on any number of processes. With sharded weights
        (ZeRO-3, FSDP2) every process generates every chunk: each decoding step gathers weights from all of them."""
        device, world, rank = self.device, self.processes, self.rank
        if shards_weights(self.model):
            world, rank = 1, 0
        starts = list(range(0, len(chosen), self.m.generation_chunk))
        mine = starts[rank::world]

        def make() -> list:  # a refusal (a reward function's wrong count) stops every process alike
            made = []
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                for c in mine:
                    torch.manual_seed(step_seed(self.seed, epoch, batch, c) % 2**63)
                    part = self.sample(chosen[c:c + self.m.generation_chunk], device)
                    for x, r in zip(part, self.rewards(part)):
                        x["reward"] = r
                    self.log_probs(part, device)
                    made.append((c, part))
            return made

        made = self.agree(make)
        if world > 1:
            made = gather_object(made)
        return [x for _, part in sorted(made, key=lambda m: m[0]) for x in part]

    def replayed(self, epoch: int, batch: int, chosen: list) -> None:
        """The generation batch as the recorded run made it: its completions, rewards, advantages and log-probs."""
        record = self.replay.get((epoch, batch))
        if record is None:
            raise ConfigError(f"model.rollouts: {self.replay_path} holds no generation batch {batch} of epoch "
                              f"{epoch} (it holds {len(self.replay)}); train no further than the recorded run")
        if record["prompts"] != [p["id"] for p in chosen]:
            raise ConfigError(f"model.rollouts: {self.replay_path} batch {batch} of epoch {epoch} holds prompts "
                              f"{record['prompts'][:4]}…, this run's are {[p['id'] for p in chosen][:4]}…; replay "
                              "with the recorded run's data, seed and effective batch")
        prompts = [p for p in chosen for _ in range(self.schedule.group)]
        ref = record.get("ref_log_probs") or [[0.0] * len(c) for c in record["completions"]]
        samples = [{"ids": torch.tensor(p["ids"] + c), "prompt_length": len(p["ids"]), "prompt": p, "reward": r,
                    "advantage": a, "old": torch.tensor(o, dtype=torch.float32),
                    "ref": torch.tensor(f, dtype=torch.float32)}
                   for p, c, r, a, o, f in zip(prompts, record["completions"], record["rewards"], record["advantages"],
                                               record["old_log_probs"], ref)]
        self.rollouts.key, self.rollouts.samples = (epoch, batch), samples
        self.rollouts.log.append(record)

    def sample(self, prompts: list, device) -> list:
        """``num_generations`` completions of each prompt (left-padded together), cut after their end token."""
        gen = chat.generation_config(self.model, self.tokenizer, self.m.max_completion_length)
        gen.update(do_sample=True, temperature=self.m.temperature, top_p=self.m.top_p, top_k=0,
                   num_return_sequences=self.schedule.group)
        longest = max(len(p["ids"]) for p in prompts)
        ids = torch.full((len(prompts), longest), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p["ids"]):] = torch.as_tensor(p["ids"])
            mask[i, longest - len(p["ids"]):] = 1
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen,
                                  synced_gpus=shards_weights(self.model)).cpu()
        ends = set(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
        samples = []
        for row, p in zip(out, [p for p in prompts for _ in range(self.schedule.group)]):
            completion = row[longest:].tolist()
            stop = next((i + 1 for i, t in enumerate(completion) if t in ends), len(completion))
            samples.append({"ids": torch.tensor(p["ids"] + completion[:stop]), "prompt_length": len(p["ids"]),
                            "prompt": p})
        return samples

    def rewards(self, samples: list) -> list:
        ids = [x["ids"][x["prompt_length"]:].tolist() for x in samples]
        texts = [self.tokenizer.decode(i, skip_special_tokens=True) for i in ids]
        return score(self.funcs, [x["prompt"] for x in samples], texts, ids)

    def log_probs(self, samples: list, device) -> None:
        """The policy's (old) and the reference's log-probs of every completion token, a chunk of sequences at a
        time (fixed, so they do not depend on the training split)."""
        chunk = self.m.generation_chunk * self.schedule.group
        for c in range(0, len(samples), chunk):
            part = samples[c:c + chunk]
            ids, lengths = [x["ids"] for x in part], [x["prompt_length"] for x in part]
            old = token_log_probs(self.model, ids, lengths, self.m.temperature, device)
            ref = self.reference(ids, lengths, device) if self.m.beta else [torch.zeros_like(o) for o in old]
            for x, o, r in zip(part, old, ref):
                x["old"], x["ref"] = o.cpu(), r.cpu()


def read_rollouts(path) -> dict:
    """(epoch, generation batch) → its record, from a run's rollouts.jsonl; one line when it cannot be read."""
    try:
        records = [json.loads(line) for line in Path(path).expanduser().read_text().splitlines() if line.strip()]
        return {(r["epoch"], r["batch"]): r for r in records}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"model.rollouts: cannot read {path} as a run's rollouts.jsonl "
                          f"({type(error).__name__}: {str(error)[:120]})") from None


def make_reference(m: ModelConfig, model, peft_enabled: bool):
    """The reference's token log-probs: the base with the adapters off (LoRA), or a frozen copy."""
    if not m.beta:
        return None

    copy = None if peft_enabled else chat.frozen_copy(model, torch.float32)

    def reference(ids, lengths, device):
        if copy is None:
            with model.disable_adapter():
                return token_log_probs(model, ids, lengths, m.temperature, device)
        return token_log_probs(copy.to(device), ids, lengths, m.temperature, device)
    return reference


# ---------------------------------------------------------------------------------------------------------------
# held-out reward


def make_reward_eval(m: ModelConfig, tokenizer, funcs: list):
    """Validation: greedy completions of the held-out prompts, scored; the "loss" is minus their mean reward."""

    def reward_eval(model, batch):
        prompts = batch["prompts"]
        texts = chat.answer(model, tokenizer, [p["ids"] for p in prompts], m.max_completion_length)
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        rewards = score(funcs, prompts, texts, ids)
        return {"loss": -torch.tensor(rewards).mean(), "reward": torch.tensor(rewards).mean()}
    return reward_eval


def eval_step(model, batch, outputs):
    return [float(outputs["reward"])] * len(batch["prompts"]), [None] * len(batch["prompts"])


def held_out_metrics(preds: list, refs: list) -> dict:
    return {"reward": sum(preds) / len(preds)}


# ---------------------------------------------------------------------------------------------------------------
# build


def load_rows(d: DataConfig):
    """The data source's rows as a ``datasets.Dataset``, in its order; one line, before any prompt is encoded, when
    there is no prompt column (``finetune import`` checks its ``--data`` with it too)."""
    if d.source == "sums":
        return chat.builtin_table(sums(d.count, max_operand=d.max_operand))
    rows = chat.load_table(d.source, d.split)
    require_columns(rows, d.source, "grpo", (("prompt",),))
    return rows


def prompt_ids(tokenizer, prompt, system_prompt: Optional[str]) -> list:
    """A prompt's token ids: a conversation rendered with the chat template and its generation prompt (and the system
    message when it has none), a text as it is."""
    if isinstance(prompt, list):
        messages = prompt if not system_prompt or prompt[0].get("role") == "system" else \
            [{"role": "system", "content": system_prompt}, *prompt]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def tokenized(tokenizer, rows, d: DataConfig):
    """Every prompt of ``rows`` as token ids, in order: built once per data, tokenizer, template and system prompt,
    and read memory-mapped from the cache afterwards."""
    import datasets  # lazy: 0.6 s on `finetune validate`, which imports this module

    def encode(row: dict, i: int) -> dict:
        ids = prompt_ids(tokenizer, row["prompt"], d.system_prompt)
        return {"ids": ids, "length": len(ids), "error": ""}

    features = datasets.Features({"ids": datasets.List(datasets.Value("int32")), "length": datasets.Value("int32"),
                                  "error": datasets.Value("string")})
    return tables.encoded(rows, d.source, tokenizer, tables.Encoding("grpo", encode, features, (d.system_prompt,),
                                                                     d.num_proc))


class Prompts(torch.utils.data.Dataset):
    """A part of the prompt table as the generator reads it: entry ``k`` is ``{"id", "ids", "prompt", "row"}`` (its
    number in the run, token ids, prompt and whole row, whose other columns go to the reward functions), read from
    the tables when asked for."""

    def __init__(self, rows, tokens, part: list, first_id: int = 0):
        self.rows, self.tokens, self.first_id = rows.select(part), tokens.select(part), first_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, k: int) -> dict:
        row = self.rows[k]
        return {"id": self.first_id + k, "ids": self.tokens[k]["ids"], "prompt": row["prompt"], "row": row}

    def check_length(self, m: ModelConfig) -> None:
        """One line naming the first prompt longer than ``model.max_prompt_length`` tokens."""
        lengths = tables.column(self.tokens, "length")
        longer = np.flatnonzero(lengths > m.max_prompt_length)
        if len(longer):
            k = int(longer[0])
            raise ConfigError(f"model.max_prompt_length: prompt {self.first_id + k} has {lengths[k]} tokens; raise "
                              f"it above {m.max_prompt_length} or shorten the prompts")


def generation_batch(m: ModelConfig, effective: int) -> tuple[int, str]:
    """The run's generation batch in completions, and where it comes from (for the banner): the recipe's
    ``generation_batch_size``, or the effective batch. The effective batch is the recipe's, so no layout of the run
    moves it."""
    if m.generation_batch_size is not None:
        return m.generation_batch_size, "model.generation_batch_size"
    return effective, "the effective batch: model.generation_batch_size is null"


def schedule_of(m: ModelConfig, effective: int, prompts: int) -> tuple[GenerationSchedule, str]:
    """The run's generation schedule over ``prompts`` prompts in steps of ``effective`` completions, and where its
    generation batch comes from; one line when they do not fit together."""
    completions, source = generation_batch(m, effective)
    if completions % effective:
        raise ConfigError(f"model.generation_batch_size: {completions} completions ({source}) is not a multiple of "
                          f"the effective batch of {effective}; each optimizer step trains on one generation batch")
    schedule = GenerationSchedule(prompts, effective, completions // effective, m.num_iterations, m.num_generations)
    if completions % m.num_generations:
        raise ConfigError(f"model.num_generations: {m.num_generations} does not divide the generation batch of "
                          f"{completions} completions ({source})")
    if m.num_iterations > 1 and prompts % schedule.batch_prompts:
        raise ConfigError(f"model.num_iterations: with {m.num_iterations} passes each generation batch must be whole; "
                          f"{prompts} prompts leave {prompts % schedule.batch_prompts} over batches of "
                          f"{schedule.batch_prompts} (set data.limit to a multiple)")
    return schedule, source


def build(cfg, ctx: TaskContext) -> Job:
    m, d = cfg.model, cfg.data
    funcs = load_rewards(m)
    replay = read_rollouts(m.rollouts) if m.rollouts else None
    rows = load_rows(d)
    val_size, held_out_note = chat.held_out_size(len(rows), d, "sums")
    if held_out_note and ctx.main:
        print(held_out_note, flush=True)
    train_part, val_part = split_samples(list(range(len(rows))), val_size, d.split_seed, d.limit)
    # the generation batches against the prompts, before any is tokenized or the model loads
    schedule, source = schedule_of(m, ctx.shape.effective, len(train_part))
    tokenizer = chat.load_tokenizer(m)
    tokens = tokenized(tokenizer, rows, d)
    prompts = Prompts(rows, tokens, train_part)
    held_out = Prompts(rows, tokens, val_part or [], first_id=len(prompts))
    for part in (prompts, held_out):
        part.check_length(m)
    tokenizer.padding_side = "left"
    model, _ = chat.tuned_model(cfg, tokenizer)
    rollouts = Rollouts()
    drawn = Drawn(prompts, schedule, funcs, make_reference(m, model, cfg.peft.enabled), replay)
    generator = Generator(m, ctx, model, tokenizer, drawn, rollouts)
    if ctx.main:
        print(f"grpo: {len(prompts)} prompts from {d.source} ({len(held_out)} held out); {m.num_generations} "
              f"completions each; generation batch {schedule.batch_completions} completions ({source}) for "
              f"{schedule.per_generation} × {schedule.iterations} optimizer steps; loss {m.loss_type}", flush=True)

    def summarize(trained, run_dir=None) -> dict:
        if run_dir is not None:
            with open(Path(run_dir) / "rollouts.jsonl", "w") as f:
                for record in rollouts.log:
                    f.write(json.dumps(record) + "\n")
        rewards = [r for record in rollouts.log for r in record["rewards"]]
        return {"mean_train_reward": sum(rewards) / len(rewards)} if rewards else {}

    return Job(model=model, train_data=RolloutSlots(schedule), val_data=held_out if len(held_out) else None,
               tokenizer=tokenizer,
               collate_fn=lambda samples: collate_slots(samples) if "slot" in samples[0] else {"prompts": samples},
               loss_fn=make_loss_fn(m, rollouts, schedule, make_reward_eval(m, tokenizer, funcs)),
               count_items=make_count(m, rollouts, schedule), eval_step=eval_step, compute_metrics=held_out_metrics,
               before_window=generator.before_window, save=peft_save_hook(cfg, tokenizer), summarize=summarize,
               checkpointed=[rollouts], windows_in_order=True,  # the slots follow the generation batches
               unplannable="the grpo task trains on the rollouts it generates during the run: its micro-steps "
                           "cannot be measured before it")

