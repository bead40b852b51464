"""``finetune run --processes N``: check the run in this process, then start its N processes on this machine.

``accelerate launch --multi_gpu`` hands a failed run to torchrun, which prints its own report (a ``ChildFailedError``
traceback) after the workers' error line, whatever the input. Here the run is checked before any worker starts
(recipe, overrides, output directory and its lock, checkpoint, the effective batch's split over N), and the workers
are started through the launcher torchrun itself uses (``torch.distributed.launcher.api.elastic_launch``) with its
logging silenced: a refusal the workers find is their one ``error:`` line, from the main process, and the exit code.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid

from finetune.config import RecipeConfig
from finetune.errors import ConfigError
from finetune.startup import check_before_launch


def launched_processes() -> int:
    """The processes of the launch this process belongs to (torchrun / accelerate set ``WORLD_SIZE``), else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_processes(processes) -> None:
    """``--processes``: at least 1, and not a different count inside a launch that already started processes."""
    if processes is not None and processes < 1:
        raise ConfigError(f"--processes: got {processes}; must be >= 1")
    launched = launched_processes()
    if processes is not None and launched > 1 and processes != launched:
        raise ConfigError(f"--processes: got {processes}, but this is one of {launched} processes started by a "
                          "launcher (accelerate launch, torchrun); drop --processes")


def launch(cfg: RecipeConfig, resume, argv: list, processes: int) -> int:
    """Check the run for ``processes`` processes, then start them, each running ``finetune <argv>`` with the output
    directory checked here. Returns the exit code: 0, or the failing workers' (2 for a refusal)."""
    out_dir = check_before_launch(cfg, resume, processes)
    return start_workers([*argv, "--set", f"output.dir={json.dumps(str(out_dir))}"], processes)


def start_workers(argv: list, processes: int) -> int:
    """Start ``processes`` copies of ``python -m finetune <argv>`` on this machine and wait for them. Their output
    is theirs (rank 0 speaks); the launcher adds none. Returns 0, or the lowest failing rank's exit code."""
    # lazy: torch's launcher costs 30 ms, on every command; only --processes N starts workers
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # the agent logs every start, failure and shutdown
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    # as torchrun does: N processes share this machine's cores (one thread each unless told otherwise)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=processes, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "finetune", *argv)
    except ChildFailedError as failed:
        codes = [f.exitcode for _, f in sorted(failed.failures.items())]
        return next((c for c in codes if c > 0), 1)
    except SignalException as stop:  # Ctrl-C / SIGTERM: the agent has stopped the workers
        return 128 + int(stop.sigval)
    return 0
