"""``training.replay_padding``: a mixed-precision baseline's micro-batches replayed at any micro-batch here — each
micro-batch cut from one baseline micro-batch (consecutive samples of the window in sampler order, never sorted) and
right-padded to the length the baseline padded it to (its longest row, or a multiple of ``pad_to_multiple_of``).

The premise, on this CPU and the tiny chat model: a sample's bf16 loss is bit-identical at micro-batch 1, 2 and 4 at
equal padded length, and not at another padded length (the negative control)."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.errors import ConfigError
from finetune.steps import pad_to_window
from finetune.windows import WindowSpec
from tests.helpers import ROOT, tiny_chat_assets

VARIED = ROOT / "tests" / "assets" / "trl-2proc" / "varied.jsonl"


def varied_ids() -> list:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_assets()["model"])
    return [tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True)["input_ids"]
            for line in open(VARIED)]


def spec(lengths, micro_batch: int, replay=(4, 1), sort=False) -> WindowSpec:
    return WindowSpec(len(lengths), micro_batch, 16 // micro_batch, 1, 42, sample_order="trainer", replay=replay,
                      length_of=lengths.__getitem__, sort_key=lengths.__getitem__ if sort else None)


def mixes(window, per_device: int) -> bool:
    """Whether a micro-batch of ``window`` holds samples of two baseline micro-batches (runs of ``per_device``)."""
    where = {i: k // per_device for k, i in enumerate(window.samples)}
    return any(len({where[i] for i in mb}) > 1 for mb in window.micro_batches)


@pytest.mark.parametrize("micro_batch", [1, 2, 3, 4, 8])
def test_each_micro_batch_is_cut_from_one_baseline_micro_batch_and_padded_to_its_length(micro_batch):
    lengths = [len(x) for x in varied_ids()]
    for multiple in (1, 16):
        for w in spec(lengths, micro_batch, (4, multiple)).epoch(0):
            assert not mixes(w, 4)
            # the samples in the sampler's order: the micro-batches, concatenated, are the window's samples
            assert [i for mb in w.micro_batches for i in mb] == list(w.samples)
            assert all(len(mb) <= micro_batch for mb in w.micro_batches)
            for mb, pad in zip(w.micro_batches, w.pad_lengths):
                k = w.samples.index(mb[0]) // 4
                longest = max(lengths[i] for i in w.samples[4 * k:4 * k + 4])
                assert pad == -(-longest // multiple) * multiple and pad >= max(lengths[i] for i in mb)
    # negative control: sorted by length (sort_within_window), micro-batches of 4 mix baseline micro-batches
    assert any(mixes(w, 4) for w in spec(lengths, 4, None, sort=True).epoch(0))


def per_sample_losses(model, rows, micro_batches) -> list:
    """Each sample's summed bf16 loss, run in ``micro_batches`` (already padded)."""
    out = {}
    for batch in micro_batches:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        losses = torch.nn.functional.cross_entropy(logits.float()[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                                                   reduction="none").sum(1)
        for i, loss in zip(batch["rows"], losses):
            out[i] = loss
    return [out[i] for i in rows]


def collated(ids, rows) -> dict:
    """``rows`` right-padded to their longest (the sft task's collation; TRL's collator pads the same)."""
    longest = max(len(ids[i]) for i in rows)
    inp = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(inp)
    for k, i in enumerate(rows):
        inp[k, :len(ids[i])], mask[k, :len(ids[i])] = torch.tensor(ids[i]), 1
    return {"input_ids": inp, "attention_mask": mask, "labels": inp.masked_fill(mask == 0, -100)}


class OneProcess:
    num_processes = 1


def test_a_replayed_sample_rounds_in_bf16_bit_for_bit_as_in_its_baseline_micro_batch():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_assets()["model"], dtype=torch.float32)
    ids = varied_ids()
    lengths = [len(x) for x in ids]
    window = spec(lengths, 4).epoch(0)[0]
    baseline = [{**collated(ids, mb), "rows": mb} for mb in window.micro_batches]  # 4 rows, their own longest
    theirs = per_sample_losses(model, window.samples, baseline)
    for b in (1, 2):
        w = spec(lengths, b).epoch(0)[0]
        padded = pad_to_window(OneProcess(), [collated(ids, mb) for mb in w.micro_batches], w.pad_lengths)
        ours = per_sample_losses(model, w.samples, [{**p, "rows": mb} for p, mb in zip(padded, w.micro_batches)])
        assert all(torch.equal(x, y) for x, y in zip(ours, theirs)), b
    # negative control: every sample at the window's longest (pad_to_window without the baseline's lengths)
    w = spec(lengths, 2).epoch(0)[0]
    padded = pad_to_window(OneProcess(), [collated(ids, mb) for mb in w.micro_batches])
    at_longest = per_sample_losses(model, w.samples, [{**p, "rows": mb} for p, mb in zip(padded, w.micro_batches)])
    assert not all(torch.equal(x, y) for x, y in zip(at_longest, theirs))


