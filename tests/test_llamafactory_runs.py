"""LLaMA-Factory runs, trained by ``llamafactory-cli train`` 0.9.5 in its own environment on the CPU (fp32, the tiny
chat model, its ``smollm2`` template) and kept in ``tests/assets/llamafactory/`` (``examples/llamafactory/
make_baselines.sh`` makes them again), reproduced through the CLI only: import → run at a smaller micro-batch →
compare, and ``finetune reproduce`` in one command.

* SFT with LoRA (4 × 2): "equivalent"; a one-word-changed answer differs; the template's newline left untrained
  (``data.turn_end: stripped``) differs on the settings layer;
* DPO with LoRA (sigmoid, beta 0.25, 2 × 2): "equivalent"; another beta differs on the settings layer;
* SFT packed (``packing: true``): by default finetune keeps its exact big-batch step, the verdict names the packing
  and the windows are not checkable; with ``import --baseline-step`` it packs as LLaMA-Factory (``data.pack:
  knapsack``, conversations cut turn by turn at ``cutoff_len − 1``): "equivalent"; a one-word change differs, and so
  does dropping the longer conversations instead of cutting them;
* bad input: one line naming the file, exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import (
    ROOT,
    one_torch_thread,  # noqa: F401  (the module's fixture, by name)
)
from tests.helpers import cli_in_process as cli

LF = ROOT / "tests" / "assets" / "llamafactory"
MODEL = LF / "model"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reproduce(capsys, tmp, baseline, recipe_name, *sets, data=None, flags=()) -> tuple[int, str, str]:
    """(compare's exit code, its last line, import's table): import over ``recipe_name`` (with ``flags``), run at
    micro-batch 1 with ``sets``, compare."""
    name = f"{baseline.name}-{abs(hash((sets, str(data), flags)))}"
    recipe = tmp / f"{name}.yaml"
    code, table = cli(capsys, "import", baseline, "--recipe", recipe_name, "--model", MODEL, "-o", recipe, "--force",
                      *(["--data", data] if data else []), *flags)
    assert code == 0, table
    mine = tmp / f"{name}-mine"
    code, out = cli(capsys, "run", "--recipe", recipe, "--batch-size", 1, "--output-dir", mine, "--set",
                    "output.tracker=none", *[x for s in sets for x in ("--set", s)])
    assert code == 0, out
    code, out = cli(capsys, "compare", baseline, mine)
    return code, next(line for line in out.splitlines() if line.startswith("verdict:")), table


def test_sft_lora_is_reproduced_and_its_twins_differ(tmp_path, capsys):
    baseline = LF / "sft-lora"
    code, verdict, table = reproduce(capsys, tmp_path, baseline, "sft-smollm2", "model.generate_prompts=0")
    assert "training_args.yaml: template: smollm2" in table and "data.turn_end" in table, table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    rows = [json.loads(line) for line in open(LF / "data" / "chat.jsonl")]
    answer = next(m for m in rows[5]["messages"] if m["role"] == "assistant")
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    changed = tmp_path / "chat.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, "sft-smollm2", "model.generate_prompts=0",
                                 data=changed)
    assert code == 1 and verdict.startswith("verdict: differs"), verdict
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, "sft-smollm2", "model.generate_prompts=0",
                                 "data.turn_end=stripped")
    assert code == 1 and "data.turn_end trained in the baseline vs stripped" in verdict, verdict


def test_dpo_lora_is_reproduced_and_another_beta_differs(tmp_path, capsys):
    baseline = LF / "dpo-lora"
    code, verdict, table = reproduce(capsys, tmp_path, baseline, "dpo-smollm2")
    assert "model.beta" in table and "pref_beta" in table and "TRL's conversational pairs" in table, table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, "dpo-smollm2", "model.beta=0.1")
    assert code == 1 and "settings: model.beta 0.25 in the baseline vs 0.1" in verdict, verdict


def test_a_packed_run_keeps_the_big_batch_step_and_the_verdict_names_the_packing(tmp_path, capsys):
    code, verdict, table = reproduce(capsys, tmp_path, LF / "sft-packed", "sft-smollm2", "model.generate_prompts=0")
    assert "not carried: packing=True" in table and "--baseline-step takes" in table, table
    assert code == 1 and "the baseline's packing=True is not carried by finetune import" in verdict, verdict
    assert "window samples" in verdict, verdict  # its batches were of packed rows: not checkable against ours


def knapsack_rows(recipe, *sets) -> list:
    from finetune.loading import load_recipe
    from finetune.tasks import sft
    from finetune.tasks.chat import load_tokenizer

    cfg = load_recipe(str(recipe), list(sets))
    rows = sft.tokenized_data(load_tokenizer(cfg.model), cfg.data, cfg.model).train
    return [{k: list(rows[i][k]) for k in ("input_ids", "labels", "position_ids", "attention_mask")}
            for i in range(len(rows))]


def test_data_pack_knapsack_lays_out_the_rows_llamafactory_packed(tmp_path, capsys):
    recipe = tmp_path / "packed.yaml"
    code, table = cli(capsys, "import", LF / "sft-packed", "--recipe", "sft-smollm2", "--model", MODEL,
                      "--baseline-step", "-o", recipe)
    assert code == 0, table
    theirs = [json.loads(line) for line in open(LF / "sft-packed" / "packed_rows.jsonl")]  # its own loader's
    assert knapsack_rows(recipe) == theirs
    assert knapsack_rows(recipe, "data.pack_group=8") != theirs  # other groups: other rows (control)


def test_a_packed_run_is_reproduced_with_its_own_step_and_its_twins_differ(tmp_path, capsys):
    own = ("--baseline-step",)
    out = tmp_path / "reproduced"  # in one command, at the micro-batch that fits here
    code, said = cli(capsys, "reproduce", LF / "sft-packed", "--model", MODEL, "--baseline-step", "-o", out, "--set",
                     "model.generate_prompts=0")
    assert code == 0 and "knapsack" in said and "not carried: packing" not in said, said
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert verdict.startswith("verdict: equivalent") and "the Trainer's samples in all 9 windows" in verdict, verdict
    # the longer conversations dropped instead of cut turn by turn as LLaMA-Factory cuts them: other rows
    code, verdict, _ = reproduce(capsys, tmp_path, LF / "sft-packed", "sft-smollm2", "model.generate_prompts=0",
                                 "data.too_long=drop", flags=own)
    assert code == 1 and "data.too_long turns in the baseline vs drop" in verdict, verdict
    rows = [json.loads(line) for line in open(LF / "data" / "chat.jsonl")]
    answer = next(m for m in rows[3]["messages"] if m["role"] == "assistant")
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    changed = tmp_path / "chat.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, verdict, _ = reproduce(capsys, tmp_path, LF / "sft-packed", "sft-smollm2", "model.generate_prompts=0",
                                 data=changed, flags=own)
    assert code == 1 and verdict.startswith("verdict: differs"), verdict


def test_reproduce_in_one_command(tmp_path, capsys):
    out = tmp_path / "reproduced"
    code, said = cli(capsys, "reproduce", LF / "sft-lora", "--model", MODEL, "-o", out, "--set",
                     "model.generate_prompts=0")
    assert code == 0, said
    report = (out / "report.md").read_text()
    assert "**verdict: equivalent" in report and (out / "curves.png").is_file(), report
    assert "finetune run --recipe" in report and "--batch-size auto" in report, report


def test_reproduce_a_trl_folder_in_one_command(tmp_path, capsys):
    from tests.helpers import tiny_chat_assets
    from tests.test_trl_runs import messages_rows, train_sft

    data = messages_rows(tmp_path / "messages.jsonl")
    baseline = tmp_path / "trl-sft"
    train_sft(baseline, data)
    code, said = cli(capsys, "reproduce", baseline, "--data", data, "--model", tiny_chat_assets()["model"], "-o",
                     tmp_path / "out", "--set", "model.generate_prompts=0")
    assert code == 0 and "verdict: equivalent" in said, said[-3000:]


def test_a_bad_yaml_is_one_line(tmp_path, capsys):
    folder = tmp_path / "lf"
    shutil.copytree(LF / "sft-lora", folder)
    (folder / "training_args.yaml").write_text("stage: sft\ntemplate: [unclosed\n")
    code, said = cli(capsys, "import", folder, "-o", tmp_path / "r.yaml")
    assert code == 2 and said.strip().splitlines()[-1].startswith("error: import: ") and "not valid YAML" in said, \
        said


@pytest.mark.parametrize("stage", ["ppo", "rm", "kto", "sft"])
def test_a_stage_no_task_trains_is_named_in_one_line(tmp_path, capsys, stage):
    """A stage finetune does not train is refused naming it and the stages it does, nothing written; sft (the
    control) imports."""
    folder = tmp_path / "lf"
    shutil.copytree(LF / "sft-lora", folder)
    saved = folder / "training_args.yaml"
    saved.write_text(saved.read_text().replace("stage: sft", f"stage: {stage}"))
    recipe = tmp_path / "r.yaml"
    code, said = cli(capsys, "import", folder, "--recipe", "sft-smollm2", "--model", MODEL, "-o", recipe)
    if stage == "sft":
        assert code == 0 and recipe.is_file(), said
        return
    assert code == 2 and said.strip().splitlines() == [f"error: import: stage: {stage} in {saved} is not supported "
                                                       "(supported: pt, dpo, sft)"], said
    assert not recipe.exists()


def test_import_refuses_data_without_the_columns_the_task_needs(tmp_path, capsys):
    """``--data`` is read as ``finetune run`` reads it: a CSV of questions and answers for an sft recipe is refused
    in one line naming its columns, nothing written; the baseline's own file (the control) imports."""
    qa = tmp_path / "qa.csv"
    qa.write_text("question,answer\nWhat is 1 plus 1?,2\n")
    recipe = tmp_path / "r.yaml"
    args = ("import", LF / "sft-lora", "--recipe", "sft-smollm2", "--model", MODEL, "-o", recipe)
    code, said = cli(capsys, *args, "--data", qa)
    assert code == 2 and said.strip().splitlines() == [f"error: data.source: {qa} has columns question, answer; the "
                                                       "sft task needs messages, or prompt and completion"], said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qa.csv"]
    code, said = cli(capsys, *args, "--data", LF / "data" / "chat.jsonl")
    assert code == 0 and recipe.is_file(), said


