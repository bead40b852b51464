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


# Runs of other tools that several test modules read (the sources' conformance test and each tool's own tests):
# trained once per session.


@pytest.fixture(scope="session")
def trl_hub_run(tmp_path_factory):
    """(root, folder, rows) of a TRL SFT run saved as push_to_hub leaves it (tests/test_hub_folders.py)."""
    from tests.test_hub_folders import trl_run

    return trl_run(tmp_path_factory.mktemp("hub"), [])


@pytest.fixture(scope="session")
def trl_events_run(tmp_path_factory):
    """The same run logged to TensorBoard, as axolotl's runs are (the Trainer's TensorBoardCallback)."""
    from tests.test_hub_folders import trl_run

    return trl_run(tmp_path_factory.mktemp("events"), ["tensorboard"])


@pytest.fixture(scope="session")
def trainer_example_run(tmp_path_factory):
    """The example's Trainer baseline (examples/trainer-baseline/train_with_trainer.py) in ROOT/baseline and its base
    recipe, ROOT/recipe.yaml, pointing at the tiny model the script wrote."""
    from tests.test_trainer_baselines import train_example

    return train_example(tmp_path_factory.mktemp("trainer"))
