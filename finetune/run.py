"""Train a recipe: ``accelerate launch -q finetune/run.py --recipe minilm-sentiment [--batch-size 8 ...]`` (``-q``:
a bad input is the script's one ``error:`` line, without the launcher's traceback).

The same as ``finetune run``: see ``finetune/cli.py`` for the flags and ``finetune/startup.py`` for what a run does.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the package, not this folder's modules as top-level names
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

    from finetune.cli import run_main

    sys.exit(run_main())
