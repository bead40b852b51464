"""benchmarks/gpu.py, the prepared GPU session, at its tiny size on the CPU, run as a user runs it: every section's
rows measured and named by their device, the JSON whole, and a row forced to fail written as failed, not dropped (the
negative control of the guard around each row). So the script cannot rot between GPU sessions."""

import importlib.util
import json
import math
import os
import subprocess
import sys

from tests.helpers import ROOT

# every row the script must write, by id (kept here, not read from the script: a row it stopped writing must show)
SPEED = [f"speed/{w}/{tool}" for w in ("1b-full", "8b-lora", "8b-qlora") for tool in ("finetune", "trl")]
SMALL = ["small/8b-qlora-16gib", "small/8b-lora-24gib"]
EXACT = {"exact/both-on": (True, True), "exact/fp32-sums-off": (False, True), "exact/pad-off": (True, False),
         "exact/both-off": (False, False)}
OFFLOAD = ["offload/1b-optimizer-16gib", "offload/1b-none-16gib"]
FP16 = ["fp16/1b-2x4", "fp16/1b-8x1-vs-2x4"]
PLAN = ["plan/1b-model-config"]
FORCED = "speed/8b-lora/trl"


def expected_status(row_id: str) -> str:
    """ok, or skipped where the row needs a package this environment lacks."""
    missing = [m for m in ("trl", "bitsandbytes", "deepspeed") if importlib.util.find_spec(m) is None]
    if ("trl" in missing and row_id.endswith("/trl")) or ("bitsandbytes" in missing and "qlora" in row_id) or \
            ("deepspeed" in missing and row_id == OFFLOAD[0]):
        return "skipped"
    return "ok"


def test_gpu_bench_tiny_writes_every_row(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--out", str(out), "--force-fail", FORCED],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((out / "rows.json").read_text())
    rows = {r["id"]: r for r in record["rows"]}
    assert list(rows) == [*SPEED, *SMALL, *EXACT, *OFFLOAD, *FP16, *PLAN], list(rows)
    assert record["device"].startswith("CPU only") and record["size"] == "tiny"
    assert {"torch", "transformers", "trl", "peft", "bitsandbytes", "deepspeed", "finetune"} <= set(record["versions"])
    for row_id, r in rows.items():
        assert r["device"] == record["device"], r
        assert f"{row_id}: " in proc.stdout, row_id  # a progress line per row
        assert r["label"] in (out / "table.md").read_text(), r["label"]

    # the negative control: failed with its reason, its traceback in the log, every other row measured
    forced = rows.pop(FORCED)
    assert forced["status"] == "failed" and "forced failure" in forced["reason"], forced
    assert "RuntimeError: forced failure" in (out / "log.txt").read_text()
    assert "**failed**: RuntimeError: forced failure" in (out / "table.md").read_text()
    for row_id, r in rows.items():
        assert r["status"] == expected_status(row_id), r
        if r["status"] == "skipped":
            assert "not installed" in r["reason"], r
            continue
        assert r["tokens_per_s"] > 0, r
        if r["section"] in ("speed", "exact", "small"):
            assert r["peak_bytes"] > 0 if r["section"] != "small" else r["peak_bytes"] is None, r

    # the small card: the injected cap bit (the planned micro-batch ran out of memory), the run settled and finished;
    # the planner's prediction at the micro-batch kept, the peak beside it said to be unmeasurable on a CPU
    for row_id in SMALL:
        r = rows[row_id]
        if r["status"] == "ok":
            assert r["oom_retries"] and r["micro_batch"] < r["planned_micro_batch"], r
            assert r["steps"] == r["steps_asked"] and r["predicted_bytes"] > 0, r
            assert "not measurable on cpu" in r["peak_over"], r

    # the price of exactness: each setting on and off, both layouts compared; the defaults' own ratio is 1, and
    # they hold (8,1) and (2,4) closer than the run without them
    for row_id, (sums, pad) in EXACT.items():
        r = rows[row_id]
        assert (r["fp32_grad_sums"], r["pad_to_window"]) == (sums, pad), r
        assert math.isfinite(r["loss_distance"]) and r["loss_distance"] >= 0, r
    assert rows["exact/both-on"]["tokens_per_s_vs_default"] == 1.0
    assert rows["exact/both-on"]["loss_distance"] < rows["exact/both-off"]["loss_distance"], \
        (rows["exact/both-on"], rows["exact/both-off"])

    # offload: the planner's recommendation for a 16 GiB card run with --offload optimizer in a process of its own;
    # its host RSS read beside the plan's host bytes, the card's peak said to be unmeasured on a CPU; the run without
    # offload at the same micro-batch, their tokens/s compared
    if rows[OFFLOAD[0]]["status"] == "ok":
        r = rows[OFFLOAD[0]]
        assert r["planned_host_bytes"] > 0 and r["planned_card_bytes"] > 0 and r["rss_grown_bytes"] > 0, r
        assert r["card_peak_bytes"] is None and "not measured on a CPU" in r["note"], r
        assert r["step_seconds"] > 0 and r["planned_host_step_seconds"] > 0, r  # measured beside the plan's price
        assert rows[OFFLOAD[1]]["micro_batch"] == r["micro_batch"], rows[OFFLOAD[1]]
        assert rows[OFFLOAD[1]]["offload_speed_ratio"] > 0, rows[OFFLOAD[1]]
    plain = rows[OFFLOAD[1]]
    assert plain["card_peak_bytes"] is None and plain["rss_peak_bytes"] > 0, plain
    # the run without offload under the injected cap (more than one sample out of memory): it ran out there and was
    # measured without the cap, and says so — the fall-back a real card takes when the 1B does not fit 16 GiB
    assert plain["uncapped"] == (plain["micro_batch"] > 1) and ("measured without it" in plain["note"]) == \
        plain["uncapped"], plain

    # fp16: the loss scale starts at the recipe's 2^16 and is logged every step; the two layouts compared with a
    # floor measured on a twin read equivalent (the verdict's negative controls under fp16: test_fp16_layouts.py)
    for row_id in FP16:
        r = rows[row_id]
        assert r["loss_scale_first"] == 2 ** 16 and r["steps"] == 3 and r["skipped_steps"] == len(r["skipped_at"]), r
    assert rows[FP16[1]]["verdict"].startswith("verdict: equivalent"), rows[FP16[1]]["verdict"]
    assert "floor measured" in rows[FP16[1]]["verdict"], rows[FP16[1]]["verdict"]

    # plan --model-config against the run of its recommendation: within the planner's tolerance of the allocator's
    # record over that run
    r = rows[PLAN[0]]
    assert 0.85 <= r["predicted_vs_measured"] <= 1.15, r
