"""``finetune plan --zero-stage``: what one process holds under DeepSpeed ZeRO 1, 2 and 3, planned against what
DeepSpeed allocates — two CPU processes over gloo, one ``accelerate launch`` of ``tests/zero_worker.py`` that trains
``zero_model`` under each stage in turn."""

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from finetune.memory.plan import PlanRequest, make_plan
from finetune.memory.sharded import Layout, Sizes, per_process, sizes_of
from finetune.memory.step import Setting
from tests import zero_worker
from tests.helpers import ACCELERATE, ENV, ROOT, TINY, assert_one_error_line

pytestmark = pytest.mark.usefixtures("frozen_heap")  # the planner's gc passes walk only this module's objects

PROCESSES = 2
# The planner prices what DeepSpeed allocates to within its alignment padding (a few bytes here)...
EXACT = 0.01
# ...and two parts as upper bounds (zero_memory: ZeRO-2's gradients of parameters across a share's edge, ZeRO-3's
# gathered weights, of which DeepSpeed frees the ones backward does not need): measured ≤ planned ≤ this much above
BOUND = 0.25
BOUNDS = {(2, "gradients"), (3, "gathered")}

CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
mixed_precision: 'no'
deepspeed_config:
  zero_stage: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
num_machines: 1
num_processes: 2
machine_rank: 0
use_cpu: false
rdzv_backend: static
same_network: true
"""


def free_port(first=29600, last=29699) -> int:
    for port in range(first, last + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{last}")


def launch_worker(folder: Path) -> dict:
    """{stage: [what each process held]} from one launch of two DeepSpeed processes (zero_worker's docstring)."""
    config = folder / "deepspeed.yaml"
    config.write_text(CONFIG)
    proc = subprocess.run([ACCELERATE, "launch", "--config_file", str(config), "--main_process_port",
                           str(free_port()), str(ROOT / "tests" / "zero_worker.py"), str(folder), "1,2,3"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    return {stage["stage"]: [rank[i] for rank in ranks] for i, stage in enumerate(ranks[0])}


@pytest.fixture(scope="module")
def deepspeed_held(tmp_path_factory) -> dict:
    return launch_worker(tmp_path_factory.mktemp("zero"))


def busiest(ranks: list) -> dict:
    """Each part as the process holding most of it holds it: the weights and the optimizer's state (with the fp32
    partition copy) as a step begins, the gradients through the window and at its step, the buckets at any moment,
    the gathered weights at the end of a forward, and what no part names."""
    at = lambda moments, key: max(key(r[m]) for r in ranks for m in moments)  # noqa: E731
    return {"weights": at(["step"], lambda h: h["weights"]),
            "optimizer state": at(["step"], lambda h: h["master"] + h["state"]),
            "gradients": at(["window", "step"], lambda h: h["gradients"]),
            "buckets": at(["window", "step", "backward"], lambda h: h["buckets"]),
            "gathered": max(r["gathered"] for r in ranks),
            "unnamed": at(["window", "step"], lambda h: h["other"])}


def whole_profile():
    """The planner's profile of ``zero_model`` with one process holding everything (what ``per_process`` spreads)."""
    return planned_profile(Layout())


def planned_profile(layout: Layout):
    batches = [zero_worker.batch(1), zero_worker.batch(2)]
    plan = make_plan(zero_worker.zero_model(), batches, PlanRequest("80GiB", 8, zero_worker.TRAINING, layout))
    return plan.profile(Setting())


def parts(profile) -> dict:
    return {"weights": profile.weights, "optimizer state": profile.optimizer_state, "gradients": profile.gradients,
            "buckets": profile.buckets, "gathered": profile.gathered}


def misses(planned: dict, measured: dict, stage: int) -> dict:
    """The parts where ``planned`` disagrees with ``measured`` (name → (planned, measured)), by EXACT, or by BOUND
    for the parts the planner bounds."""
    out = {}
    for name, value in planned.items():
        m = measured[name]
        ok = m <= value <= m * (1 + BOUND) if (stage, name) in BOUNDS else abs(value - m) <= EXACT * max(m, 1)
        if not ok:
            out[name] = (value, m)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_planned_per_process_memory_is_what_deepspeed_holds(deepspeed_held, stage):
    measured = busiest(deepspeed_held[stage])
    assert measured["unnamed"] <= 1024, measured  # every tensor the processes hold is in a part
    planned = parts(planned_profile(Layout(PROCESSES, stage)))
    assert not misses(planned, measured, stage), (planned, measured)
    assert (planned["gathered"] > 0) == (stage == 3) and planned["buckets"] > planned["weights"]


def test_each_layout_detail_matters(deepspeed_held):
    """Negative controls: every process holding everything (DDP's count, stage 0) misses ZeRO-3's weights,
    optimizer state, gradients and buckets; ZeRO-3 without the parameters it keeps whole misses its weights; ZeRO-2
    without the gradients across a share's edge falls below its busiest process."""
    zero3 = busiest(deepspeed_held[3])
    ddp = misses(parts(planned_profile(Layout(PROCESSES, 0))), zero3, 3)
    assert {"weights", "optimizer state", "gradients", "buckets"} <= set(ddp), ddp

    whole, sizes = whole_profile(), sizes_of(zero_worker.zero_model())
    assert sizes.kept_whole > 0 and sizes.largest_trainable > 0
    no_kept = per_process(whole, Layout(PROCESSES, 3), Sizes(largest_trainable=sizes.largest_trainable))
    assert "weights" in misses(parts(no_kept), zero3, 3)
    zero2 = busiest(deepspeed_held[2])
    no_edges = per_process(whole, Layout(PROCESSES, 2), Sizes(kept_whole=sizes.kept_whole))
    assert no_edges.gradients < zero2["gradients"], (no_edges.gradients, zero2["gradients"])


def test_plan_table_names_the_layout():
    table = make_plan(zero_worker.zero_model(), [zero_worker.batch(1), zero_worker.batch(2)],
                      PlanRequest("80GiB", 8, zero_worker.TRAINING, Layout(PROCESSES, 3))).table()
    assert table.startswith("per process: 2 processes, DeepSpeed ZeRO-3: optimizer state, gradients and parameters")
    assert "DeepSpeed reduce bucket" in table and "gathered weights" in table
    ddp = make_plan(zero_worker.zero_model(), [zero_worker.batch(1), zero_worker.batch(2)],
                    PlanRequest("80GiB", 8, zero_worker.TRAINING, Layout(PROCESSES, 0))).table()
    assert ddp.startswith("per process: 2 processes, DDP") and "DDP gradient buckets" in ddp
    assert "DeepSpeed" not in ddp


@pytest.mark.parametrize("value", ["4", "two", "-1"])
def test_zero_stage_refused_with_one_line(value):
    proc = subprocess.run([sys.executable, "-m", "finetune", "plan", "--recipe", TINY, "--gpu", "t4",
                           f"--zero-stage={value}"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert_one_error_line(proc.stderr, f"--zero-stage: got {value!r}; one of 0 (DDP), 1 (DeepSpeed ZeRO-1), "
                                       "2 (DeepSpeed ZeRO-2), 3 (DeepSpeed ZeRO-3)")


def report() -> str:
    """The table docs/memory.md shows: planned and measured bytes of the busiest process, per stage."""
    with tempfile.TemporaryDirectory() as tmp:
        held = launch_worker(Path(tmp))
    rows = ["| stage | part | planned | measured (busiest process) |", "|---|---|---|---|"]
    for stage in (1, 2, 3):
        measured = busiest(held[stage])
        for name, value in parts(planned_profile(Layout(PROCESSES, stage))).items():
            rows.append(f"| ZeRO-{stage} | {name} | {value:,} | {measured[name]:,} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m tests.test_zero_memory
    print(report())
