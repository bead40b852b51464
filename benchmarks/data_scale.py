"""Data at scale: time to the first optimizer step and peak memory of ``sft-smollm2`` on generated chat files of N
conversations, beside TRL 1.16's ``SFTTrainer`` preparing the same file.

Each file holds N seeded random chats, one ``{"messages": [user, assistant]}`` row a line: a question of 8–40 and an
answer of 20–120 words drawn from the words of the builtins' docstrings (so the same Python writes the same file).
It is written once per N into ``--work`` and reused. Every case runs in a process of its own:

* ``cold`` — ``python -m finetune run --recipe sft-smollm2 --max-steps 1`` on the file, with an empty finetune cache
  and an empty ``HF_DATASETS_CACHE``: reading, tokenizing, loading the model, one step. The GGUF model converted to
  safetensors once (a one-time cost, not the data's) is linked into the empty cache (``MODEL_CACHE_DIRS``).
* ``cached`` — the same command again on the caches ``cold`` filled (a new output folder).
* ``streaming`` — ``cold`` with ``data.streaming=true``: the rows are read and encoded a block at a time while
  training, nothing ahead.
* ``old`` — ``cold`` run by an earlier checkout (``--old-code``): the rows read into Python lists and tokenized in one
  process, every run.
* ``trl`` — ``datasets.load_dataset("json")`` into an empty ``HF_DATASETS_CACHE``, ``SFTTrainer(...)`` (its
  preparation: chat template, tokenization, truncation at 256 tokens, in 2 worker processes), then
  ``trainer.train()`` for one step; the same model, LoRA and batch (4 × 2 micro-batches) as the recipe.

What is reported, per case:

* **wall s** — the command's whole run, from launch to exit (imports, set-up, one step and whatever follows it).
* **first step s** — from launch until the first optimizer step is done: until finetune writes the first line of
  ``history.jsonl`` (one line per step, written as the step ends), or TRL's ``on_step_end`` callback fires; seen by
  polling every 0.1 s.
* **peak RSS GB** — ``ru_maxrss`` of the case's process tree, as ``/usr/bin/time -v`` reports it (else a python
  wrapper's ``getrusage(RUSAGE_CHILDREN)``): the largest resident set of any *one* process in the tree.
* **tree PSS GB** — the largest sum of PSS over the whole tree (the main process and its workers, pages shared
  between them counted once), sampled every 0.1 s from ``/proc``; a spike shorter than that can be missed.
* **before the loop s** — first step s less *step 1*: from launch until the training loop starts (imports, reading
  and tokenizing the data, loading the model, the optimizer): where the data's preparation falls. The loop's own
  start (drawing the epoch's sample order) is counted in *step 1*.
* **breakdown** — *step 1*: from the training loop's start to the end of its first step (finetune: that line's
  ``seconds``; TRL: ``on_train_begin`` to ``on_step_end``); TRL also: ``load_dataset``, ``SFTTrainer(...)`` (its
  preparation) and the whole ``train()`` call, each timed inside its process.

Settings beyond the recipe, the same for every finetune case: ``data.limit=null`` (the recipe keeps 240 chats: the
whole file is the point), ``data.max_length=256`` with ``data.too_long=keep_start`` (TRL's ``max_length`` here, and
TRL's truncation), ``data.val_fraction=0`` (no held-out set: nothing is evaluated or generated after the one step) and
``output.save_model=false`` (writing the model is not the data's cost). TRL computes its loss on every token of a
``messages`` row (SmolLM2's template has no generation marks for ``assistant_only_loss``); the recipe on the
assistant's only, and it adds its system prompt.

    pip install 'finetune[peers]'      # TRL 1.16
    python benchmarks/data_scale.py --chats 20000 200000 --cases cold,cached,trl --work /tmp/data_scale
    python benchmarks/data_scale.py --chats 2000       # a few minutes on 2 CPU cores

Prints the machine line and a markdown table, and writes it all to ``<work>/data_scale.json``; each case's output is
in ``<work>/<N>/<case>.log``.
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("cold", "cached", "streaming", "old", "trl")  # the order they run in: cached reads what cold left
DEFAULT_CASES = "cold,cached,streaming,trl"
# Subfolders of finetune's cache root that hold converted models: linked into each fresh root, so that a cold run
# starts without any data cache but does not pay the one-time GGUF conversion. Everything else (tokenizers, data
# sets, tokenized samples) starts empty.
MODEL_CACHE_DIRS = ("gguf",)
# What every finetune case sets beyond the recipe (see the module docstring for why).
FINETUNE_SETS = ("data.limit=null", "data.max_length=256", "data.too_long=keep_start", "data.val_fraction=0",
                 "output.save_model=false")
MAX_LENGTH = 256  # TRL's max_length: tokens per chat
TRL_NUM_PROC = 2  # SFTConfig.dataset_num_proc: worker processes for TRL's tokenization
POLL_SECONDS = 0.1
STEP_1 = "step 1"  # the breakdown's key for the seconds from the training loop's start to the first step's end
GB = 1e9


# ---------------------------------------------------------------------------------------------------------------
# the chat files


def vocabulary() -> list:
    """The words (3+ lowercase letters) of the builtins' docstrings, sorted: the same list for the same Python."""
    docs = (getattr(builtins, name).__doc__ or "" for name in sorted(dir(builtins)))
    return sorted({w for doc in docs for w in re.findall(r"\b[a-z]{3,}\b", doc.lower())})


