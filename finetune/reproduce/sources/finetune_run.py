"""finetune's own runs: a run folder (``history.jsonl``, ``config.yaml``) or its model card (``model/README.md``),
which carry the resolved recipe whole (``Baseline.recipe``). Imported as that recipe, its effective batch kept and
the micro-batch the user's (``card.reproducible``); compared run against run (``Baseline.run``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from finetune import card as card_io
from finetune.outputs import read_config, read_metrics
from finetune.reproduce.record import Baseline, WholeRecipe
from finetune.reproduce.sources.contract import Reader


def run_folder(path: Path) -> Optional[Path]:
    """``path`` when it is a finetune run folder, else the run whose ``model/`` folder (or card) it is; None when
    neither."""
    for p in (path, path.parent, path.parent.parent):
        if (p / "history.jsonl").is_file() and (p / "config.yaml").is_file():
            return p if p == path or path in (p / "model", p / "model" / "README.md") else None
    return None


def card_of(path: Path) -> Optional[Path]:
    return next((c for c in ((path / "model") if path.is_dir() else path, path) if card_io.is_card(c)), None)


class FinetuneRun(Reader):
    name = "finetune"
    reads = "a finetune run folder (history.jsonl, config.yaml) or its model card (model/README.md): its recipe, whole"

    def recognises(self, path: Path) -> bool:
        return (path.is_dir() and (path / "history.jsonl").is_file() and (path / "config.yaml").is_file()) or \
            card_of(path) is not None

    def read(self, path: Path, what: str) -> Baseline:
        run = run_folder(path)  # the run, or the run whose card this is: its config names its files on this machine
        b = Baseline("finetune run" if run == path else "finetune model card", path, run=run)
        b.recipe = whole(path, run)
        return b


SOURCE = FinetuneRun()


def whole(path: Path, run: Optional[Path]) -> WholeRecipe:
    """The run's resolved recipe whole, its effective batch kept (``card.reproducible``), from its folder where it
    is here, else from its card; with what was read and the data's sha256 the card records."""
    card = card_of(path)
    if run is not None:
        recipe = card_io.reproducible(read_config(run), read_metrics(run).get("effective_batch_size"))
    else:
        recipe = card_io.read_recipe(card)
    kind = "run" if run == path else "model card of a run here" if run else "model card"
    said = (f"finetune {kind}: {path} (its resolved recipe, whole; effective batch "
            f"{(recipe.get('training') or {}).get('effective_batch_size')} kept, the micro-batch yours)")
    return WholeRecipe(recipe, said, card_io.card_data_sha(card) if card else None)
