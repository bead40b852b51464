"""Transformer specifics: heads that ignore num_items_in_batch, LoRA through peft, the transformer recipes' CLI."""

import json
import math

import pytest
import torch

from finetune import test_fine_tuning
from tests.helpers import cli, copy_model, pad_collate, rel_diff, tiny_gpt2, token_data, train_quietly

SGD = dict(optimizer="sgd", learning_rate=0.3, max_grad_norm=None, n_epochs=2, seed=3)


def tiny_bert_classifier(num_labels=2):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=num_labels))


def classify_collate(samples):
    batch = pad_collate(samples)
    batch["labels"] = torch.stack([s["input_ids"].sum() % 2 for s in samples])
    return batch


def test_head_that_ignores_num_items_in_batch_is_exact_and_never_scaled_twice():
    """BertForSequenceClassification takes **kwargs but ignores num_items_in_batch: we never pass it, and weight
    each micro-batch ourselves, so (b, N) = (b·N, 1) and the logged loss is the plain mean (not × N)."""
    seen = []
    model = tiny_bert_classifier()
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    data = token_data(23, seed=5)
    small = test_fine_tuning(copy_model(model), train_data=data, batch_size=2, gradient_accumulation_steps=4,
                             collate_fn=classify_collate, **SGD)
    big = test_fine_tuning(copy_model(model), train_data=data, batch_size=8, gradient_accumulation_steps=1,
                           collate_fn=classify_collate, **SGD)
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert small["loss_history"] == pytest.approx(big["loss_history"], rel=1e-5)
    assert 0.3 < small["loss_history"][0] < 1.5  # ≈ ln 2 at the start: a mean, not N × a mean
    assert not any("num_items_in_batch" in kw for kw in seen)


def test_causal_lm_loss_is_the_window_token_mean():
    """The logged window loss equals the big batch's token-mean loss; the GPT-2 count is shifted (one less token
    per row), and (b, N) = (b·N, 1) also at N = 1 vs sample-weighted counting."""
    model, data = tiny_gpt2(), token_data(12, lo=3, hi=10)
    batch = pad_collate(data)
    with torch.no_grad():
        full_mean = float(model(**batch).loss)
    result = test_fine_tuning(copy_model(model), train_data=data, batch_size=3, gradient_accumulation_steps=4,
                              collate_fn=pad_collate, shuffle=False, n_epochs=1, optimizer="sgd",
                              learning_rate=0.0)
    assert result["loss_history"][0] == pytest.approx(full_mean, rel=1e-6)
    assert result["history"][0]["items"] == sum(len(s["input_ids"]) - 1 for s in data)


def _lora_gpt2(dropout=0.0):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_gpt2(), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=dropout,
                                                  target_modules=["c_attn", "c_proj"], fan_in_fan_out=True))


