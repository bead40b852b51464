"""Less padding, same steps: real tokens per second against the peers' documented set-ups, one epoch each.

    PYTHONPATH=. python benchmarks/padding.py --quick    # ~3 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/padding.py            # bigger subsets, the recipes' shapes, more repetitions

Workloads (each set-up trains one epoch over the same samples, same micro-batch b, N, AdamW, learning rate):

* **MiniLM classification** of VADER's rated words (3–11 tokens, median 4; ``max_length`` 32 as in the recipe);
* **GPT-2 causal LM** (the clm-pydoc recipe's model) on Python-docs paragraphs, one a sample, cut at 128 tokens
  (4–128, median 38): a realistic length spread;
* **SmolLM2 chat** — the sft-smollm2 recipe's data (stdlib-qa questions with its system prompt, rendered with
  SmolLM2's chat template, the loss on the assistant's tokens only; its first 640 training conversations are 39–125
  tokens, median 52), its LoRA adapters, b and N: SmolLM2-135M-Instruct from its GGUF file on the first 32 (it trains
  ~100 real tokens/s on one thread), or with ``--quick`` a 2-layer Llama (64 wide) from a config with SmolLM2's
  tokenizer on the first 128. The Trainer pads the same
  tokenized samples with ``DataCollatorForSeq2Seq`` (labels padded with -100).

Set-ups:

* *static padding* — the hand Accelerate loop with every sample padded to ``max_length`` (the tutorials' set-up);
* *Trainer* — HF Trainer as documented: random sampler, padding to each micro-batch's longest;
* *Trainer group_by_length* / *Trainer batch_rebalance* — its ``train_sampling_strategy`` options that group
  samples by length (the first sorts mega-batches of 50 optimizer steps' samples; the second, new in transformers 5,
  balances each optimizer step's micro-batches by padded cost);
* *finetune (packed)* — its default for causal LMs: each window's own samples packed into rows of up to
  ``max_length`` tokens (first-fit decreasing, ``position_ids`` restarting per sample, no attention mask), ``b`` rows
  a micro-batch (``training.packing``); the windows, their item counts and so the steps are the unpacked ones;
* *finetune (packed, plain loss head)* — the same with ``training.chunked_loss=false``: finetune's default loss
  head for causal LMs computes the LM head only at tokens that carry a label (padding, and in chat data the prompt,
  are skipped), where the peers compute it at every position. This row is what packing alone does;
* *finetune (sorted windows)* — its default for encoders: each window's samples sorted by length before they are
  cut into micro-batches (``training.sort_within_window``); *finetune + token budget* also cuts micro-batches by a
  budget of padded tokens (``training.max_tokens_per_micro_batch`` = b × max_length: never more than a static
  micro-batch).

Real tokens/s = non-padding tokens ÷ time, from the start of the second optimizer step to the end of the epoch
(set-up and the warm-up step left out alike; median over interleaved repetitions), on the process's CPU time (one
torch thread; steady when other jobs share the machine — the JSON also has the wall-clock rate); "epoch s" is the
wall time of the whole training call.
"Same steps" is the share of steps whose sample set is that of the same tool without length grouping (same seed):
the Trainer's random sampler for its options, finetune's unsorted, unpacked (b·N) × 1 run for finetune — whose
packed, sorted and budgeted runs are then checked for the same weights (max relative difference after the epoch,
fp32; with SGD, as the test suite checks, and with the timed AdamW runs). For the causal LMs a last table counts,
from finetune's plan of the same epoch, the padding and the attention work of each layout (a packed row attends over
its whole length). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
import torch  # noqa: E402

CHAT_SAMPLES = 32  # SmolLM2-135M trains ~100 real tokens/s on one thread of this CPU


def workloads(quick: bool) -> dict:
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, DataCollatorWithPadding

    minilm, mtok = C.minilm()
    ptok = C.pydoc_tokenizer()
    gpt2 = C.tiny_gpt2(ptok)
    smol, stok, chat = C.smollm2_chat(128 if quick else CHAT_SAMPLES, tiny=quick)
    vader = C.with_idx(C.vader_samples(mtok, 160 if quick else 1600, max_length=32))
    pydoc = C.with_idx(C.pydoc_samples(ptok, 128 if quick else 640, seq_len=128))
    return {
        "MiniLM classification": dict(
            model=minilm, data=vader, b=16, n=2, lr=1e-4, max_length=32, tokenizer=mtok,
            dynamic=DataCollatorWithPadding(mtok),
            static=DataCollatorWithPadding(mtok, padding="max_length", max_length=32),
            trainer_collate=None),
        "GPT-2 causal LM": dict(
            model=gpt2, data=pydoc, b=4 if quick else 8, n=4, lr=2e-3, max_length=128, tokenizer=ptok,
            dynamic=C.clm_collate(ptok), static=C.clm_collate(ptok, pad_to=128),
            trainer_collate=DataCollatorForLanguageModeling(ptok, mlm=False), causal=True),
        "SmolLM2 chat": dict(
            model=smol, data=C.with_idx(chat), b=4, n=2, lr=1e-3, max_length=160, tokenizer=stok,
            about="a 2-layer Llama, 64 wide, from a config with SmolLM2's tokenizer, LoRA" if quick else
            "SmolLM2-135M-Instruct, LoRA", reps=None if quick else 2,  # ~3 min a repetition
            dynamic=C.chat_collate(stok.pad_token_id), static=C.chat_collate(stok.pad_token_id, pad_to=160),
            trainer_collate=DataCollatorForSeq2Seq(stok, label_pad_token_id=-100), causal=True),
    }


def setups(w: dict) -> dict:
    """name → runner(model) for one epoch."""
    data, b, n, lr = w["data"], w["b"], w["n"], w["lr"]
    lengths = C.lengths_of(data)
    budget = b * w["max_length"]

    def trainer(sampling):
        return lambda model: C.run_trainer(model, data, w["trainer_collate"], b, n, lr=lr, optimizer=None,
                                           sampling=sampling, tokenizer=w["tokenizer"])

    return {
        "static padding (hand Accelerate)": lambda model: C.run_accelerate(
            model, data, C.strip_idx(w["static"]), b, n, lr=lr, shuffle=True),
        "Trainer": trainer("random"),
        "Trainer group_by_length": trainer("group_by_length"),
        "Trainer batch_rebalance": trainer("batch_rebalance"),
        **({"finetune (packed)": lambda model: C.run_finetune(
            model, data, C.strip_idx(w["dynamic"]), b, n, lr=lr, shuffle=True, lengths=lengths, packing=True),
            "finetune (packed, plain loss head)": lambda model: C.run_finetune(
            model, data, C.strip_idx(w["dynamic"]), b, n, lr=lr, shuffle=True, lengths=lengths, packing=True,
            chunked_loss=False)}
           if w.get("causal") else {}),
        "finetune (sorted windows)": lambda model: C.run_finetune(
            model, data, C.strip_idx(w["dynamic"]), b, n, lr=lr, shuffle=True, lengths=lengths, sort=None),
        "finetune + token budget": lambda model: C.run_finetune(
            model, data, C.strip_idx(w["dynamic"]), b, n, lr=lr, shuffle=True, lengths=lengths, sort=True,
            max_tokens=budget),
    }


def same_steps(run, baseline) -> float:
    """Share of ``run``'s steps whose sample set is the baseline's step's."""
    return sum(a == b for a, b in zip(run.windows, baseline.windows)) / max(len(baseline.windows), 1)


