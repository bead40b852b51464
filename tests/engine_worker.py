"""Run by tests/test_engines.py: finetune's windows under a sharding engine on 2 CPU processes.

``python -m tests.engine_worker OUT.json ENGINE CASE[,CASE…]`` under ``accelerate launch``: ENGINE is ``deepspeed``
(the launch config names the ZeRO stage) or ``fsdp2`` (DDP launch; the worker shards the model with torch's
``fully_shard`` on a CPU mesh over gloo, the way FSDP2 runs without GPUs). Each case trains with SGD at (b, N) per
process and writes, from the main process, the whole final weights and the per-step history. The test compares them
with one process taking the big-batch step (b · N · 2, 1).
"""

import contextlib
import json
import sys
from unittest import mock

import torch
from torch.utils.data import default_collate

from finetune import distributed, steps, test_fine_tuning
from finetune.models.forward import shards_weights
from tests.helpers import MLP, pad_collate, regression_data, tiny_gpt2, token_data

# 41 samples, B = 12 = 3 × 2 × 2: the last window of 5 splits 3 / 2 over the ranks (a short last window)
# 27 token sequences, B = 8 = 2 × 2 × 2: label-token counts differ per micro-batch, per rank and in the tail
CASES = {
    "mlp": dict(data=lambda: regression_data(41), model=lambda: MLP(), b=3, n=2, kw={}, lr=0.3),
    "gpt2": dict(data=lambda: token_data(27), model=lambda: tiny_gpt2(), b=2, n=2,
                 kw={"collate_fn": pad_collate, "packing": False}, lr=0.5),
}
# negative controls: what a loop gets wrong that finetune's must not
CONTROLS = {
    # each micro-batch's mean loss divided by N (Accelerate's accumulate()): wrong for a short tail window
    "per_micro_batch_mean": lambda case: mock.patch.object(steps, "loss_weight",
                                                           lambda items, window, processes: 1 / case["n"]),
    # the clipping Accelerate fills in for DeepSpeed when the config leaves it out: 1.0, though the recipe has none
    "accelerate_clipping": lambda case: mock.patch.object(distributed, "deepspeed_clipping",
                                                          lambda max_grad_norm: "auto"),
}


def shard(model):
    """FSDP2 on the CPU: each block, then the root, fully sharded over the processes (a gloo mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (distributed.process_group().num_processes,))
    blocks = model.transformer.h if hasattr(model, "transformer") else [model.net[0], model.net[2]]
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def whole_weights(model) -> list:
    """Every parameter, gathered whole (a collective under FSDP2 / ZeRO-3), flattened in a fixed order."""
    with distributed.whole_model(model):
        return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).tolist()


def run(engine, name, control=None, processes=2, max_grad_norm=None):
    case = CASES[name]
    with CONTROLS[control](case) if control else contextlib.nullcontext():
        return train(engine, case, processes, max_grad_norm)


def train(engine, case, processes, max_grad_norm):
    torch.manual_seed(0)
    model = case["model"]()
    if engine == "fsdp2":
        model = shard(model)
    n = case["n"] if processes > 1 else 1
    b = case["b"] if processes > 1 else case["b"] * case["n"] * 2  # one process: the big batch, one micro-batch
    seen = []  # whether each step's weights were sharded on this process
    result = test_fine_tuning(model, train_data=case["data"](), batch_size=b, gradient_accumulation_steps=n,
                              optimizer="sgd", learning_rate=case["lr"], max_grad_norm=max_grad_norm, n_epochs=2,
                              seed=11, after_step=lambda state, m: seen.append(sharded(m)), **case["kw"])
    return {"weights": whole_weights(result["model"]), "history": [{k: v for k, v in h.items() if k != "seconds"}
                                                                   for h in result["history"]],
            "effective": result["effective_batch_size"], "processes": result["accelerator"].num_processes,
            "engine": str(result["accelerator"].distributed_type), "sharded": all(seen),
            "alone": forward_alone(result["model"], case)}


def forward_alone(model, case) -> float:
    """The main process runs a forward on its own (what saving and a generated sample do after a run): it must not
    wait on the others. Returns the loss (every process takes part in the context, only the main one computes)."""
    batch = (case["kw"].get("collate_fn") or default_collate)(case["data"]()[:2])
    with distributed.whole_model(model), torch.no_grad():
        return float(model(**batch)["loss"]) if distributed.is_main_process() else 0.0


def sharded(model) -> bool:
    """Whether this process keeps only a part of the weights: ZeRO-3's partitions (a tensor as small as these
    models' stays gathered between steps too, below DeepSpeed's persistence threshold, but its partition is still
    what the process owns and updates) or FSDP2's shards."""
    return shards_weights(model) or any(
        hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in model.parameters())


if __name__ == "__main__":
    out, engine, specs = sys.argv[1], sys.argv[2], sys.argv[3].split(",")  # CASE or CASE:CONTROL
    results = {spec: run(engine, *spec.partition(":")[::2]) for spec in specs}
    if distributed.is_main_process():
        with open(out, "w") as f:
            json.dump(results, f)
