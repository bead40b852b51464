"""Packing inside each window: no padding, the same windows, items and steps as the unpacked big batch — through
the Python API, and through the CLI: a packed run resumed mid-epoch is bit-identical to the uninterrupted one, and
`finetune compare` calls a packed and an unpacked run of the same recipe equivalent."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from finetune import ConfigError, test_fine_tuning
from finetune.items import count_items
from finetune.packing import (
    PackedRows,
    collate_rows,
    contiguous_groups,
    greedy_knapsack,
    knapsack_row,
    pack_rows,
)
from finetune.reproduce.compare import compare_runs
from finetune.windows import WindowSpec
from tests.helpers import (
    ENV,
    ROOT,
    SMALL,
    checkpoint_copy,
    cli,
    copy_model,
    pad_collate,
    rel_diff,
    same_bytes,
    tiny_chat_assets,
    tiny_gpt2,
    token_data,
)

SGD = dict(optimizer="sgd", learning_rate=0.3, max_grad_norm=None, n_epochs=2, seed=3, collate_fn=pad_collate)
CAPACITY = 24  # lengths run from 2 to the capacity


def tiny_llama(seed=0, vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=1))


@pytest.fixture(scope="module")
def data():
    return token_data(37, lo=2, hi=CAPACITY, seed=7)  # windows of 12: the last of each epoch holds 1 sample


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}
SPLITS = {"12x1": dict(batch_size=12), "2x6": dict(batch_size=2, gradient_accumulation_steps=6),
          "1x12-rows-of-30": dict(batch_size=1, gradient_accumulation_steps=12, pack_length=30),
          "3x4-budget-48": dict(batch_size=3, gradient_accumulation_steps=4, max_tokens_per_micro_batch=48)}


@pytest.fixture(scope="module")
def unpacked_big(data):
    return {name: test_fine_tuning(make(), train_data=data, batch_size=12, packing=False, **SGD)
            for name, make in MODELS.items()}


@pytest.mark.parametrize("name,split", [("llama", s) for s in SPLITS] + [("gpt2", "2x6")])
def test_packed_steps_equal_the_unpacked_big_batch(data, unpacked_big, name, split):
    big = unpacked_big[name]
    packed = test_fine_tuning(MODELS[name](), train_data=data, packing=True, **SPLITS[split], **SGD)
    assert rel_diff(packed["model"], big["model"]) <= 1e-5
    assert [h["window_hash"] for h in packed["history"]] == [h["window_hash"] for h in big["history"]]
    assert [h["content_hash"] for h in packed["history"]] == [h["content_hash"] for h in big["history"]]
    assert [h["items"] for h in packed["history"]] == [h["items"] for h in big["history"]]
    assert packed["tokens"] == big["tokens"]
    assert packed["padded_tokens"] < big["padded_tokens"]


def test_packing_is_on_by_default_for_a_causal_lm(data):
    result = test_fine_tuning(tiny_gpt2(), train_data=data, batch_size=4, gradient_accumulation_steps=3, **SGD)
    padding = 1 - result["tokens"] / result["padded_tokens"]
    unpacked = test_fine_tuning(tiny_gpt2(), train_data=data, batch_size=4, gradient_accumulation_steps=3,
                                packing=False, **SGD)
    assert padding < 0.5 * (1 - unpacked["tokens"] / unpacked["padded_tokens"])


def test_without_first_labels_a_packed_row_would_train_across_samples(data):
    """Negative control: the first label of every packed sample is -100. Without that, the row counts one item
    per extra sample — the count would no longer be the unpacked one, and the next sample would be predicted from
    the previous one."""
    rows = PackedRows(data)
    row = rows[(0, 1, 2)]
    batch = collate_rows([row])
    unpacked = sum(count_items(pad_collate([data[i]]), causal=True) for i in (0, 1, 2))
    assert count_items(batch, causal=True) == unpacked
    leaky = dict(batch, labels=batch["input_ids"].clone())
    assert count_items(leaky, causal=True) == unpacked + 2


def test_rows_hold_whole_samples_within_capacity():
    lengths = [2, 24, 3, 9, 17, 5, 6, 2, 11, 30]
    rows = pack_rows(range(10), lengths.__getitem__, capacity=24)
    assert sorted(i for r in rows for i in r) == list(range(10))
    assert all(sum(lengths[i] for i in r) <= 24 or len(r) == 1 for r in rows)
    (w,) = WindowSpec(10, 2, 5, 1, 0, length_of=lengths.__getitem__, pack_capacity=24).epoch(0, 0)
    assert len(w.micro_batches) == -(-len(rows) // 2) and w.token_counts
    assert sum(real for real, _ in w.token_counts) == sum(lengths)


def test_the_last_micro_batch_is_packed_again_short_and_even():
    """First fit leaves the last micro-batch's rows part-empty and uneven, and a micro-batch is padded to its
    longest row: packed again they pad less (never more), in as many micro-batches, with every sample once."""
    g = torch.Generator().manual_seed(0)
    fills = lambda rows, lengths: [sum(lengths[i] for i in r) for r in rows]  # noqa: E731
    padded = lambda f: sum(len(f[k:k + 4]) * max(f[k:k + 4]) for k in range(0, len(f), 4))  # noqa: E731
    saved = []
    for _ in range(40):  # windows of 24 samples of 2 to 24 tokens, micro-batches of 4 rows of 24
        lengths = torch.randint(2, CAPACITY + 1, (24,), generator=g).tolist()
        plain = pack_rows(range(24), lengths.__getitem__, CAPACITY)
        even = pack_rows(range(24), lengths.__getitem__, CAPACITY, rows_per_batch=4)
        assert sorted(i for r in even for i in r) == list(range(24))
        assert max(fills(even, lengths)) <= CAPACITY
        assert -(-len(even) // 4) == -(-len(plain) // 4)
        saved.append(padded(fills(plain, lengths)) - padded(fills(even, lengths)))
    assert min(saved) >= 0 and sum(saved) > 0


class IgnoresPositions(torch.nn.Module):
    """A causal LM whose attention ignores packed position_ids (it always passes an attention mask of ones)."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_gpt2()
        self.config = self.inner.config

    def forward(self, input_ids, labels=None, position_ids=None, use_cache=None, **kw):
        return self.inner(input_ids=input_ids, labels=labels, attention_mask=torch.ones_like(input_ids),
                          use_cache=False)