def test_lora_trains_only_adapters_saves_loads_and_merges(tmp_path):
    from peft import PeftModel

    model = _lora_gpt2()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = token_data(16)
    result = test_fine_tuning(model, train_data=data, batch_size=4, gradient_accumulation_steps=2,
                              collate_fn=pad_collate, learning_rate=1e-2, gradient_checkpointing=True)
    trained = result["model"]
    n_lora = sum(p.numel() for p in trained.parameters() if p.requires_grad)
    # r = 4 on each layer's attn.c_attn (32→96), attn.c_proj (32→32) and mlp.c_proj (128→32), 2 layers
    assert n_lora == 2 * 4 * ((32 + 96) + (32 + 32) + (128 + 32))
    named = dict(trained.named_parameters())
    assert all(torch.equal(named[n], p) for n, p in frozen_before.items())  # base weights untouched
    assert any(not torch.equal(named[n], p) for n, p in lora_before.items())  # adapters moved (with checkpointing)

    trained.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    reloaded = PeftModel.from_pretrained(tiny_gpt2(), tmp_path / "adapter")
    ids = pad_collate(token_data(3, seed=9))
    with torch.no_grad():
        trained.eval()
        reloaded.eval()
        a = trained(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        b = reloaded(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        merged = reloaded.merge_and_unload()
        c = merged(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).logits
    assert torch.equal(a, b)
    assert torch.allclose(a, c, atol=1e-5)
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def test_adding_adapters_says_nothing_of_transformers_deprecated_property():
    """peft reads ``is_gradient_checkpointing``, which transformers 5 deprecates with a FutureWarning on every read:
    that one warning is silenced where finetune adds the adapters, and only there (read again afterwards, it warns)."""
    import warnings

    from finetune.config import PeftConfig
    from finetune.models.hf import apply_peft

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_peft(tiny_gpt2(), PeftConfig(enabled=True, r=4, target_modules=["c_attn"]), "CAUSAL_LM")
        said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        assert not any("is_gradient_checkpointing" in m for m in said), said
        model.get_base_model().is_gradient_checkpointing  # the control: the filter did not outlive the call
        assert any("is_gradient_checkpointing" in str(w.message) for w in caught)


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False")  # peft on GPT-2's Conv1D: it sets it
def test_target_modules_of_another_architecture_are_one_line_naming_its_layers():
    """A recipe's Llama targets (q_proj, …) on a GPT-2: ConfigError naming the field and GPT-2's own linear layers
    (its Conv1D ones included); the same config with c_attn trains (the control)."""
    from finetune.config import PeftConfig
    from finetune.errors import ConfigError
    from finetune.models.hf import apply_peft

    with pytest.raises(ConfigError, match=r"^peft.target_modules: q_proj, v_proj match no layer of GPT2LMHeadModel; "
                                          r"its linear layers: c_attn, c_fc, c_proj"):
        apply_peft(tiny_gpt2(), PeftConfig(enabled=True, r=4, target_modules=["q_proj", "v_proj"]), "CAUSAL_LM")
    model = apply_peft(tiny_gpt2(), PeftConfig(enabled=True, r=4, target_modules=["c_attn"]), "CAUSAL_LM")
    assert any("lora_" in name for name, _ in model.named_parameters())


def test_lora_windows_are_exact():
    model, data = _lora_gpt2(), token_data(21)
    small = test_fine_tuning(copy_model(model), train_data=data, batch_size=2, gradient_accumulation_steps=3,
                             collate_fn=pad_collate, **SGD)
    big = test_fine_tuning(copy_model(model), train_data=data, batch_size=6, gradient_accumulation_steps=1,
                           collate_fn=pad_collate, **SGD)
    assert rel_diff(small["model"], big["model"]) <= 1e-5


def test_length_sorted_micro_batches_take_the_same_steps():
    """Sorting a window's samples by length before cutting micro-batches changes the padding, not the step."""
    from finetune import Job
    from finetune.config import TrainingConfig

    model, data = tiny_gpt2(), token_data(29, lo=2, hi=20)
    lengths = [len(s["input_ids"]) for s in data]

    def run(b, n, sort):
        t = TrainingConfig(batch_size=b, gradient_accumulation_steps=n, sort_within_window=sort, optimizer="sgd",
                           learning_rate=0.3, max_grad_norm=None, epochs=2, seed=3)
        job = Job(model=copy_model(model), train_data=data, collate_fn=pad_collate, length_of=lambda i: lengths[i])
        return train_quietly(job, t)

    big, sorted_small = run(6, 1, False), run(2, 3, True)
    assert rel_diff(sorted_small["model"], big["model"]) <= 1e-5
    assert [h["window_hash"] for h in sorted_small["history"]] == [h["window_hash"] for h in big["history"]]
    assert [h["content_hash"] for h in sorted_small["history"]] == [h["content_hash"] for h in big["history"]]


TRANSFORMER_RECIPES = ["minilm-valence", "minilm-sentiment-lora", "clm-pydoc"]


@pytest.mark.parametrize("recipe", TRANSFORMER_RECIPES)
def test_transformer_recipe_runs_through_the_cli(tmp_path, recipe):
    out = tmp_path / "run"
    proc = cli("--recipe", recipe, "--max-steps", "2", "--batch-size", "4", "--set", "data.limit=48",
               "--set", "training.effective_batch_size=8", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2
    final = metrics["final_metrics"]
    if recipe == "minilm-valence":
        assert final["mae"] >= 0 and -1 <= final["pearson"] <= 1
    elif recipe == "clm-pydoc":
        assert final["perplexity"] == pytest.approx(math.exp(final["loss"]), rel=1e-6)
        assert isinstance(metrics["sample"], str) and metrics["sample"].startswith("The")
    else:
        assert 0 <= final["accuracy"] <= 1
        assert (out / "model" / "adapter_model.safetensors").exists()
        assert (out / "model-merged" / "model.safetensors").exists()
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert "val_loss" in history[-1]  # the evaluation is in the history too


def test_long_sequence_lion_amp_compile_recipe(tmp_path):
    """Seed 004 as a recipe: the banner shows the 2 × 16 split and the bar the EMA loss. Without the recipe's
    torch.compile (a minute of compiling on a CPU; compiled = eager: test_loop.py::test_compile_matches_eager)."""
    out = tmp_path / "run"
    proc = cli("--recipe", "clm-lion-long", "--max-steps", "1", "--set", "data.limit=150", "--output-dir", str(out),
               "--set", "model.sample_tokens=4", "--set", "training.compile=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Effective batch size: 32 (2 × 16)" in proc.stdout
    assert "Optimizer: lion" in proc.stdout and "Mixed precision: bf16" in proc.stdout
    assert "eff_batch=32 loss=" in proc.stderr
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and math.isfinite(history[0]["loss"]) and history[0]["samples"] <= 32


def test_dropout_zero_reaches_attention_that_reads_a_float():
    """``model.dropout: 0`` must also reach attention dropout kept as a float (nn.MultiheadAttention, and HF models
    that copy ``attention_dropout`` from the config at init): else training stays random, and (b, N) = (b·N, 1)
    holds only while the RNG stream happens to line up (one process on CPU), not across processes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.models.forward import set_dropout

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5))
    x, ids = torch.randn(2, 5, 16), torch.randint(32, (2, 5))
    cases = [(layer, lambda m: m(x)), (llama, lambda m: m(input_ids=ids).logits)]
    for model, forward in cases:
        model.train()
        assert not torch.equal(forward(model), forward(model))  # the check can fail: dropout is live
        set_dropout(model, 0.0)
        assert torch.equal(forward(model), forward(model)), type(model).__name__


def test_a_new_model_config_naming_what_the_tokenizer_gives_is_one_line(capsys, tmp_path):
    from tests.helpers import SMALL, refused_in_process

    config = "model.config={model_type: gpt2, n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64, vocab_size: 100}"
    args = ["--recipe", "clm-pydoc", *[x for s in SMALL["clm-pydoc"] for x in ("--set", s)], "--set", config,
            "--output-dir", str(tmp_path / "run")]
    refused_in_process(capsys, args, "model.config: vocab_size comes from the tokenizer")
    assert not (tmp_path / "run" / "config.yaml").exists()
