"""The certificate in bf16 (finetune/reproduce/floor.py): `finetune compare A B --floor TWIN` measures the rounding
floor between run A and its twin (the same recipe at another --batch-size) and holds B to 4× it, step by step.

On the tiny chat model in bf16 autocast with the sft recipe's defaults (packing, the chunked head, AdamW, cosine,
clipping), through the CLI: the layouts of one run read "equivalent" against the measured floor; the negative
controls of the fp32 certificate read "differs" against the same floor — one answer changed by one word, the short
last window weighted as a plain micro-batch mean, clipping on one side only, weight decay 0.01 against 0. Without a
twin the verdict says it rests on an assumed floor; a twin that is not the same run is refused in one line.
"""

from __future__ import annotations

import pytest

from finetune.cli import main
from finetune.reproduce import floor as floors
from tests.helpers import (
    SMALL,
    assert_one_error_line,
    one_word_changed,
    recipe_runs,
    tail_weighted_as_mean,
    tiny_chat_assets,
)

CLIP = 0.34
BASE = [*SMALL["sft-smollm2"], "model.dropout=0", "data.limit=22", "training.effective_batch_size=4",
        "model.generate_prompts=0", "training.eval_at_start=false", "output.plots=false", "output.tracker=none",
        f"training.max_grad_norm={CLIP}", "training.mixed_precision=bf16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tiny_chat_assets()
    return recipe_runs(tmp_path_factory.mktemp("bf16-cert"), "sft-smollm2", BASE)


def compare(capsys, a, b, *extra) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["compare", str(a), str(b), *extra])
    return code, capsys.readouterr().out.strip().splitlines()[-1]


def test_layouts_are_equivalent_against_the_measured_floor(runs, capsys):
    big, twin = runs("4", 4), runs("2", 2)
    code, verdict = compare(capsys, big, runs("1", 1), "--floor", str(twin))
    assert code == 0 and verdict.startswith("verdict: equivalent") and "floor measured on 2" in verdict, verdict


@pytest.mark.parametrize("control", ["word", "tail", "noclip", "decay"])
def test_each_control_differs_against_the_measured_floor(runs, capsys, tmp_path, monkeypatch, control):
    big, twin = runs("4", 4), runs("2", 2)
    if control == "word":
        other = runs("word", 2, f"data.source={one_word_changed(tmp_path)}")
    elif control == "tail":  # Accelerate's accumulate(): the short last window's gradient halved
        tail_weighted_as_mean(monkeypatch)
        other = runs("tail", 2)
    elif control == "noclip":
        other = runs("noclip", 2, "training.max_grad_norm=null")
    else:
        other = runs("decay", 2, "training.weight_decay=0.01")
    code, verdict = compare(capsys, big, other, "--floor", str(twin))
    assert code == 1 and verdict.startswith("verdict: differs — "), verdict
    if control == "decay":
        assert "settings: training.weight_decay" in verdict, verdict
    elif control == "word":
        assert "window content: step" in verdict, verdict
    else:
        assert "first above at step" in verdict or "clipping: step" in verdict, verdict


def test_without_a_twin_the_verdict_says_its_floor_is_assumed(runs, capsys):
    code, verdict = compare(capsys, runs("4", 4), runs("1", 1))
    assert code == 0 and "rests on an assumed bf16 floor" in verdict and "--floor TWIN" in verdict, verdict


def test_a_twin_that_is_another_run_is_refused_in_one_line(runs, capsys):
    capsys.readouterr()
    other = runs("noclip", 2, "training.max_grad_norm=null")
    assert main(["compare", str(runs("4", 4)), str(runs("1", 1)), "--floor", str(other)]) == 2
    assert_one_error_line(capsys.readouterr().err, "compare: --floor")


def test_a_one_sided_shift_under_the_tolerance_is_caught():
    """Negative control of the shift test: every step 2e-4 above, within a 3e-4 per-step tolerance, is told apart;
    the same size with alternating signs is noise."""
    fl = floors.Floor("measured", {"loss": 3e-4}, noise={"loss": [1e-5] * 8})
    xs = [2.0 - 0.1 * i for i in range(8)]
    assert floors.one_sided(xs, [x * (1 + 2e-4) for x in xs], fl)
    assert floors.one_sided(xs, [x * (1 + (-1) ** i * 2e-4) for i, x in enumerate(xs)], fl) is None


def test_a_run_that_did_not_train_is_said():
    assert floors.moved([{"loss": 2.0}, {"loss": 1.5}], 1e-2)
    assert not floors.moved([{"loss": 2.0}, {"loss": 2.0 + 1e-5}], 1e-2)


def test_a_run_records_its_arithmetic(runs):
    import json

    recorded = json.loads((runs("4", 4) / "metrics.json").read_text())["arithmetic"]
    assert recorded["device"] == "cpu" and recorded["tf32"] is False and recorded["name"]


