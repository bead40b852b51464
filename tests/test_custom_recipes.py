"""Custom models through the shared loop: the latent ODE, the VAE/GAN and the video regressor.

* (b, N) and (b·N, 1) give the same weights (≤ 1e-5 relative, SGD, dropout off) over two epochs whose last window
  is short and ends in a short micro-batch — for the GAN both the generator's and the discriminator's;
* the randomness inside their losses (SWD projections, reparameterisation noise) is keyed so that this holds, and
  the usual alternatives visibly break it;
* the KL warm-up and the R1 interval count optimizer steps: the same for N = 1 and N = 4;
* R1 over 2 000 micro-steps leaves no tensor, autograd buffer or memory behind;
* every custom recipe runs through the CLI and reports its metric.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
from accelerate.utils import set_seed

from finetune.loading import load_recipe
from finetune.registry import task_module
from tests.helpers import ENV, EXACT, ROOT, RUN, SMALL, rel_diff, train_quietly

CLI_ARGS = {
    "ode-latent": ["--set", "data.limit=16"],
    "vae-digits": ["--set", "data.limit=16"],
    "video-motion": ["--set", "data.limit=16", "--set", "data.val_fraction=0.5"],
}
METRIC = {"ode-latent": ("mae", "gap_closed", "mae_identity"),
          "vae-digits": ("mae", "recon_accuracy", "real_accuracy"),
          "video-motion": ("mae", "mae_mean_predictor")}
LOGGED = {"ode-latent": ("swd", "content"),
          "vae-digits": ("kl", "kl_weight", "r1", "d_loss", "adv", "perceptual", "grad_norm_discriminator"),
          "video-motion": ()}


@pytest.fixture(autouse=True, scope="module")
def cli_runs(tmp_path_factory):
    """Launch every custom recipe through the CLI (2 optimizer steps each) at the start, so that these independent
    processes run while the in-process tests do; the CLI tests at the end collect them.

    Everything here runs on one thread: the models are tiny, a second thread only adds synchronisation, and on a
    shared machine it can cost 100×."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("cli")
    runs = {}
    for name, extra in CLI_ARGS.items():
        sets = [a for s in SMALL[name] for a in ("--set", s)]
        args = [sys.executable, RUN, "--recipe", name, "--max-steps", "2", "--batch-size", "4", "--grad-accum-steps",
                "2", *sets, *extra, "--set", "output.plots=false", "--output-dir", str(base / name)]
        log = open(base / f"{name}.log", "w+")
        runs[name] = (subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                       env={**ENV, "OMP_NUM_THREADS": "1"}), log, base / name)
    yield runs
    for proc, log, _ in runs.values():
        if proc.poll() is None:
            proc.kill()
        log.close()
    torch.set_num_threads(threads)


def run(name, b, n, *overrides, val=False, before_window=None, job_hook=None):
    """Build the recipe's job (seeded as the CLI seeds it) and train it through the loop; (result, job)."""
    cfg = load_recipe(name, [*SMALL[name], *EXACT, f"training.batch_size={b}",
                             f"training.gradient_accumulation_steps={n}", *overrides])
    set_seed(cfg.training.seed)
    job = task_module(cfg.task).build(cfg)
    if not val:
        job.val_data = None
    job.start = {k: p.detach().clone() for k, p in job.model.named_parameters()}  # the initial weights
    if job_hook is not None:
        job_hook(job)
    if before_window is not None:
        job.before_window = before_window(job)
    return train_quietly(job, cfg.training), job


def params(model, prefix=""):
    named = model.items() if isinstance(model, dict) else model.named_parameters()
    return torch.cat([p.detach().flatten().double() for k, p in named if k.startswith(prefix)])


# ---------------------------------------------------------------------------------------------------------------
# exact windows


@pytest.mark.parametrize("memory", ["none", "checkpoint", "adjoint"])
def test_latent_ode_exact_windows(memory):
    over = [f"model.ode_memory={memory}", "model.solver=rk4", "training.learning_rate=0.5"]
    small, job = run("ode-latent", 3, 4, *over)
    big, _ = run("ode-latent", 12, 1, *over)
    assert small["optimizer_steps"] == big["optimizer_steps"] == 4
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert small["grad_norm_history"] == pytest.approx(big["grad_norm_history"], rel=1e-5)
    h = small["history"]
    assert all(math.isfinite(x["swd"]) and math.isfinite(x["content"]) for x in h)  # both terms logged
    assert [x["swd"] for x in h] == pytest.approx([x["swd"] for x in big["history"]], rel=1e-5)