def same_result(w: dict, timed: dict) -> dict:
    """finetune's sorted / budgeted runs against its unsorted (b·N) × 1 run: same windows? same weights?
    Checked with SGD (as the test suite does: any mis-weighting shows) and with the timed AdamW runs. AdamW divides
    each gradient element by its own running magnitude, so elements whose gradient is ~0 turn float32 rounding into
    visible steps; the unsorted (b, N) control shows the size of that effect without any sorting."""
    data, b, n = w["data"], w["b"], w["n"]
    lengths = C.lengths_of(data)
    collate = C.strip_idx(w["dynamic"])
    variants = {**({"finetune (packed)": dict(packing=True)} if w.get("causal") else {}),
                "finetune (sorted windows)": dict(sort=None),
                "finetune + token budget": dict(sort=True, max_tokens=b * w["max_length"]),
                "finetune unsorted (control)": dict(sort=False)}
    out = {name: {} for name in variants}
    for optimizer, lr in (("sgd", 0.1), ("adamw", w["lr"])):
        with C.quiet():
            big = C.run_finetune(C.copy_model(w["model"]), data, collate, b * n, 1, lr=lr, shuffle=True, sort=False,
                                 optimizer=optimizer)
            for name, kw in variants.items():
                if optimizer == "adamw" and name in timed:
                    run = timed[name][0]
                else:
                    run = C.run_finetune(C.copy_model(w["model"]), data, collate, b, n, lr=lr, shuffle=True,
                                         lengths=lengths, optimizer=optimizer, **kw)
                out[name][optimizer] = C.rel_diff(run.model, big.model)
                out[name]["same_steps"] = same_steps(run, big)
    return out