def planted_pair(runs, tmp_path, precision: str, device: str, tf32: bool, loss_factor: float):
    """Run A and a byte copy of it whose every logged loss is ``loss_factor`` × A's, both at ``precision`` and
    recorded as run on ``device`` with or without TF32: the same weights, windows and grad norms, so the loss layer
    alone decides the verdict."""
    import json
    import shutil

    pair = []
    for name, factor in (("a", 1.0), ("b", loss_factor)):
        run = shutil.copytree(runs("4", 4), tmp_path / name)
        config = run / "config.yaml"
        config.write_text(config.read_text().replace("mixed_precision: bf16", f"mixed_precision: '{precision}'"))
        metrics = json.loads((run / "metrics.json").read_text())
        metrics["arithmetic"] = {"device": device, "name": "a test device", "tf32": tf32}
        (run / "metrics.json").write_text(json.dumps(metrics))
        history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
        (run / "history.jsonl").write_text("".join(json.dumps({**h, "loss": h["loss"] * factor}) + "\n"
                                                   for h in history))
        pair.append(run)
    return pair


# Outside an assumed floor a run is "not certified" (exit 3), never "differs": the floor was not measured.
@pytest.mark.parametrize("precision, device, tf32, factor, expected", [
    ("no", "cuda", False, 1 + 5e-4, "differs"),      # IEEE fp32 on a GPU keeps the fp32 tolerance (1e-4)
    ("no", "cuda", True, 1 + 5e-4, "equivalent"),    # TF32: 4 × the H200's layout noise (1.9e-4)
    ("no", "cuda", True, 1 + 2e-3, "not certified"),  # ... and not more
    ("bf16", "cpu", False, 1 + 2e-2, "not certified"),  # bf16 on the CPU: 4 × 4.2e-3
    ("bf16", "cuda", False, 1 + 2e-2, "equivalent"),  # bf16 on the H200: 4 × 6.6e-3, which a one-word change is in
    ("bf16", "cuda", False, 1 + 4e-2, "not certified"),
])
def test_the_assumed_floor_follows_the_recorded_arithmetic(runs, tmp_path, capsys, precision, device, tf32, factor,
                                                           expected):
    a, b = planted_pair(runs, tmp_path, precision, device, tf32, factor)
    code, verdict = compare(capsys, a, b)
    assert verdict.startswith(f"verdict: {expected}"), verdict
    assert code == {"equivalent": 0, "differs": 1, "not certified": 3}[expected], verdict
    if expected == "not certified":
        assert "--floor TWIN" in verdict, verdict
    if expected == "equivalent" and device == "cuda":
        assert "an NVIDIA H200" in verdict and "--floor TWIN" in verdict, verdict
        assert ("one-word change" in verdict) == (precision == "bf16"), verdict


def test_a_run_on_each_device_gets_the_wider_floor():
    cpu, cuda = {"device": "cpu", "tf32": False}, {"device": "cuda", "tf32": False}
    both = floors.assumed("bf16", [cpu, cuda])
    assert both.overall == floors.assumed("bf16", [cuda]).overall != floors.assumed("bf16", [cpu]).overall
    assert floors.assumed("bf16", [None, None]).overall == floors.assumed("bf16", [cpu]).overall  # older runs
    assert floors.assumed("no", [cpu, cuda]).kind == "fp32"


def test_a_measured_floor_holds_each_step_to_the_twins_distance_up_to_it():
    """Per-step bands (floor.measured): a twin that drifts from 2e-5 to 2e-3 over four steps gives step 1 a band of
    12 × 2e-5 (fp32's 1e-4 at least), not 4 × the run's largest (8e-3). A run 1e-3 off at step 1 differs there — the
    old whole-run band passed it (the negative control) — while one 3× the twin's distance at every step is
    equivalent; the layer states its power (its least band)."""
    from finetune.reproduce.verdict import Comparison, Judgement, per_step

    a = [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in (1, 2, 3, 4)]
    drift = [2e-5, 2e-5, 1e-3, 2e-3]
    twin = [{**h, "loss": 2.0 * (1 + d)} for h, d in zip(a, drift)]
    fl = floors.measured(a, twin, {}, "twin")
    assert fl.at("loss", 1) == pytest.approx(floors.STEP_FACTOR * 2e-5, rel=1e-3)
    assert fl.at("loss", 4) == fl.overall["loss"] == pytest.approx(floors.TWIN_FACTOR * 2e-3, rel=1e-2)
    steps, xs = [1, 2, 3, 4], [h["loss"] for h in a]

    def judged(ys, steps_of):
        c = Comparison()
        per_step(c, "loss curve", (steps, xs, ys), Judgement(fl.overall["loss"], steps=steps_of))
        return c

    early = [2.0 * (1 + 1e-3)] + xs[1:]
    c = judged(early, fl.steps["loss"])
    assert c.checks[0][1] is False and c.checks[0][3] == 1, c.checks
    assert judged(early, None).checks[0][1] is True  # the whole run's band let it pass
    near = [2.0 * (1 + 3 * max(drift[:i + 1])) for i in range(4)]
    c = judged(near, fl.steps["loss"])
    assert c.checks[0][1] is True and c.power["loss"] == pytest.approx(floors.STEP_FACTOR * 2e-5, rel=1e-3), c.checks
