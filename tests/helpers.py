"""Tiny models and data built in the test, shared by the test modules."""

from __future__ import annotations

import contextlib
import copy

import torch

from finetune.data import pad_collate as _pad_collate
from finetune.reproduce.weight_diff import flat, rel_diff  # noqa: F401  (the suite's measure: every parameter)


class MLP(torch.nn.Module):
    """Regression MLP; forward(x, y) returns {"loss": mean squared error over the batch's samples}."""

    def __init__(self, d_in=6, hidden=16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, x, y):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


def train_quietly(job, t, reporting=None, resume_from=None, accelerator=None):
    """``job`` trained through start-up's stages and the loop, as a recipe run is — its shape computed at start-up,
    the checkpoint ``resume_from`` (a folder, or "latest" in ``output.dir``) found, read once and checked as the
    command line checks it — without the banner (the suite's output stays readable)."""
    import dataclasses

    from finetune import loop, startup

    reporting = dataclasses.replace(reporting or loop.Reporting(), banner=False)
    return startup.train_job(job, t, reporting, str(resume_from) if resume_from is not None else None, accelerator)


def regression_data(n, d_in=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def tiny_gpt2(seed=0, vocab=64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
                     pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def token_data(n, vocab=64, lo=2, hi=12, seed=0):
    """Variable-length token sequences (lengths lo..hi)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, vocab, (length,), generator=g)})
    return out


pad_collate = _pad_collate(0)  # right-pads a micro-batch; padded label positions are -100


def copy_model(model):
    return copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------------------------
# running the CLI as a user does

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUN = str(ROOT / "finetune" / "run.py")
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
TINY = str(ROOT / "tests" / "assets" / "tiny-sentiment.yaml")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(ROOT)}


def cli(*args, launcher=(sys.executable,), timeout=600, env=None):
    """Run ``finetune/run.py`` with ``args`` (through ``launcher``) and return the CompletedProcess."""
    return subprocess.run([*launcher, RUN, *args], capture_output=True, text=True, env={**ENV, **(env or {})},
                          cwd=ROOT, timeout=timeout)


def assert_one_error_line(stderr: str, message: str) -> None:
    """Bad input as the user sees it: exactly one ``error:`` line, holding ``message``, and no traceback."""
    lines = [x for x in stderr.strip().splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]


def refused_in_process(capsys, args: list, message: str) -> None:
    """``finetune run ARGS`` through ``run_main`` in this process refuses with exit code 2 and one error line."""
    from finetune.cli import run_main

    capsys.readouterr()
    code = run_main(args)
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert_one_error_line(stderr, message)


def load_weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model" / "model.safetensors"))


def same_bytes(a: dict, b: dict) -> bool:
    """Every tensor equal bit for bit (same names, dtypes, shapes and bytes)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and a[k].contiguous().view(torch.uint8).equal(b[k].contiguous().view(torch.uint8)) for k in a)


# Custom recipes at small shapes (each run takes about a second) and the settings under which (b, N) = (b·N, 1).
SMALL = {
    "ode-latent": ["data.size=12", "model.hidden_channels=8", "model.ode_integration_steps=3",
                   "model.swd_projections=8", "model.swd_max_samples=16", "model.swd_patch=3"],
    "vae-digits": ["model.channels=8", "model.d_channels=8", "model.latent_dim=4", "model.kl_warmup_steps=3",
                   "model.r1_interval=2"],
    "video-motion": ["data.clips=60", "data.frames=3", "data.size=12", "model.channels=4", "model.dim=8",
                     "model.heads=2", "model.layers=1"],
}
# The transformer recipes at small shapes: a new 2-layer, 32-wide model from a config (the sentiment recipes keep
# MiniLM's tokenizer; the clm recipes train a 512-token one), 48 samples, two steps of 8.
TINY_TRANSFORMER = ["data.limit=48", "training.batch_size=4", "training.effective_batch_size=8"]
for _name in ("minilm-sentiment", "minilm-sentiment-lora", "minilm-valence"):
    SMALL[_name] = ["model.config={num_hidden_layers: 2, hidden_size: 32, num_attention_heads: 2, "
                    "intermediate_size: 64}", "data.max_length=16", *TINY_TRANSFORMER]
for _name in ("clm-pydoc", "clm-lion-long"):
    SMALL[_name] = ["model.config={model_type: gpt2, n_layer: 2, n_embd: 32, n_head: 2, n_positions: 64}",
                    "model.vocab_size=512", "data.seq_len=32", *TINY_TRANSFORMER]
SMALL["clm-lion-long"] += ["training.compile=false"]  # a minute of compiling on a CPU; compiled = eager elsewhere
# 22 training samples in windows of 12: the second window holds 10 = 3 + 3 + 3 + 1.
EXACT = ["model.dropout=0", "data.limit=22", "training.optimizer=sgd", "training.max_grad_norm=null",
         "training.epochs=2", "training.warmup_steps=0", "training.lr_scheduler=constant",
         "training.effective_batch_size=null"]


# ---------------------------------------------------------------------------------------------------------------
# a tiny chat model: a 2-layer Llama from a config and a byte-level BPE tokenizer with a ChatML template

import tempfile  # noqa: E402

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The test run's own folder (tests/conftest.py makes it before any test or worker starts and removes it at the end;
# a process started outside the suite gets a fresh one): nothing in it outlives the run.
ASSETS = Path(os.environ.get("FINETUNE_TEST_ASSETS") or tempfile.mkdtemp(prefix="finetune-tests-"))
TINY_CHAT = ASSETS / "tiny-chat-v1"


def sums(n: int, seed: int, longest_filler: int):
    """``n`` × (i, a, b, k, filler): two numbers to add, a third drawn with them, and up to ``longest_filler`` filler
    words (k of them, modulo) — the questions behind the tiny chat and preference rows."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    for i in range(n):
        a, b, k = (int(x) for x in torch.randint(0, 50, (3,), generator=g))
        filler = " ".join(words[int(j)] for j in torch.randint(0, len(words), (k % (longest_filler + 1),),
                                                                 generator=g))
        yield i, a, b, k, filler


def chat_rows(n=40, seed=0):
    """``n`` conversations of varying length: arithmetic questions, some with a system message, some with two
    user / assistant exchanges."""
    rows = []
    for i, a, b, k, filler in sums(n, seed, longest_filler=8):
        messages = [{"role": "user", "content": f"What is {a} plus {b}? {filler}".strip()},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}." + (" " + filler if k % 3 else "")}]
        if i % 3 == 1:
            messages.insert(0, {"role": "system", "content": "Answer with the sum."})
        if i % 4 == 2:
            messages += [{"role": "user", "content": f"And {a} minus {b}?"},
                         {"role": "assistant", "content": f"{a} minus {b} is {a - b}."}]
        rows.append({"messages": messages})
    return rows


def tiny_chat_assets() -> dict:
    """``{"model": dir, "data": jsonl}``: a 2-layer Llama (hidden 32) with its tokenizer and ChatML template, and 40
    chat rows, in ``TINY_CHAT``. Built once through ``finetune.cache`` (rank 0 builds inside a process group, the
    folder counts only with its manifest), so it is a collective there: every rank calls it at the same point."""
    from finetune import cache

    cache.folder(TINY_CHAT, write_tiny_chat, "tiny chat model")
    return {"model": str(TINY_CHAT / "model"), "data": str(TINY_CHAT / "chat.jsonl")}


def write_tiny_chat(out: Path) -> None:
    """Write the tiny chat model, its tokenizer and the chat rows into ``out``."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rows = chat_rows()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for r in rows for m in r["messages"]] + ["system user assistant"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    model.save_pretrained(out / "model", is_main_process=True)  # cache.folder builds on rank 0 only
    tokenizer.save_pretrained(out / "model")
    (out / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_tiny_gguf(path: Path) -> Path:
    """A GGUF file of a 2-layer Llama (hidden 16, fp32 tensors) with a byte-level BPE tokenizer and a chat template,
    written with the ``gguf`` package: what ``finetune.models.hf.gguf_folder`` converts, in a second."""
    import gguf
    import numpy as np

    vocab, hidden, inner, layers, heads, kv_heads = 64, 16, 32, 2, 2, 1
    tokens = ["<pad>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("a") + vocab - 4)] + ["ab"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inner)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    kv = hidden // heads * kv_heads
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                       f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (inner, hidden), f"blk.{i}.ffn_up.weight": (inner, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, inner)})
    for name, shape in shapes.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# The sft recipe on the tiny chat model (call tiny_chat_assets() before loading it).
SMALL["sft-smollm2"] = [f"model.name_or_path={TINY_CHAT / 'model'}", f"data.source={TINY_CHAT / 'chat.jsonl'}",
                        "data.val_fraction=0.2", "data.max_length=96", "data.system_prompt=null",
                        "model.generate_prompts=2", "model.max_new_tokens=4", "model.samples_saved=2"]


# GRPO on the tiny chat model: arithmetic prompts, the recipe's reward, short completions
SMALL["grpo-smollm2"] = [f"model.name_or_path={TINY_CHAT / 'model'}", "data.count=30", "data.max_operand=49",
                         "data.val_fraction=0.2", "model.num_generations=4", "model.temperature=1.0",
                         "model.max_completion_length=6", "training.batch_size=4", "training.effective_batch_size=8"]


# Preference pairs on the tiny chat model's arithmetic (the dpo task): the right sum against a wrong one, in TRL's
# three layouts — an explicit conversational prompt, an implicit one (whole conversations), and plain text.
TINY_PAIRS = ASSETS / "tiny-pairs-v1"
SMALL["dpo-smollm2"] = [f"model.name_or_path={TINY_CHAT / 'model'}", f"data.source={TINY_PAIRS / 'pairs.jsonl'}",
                        "data.val_fraction=0.2", "data.max_length=96", "data.system_prompt=null"]


def pair_rows(n=40, seed=0):
    """``n`` preference rows of varying length (chosen: the sum; rejected: a wrong sum, longer or shorter)."""
    rows = []
    for i, a, b, k, filler in sums(n, seed, longest_filler=6):
        question = f"What is {a} plus {b}? {filler}".strip()
        chosen = f"{a} plus {b} is {a + b}."
        rejected = f"{a} plus {b} is {a + b + 1 + k % 5}." + (f" {filler}" if i % 2 else "")
        if i % 3 == 0:
            rows.append({"prompt": [{"role": "user", "content": question}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
        elif i % 3 == 1:
            user = [{"role": "system", "content": "Answer with the sum."}, {"role": "user", "content": question}]
            rows.append({"chosen": [*user, {"role": "assistant", "content": chosen}],
                         "rejected": [*user, {"role": "assistant", "content": rejected}]})
        else:
            rows.append({"prompt": question, "chosen": chosen, "rejected": rejected})
    return rows


def tiny_pairs_assets() -> dict:
    """``{"model": dir, "data": jsonl}``: the tiny chat model and 40 preference rows (``pair_rows``); a collective in
    a process group, as ``tiny_chat_assets``."""
    import json

    from finetune import cache

    tiny = tiny_chat_assets()
    cache.folder(TINY_PAIRS, lambda out: (out / "pairs.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in pair_rows())), "tiny preference pairs")
    return {"model": tiny["model"], "data": str(TINY_PAIRS / "pairs.jsonl")}


def dpo_recipe_run(b, n, *overrides, job_hook=None, output=None, resume_from=None):
    """The dpo recipe on the tiny chat model and pairs (call tiny_pairs_assets() first), trained through the loop
    with micro-batch ``b`` and N = ``n``, full fine-tuning, SGD, no evaluation unless ``overrides`` say otherwise:
    (result, the job, the trainable weights before training)."""
    from finetune.loading import load_recipe
    from finetune.startup import build_job

    cfg = load_recipe("dpo-smollm2", [*SMALL["dpo-smollm2"], *EXACT, f"training.batch_size={b}",
                                      f"training.gradient_accumulation_steps={n}", "training.learning_rate=0.5",
                                      "training.eval_at_start=false", "peft.enabled=false", *overrides])
    job = build_job(cfg)  # seeded as the CLI seeds it
    job.val_data = None
    if job_hook is not None:
        job_hook(job)
    start = {k: p.detach().clone() for k, p in job.model.named_parameters() if p.requires_grad}
    result = train_quietly(job, cfg.training, output, resume_from)
    return result, job, start


def sft_recipe_run(b, n, *overrides, job_hook=None):
    """The sft recipe on the tiny chat model (call tiny_chat_assets() first), seeded as the CLI seeds it, trained
    through the loop with micro-batch ``b`` and N = ``n``, full fine-tuning unless ``overrides`` say otherwise:
    (result, the trainable weights before training)."""
    from finetune.loading import load_recipe
    from finetune.startup import build_job

    cfg = load_recipe("sft-smollm2", [*SMALL["sft-smollm2"], *EXACT, f"training.batch_size={b}",
                                      f"training.gradient_accumulation_steps={n}", "training.learning_rate=0.5",
                                      "training.eval_at_start=false", "model.generate_prompts=0",
                                      "peft.enabled=false", *overrides])
    job = build_job(cfg)
    job.val_data = None
    if job_hook is not None:
        job_hook(job)
    start = {k: p.detach().clone() for k, p in job.model.named_parameters() if p.requires_grad}
    return train_quietly(job, cfg.training), start


# ---------------------------------------------------------------------------------------------------------------
# comparing and cutting runs

import shutil  # noqa: E402


def assert_same_history(two: list, one: list, same_split: bool = True, loss_abs: float = 0.0) -> None:
    """Two histories of the same steps (e.g. 2 processes and 1): the same windows exactly, the same numbers to 1e-5
    (timings aside). ``same_split``: the windows were cut into the same micro-batches too. ``loss_abs``: also
    accept losses this close (a loss that sums to about 0, as GRPO's centred advantages make it)."""
    import pytest

    assert len(two) == len(one)
    for h2, h1 in zip(two, one):
        for key in ("step", "epoch", "window", "items", "samples", "window_hash", "content_hash", "skipped",
                    *(["micro_batches"] if same_split else [])):
            assert h2[key] == h1[key], key
        for key in ("loss", "grad_norm", "lr"):
            assert h2[key] == pytest.approx(h1[key], rel=1e-5, abs=loss_abs if key == "loss" else 0.0), key
        for key in ("tokens", "tokens_seen"):  # real tokens, over processes and the run so far: exact
            assert h2.get(key) == h1.get(key), key


def checkpoint_copy(run, out, step: int):
    """A copy of the run directory ``run`` at ``out`` whose newest checkpoint is the one after ``step`` optimizer
    steps (the later ones removed, ``latest`` pointing at it)."""
    shutil.copytree(run, out)
    for p in (out / "checkpoints").glob("step-*"):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    (out / "checkpoints" / "latest").write_text(f"step-{step:06d}\n")
    return out



def recipe_runs(root, recipe: str, base: list):
    """``run(name, b, *overrides)``: ``finetune run --recipe recipe`` at micro-batch ``b`` with ``base`` and
    ``overrides`` into ``root / name``, once per name (a module's runs shared by its tests); returns the folder."""
    from finetune.cli import run_main

    done = {}

    def run(name, b, *overrides):
        if name not in done:
            args = [f"--set={o}" for o in (*base, *overrides)]
            assert run_main(["--recipe", recipe, "--batch-size", str(b), *args,
                             "--output-dir", str(Path(root) / name)]) == 0
            done[name] = Path(root) / name
        return done[name]
    return run


def train_and_save(trainer) -> None:
    """A Trainer / TRL trainer's run and the folder ``finetune import`` reads: its weights and trainer_state."""
    trainer.train()
    trainer.save_model()
    trainer.save_state()


def one_word_changed(folder) -> str:
    """The tiny chat rows with one trained answer (of the sft recipe's 22 at split_seed 0) changed by one word
    (" is " → " was "): the certificate's negative control. Returns the file."""
    import json

    from finetune.data import split_samples

    rows = [json.loads(line) for line in open(tiny_chat_assets()["data"])]
    trained = split_samples(list(range(len(rows))), 0.2, 0, 22)[0]  # the rows the recipe trains on
    answer = next(m for m in rows[trained[7]]["messages"] if m["role"] == "assistant")
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    data = Path(folder) / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(data)


def tail_weighted_as_mean(monkeypatch, full: int = 4) -> None:
    """Make the loop weight each micro-batch of a short last window (fewer than ``full`` samples) as Accelerate's
    accumulate() does, dividing by N = 2 instead of by its share: that window's gradient is halved."""
    from finetune import steps

    accumulate, weight = steps.accumulate_window, steps.loss_weight

    def tail_as_mean(backward, window, micro_batches):
        if len(window.samples) < full:
            monkeypatch.setattr(steps, "loss_weight", lambda items, window_items, processes: processes / 2)
        try:
            return accumulate(backward, window, micro_batches)
        finally:
            monkeypatch.setattr(steps, "loss_weight", weight)

    monkeypatch.setattr("finetune.loop.accumulate_window", tail_as_mean)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny in-process runs (a second waits for a core on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cli_in_process(capsys, *args) -> tuple[int, str]:
    """(exit code, what it printed) of ``finetune ARGS`` run in this process."""
    from finetune.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    said = capsys.readouterr()
    return code, said.out + said.err


def edited_yaml(src: Path, folder: Path, change) -> Path:
    """A copy of the YAML file ``src`` in ``folder``, its mapping changed in place by ``change`` (a negative
    control's one edit)."""
    import yaml

    raw = yaml.safe_load(src.read_text())
    change(raw)
    copy_ = folder / src.name
    copy_.write_text(yaml.safe_dump(raw, sort_keys=False))
    return copy_


def cpu_kernels() -> str:
    """The CPU's kernel capabilities, for the failure message of a test whose numbers depend on them: torch's
    vector capability and the flags that decide oneDNN's half-precision kernels (``lscpu``'s, from /proc/cpuinfo)."""
    import torch

    flags = set()
    with contextlib.suppress(OSError):
        flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("flags")), "").split())
    said = ", ".join(f"{f}: {'yes' if f in flags else 'no'}" for f in ("avx512_fp16", "avx512_bf16", "amx_bf16",
                                                                       "amx_fp16"))
    return f"ran on CPU capability {torch.backends.cpu.get_cpu_capability()} ({said})"
