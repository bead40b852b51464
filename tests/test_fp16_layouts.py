"""fp16 layouts of one run (docs/exact-steps.md#fp16): under fp16 autocast with a dynamic loss scale (on this CPU as
on a T4), finetune pads every micro-batch to its window's longest sample and sums each trainable linear layer's
weight gradient in fp32, the scale multiplies every micro-batch's loss alike and is unscaled once over the window's
accumulated gradient. So (8, 1), (4, 2) and (2, 4) of the sft recipe on the tiny chat model, and of the ODE recipe,
read "equivalent" against the floor measured on the (2, 4) twin; a run whose first steps overflow skips the same
steps at every layout.

Negative twins: the same layouts without the fp32 sums and window padding stand further apart; one answer changed by
one word differs; a skipped step on one side only is named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from finetune import distributed
from finetune.models import precision
from finetune.outputs import read_history
from finetune.reproduce.compare import compare_runs
from tests.helpers import ENV, ROOT, SMALL, cpu_kernels, one_word_changed, recipe_runs, tiny_chat_assets

SFT = [*SMALL["sft-smollm2"], "model.dropout=0", "data.limit=22", "training.effective_batch_size=8",
       "model.generate_prompts=0", "training.eval_at_start=false", "output.plots=false",
       "training.mixed_precision=fp16", "training.max_grad_norm=0.34", "peft.enabled=false",
       "training.learning_rate=5e-4", "training.packing=false", "training.chunked_loss=false", "training.epochs=2"]
ODE = [*SMALL["ode-latent"], "model.dropout=0", "data.limit=48", "training.effective_batch_size=8",
       "training.mixed_precision=fp16", "training.epochs=1", "output.plots=false", "training.eval_at_start=false"]
UNFIXED = ["training.fp32_grad_sums=false", "training.pad_to_window=false"]
# a scale at which the first windows' scaled gradients overflow fp16 (65504): those steps are skipped and the scale
# halved until it fits (the tiny chat model overflows up to 2.5e6, the ODE's network at 1e6)
OVERFLOWING = {"sft": "training.initial_loss_scale=1e7", "ode": "training.initial_loss_scale=1e6"}


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    tiny_chat_assets()
    return recipe_runs(tmp_path_factory.mktemp("fp16-sft"), "sft-smollm2", SFT)


@pytest.fixture(scope="module")
def ode(tmp_path_factory):
    return recipe_runs(tmp_path_factory.mktemp("fp16-ode"), "ode-latent", ODE)


def history(run) -> list:
    return read_history(run, "test")


@pytest.mark.parametrize("recipe", ["sft", "ode"])
def test_fp16_layouts_of_the_same_run_are_equivalent(request, recipe):
    runs = request.getfixturevalue(recipe)
    big, mid, twin = runs("b8", 8), runs("b4", 4), runs("b2", 2)
    steps = history(big)
    assert all("loss_scale" in h and not h["skipped"] for h in steps), steps  # fp16 ran, with its scale
    c = compare_runs(big, mid, twin=twin)
    assert c.equivalent and "floor measured on b2" in c.report(), (cpu_kernels(), c.report())
    assert compare_runs(big, twin).equivalent, cpu_kernels()  # and against the assumed fp16 floor


def test_the_fixes_take_fp16_layout_noise_toward_fp32_rounding(sft):
    """(8, 1) against (2, 4): closer with the fp32 sums and window padding than without (the control). Measured:
    weights 2.0e-7 apart (relative L2) with them, 2.8e-6 without."""
    fixed = compare_runs(sft("b8", 8), sft("b2", 2)).measured
    unfixed = compare_runs(sft("unfixed-8", 8, *UNFIXED), sft("unfixed-2", 2, *UNFIXED)).measured
    assert unfixed["weights L2"] > 5 * fixed["weights L2"], (unfixed, fixed)


def test_one_word_in_one_answer_differs_in_fp16(sft, tmp_path):
    c = compare_runs(sft("b8", 8), sft("word-4", 4, f"data.source={one_word_changed(tmp_path)}"),
                     twin=sft("b2", 2))
    assert c.verdict.kind == "differs" and c.first_difference.startswith("window content: step "), c.report()
    by_name = {name: ok for name, ok, _, _ in c.checks}
    assert by_name["loss curve"] is False or by_name["grad norm"] is False, c.report()  # against the twin's floor


@pytest.mark.parametrize("recipe", ["sft", "ode"])
def test_overflowing_steps_are_skipped_alike_at_every_layout(request, recipe):
    """A loss scale that overflows fp16: the first steps are skipped (no update, no step of the schedule, the scale
    halved each time) at (8, 1), (4, 2) and (2, 4) alike, the rest trained, and the runs read equivalent."""
    runs = request.getfixturevalue(recipe)
    layouts = [runs(f"over-{b}", b, OVERFLOWING[recipe]) for b in (8, 4, 2)]
    skipped = [[h["step"] for h in history(r) if h["skipped"]] for r in layouts]
    scales = [[h["loss_scale"] for h in history(r)] for r in layouts]
    assert skipped[0] and skipped[0][0] == 1 and len(skipped[0]) < len(history(layouts[0])), skipped
    assert skipped[1] == skipped[0] and skipped[2] == skipped[0], skipped
    assert scales[1] == scales[0] == scales[2]
    first = history(layouts[0])
    assert first[len(skipped[0])]["lr"] == first[0]["lr"]  # the schedule starts at the first step taken
    c = compare_runs(layouts[0], layouts[1], twin=layouts[2])
    assert c.equivalent and "skipped steps" in c.report(), (cpu_kernels(), c.report())
    # the skipped steps' inf / NaN norms are no rounding: the floor measured on the twin stays a number
    assert "tolerance nan" not in c.report() and "≤ nan" not in c.report(), c.report()


def test_a_step_skipped_on_one_side_only_is_named(sft, tmp_path):
    """The negative twin of the skipped-steps layer: run B's history with its second step marked skipped (as an
    overflow on one side only would leave it) differs, naming the step."""
    other = tmp_path / "b4-skipped"
    shutil.copytree(sft("b4", 4), other)
    lines = (other / "history.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    record["skipped"] = True
    lines[1] = json.dumps(record)
    (other / "history.jsonl").write_text("\n".join(lines) + "\n")
    c = compare_runs(sft("b8", 8), other, twin=sft("b2", 2))
    by_name = {name: (ok, detail) for name, ok, detail, _ in c.checks}
    assert c.verdict.kind == "differs" and by_name["skipped steps"][0] is False, c.report()
    assert "step 2" in by_name["skipped steps"][1], c.report()


@pytest.mark.parametrize("padding_mode", ["circular", "zeros"])
def test_fp32_grad_sums_of_a_convolution_keep_autocast_forward_and_input_gradient(padding_mode):
    """A switched Conv2d (the ODE's layers, their circular padding included) computes autocast's forward and input
    gradient to the bit, and its weight gradient as the fp32 sum of the fp16 products: two micro-batches add up to
    the whole batch's to fp32 rounding, where autocast's rounded partial sums stand far apart (the control)."""
    torch.manual_seed(0)
    x = torch.randn(8, 5, 12, 12)

    def grads(switch: bool, parts: int):
        torch.manual_seed(1)
        conv = torch.nn.Conv2d(5, 7, 3, padding=1, padding_mode=padding_mode)
        if switch:
            assert precision.sum_weight_grads_in_fp32(conv) == 1 and precision.sums_weight_grads_in_fp32(conv)
        inputs, outs = x.clone().requires_grad_(), []
        for part in inputs.chunk(parts):
            with torch.autocast("cpu", dtype=torch.float16):
                out = conv(part)
            (out.float() ** 2).sum().backward()
            outs.append(out)
        return torch.cat(outs), inputs.grad, conv.weight.grad

    autocast_out, autocast_x, autocast_w = grads(False, 1)
    out, grad_x, whole = grads(True, 1)
    assert torch.equal(out, autocast_out) and torch.equal(grad_x, autocast_x)
    split = grads(True, 2)[2]
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    assert rel(split, whole) < 1e-5
    assert rel(grads(False, 2)[2], autocast_w) > 100 * rel(split, whole)


def test_a_step_the_baseline_skipped_is_named(tmp_path, capsys):
    """Against another tool's run: a step whose logged grad norm is inf (an fp16 overflow the Trainer skipped) and
    that this run took is named; the baseline as it was trained names none (the control)."""
    from finetune.cli import main
    from tests.test_multiprocess_args import LF, TWO

    rows = LF / "data" / "chat.jsonl"
    assert main(["reproduce", str(TWO), "--model", str(LF / "model"), "--data", str(rows), "--batch-size", "2",
                 "-o", str(tmp_path / "same"), "--set", "model.generate_prompts=0"]) == 0
    skipped = tmp_path / "skipped"
    shutil.copytree(TWO, skipped)
    state = json.loads((skipped / "trainer_state.json").read_text())
    state["log_history"][1]["grad_norm"] = float("inf")
    (skipped / "trainer_state.json").write_text(json.dumps(state))
    capsys.readouterr()
    assert main(["compare", str(skipped), str(tmp_path / "same" / "run")]) == 1
    report = capsys.readouterr().out
    assert "skipped steps" in report and "step 2 skipped in the baseline only" in report, report
    assert report.strip().splitlines()[-1].startswith("verdict: differs"), report
    assert main(["compare", str(TWO), str(tmp_path / "same" / "run")]) == 0
    assert "skipped steps" not in capsys.readouterr().out


def test_an_fp16_run_resumed_from_a_checkpoint_is_bit_identical(tmp_path):
    """The loss scale is saved with the checkpoint (JSON, no pickle) and restored: a run started at an overflowing
    scale and resumed after its skipped steps takes the uninterrupted run's steps to the bit, scales included."""
    import copy

    from finetune.api import test_fine_tuning
    from tests.helpers import MLP, regression_data

    torch.manual_seed(0)
    start = MLP()
    kw = dict(train_data=regression_data(48), batch_size=4, gradient_accumulation_steps=2, learning_rate=0.05,
              mixed_precision="fp16", initial_loss_scale=2.0 ** 20, save_every=2, output_dir=str(tmp_path / "run"))
    full = test_fine_tuning(copy.deepcopy(start), **kw)  # 6 steps: the first 3 overflow, checkpoints 4 and 6 kept
    scales = [h["loss_scale"] for h in full.history]
    assert full.history[0]["skipped"] and not full.history[4]["skipped"] and scales[4] < scales[0]
    saved = tmp_path / "run" / "checkpoints" / "step-000004"
    assert json.loads((saved / "loss_scale.json").read_text())["scale"] == scales[4]  # the scale step 5 runs at
    resumed = test_fine_tuning(copy.deepcopy(start), resume=str(saved), **kw)
    assert [h["loss_scale"] for h in resumed.history] == scales
    assert [h["skipped"] for h in resumed.history] == [h["skipped"] for h in full.history]
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full.model.parameters()))


