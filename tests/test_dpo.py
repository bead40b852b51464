"""The dpo task: preference tuning through the shared loop, exact under accumulation.

* (b, N) and (b·N, 1) take the same steps (≤ 1e-5 relative, SGD, fp32) on a tiny Llama with preference pairs of
  varying length, over two epochs whose last window is short and ends in a short micro-batch — with a frozen copy as
  the reference, with LoRA and the base (adapters off) as the reference, with precomputed reference log-probs, for
  every loss; the logged rewards are the same window means; dividing each micro-batch's mean by the number of
  micro-batches (TRL's DPOTrainer under HF Trainer) visibly breaks it (label smoothing: its formula below);
* the losses are TRL 1.16's formulas; the per-sequence log-probs are the plain head's, values and gradients;
* TRL's data layouts (explicit / implicit prompt, conversations / text) give the same tokens;
* precomputed reference log-probs are saved with checkpoints and restored on resume;
* bad input: one line naming the field, exit 2, nothing written.

Two processes against one: ``tests/dist_worker.py`` (``dpo-smollm2``).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.loop import Reporting
from finetune.models.loss_head import model_sequence_log_probs, sequence_log_probs
from finetune.startup import build_job
from finetune.tasks import dpo
from tests.helpers import SMALL, assert_one_error_line, cli, refused_in_process, tiny_pairs_assets
from tests.helpers import dpo_recipe_run as run

RECIPE = "dpo-smollm2"
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected")


@pytest.fixture(autouse=True, scope="module")
def assets():
    return tiny_pairs_assets()


@pytest.fixture(scope="module")
def big(assets):
    """The baseline: the 9 pairs of each window in one micro-batch, a frozen copy as the reference."""
    return run(9, 1)[0]


def update_diff(a, b, start) -> float:
    """max |Δa − Δb| / max |Δb| over the trainable weights (Δ: the change from the initial weights)."""
    da, db = ([(dict(r["model"].named_parameters())[k].detach() - w).flatten().double() for k, w in start.items()]
              for r in (a, b))
    da, db = torch.cat(list(da)), torch.cat(list(db))
    return float((da - db).abs().max() / db.abs().max())


def assert_same_logged(a, b) -> None:
    for h1, h2 in zip(a["history"], b["history"]):
        assert h1["items"] == h2["items"] and h1["loss"] == pytest.approx(h2["loss"], rel=1e-5)
        for key in LOGGED:
            assert h1[key] == pytest.approx(h2[key], rel=1e-5, abs=1e-6), key


# ---------------------------------------------------------------------------------------------------------------
# exact windows


def test_windows_are_exact_and_micro_batch_division_is_not(big):
    # 22 pairs in windows of 9: the last holds 4 = 3 + 1 (a short window ending in a short micro-batch)
    small, _, start = run(3, 3)
    assert small["optimizer_steps"] == big["optimizer_steps"] == 6
    assert [h["items"] for h in small["history"]] == [9, 9, 4] * 2  # pairs, not sequences or tokens
    assert update_diff(small, big, start) <= 1e-5
    assert_same_logged(small, big)
    assert small["history"][-1]["rewards/accuracy"] > 0.5  # it learns the preference
    # the control: each micro-batch's mean divided by the window's micro-batches, as HF Trainer does for TRL's DPO
    per_micro_batch, _, _ = run(3, 3, job_hook=lambda job: setattr(job, "count_items", lambda batch: 1))
    assert update_diff(per_micro_batch, big, start) > 1e-3


@pytest.mark.parametrize("overrides", [["model.loss_type=ipo", "model.beta=0.5"], ["model.loss_type=hinge"]],
                         ids=["ipo", "hinge"])
def test_every_loss_is_exact(overrides):
    overrides = [*overrides, "training.epochs=1"]  # windows of 9, 9 and 4 = 3 + 1
    small, _, start = run(3, 3, *overrides)
    big, _, _ = run(9, 1, *overrides)
    assert update_diff(small, big, start) <= 1e-5
    assert_same_logged(small, big)


def test_lora_reference_is_the_base_with_adapters_off():
    small, job, start = run(3, 3, "peft.enabled=true", "peft.r=4", "training.epochs=1")
    big, _, _ = run(9, 1, "peft.enabled=true", "peft.r=4", "training.epochs=1")
    assert start and all("lora_" in k for k in start)
    reference = job.loss_fn.__closure__[next(i for i, c in enumerate(job.loss_fn.__code__.co_freevars)
                                             if c == "reference")].cell_contents
    assert reference.kind == "adapters" and reference.frozen is None  # no second copy
    assert update_diff(small, big, start) <= 1e-5
    assert_same_logged(small, big)
    # before the first update the adapters add exactly zero: the policy is the reference, every reward 0
    assert small["history"][0]["rewards/chosen"] == 0 and small["history"][0]["rewards/rejected"] == 0


def test_precomputed_reference_is_exact_and_equals_the_frozen_copy(big):
    small, job, start = run(3, 3, "model.precompute_ref_log_probs=true")
    assert job.checkpointed and job.checkpointed[0].frozen is None  # no copy kept
    assert update_diff(small, big, start) <= 1e-5  # big: (9, 1) with a frozen copy
    assert_same_logged(small, big)


def test_precomputed_reference_is_restored_on_resume(tmp_path):
    out = tmp_path / "run"
    first, job, _ = run(3, 3, "model.precompute_ref_log_probs=true", "training.max_steps=3",
                        output=Reporting(dir=out, save_every=2))
    saved = {k: v.clone() for k, v in job.checkpointed[0].state_dict().items()}
    assert (out / "checkpoints" / "step-000002" / "task_state.safetensors").is_file()

    def recomputed_differently(job):  # as if set-up on another layout had rounded otherwise
        job.checkpointed[0].cache = {k: v + 1.0 for k, v in job.checkpointed[0].cache.items()}

    resumed, job2, _ = run(3, 3, "model.precompute_ref_log_probs=true", "training.max_steps=3",
                           job_hook=recomputed_differently, resume_from=out / "checkpoints" / "step-000002")
    assert all(torch.equal(job2.checkpointed[0].state_dict()[k], v) for k, v in saved.items())
    assert resumed["history"][-1]["loss"] == pytest.approx(first["history"][-1]["loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# the losses and the log-probs


def test_losses_are_trl_formulas():
    policy, reference = torch.tensor([-5.0, -9.0, -7.0, -6.0]), torch.tensor([-6.0, -8.0, -7.5, -5.0])
    labels = torch.full((4, 6), -100)
    labels[0, 2:], labels[1, 3:], labels[2, 1:], labels[3, 4:] = 1, 1, 1, 1  # 4, 3, 5 and 2 completion tokens
    m = dpo.ModelConfig(beta=0.3)
    delta = torch.tensor([(-5 + 6) - (-7 + 7.5), (-9 + 8) - (-6 + 5)])
    sigmoid = dpo.preference_loss(policy, reference, labels, m)
    assert torch.allclose(sigmoid["losses"], -F.logsigmoid(0.3 * delta))
    assert torch.allclose(sigmoid["chosen_rewards"], 0.3 * torch.tensor([1.0, -1.0]))
    m.label_smoothing = 0.1
    smoothed = dpo.preference_loss(policy, reference, labels, m)["losses"]
    assert torch.allclose(smoothed, -0.9 * F.logsigmoid(0.3 * delta) - 0.1 * F.logsigmoid(-0.3 * delta))
    m.label_smoothing, m.loss_type = 0.0, "hinge"
    assert torch.allclose(dpo.preference_loss(policy, reference, labels, m)["losses"], torch.relu(1 - 0.3 * delta))
    m.loss_type = "ipo"
    ipo = torch.tensor([(1.0 / 4 - 0.5 / 5), (-1.0 / 3 + 1.0 / 2)]) - 1 / (2 * 0.3)
    assert torch.allclose(dpo.preference_loss(policy, reference, labels, m)["losses"], ipo ** 2)


def test_sequence_log_probs_are_the_plain_heads():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 8, requires_grad=True)
    head = torch.nn.Linear(8, 50)
    labels = torch.randint(0, 50, (3, 7))
    labels[:, :2], labels[2, 5:] = -100, -100
    weights = torch.randn(3)
    ours = sequence_log_probs(hidden, head, labels, chunk_tokens=4)
    (ours * weights).sum().backward()
    grads = [hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()]
    hidden.grad = None
    head.zero_grad()
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    per_token = F.log_softmax(head(hidden).float(), -1).gather(2, shifted.clamp(min=0)[..., None]).squeeze(-1)
    plain = (per_token * (shifted != -100)).sum(1)
    (plain * weights).sum().backward()
    assert torch.allclose(ours, plain, atol=1e-5)
    for a, b in zip(grads, [hidden.grad, head.weight.grad, head.bias.grad]):
        assert torch.allclose(a, b, atol=1e-6)


def test_model_log_probs_need_no_vocabulary_sized_logits(assets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    ids = torch.randint(3, 100, (4, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(ids < 40, -100)}
    shapes = []
    model.lm_head.register_forward_hook(lambda m, i, out: shapes.append(tuple(out.shape)))
    ours = model_sequence_log_probs(model, batch)
    assert shapes == [(4, 1, model.config.vocab_size)]  # only the last position's logits, from the model's forward
    logits = model(input_ids=ids).logits
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    plain = (F.log_softmax(logits, -1).gather(2, shifted.clamp(min=0)[..., None]).squeeze(-1)
             * (shifted != -100)).sum(1)
    assert torch.allclose(ours, plain, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# data


def test_every_layout_gives_the_same_tokens(assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    explicit = {"prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
                "chosen": [{"role": "assistant", "content": "5."}], "rejected": [{"role": "assistant", "content": "6"}]}
    implicit = {"chosen": explicit["prompt"] + explicit["chosen"],
                "rejected": explicit["prompt"] + explicit["rejected"]}
    text = {"prompt": "What is 2 plus 3?", "chosen": "5.", "rejected": "6"}
    encoded = [dpo.encode_pair(tokenizer, *dpo.to_pair(row)) for row in (explicit, implicit, text)]
    assert encoded[0] == encoded[1] == encoded[2]
    assert tokenizer.decode(encoded[0]["chosen_ids"]).startswith("5.<|im_end|>")
    # TRL's extract_prompt on texts: the space before the split goes with the completions
    assert dpo.split_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")


def test_stdlib_pairs_prefer_the_functions_own_docstring():
    pairs = dpo.stdlib_pairs()
    assert len(pairs) > 1000 and all(p["chosen"] != p["rejected"] for p in pairs)
    chosen = {p["chosen"] for p in pairs}
    assert all(p["rejected"] in chosen for p in pairs)  # another function's answer, from the same source
    assert len({p["prompt"] for p in pairs}) == len(pairs)


def test_held_out_rewards_and_the_recipe_through_the_cli(tmp_path):
    out = tmp_path / "run"
    sets = [a for s in [*SMALL[RECIPE], "data.limit=16", "output.plots=false"] for a in ("--set", s)]
    proc = cli("--recipe", RECIPE, *sets, "--max-steps", "2", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2 and all(key in history[0] for key in LOGGED)
    metrics = json.loads((out / "metrics.json").read_text())
    text = json.dumps(metrics)
    assert "rewards/accuracy" in text and "rewards/margin" in text and "logps/accuracy" in text


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line naming the field, exit 2, nothing written


def _bad_rows(tmp_path):
    ok = {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}
    cases = {
        "norejected.jsonl": [ok, {"prompt": "Hi", "chosen": "Hello."}],
        "nochosen.jsonl": [ok, {"prompt": "Hi", "rejected": "Go away."}],
        "empty.jsonl": [ok, {"prompt": "Hi", "chosen": " ", "rejected": "Go away."}],
        "emptyturn.jsonl": [ok, {"prompt": "Hi", "chosen": [{"role": "assistant", "content": ""}], "rejected": "No."}],
    }
    for name, rows in cases.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "pairs.csv").write_text("prompt,good,bad\nHi,Hello.,Go away.\n")


BAD = [
    (["data.source={tmp}/norejected.jsonl"], "data.source: line 2 has no 'rejected'"),
    (["data.source={tmp}/nochosen.jsonl"], "data.source: line 2 has no 'chosen'"),
    (["data.source={tmp}/empty.jsonl"], "data.source: line 2 has an empty 'chosen'"),
    (["data.source={tmp}/emptyturn.jsonl"], "data.source: line 2 has an empty 'chosen'"),
    (["model.beta=0"], "model.beta: got 0.0; must be a number > 0"),
    (["model.beta=-0.1"], "model.beta: got -0.1; must be a number > 0"),
    (["model.loss_type=kto"], "model.loss_type: got 'kto'"),
    (["model.loss_type=ipo", "model.label_smoothing=0.1"], "model.label_smoothing: applies to loss_type sigmoid"),
    (["data.source={tmp}/pairs.csv"], "pairs.csv has columns prompt, good, bad; the dpo task needs chosen and "
                                      "rejected"),
]
IN_A_PROCESS = {0}  # as a user runs it; the rest through main() in this process


@pytest.mark.parametrize("index,overrides,message", [(i, *case) for i, case in enumerate(BAD)],
                         ids=[f"{i:02d}-" + m.split(":")[0] for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, index, overrides, message):
    _bad_rows(tmp_path)
    sets = [a for s in [*SMALL[RECIPE], *overrides] for a in ("--set", s.replace("{tmp}", str(tmp_path)))]
    out = tmp_path / "out"
    if index in IN_A_PROCESS:
        proc = cli("--recipe", RECIPE, *sets, "--output-dir", str(out))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert_one_error_line(proc.stderr, message)
    else:
        refused_in_process(capsys, ["--recipe", RECIPE, *sets, "--output-dir", str(out)], message)
    assert not out.exists()


def test_identical_pairs_are_counted_and_kept(tmp_path, capsys):
    rows = [{"prompt": f"Q{i}?", "chosen": f"A{i}.", "rejected": "Same." if i < 3 else f"B{i}."} for i in range(10)]
    rows[0]["chosen"] = rows[1]["chosen"] = rows[2]["chosen"] = "Same."
    (tmp_path / "same.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], f"data.source={tmp_path / 'same.jsonl'}", "data.val_fraction=0"])
    job = build_job(cfg)
    err = capsys.readouterr().err
    assert "warning: data.source: 3 pairs have chosen identical to rejected" in err
    assert len(job.train_data) == 10


def test_config_errors_are_listed_at_load():
    with pytest.raises(ConfigError) as e:
        load_recipe(RECIPE, ["model.beta=0", "model.label_smoothing=0.7", "data.max_length=1"])
    assert [p.split(":")[0] for p in e.value.problems] == ["model.beta", "model.label_smoothing", "data.max_length"]
