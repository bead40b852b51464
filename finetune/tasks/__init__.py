"""One small module per recipe family. Each declares ``ModelConfig`` and ``DataConfig`` (the recipe's ``model`` and
``data`` sections) and ``build(cfg) -> Job``; optionally ``validate(cfg, problems)``."""

from pathlib import Path


def available() -> list[str]:
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_"))