def test_the_odes_fp16_kernels_give_each_sample_the_same_numbers_at_every_micro_batch():
    """The kernel that held the layouts apart on a CPU with fp16 arithmetic (``avx512_fp16``): there torch sends fp16
    convolutions and matmuls to oneDNN, whose kernel (and rounding) follows the micro-batch. Under the kernels
    finetune's fp16 runs on a CPU (``distributed.torchs_own_kernels``), the ODE's velocity network gives every sample
    the same output and input gradient, to the bit, in micro-batches of 8, 4, 2 and 1 — on every CPU. (Without them,
    on such a CPU, micro-batch 4 stood apart; on a CPU without fp16 arithmetic both ways agree.)"""
    from finetune.tasks.latent_ode import CHANNELS, Velocity

    torch.manual_seed(0)
    net = Velocity(16)
    for p in net.parameters():  # the last convolution starts at zero: give it numbers to round
        torch.nn.init.normal_(p, std=0.2)
    z, t = torch.randn(8, CHANNELS, 16, 16), torch.tensor(0.3)

    def per_sample(b: int):
        outs, grads = [], []
        for part in z.split(b):
            part = part.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(t, part)
            (out.float() ** 2).sum().backward()
            outs.append(out.detach())
            grads.append(part.grad)
        return torch.cat(outs), torch.cat(grads)

    with distributed.torchs_own_kernels():
        assert not torch.backends.mkldnn.enabled
        (out8, grad8), *rest = [per_sample(b) for b in (8, 4, 2, 1)]
    assert torch.backends.mkldnn.enabled  # as it was, once the context ends
    for b, (out, grad) in zip((4, 2, 1), rest):
        assert torch.equal(out, out8) and torch.equal(grad, grad8), (
            f"micro-batch {b}: output {float((out - out8).abs().max()):.3g}, input gradient "
            f"{float((grad - grad8).abs().max()):.3g} from micro-batch 8; {cpu_kernels()}")