def plan_costs(w: dict) -> dict:
    """Layout → (padding share, attention scores per real token) of finetune's micro-batches for the timed runs'
    epoch, from its plan (no training). A micro-batch of r rows padded to L tokens computes r × L² attention scores:
    a packed row attends over its whole length (the mask hides the other samples; SDPA computes them anyway). The
    limit is every sample alone and unpadded: Σ length² / Σ length."""
    from finetune.windows import WindowSpec

    lengths = C.lengths_of(w["data"])
    longest = max(lengths)
    layouts = {"unsorted windows": {}, "sorted windows": dict(sort_key=lengths.__getitem__),
               f"packed, rows of {longest} (the longest sample: the default)": dict(pack_capacity=longest),
               f"packed, rows of {2 * longest}": dict(pack_capacity=2 * longest)}
    out = {}
    for name, kw in layouts.items():
        real = padded = scores = 0
        spec = WindowSpec(len(lengths), w["b"], w["n"], processes=1, seed=0, length_of=lengths.__getitem__, **kw)
        for window in spec.epoch(0):
            for mb in window.micro_batches:
                widths = [sum(lengths[i] for i in row) if "pack_capacity" in kw else lengths[row] for row in mb]
                real, padded = real + sum(widths), padded + len(widths) * max(widths)
                scores += len(widths) * max(widths) ** 2
        out[name] = (1 - real / padded, scores / real)
    out["every sample alone (the limit)"] = (0.0, sum(x * x for x in lengths) / sum(lengths))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small subsets, 2 repetitions (~2 min on 2 CPU cores)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of each set-up (default 2, or 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine a second thread waits on busy cores)")
    p.add_argument("--plot", metavar="PNG", help="also draw real tokens/s relative to the Trainer's into this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps = args.reps or (2 if args.quick else 3)
    start = time.perf_counter()
    print(f"# Padding\n\n{C.machine()}\n`{' '.join(['python', *sys.argv])}`; {reps} interleaved repetitions\n")
    record = {"benchmark": "padding", "quick": args.quick, "reps": reps, "models": {}}
    worst = {}
    for model_name, w in workloads(args.quick).items():
        runners = setups(w)
        w_reps = min(reps, w.get("reps") or reps)
        runs = C.interleaved(runners, w_reps, lambda: (C.copy_model(w["model"]),))
        res = {}
        for name, rs in runs.items():
            res[name] = {"tokens_per_s": C.median([r.rate("tokens", clock="cpu") for r in rs]),
                         "tokens_per_s_wall": C.median([r.rate("tokens") for r in rs]),
                         "epoch_s": C.median([r.wall for r in rs]),
                         "padding": C.median([1 - sum(r.tokens) / sum(r.padded) for r in rs])}
            if name.startswith("Trainer"):  # against the Trainer's random sampler, same seed
                res[name]["same_steps"] = same_steps(rs[0], runs["Trainer"][0])
        check = same_result(w, runs)
        for name in [k for k in check if k in res]:
            res[name]["same_steps"] = check[name]["same_steps"]
        default = "finetune (packed)" if "finetune (packed)" in res else "finetune (sorted windows)"
        ft = res[default]["tokens_per_s"]
        ftb = res["finetune + token budget"]["tokens_per_s"]
        peers = [k for k in res if not k.startswith("finetune")]
        rows = [[name, f"{r['tokens_per_s']:.0f}", f"{r['epoch_s']:.1f}", f"{r['padding']:.0%}",
                 f"{r['same_steps']:.0%}" if "same_steps" in r else "—",
                 f"{ft / r['tokens_per_s']:.2f}", f"{ftb / r['tokens_per_s']:.2f}"] for name, r in res.items()]
        about = f"{w['about']}, " if "about" in w else ""
        fewer = f", {w_reps} repetitions" if w_reps != reps else ""
        print(f"## {model_name} ({about}b={w['b']}, N={w['n']}, {len(w['data'])} samples, one epoch{fewer})\n")
        print(C.table(["set-up", "real tokens/s", "epoch s", "padding share", "same steps as unsorted",
                       f"{default} ÷", "finetune + budget ÷"], rows))
        print(f"\nSame result — finetune against its unsorted {w['b'] * w['n']} × 1 run (max relative weight "
              "difference after the epoch, fp32):\n")
        print(C.table(["finetune run", "same windows", "SGD", "AdamW"],
                      [[name, f"{c['same_steps']:.0%}", f"{c['sgd']:.0e}", f"{c['adamw']:.0e}"]
                       for name, c in check.items()]))
        costs = plan_costs(w) if w.get("causal") else {}
        if costs:
            print("\nThe same epoch as finetune plans it (no training): padding, and attention scores computed per "
                  "real token:\n")
            print(C.table(["layout", "padding share", "attention scores / real token"],
                          [[name, f"{pad:.1%}", f"{per:.0f}"] for name, (pad, per) in costs.items()]))
        print()
        worst[model_name] = {"finetune_default": default,
                             "finetune_vs_best_peer": ft / max(res[k]["tokens_per_s"] for k in peers),
                             "finetune_budget_vs_best_peer": ftb / max(res[k]["tokens_per_s"] for k in peers),
                             "finetune_vs_trainer": ft / res["Trainer"]["tokens_per_s"],
                             "finetune_vs_static": ft / res["static padding (hand Accelerate)"]["tokens_per_s"]}
        record["models"][model_name] = {"reps": w_reps, "setups": res, "same_result": check,
                                        **({"plan": costs} if costs else {}), **worst[model_name]}
    if args.plot:
        names = list(dict.fromkeys(n for v in record["models"].values() for n in v["setups"]))
        C.bar_chart(args.plot, "Real tokens/s, one epoch, relative to HF Trainer's (random sampler)",
                    [n.replace(" (", "\n(").replace(" + ", "\n+ ").replace("Trainer ", "Trainer\n") for n in names],
                    {m: [v["setups"][n]["tokens_per_s"] / v["setups"]["Trainer"]["tokens_per_s"]
                         if n in v["setups"] else 0.0 for n in names]
                     for m, v in record["models"].items()}, "× Trainer")
    for key in ("finetune_vs_best_peer", "finetune_budget_vs_best_peer", "finetune_vs_trainer", "finetune_vs_static"):
        record[key] = {m: v[key] for m, v in worst.items()}
    record["seconds"] = round(time.perf_counter() - start, 1)
    print(f"Total {record['seconds']} s.\n")
    C.emit_json(record)
    return record


if __name__ == "__main__":
    main()
