"""The chunked loss head gives the plain head's loss and gradients (fp32: ≤ 1e-5 relative), in a model and in the
loop."""

import copy
import inspect
import re

import pytest
import torch
import torch.nn.functional as F
import transformers

from finetune import test_fine_tuning
from finetune.models.loss_head import (
    SUPPORTED,
    Head,
    causal_lm_loss,
    chunked_linear_cross_entropy,
    chunked_loss_enabled,
    disable_chunked_loss,
    enable_chunked_loss,
)
from tests.helpers import copy_model, pad_collate, rel_diff, tiny_gpt2, token_data

VOCAB = 96
LOSS_WEIGHT = 0.37  # the loop scales each micro-batch's loss before backward: the head must pass that on


def tiny_llama(seed=0, tie=False, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, pad_token_id=0, **kw)
    return LlamaForCausalLM(cfg)


def padded_batch(seed=0):
    """Three rows of 13 tokens: one short (right-padded, attention mask 0), one with -100 inside its labels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2:6] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}  # 9 + 4 + 12 = 25 counted tokens


def packed_batch(seed=1):
    """Two rows each packing several samples: no attention mask, position_ids restarting at every sample."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (2, 12), generator=g)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2]])
    labels = ids.clone()
    labels[positions == 0] = -100  # a sample's first token is not predicted from the previous sample
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def loss_and_grads(model, batch, chunk_tokens=None, autocast=False):
    """(loss, {parameter: gradient}) of one forward + backward of a copy of ``model``; chunked when chunk_tokens."""
    model = copy.deepcopy(model).train()
    if chunk_tokens:
        enable_chunked_loss(model, chunk_tokens=chunk_tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**batch)
    if chunk_tokens:
        assert out.logits is None
    (out.loss * LOSS_WEIGHT).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return out.loss.detach(), grads


def worst(a, b) -> tuple:
    """(relative loss difference, worst relative gradient difference over parameters) of a against b."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys()
    return (float((loss_a - loss_b).abs() / loss_b.abs()),
            max(rel_diff(grads_a[n].flatten(), grads_b[n].flatten()) for n in grads_b))


MODELS = {"llama": tiny_llama, "llama-tied": lambda: tiny_llama(tie=True), "gpt2-tied": lambda: tiny_gpt2(vocab=VOCAB)}


@pytest.mark.parametrize("name", MODELS)
def test_same_loss_and_gradients_as_the_plain_head(name):
    """-100 labels, a padded short row, 7-token chunks that do not divide the 25 counted tokens."""
    model, batch = MODELS[name](), padded_batch()
    chunked, plain = loss_and_grads(model, batch, chunk_tokens=7), loss_and_grads(model, batch)
    assert worst(chunked, plain) <= (1e-5, 1e-5)
    if name != "llama":  # tied: the head's gradient reaches the embedding through the same parameter
        assert not any("lm_head" in n for n in plain[1])


def test_packed_rows():
    model, batch = tiny_llama(), packed_batch()
    assert worst(loss_and_grads(model, batch, chunk_tokens=5), loss_and_grads(model, batch)) <= (1e-5, 1e-5)


def test_a_bias_on_the_head():
    """Phi's head has a bias (its gradient is the summed logit gradients)."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, pad_token_id=0))
    assert model.lm_head.bias is not None
    batch = padded_batch()
    assert worst(loss_and_grads(model, batch, chunk_tokens=4), loss_and_grads(model, batch)) <= (1e-5, 1e-5)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_lora(targets):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                    init_lora_weights=False))
    batch = padded_batch()
    chunked, plain = loss_and_grads(model, batch, chunk_tokens=6), loss_and_grads(model, batch)
    assert all("lora_" in n for n in plain[1])
    assert worst(chunked, plain) <= (1e-5, 1e-5)


def test_lora_on_the_head_is_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="LlamaForCausalLM.lm_head is a Linear"):
        enable_chunked_loss(model)


def test_gradient_checkpointing_on_the_body():
    model = tiny_gpt2(vocab=VOCAB)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = padded_batch()
    assert worst(loss_and_grads(model, batch, chunk_tokens=8), loss_and_grads(model, batch)) <= (1e-5, 1e-5)


