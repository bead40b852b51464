"""Reproducing a baseline: `finetune compare`, the `finetune` command, trackers, plots, LR scaling, search."""

import json
import subprocess
import sys

import pytest

from finetune.cli import main
from finetune.registry import list_recipes
from tests.helpers import ENV, ROOT, TINY, cli


def finetune(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, args in {"4x4": ["--batch-size", "4", "--grad-accum-steps", "4"],
                       "16x1": ["--batch-size", "16", "--grad-accum-steps", "1"],
                       "seed": ["--batch-size", "16", "--grad-accum-steps", "1", "--seed", "8"]}.items():
        proc = cli("--recipe", TINY, *args, "--set", "model.dropout=0", "--output-dir", str(root / name))
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[name] = root / name
    return out


def test_compare_says_equivalent_for_4x4_vs_16x1(runs, tmp_path):
    proc = finetune("compare", str(runs["4x4"]), str(runs["16x1"]), "--plot", str(tmp_path / "c.png"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: equivalent" in proc.stdout
    for check in ("effective batch", "optimizer steps", "window samples", "lr schedule", "loss curve", "weights"):
        assert any(line.startswith("ok") and check in line for line in proc.stdout.splitlines()), check
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_compare_names_the_first_difference(runs):
    proc = finetune("compare", str(runs["16x1"]), str(runs["seed"]))
    assert proc.returncode == 1
    assert "verdict: differs — window samples: step 1 (epoch 0, window 0) held different samples" in proc.stdout


def test_compare_refuses_a_non_run(tmp_path):
    proc = finetune("compare", str(tmp_path), str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error: compare:")


def test_tensorboard_events_are_written(runs):
    assert list(runs["4x4"].rglob("events.out.tfevents.*"))


def test_plot_redraws_the_pngs(runs, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["4x4"], run)
    for png in run.glob("*.png"):
        png.unlink()
    proc = finetune("plot", str(run))
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "lr.png", "grad_norm.png", "memory.png"):
        assert (run / name).read_bytes()[:4] == b"\x89PNG", name


def test_ls_and_validate_cover_every_recipe(capsys):
    proc = finetune("ls")
    assert proc.returncode == 0
    listed = [line.split()[0] for line in proc.stdout.splitlines()]
    names = [n for n, _ in list_recipes()]
    assert listed == names and len(names) >= 5
    # `validate` itself in this process (a subprocess each is a Python start-up each; the command's own process,
    # exit code and stderr are test_validate_lists_every_problem's)
    for name in names:
        capsys.readouterr()
        assert main(["validate", name]) == 0
        out = capsys.readouterr()
        assert out.out.startswith(f"{name}: ok"), out.err


def test_validate_lists_every_problem():
    proc = finetune("validate", "minilm-sentiment", "--set", "training.learning_rate=-1", "--set",
                    "training.bogus=2", "--set", "model.dropout=3")
    assert proc.returncode == 2
    errors = proc.stderr.strip().splitlines()
    assert any("training.bogus: unknown key" in e for e in errors)
    assert all(e.startswith("error: ") for e in errors) and "Traceback" not in proc.stderr


def test_lr_scaling_is_applied_and_printed(tmp_path):
    proc = cli("--recipe", TINY, "--batch-size", "4", "--grad-accum-steps", "2", "--max-steps", "3", "--set",
               "training.scale_lr=sqrt", "--set", "training.reference_batch_size=32", "--set",
               "training.warmup_steps=0", "--set", "training.lr_scheduler=constant", "--output-dir",
               str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LR scaling: sqrt from the baseline's batch 32 to 8: 0.001 × 0.5" in proc.stdout
    history = [json.loads(x) for x in (tmp_path / "r" / "history.jsonl").read_text().splitlines()]
    assert all(h["lr"] == pytest.approx(0.0005) for h in history)


def test_search_runs_three_trials(tmp_path):
    out = tmp_path / "search"
    proc = finetune("search", "--recipe", TINY, "--trials", "3", "--param", "lr=loguniform:1e-4:1e-2",
                    "--param", "gradient_accumulation_steps=choice:1,2", "--set", "training.epochs=2",
                    "--set", "data.limit=48", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = json.loads((out / "best.json").read_text())
    assert len(best["trials"]) == 3 and best["metric"] == "loss" and best["direction"] == "minimize"
    finished = [t for t in best["trials"] if t["state"] == "COMPLETE"]
    assert best["value"] == min(t["value"] for t in finished)
    assert "best trial" in proc.stdout
    assert len(list(out.glob("trial-*/history.jsonl"))) == 3


def test_a_run_written_before_a_setting_existed_reads_as_its_default():
    """``training.loss_divisor`` and ``model.master_weights`` came after runs were written: a config.yaml without
    them had their defaults, and compares equal to one that says them; another value differs (control)."""
    from finetune.reproduce.update_settings import run_settings

    old = {"training": {"optimizer": "adamw"}, "model": {"dtype": "fp32"}}
    new = {"training": {"optimizer": "adamw", "loss_divisor": "items"}, "model": {"dtype": "fp32",
                                                                                  "master_weights": True}}
    assert run_settings(old) == run_settings(new)
    new["training"]["loss_divisor"] = "labels"
    assert run_settings(old) != run_settings(new)
