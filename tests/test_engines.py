"""Sharding engines on 2 CPU processes (gloo): DeepSpeed ZeRO-2 / ZeRO-3 through `accelerate launch` with the
shipped configs, and FSDP2 (torch's fully_shard on a CPU mesh, trained by the same loop) take the big-batch step.

Each engine is launched once (tests/engine_worker.py); every case is compared with one process taking one batch of
b · N · 2 samples per step, SGD, fp32, a short last window in each epoch."""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune import distributed, engine_config
from finetune.errors import ConfigError
from finetune.models.forward import shards_weights
from tests import engine_worker
from tests.helpers import ACCELERATE, ENV, ROOT, SMALL, assert_same_history, tiny_chat_assets

pytest.importorskip("deepspeed")
CONFIGS = ROOT / "accelerate_configs"
EXACT = 1e-5  # fp32 rounding over 8 steps: measured 7.0e-8 (MLP), 2.6e-8 to 1.2e-7 (GPT-2)
LAUNCHES = {
    "zero1": ("deepspeed_zero1.yaml", "deepspeed", "mlp,gpt2"),
    "zero2": ("deepspeed_zero2.yaml", "deepspeed", "mlp,gpt2,mlp:per_micro_batch_mean,mlp:accelerate_clipping"),
    "zero3": ("deepspeed_zero3.yaml", "deepspeed", "mlp,gpt2,mlp:per_micro_batch_mean"),
    "fsdp2": ("multi_cpu_2.yaml", "fsdp2", "mlp,gpt2,mlp:per_micro_batch_mean"),
}
PORTS = {"zero1": 29560, "zero2": 29561, "zero3": 29562, "fsdp2": 29563}