def test_a_micro_batch_longer_than_its_baseline_length_is_refused():
    batch = collated([[5] * 9], [0])
    with pytest.raises(RuntimeError, match="longer than the 8 its baseline micro-batch was padded to"):
        pad_to_window(OneProcess(), [batch], [8])
    assert pad_to_window(OneProcess(), [batch], [12])[0]["labels"].shape == (1, 12)  # shorter is padded


@pytest.mark.parametrize("setting", [{"packing": True}, {"sort_within_window": True},
                                     {"max_tokens_per_micro_batch": 512}])
def test_what_would_regroup_the_baseline_micro_batches_is_refused_naming_it(setting):
    from types import SimpleNamespace

    from finetune.config import TrainingConfig
    from finetune.startup import check_replay_padding

    t = TrainingConfig(replay_padding=[4, 1], **setting)
    with pytest.raises(ConfigError, match=f"training.{next(iter(setting))}: cannot be combined with "
                                          "training.replay_padding"):
        check_replay_padding(SimpleNamespace(length_of=len), t)
    check_replay_padding(SimpleNamespace(length_of=len), TrainingConfig(replay_padding=[4, 1]))  # alone: fine
    with pytest.raises(ConfigError, match="this task gives no sample lengths"):
        check_replay_padding(SimpleNamespace(length_of=None), TrainingConfig(replay_padding=[4, 1]))


TWO = ROOT / "tests" / "assets" / "trl-2proc"


def imported(capsys, tmp_path, source, *extra):
    import yaml

    from tests.helpers import cli_in_process

    recipe = tmp_path / "r.yaml"
    code, said = cli_in_process(capsys, "import", source, "-o", recipe, "--force", *extra)
    assert code == 0, said
    return yaml.safe_load(recipe.read_text())["training"].get("replay_padding"), said


def test_import_carries_each_tools_micro_batch_padding_in_half_precision_only(tmp_path, capsys, monkeypatch):
    """TRL's per-device batch and its pad_to_multiple_of; LLaMA-Factory's collator, which pads to a multiple of 8;
    an fp32 baseline (negative control) gets none: its rounding does not depend on the padded length."""
    import yaml

    lf = ["--recipe", "sft-smollm2", "--data", VARIED, "--model", tiny_chat_assets()["model"]]
    assert imported(capsys, tmp_path, TWO / "sft-bf16-varied", *lf)[0] == [4, 1]
    replay, said = imported(capsys, tmp_path, TWO / "sft-bf16-varied-pad16", *lf)
    assert replay == [4, 16] and "rounded up to a multiple of 16 (pad_to_multiple_of)" in said, said
    assert imported(capsys, tmp_path, TWO / "sft", *lf)[0] is None  # fp32
    monkeypatch.chdir(ROOT)  # the YAML names its model and data from the repository's root
    raw = yaml.safe_load((ROOT / "examples" / "llamafactory" / "sft-lora.yaml").read_text())
    for bf16, expected in ((True, [raw["per_device_train_batch_size"], 8]), (False, None)):
        source = tmp_path / f"lf-{bf16}.yaml"
        source.write_text(yaml.safe_dump({**raw, "bf16": bf16}))
        replay, said = imported(capsys, tmp_path, source)
        assert replay == expected, said
