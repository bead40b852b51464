"""``training_args.bin`` of any class, read as a plain record: axolotl's ``AxolotlTrainingArguments`` (today's module
and the 2023–2025 one), Unsloth's generated ``UnslothSFTConfig``, TRL's configs, enum members pickled by value, by
``getattr(Class, 'NAME')`` and by the dotted global — with nothing of the file imported or called — and the output
folders of axolotl and Unsloth imported with their settings. What would run code is refused in one line; each such
file is shown to run its payload when unpickled as is (the negative control). The files: tests/assets/corpus/pickles
(PROVENANCE.md; made by its make_pickles.py)."""

from __future__ import annotations

import builtins
import pickle
import pickletools
import zipfile
from pathlib import Path

import pytest
import yaml

from finetune.errors import ConfigError
from finetune.reproduce.sources.pickled_args import read_training_args_bin
from tests.helpers import assert_one_error_line
from tests.helpers import cli_in_process as cli

CORPUS = Path(__file__).parent / "assets" / "corpus" / "pickles"


def globals_named(path: Path) -> set[str]:
    """The ``module name`` pairs a torch.save file's pickle names (GLOBAL, and STACK_GLOBAL's two strings)."""
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    names, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            names.add(arg)
        elif op.name == "STACK_GLOBAL":
            names.add(" ".join(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return names


def plain_data(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain_data(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(plain_data(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool, bytes))


# ---------------------------------------------------------------------------------------------------------------
# the classes of other tools, read without them


FOREIGN = {  # folder → (the class its pickle names, fields only that class has)
    "unsloth-sft": ("UnslothSFTTrainer UnslothSFTConfig", {"unsloth_num_chunks": -1, "max_seq_length": 512}),
    "unsloth-grpo": ("UnslothGRPOTrainer UnslothGRPOConfig", {
        "num_generations": 8,  # vLLM's SamplingParams, a struct pickled as its fields' values in order: those values
        "vllm_sampling_params": [1, None, None, 0.0, 0.0, 1.0, 0.9, 0.95, -1, 0.1, 3407, ["<|im_end|>"], [], False,
                                 16, 0]}),
    "axolotl-lora": ("axolotl.core.training_args AxolotlTrainingArguments",
                     {"sample_packing": False, "image_resize_algorithm": 2}),  # PIL's Resampling.BILINEAR
    "axolotl-trainer-builder": ("axolotl.core.trainer_builder AxolotlTrainingArguments", {"max_seq_length": 512}),
}


@pytest.mark.parametrize("folder", sorted(FOREIGN))
def test_a_foreign_arguments_class_is_read_as_plain_fields_with_nothing_imported(folder, monkeypatch):
    path = CORPUS / folder / "training_args.bin"
    named, own = FOREIGN[folder]
    assert named in globals_named(path)  # the file names the tool's class, which is not installed here
    imported = []
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: imported.append(name) or real_import(name, *a,
                                                                                                        **k))
    args = read_training_args_bin(path)
    monkeypatch.undo()
    named_tools = {"axolotl", "UnslothSFTTrainer", "UnslothGRPOTrainer", "vllm", "PIL", "transformers", "trl",
                   "accelerate"}
    assert not [m for m in imported if m.split(".")[0] in named_tools], imported
    assert {k: args[k] for k in own} == own
    assert plain_data(args), args  # no stand-in or callable left: every value is data
    assert args["distributed_state"]["device"] == "cuda" and args["accelerator_config"]["even_batches"] is True


@pytest.mark.parametrize("folder, how", [("enums-by-getattr", "__builtin__ getattr"),
                                         ("enums-by-dotted-global", "transformers.trainer_utils SchedulerType.")])
def test_enum_members_pickled_by_name_are_read_as_their_values(folder, how):
    path = CORPUS / folder / "training_args.bin"
    assert any(g.startswith(how) for g in globals_named(path)), globals_named(path)  # the form under test
    args = read_training_args_bin(path)
    got = {k: args[k] for k in ("lr_scheduler_type", "optim", "eval_strategy", "save_strategy", "hub_strategy")}
    # the values transformers gives these members; OptimizerNames.PAGED_ADAMW's is not its name lower-cased
    assert got == {"lr_scheduler_type": "cosine_with_restarts", "optim": "paged_adamw_32bit",
                   "eval_strategy": "steps", "save_strategy": "epoch", "hub_strategy": "every_save"}


@pytest.mark.parametrize("config", ["SFTConfig", "DPOConfig", "GRPOConfig"])
def test_trl_configs_of_the_installed_library_are_read(config, tmp_path):
    import torch
    import trl

    cls = getattr(trl, config)
    args = cls(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=3,
               learning_rate=7e-6, lr_scheduler_type="cosine", num_train_epochs=2, report_to=[], use_cpu=True,
               **({"num_generations": 4} if config == "GRPOConfig" else {}))
    _ = args.device
    torch.save(args, tmp_path / "training_args.bin")
    read = read_training_args_bin(tmp_path / "training_args.bin")
    assert (read["per_device_train_batch_size"], read["gradient_accumulation_steps"], read["learning_rate"],
            read["lr_scheduler_type"], read["num_train_epochs"]) == (4, 3, 7e-6, "cosine", 2)
    assert plain_data(read)


def test_the_data_types_a_pickle_builds_are_read_as_plain_values(tmp_path):
    """numpy scalars (a learning rate computed with numpy), bytes (protocol 2: ``_codecs.encode``), dates, paths,
    sets and ordered dicts: built by the reader, as the values they hold."""
    import collections
    import datetime

    import numpy as np
    import torch
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    args.learning_rate, args.num_train_epochs, args.fp16 = np.float64(2e-4), np.int64(3), np.bool_(False)
    args.extra = {"when": datetime.datetime(2024, 5, 1, 12, 30), "day": datetime.date(2024, 5, 1),
                  "timeout": datetime.timedelta(minutes=30), "where": Path("/data/run"), "tags": {"a"},
                  "order": collections.OrderedDict(b=1, a=2), "raw": b"\x00\xff", "f32": np.float32(0.5)}
    torch.save(args, tmp_path / "training_args.bin")
    assert "numpy._core.multiarray scalar" in globals_named(tmp_path / "training_args.bin")
    read = read_training_args_bin(tmp_path / "training_args.bin")
    assert (read["learning_rate"], read["num_train_epochs"], read["fp16"]) == (2e-4, 3, False)
    assert read["extra"] == {"when": "2024-05-01T12:30:00", "day": "2024-05-01", "timeout": 1800.0,
                             "where": "/data/run", "tags": ["a"], "order": {"b": 1, "a": 2}, "raw": b"\x00\xff",
                             "f32": 0.5}
    assert plain_data(read)


@pytest.mark.parametrize("folder, expected", [
    ("unsloth-sft", {"effective_batch_size": 8, "learning_rate": 5e-05, "lr_scheduler": "linear", "max_steps": 60,
                     "warmup_steps": 10, "r": 16, "alpha": 16}),
    ("axolotl-lora", {"effective_batch_size": 8, "learning_rate": 0.001, "lr_scheduler": "cosine", "epochs": 1,
                      "warmup_steps": 2, "r": 8, "alpha": 16}),
    ("axolotl-trainer-builder", {"effective_batch_size": 8, "learning_rate": 0.001, "lr_scheduler": "cosine",
                                 "epochs": 1, "r": 8, "alpha": 16}),
])
def test_an_output_folder_of_axolotl_or_unsloth_imports_with_its_settings(folder, expected, tmp_path, capsys):
    out = tmp_path / "recipe.yaml"
    code, table = cli(capsys, "import", CORPUS / folder, "-o", out)
    assert code == 0, table
    raw = yaml.safe_load(out.read_text())
    got = {**raw["training"], **raw["peft"]}
    assert {k: got[k] for k in expected} == expected, table
    row = next(line for line in table.splitlines() if line.startswith("training.learning_rate"))
    assert row.split()[-1] == "training_args.bin", row  # the arguments' file said it, not a default


# ---------------------------------------------------------------------------------------------------------------
# what would run code: refused in one line, and shown to run when unpickled as is


def _str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def _global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


ARGS = _global("transformers.training_args", "TrainingArguments") + b")\x81"  # NEWOBJ: an arguments object


def payloads(marker: Path) -> dict:
    """Each hand-written pickle (protocol 2) → what the refusal names. ``touch MARKER`` is what would run."""
    touch = _str(f"touch {marker}")
    return {
        # __reduce__ to a builtin through getattr: getattr(__import__('os'), 'system')('touch …')
        "getattr to a builtin": (b"\x80\x02" + _global("__builtin__", "getattr") + _global("__builtin__", "__import__")
                                 + _str("os") + b"\x85R" + _str("system") + b"\x86R" + touch + b"\x85R.",
                                 "__builtin__.__import__ (a name of Python's standard library)"),
        "builtins.eval": (b"\x80\x02" + _global("builtins", "eval") + _str(f"__import__('os').system('touch {marker}')")
                          + b"\x85R.", "builtins.eval (a name of Python's standard library)"),
        "builtins.exec": (b"\x80\x02" + _global("builtins", "exec") + _str(f"import os; os.system('touch {marker}')")
                          + b"\x85R.", "builtins.exec (a name of Python's standard library)"),
        # a stand-in whose state plants an instance __setstate__, which the second BUILD calls
        "state smuggling os.system": (b"\x80\x02" + ARGS + b"}" + _str("__setstate__") + _global("posix", "system")
                                      + b"sb" + touch + b"b.", "posix.system (a name of Python's standard library)"),
        "a second state": (b"\x80\x02" + ARGS + b"}" + _str("__setstate__")
                           + _global("transformers.trainer_utils", "IntervalStrategy") + b"sb" + touch + b"b.",
                           "a second state for one transformers.training_args.TrainingArguments object"),
        "a field holding a class": (b"\x80\x02" + ARGS + b"}" + _str("optim")
                                    + _global("transformers.trainer_utils", "IntervalStrategy") + b"sb.",
                                    "the class transformers.trainer_utils.IntervalStrategy as a value"),
        "a field holding a function": (b"\x80\x02" + ARGS + b"}" + _str("callback")
                                       + _global("transformers.trainer_utils", "set_seed") + b"sb.",
                                       "transformers.trainer_utils.set_seed (a function or other callable"),
        "getattr to a private name": (b"\x80\x02" + _global("__builtin__", "getattr")
                                      + _global("transformers.trainer_utils", "IntervalStrategy")
                                      + _str("__subclasses__") + b"\x86R)R.", "getattr of '__subclasses__'"),
        "getattr on a string": (b"\x80\x02" + _global("__builtin__", "getattr") + touch + _str("upper") + b"\x86R)R.",
                                "getattr on str, not on a class of the arguments"),
        "an enum member called": (b"\x80\x02" + _global("__builtin__", "getattr")
                                  + _global("transformers.trainer_utils", "IntervalStrategy") + _str("STEPS")
                                  + b"\x86R" + touch + b"\x85R.",
                                  "a call of transformers.trainer_utils.IntervalStrategy.STEPS, an enum member"),
    }


RUNS_AS_IS = ("getattr to a builtin", "builtins.eval", "builtins.exec", "state smuggling os.system")


def as_torch_save(data: bytes, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/version", "3\n")
    return path


@pytest.mark.parametrize("case", sorted(payloads(Path("m"))))
def test_a_pickle_that_would_run_code_is_refused_in_one_line(case, tmp_path):
    marker = tmp_path / "ran"
    data, names = payloads(marker)[case]
    path = as_torch_save(data, tmp_path / "training_args.bin")
    with pytest.raises(ConfigError) as e:
        read_training_args_bin(path)
    said = str(e.value)
    assert names in said and said.endswith("refused, nothing from it was run") and "\n" not in said, said
    assert not marker.exists()
    if case in RUNS_AS_IS:  # negative control: unpickled as is, the file runs its command
        pickle.loads(data)
        assert marker.exists()


def test_a_git_lfs_pointer_is_said_to_be_one(tmp_path):
    path = tmp_path / "training_args.bin"  # what a clone without `git lfs pull` holds
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 6289\n")
    with pytest.raises(ConfigError, match="is a Git LFS pointer, not the file: fetch it"):
        read_training_args_bin(path)


def test_a_refused_pickle_is_one_error_line_through_import(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("trainer_state.json", "adapter_config.json"):
        (folder / name).write_text((CORPUS / "unsloth-sft" / name).read_text())
    marker = tmp_path / "ran"
    as_torch_save(payloads(marker)["getattr to a builtin"][0], folder / "training_args.bin")
    code, said = cli(capsys, "import", folder, "-o", tmp_path / "r.yaml")
    assert code == 2 and not (tmp_path / "r.yaml").exists() and not marker.exists()
    assert_one_error_line(said, "holds __builtin__.__import__ (a name of Python's standard library): not training "
                                "arguments")


@pytest.mark.parametrize("config, objective", [("SFTConfig", "sft"), ("DPOConfig", "dpo"), ("GRPOConfig", "grpo"),
                                               ("KTOConfig", "kto"), ("RewardConfig", "reward model"),
                                               ("TrainingArguments", None)])
def test_the_arguments_class_names_the_objective(config, objective, tmp_path):
    """A ``training_args.bin`` of TRL's real config classes: the class is the trainer's, so it names the objective
    (``training_args.bin: DPOConfig``), before any key is looked at; the Trainer's own TrainingArguments names none
    (the control), and Unsloth's classes are TRL's with its prefix."""
    import torch
    import transformers
    import trl

    from finetune.reproduce.objective import said_objective
    from finetune.reproduce.sources.files import read_file

    cls = getattr(trl, config, None) or getattr(transformers, config)
    torch.save(cls(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True), tmp_path / "training_args.bin")
    said = said_objective(read_file(tmp_path / "training_args.bin", "import"))
    if objective is None:
        assert said is None or "TrainingArguments" not in said.where, said
        return
    assert said is not None and said.name == objective and said.where == f"training_args.bin: {config}", said
    unsloth = read_file(CORPUS / "unsloth-grpo" / "training_args.bin", "import")
    assert said_objective(unsloth).where == "training_args.bin: UnslothGRPOConfig"