def test_pure_bf16_is_named_and_taken_with_the_baseline_step(tmp_path, capsys, monkeypatch):
    """``pure_bf16: true`` (every weight trained in bf16, no fp32 master weights): by default bf16 autocast and the
    setting named as not carried; with --baseline-step the recipe trains as it did."""
    import yaml

    monkeypatch.chdir(ROOT)  # the YAML names its model and data from the repository's root
    raw = {**yaml.safe_load((ROOT / "examples" / "llamafactory" / "sft-lora.yaml").read_text()), "pure_bf16": True}
    source = tmp_path / "pure.yaml"
    source.write_text(yaml.safe_dump(raw))
    for flags, recipe in (((), tmp_path / "default.yaml"), (("--baseline-step",), tmp_path / "own.yaml")):
        code, table = cli(capsys, "import", source, "-o", recipe, *flags)
        assert code == 0, table
        written = yaml.safe_load(recipe.read_text())
        if flags:
            assert written["model"]["master_weights"] is False and written["model"]["dtype"] == "bf16", written
            assert written["training"]["mixed_precision"] == "no" and "not carried: pure_bf16" not in table, table
        else:
            assert "master_weights" not in written["model"] and written["training"]["mixed_precision"] == "bf16"
            assert "not carried: pure_bf16=True — LLaMA-Factory loads and trains every weight in bf16" in table, table