def chat_rows(n: int, seed: int = 0):
    """``n`` seeded chats as ``{"messages": [user, assistant]}`` rows."""
    rng, words = random.Random(seed), vocabulary()

    def sentence(lo: int, hi: int, end: str) -> str:
        return " ".join(rng.choices(words, k=rng.randint(lo, hi))).capitalize() + end

    for _ in range(n):
        yield {"messages": [{"role": "user", "content": sentence(8, 40, "?")},
                            {"role": "assistant", "content": sentence(20, 120, ".")}]}


def chat_file(work: Path, n: int) -> Path:
    """``<work>/chats-<n>.jsonl``, written once (under a temporary name, renamed when whole) and reused."""
    path = work / f"chats-{n}.jsonl"
    if not path.is_file():
        work.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in chat_rows(n))
        os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# measuring one process tree


def timed_command(cmd: list, rss_file: Path) -> list:
    """``cmd`` under ``/usr/bin/time -v``, or, where it is missing, under a python wrapper that writes the same
    ``Maximum resident set size (kbytes)`` line from ``getrusage(RUSAGE_CHILDREN)`` (kB on Linux)."""
    if Path("/usr/bin/time").is_file():
        return ["/usr/bin/time", "-v", "-o", str(rss_file), *cmd]
    wrapper = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
               "kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
               "open(sys.argv[1], 'w').write(f'Maximum resident set size (kbytes): {kb}\\n'); sys.exit(rc)")
    return [sys.executable, "-c", wrapper, str(rss_file), *cmd]


def max_rss_gb(rss_file: Path) -> float | None:
    try:
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", rss_file.read_text())
    except OSError:
        return None
    return int(found.group(1)) * 1024 / GB if found else None


def tree_pids(pid: int) -> list:
    """``pid`` and its descendants, from ``/proc/<pid>/task/*/children`` (Linux); those that ended are skipped."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def tree_pss_gb(pid: int) -> float:
    """The tree's summed PSS (``/proc/<pid>/smaps_rollup``): shared pages split between the processes sharing them."""
    total = 0
    for p in tree_pids(pid):
        try:
            found = re.search(r"^Pss:\s+(\d+) kB", Path(f"/proc/{p}/smaps_rollup").read_text(), re.M)
        except OSError:  # ended meanwhile, or no smaps_rollup (kernels before 4.14)
            continue
        total += int(found.group(1)) if found else 0
    return total * 1024 / GB


