"""The token-count layer: the tokens seen by each logged step — TRL's ``num_tokens``, the Trainer's
``num_input_tokens_seen``, finetune's own ``tokens_seen`` — compared exactly, as integers.

The Trainer's ``all`` mode counts padding: compared with the padded tokens of a run that replays the baseline's
micro-batches' padding, said as not checkable otherwise.

A 2-process TRL SFTTrainer run (``tests/assets/trl-2proc/sft``, made by examples/trl-multiprocess/train_sft.py; it
logs ``num_tokens`` at every step) reproduced on one process at micro-batch 2 counts the same tokens at every step;
the same recipe on its data with a word added to one answer differs at the step holding that row, even with the
loss, grad norm and weights bands opened wide; a word replaced by one of the same token count leaves the counts
equal (the loss layers see it, not this one). Two layouts of one finetune run count alike."""

from __future__ import annotations

import json

import pytest

from finetune.cli import main
from finetune.reproduce.baseline_check import compare_with_baseline
from finetune.reproduce.compare import compare_runs
from finetune.reproduce.record import Baseline, logged_tokens
from finetune.reproduce.verdict import Comparison, token_count
from tests.helpers import ROOT

TRL = ROOT / "tests" / "assets" / "trl-2proc" / "sft"
LF = ROOT / "tests" / "assets" / "llamafactory"
ROWS = LF / "data" / "chat.jsonl"
ROW = 7  # the row whose answer is changed


def checks(c: Comparison) -> dict:
    return {name: (ok, detail) for name, ok, detail, _ in c.checks}


def test_the_layer_names_the_first_step_and_both_counts():
    c = Comparison()
    token_count(c, ([1, 2, 3], [10, 25, 40], [10, 26, 41]), "what both count")
    (name, ok, detail, step), = c.checks
    assert (name, ok, step) == ("token count", False, 2), detail
    assert "step 2: 25 tokens seen in RUN_A vs 26 in RUN_B (15 vs 16 since step 1" in detail, detail
    c = Comparison()
    token_count(c, ([1, 2], [10, 25], [10.0, 25.0]), "what both count")  # a log's float counts are integers
    assert c.checks[0][1] is True and c.equivalent, c.checks


def test_the_trainers_count_says_whether_it_counts_padding():
    logs = [{"step": 1, "loss": 1.0, "num_input_tokens_seen": 64}, {"step": 2, "loss": 1.0}]
    assert logged_tokens(logs, "all").padding is True
    assert logged_tokens(logs, True).padding is True  # the arguments' bool, as transformers maps it
    assert logged_tokens(logs, "non_padding").padding is False
    assert logged_tokens(logs, None).padding is None
    assert logged_tokens(logs, "all").counts == ((1, 64),)
    assert logged_tokens([{"step": 1, "loss": 1.0}], "all") is None
    trl = Baseline("Trainer folder", TRL, logs=[{"step": 1, "loss": 1.0, "num_tokens": 403.0,
                                                  "num_input_tokens_seen": 999}])
    assert trl.token_counts.key == "num_tokens" and trl.token_counts.counts == ((1, 403),)