@pytest.mark.parametrize("attention", ["apart", "across"])
def test_a_neat_packed_run_is_reproduced_with_its_own_step(tmp_path, capsys, attention):
    """``neat_packing: true``: the same knapsacks, each conversation attending only to itself
    (``data.pack: knapsack_neat``): "equivalent"; the rows trained with the conversations attending to each other
    (``knapsack``) differ."""
    sets = ["model.generate_prompts=0"] + (["data.pack=knapsack"] if attention == "across" else [])
    code, verdict, table = reproduce(capsys, tmp_path, LF / "sft-neat", "sft-smollm2", *sets,
                                     flags=("--baseline-step",))
    assert "knapsack_neat" in table and "neat_packing" in table and "not carried: neat" not in table, table
    if attention == "apart":
        assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    else:
        assert code == 1 and "data.pack knapsack_neat in the baseline vs knapsack" in verdict, verdict


@pytest.mark.parametrize("run,task", [("sft-lora", "sft"), ("dpo-lora", "dpo")])
def test_an_output_folder_without_its_yaml_gets_its_stage_from_the_log(tmp_path, capsys, run, task):
    """Trained from the command line, the folder holds no training_args.yaml: the stage is dpo where its log holds
    preference rewards, else LLaMA-Factory's default sft; a preference stage's beta, in the YAML only, is said
    unknown (not LLaMA-Factory's default, which it may not have been)."""
    import yaml

    folder = tmp_path / run
    shutil.copytree(LF / run, folder)
    (folder / "training_args.yaml").unlink()
    code, table = cli(capsys, "import", folder, "--model", MODEL, "-o", tmp_path / "r.yaml")
    assert code == 0 and yaml.safe_load((tmp_path / "r.yaml").read_text())["task"] == task, table
    assert ("not carried: pref_beta=unknown" in table) == (task == "dpo"), table
    assert "give the YAML you trained with" in table, table


