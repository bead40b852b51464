"""An ms-swift run (``swift sft`` 4.6.0, LoRA, fp32, on the tiny chat model; examples/msswift/make_baselines.sh),
reproduced through ``finetune reproduce`` at micro-batch 1: equivalent, and its one-word twin differs; swift's own
settings are carried or named. Its twin at swift's defaults for precision (``fp16: true``, trained in fp32 on the
CPU) is imported as what it trained: fp32, said why."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import (
    ROOT,
    one_torch_thread,  # noqa: F401  (the module's fixture, by name)
)
from tests.helpers import cli_in_process as cli

RUN = ROOT / "tests" / "assets" / "msswift" / "sft-lora"
DEFAULTS = ROOT / "tests" / "assets" / "msswift" / "sft-lora-defaults"  # the same run at swift's default precision
SHUFFLED = ROOT / "tests" / "assets" / "msswift" / "sft-lora-shuffled"  # …and at its default data order
LF = ROOT / "tests" / "assets" / "llamafactory"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reproduce(capsys, out, data, *sets, run=RUN) -> tuple[int, str]:
    code, said = cli(capsys, "reproduce", run, "--model", LF / "model", "--data", data, "--batch-size", 1, "-o", out,
                     "--set", "model.generate_prompts=0", *[x for s in sets for x in ("--set", s)])
    return code, said


def test_an_msswift_run_is_reproduced_and_its_one_word_twin_differs(tmp_path, capsys):
    code, said = reproduce(capsys, tmp_path / "same", LF / "data" / "chat.jsonl")
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 0 and verdict.startswith("verdict: equivalent"), said[-3000:]
    assert "lr schedule      identical at all 5 logged steps" in said  # its lr read back one step
    for line in ("args.json: template: chatml renders ChatML", "args.json: loss_scale", "adapters' start: replayed"):
        assert line in said, line
    rows = [json.loads(line) for line in open(LF / "data" / "chat.jsonl")]
    answer = next(m for m in rows[3]["messages"] if m["role"] == "assistant")
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    changed = tmp_path / "chat.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, said = reproduce(capsys, tmp_path / "word", changed)
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 1 and verdict.startswith("verdict: differs"), verdict


def imported_with(tmp_path, capsys, **changes) -> str:
    """``finetune import`` of sft-lora's files with ``changes`` to its args.json."""
    args = json.loads((RUN / "args.json").read_text())
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    (folder / "args.json").write_text(json.dumps({**args, **changes}))
    (folder / "logging.jsonl").write_text((RUN / "logging.jsonl").read_text())
    code, said = cli(capsys, "import", folder, "--model", LF / "model", "-o", tmp_path / "r.yaml", "--force")
    assert code == 0, said
    return said


def test_what_it_does_that_finetune_does_not_is_named(tmp_path, capsys):
    said = imported_with(tmp_path, capsys, dataset_shuffle=True, truncation_strategy="split")
    assert "not carried: dataset_shuffle" not in said, said  # carried: the rows written in swift's order
    assert re.search(r"data\.source +\S+r-rows\.jsonl +the rows of \S+chat\.jsonl \(args\.json: dataset\) as it "
                     r"trained on them: args\.json: dataset_shuffle true, data_seed 42 \(ms-swift 4\.6\.0: the seed is "
                     r"draw 2 of np\.random\.RandomState\(42\)", said), said
    assert "not carried: truncation_strategy=split" in said, said
    # a split of the rows before the shuffle: named, the rows' order with it
    said = imported_with(tmp_path, capsys, dataset_shuffle=True, split_dataset_ratio=0.1)
    assert "not carried: dataset_shuffle=True — ms-swift shuffles the rows once before training, and holds rows " \
           "out first (split_dataset_ratio)" in said, said
    assert "not carried: split_dataset_ratio=0.1" in said, said


def test_a_run_at_swifts_default_precision_trained_fp32_on_the_cpu_and_is_reproduced_so(tmp_path, capsys):
    """swift's defaults record fp16: true; on the CPU accelerate trained that in fp32 (the run's adapters are the fp32
    run's bit for bit): the recipe trains fp32 (``mixed_precision: no``), its row says why, and it is equivalent."""
    args = json.loads((DEFAULTS / "args.json").read_text())
    assert args["fp16"] is True and args["use_cpu"] is False  # what swift records: its use_cpu says nothing
    assert (DEFAULTS / "checkpoint-5" / "adapter_model.safetensors").read_bytes() == \
        (RUN / "checkpoint-5" / "adapter_model.safetensors").read_bytes()
    code, said = reproduce(capsys, tmp_path / "same", LF / "data" / "chat.jsonl", run=DEFAULTS)
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 0 and verdict.startswith("verdict: equivalent"), said[-3000:]
    assert re.search(r"training\.mixed_precision +no +training_args\.bin: fp16 true, on a CPU \(training_args\.bin: "
                     r"distributed_state\.device cpu\): accelerate trains fp16 as fp32 there", said), said[:4000]
    assert "mixed precision (" not in said  # held to the fp32 band, not the assumed band of an fp16 baseline
    # negative control: what the arguments asked, fp16 autocast (finetune runs it on a CPU), is another run
    code, said = reproduce(capsys, tmp_path / "fp16", LF / "data" / "chat.jsonl", "training.mixed_precision=fp16",
                           run=DEFAULTS)
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 1 and verdict.startswith("verdict: differs — settings: training.mixed_precision no in the "
                                            "baseline vs fp16"), verdict


