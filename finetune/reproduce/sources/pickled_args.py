"""``training_args.bin``: ``torch.save`` of a TrainingArguments object (or a subclass: TRL's configs, LLaMA-Factory's),
read by a restricted unpickler into its fields. Nothing from the file runs."""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

from finetune.errors import ConfigError

# The classes a TrainingArguments pickle holds: the arguments class itself (TRL's configs derive from it), its enums
# and the records it keeps (accelerate's state, its accelerator config, DeepSpeed's and FSDP's plugins and configs, a
# torch.device of any type and index, a dtype) — whatever device and number of processes it was saved on. Each
# becomes an inert stand-in: nothing from transformers, TRL, accelerate or torch is imported or called while reading.
ENUM_MODULES = ("transformers.", "trl.", "accelerate.", "torch.distributed.fsdp")  # where the enums live
ARGS_CLASSES = {"TrainingArguments", "Seq2SeqTrainingArguments"}
ENUMS = {"IntervalStrategy", "SaveStrategy", "HubStrategy", "SchedulerType", "OptimizerNames", "FSDPOption",
         "DebugOption", "ParallelMode", "DistributedType", "EvaluationStrategy", "ExplicitEnum", "ShardingStrategy",
         "BackwardPrefetch", "StateDictType", "CPUOffloadPolicy", "PrecisionType", "DynamoBackend"}
RECORDS = {("transformers.trainer_pt_utils", "AcceleratorConfig"), ("accelerate.state", "PartialState"),
           ("accelerate.utils.dataclasses", "DeepSpeedPlugin"),
           ("accelerate.utils.dataclasses", "FullyShardedDataParallelPlugin"),
           ("accelerate.utils.dataclasses", "TorchDynamoPlugin"),
           ("accelerate.utils.dataclasses", "ProjectConfiguration"),
           ("transformers.integrations.deepspeed", "HfTrainerDeepSpeedConfig"),
           ("transformers.integrations.deepspeed", "HfDeepSpeedConfig"),
           ("accelerate.utils.deepspeed", "HfDeepSpeedConfig"),
           ("torch.distributed.fsdp.api", "MixedPrecision"), ("torch.distributed.fsdp.api", "CPUOffload")}
DTYPES = {"float32", "float16", "bfloat16", "float64", "int8", "uint8"}  # a torch dtype: its name


class _Record:
    """A stand-in object: pickle's BUILD hands it the state it had; nothing else runs."""

    def __setstate__(self, state):
        self.state = state[1] if isinstance(state, tuple) and len(state) == 2 and state[0] is None else state


def _enum_value(value, *rest):
    return value


def _device(kind, index=None) -> str:
    """``torch.device('cuda', 3)`` as ``cuda:3`` (an indexed device: a process of a multi-GPU run)."""
    return str(kind) if index is None or ":" in str(kind) else f"{kind}:{index}"


def plain(value):
    """A value of the arguments with every stand-in replaced by the state it held (a dict): accelerate's state, the
    DeepSpeed and FSDP records, as mappings to read."""
    if isinstance(value, _Record):
        return plain(value.state)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


class _ArgsUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        # the arguments class by its name, from any tool that subclasses it (it is a stand-in: nothing of it runs)
        if name in ARGS_CLASSES or module.startswith("trl.") and name.endswith("Config"):
            return type(name, (_Record,), {})
        if name in ENUMS and module.startswith(ENUM_MODULES):
            return _enum_value
        if (module, name) == ("torch", "device"):
            return _device
        if module == "torch" and name in DTYPES:
            return f"torch.{name}"
        if (module, name) in RECORDS:
            return type(name, (_Record,), {})
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"a tensor storage ({pid!r})")


def read_training_args_bin(path: Path, what: str = "baseline") -> dict:
    """The fields of a ``training_args.bin`` (``torch.save`` of a TrainingArguments or a TRL config), read with a
    restricted unpickler that accepts only those classes, their enums and the records they hold, each as an inert
    stand-in. Any other class (or a tensor) refuses the whole file with one line: nothing from it runs.

    Raises ConfigError for a foreign class or a file that is not a ``torch.save`` zip of one object."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise ConfigError(f"{what}: {path} is not a torch.save file of training arguments")
            data = z.read(names[0])
    except zipfile.BadZipFile:
        raise ConfigError(f"{what}: {path} is not a torch.save zip file (training arguments are saved as one since "
                          "torch 1.6); give training_args.json or the model card") from None
    try:
        obj = _ArgsUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise ConfigError(f"{what}: {path} holds {e}, which is not a TrainingArguments class or one of its enums; "
                          "refused, nothing from it was run") from None
    except Exception as e:  # a malformed pickle: said in one line, never run
        raise ConfigError(f"{what}: {path} is not a readable pickle of training arguments ({type(e).__name__})") \
            from None
    if not isinstance(obj, _Record) or not isinstance(getattr(obj, "state", None), dict):
        raise ConfigError(f"{what}: {path} does not hold a TrainingArguments object")
    return {k: plain(v) for k, v in obj.state.items()}


