"""Device memory on CUDA: the planner's prediction against ``torch.cuda.max_memory_allocated`` of a real step, and
what the chunked loss head and activation offloading take off the measured peak.

Every peak is measured the same way (``tests/gpu/common.py: train_and_measure``): two optimizer steps of the real
loop, AdamW, fp32, fixed-length samples; the most bytes allocated at any moment of the second step, above what was
allocated before the model came to the device.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from accelerate.utils import send_to_device

from finetune.config import TrainingConfig
from finetune.memory.measure import activation_bytes
from finetune.memory.plan import PlanRequest, make_plan
from tests.gpu import common
from tests.gpu.common import GPU, causal_lm_collate, causal_lm_data, release, train_and_measure

pytestmark = GPU

MiB = 2 ** 20


def predicted_step_peak(plan, micro_batch: int, accumulation: int) -> int:
    """The plan's step peak at ``micro_batch`` × ``accumulation`` in the setting it recommends (the loop's defaults:
    the chunked head on a causal LM): weights, gradients, optimizer state and the micro-batch's measured peak — saved
    activations, the loss head, backward's temporaries (``finetune.memory.plan``)."""
    return plan.predict(micro_batch, accumulation)


def _minilm():
    model, samples = common.minilm_classifier()
    return model, samples(32, 128), None, 8, 2          # 8 × 128 tokens, N = 2


def _gpt2():
    return common.gpt2(), causal_lm_data(32, 256, 8192), causal_lm_collate, 8, 2   # 8 × 256 tokens, N = 2


def _smollm2():
    model = common.smollm2()
    return model, causal_lm_data(8, 256, model.config.vocab_size), causal_lm_collate, 2, 2   # 2 × 256 tokens


