"""Reproducing a baseline: reading another tool's run (``baselines``), turning it into a recipe (``importer``,
``finetune import``) and checking that two runs took the same steps (``compare``, ``finetune compare``)."""