def test_a_run_at_swifts_default_data_order_is_reproduced_and_the_rows_in_another_order_differ(tmp_path, capsys):
    """swift shuffled the 40 rows once before training (dataset_shuffle: true, data_seed 42): import writes them in
    that order, and the run is equivalent (before the replay it read differs at step 1: 4.1e-3 in the loss, 1.3e-1
    in the grad norm). Negative control: the same rows in another order in the file → differs."""
    assert json.loads((SHUFFLED / "args.json").read_text())["dataset_shuffle"] is True
    code, said = reproduce(capsys, tmp_path / "same", LF / "data" / "chat.jsonl", run=SHUFFLED)
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 0 and verdict.startswith("verdict: equivalent"), said[-3000:]
    assert "Dataset.shuffle(seed=1273642419)" in said and "not carried: dataset_shuffle" not in said, said[:6000]
    lines = (LF / "data" / "chat.jsonl").read_text().splitlines()
    reordered = tmp_path / "chat.jsonl"
    reordered.write_text("".join(line + "\n" for line in lines[::-1]))
    code, said = reproduce(capsys, tmp_path / "reordered", reordered, run=SHUFFLED)
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 1 and verdict.startswith("verdict: differs — loss curve"), verdict
    assert "first above at step 1" in verdict, verdict


def test_its_fp16_is_kept_where_the_files_do_not_say_the_device(tmp_path, capsys):
    """Negative control: the same run with its Trainer arguments as JSON (``to_json_string`` holds no accelerate state,
    and swift's use_cpu false names no device) keeps the arguments' fp16."""
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("args.json", "logging.jsonl"):
        (folder / name).write_text((DEFAULTS / name).read_text())
    trainer_args = json.loads((DEFAULTS / "args.json").read_text())
    (folder / "training_args.json").write_text(json.dumps({k: trainer_args[k] for k in ("fp16", "bf16", "use_cpu")}))
    (folder / "trainer_state.json").write_text((DEFAULTS / "checkpoint-5" / "trainer_state.json").read_text())
    code, said = cli(capsys, "import", folder, "--model", LF / "model", "-o", tmp_path / "r.yaml")
    assert code == 0, said
    assert re.search(r"training\.mixed_precision +fp16 +training_args\.json\n", said), said


DROPOUT = ROOT / "tests" / "assets" / "msswift" / "sft-lora-dropout"  # swift at its defaults: lora_dropout 0.05 too


def verdict_of(said: str) -> str:
    return next(line for line in said.splitlines() if line.startswith("verdict:"))


def test_an_msswift_run_at_its_defaults_is_equivalent_within_dropout_noise_and_another_order_differs(tmp_path,
                                                                                                     capsys):
    """swift's defaults throughout — lora_dropout 0.05, the rows shuffled, fp16 recorded on a CPU: reproduced, the
    twin draws other masks (``training.dropout_seed``) over the same samples, and the baseline stands within that
    noise: "equivalent within dropout noise", its power said. The rows in another order (the file reversed) differ
    at step 1: the noise is the masks', not a licence for other batches. Without the twin, the band assumed for
    dropout certifies nothing and says how to measure the noise."""
    code, said = reproduce(capsys, tmp_path / "same", LF / "data" / "chat.jsonl", run=DROPOUT)
    verdict = verdict_of(said)
    assert code == 0 and verdict.startswith("verdict: equivalent within dropout noise — "), said[-3000:]
    assert "another dropout seed" in verdict and "nothing above — loss" in verdict, verdict
    assert "training.dropout_seed=43" in (tmp_path / "same" / "report.md").read_text()  # the twin's command
    code, said = cli(capsys, "compare", DROPOUT, tmp_path / "same" / "run")  # no --floor
    assert "training.dropout_seed=N" in said and "within dropout noise" not in verdict_of(said), said[-3000:]
    rows = (LF / "data" / "chat.jsonl").read_text().splitlines()
    reversed_rows = tmp_path / "reversed.jsonl"
    reversed_rows.write_text("\n".join(reversed(rows)) + "\n")
    code, said = reproduce(capsys, tmp_path / "reversed", reversed_rows, run=DROPOUT)
    verdict = verdict_of(said)
    assert code == 1 and verdict.startswith("verdict: differs — ") and "at step 1" in verdict, said[-3000:]