def test_an_fp16_run_on_a_cpu_computes_in_torchs_own_kernels_and_bf16_in_onednns():
    """The mechanism, seen from inside a run: every forward and backward of an fp16 run on this CPU finds oneDNN off,
    and the process finds it on again once the run ends; a bf16 run (which replays a baseline's oneDNN kernels)
    keeps it on (the negative twin)."""
    from finetune.api import test_fine_tuning
    from tests.helpers import MLP, regression_data

    seen = []

    class Spying(MLP):
        def forward(self, x, y):
            seen.append(("forward", torch.backends.mkldnn.enabled))
            x = x.clone().requires_grad_()
            x.register_hook(lambda g: seen.append(("backward", torch.backends.mkldnn.enabled)))
            return super().forward(x, y)

    for mixed, expected in (("fp16", False), ("bf16", True)):
        seen.clear()
        test_fine_tuning(Spying(), train_data=regression_data(16), batch_size=4, gradient_accumulation_steps=2,
                         mixed_precision=mixed, learning_rate=0.01)
        assert {k for k, _ in seen} == {"forward", "backward"} and all(on is expected for _, on in seen), (mixed,
                                                                                                             seen)
        assert torch.backends.mkldnn.enabled


def test_an_overflowing_fp16_run_on_two_processes_skips_the_steps_of_one(sft, tmp_path):
    """fp16 across processes: the process factor multiplies the summed gradients, not each loss, so two processes
    (4 each, N = 1) overflow where one process at (4, 2) overflows: the same skipped steps and scales, both ways
    (neither skips a step the other takes), and the runs equivalent. (With the factor in the loss, every fp16
    gradient of the two-process backward was twice the one-process one, and overflowed at half its scale.)"""
    import subprocess
    import sys

    one = sft("over-4", 4, OVERFLOWING["sft"])
    two = tmp_path / "over-2x4"
    sets = [x for s in (*SFT, OVERFLOWING["sft"]) for x in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "finetune", "run", "--processes", "2", "--recipe", "sft-smollm2",
                           "--batch-size", "4", *sets, "--output-dir", str(two)], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [[h["step"] for h in history(r) if h["skipped"]] for r in (one, two)]
    assert skipped[0] and skipped[1] == skipped[0], skipped
    assert [h["loss_scale"] for h in history(two)] == [h["loss_scale"] for h in history(one)]
    c = compare_runs(one, two, twin=sft("over-2", 2, OVERFLOWING["sft"]))
    assert c.equivalent and "skipped steps" in c.report(), (cpu_kernels(), c.report())