def test_latent_ode_memory_modes_give_the_same_gradient():
    """checkpoint recomputes the very same steps (bit for bit); adjoint solves the adjoint ODE on the same grid, which
    matches backprop through the solver up to discretisation error (5e-4 here, 3 rk4 steps)."""
    cfg = load_recipe("ode-latent", [*SMALL["ode-latent"], "model.solver=rk4"])
    set_seed(0)
    job = task_module(cfg.task).build(cfg)
    batch = torch.utils.data.default_collate(job.train_data[:4])
    model = job.model
    with torch.no_grad():  # a trained-looking flow, not the zero-initialised one
        model.velocity.net[-1].weight.normal_(0, 0.05)
    grads = {}
    for memory in ("none", "checkpoint", "adjoint"):
        model.cfg.ode_memory = memory
        model.zero_grad()
        model(**batch)["loss"].backward()
        grads[memory] = torch.cat([p.grad.flatten() for p in model.parameters()]).clone()
    assert torch.equal(grads["checkpoint"], grads["none"])
    assert rel_diff(grads["adjoint"], grads["none"]) <= 2e-3  # the adjoint ODE's discretisation error


def test_swd_drawn_per_micro_batch_would_not_match():
    """The check above can fail: projections drawn anew for every micro-batch (not once per optimizer step)."""
    over = ["model.ode_memory=none", "training.learning_rate=0.5"]

    def per_forward(job):
        model, forward = job.model, job.model.forward

        def redraw(**batch):
            model.swd_key = torch.randint(1 << 30, ()).item()
            return forward(**batch)

        model.forward = redraw

    small, _ = run("ode-latent", 3, 4, *over, job_hook=per_forward)
    big, _ = run("ode-latent", 12, 1, *over, job_hook=per_forward)
    assert rel_diff(small["model"], big["model"]) > 1e-4


def test_vae_gan_exact_windows_for_both_optimizers():
    over = ["training.learning_rate=0.2", "model.d_learning_rate=0.1", "model.r1_gamma=5"]
    small, job = run("vae-digits", 3, 4, *over)
    big, _ = run("vae-digits", 12, 1, *over)
    assert {o for o in job.param_groups} == {"generator", "discriminator"}
    for part in ("encoder", "decoder", "disc"):
        a, b = params(small["model"], part), params(big["model"], part)
        assert rel_diff(a, b) <= 1e-5, part
        assert float((b - params(job.start, part)).abs().max()) > 1e-3, part  # it trained: "equal" ≠ "unchanged"
    h_small, h_big = small["history"], big["history"]
    for key in ("grad_norm", "grad_norm_discriminator", "d_loss", "r1", "kl", "recon"):
        assert [x[key] for x in h_small] == pytest.approx([x[key] for x in h_big], rel=1e-5), key
    assert [x["lr_discriminator"] for x in h_small] == [0.1] * 4
    assert [x["r1"] > 0 for x in h_small] == [True, False, True, False]  # r1_interval = 2 optimizer steps


def test_vae_noise_from_the_global_rng_would_not_match():
    """The check above can fail: the usual ``torch.randn_like`` noise from the global RNG, drawn micro-batch by
    micro-batch. (On CPU it can match by coincidence — the generator draws normals in blocks of 16, so a latent of
    16 dimensions gives the same stream however the rows are split — but not across processes; per-sample seeds
    hold everywhere.)"""
    over = ["training.learning_rate=0.2", "model.gan=false", "model.perceptual=none", "model.latent_dim=4"]

    def global_noise(job):
        job.model.noise = lambda index, like: torch.randn_like(like)

    small, _ = run("vae-digits", 3, 4, *over, job_hook=global_noise)
    big, _ = run("vae-digits", 12, 1, *over, job_hook=global_noise)
    assert rel_diff(small["model"], big["model"]) > 1e-4
    exact_small, _ = run("vae-digits", 3, 4, *over)
    exact_big, _ = run("vae-digits", 12, 1, *over)
    assert rel_diff(exact_small["model"], exact_big["model"]) <= 1e-5


