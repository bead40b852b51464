"""QLoRA on CUDA: the sft recipe with an NF4 base, quantized as it loads straight onto the GPU, takes the steps of
the big batch — to 1e-5 of the adapters in fp32 compute, within bf16's bound of the update under bf16 autocast
(``tests/gpu/test_precision.py`` says where the bounds come from)."""

from __future__ import annotations

import pytest
import torch

from finetune.loading import load_recipe
from finetune.models import precision
from finetune.startup import build_job
from tests.gpu.common import GPU, flat, rel_diff, update_share
from tests.helpers import EXACT, SMALL, tiny_chat_assets, train_quietly

pytestmark = GPU
TOLERANCE = {"no": 1e-5, "bf16": 5e-2}


def run(b: int, n: int, mixed_precision: str):
    tiny_chat_assets()
    cfg = load_recipe("sft-smollm2", [*SMALL["sft-smollm2"], *EXACT, f"training.batch_size={b}",
                                      f"training.gradient_accumulation_steps={n}", "training.learning_rate=0.5",
                                      "training.eval_at_start=false", "model.generate_prompts=0", "peft.enabled=true",
                                      "model.quantization=nf4", f"training.mixed_precision={mixed_precision}"])
    job = build_job(cfg)
    job.val_data = None
    start = flat(job.model, trainable_only=True)
    return train_quietly(job, cfg.training), start


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"], ids=["fp32", "bf16"])
def test_qlora_accumulates_like_the_big_batch(mixed_precision, figures, ieee_fp32):
    pytest.importorskip("bitsandbytes")
    if mixed_precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16 (compute capability < 8.0)")
    small, start = run(3, 3, mixed_precision)
    big, _ = run(9, 1, mixed_precision)
    quantized = [p for p in small.model.parameters() if precision.is_quantized(p)]
    assert quantized and all(p.is_cuda for p in quantized)  # loaded and kept 4-bit on the GPU
    w_small, w_big = flat(small.model, trainable_only=True), flat(big.model, trainable_only=True)
    if mixed_precision == "no":
        weights = rel_diff(w_small, w_big)
        figures("adapters", weights, f"≤ {TOLERANCE['no']:g}")
        assert weights <= TOLERANCE["no"], weights
    else:
        share = update_share(w_small, w_big, start)
        figures("of the update", share, f"≤ {TOLERANCE['bf16']:g}")
        assert share <= TOLERANCE["bf16"], share