@pytest.mark.parametrize("name", ["llama-tied", "gpt2-tied"])
def test_bf16_autocast_is_close(name):
    """Under bf16 autocast the logits are bf16 as the plain head's, the loss fp32. The loss agrees with the plain
    head's to fp32 rounding (≤ 1e-5); the gradients to bf16 rounding, ≤ 2e-2 relative (the bf16 products are rounded
    per chunk and before the loss weight, not once over all tokens after it) — as far as bf16 itself moves the plain
    head's gradients from fp32's (~1e-2 here), and the chunked head is no further from fp32 than 1.5 × that."""
    model, batch = MODELS[name](), padded_batch()
    chunked = loss_and_grads(model, batch, chunk_tokens=7, autocast=True)
    plain = loss_and_grads(model, batch, autocast=True)
    fp32 = loss_and_grads(model, batch)
    assert chunked[0].dtype == plain[0].dtype == torch.float32
    loss_diff, grad_diff = worst(chunked, plain)
    assert loss_diff <= 1e-5 and grad_diff <= 2e-2
    assert worst(chunked, fp32)[1] <= 1.5 * worst(plain, fp32)[1]


def test_num_items_in_batch_and_shift_labels():
    """HF's other loss keywords: the sum over counted tokens ÷ num_items_in_batch; labels already shifted."""
    model, batch = tiny_llama(), padded_batch()
    for extra in ({"num_items_in_batch": torch.tensor(40)}, {"num_items_in_batch": 40}):
        kw = {**batch, **extra}
        assert worst(loss_and_grads(model, kw, chunk_tokens=7), loss_and_grads(model, kw)) <= (1e-5, 1e-5)
    shifted = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    kw = {**batch, "labels": batch["labels"].roll(1, 1), "shift_labels": shifted}
    assert worst(loss_and_grads(model, kw, chunk_tokens=7), loss_and_grads(model, batch)) <= (1e-5, 1e-5)


def test_no_counted_token_gives_zero_gradients():
    """Rows with nothing to predict: NaN loss as the plain head, and exact zeros once the loop multiplies it by 0."""
    model = tiny_gpt2(vocab=VOCAB).train()
    enable_chunked_loss(model)
    out = model(input_ids=torch.tensor([[5], [7]]), labels=torch.tensor([[5], [7]]))
    assert out.loss.isnan()
    (torch.nan_to_num(out.loss, 0.0, 0.0, 0.0) * 0.0).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# the check can fail


def test_a_wrong_chunk_reduction_or_unshifted_labels_fail_the_check():
    """Averaging chunk means (chunks hold unequal counted tokens) or predicting the same position is measurably off,
    at the tolerance the tests above use."""
    torch.manual_seed(0)
    h, w = torch.randn(25, 16), torch.randn(VOCAB, 16)
    y = torch.randint(0, VOCAB, (25,))
    y[3:9] = -100
    plain = F.cross_entropy(h @ w.T, y)
    assert abs(chunked_linear_cross_entropy(h, Head(w), y, chunk_tokens=7) / plain - 1) <= 1e-6
    chunk_means = torch.stack([F.cross_entropy(h[i:i + 7] @ w.T, y[i:i + 7]) for i in range(0, 25, 7)]).mean()
    assert abs(chunk_means / plain - 1) > 1e-3

    model, batch = tiny_llama(), padded_batch()
    hidden = model.train().model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
    right = causal_lm_loss(hidden, model.lm_head, batch["labels"], chunk_tokens=7)
    unshifted = causal_lm_loss(hidden, model.lm_head, batch["labels"], shift_labels=batch["labels"], chunk_tokens=7)
    assert abs(right / model(**batch).loss - 1) <= 1e-5
    # a random model's loss is about log(vocab) for any labels: its gradients tell the labels apart
    (grad_right,), (grad_unshifted,) = (torch.autograd.grad(loss, model.lm_head.weight) for loss in (right, unshifted))
    assert rel_diff(grad_unshifted, grad_right) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# when the plain forward runs, what is refused


def test_logits_when_they_are_needed_and_disable():
    model, batch = tiny_llama(), padded_batch()
    enable_chunked_loss(model, chunk_tokens=4)
    assert chunked_loss_enabled(model)
    assert model.train()(**batch).logits is None
    with torch.no_grad():
        assert model(**batch).logits.shape == (3, 13, VOCAB)
    assert model.eval()(**batch).logits.shape == (3, 13, VOCAB)
    assert model.train()(input_ids=batch["input_ids"]).logits.shape == (3, 13, VOCAB)
    loss, logits = model(**batch, return_dict=False)[:2]  # the tuple output: loss first, then past_key_values
    assert loss.dim() == 0 and logits is not None
    copy_ = copy.deepcopy(model)  # a copy runs its own weights
    copy_.lm_head.weight.data.zero_()
    assert model(**batch).loss != copy_(**batch).loss
    disable_chunked_loss(model)
    assert not chunked_loss_enabled(model) and model(**batch).logits is not None


