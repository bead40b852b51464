import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_UPDATE_DOWNLOAD_COUNTS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

# The run's own folder for test assets and finetune's caches, made before any test or worker process starts (they
# inherit the variables) and removed at the end: nothing a run leaves in a shared folder can change the next run.
RUN_FOLDER = tempfile.mkdtemp(prefix="finetune-tests-")
os.environ["FINETUNE_TEST_ASSETS"] = RUN_FOLDER
os.environ["FINETUNE_CACHE"] = os.path.join(RUN_FOLDER, "cache")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import helpers  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _assets():
    """Build the shared test assets once, in this process, before any test starts a worker."""
    helpers.tiny_chat_assets()


def pytest_unconfigure(config):
    """Remove the run's folder however the run ended (also when no test ran)."""
    shutil.rmtree(RUN_FOLDER, ignore_errors=True)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.use_deterministic_algorithms(False)
    yield


@pytest.fixture(scope="module")
def frozen_heap():
    """For modules whose code collects garbage often in this process: ``memory.PeakMeter`` runs a full
    ``gc.collect()`` before each measurement (50+ per plan), as do Accelerate's and the Trainer's clean-ups, and with
    transformers, peft and the suite's modules loaded a full pass walks ~10⁶ objects (0.2–0.4 s each). Freezing what
    exists when the module starts (collected first: no garbage is frozen) leaves the pass only the module's own
    objects; what a measurement must free is made after the freeze and still goes."""
    import gc

    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