IgnoresPositions.__name__ = "IgnoresPositionsForCausalLM"


def test_refused_or_avoided_for_a_model_that_lets_samples_see_each_other(data, capsys):
    with pytest.raises(ConfigError, match="cannot pack for IgnoresPositionsForCausalLM: its attention lets"):
        test_fine_tuning(IgnoresPositions(), train_data=data, batch_size=4, packing=True, **SGD)
    result = test_fine_tuning(IgnoresPositions(), train_data=data, batch_size=4, **SGD)  # not asked for: fall back
    assert "Packing: off (IgnoresPositionsForCausalLM: its attention lets packed samples see each other" in \
        capsys.readouterr().out
    assert result["padded_tokens"] > result["tokens"]


def test_a_loss_fn_that_drops_positions_is_caught(data):
    """The set-up check runs the job's own loss path: a loss_fn written for padded batches, which passes no
    position_ids, would let packed samples see each other."""
    def drops_positions(model, batch):
        return model(input_ids=batch["input_ids"], labels=batch["labels"])

    with pytest.raises(ConfigError, match="does its loss_fn drop position_ids"):
        test_fine_tuning(tiny_gpt2(), train_data=data, batch_size=4, packing=True, loss_fn=drops_positions, **SGD)
    result = test_fine_tuning(tiny_gpt2(), train_data=data, batch_size=4, packing=True,
                              loss_fn=lambda model, batch: model(**batch), **SGD)
    assert result["padded_tokens"] < 1.3 * result["tokens"]


def test_encoders_keep_sorted_windows(capsys):
    from transformers import BertConfig, BertForTokenClassification

    model = BertForTokenClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=32, num_labels=3))
    data = [{"input_ids": s["input_ids"], "labels": s["input_ids"] % 3} for s in token_data(10)]

    def token_collate(samples):  # right-pads ids and token labels (-100 on padding)
        batch = pad_collate([{"input_ids": s["input_ids"]} for s in samples])
        batch["labels"] = torch.full_like(batch["input_ids"], -100)
        for i, s in enumerate(samples):
            batch["labels"][i, :len(s["labels"])] = s["labels"]
        return batch

    kw = {**SGD, "collate_fn": token_collate}
    with pytest.raises(ConfigError, match="not a causal LM"):
        test_fine_tuning(copy_model(model), train_data=data, batch_size=5, packing=True, **kw)
    test_fine_tuning(model, train_data=data, batch_size=5, **kw)
    assert "Packing: off (BertForTokenClassification: the model is not a causal LM)" in capsys.readouterr().out