def test_refused_models_name_their_class():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="^chunked loss: Gemma2ForCausalLM is not a model"):
        enable_chunked_loss(gemma2)
    custom = tiny_llama()
    custom.loss_function = lambda logits, labels, **kw: logits.mean()
    with pytest.raises(ValueError, match="LlamaForCausalLM has a custom loss_function"):
        enable_chunked_loss(custom)
    twice = enable_chunked_loss(tiny_llama())
    with pytest.raises(ValueError, match="already replaced"):
        enable_chunked_loss(twice)


def _forward_code(cls) -> str:
    """The statements of ``cls.forward`` after its signature and docstring, the class names masked."""
    src = re.sub(r'r?"""[\s\S]*?"""|#.*', "", inspect.getsource(cls.forward))
    src = src[src.index(") ->"):]
    return re.sub(r"\s+", " ", re.sub(r"\b[A-Z]\w*(Output|Config)\w*", "Cls", src))


def test_supported_classes_still_have_the_forward_this_head_reproduces():
    """A transformers upgrade that changes one of these forwards (say, logits scaled before the loss) fails here."""
    llama, gpt2 = _forward_code(transformers.LlamaForCausalLM), _forward_code(transformers.GPT2LMHeadModel)
    assert "logits = self.lm_head(hidden_states)" in llama and "self.loss_function(" in llama
    for name in SUPPORTED:
        assert _forward_code(getattr(transformers, name)) == (gpt2 if name == "GPT2LMHeadModel" else llama), name


# ---------------------------------------------------------------------------------------------------------------
# in the loop


def test_loop_accumulation_stays_exact_with_the_chunked_head():
    """(b, N) = (b·N, 1) with the chunked head, and both equal to the plain head's run: padded token batches, 17
    samples in windows of 6 (a tail window of 2 + 2 + 1)."""
    data = token_data(17, vocab=VOCAB)
    settings = dict(collate_fn=pad_collate, optimizer="sgd", learning_rate=0.5, max_grad_norm=None, n_epochs=1,
                    seed=3)
    plain_model = tiny_gpt2(vocab=VOCAB)
    chunked_model = enable_chunked_loss(copy_model(plain_model), chunk_tokens=5)
    small = test_fine_tuning(copy_model(chunked_model), train_data=data, batch_size=2, gradient_accumulation_steps=3,
                             **settings)
    big = test_fine_tuning(copy_model(chunked_model), train_data=data, batch_size=6, **settings)
    plain = test_fine_tuning(copy_model(plain_model), train_data=data, batch_size=6, chunked_loss=False, **settings)
    assert chunked_loss_enabled(small["model"])
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert rel_diff(big["model"], plain["model"]) <= 1e-5
    assert small["grad_norm_history"] == pytest.approx(plain["grad_norm_history"], rel=1e-5)
    assert small["loss_history"] == pytest.approx(plain["loss_history"], rel=1e-5)


def test_the_loop_turns_the_head_on_for_supported_causal_lms(capsys):
    """On by default where supported (the banner says so), off on request, refused with one line where asked for
    and impossible; the runs agree to fp32 rounding."""
    data = token_data(12, vocab=VOCAB)
    settings = dict(collate_fn=pad_collate, optimizer="sgd", learning_rate=0.5, max_grad_norm=None, batch_size=4,
                    gradient_accumulation_steps=3, seed=3)
    model = tiny_gpt2(vocab=VOCAB)
    chunked = test_fine_tuning(copy_model(model), train_data=data, **settings)
    assert chunked_loss_enabled(chunked["model"]) and "Loss head: chunked" in capsys.readouterr().out
    plain = test_fine_tuning(copy_model(model), train_data=data, chunked_loss=False, **settings)
    assert not chunked_loss_enabled(plain["model"]) and "Loss head: plain" in capsys.readouterr().out
    assert rel_diff(chunked["model"], plain["model"]) <= 1e-5
    from finetune import ConfigError
    from tests.helpers import MLP, regression_data

    with pytest.raises(ConfigError, match="training.chunked_loss: .*not a causal LM"):
        test_fine_tuning(MLP(), train_data=regression_data(8), batch_size=4, chunked_loss=True)
    with pytest.raises(ConfigError, match="training.activation_offloading: .*needs CUDA"):
        test_fine_tuning(MLP(), train_data=regression_data(8), batch_size=4, activation_offloading=True)
