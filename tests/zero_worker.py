"""Run by tests/test_zero_memory.py under ``accelerate launch`` (2 processes, DeepSpeed over gloo on the CPU).

For each ZeRO stage named on the command line, one after the other in this launch, it trains ``zero_model`` for two
windows of two micro-batches through Accelerate's DeepSpeed engine (fp32, finetune's AdamW) and records the bytes
this process holds that it did not hold before the model was built:

* ``window``: after the second window's first backward (the window's gradients held, the optimizer's state too);
* ``backward``: inside a backward, once every parameter after the first block has its gradient;
* ``step``: as the second window's optimizer step begins;
* ``gathered``: ZeRO-3's gathered (whole) parameters at the end of a forward.

Each is split by where DeepSpeed keeps it (``held``): the parameters (ZeRO-3: with their partitions), the fp32
partition copy, the optimizer's state, the reduce buckets, the gradients, and every other tensor Python can reach.
(The allocator's own record is no help here: gloo's threads free a collective's buffers, and torch's profiler does
not see frees on other threads.) Usage: ``zero_worker.py OUT_DIR STAGE[,STAGE…]``; rank r writes
``OUT_DIR/rank{r}.json``.
"""

import gc
import json
import sys
from pathlib import Path

import torch

from finetune.config import TrainingConfig

MICRO_BATCH = 4
TRAINING = TrainingConfig(learning_rate=1e-3)  # finetune's AdamW (fused), fp32


class ZeroModel(torch.nn.Module):
    """A regression MLP with a frozen first layer (``inp``: a partitioned weight that never has a gradient), six
    trainable 384 × 384 layers (147 456 elements each: ZeRO-3 partitions them), and tensors under ZeRO-3's
    persistence threshold of 100 000 elements, which it keeps whole on every process: the biases, ``out``
    (384 × 256) and ``last`` (256 × 256), about a fifth of the weights."""

    def __init__(self, width=384, depth=6):
        super().__init__()
        self.inp = torch.nn.Linear(width, width).requires_grad_(False)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])
        self.out, self.last, self.head = torch.nn.Linear(width, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in [*self.blocks, self.out, self.last]:
            h = torch.tanh(layer(h))
        return {"loss": torch.nn.functional.mse_loss(self.head(h).squeeze(-1), y)}


def zero_model() -> ZeroModel:
    torch.manual_seed(0)
    return ZeroModel()


def batch(n: int = MICRO_BATCH, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 384, generator=g), "y": torch.randn(n, generator=g)}


def storages(tensors) -> dict:
    """{data_ptr: bytes} of the CPU storages under ``tensors`` (a view brings its whole storage), each once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes()}


def live_tensors() -> list:
    """Every tensor Python can reach now (the garbage collected first)."""
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]


def flat_list(value) -> list:
    """The tensors in ``value``: a tensor, a list of them, or a dict of lists (DeepSpeed's gradient records)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    return [t for v in (value or []) for t in flat_list(v)] if isinstance(value, (list, tuple)) else []


def held(engine, before: dict) -> dict:
    """Bytes this process holds now that it did not hold in ``before``, by where DeepSpeed keeps them: the
    parameters (ZeRO-3: their partitions too), the fp32 partition copy, the optimizer's state, the reduce buckets,
    the gradients (the parameters' own, and DeepSpeed's gradient partitions), and ``other``: any other tensor Python
    can reach. Each storage is counted once, in the first part that names it."""
    zero, params = engine.optimizer, list(engine.module.parameters())
    master = flat_list(getattr(zero, "single_partition_of_fp32_groups", None)
                       or getattr(zero, "fp32_partitioned_groups_flat", None))
    named = {"weights": [p.data for p in params] + [getattr(p, "ds_tensor", None) for p in params],
             "master": master,
             "state": [v for s in zero.optimizer.state.values() for v in s.values()],
             "buckets": [b for bucket in zero.ipg_buckets.values() for b in flat_list(bucket.buffer)],
             "gradients": [p.grad for p in params] + [m.grad for m in master] + flat_list(
                 [getattr(zero, name, None) for name in ("averaged_gradients", "all_grad_tensors",
                                                         "grads_in_partition", "grad_partitions_flat_buffer")]),
             "other": live_tensors()}
    out, seen = {}, set(before)
    for part, tensors in named.items():
        found = {ptr: n for ptr, n in storages(tensors).items() if ptr not in seen}
        seen |= set(found)
        out[part] = sum(found.values())
    return out


def gathered_bytes(engine) -> int:
    """Bytes of ZeRO-3 parameters that are whole right now, besides those it keeps whole anyway (0 for ZeRO-1/2)."""
    return sum(p.data.numel() * p.element_size() for p in engine.module.parameters()
               if hasattr(p, "ds_numel") and not p.ds_persist and p.data.numel() == p.ds_numel)


def deepspeed_engine(stage: int, model):
    """``model`` and finetune's AdamW prepared by a fresh Accelerator with DeepSpeed ZeRO ``stage``, on the CPU over
    gloo: (accelerator, engine, optimizer)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from finetune.optim import make_optimizer

    AcceleratorState._reset_state(reset_partial_state=False)  # a new DeepSpeed plugin for each stage, one launch
    accelerator = Accelerator(cpu=False, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
                              deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, zero3_init_flag=False))
    accelerator.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = MICRO_BATCH
    accelerator.deepspeed_plugin.deepspeed_config["gradient_clipping"] = 0.0
    engine, optimizer = accelerator.prepare(model, make_optimizer(model, TRAINING))
    return accelerator, engine, optimizer


def measure(stage: int, rank: int) -> dict:
    """Two windows of two micro-batches under ZeRO ``stage``: what this process holds (see the docstring)."""
    batches = [batch(seed=10 * rank + i) for i in range(4)]
    kept = live_tensors()  # held (so no new storage can take an address) and left out of every count
    before = storages(kept)
    accelerator, engine, optimizer = deepspeed_engine(stage, zero_model())
    out, step = {"stage": stage}, engine.step

    def step_measured(*args, **kwargs):
        out["step"] = held(engine, before)
        return step(*args, **kwargs)

    def in_backward(output):  # the first block's output: backward is past every later parameter
        output.register_hook(lambda _: out.__setitem__("backward", held(engine, before)))

    hooks = [engine.module.head.register_forward_hook(lambda *_: out.__setitem__("gathered", gathered_bytes(engine))),
             engine.module.blocks[0].register_forward_hook(lambda _, __, output: in_backward(output))]
    for window in range(2):
        engine.step = step_measured if window == 1 else step  # the optimizer's state exists from the first step on
        for micro in range(2):
            loss = engine(**batches[2 * window + micro])["loss"]
            accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=micro == 1)
            del loss
            if window == 1 and micro == 0:
                out["window"] = held(engine, before)
    for hook in hooks:
        hook.remove()
    engine.step = step
    accelerator.free_memory(engine, optimizer)
    return out


def main(out_dir: str, stages: str) -> None:
    from accelerate.state import PartialState

    state = PartialState(cpu=False, backend="gloo")
    results = [measure(int(s), state.process_index) for s in stages.split(",")]
    Path(out_dir, f"rank{state.process_index}.json").write_text(json.dumps(results))
    state.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:])
