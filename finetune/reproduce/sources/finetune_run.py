"""finetune's own runs: a run folder (``history.jsonl``, ``config.yaml``) or its model card (``model/README.md``),
which carry the resolved recipe whole. Imported as that recipe, its effective batch kept and the micro-batch the
user's (``card.reproducible``); compared run against run (``compare.compare_runs``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from finetune import card as card_io
from finetune.outputs import read_config, read_metrics
from finetune.reproduce.record import Baseline
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
        run = path if (path / "history.jsonl").is_file() else None
        return Baseline("finetune run" if run else "finetune model card", path)

    def run_folder(self, b: Baseline) -> Optional[Path]:
        return run_folder(b.path)

    def whole_recipe(self, b: Baseline, data, model) -> tuple:
        """The run's resolved recipe whole, its effective batch kept (``card.reproducible``); ``data``, ``model``:
        where the training file and the base model are on this machine. With it, what the import says: each line
        names what was read and how the data stand against the run's (sha256)."""
        p = b.path
        run = run_folder(p)  # the run, or the run whose card this is: its config names its files on this machine
        card = card_of(p)
        if run is not None:
            recipe = card_io.reproducible(read_config(run), read_metrics(run).get("effective_batch_size"))
        else:
            recipe = card_io.read_recipe(card)
        kind = "run" if run == p else "model card of a run here" if run else "model card"
        said = [f"finetune {kind}: {p} (its resolved recipe, whole; effective batch "
                f"{(recipe.get('training') or {}).get('effective_batch_size')} kept, the micro-batch yours)"]
        sections = {k: dict(recipe.get(k) or {}) for k in ("model", "data")}
        if model is not None:
            sections["model"]["name_or_path"] = str(model)
            said.append(f"model.name_or_path  {model}  --model")
        if data is not None:
            sections["data"]["source"] = str(data)
        recipe.update({k: v for k, v in sections.items() if v})
        said.append(data_line(sections["data"].get("source"), card_io.card_data_sha(card) if card else None,
                              "--data" if data is not None else "the run's"))
        return recipe, said


SOURCE = FinetuneRun()


def data_line(source, sha: str | None, whose: str) -> str:
    """How ``source`` (the data the recipe will train on) stands against the sha256 the run's card recorded."""
    if sha is None:
        return f"data.source  {source}  {whose} (the card records no file sha256: not a local file)"
    mine = card_io.file_sha256(source)
    if mine is None:
        return f"missing: data.source {source} is not on this machine; give --data FILE (sha256 {sha[:12]}…)"
    if mine != sha:
        return (f"not carried: data.source {source} differs from the run's data (sha256 {mine[:12]}… vs "
                f"{sha[:12]}…): the reproduction trains on other data")
    return f"data.source  {source}  {whose}; sha256 {sha[:12]}… matches the run's"
