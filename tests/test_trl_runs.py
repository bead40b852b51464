"""TRL runs people hold, through the CLI only (import → run at a smaller micro-batch → compare), on the tiny chat
model in fp32:

* rows of messages (``{"messages": [...]}``): TRL trains on every token without ``assistant_only_loss`` and on the
  assistant's turns with it, and ``import --data`` says which (``data.train_on``) — "equivalent"; the other set of
  tokens differs at step 1;
* an SFT baseline that shuffled its rows (``shuffle_dataset=True``): import writes them in TRL's order —
  "equivalent"; the file's order differs at step 1;
* packed SFT baselines (``packing=True``, bfd and wrapped): import carries the packing (``data.pack``), the
  reproduction trains on TRL's packed rows — "equivalent"; unpacked, it differs on the settings layer;
* DPO baselines (sigmoid on conversational rows, hinge on text rows): import carries ``DPOConfig``'s ``beta`` and
  ``loss_type`` and how TRL tokenized the rows — "equivalent"; a run at another beta differs on the settings layer;
  with accumulation "equivalent" while every micro-batch is full, and a short last micro-batch (which TRL weights
  like a full one) differs at its step, named.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune.cli import main
from tests.helpers import ROOT, tiny_chat_assets, tiny_pairs_assets, train_and_save
from tests.test_trl_baseline import ROWS, SEED

CORPUS = ROOT / "tests" / "assets" / "corpus"


def messages_rows(path) -> str:
    rows = [json.loads(line) for line in open(tiny_chat_assets()["data"])][:ROWS]
    path.write_text("".join(json.dumps({"messages": [m for m in r["messages"] if m["role"] != "system"]}) + "\n"
                            for r in rows))
    return str(path)


def train_sft(out, data, template=None, **extra) -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir = tiny_chat_assets()["model"]
    extra = {"per_device_train_batch_size": 4, **extra}
    args = SFTConfig(output_dir=str(out), num_train_epochs=1, learning_rate=5e-4,
                     lr_scheduler_type="cosine", warmup_steps=0.2, max_grad_norm=0.34, logging_steps=1, seed=SEED,
                     bf16=False, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, **extra)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template or tokenizer.chat_template
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=data)["train"], processing_class=tokenizer)
    train_and_save(trainer)


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().out


def reproduce(capsys, tmp, baseline, data, recipe_name="sft-smollm2", *sets) -> tuple[int, str, str]:
    """(compare's exit code, its last line, import's table)."""
    recipe = tmp / f"{baseline.name}.yaml"
    code, table = cli(capsys, "import", baseline, "--recipe", recipe_name, "--data", data, "--model",
                      tiny_chat_assets()["model"], "-o", recipe, "--force")
    assert code == 0, table
    mine = tmp / f"{baseline.name}-mine{len(sets)}"
    code, out = cli(capsys, "run", "--recipe", recipe, "--batch-size", 2, "--output-dir", mine, "--set",
                    "output.tracker=none", *[x for s in sets for x in ("--set", s)])
    assert code == 0, out
    code, out = cli(capsys, "compare", baseline, mine)
    return code, out.strip().splitlines()[-1], table


# The tiny model's ChatML template with TRL's generation markers around each assistant turn (content and end token),
# which assistant_only_loss needs; it renders the same text.
GENERATION = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
              "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
              "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("assistant_only", [False, True], ids=["every-token", "assistant-only"])
def test_rows_of_messages_train_as_trl(tmp_path, capsys, assistant_only):
    """Without assistant_only_loss TRL trains on every token of a messages row (data.train_on: all); with it, on the
    assistant's turns (assistant). The negative twin trains on the other set of tokens and differs at step 1."""
    data = messages_rows(tmp_path / "messages.jsonl")
    baseline = tmp_path / "trl-messages"
    train_sft(baseline, data, assistant_only_loss=assistant_only, template=GENERATION if assistant_only else None)
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0")
    expected = "assistant_only_loss=True" if assistant_only else "--data: messages rows, trained on every token by TRL"
    assert "data.train_on" in table and expected in table, table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    other = "data.train_on=all" if assistant_only else "data.train_on=assistant"
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0", other)
    assert code == 1 and "first above at step 1" in verdict, verdict


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_a_packed_baseline_is_reproduced(tmp_path, capsys, strategy):
    """TRL packs the whole data set before sampling (trl.pack_dataset); import carries it as data.pack, and the
    reproduction trains on the same packed rows in the Trainer's order. Its twin without packing differs, naming
    the setting."""
    data = messages_rows(tmp_path / "messages.jsonl")
    baseline = tmp_path / f"trl-packed-{strategy}"
    train_sft(baseline, data, packing=True, packing_strategy=strategy, max_length=128)
    steps = json.loads((baseline / "trainer_state.json").read_text())["global_step"]
    assert steps < ROWS / 4 / 1.5, steps  # rows of several conversations (unpacked: 6 steps of 4)
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0")
    assert "data.pack" in table and strategy in table.split("data.pack")[1].splitlines()[0], table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0",
                                 "data.pack=null")
    assert code == 1 and f"settings: data.pack {strategy} in the baseline vs None" in verdict, verdict


def test_a_baseline_that_shuffled_its_rows_is_reproduced_in_that_order(tmp_path, capsys):
    """SFTConfig(shuffle_dataset=True): TRL shuffles its tokenized rows once (``Dataset.shuffle(seed=seed)``) before
    the Trainer's sampler; import writes the rows in that order — equivalent. Negative control: the file's own
    order (``data.source`` set back to it) differs at step 1."""
    data = messages_rows(tmp_path / "messages.jsonl")
    baseline = tmp_path / "trl-shuffled"
    train_sft(baseline, data, shuffle_dataset=True)
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0")
    assert "shuffle_dataset=True" in table and f"Dataset.shuffle(seed={SEED}) does" in table, table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0",
                                 f"data.source={data}")
    assert code == 1 and "first above at step 1" in verdict, verdict