def tail_case(rows: int, counts: list) -> Comparison:
    """A 2-process TRL baseline (4 per device, 2 accumulation) over ``rows`` rows, two epochs of 3 steps, logging
    ``counts``; this run's history counts 100 tokens a step."""
    from pathlib import Path

    from finetune.reproduce.runs import Run
    from finetune.reproduce.token_counts import check_tokens

    logs = [{"step": s, "loss": 1.0, "num_tokens": float(n)} for s, n in enumerate(counts, 1)]
    b = Baseline("Trainer folder", TRL, logs=logs, processes=(2, "test"),
                 args={"per_device_train_batch_size": (4, "test")})
    history = [{"step": s, "epoch": (s - 1) // 3, "tokens_seen": 100 * s} for s in range(1, 7)]
    mine = Run(Path("run"), history, {"train_samples": rows}, {"task": "sft"}, None, None)
    c = Comparison()
    check_tokens(c, b, mine)
    return c


def test_an_epochs_last_step_trl_counts_on_fewer_processes_is_left_out():
    """41 rows on 2 processes × 4: accelerate's gather_for_metrics keeps only process 0's count of each epoch's last
    micro-batch (41 mod 8 = 1 process; measured with accelerate 1.15 on 2 CPU processes), so TRL logs less at steps
    3 and 6; those steps' additions are left out, the others still compared. 40 rows (a multiple of 8): every step
    compared."""
    short = [100, 200, 290, 390, 490, 580]
    (name, ok, detail, _), = tail_case(41, short).checks
    assert ok is True and "equal at 4 of 6 logged steps" in detail and "on 1 of its 2 processes" in detail, detail
    assert tail_case(41, [100, 201, 291, 391, 491, 581]).checks[0][1] is False  # step 2 still compared
    (name, ok, detail, step), = tail_case(40, short).checks
    assert ok is False and step == 3, detail


def changed(tmp, name: str, edit) -> str:
    rows = [json.loads(line) for line in open(ROWS)]
    answer = next(m for m in rows[ROW]["messages"] if m["role"] == "assistant")
    assert " is " in answer["content"]
    answer["content"] = edit(answer["content"])
    out = tmp / f"{name}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The TRL run reproduced (micro-batch 2, its report kept), and its recipe run at micro-batch 4, on a word added
    and on a word replaced."""
    tmp = tmp_path_factory.mktemp("counts")
    assert main([str(a) for a in ("reproduce", TRL, "--model", LF / "model", "--data", ROWS, "--batch-size", 2,
                                  "-o", tmp / "same", "--set", "model.generate_prompts=0")]) == 0
    out = {"same": tmp / "same" / "run", "report": (tmp / "same" / "report.md").read_text()}
    added = changed(tmp, "added", lambda a: a.replace(" is ", " is indeed ", 1))
    # " is " → " a ": the same number of tokens with the test model's tokenizer (" was " is three more)
    replaced = changed(tmp, "replaced", lambda a: a.replace(" is ", " a ", 1))
    for name, b, data in (("four", 4, ROWS), ("added", 2, added), ("replaced", 2, replaced)):
        assert main([str(a) for a in ("run", "--recipe", tmp / "same" / "recipe.yaml", "--batch-size", b,
                                      "--output-dir", tmp / name, "--set", f"data.source={data}", "--set",
                                      "model.generate_prompts=0", "--set", "output.plots=false", "--set",
                                      "output.tracker=none")]) == 0
        out[name] = tmp / name
    return out


def history(run) -> list:
    return [json.loads(line) for line in open(run / "history.jsonl")]


def step_of_row(a, b) -> int:
    """The first step whose window held other tokens in run ``b`` than in ``a``: the step holding the changed row."""
    return next(x["step"] for x, y in zip(history(a), history(b)) if x["content_hash"] != y["content_hash"])


def test_a_trl_run_reproduced_counts_its_tokens_exactly(runs):
    said = runs["report"]
    line = next(line for line in said.splitlines() if " token count " in line)
    logged = json.loads((TRL / "trainer_state.json").read_text())["log_history"]
    counts = [int(e["num_tokens"]) for e in logged if "num_tokens" in e and "loss" in e]
    assert line.startswith("ok ") and f"equal at all {len(counts)} logged steps" in line, said
    assert f"token counts at {len(counts)} steps" in said, said  # in what the equivalent verdict rests on
    assert [h["tokens_seen"] for h in history(runs["same"])] == counts  # every step, not only the last


def test_a_word_added_differs_on_the_token_count_at_its_step_whatever_the_bands(runs):
    step = step_of_row(runs["same"], runs["added"])
    wide = compare_with_baseline(TRL, runs["added"], weight_rtol=1.0, loss_rtol=1.0)  # the rounding bands miss it
    found = checks(wide)
    assert found["token count"][0] is False and found["token count"][1].startswith(f"step {step}: "), wide.report()
    assert [name for name, ok, _, _ in wide.checks if ok is False] == ["token count"], wide.report()
    assert wide.verdict.kind == "differs" and "token count: step" in wide.verdict.line, wide.report()
    # negative control: a word replaced by one of its token count — the counts agree, the loss does not
    ours, theirs = history(runs["same"]), history(runs["replaced"])
    assert [h["tokens_seen"] for h in ours] == [h["tokens_seen"] for h in theirs]  # the control's premise
    assert [h["content_hash"] for h in ours] != [h["content_hash"] for h in theirs]
    same_length = compare_with_baseline(TRL, runs["replaced"])
    assert checks(same_length)["token count"][0] is True, same_length.report()
    assert same_length.verdict.kind == "differs", same_length.report()


def test_two_layouts_of_a_run_count_alike_and_a_longer_row_differs(runs):
    layouts = compare_runs(runs["same"], runs["four"])
    assert checks(layouts)["token count"][0] is True and layouts.equivalent, layouts.report()
    assert [h["padded_tokens_seen"] for h in history(runs["same"])] != \
        [h["padded_tokens_seen"] for h in history(runs["four"])]  # what the layouts pad differs, what they count not
    longer = compare_runs(runs["same"], runs["added"])
    ok, detail = checks(longer)["token count"]
    assert ok is False and detail.startswith(f"step {step_of_row(runs['same'], runs['added'])}: "), longer.report()
    assert checks(compare_runs(runs["same"], runs["replaced"]))["token count"][0] is True


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """The worked example's Trainer baseline logging ``num_input_tokens_seen`` in the Trainer's ``all`` mode (every
    input id), and its recipe imported."""
    from tests.test_trainer_baselines import train_example

    root = train_example(tmp_path_factory.mktemp("trainer"), "--tokens-seen", "all")
    assert main(["import", str(root / "baseline"), "--recipe", str(root / "recipe.yaml"), "-o",
                 str(root / "imported.yaml")]) == 0
    return root


def test_the_trainers_count_with_padding_is_compared_where_the_padding_is_replayed(trainer_run):
    """``all`` counts each micro-batch's padding, which depends on the baseline's micro-batches: a reproduction at
    micro-batch 2 that does not replay them says so; one that replays them (``training.replay_padding``: the
    baseline's 8 per device) compares its padded tokens, exactly."""
    def run(name, *sets):  # its first 4 steps: what the counts need (the other layers then differ)
        assert main(["run", "--recipe", str(trainer_run / "imported.yaml"), "--batch-size", "2", "--output-dir",
                     str(trainer_run / name), "--set", "training.max_steps=4",
                     *[x for s in sets for x in ("--set", s)]]) == 0
        return compare_with_baseline(trainer_run / "baseline", trainer_run / name)

    plain = run("plain")
    ok, detail = checks(plain)["token count"]
    assert ok is None and "include_num_input_tokens_seen: all" in detail, plain.report()
    replayed = run("replayed", "training.replay_padding=[8, 1]")
    ok, detail = checks(replayed)["token count"]
    steps = len(history(trainer_run / "replayed"))
    assert ok is True and f"equal at all {steps} logged steps" in detail and "padded tokens" in detail, \
        replayed.report()
    # negative control: padded otherwise than the baseline (each micro-batch to a multiple of 48: its 64-token rows
    # to 96), the same real tokens — differs from step 1, so the padded count is what was compared
    other = run("other", "training.replay_padding=[8, 48]")
    ok, detail = checks(other)["token count"]
    assert ok is False and detail.startswith("step 1: "), other.report()
    assert [h["tokens_seen"] for h in history(trainer_run / "other")] == \
        [h["tokens_seen"] for h in history(trainer_run / "replayed")]


def test_rows_whose_trailing_template_text_is_dropped_are_not_compared():
    """Trained on the assistant's turns with turn_end stripped, finetune drops the text after each row's last turn
    that TRL tokenizes untrained (tests/test_trl_runs.py's assistant-only run: 223 tokens against 219 at step 1)."""
    from finetune.reproduce.token_counts import dropped_tail

    assert dropped_tail({"data": {"train_on": "assistant", "turn_end": "stripped"}})
    assert dropped_tail({"data": {"train_on": "assistant_turns"}})
    assert dropped_tail({"data": {"train_on": "assistant", "turn_end": "trained"}}) is None
    assert dropped_tail({"data": {"train_on": "all", "turn_end": "stripped"}}) is None
