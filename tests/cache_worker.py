"""Run by tests/test_cache.py as one of two processes (a gloo group over a file store, or no group): builds one
cache folder through ``finetune.cache`` and writes what it saw to ``<tmp>/result-<rank>.json``.

    python tests/cache_worker.py MODE RANK WORLD TMP

Rank 1 always arrives first: rank 0 waits ``LATE`` seconds before it asks for the folder.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from finetune import cache
from finetune.errors import ConfigError

LATE = 1.0


def save_tiny_model(out: Path, seconds: float = 0.0) -> None:
    """save_pretrained of a tiny Llama, as a cache of a converted model does (a marker file counts the builds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    time.sleep(seconds)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(out, is_main_process=True)
    (out / f"built-by-{os.getpid()}").write_text("")


def old_scheme(target: Path) -> None:
    """What the test assets and the GGUF cache did before: every process builds its own copy and renames it into
    place, the first rename wins. Rank 1 renames first here."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    if dist.get_rank() == 0:
        dist.barrier()
    save_tiny_model(tmp)
    try:
        os.replace(tmp, target)
    except OSError:
        pass
    if dist.get_rank() == 1:
        dist.barrier()


def main(mode: str, rank: int, world: int, tmp: Path) -> dict:
    if mode != "lock":  # "lock": independent processes, no group
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank, world_size=world)
    target = tmp / "cache" / "model"
    if rank == 0:
        time.sleep(LATE)
    if mode == "old":
        old_scheme(target)
        return {"path": str(target)}
    if mode == "gguf":
        from finetune.models.hf import resolve_model_path

        return {"path": resolve_model_path(str(tmp / "tiny.gguf"))}
    build = {"group": save_tiny_model, "lock": lambda out: save_tiny_model(out, seconds=2 * LATE),
             "slow": lambda out: save_tiny_model(out, seconds=3), "fail": lambda out: 1 / 0}[mode]
    path = cache.folder(target, build, "tiny model", timeout=1.5 if mode == "slow" else 60)
    return {"path": str(path)}


if __name__ == "__main__":
    mode, rank, world, tmp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    try:
        result = main(mode, rank, world, tmp)
    except ConfigError as e:
        result = {"error": str(e)}
    except Exception as e:
        result = {"crash": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    (tmp / f"result-{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()