@pytest.mark.parametrize("run, shuffle, packing, shuffled", [
    ("sft-config-run", True, False, True), ("sft-config-run", False, False, False),
    ("sft-config-run", True, True, False), ("grpo-config-run", True, False, False)])
def test_only_an_unpacked_sft_run_shuffles_its_rows_before_the_sampler(tmp_path, run, shuffle, packing, shuffled):
    """GRPOConfig's shuffle_dataset (its default true) is its sampler's; a packed SFT run's shuffle is named with its
    packing: neither is a shuffle of the rows import replays."""
    from finetune.reproduce.sources import read_baseline

    folder = tmp_path / run
    shutil.copytree(CORPUS / "trl" / run, folder)
    args = json.loads((folder / "training_args.json").read_text())
    (folder / "training_args.json").write_text(json.dumps({**args, "shuffle_dataset": shuffle, "packing": packing}))
    b = read_baseline(folder)
    assert (b.shuffled is not None) == shuffled and (not shuffled or b.shuffled[0] == args["seed"]), b.shuffled


def dpo_rows(path, text: bool, limit: int | None = None) -> str:
    """The tiny preference pairs of one kind (text or conversational prompts), as a jsonl file."""
    pairs = [json.loads(line) for line in open(tiny_pairs_assets()["data"])]
    kept = [r for r in pairs if "prompt" in r and isinstance(r["prompt"], str) == text][:limit]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return str(path)


def train_dpo(out, data, loss_type="sigmoid", **extra) -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model_dir = tiny_chat_assets()["model"]
    extra = {"per_device_train_batch_size": 4, "max_steps": 3, **extra}
    args = DPOConfig(output_dir=str(out), learning_rate=1e-3, beta=0.25, loss_type=[loss_type], logging_steps=1,
                     seed=SEED, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
                     lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, **extra)
    train_and_save(DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                              train_dataset=load_dataset("json", data_files=data)["train"],
                              processing_class=AutoTokenizer.from_pretrained(model_dir)))


@pytest.mark.parametrize("loss_type, rows", [("sigmoid", "conversational"), ("hinge", "text")])
def test_a_dpo_baseline_is_reproduced_and_another_beta_differs(tmp_path, capsys, loss_type, rows):
    """TRL's DPOTrainer (full fine-tuning, 4 × 1, beta 0.25): its beta and loss type are carried; text rows are
    tokenized as TRL takes them (``data.text_rows: plain``: no chat template, an end token after each completion)."""
    data = dpo_rows(tmp_path / "pairs.jsonl", text=rows == "text")
    baseline = tmp_path / "trl-dpo"
    train_dpo(baseline, data, loss_type)
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, "dpo-smollm2")
    assert "model.loss_type" in table and "0.25" in table, table
    assert ("plain" if rows == "text" else "chat") in table.split("data.text_rows")[1].splitlines()[0], table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, "dpo-smollm2", "model.beta=0.1")
    assert code == 1 and "settings: model.beta 0.25 in the baseline vs 0.1" in verdict, verdict


@pytest.mark.parametrize("pairs", [12, 11], ids=["full-micro-batches", "short-last-micro-batch"])
def test_a_dpo_baseline_with_accumulation(tmp_path, capsys, pairs):
    """TRL's DPOTrainer at 2 × 2 for an epoch: the Trainer divides each micro-batch's mean by the accumulation, the
    big batch's mean while every micro-batch is full ("equivalent" at micro-batch 1). With 11 pairs the last window
    holds micro-batches of 2 and 1, weighted alike by TRL and per pair by finetune: that step differs, and the verdict
    says why; the steps before it agree."""
    data = dpo_rows(tmp_path / "pairs.jsonl", text=False, limit=pairs)
    baseline = tmp_path / "trl-dpo-accumulated"
    train_dpo(baseline, data, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=-1,
              num_train_epochs=1)
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, "dpo-smollm2")
    if pairs % 2 == 0:
        assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
        return
    assert code == 1 and "first above at step 3" in verdict, verdict
    assert "last window of each epoch (step 3, ...) held micro-batches of 2 and 1 samples" in verdict, verdict


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_rows_longer_than_max_length_are_cut_as_trl_cuts_them(tmp_path, capsys, task):
    """TRL truncates a row longer than max_length (keep_start) where finetune's default drops it: import sets
    data.too_long, and the reproduction trains on the cut rows — "equivalent"; its twin that drops them differs."""
    if task == "sft":  # 5 of the 22 conversations are longer than 60 tokens
        data = messages_rows(tmp_path / "messages.jsonl")
        baseline = tmp_path / "trl-sft-cut"
        train_sft(baseline, data, max_length=60)
    else:  # prompts of 23-28 tokens, completions of 10-17: most pairs are cut at 36, none is dropped
        data = dpo_rows(tmp_path / "pairs.jsonl", text=False)
        baseline = tmp_path / "trl-dpo-cut"
        train_dpo(baseline, data, max_length=36)
    recipe = "sft-smollm2" if task == "sft" else "dpo-smollm2"
    sets = ["model.generate_prompts=0"] if task == "sft" else []
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, recipe, *sets)
    assert "keep_start" in table.split("data.too_long")[1].splitlines()[0], table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, recipe, *sets, "data.too_long=drop")
    assert code == 1 and "settings: data.too_long keep_start in the baseline vs drop" in verdict, verdict
