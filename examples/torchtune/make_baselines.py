"""Train the torchtune baselines that ``tests/test_torchtune_runs.py`` reproduces: its own CLI, on the CPU, fp32.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python examples/torchtune/make_baselines.py --tune /work/tt-venv/bin/tune

torchtune pins its own versions (0.6.1 imports ``torchao.dtypes.nf4tensor``, gone from torchao 0.18), so it runs from
an environment of its own, named by ``--tune``: measured with torch 2.13.0+cpu, torchtune 0.6.1 and torchao 0.15.0
(0.16 lacks ``int4_weight_only``, which 0.6.1 imports; its C++ kernels are skipped under torch 2.13: none is used).
This script runs with finetune's environment (transformers, tokenizers) and

1. writes ``tests/assets/torchtune-tiny/``: a 2-layer Qwen2 (hidden 32, 4 heads, 2 KV heads, untied embeddings,
   seed 0) saved with ``save_pretrained`` (safetensors), a byte-level BPE tokenizer with Qwen2's pre-tokenizer (its
   ``tokenizer.json`` and the ``vocab.json`` + ``merges.txt`` torchtune's ``qwen2_tokenizer`` reads) and the ChatML
   template; ``chat.jsonl`` (40 conversations of ``tests/helpers.chat_rows``) and ``chat-one-word.jsonl`` (one word
   of one answer changed);
2. runs ``tune run full_finetune_single_device`` and ``tune run lora_finetune_single_device`` with the configs
   beside this file (batch_size 2 × gradient_accumulation_steps 2, one epoch, AdamW, cosine with warm-up, clipping)
   from ``tests/assets/`` (the configs' paths are relative to it), and the full one again in pure bf16
   (``dtype=bf16``);
3. keeps what a reader needs in ``tests/assets/torchtune-full/``, ``torchtune-full-bf16/`` and ``torchtune-lora/``: the
   ``torchtune_config.yaml``, the DiskLogger log and the last epoch's weights (LoRA: the adapters), a few hundred KB;
4. writes ``tests/assets/torchtune-lora-initial/``: the adapters torchtune started from (it saves none), drawn by
   replaying its recipe's start — seed, then the model build — with torchtune's own python.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ASSETS = HERE.parent.parent / "tests" / "assets"
TINY = ASSETS / "torchtune-tiny"
# torchtune 0.6.1's Qwen2Tokenizer pre-tokenizer (torchtune/models/qwen2/_tokenizer.py PRETOKENIZE_REGEX), so the
# Hugging Face tokenizer finetune loads splits text as torchtune does
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_model(out: Path) -> None:
    """The tiny Qwen2, its tokenizer (HF files and torchtune's vocab.json + merges.txt), and the chat rows."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from tests.helpers import CHATML, chat_rows

    rows = chat_rows()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for r in rows for m in r["messages"]] + ["system user assistant"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, torch_dtype="float32"))
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    tok.model.save(str(out / "model"))  # vocab.json + merges.txt, for torchtune's qwen2_tokenizer
    (out / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    changed = [json.loads(json.dumps(r)) for r in rows]
    answer = changed[5]["messages"][-1]
    assert " plus " in answer["content"], answer
    answer["content"] = answer["content"].replace(" plus ", " and ", 1)  # one word of one answer
    (out / "chat-one-word.jsonl").write_text("".join(json.dumps(r) + "\n" for r in changed))


# each baseline: its recipe, config and overrides (full-bf16: the full run in torchtune's pure bf16, every weight and
# the optimizer's state in bf16)
RUNS = {"full": ("full_finetune_single_device", "full", []),
        "lora": ("lora_finetune_single_device", "lora", []),
        "full-bf16": ("full_finetune_single_device", "full", ["dtype=bf16"])}


def train(tune: str, kind: str) -> None:
    """``tune run <recipe> --config <config>.yaml [overrides]`` from tests/assets/, then keep the run's small files."""
    recipe, config, overrides = RUNS[kind]
    scratch = ASSETS / f"torchtune-{kind}-scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run([tune, "run", recipe, "--config", str(HERE / f"{config}.yaml"), f"output_dir={scratch.name}",
                    *overrides], cwd=ASSETS, check=True)
    keep = ASSETS / f"torchtune-{kind}"
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir()
    shutil.copy(scratch / "torchtune_config.yaml", keep)
    (keep / "logs").mkdir()
    for log in (scratch / "logs").glob("log_*.txt"):
        shutil.copy(log, keep / "logs")
    epochs = sorted(scratch.glob("epoch_*"), key=lambda p: int(p.name.split("_")[-1]))
    last = keep / epochs[-1].name
    last.mkdir()
    wanted = ["config.json", "adapter_config.json", "adapter_model.safetensors"] if kind == "lora" else \
        ["config.json", *[p.name for p in epochs[-1].glob("model-*.safetensors")]]
    for name in wanted:
        shutil.copy(epochs[-1] / name, last)
    shutil.rmtree(scratch)
    if kind == "lora":
        initial_adapters(tune, keep)


# Run with torchtune's python: the LoRA adapters torchtune 0.6.1's lora_finetune_single_device starts from. Its recipe
# seeds (training.set_seed) and then builds the model before anything else draws a random number (the checkpoint is
# loaded with strict=False over the base weights only), so building the same model after the same seed draws them.
INITIAL = """
import json, sys
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torchtune import config, training
from torchtune.models.convert_weights import tune_to_peft_adapter_weights
from torchtune.modules.peft import get_adapter_params

cfg, out, hf = OmegaConf.load(sys.argv[1]), sys.argv[2], json.load(open(sys.argv[3]))
assert not {"q_proj", "k_proj"} & set(cfg.model.lora_attn_modules)  # saved permuted for Qwen2 (see lora.yaml)
training.set_seed(seed=cfg.seed)
with training.set_default_dtype(torch.float32), torch.device("cpu"):
    model = config.instantiate(cfg.model)
adapters = {k: v.detach().clone() for k, v in get_adapter_params(model).items()}
save_file(tune_to_peft_adapter_weights(adapters, num_heads=hf["num_attention_heads"],
          num_kv_heads=hf["num_key_value_heads"], dim=hf["hidden_size"]), out, metadata={"format": "pt"})
"""


def initial_adapters(tune: str, keep: Path) -> None:
    """``<keep>-initial/``: torchtune's LoRA adapters before the first step (for ``finetune import
    --initial-adapter``), drawn by replaying its recipe's start with its own python, next to ``tune``."""
    folder = keep.parent / f"{keep.name}-initial"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    subprocess.run([str(Path(tune).parent / "python"), "-c", INITIAL, str(keep / "torchtune_config.yaml"),
                    str(folder / "adapter_model.safetensors"), str(TINY / "model" / "config.json")],
                   cwd=ASSETS, check=True)
    shutil.copy(next(keep.glob("epoch_*")) / "adapter_config.json", folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tune", required=True, help="torchtune's `tune` command, in its own environment")
    parser.add_argument("--only", choices=list(RUNS), help="train one baseline (the tiny model and rows are kept "
                                                           "when they exist)")
    args = parser.parse_args()
    if not args.only or not TINY.is_dir():
        shutil.rmtree(TINY, ignore_errors=True)
        write_model(TINY)
    for kind in [args.only] if args.only else list(RUNS):
        train(args.tune, kind)


if __name__ == "__main__":
    main()
