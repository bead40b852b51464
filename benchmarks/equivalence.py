"""How far does each tool's gradient accumulation stray from the big-batch step it stands in for?

    PYTHONPATH=. python benchmarks/equivalence.py --quick   # fp64, one epoch per case (~20 s)
    PYTHONPATH=. python benchmarks/equivalence.py           # also fp32, and two epochs

Every tool really runs: Accelerate's documented ``accumulate()`` loop with a prepared DataLoader, HF ``Trainer``
with ``gradient_accumulation_steps``, and finetune — each with micro-batch b and N accumulation steps — against a
reference that takes one optimizer step per batch of b·N samples (a plain torch loop, N = 1: the model's own mean
loss over the whole batch). All see the samples in the same order (no shuffling), use plain SGD at a constant
learning rate without clipping (so any mis-weighting of a micro-batch shows in the weights), and start from the same
weights. The number is the max relative weight difference after the run, max |w − w_ref| / max |w_ref| (the
measure the test suite uses); a second table gives the same error as a share of the reference's update,
max |w − w_ref| / max |w_ref − w_0|.

Cases:

* **MLP, tail window**: a regression MLP, 85 samples, b = 16, N = 3: windows of 48 and 37 = 16 + 16 + 5.
* **BERT classifier, tail window**: a 2-layer BERT for sequence classification (its forward takes ``**kwargs``
  but does not use ``num_items_in_batch``), 23 samples, b = 4, N = 2: the last window is 4 + 3.
* **GPT-2, padded, N = 3**: a 2-layer GPT-2 LM on 29 sequences of 2–12 tokens padded per micro-batch, b = 2,
  N = 3 (token-level loss: each window's loss is the mean over its real, shifted tokens).
* **GPT-2, padded, N = 1**: the same without accumulation (b = 6) — what is left is how a tool counts tokens.

The last line printed is one JSON object with every number and ``finetune_max`` / ``peers_max`` (fp64, one epoch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
import torch  # noqa: E402

from finetune.data import pad_collate as _pad_collate  # noqa: E402

pad_collate = _pad_collate(0)  # right-pad; class labels stacked, a causal LM's padded labels -100

TOOLS = {"Accelerate accumulate()": C.run_accelerate, "HF Trainer": C.run_trainer, "finetune": C.run_finetune}
SGD = dict(optimizer="sgd", scheduler="constant", max_grad_norm=None)


class MLP(torch.nn.Module):
    """Regression MLP; ``forward(x, y)`` returns {"loss": mean squared error over the batch's samples}."""

    def __init__(self, d_in: int = 6, hidden: int = 16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


def regression_data(n: int, dtype, d_in: int = 6, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return [{"x": x[i].to(dtype), "y": y[i].to(dtype)} for i in range(n)]


def token_data(n: int, vocab: int = 64, lo: int = 2, hi: int = 12, seed: int = 0, labels: int = 0) -> list:
    """Sequences of lo..hi random tokens; with ``labels`` > 0 each also gets a class label."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        sample = {"input_ids": torch.randint(2, vocab, (length,), generator=g)}
        if labels:
            sample["labels"] = int(torch.randint(0, labels, (1,), generator=g))
        out.append(sample)
    return out


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kw):
    """transformers' causal-LM loss (same shift, same ``num_items_in_batch`` handling) without its cast of the
    logits to fp32, so that an fp64 model's loss stays fp64."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def tiny_gpt2(dtype, seed: int = 0):
    """A 2-layer, 32-wide GPT2LMHeadModel. In fp64 its loss keeps fp64 (``causal_lm_loss``): transformers computes
    a causal LM's loss in fp32 whatever the model's dtype, which would hide the accumulation's error under fp32
    rounding (~1e-8)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                       eos_token_id=1, pad_token_id=0)).to(dtype)
    if dtype == torch.float64:
        model.loss_function = causal_lm_loss
    return model


def tiny_llama(dtype, seed: int = 0):
    """A 2-layer, 32-wide LlamaForCausalLM (the SmolLM2 / Llama family), its loss kept in fp64 as ``tiny_gpt2``'s."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                         pad_token_id=0)).to(dtype)
    if dtype == torch.float64:
        model.loss_function = causal_lm_loss
    return model


def tiny_bert_classifier(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3))


def torch_default_collate(samples):
    return torch.utils.data.default_collate(samples)


def cases(dtype) -> dict:
    """name → (model, data, collate, b, N, learning rate)."""
    torch.manual_seed(0)
    return {
        "MLP, tail window 16/16/5": (MLP().to(dtype), regression_data(85, dtype), torch_default_collate, 16, 3, 0.2),
        "BERT classifier, tail window 4/3": (tiny_bert_classifier().to(dtype), token_data(23, seed=2, labels=3),
                                             pad_collate, 4, 2, 0.5),
        "GPT-2, padded lengths 2–12, N = 3": (tiny_gpt2(dtype), token_data(29), pad_collate, 2, 3, 0.5),
        "GPT-2, padded lengths 2–12, N = 1": (tiny_gpt2(dtype), token_data(29), pad_collate, 6, 1, 0.5),
        "Llama, padded lengths 2–12, N = 3": (tiny_llama(dtype), token_data(29), pad_collate, 2, 3, 0.5),
    }


def measure(dtype=torch.float64, epochs: int = 1, only=None, tools=None) -> dict:
    """case → tool → {"weights": max rel. weight difference, "update": the same over the reference's update}.
    ``only`` / ``tools``: restrict to these case names / tool names.

        res = measure(only=["MLP, tail window 16/16/5"], tools=["finetune", "Accelerate accumulate()"])
        res["MLP, tail window 16/16/5"]["finetune"]["weights"]   # ~1e-16 (fp64 rounding)
    """
    out = {}
    for name, (model, data, collate, b, n, lr) in cases(dtype).items():
        if only is not None and name not in only:
            continue
        start = C.flat(model)
        with C.quiet():
            ref = C.run_raw(C.copy_model(model), data, collate, b * n, 1, lr=lr, epochs=epochs, **SGD)
        ref_w = C.flat(ref.model)
        row = {}
        for tool, fn in TOOLS.items():
            if tools is not None and tool not in tools:
                continue
            with C.quiet():
                run = fn(C.copy_model(model), data, collate, b, n, lr=lr, epochs=epochs, **SGD)
            w = C.flat(run.model)
            row[tool] = {"weights": C.rel_diff(w, ref_w),
                         "update": float((w - ref_w).abs().max() / (ref_w - start).abs().max())}
        out[name] = row
    return out


def trainer_logged_loss(dtype=torch.float64) -> dict:
    """The Trainer's logged training loss at the first step ÷ the true mean loss of that step's window."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    out = {}
    for name, (model, data, collate, b, n, lr) in cases(dtype).items():
        window = collate(data[:b * n])
        with torch.no_grad():
            true = float(C.copy_model(model)(**window)["loss"])
        C.restart_accelerate_state()
        with tempfile.TemporaryDirectory() as tmp, C.quiet():
            args = TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, per_device_train_batch_size=b,
                                     gradient_accumulation_steps=n, learning_rate=0.0, max_steps=1, logging_steps=1,
                                     train_sampling_strategy="sequential", save_strategy="no", max_grad_norm=0.0)
            trainer = Trainer(model=C.copy_model(model), args=args, train_dataset=data, data_collator=collate)
            trainer.train()
        logged = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
        out[name] = logged / true
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fp64 and one epoch only")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the results do not depend on it)")
    p.add_argument("--plot", metavar="PNG", help="also draw the fp64 table as a bar chart into this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    print(f"# Equivalence\n\n{C.machine()}\n`{' '.join(['python', *sys.argv])}`\n")
    record = {"benchmark": "equivalence", "quick": args.quick}
    settings = [("fp64", torch.float64, 1)] + ([] if args.quick else [("fp32", torch.float32, 1),
                                                                       ("fp64", torch.float64, 2)])
    for label, dtype, epochs in settings:
        res = measure(dtype, epochs)
        record[f"{label}_{epochs}ep"] = res
        for key, what in (("weights", "max |w − w_ref| / max |w_ref|"),
                          ("update", "max |w − w_ref| / max |w_ref − w_0| (share of the update)")):
            print(f"## {label}, {epochs} epoch{'s' if epochs > 1 else ''}: {what}\n")
            print(C.table(["case (b × N)", *TOOLS], [[name, *(f"{row[t][key]:.1e}" for t in TOOLS)]
                                                    for name, row in res.items()]))
            print()
    loss_ratio = trainer_logged_loss()
    record["trainer_logged_loss_ratio"] = loss_ratio
    print("## HF Trainer's logged loss ÷ the window's true mean loss (first step, fp64)\n")
    print(C.table(["case", "ratio"], [[k, f"{v:.3f}"] for k, v in loss_ratio.items()]))
    main_res = record["fp64_1ep"]
    if args.plot:
        floor = 1e-17
        C.bar_chart(args.plot, "Distance to the big-batch run after one epoch (fp64; 0 drawn at 1e-17)",
                    ["MLP\ntail window 16/16/5", "BERT classifier\ntail window 4/3", "GPT-2, padded\nN = 3",
                     "GPT-2, padded\nN = 1", "Llama, padded\nN = 3"],
                    {t: [max(row[t]["weights"], floor) for row in main_res.values()] for t in TOOLS},
                    "max |w − w_ref| / max |w_ref|", log=True)
    record["finetune_max"] = max(row["finetune"]["weights"] for row in main_res.values())
    record["peers_max"] = max(row[t]["weights"] for row in main_res.values() for t in TOOLS if t != "finetune")
    record["seconds"] = round(time.perf_counter() - start, 1)
    print(f"\nTotal {record['seconds']} s.\n")
    C.emit_json(record)
    return record


if __name__ == "__main__":
    main()