def test_packing_is_read_for_the_sft_stage_only(tmp_path, capsys, monkeypatch):
    """LLaMA-Factory packs for its sft stage; its dpo stage ignores packing: nothing to carry or name there."""
    import yaml

    monkeypatch.chdir(ROOT)
    raw = {**yaml.safe_load((ROOT / "examples" / "llamafactory" / "dpo-lora.yaml").read_text()), "packing": True}
    source = tmp_path / "dpo.yaml"
    source.write_text(yaml.safe_dump(raw))
    code, table = cli(capsys, "import", source, "-o", tmp_path / "r.yaml", "--baseline-step")
    assert code == 0 and "not carried: packing" not in table and "data.pack " not in table, table
    assert "pack" not in (yaml.safe_load((tmp_path / "r.yaml").read_text()).get("data") or {}), table


@pytest.mark.parametrize("keys,quantization", [({"quantization_bit": 4}, "nf4"),
                                               ({"quantization_bit": 4, "quantization_type": "fp4"}, "fp4"),
                                               ({"quantization_bit": 8}, "int8"), ({}, None)])
def test_its_quantization_bit_is_the_quantized_base(tmp_path, capsys, monkeypatch, keys, quantization):
    """QLoRA in LLaMA-Factory: quantization_bit with bitsandbytes (its default method), nf4 unless
    quantization_type says; none set: no quantization (control)."""
    import yaml

    pytest.importorskip("bitsandbytes")
    monkeypatch.chdir(ROOT)
    raw = {**yaml.safe_load((ROOT / "examples" / "llamafactory" / "sft-lora.yaml").read_text()), **keys}
    source = tmp_path / "q.yaml"
    source.write_text(yaml.safe_dump(raw))
    code, table = cli(capsys, "import", source, "-o", tmp_path / "r.yaml")
    assert code == 0 and "not read: quantization" not in table, table
    assert yaml.safe_load((tmp_path / "r.yaml").read_text())["model"].get("quantization") == quantization, table


@pytest.mark.parametrize("rows", ["its-train-part", "the-whole-file"])
def test_a_run_that_held_rows_out_is_reproduced_on_the_rows_it_kept(tmp_path, capsys, rows):
    """``val_size: 0.2``: LLaMA-Factory splits the rows before training (datasets' train_test_split with its seed)
    and trains the train part in that order; import writes those rows beside the recipe: "equivalent". Trained on
    the whole file instead, the run differs (the control)."""
    sets = ["model.generate_prompts=0"] + ([f"data.source={LF / 'data' / 'chat.jsonl'}"]
                                           if rows == "the-whole-file" else [])
    code, verdict, table = reproduce(capsys, tmp_path, LF / "sft-val", "sft-smollm2", *sets)
    assert "train_test_split(test_size=0.2, seed=42)" in table, table
    if rows == "its-train-part":
        assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    else:
        assert code == 1 and verdict.startswith("verdict: differs"), verdict