def launch(config, *args, port, timeout=900):
    cmd = [ACCELERATE, "launch", "--config_file", str(CONFIGS / config), "--main_process_port", str(port), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def engine_results(tmp_path_factory):
    """name → the worker's results, launched on first use."""
    results = {}

    def get(name):
        if name not in results:
            config, engine, specs = LAUNCHES[name]
            out = tmp_path_factory.mktemp(name) / "out.json"
            proc = launch(config, "-m", "tests.engine_worker", str(out), engine, specs, port=PORTS[name])
            assert proc.returncode == 0, proc.stderr[-4000:]
            results[name] = json.loads(out.read_text())
        return results[name]
    return get


@pytest.fixture(scope="module")
def big_batch():
    """case → one process, one micro-batch of b · N · 2 samples per step."""
    return {name: engine_worker.run("none", name, processes=1) for name in engine_worker.CASES}


def rel(a, b) -> float:
    a, b = torch.tensor(a), torch.tensor(b)
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp2"])
@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_engine_takes_the_big_batch_step(engine_results, big_batch, name, case):
    got, want = engine_results(name)[case], big_batch[case]
    assert got["processes"] == 2 and got["effective"] == want["effective"]
    assert ("DEEPSPEED" in got["engine"]) == name.startswith("zero")
    # ZeRO-3 and FSDP2 really held a part of the weights at every step; ZeRO-2 holds them whole
    assert got["sharded"] == (name in ("zero3", "fsdp2"))
    assert rel(got["weights"], want["weights"]) <= EXACT
    # the same samples, loss, grad norm and lr at every step (in 2 · N micro-batches against 1)
    assert_same_history(got["history"], want["history"], same_split=False)
    assert torch.isfinite(torch.tensor(got["alone"]))  # after the run the main process can run the model alone


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp2"])
def test_a_per_micro_batch_mean_is_told_apart(engine_results, big_batch, name):
    """The negative control: dividing each micro-batch's mean by N (right only for full, equal windows)."""
    got = engine_results(name)["mlp:per_micro_batch_mean"]
    assert rel(got["weights"], big_batch["mlp"]["weights"]) > 100 * EXACT


def test_accelerate_default_clipping_is_told_apart(engine_results, big_batch):
    """Left to Accelerate, DeepSpeed clips at 1.0 a run whose recipe has no clipping: the steps differ."""
    got = engine_results("zero2")["mlp:accelerate_clipping"]
    assert max(h["grad_norm"] for h in big_batch["mlp"]["history"]) > 1.0  # clipping at 1.0 changes these steps
    assert rel(got["weights"], big_batch["mlp"]["weights"]) > 100 * EXACT


def sft_args(out, *extra):
    tiny_chat_assets()
    sets = [x for s in SMALL["sft-smollm2"] for x in ("--set", s)]
    return ["finetune/run.py", "--recipe", "sft-smollm2", *sets, "--set", "peft.enabled=false", "--max-steps", "3",
            "--batch-size", "2", "--set", "output.save_every=2", "--set", "output.tracker=none",
            "--output-dir", str(out), *extra]


def test_sft_under_zero3_saves_a_whole_model_and_resumes_bit_identically(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    proc = launch("deepspeed_zero3.yaml", *sft_args(run), port=29564)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Processes: 2, DeepSpeed ZeRO-3" in proc.stdout and proc.stdout.count("done:") == 1
    model = AutoModelForCausalLM.from_pretrained(run / "model")  # whole: every weight, loadable on its own
    saved = load_file(run / "model" / "model.safetensors")
    assert all(v.numel() == model.state_dict()[k].numel() > 0 for k, v in saved.items())

    resumed = tmp_path / "resumed"  # the run interrupted after its step-2 checkpoint, continued under ZeRO-3
    (resumed / "checkpoints").mkdir(parents=True)
    subprocess.run(["cp", "-r", str(run / "checkpoints" / "step-000002"), str(resumed / "checkpoints")], check=True)
    (resumed / "checkpoints" / "latest").write_text("step-000002\n")
    proc = launch("deepspeed_zero3.yaml", *sft_args(resumed, "--resume", "latest"), port=29565)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = load_file(resumed / "model" / "model.safetensors")
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)


@pytest.mark.parametrize("use_cpu", [False, True])
def test_an_fsdp_launch_that_would_not_shard_is_refused(tmp_path, use_cpu):
    """Accelerate's FSDP on the CPU (use_cpu: true, or no GPU) trains each process alone and exits 0."""
    if torch.cuda.is_available() and not use_cpu:
        pytest.skip("this machine has a GPU: the shipped fsdp.yaml shards")
    config = tmp_path / "fsdp.yaml"
    config.write_text((CONFIGS / "fsdp.yaml").read_text().replace("use_cpu: false", f"use_cpu: {str(use_cpu).lower()}"))
    proc = subprocess.run([ACCELERATE, "launch", "--config_file", str(config), "--main_process_port", "29567",
                           *sft_args(tmp_path / "o")], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode != 0
    assert "error: accelerate config: FSDP does not shard here" in proc.stderr
    assert "LOAD REPORT" not in proc.stderr and "FINE-TUNING" not in proc.stdout  # refused before the model is built
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# what finetune writes into DeepSpeed's config (no launch)


def deepspeed_accelerator(**plugin):
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=DeepSpeedPlugin(**plugin))


def optims(max_grad_norm, n=1):
    return [SimpleNamespace(max_grad_norm=max_grad_norm)] * n


@pytest.mark.parametrize("max_grad_norm, clip", [(None, 0.0), (0.0, 0.0), (0.5, 0.5)])
def test_deepspeed_clips_as_the_recipe_says(max_grad_norm, clip):
    accelerator = deepspeed_accelerator(zero_stage=2)
    assert accelerator.deepspeed_plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto"
    distributed.configure_deepspeed(accelerator, 3, optims(max_grad_norm))
    config = accelerator.deepspeed_plugin.deepspeed_config
    assert config["gradient_clipping"] == clip and config["train_micro_batch_size_per_gpu"] == 3


def refuse_for(accelerator, optims, on_nonfinite="stop"):
    """Start-up's check of what DeepSpeed would run differently, on the config Accelerate prepares with."""
    engine_config.check_deepspeed(accelerator.deepspeed_plugin.deepspeed_config,
                                  optims[0].max_grad_norm if optims else None, len(optims), on_nonfinite)


def test_deepspeed_config_that_contradicts_the_recipe_is_refused():
    with pytest.raises(ConfigError, match="^deepspeed config: gradient_clipping is 1.0 but training.max_grad_norm is "
                                          "None"):
        refuse_for(deepspeed_accelerator(zero_stage=2, gradient_clipping=1.0), optims(None))
    refuse_for(deepspeed_accelerator(zero_stage=2, gradient_clipping=1.0), optims(1.0))
    with pytest.raises(ConfigError, match="^deepspeed config: gradient_accumulation_steps is 4; set it to 1 or auto"):
        refuse_for(deepspeed_accelerator(zero_stage=2, gradient_accumulation_steps=4), optims(None))
    with pytest.raises(ConfigError, match="^accelerate config: DeepSpeed drives one model and one optimizer"):
        refuse_for(deepspeed_accelerator(zero_stage=2), optims(None, n=2))
    with pytest.raises(ConfigError, match="^training.on_nonfinite: skip cannot drop a window under DeepSpeed"):
        refuse_for(deepspeed_accelerator(zero_stage=2), optims(None), on_nonfinite="skip")


def test_deepspeed_refusals_come_before_the_model_and_the_run_directory(monkeypatch, tmp_path):
    """What DeepSpeed would run otherwise is refused at set-up (every process checks the launch's config), and a
    task with two optimizers right after it is built, before its output directory holds anything."""
    from finetune.config import TrainingConfig
    from finetune.startup import check_environment

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    with pytest.raises(ConfigError, match="^deepspeed config: gradient_clipping is 1.0 but training.max_grad_norm"):
        check_environment(TrainingConfig(max_grad_norm=None))
    check_environment(TrainingConfig(max_grad_norm=1.0))
    proc = launch("deepspeed_zero2.yaml", "finetune/run.py", "--recipe", "vae-digits", "--max-steps", "1",
                  "--output-dir", str(tmp_path / "o"), port=29568)
    assert proc.returncode != 0
    assert "error: accelerate config: DeepSpeed drives one model and one optimizer; this task trains 2" in proc.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_checkpoint_resumes_only_under_the_engine_that_wrote_it(monkeypatch, tmp_path):
    from finetune.checkpoint import check_resume_engine

    saved = lambda engine, processes=2: SimpleNamespace(path=tmp_path, engine=engine, processes=processes)  # noqa
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    check_resume_engine(saved("deepspeed-zero3"), processes=2)
    with pytest.raises(ConfigError, match="^resume: checkpoint .* was written under ddp, this launch is "
                                          "deepspeed-zero3"):
        check_resume_engine(saved("ddp"), processes=2)
    with pytest.raises(ConfigError, match="was written under deepspeed-zero2, this launch is deepspeed-zero3"):
        check_resume_engine(saved("deepspeed-zero2"), processes=2)
    with pytest.raises(ConfigError, match="on 2 processes; it resumes on 2"):
        check_resume_engine(saved("deepspeed-zero3"), processes=4)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    check_resume_engine(saved("ddp", processes=1), processes=2)  # DDP: elastic
    with pytest.raises(ConfigError, match="was written under deepspeed-zero3, this launch is ddp"):
        check_resume_engine(saved("deepspeed-zero3"), processes=2)


def test_release_is_a_no_op_off_zero3():
    """Only ZeRO-3 partitions weights; other runs keep their model as it is."""
    model = torch.nn.Linear(2, 2)
    accelerator = SimpleNamespace(distributed_type="MULTI_CPU")
    before = model.weight.detach().clone()
    distributed.release_sharding(accelerator, model)
    assert torch.equal(model.weight, before) and not shards_weights(model)


def test_config_files_carry_no_clipping_of_their_own():
    """finetune gives DeepSpeed the recipe's clipping; a value in the shipped configs would contradict recipes."""
    for stage in (1, 2, 3):
        text = (CONFIGS / f"deepspeed_zero{stage}.yaml").read_text()
        assert f"zero_stage: {stage}" in text and "use_cpu: false" in text
        assert "gradient_clipping:" not in text.split("compute_environment")[1]
    assert Path(CONFIGS / "fsdp.yaml").read_text().count("fsdp_version: 2") == 1