def test_packing_with_checkpointing_lora_and_bf16(data):
    from peft import LoraConfig, get_peft_model

    def lora():
        torch.manual_seed(1)
        return get_peft_model(tiny_llama(), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["q_proj", "v_proj", "gate_proj"]))

    base = lora()
    big = test_fine_tuning(copy_model(base), train_data=data, batch_size=12, packing=False, **SGD)
    packed = test_fine_tuning(copy_model(base), train_data=data, batch_size=2, gradient_accumulation_steps=6,
                              packing=True, gradient_checkpointing=True, **SGD)
    assert rel_diff(packed["model"], big["model"]) <= 1e-5
    bf16 = test_fine_tuning(copy_model(base), train_data=data, batch_size=2, gradient_accumulation_steps=6,
                            packing=True, mixed_precision="bf16", **SGD)
    assert rel_diff(bf16["model"], big["model"]) <= 1e-2  # bf16 autocast: ~3 significant digits per step


# ---------------------------------------------------------------------------------------------------------------
# through the CLI: the sft recipe (LoRA, AdamW, cosine schedule, clipping) on the tiny chat model

# 32 training conversations in windows of 4 = 2 × 2: 8 windows an epoch, 16 steps, a checkpoint every 5 (each one
# is fsynced: on a busy disk that is most of a run's time)
CHAT = ["--recipe", "sft-smollm2", *(a for s in SMALL["sft-smollm2"] for a in ("--set", s)), "--batch-size", "2",
        "--effective-batch-size", "4", "--epochs", "2", "--save-every", "5", "--keep-last", "4",
        "--set", "model.generate_prompts=0", "--set", "output.plots=false"]


