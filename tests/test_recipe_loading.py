"""Every recipe a user can be handed loads as written: the shipped recipes, each doc's YAML block that is a recipe
(a ``task:`` key; a task file the doc names is written from the doc's own Python block) and every recipe fixture in
tests/assets. Loading settles every default, so the resolved settings (what a run's config.yaml records) load back
to themselves. The training section's groups (``t.precision`` …) are built from its flat fields, the keys users
write."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from finetune.config import GROUPS, TrainingConfig
from finetune.errors import ConfigError
from finetune.loading import config_from_dict, load_recipe, read_yaml
from tests.helpers import ROOT

FENCED = re.compile(r"```(yaml|python)\n(.*?)```", re.S)


def shipped() -> list:
    return sorted((ROOT / "recipes").glob("*.yaml"))


def fixtures() -> list:
    """The YAML files under tests/assets that are finetune recipes (a mapping with ``task:`` whose task finetune
    knows): the other tools' configs there are read by ``finetune import``, not loaded as recipes."""
    out = []
    for path in sorted((ROOT / "tests" / "assets").rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict) and "task" in raw and "training" in raw:
            out.append(path)
    return out


def doc_recipes() -> list:
    """(doc, block index) of every fenced ``yaml`` block in docs/ that is a mapping with a ``task:`` key."""
    out = []
    for doc in sorted((ROOT / "docs").rglob("*.md")):
        for i, (kind, text) in enumerate(FENCED.findall(doc.read_text())):
            if kind == "yaml":
                try:
                    raw = yaml.safe_load(text)
                except yaml.YAMLError:
                    continue
                if isinstance(raw, dict) and "task" in raw:
                    out.append((doc, i))
    return out


def round_trips(cfg) -> dict:
    """The resolved settings of ``cfg``, after checking that they load back to themselves."""
    settings = cfg.to_dict()
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(settings, sort_keys=False)), name=cfg.name)
    assert again.to_dict() == settings
    return settings


@pytest.mark.parametrize("path", shipped(), ids=lambda p: p.stem)
def test_every_shipped_recipe_loads_and_its_settings_load_back(path):
    settings = round_trips(load_recipe(str(path)))
    assert settings["task"] == read_yaml(path)["task"] and settings["name"] == path.stem


@pytest.mark.parametrize("path", fixtures(), ids=lambda p: str(p.relative_to(ROOT / "tests" / "assets")))
def test_every_recipe_fixture_loads_and_its_settings_load_back(path):
    round_trips(load_recipe(str(path)))


@pytest.mark.parametrize("doc,index", doc_recipes(), ids=lambda x: x.stem if isinstance(x, Path) else str(x))
def test_every_recipe_in_the_docs_loads_and_its_settings_load_back(doc, index, tmp_path):
    blocks = FENCED.findall(doc.read_text())
    raw = yaml.safe_load(blocks[index][1])
    task = str(raw["task"])
    if task.endswith(".py"):  # a task file beside the recipe: the doc's Python block that builds it
        code = [text for kind, text in blocks if kind == "python" and "def build" in text]
        assert code, f"{doc.name}: the recipe names {task}, and no Python block of the doc defines build"
        (tmp_path / Path(task).name).write_text(code[0])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(blocks[index][1])
    round_trips(load_recipe(str(recipe)))


def test_the_lists_are_not_empty():
    """Negative control of the parametrisation: a glob gone wrong would test nothing."""
    assert len(shipped()) >= 10 and fixtures() and doc_recipes()


def test_resolved_settings_that_do_not_load_are_caught():
    cfg = load_recipe(str(shipped()[0]))
    broken = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, epochs=0))
    with pytest.raises(ConfigError, match="training.epochs"):
        round_trips(broken)


def test_the_training_groups_are_its_flat_fields():
    """Each group holds fields of the training section, none in two groups, and reads them as they are now (an
    override or a ``dataclasses.replace`` shows in the group)."""
    names = {f.name for f in dataclasses.fields(TrainingConfig)}
    grouped = [f.name for cls in GROUPS for f in dataclasses.fields(cls)]
    assert set(grouped) <= names and len(grouped) == len(set(grouped))
    t = dataclasses.replace(TrainingConfig(), mixed_precision="bf16", learning_rate=0.5, betas=[0.8, 0.9],
                            max_steps=3, eval_every=2, seed=7)
    assert t.precision.mixed_precision == "bf16" and t.optimizer_settings.learning_rate == 0.5
    assert t.optimizer_settings.betas == (0.8, 0.9) and t.schedule.max_steps == 3
    assert t.cadence.eval_every == 2 and t.data_order.seed == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.precision.mixed_precision = "fp16"
    # the groups are not settings of their own: the recipe's keys and its resolved dict stay flat
    assert not {"precision", "optimizer_settings", "schedule", "cadence", "data_order"} & names