def test_video_exact_windows_with_and_without_frame_checkpointing():
    over = ["training.learning_rate=0.3"]
    small, _ = run("video-motion", 3, 4, *over, "model.checkpoint_frames=true")
    big, _ = run("video-motion", 12, 1, *over)
    assert small["model"].checkpoint_frames and not big["model"].checkpoint_frames
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert small["grad_norm_history"] == pytest.approx(big["grad_norm_history"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# schedules keyed on optimizer steps


def test_kl_weight_after_k_optimizer_steps_is_the_same_for_n_1_and_4():
    from finetune.tasks.vae_gan import kl_weight_at

    over = ["data.limit=64", "model.kl_warmup_steps=6", "training.max_steps=8", "training.learning_rate=0.01"]
    one, job = run("vae-digits", 8, 1, *over)
    four, _ = run("vae-digits", 2, 4, *over)
    expected = [kl_weight_at(job.model.cfg, k) for k in range(8)]  # the window after k optimizer steps
    assert expected == [0, 1 / 6, 2 / 6, 3 / 6, 4 / 6, 5 / 6, 1, 1]
    assert [h["kl_weight"] for h in one["history"]] == pytest.approx(expected, abs=1e-7)
    assert [h["kl_weight"] for h in four["history"]] == pytest.approx(expected, abs=1e-7)
    assert [h["r1"] > 0 for h in four["history"]] == [k % 2 == 0 for k in range(8)]

    def counts_micro_steps(job):  # the seed's bug: a counter in the wrong unit finishes the warm-up N× too early
        model, m = job.model, job.model.cfg
        return lambda state: setattr(model, "kl_now", kl_weight_at(m, state.micro_step))

    wrong, _ = run("vae-digits", 2, 4, *over, before_window=counts_micro_steps)
    assert [h["kl_weight"] for h in wrong["history"]][:3] == pytest.approx([0, 4 / 6, 1])


# ---------------------------------------------------------------------------------------------------------------
# R1 does not leak


class LiveSaved:
    """Counts tensors that autograd holds for backward right now (saved by any graph, reachable from Python or
    not): each saved tensor is wrapped in a holder whose death decrements the count."""

    def __init__(self):
        self.live = 0

    def _pack(self, t):
        holder = _Holder(t)
        self.live += 1
        weakref.finalize(holder, self._dead)
        return holder

    def _dead(self):
        self.live -= 1

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor)


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, t):
        self.tensor = t


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_bytes() -> int:
    """Bytes malloc has handed out and not got back (glibc's mallinfo2: heap in use + mmapped blocks): unlike RSS it
    grows even when the heap reuses what earlier tests freed. RSS where mallinfo2 is missing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    except (OSError, AttributeError):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def r1_run(micro_steps, every=100, keep=None):
    """R1 on every window of a tiny GAN, 4 micro-batches a window; every ``every`` windows: live saved tensors,
    live Python tensors (after a collection) and the bytes malloc holds."""
    saved, samples = LiveSaved(), []
    windows = micro_steps // 4
    over = ["data.limit=32", "model.r1_interval=1", "model.gan=true", "training.learning_rate=1e-3",
            f"training.max_steps={windows}", f"training.epochs={windows}", "training.optimizer=adamw"]

    def sample(job):
        set_schedule = job.before_window

        def before(state):
            set_schedule(state)
            if state.optimizer_step % every == 0:
                gc.collect()
                tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
                samples.append((state.optimizer_step, saved.live, tensors, heap_bytes()))
        return before

    def leak(job):
        if keep is not None:
            forward = job.model.forward
            job.model.forward = lambda **b: keep(forward(**b))

    with saved.hooks():
        result, _ = run("vae-digits", 2, 4, *over, before_window=sample, job_hook=leak)
    assert result["state"].micro_step == micro_steps
    assert all(h["r1"] > 0 for h in result["history"])
    return samples


def test_r1_over_2000_micro_steps_leaves_nothing_behind():
    samples = r1_run(2000)
    assert [s[0] for s in samples] == [0, 100, 200, 300, 400]
    warm = samples[1]  # after 100 optimizer steps (400 micro-steps)
    for step, live, tensors, heap in samples[1:]:
        assert live == 0, (step, live)  # no graph outlives its micro-step
        assert tensors <= warm[2], (step, tensors, warm[2])
        assert heap - warm[3] < 2 * 2 ** 20, (step, (heap - warm[3]) / 2 ** 20)  # 0.23 MiB: the history


def test_a_graph_kept_alive_is_caught():
    """The check above can fail: keeping each micro-step's outputs (a logging list holding the R1 term with its graph,
    say) piles up tensors and memory. Their backward has freed the saved buffers, so the Python tensors and the
    heap (graph nodes) are what show it."""
    kept = []
    samples = r1_run(300, every=25, keep=lambda out: kept.append(out) or out)
    assert [s[0] for s in samples] == [0, 25, 50]
    (_, _, tensors_a, heap_a), (_, _, tensors_b, heap_b) = samples[1:]
    assert tensors_b - tensors_a >= 25 * 4  # at least one more tensor per micro-step
    # the test above allows 2 MiB over 1 600 micro-steps (1.3 kB a micro-step); this leaks ~85 kB a micro-step
    assert (heap_b - heap_a) / 100 > 4 * 2 * 2 ** 20 / 1600


# ---------------------------------------------------------------------------------------------------------------
# every custom recipe through the CLI

@pytest.mark.parametrize("name", list(CLI_ARGS))
def test_recipe_through_the_cli_reports_its_metric(cli_runs, name):
    proc, log, out = cli_runs[name]
    proc.wait(timeout=600)
    log.seek(0)
    stdout = log.read()
    assert proc.returncode == 0, stdout[-3000:]
    assert "Effective batch size: 8 (4 × 2)" in stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2
    final = metrics["final_metrics"]
    assert all(isinstance(final[k], float) and math.isfinite(final[k]) for k in METRIC[name]), final
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert all(k in h for h in history for k in LOGGED[name])
    assert (out / "model" / "model.safetensors").exists()
    done = [line for line in stdout.splitlines() if line.startswith("done:")]
    assert done and f"{METRIC[name][0]}=" in done[0]  # the final line names the metric