def chat_run(out, *args):
    tiny_chat_assets()
    # one thread: a tiny model gains nothing from two, and on a busy machine the second one spins
    proc = cli(*CHAT, "--output-dir", str(out), *args, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def packed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "run"
    proc = chat_run(out)
    assert "Packing: on" in proc.stdout
    return out


def killed_copy(run, tmp_path, step):
    """``run`` as a kill between step ``step``'s checkpoint and the next would leave it: the checkpoints up to
    ``step``, one history line more, no model and no metrics."""
    out = checkpoint_copy(run, tmp_path / "killed", step)
    history = out / "history.jsonl"
    history.write_text("".join(history.read_text().splitlines(keepends=True)[:step + 1]))
    for p in out.glob("model*"):
        shutil.rmtree(p)
    for name in ("metrics.json", "samples.jsonl"):
        (out / name).unlink(missing_ok=True)
    return out


def saved_weights(run) -> dict:
    """Every tensor the run saved: the LoRA adapter and the merged model."""
    from safetensors.torch import load_file

    return {f"{p.parent.name}/{k}": v for p in sorted(run.glob("model*/*.safetensors"))
            for k, v in load_file(str(p)).items()}


def history(run) -> list:
    """history.jsonl without the timings and memory readings (they differ between runs)."""
    rows = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    return [{k: v for k, v in h.items() if k != "seconds" and not k.startswith("mem_")} for h in rows]


def padding_share(run) -> float:
    rows = history(run)
    return 1 - sum(h["tokens"] for h in rows) / sum(h["padded_tokens"] for h in rows)


@pytest.mark.parametrize("step", [5, pytest.param(10, marks=pytest.mark.slow)])  # mid-epoch 0 (5 of its 8 windows
# done); mid-epoch 1 (2 done) with make test-all
def test_a_packed_run_resumed_mid_epoch_is_bit_identical(packed_run, tmp_path, step):
    out = killed_copy(packed_run, tmp_path, step)
    proc = chat_run(out, "--resume", "latest")
    assert "Packing: on" in proc.stdout and "warning: resuming" not in proc.stderr
    weights = saved_weights(out)
    assert len(weights) > 20 and same_bytes(weights, saved_weights(packed_run))
    assert history(out) == history(packed_run)  # the line after the checkpoint dropped, then redone
    assert json.loads((out / "metrics.json").read_text())["val_history"] == \
        json.loads((packed_run / "metrics.json").read_text())["val_history"]


def test_resuming_a_packed_checkpoint_unpacked_is_equivalent_but_not_bit_identical(packed_run, tmp_path):
    """The control: another packing of the same windows rounds differently, and the byte comparison above sees it
    (packing does not change the result, so the resumed run is still the same run within fp32 rounding)."""
    out = killed_copy(packed_run, tmp_path, 5)
    proc = chat_run(out, "--resume", "latest", "--set", "training.packing=false")
    assert "Packing: off (training.packing=false)" in proc.stdout
    assert not same_bytes(saved_weights(out), saved_weights(packed_run))
    result = compare_runs(out, packed_run)
    assert result.equivalent, result.report()
    resumed, packed = history(out), history(packed_run)
    assert resumed[:5] == packed[:5]
    assert [h["padded_tokens"] for h in resumed[5:]] != [h["padded_tokens"] for h in packed[5:]]


def test_compare_calls_a_packed_and_an_unpacked_run_equivalent(packed_run, tmp_path):
    out = tmp_path / "unpacked"
    unpacked = chat_run(out, "--set", "training.packing=false")
    assert "Packing: off (training.packing=false)" in unpacked.stdout
    proc = subprocess.run([sys.executable, "-m", "finetune", "compare", str(packed_run), str(out)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and "verdict: equivalent" in proc.stdout, proc.stdout + proc.stderr
    for check in ("effective batch", "optimizer steps", "window samples", "lr schedule", "loss curve", "weights"):
        assert any(line.startswith("ok") and check in line for line in proc.stdout.splitlines()), check
    # packing was on: the same samples and label tokens in fewer, fuller micro-batches (padding 6 % against 11 %:
    # conversations of 33 to 92 tokens leave a row little room for a second one)
    packed, plain = history(packed_run), history(out)
    assert [h["tokens"] for h in packed] == [h["tokens"] for h in plain]
    assert [h["items"] for h in packed] == [h["items"] for h in plain]
    assert sum(h["micro_batches"] for h in packed) < sum(h["micro_batches"] for h in plain)
    assert padding_share(packed_run) < 0.6 * padding_share(out)


# ---------------------------------------------------------------------------------------------------------------
# the whole set packed as LLaMA-Factory packs it (data.pack: knapsack); the rows against its own run:
# tests/test_llamafactory_runs.py


def test_knapsacks_hold_every_sample_once_within_capacity_longest_fitting_first():
    lengths = [int(x) for x in torch.randint(1, 60, (200,), generator=torch.Generator().manual_seed(0))]
    sacks = greedy_knapsack(lengths, 100)
    assert sorted(i for s in sacks for i in s) == list(range(200))
    assert all(sum(lengths[i] for i in s) <= 100 for s in sacks)
    for sack in sacks:  # each pick was the longest that still fitted: none of the later knapsacks' would have
        room, later = 100, [lengths[i] for s in sacks[sacks.index(sack) + 1:] for i in s]
        for i in sack:
            assert not [n for n in later if lengths[i] < n <= room], (sack, room)
            room -= lengths[i]
    assert greedy_knapsack([4, 4, 4], 8) == [[2, 1], [0]]  # of equal lengths, the one seen last first


@pytest.mark.parametrize("n,shards,group", [(10, 1, 1000), (10, 3, 2), (7, 4, 3), (3, 8, 2), (1000, 16, 100)])
def test_groups_are_datasets_contiguous_shards_cut_in_batches(n, shards, group):
    import datasets

    table = datasets.Dataset.from_dict({"i": list(range(n))})
    expected = []
    for k in range(min(shards, n)):
        rows = table.shard(num_shards=min(shards, n), index=k, contiguous=True)["i"]
        expected += [rows[s:s + group] for s in range(0, len(rows), group)]
    assert [list(g) for g in contiguous_groups(n, shards, group)] == expected


def test_a_knapsack_row_lets_its_samples_attend_to_each_other():
    row = knapsack_row([{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [7, 8, 9], "labels": [7, 8, 9]}],
                       width=7, pad_id=0)
    assert row == {"input_ids": [5, 6, 7, 8, 9, 0, 0], "labels": [-100, 6, 7, 8, 9, -100, -100],
                   "position_ids": [0, 1, 0, 1, 2, 0, 0], "attention_mask": [1] * 7}
    batch = collate_rows([row])
    assert batch["attention_mask"].tolist() == [[1] * 7]  # kept: without it transformers would keep them apart
    assert "attention_mask" not in collate_rows([PackedRows([{"input_ids": [1, 2]}, {"input_ids": [3]}])[(0, 1)]])
