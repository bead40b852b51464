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
