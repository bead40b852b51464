"""Every shipped recipe runs two optimizer steps through the command line, at a small shape.

The list is the recipe folder, read when the tests are collected: a new recipe is run here the day it is added, and
fails until it has a small override set (``SMALL`` in tests/helpers.py: a tiny model and a few dozen samples). The
recipes' own numbers are checked elsewhere; here each one loads, builds, trains and writes its history."""

from __future__ import annotations

import json
import math

import pytest

from finetune.registry import list_recipes
from tests.helpers import SMALL, cli, tiny_pairs_assets

RECIPES = [name for name, _ in list_recipes()]


def small_overrides(name: str) -> list:
    """The recipe's small override set; a recipe without one fails, saying where to add it."""
    if name not in SMALL:
        pytest.fail(f"recipe {name} has no small override set: add SMALL[{name!r}] in tests/helpers.py (a tiny "
                    "model and data, so that tests/test_recipes.py runs it in seconds)", pytrace=False)
    return SMALL[name]


def history(out) -> list:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_runs_two_steps(tmp_path, name):
    tiny_pairs_assets()  # the chat recipes' model and data (the tiny chat model and its preference pairs)
    sets = [a for s in small_overrides(name) for a in ("--set", s)]
    out = tmp_path / "run"
    proc = cli("--recipe", name, "--max-steps", "2", *sets, "--set", "output.plots=false", "--output-dir", str(out),
               env={"OMP_NUM_THREADS": "1"})  # tiny models: a second thread only adds synchronisation
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = history(out)
    assert [h["step"] for h in steps] == [1, 2], steps
    assert all(math.isfinite(h["loss"]) for h in steps), steps


def test_a_recipe_without_a_small_override_set_fails_saying_where_to_add_one():
    """The negative control: a recipe added to the folder without a small override set is not skipped."""
    with pytest.raises(pytest.fail.Exception, match=r"add SMALL\['my-new-recipe'\] in tests/helpers.py"):
        small_overrides("my-new-recipe")
    assert small_overrides(RECIPES[0]) == SMALL[RECIPES[0]]
