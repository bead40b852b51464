"""The objective of files others published, read as ``finetune import`` reads it, held against this test's own
reading of each file (tests/assets/corpus/, PROVENANCE.md says where each comes from): torchtune's recipe configs,
axolotl's examples, alignment-handbook's and open-r1's TRL recipes, TRL's CLI config and run folders of TRL's and
transformers' own config classes. An objective finetune trains becomes the recipe's task, with its source in the
table, and the file's learning rate and LoRA rank where it says them; any other is refused in one line naming it, and
a file that trains nothing is refused as such — nothing written either way. Negative controls take the one key that
says the objective out of a copy of a file and see the objective change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import cli_in_process as cli
from tests.helpers import edited_yaml

CORPUS = Path(__file__).parent / "assets" / "corpus"
TOOLS = ("torchtune", "axolotl", "alignment-handbook", "open-r1", "trl")


def _units() -> list:
    """Every config file and run folder of the corpus (a folder's own files are its parts, not units)."""
    found = []
    for tool in TOOLS:
        for p in sorted((CORPUS / tool).iterdir()):
            if p.is_dir() or p.suffix in (".yaml", ".yml"):
                found.append(p)
    return found


# ---------------------------------------------------------------------------------------------------------------
# the test's own reading of each file: (what import must do, the word it names) and the numbers it says


def expected(path: Path) -> tuple:
    """("task", name) for an objective finetune trains, ("refused", a word the refusal names), or ("nothing",)."""
    if path.is_dir():
        return _folder(path)
    raw = yaml.safe_load(path.read_text())
    tool = path.parent.name
    if tool == "torchtune":
        return _torchtune(raw)
    if tool == "axolotl":
        return _axolotl(raw)
    if "num_generations" in raw:
        return "task", "grpo"
    if "beta" in raw:  # a preference trainer; the handbook's ORPO recipe says so only in its names
        return ("refused", "ORPO") if "orpo" in str(raw.get("output_dir")) else ("task", "dpo")
    return "task", "sft"


def _folder(path: Path) -> tuple:
    args = json.loads((path / "training_args.json").read_text()) if (path / "training_args.json").exists() else {}
    logged = {k for e in json.loads((path / "trainer_state.json").read_text())["log_history"] for k in e}
    if json.loads((path / "config.json").read_text()).get("is_encoder_decoder"):
        return "refused", "encoder-decoder"
    if "desirable_weight" in args:
        return "refused", "KTO"
    if "center_rewards_coefficient" in args:
        return "refused", "reward model"
    if "num_generations" in args or "reward_std" in logged:
        return "task", "grpo"
    if "beta" in args or "rewards/chosen" in logged:
        return "task", "dpo"
    if "packing" in args or "mean_token_accuracy" in logged:
        return "task", "sft"
    return "task", "clm"


def _torchtune(raw: dict) -> tuple:
    if "optimizer" not in raw:
        return ("nothing",)
    if "teacher_model" in raw:
        return "refused", "distillation"
    if "reward_and_value_model" in raw:
        return "refused", "PPO"
    loss = str((raw.get("loss") or {}).get("_component_"))
    if "DPOLoss" in loss:
        return "task", "dpo"
    if "GRPO" in loss:
        return "task", "grpo"
    return ("task", "clm") if "text_completion" in str(raw.get("dataset")) else ("task", "sft")


def _axolotl(raw: dict) -> tuple:
    rl = raw.get("rl")
    if rl in ("dpo", "ipo"):
        return "task", "dpo"
    if rl:
        return "refused", str(rl).upper()
    if raw.get("process_reward_model"):
        return "refused", "process reward model"
    if raw.get("reward_model"):
        return "refused", "reward model"
    if raw.get("pretraining_dataset"):
        return "task", "clm"
    types = {str(d.get("type")) for d in raw.get("datasets") or []}
    return ("task", "clm") if all(t.startswith(("completion", "pretrain")) for t in types) else ("task", "sft")


def said_numbers(path: Path) -> dict:
    """The learning rate and LoRA rank the file says (absent: it does not say them)."""
    if path.is_dir():
        args = path / "training_args.json"
        return {"lr": json.loads(args.read_text())["learning_rate"]} if args.exists() else {}
    raw, said = yaml.safe_load(path.read_text()), {}
    tool = path.parent.name
    if tool == "torchtune":
        said["lr"] = (raw.get("optimizer") or {}).get("lr")
        said["r"] = (raw.get("model") or {}).get("lora_rank")
    elif tool == "axolotl":
        said["lr"] = raw.get("learning_rate")
        said["r"] = raw.get("lora_r") if raw.get("adapter") in ("lora", "qlora") else None
    else:
        said["lr"] = raw.get("learning_rate")
        said["r"] = raw.get("lora_r", 16) if raw.get("use_peft") else None  # TRL ModelConfig's default 16
    return {k: float(v) for k, v in said.items() if v is not None}


# ---------------------------------------------------------------------------------------------------------------


def _import(capsys, source: Path, out: Path) -> tuple:
    return cli(capsys, "import", source, "-o", out, "--force")


@pytest.mark.parametrize("path", _units(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_objective_of_each_file_is_read(path, tmp_path, capsys):
    want = expected(path)
    out = tmp_path / "r.yaml"
    code, said = _import(capsys, path, out)
    if want[0] != "task":
        lines = [x for x in said.splitlines() if x.startswith("error: ")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in said, said[-1500:]
        assert ("trains nothing" in lines[0]) if want[0] == "nothing" else (
            want[1] in lines[0] and "finetune trains" in lines[0]), lines[0]
        assert not out.exists()  # nothing written
        return
    assert code == 0, said[-1500:]
    recipe = yaml.safe_load(out.read_text())
    assert recipe["task"] == want[1], said[:600]
    row = next(x for x in said.splitlines() if x.startswith("task "))
    assert row.split()[1] == want[1] and len(row.split()) > 2, row  # the task row names where it is said
    if path.is_file():
        assert path.name in row, row
    numbers = said_numbers(path)
    if "lr" in numbers:
        assert recipe["training"]["learning_rate"] == pytest.approx(numbers["lr"])
    if "r" in numbers:
        assert recipe["peft"]["enabled"] and recipe["peft"]["r"] == numbers["r"]


def test_the_corpus_spans_each_kind(capsys):
    """The corpus holds each verdict: every task finetune trains, refusals, and files that train nothing."""
    verdicts = {expected(p) for p in _units()}
    assert {("task", t) for t in ("sft", "clm", "dpo", "grpo")} <= verdicts
    assert ("nothing",) in verdicts and len({v for v in verdicts if v[0] == "refused"}) >= 6


# ---------------------------------------------------------------------------------------------------------------
# negative controls: the one key that says the objective, taken out of a copy, changes it


def _task_of(capsys, source: Path, tmp_path: Path) -> str:
    code, said = _import(capsys, source, tmp_path / "control.yaml")
    assert code == 0, said[-1500:]
    return yaml.safe_load((tmp_path / "control.yaml").read_text())["task"]


def test_axolotl_rl_is_what_says_dpo(tmp_path, capsys):
    source = CORPUS / "axolotl" / "qwen2__dpo.yaml"
    assert _task_of(capsys, source, tmp_path) == "dpo"
    assert _task_of(capsys, edited_yaml(source, tmp_path, lambda raw: raw.pop("rl")), tmp_path) == "sft"


def test_preference_keys_are_what_say_dpo_in_a_trl_recipe(tmp_path, capsys):
    """beta and max_prompt_length, which every TRL preference trainer takes and SFTConfig does not."""
    source = CORPUS / "alignment-handbook" / "zephyr-7b-beta__dpo__config_full.yaml"
    edited = edited_yaml(source, tmp_path, lambda raw: [raw.pop("beta"), raw.pop("max_prompt_length")])
    assert _task_of(capsys, edited, tmp_path) == "sft"


def test_an_optimizer_makes_a_generation_config_train(tmp_path, capsys):
    """generation.yaml is refused for lacking an optimizer, not for its name."""
    source = CORPUS / "torchtune" / "generation.yaml"
    edited = edited_yaml(source, tmp_path, lambda raw: raw.update(
        optimizer={"_component_": "torch.optim.AdamW", "lr": 2e-5},
        dataset={"_component_": "torchtune.datasets.alpaca_dataset"}))
    assert _task_of(capsys, edited, tmp_path) == "sft"


def test_is_encoder_decoder_is_what_refuses_a_t5_run(tmp_path, capsys):
    folder = tmp_path / "run"
    shutil.copytree(CORPUS / "trl" / "t5-trainer-run", folder)
    config = json.loads((folder / "config.json").read_text())
    config["is_encoder_decoder"] = False
    config["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    assert _task_of(capsys, folder, tmp_path) == "clm"


def test_a_task_said_nowhere_is_said_so(tmp_path, capsys):
    """A folder whose files say no objective (no trainer's key, no log column, no model config) is written as clm
    with a line saying that nothing said it."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(CORPUS / "trl" / "trainer-clm-run" / "trainer_state.json", folder)
    code, said = _import(capsys, folder, tmp_path / "r.yaml")
    assert code == 0 and "not carried: the objective=unknown" in said, said[-1500:]


def test_reproduce_refuses_before_it_makes_its_folder(tmp_path, capsys):
    code, said = cli(capsys, "reproduce", CORPUS / "axolotl" / "llama-3__qlora-1b-kto.yaml", "-o", tmp_path / "rp")
    assert code == 2 and "trains KTO" in said and not (tmp_path / "rp").exists(), said[-1500:]
