"""The row guard, the meters and the report of ``benchmarks/gpu.py``: each row measured in its own guard (ok,
skipped or failed with the reason, past its section's time), the peak of a block (``Peak``), the planner's profile
of a ``batch_size: auto`` run, the header (device, versions, date, command) and the tables, all rewritten after
every row."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import common as C
import torch

from finetune.distributed import restart_accelerate_state
from finetune.memory.measure import PeakMeter

GiB, MiB = 2 ** 30, 2 ** 20
# dense bf16 peak of NVIDIA's data sheets, by the name torch.cuda.get_device_name gives (first match wins)
BF16_PEAK = (("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12))


class Skip(Exception):
    """A row that cannot run here (a package missing): written as skipped, with the reason."""


class OverBudget(BaseException):
    """A row past its section's time (a BaseException: library code that catches Exception lets it through)."""


def needs(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} is not installed ({why})")


def release() -> None:
    """Free what the last row left: unreachable tensors and the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()



class Peak:
    """The most bytes allocated during the block, weights included. CUDA: ``max_memory_allocated`` since the block
    began (everything the process holds; ``restart()`` starts the record again, e.g. at a steady step); CPU: the
    allocator's record (``PeakMeter``) above the start, plus what ``model`` held then."""

    def __init__(self, device: torch.device, model=None):
        self.cuda, self.model, self.bytes = device.type == "cuda", model, 0

    def __enter__(self):
        if self.cuda:
            self.restart()
        else:
            import memory  # benchmarks/memory.py: the weights with a 4-bit layer's scales and code books

            self.held = memory.weight_bytes(self.model) if self.model is not None else 0
            self.meter = PeakMeter("cpu").__enter__()
        return self

    def restart(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated()
        else:
            self.meter.__exit__(*exc)
            self.bytes = self.held + self.meter.peak
        return False


@contextlib.contextmanager
def spy_auto_profile(box: dict):
    """Keep the Profile ``batch_size: auto`` picks its micro-batch from (``finetune.memory.step.auto_profile``, which
    ``AutoBatch.initial_shape`` imports when it runs), so that the planner's prediction can be read at the micro-batch
    the run kept, in bytes, rather than at the one it planned, rounded in its printed line."""
    from finetune.memory import step

    real = step.auto_profile

    def kept(*args, **kwargs):
        box["profile"] = real(*args, **kwargs)
        return box["profile"]

    step.auto_profile = kept
    try:
        yield box
    finally:
        step.auto_profile = real


def bf16_peak(device: torch.device):
    """Dense bf16 FLOP/s of the card (None: not a card in ``BF16_PEAK``, or a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in BF16_PEAK if key in name), None)


# ---------------------------------------------------------------------------------------------------------------
# the rows


class Bench:
    """The rows of one run: each measured in its own guard, written (table, JSON, log) after every row."""

    def __init__(self, args, size, device: torch.device):
        self.args, self.size, self.device = args, size, device
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "log.txt", "w")
        self.start = time.perf_counter()
        self.deadline = self.start + (args.budget or size.budget)
        self.rows: list = []
        self.header = header(device, args)
        self.say("# " + self.header["line"])

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def row(self, section: str, row_id: str, label: str, measure, until: float) -> dict:
        """Run ``measure()`` (→ the row's figures) under the section's deadline ``until``; record it as ok, failed
        (with the exception's first line) or skipped."""
        full_id = f"{section}/{row_id}"
        record = {"id": full_id, "section": section, "label": label, "device": self.header["device"]}
        left = min(until, self.deadline) - time.perf_counter()
        captured = io.StringIO()
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # what an earlier row left behind would count in this row's peak
            record["allocated_at_start_bytes"] = torch.cuda.memory_allocated(self.device)
        if left <= 1:
            record.update(status="skipped", reason=f"time budget spent ({self.elapsed():.0f} s of "
                                                    f"{self.deadline - self.start:.0f} s)")
        else:
            try:
                with alarm(left), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                    if full_id in self.args.force_fail:
                        raise RuntimeError("forced failure (--force-fail), the negative control")
                    restart_accelerate_state()  # each row starts from a fresh Accelerate, as in its own process
                    record.update(status="ok", **measure())
            except Skip as e:
                record.update(status="skipped", reason=str(e))
            except (Exception, OverBudget) as e:  # noqa: BLE001  (a row's failure, out of memory too, is its result)
                reason = "over its section's time budget" if isinstance(e, OverBudget) else \
                    f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                record.update(status="failed", reason=reason)
                captured.write(traceback.format_exc())
            finally:
                release()
        record["seconds"] = round(time.perf_counter() - t0, 1)
        self.rows.append(record)
        self.log.write(f"--- {full_id} ({record['status']}, {record['seconds']} s)\n{captured.getvalue()}\n")
        self.say(f"[{self.elapsed():6.1f} s] {full_id}: {progress(record)}")
        self.write()
        return record

    def write(self) -> list:
        """Write the table and the JSON of the rows so far (with the ratios derived from them); return those rows."""
        rows = with_ratios(self.rows)
        record = {**self.header, "size": self.args.size, "seconds": round(self.elapsed(), 1), "rows": rows}
        (self.out / "rows.json").write_text(json.dumps(record, indent=1))
        (self.out / "table.md").write_text(tables(self.header, rows, self.args.size))
        return rows


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise OverBudget in the main thread after ``seconds`` (checked between Python bytecodes: a CUDA step
    returns within seconds)."""
    def ring(signum, frame):
        raise OverBudget()

    before = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def with_ratios(rows: list) -> list:
    """``rows``, each exactness row with its tokens/s and peak over the defaults' (both on) where both were
    measured (new dicts: the measured rows stay as they were recorded)."""
    base = next((r for r in rows if r["id"] == "exact/both-on" and r["status"] == "ok"), None)
    if base is None:
        return rows
    return [{**r, "tokens_per_s_vs_default": r["tokens_per_s"] / base["tokens_per_s"],
             "peak_vs_default": r["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else None}
            if r["section"] == "exact" and r["status"] == "ok" else r for r in rows]


# ---------------------------------------------------------------------------------------------------------------
# reporting


def version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def header(device: torch.device, args) -> dict:
    import finetune

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU only ({os.cpu_count()} cores)"
    try:
        commit = subprocess.run(["git", "-C", str(C.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "no git"
    except (OSError, subprocess.SubprocessError):
        commit = "no git"
    versions = {"torch": torch.__version__, **{name: version(name) for name in (
        "transformers", "accelerate", "trl", "peft", "bitsandbytes", "liger-kernel", "datasets", "deepspeed")},
        "finetune": f"{finetune.__version__} ({commit})"}
    date = time.strftime("%Y-%m-%d %H:%M")
    command = "python benchmarks/gpu.py " + " ".join(sys.argv[1:])
    line = f"{name}; " + ", ".join(f"{k} {v}" for k, v in versions.items()) + f"; {date}; `{command}`"
    return {"device": name, "versions": versions, "date": date, "command": command, "line": line,
            "bf16_peak_flops": bf16_peak(device)}


def mem(x) -> str:
    return "—" if x is None else x if isinstance(x, str) else f"{x / GiB:.2f} GiB" if x >= GiB else \
        f"{x / MiB:.1f} MiB"


def num(x, fmt: str = ".0f") -> str:
    return "—" if x is None else format(x, fmt)


def progress(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}"
    parts = [f"{r['tokens_per_s']:.0f} tokens/s" if r.get("tokens_per_s") else None,
             f"MFU {r['mfu']:.1%}" if r.get("mfu") else None,
             f"peak {mem(r['peak_bytes'])}" if r.get("peak_bytes") else None,
             f"predicted {mem(r['predicted_bytes'])}" if r.get("predicted_bytes") else None,
             f"micro-batch {r['micro_batch']} × {r['accumulation']}" if r["section"] == "small" else None,
             f"loss distance {r['loss_distance']:.1e}" if "loss_distance" in r else None,
             f"card peak {mem(r['card_peak_bytes'])}" if r.get("card_peak_bytes") else None,
             f"planned card {mem(r['planned_card_bytes'])}" if "planned_card_bytes" in r else None,
             f"RSS grown {mem(r['rss_grown_bytes'])}" if "rss_grown_bytes" in r else None,
             f"planned host {mem(r['planned_host_bytes'])}" if "planned_host_bytes" in r else None,
             f"{r['skipped_steps']} skipped, loss scale {r['loss_scale_first']:g} → {r['loss_scale_last']:g}"
             if "skipped_steps" in r else None,
             r["verdict"].partition(" — ")[0] if "verdict" in r else None]
    return "ok — " + ", ".join(p for p in parts if p)


def status(r: dict) -> str:
    return "ok" if r["status"] == "ok" else f"**{r['status']}**: {r['reason']}"


def tables(head: dict, rows: list, size: str) -> str:
    peak = head["bf16_peak_flops"]
    mfu = f"MFU against {peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "no MFU (no bf16 peak known for this device)"
    out = [f"# GPU session: {head['device']}", "", head["line"], "",
           f"Size: {size}. {mfu}; FLOPs 6·N + 12·L·H·s a trained token (benchmarks/gpu.py).", *(
               ["", "Tiny: two-layer Llamas 64 wide at 64 tokens stand in for the 1B / 8B shapes; the numbers show "
                "that every row runs, not how fast anything is."] if size == "tiny" else []), ""]
    speed = [r for r in rows if r["section"] == "speed"]
    if speed:
        out += ["## Speed beside TRL's SFTTrainer", "", C.table(
            ["workload · tool", "micro-batch × N", "tokens/s", "MFU", "peak memory", "status", "note"],
            [[r["label"], f"{r['micro_batch']} × {r['accumulation']}" if r["status"] == "ok" else "—",
              num(r.get("tokens_per_s")), num(r.get("mfu") and 100 * r["mfu"], ".1f") + (" %" if r.get("mfu") else ""),
              mem(r.get("peak_bytes")), status(r), r.get("note", "")] for r in speed]), ""]
    small = [r for r in rows if r["section"] == "small"]
    if small:
        out += ["## The small card: `batch_size: auto` under a cap", "", C.table(
            ["run", "cap", "planned micro-batch", "out of memory at", "kept", "predicted peak (kept)",
             "measured peak", "predicted ÷ measured", "steps", "tokens/s", "status"],
            [[r["label"], r.get("cap", "—"), num(r.get("planned_micro_batch")),
              ", ".join(map(str, r.get("oom_retries") or [])) or "—",
              f"{r['micro_batch']} × {r['accumulation']}" if r["status"] == "ok" else "—",
              mem(r.get("predicted_bytes")),
              mem(r.get("peak_bytes") or ("not measurable on cpu" if r["status"] == "ok" else None)),
              num(r.get("predicted_bytes") and r.get("peak_bytes") and r["predicted_bytes"] / r["peak_bytes"], ".3f"),
              f"{r['steps']} of {r['steps_asked']}" if r["status"] == "ok" else "—", num(r.get("tokens_per_s")),
              status(r)] for r in small]), ""]
    exact = [r for r in rows if r["section"] == "exact"]
    if exact:
        out += ["## The price of exactness (1B full fine-tuning, bf16, unpacked)", "", C.table(
            ["setting", "tokens/s at (2, 4)", "× default", "peak memory", "× default",
             "loss distance (8,1) vs (2,4)", "grad-norm distance", "padded share", "status"],
            [[r["label"], num(r.get("tokens_per_s")), num(r.get("tokens_per_s_vs_default"), ".3f"),
              mem(r.get("peak_bytes")), num(r.get("peak_vs_default"), ".3f"), num(r.get("loss_distance"), ".1e"),
              num(r.get("grad_norm_distance"), ".1e"), num(r.get("padded_share") and 100 * r["padded_share"], ".0f")
              + (" %" if r.get("padded_share") else ""), status(r)] for r in exact]), ""]
    return "\n".join(out + cli_tables(rows))


def ratio(a, b) -> str:
    return num(a / b, ".3f") if a and b else "—"


def cli_tables(rows: list) -> list:
    """The tables of the rows that run finetune's commands (``gpu_cli``): offload, fp16, plan."""
    out = []
    offload = [r for r in rows if r["section"] == "offload"]
    if offload:
        out += ["## A 1B full fine-tune on a 16 GiB card: optimizer offload against the plan", "", C.table(
            ["run", "micro-batch × N", "card peak", "plan: card", "peak ÷ plan", "RSS peak", "RSS grown",
             "plan: host", "grown ÷ plan", "tokens/s", "s a step", "plan: host step s", "status", "note"],
            [[r["label"], f"{r['micro_batch']} × {r['accumulation']}" if r["status"] == "ok" else "—",
              mem(r.get("card_peak_bytes") or ("not on a CPU" if r["status"] == "ok" else None)),
              mem(r.get("planned_card_bytes")), ratio(r.get("card_peak_bytes"), r.get("planned_card_bytes")),
              mem(r.get("rss_peak_bytes")), mem(r.get("rss_grown_bytes")), mem(r.get("planned_host_bytes")),
              ratio(r.get("rss_grown_bytes"), r.get("planned_host_bytes")), num(r.get("tokens_per_s")),
              num(r.get("step_seconds"), ".2f"), num(r.get("planned_host_step_seconds"), ".2f"), status(r),
              r.get("note", "") + (f"; offload's tokens/s × {r['offload_speed_ratio']:.2f} of this"
                                   if r.get("offload_speed_ratio") else "")] for r in offload]), ""]
    fp16 = [r for r in rows if r["section"] == "fp16"]
    if fp16:
        out += ["## fp16 with its loss scale", "", C.table(
            ["run", "micro-batch × N", "steps", "skipped (at step)", "loss scale first → last", "tokens/s",
             "finetune compare", "status"],
            [[r["label"], f"{r['micro_batch']} × {r['accumulation']}" if r["status"] == "ok" else "—",
              num(r.get("steps")), f"{r['skipped_steps']} ({', '.join(map(str, r['skipped_at'])) or '—'})"
              if r["status"] == "ok" else "—",
              f"{r['loss_scale_first']:g} → {r['loss_scale_last']:g}" if r["status"] == "ok" else "—",
              num(r.get("tokens_per_s")), r.get("verdict", "—"), status(r)] for r in fp16]), ""]
    plan = [r for r in rows if r["section"] == "plan"]
    if plan:
        out += ["## `finetune plan --model-config` against the run it plans", "", C.table(
            ["run", "recommended", "predicted step peak", "measured peak", "predicted ÷ measured", "tokens/s",
             "status", "note"],
            [[r["label"], f"{r['micro_batch']} × {r['accumulation']}, checkpointing "
              f"{'on' if r['checkpointing'] else 'off'}, chunked loss {'on' if r['chunked_loss'] else 'off'}"
              if r["status"] == "ok" else "—", mem(r.get("predicted_bytes")), mem(r.get("peak_bytes")),
              num(r.get("predicted_vs_measured"), ".3f"), num(r.get("tokens_per_s")), status(r), r.get("note", "")]
             for r in plan]), ""]
    return out