def measure(cmd: list, env: dict, log: Path, first_step_done, timeout: float, cwd: Path = ROOT) -> dict:
    """Run ``cmd`` (its output to ``log``) until it exits or ``timeout`` s pass (then its process group is killed).
    ``first_step_done()`` says whether the first optimizer step has been taken. Returns wall / first-step seconds,
    max RSS and peak tree PSS (GB), the exit code, and the log's last line when it failed."""
    rss_file = log.with_suffix(".time")
    rss_file.unlink(missing_ok=True)
    first, pss, timed_out = None, 0.0, False
    with open(log, "w") as out:
        start = time.perf_counter()
        # a session of its own: a timeout kills the whole tree (TRL's map workers too), and nothing else
        proc = subprocess.Popen(timed_command(cmd, rss_file), env=env, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            if first is None and first_step_done():
                first = time.perf_counter() - start
            pss = max(pss, tree_pss_gb(proc.pid))
            if time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                timed_out = True
                break
            time.sleep(POLL_SECONDS)
        wall = time.perf_counter() - start
    if first is None and proc.returncode == 0 and first_step_done():  # stepped within the last poll
        first = wall
    lines = log.read_text(errors="replace").strip().splitlines()
    failure = f"timed out after {timeout:.0f} s" if timed_out else \
        (lines[-1][:200] if proc.returncode and lines else None)
    return {"wall_s": wall, "first_step_s": first, "peak_rss_gb": max_rss_gb(rss_file), "tree_pss_gb": pss or None,
            "returncode": proc.returncode, "failure": failure}


# ---------------------------------------------------------------------------------------------------------------
# the cases


def base_env(**extra) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0", **extra}


def fresh_cache(folder: Path, shared_root: Path) -> Path:
    """An empty finetune cache root in ``folder`` but for links to the shared root's ``MODEL_CACHE_DIRS``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in MODEL_CACHE_DIRS:
        (folder / name).symlink_to(shared_root / name, target_is_directory=True)
    return folder


def fresh_dir(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def finetune_case(case: str, data: Path, here: Path, shared_root: Path, timeout: float, steps: int = 1,
                  old_code: Path | None = None) -> dict:
    """One ``finetune run`` of the recipe for ``steps`` steps; ``cached`` reuses the caches the last ``cold`` filled,
    ``old`` runs the code in ``old_code`` (an earlier checkout: rows read into Python, tokenized every run)."""
    if case != "cached":
        fresh_cache(here / "finetune-cache", shared_root)
        fresh_dir(here / "hf-datasets")
    out = here / f"out-{case}"
    shutil.rmtree(out, ignore_errors=True)  # finetune refuses a non-empty output folder
    sets = [*FINETUNE_SETS, f"data.source={data}", *(["data.streaming=true"] if case == "streaming" else [])]
    cmd = [sys.executable, "-m", "finetune", "run", "--recipe", "sft-smollm2", "--max-steps", str(steps),
           "--output-dir", str(out), *[x for s in sets for x in ("--set", s)]]
    history = out / "history.jsonl"
    env = base_env(FINETUNE_CACHE=str(here / "finetune-cache"), HF_DATASETS_CACHE=str(here / "hf-datasets"),
                   **({"PYTHONPATH": str(old_code)} if case == "old" else {}))
    # python -m puts the working folder first on the path: the old case runs in its checkout
    result = measure(cmd, env, here / f"{case}.log", lambda: history.is_file() and history.stat().st_size > 0,
                     timeout, cwd=old_code if case == "old" else ROOT)
    if case == "old" and (here / "finetune-cache" / "datasets").exists():  # the old path caches no data set
        result["failure"] = "the old case ran the current code"
    try:
        lines = [json.loads(x) for x in history.read_text().splitlines()]
        result["breakdown"] = {STEP_1: lines[0]["seconds"]}
        later = lines[1:]  # the steps after the first: training on prepared data
        if later:
            result["tokens_per_s"] = sum(h["tokens"] for h in later) / sum(h["seconds"] for h in later)
    except (OSError, IndexError, ValueError, KeyError):
        result["breakdown"] = {}
    return {**result, "command": cmd}


def trl_case(data: Path, here: Path, model_path: str, timeout: float) -> dict:
    """TRL's SFTTrainer on the file, in a process of its own (``--trl-child``), with an empty datasets cache."""
    from finetune.loading import load_recipe

    recipe = load_recipe("sft-smollm2")
    t, p = recipe.training, recipe.peft
    out = fresh_dir(here / "out-trl")
    spec = {"data": str(data), "model": model_path, "out": str(out), "batch_size": t.batch_size,
            "accumulation": t.effective_batch_size // t.batch_size, "learning_rate": t.learning_rate,
            "seed": t.seed, "lora": {"r": p.r, "lora_alpha": p.alpha, "lora_dropout": p.dropout,
                                     "target_modules": list(p.target_modules)}}
    (here / "trl-spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-child", str(here / "trl-spec.json")]
    marker, times = out / "first-step", out / "times.json"
    result = measure(cmd, base_env(HF_DATASETS_CACHE=str(fresh_dir(here / "hf-datasets-trl"))),
                     here / "trl.log", marker.is_file, timeout)
    result["breakdown"] = json.loads(times.read_text()) if times.is_file() else {}
    return {**result, "command": cmd}


def trl_child(spec_file: str) -> None:
    """The ``trl`` case inside its process: load, construct (TRL's preparation), one step; each timed."""
    spec = json.loads(Path(spec_file).read_text())
    out = Path(spec["out"])
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    times = {}

    class FirstStep(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # the loop starts: model and optimizer set up
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                times[STEP_1] = time.perf_counter() - self.begin
                (out / "first-step").touch()  # the parent polls for it, as for finetune's history.jsonl

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    start = time.perf_counter()
    data = load_dataset("json", data_files=spec["data"], split="train")
    times["load_dataset"] = time.perf_counter() - start
    args = SFTConfig(output_dir=str(out), dataset_num_proc=TRL_NUM_PROC, max_length=MAX_LENGTH, report_to=[],
                     bf16=False, per_device_train_batch_size=spec["batch_size"],
                     gradient_accumulation_steps=spec["accumulation"], learning_rate=spec["learning_rate"],
                     max_steps=1, seed=spec["seed"], logging_steps=1, save_strategy="no", disable_tqdm=True,
                     gradient_checkpointing=False)  # TRL 1.16 turns it on by default; the recipe does not
    start = time.perf_counter()
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                         peft_config=LoraConfig(task_type="CAUSAL_LM", **spec["lora"]), callbacks=[FirstStep()])
    times["SFTTrainer()"] = time.perf_counter() - start
    start = time.perf_counter()
    trainer.train()
    times["train()"] = time.perf_counter() - start
    (out / "times.json").write_text(json.dumps(times))


# ---------------------------------------------------------------------------------------------------------------
# the report


def fmt(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


HEADER = ["chats", "file MB", "case", "wall s", "first step s", "before the loop s", "peak RSS GB", "tree PSS GB",
          "tokens/s after step 1", "breakdown"]


def row_of(r: dict) -> list:
    if r["failure"]:
        return [r["chats"], fmt(r["file_mb"]), r["case"], fmt(r["wall_s"]), "—", "—", "—", "—", "—",
                f"failed: {r['failure']}"]
    step = r["breakdown"].get(STEP_1)
    before = r["first_step_s"] - step if r["first_step_s"] is not None and step is not None else None
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in r["breakdown"].items())
    return [r["chats"], fmt(r["file_mb"]), r["case"], fmt(r["wall_s"]), fmt(r["first_step_s"]), fmt(before),
            fmt(r["peak_rss_gb"], 2), fmt(r["tree_pss_gb"], 2), fmt(r.get("tokens_per_s"), 0), parts]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, nargs="+", default=[2000], help="file sizes, in chats")
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--work", type=Path, default=Path("/tmp/data_scale"), help="chat files, caches, outputs, logs")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per case before it is killed")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps of each finetune case (more: tokens/s of "
                                                         "training after the first step)")
    p.add_argument("--old-code", type=Path, help="the old case's checkout (e.g. git worktree add /tmp/old 2f571f0)")
    p.add_argument("--trl-child", help=argparse.SUPPRESS)  # the trl case's own process
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if bad := [c for c in cases if c not in CASES]:
        p.error(f"--cases: unknown {', '.join(bad)}; allowed: {', '.join(CASES)}")
    if "cached" in cases and "cold" not in cases:
        p.error("--cases: cached reuses the caches cold fills; select cold too")
    if "old" in cases and args.old_code is None:
        p.error("--cases: old needs --old-code (an earlier checkout)")
    args.cases = [c for c in CASES if c in cases]
    return args


def main() -> None:
    args = parse_args()
    if args.trl_child:
        trl_child(args.trl_child)
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import machine, smollm2_path, table
    from finetune import cache

    # converted once here (in the usual cache root), then linked into every fresh root: no case pays for it
    model_path = smollm2_path(False, args.work)
    shared_root = cache.root().resolve()
    where = machine()
    print(where, flush=True)
    results = []
    for n in args.chats:
        data, here = chat_file(args.work, n), args.work / str(n)
        for case in args.cases:
            r = trl_case(data, here, model_path, args.timeout) if case == "trl" else \
                finetune_case(case, data, here, shared_root, args.timeout, args.steps, args.old_code)
            results.append({"chats": n, "file_mb": data.stat().st_size / 1e6, "case": case, **r})
            note = f" ({r['failure']})" if r["failure"] else ""
            print(f"{n} chats, {case}: {fmt(r['wall_s'])} s{note}", file=sys.stderr, flush=True)
    print(table(HEADER, [row_of(r) for r in results]))
    report = args.work / "data_scale.json"
    report.write_text(json.dumps({"machine": where, "argv": sys.argv, "results": results}, indent=1))
    print(f"\nresults: {report}")


if __name__ == "__main__":
    main()