@pytest.mark.parametrize("keys", [{"max_samples": 10}, {"max_samples": 30, "val_size": 0.2, "seed": 7},
                                  {"disable_shuffling": True}])
def test_the_rows_kept_and_their_order_are_carried(tmp_path, capsys, monkeypatch, keys):
    """max_samples keeps the first rows, then val_size splits them (datasets' train_test_split with the seed): the
    rows written beside the recipe are those; disable_shuffling is the sequential order (training.shuffle false)."""
    import datasets
    import yaml

    monkeypatch.chdir(ROOT)
    raw = {**yaml.safe_load((ROOT / "examples" / "llamafactory" / "sft-lora.yaml").read_text()), **keys}
    source, recipe = tmp_path / "k.yaml", tmp_path / "r.yaml"
    source.write_text(yaml.safe_dump(raw))
    code, table = cli(capsys, "import", source, "-o", recipe)
    assert code == 0 and "not carried: max_samples" not in table and "not carried: disable" not in table, table
    written = yaml.safe_load(recipe.read_text())
    lines = (LF / "data" / "chat.jsonl").read_text().splitlines()
    if "disable_shuffling" in keys:
        assert written["training"]["shuffle"] is False, written
        return
    first = lines[:keys["max_samples"]]
    if "val_size" in keys:
        split = datasets.Dataset.from_dict({"row": range(len(first))}).train_test_split(test_size=0.2, seed=7)
        first = [first[i] for i in split["train"]["row"]]
    assert Path(written["data"]["source"]).read_text().splitlines() == first


@pytest.mark.parametrize("divisor", ["the-card-s-trainer", "items"])
def test_a_run_training_every_token_is_divided_as_its_trainer_divided(tmp_path, capsys, divisor):
    """``train_on_prompt: true`` (``data.train_on: all``: every sample's first label trains). Its card says
    Transformers 5.6.0, whose Trainer divides each window's summed loss by the labels counted before the causal
    shift — one more per row than the tokens the loss sums over — so import sets ``training.loss_divisor: labels``:
    "equivalent". Divided by the items instead (5.10's count, finetune's default), every loss and gradient is
    scaled by items ÷ labels: the run differs (the control)."""
    sets = ["model.generate_prompts=0"] + (["training.loss_divisor=items"] if divisor == "items" else [])
    code, verdict, table = reproduce(capsys, tmp_path, LF / "sft-prompt", "sft-smollm2", *sets)
    assert "Transformers 5.6.0, whose Trainer divides" in table and "data.train_on" in table, table
    assert "every token trained" in table and "not read: train_on_prompt" not in table, table
    if divisor == "items":
        assert code == 1 and "training.loss_divisor labels in the baseline vs items" in verdict, verdict
    else:
        assert code == 0 and verdict.startswith("verdict: equivalent"), verdict


def test_a_first_step_that_differs_with_settings_unread_is_not_certified(tmp_path, capsys):
    """Without its YAML the folder's template is unknown (smollm2 adds a default system message the tokenizer's
    template lacks): step 1's loss differs before any update, and the verdict is "not certified", naming what import
    could not read. Control: with the YAML there, the same difference of the tokens (the system message dropped)
    reads "differs"."""
    folder = tmp_path / "sft-lora"
    shutil.copytree(LF / "sft-lora", folder)
    (folder / "training_args.yaml").unlink()
    code, said = cli(capsys, "reproduce", folder, "--model", MODEL, "--data", LF / "data" / "chat.jsonl",
                     "--batch-size", 1, "-o", tmp_path / "r", "--set", "model.generate_prompts=0")
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 3 and verdict.startswith("verdict: not certified — loss curve"), verdict
    assert "step 1's loss differs before any update" in verdict and "training_args.yaml" in verdict, verdict
    assert "adapters" not in verdict  # their start cannot move step 1
    code, verdict, _ = reproduce(capsys, tmp_path, LF / "sft-lora", "sft-smollm2", "model.generate_prompts=0",
                                 "data.system_prompt=null")
    assert code == 1 and verdict.startswith("verdict: differs"), verdict