PLAN_CASES = {"minilm": _minilm, "gpt2": _gpt2, "smollm2": _smollm2}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_planner_predicts_the_step_peak(name, figures, clean_cuda):
    """``make_plan`` (measuring activations on this GPU, with its kernels) predicts the peak of a steady optimizer
    step within ±10 % of ``torch.cuda.max_memory_allocated``. N = 2: from the second micro-batch on, the forward runs
    while the accumulated gradients are held, as the plan's sum assumes."""
    model, data, collate, b, n = PLAN_CASES[name]()
    collate = collate or torch.utils.data.default_collate
    planned = copy.deepcopy(model).cuda()
    batches = [send_to_device(collate(data[:k]), "cuda") for k in (max(b // 2, 1), b)]
    card = f"{torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.1f}GiB"
    plan = make_plan(planned, batches, PlanRequest(card, effective=b * n))
    del planned, batches
    release()
    measured, _ = train_and_measure(model, data, collate, b, n)
    predicted = predicted_step_peak(plan, b, n)
    fixed = plan.weights + plan.gradients + plan.optimizer
    error = predicted / measured - 1
    figures("predicted", f"{predicted / MiB:.0f} MiB")
    figures("measured", f"{measured / MiB:.0f} MiB")
    figures("error", f"{error:+.1%}", "±10 %")
    figures("above weights+grads+optimizer", f"{(predicted - fixed) / MiB:.0f} vs {(measured - fixed) / MiB:.0f} MiB")
    assert abs(error) <= 0.10, f"predicted {predicted / MiB:.0f} MiB, measured {measured / MiB:.0f} MiB ({error:+.1%})"


def test_chunked_loss_head_lowers_the_step_peak(figures, clean_cuda):
    """A causal LM whose logits dominate (49 152 words, SmolLM2's vocabulary, at 4 × 512 tokens: 384 MiB of fp32
    logits): with the chunked head the step's peak falls by at least one logits buffer — the plain head holds the
    log-softmax output and its gradient at once, the chunked one neither (on the CPU the drop was 2.4 buffers)."""
    loss_head = pytest.importorskip("finetune.models.loss_head", reason="needs finetune.models.loss_head")
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, b, length = 49152, 4, 512
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=length, tie_word_embeddings=False))
    data = causal_lm_data(b * 4, length, vocab)
    plain, result = train_and_measure(copy.deepcopy(model), data, causal_lm_collate, b, 2, chunked_loss=False)
    assert not loss_head.chunked_loss_enabled(result.model), \
        "the loop turned the chunked head on by itself: give the plain run the setting that turns it off"
    del result
    release()
    chunked, _ = train_and_measure(loss_head.enable_chunked_loss(copy.deepcopy(model)), data, causal_lm_collate,
                                   b, 2)
    logits = b * length * vocab * 4
    figures("plain", f"{plain / MiB:.0f} MiB")
    figures("chunked", f"{chunked / MiB:.0f} MiB")
    figures("saved", f"{(plain - chunked) / MiB:.0f} MiB", f"≥ {logits / MiB:.0f} MiB, the fp32 logits")
    assert chunked <= plain - logits, f"plain {plain / MiB:.0f} MiB, chunked {chunked / MiB:.0f} MiB"


def test_activation_offloading_lowers_the_step_peak(figures, clean_cuda):
    """A GPT-2 whose saved activations dominate the step (6 layers, 512 wide, 4 × 512 tokens, a 1 024-word
    vocabulary): offloading them to host memory lowers the peak by at least half of what autograd saves."""
    if "activation_offloading" not in {f.name for f in dataclasses.fields(TrainingConfig)}:
        pytest.skip("needs training.activation_offloading")
    model = common.gpt2(n_layer=6, n_embd=512, vocab=1024)
    data = causal_lm_data(16, 512, 1024)
    probe = copy.deepcopy(model).cuda()
    saved = activation_bytes(probe, send_to_device(causal_lm_collate(data[:4]), "cuda"))
    del probe
    release()
    plain, _ = train_and_measure(copy.deepcopy(model), data, causal_lm_collate, 4, 2, activation_offloading=False)
    release()
    offloaded, _ = train_and_measure(copy.deepcopy(model), data, causal_lm_collate, 4, 2, activation_offloading=True)
    figures("saved for backward", f"{saved / MiB:.0f} MiB")
    figures("plain", f"{plain / MiB:.0f} MiB")
    figures("offloaded", f"{offloaded / MiB:.0f} MiB", f"≤ plain − {saved / 2 / MiB:.0f} MiB")
    assert offloaded <= plain - saved / 2, f"plain {plain / MiB:.0f} MiB, offloaded {offloaded / MiB:.0f} MiB"


def test_plan_from_a_config_predicts_the_full_depth_step_peak(figures, clean_cuda, tmp_path):
    """``finetune plan --model-config``: a 12-block Llama (width 1024, vocabulary 32 000) under the clm recipe,
    planned from its config alone — the fixed part on the meta device, the micro-step measured on 2 blocks and
    carried on per block — against ``max_memory_allocated`` of two steps of the whole model built from the same
    config on this GPU (SGD with momentum, the recipe's own samples, micro-batch 4, N = 2)."""
    from transformers import LlamaConfig

    from finetune.loading import load_recipe
    from finetune.models.hf import stand_in
    from finetune.plan_command import plan_from_config
    from finetune.startup import build_job

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=512)
    config.save_pretrained(tmp_path)
    b, n = 4, 2
    cfg = load_recipe("clm-pydoc", ["training.effective_batch_size=8", f"training.batch_size={b}",
                                    "training.optimizer=sgd", "training.momentum=0.9"])
    card = f"{torch.cuda.get_device_properties(0).total_memory / 2 ** 30:.1f}GiB"
    predicted = plan_from_config(cfg, str(tmp_path), card).predict(b, n)
    with stand_in(config):
        job = build_job(cfg)
    longest = sorted(range(len(job.train_data)), key=job.length_of, reverse=True)[:1] * (2 * b * n)
    measured, _ = train_and_measure(job.model, [job.train_data[i] for i in longest], job.collate_fn, b, n,
                                    optimizer="sgd", momentum=0.9)
    error = predicted / measured - 1
    figures("predicted", f"{predicted / MiB:.0f} MiB")
    figures("measured", f"{measured / MiB:.0f} MiB")
    figures("error", f"{error:+.1%}", "±10 %")
    assert abs(error) <= 0.10, f"predicted {predicted / MiB:.0f} MiB, measured {measured / MiB:.0f} MiB ({error:+.1%})"
