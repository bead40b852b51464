"""GRPO (finetune/tasks/grpo.py) on the tiny chat Llama: every loss type's step at (b, N) is the step of (b·N, 1)
given the same rollouts, with a short last window and generation batches of 2 optimizer steps at N = 3; the
per-micro-batch mean the peers use is told apart; a resumed run is bit-identical; bad input is one line; the shipped
recipe takes the same steps at any micro-batch and on 2 processes; a TRL GRPOTrainer folder is imported."""

import json
import subprocess

import pytest
import torch

from finetune import steps
from finetune.loop import Reporting
from finetune.tasks import grpo
from tests.helpers import SMALL, refused_in_process, tiny_chat_assets, train_quietly

EXACT = 1e-5
# 13 prompts × 4 completions = 52 slots; a generation batch is 12 completions, 2 steps of the effective 6
# completions (3 prompts), so the epoch's last generation batch holds 1 prompt and its window 4 completions
BASE = ["peft.enabled=false", "data.count=13", "data.val_fraction=0", "training.effective_batch_size=null",
        "training.optimizer=sgd", "training.learning_rate=0.5", "training.max_grad_norm=null",
        "model.generation_batch_size=12", "model.max_completion_length=6", "training.eval_at_start=false",
        "training.epochs=1"]
EOS_BIAS = 5.0  # added to the end token's logit: completions end at varied lengths (else all run to the limit)


def end_early(job):
    """Make the tiny model stop often, so that completion lengths (the token counts) differ."""
    bias = torch.zeros(job.model.lm_head.out_features)
    bias[job.tokenizer.eos_token_id] = EOS_BIAS
    job.model.lm_head.register_forward_hook(lambda module, args, out: out + bias.to(out.dtype))


def grpo_run(b, n, *overrides, output=None, resume_from=None):
    from finetune.loading import load_recipe
    from finetune.startup import build_job

    tiny_chat_assets()
    cfg = load_recipe("grpo-smollm2", [*SMALL["grpo-smollm2"], *BASE, f"training.batch_size={b}",
                                       f"training.gradient_accumulation_steps={n}", *overrides])
    job = build_job(cfg)  # seeded, and told the run (TaskContext), as a recipe run builds it
    end_early(job)
    result = train_quietly(job, cfg.training, output, resume_from)
    weights = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    return weights, result, job


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def rollouts_of(job) -> list:
    """Every generation batch's record (the run's rollouts.jsonl)."""
    return job.checkpointed[0].log


@pytest.fixture(scope="module")
def big_batch():
    return {lt: grpo_run(6, 1, f"model.loss_type={lt}") for lt in grpo.LOSS_TYPES}


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_every_loss_type_takes_the_big_batch_step(big_batch, loss_type):
    w1, r1, job1 = big_batch[loss_type]
    w2, r2, job2 = grpo_run(2, 3, f"model.loss_type={loss_type}")  # N = 3 ≠ the 2 steps of a generation batch
    same = ("prompts", "completions", "rewards", "advantages")  # the same rollouts, to the token and the reward
    assert [{k: r[k] for k in same} for r in rollouts_of(job2)] == [{k: r[k] for k in same} for r in rollouts_of(job1)]
    lengths = {len(c) for record in rollouts_of(job1) for c in record["completions"]}
    assert len(lengths) > 2  # completions of several lengths: token counts differ per micro-batch
    assert [h["samples"] for h in r1.history][-1] == 4  # the short last window
    assert rel(w2, w1) <= EXACT
    assert [h["loss"] for h in r2.history] == pytest.approx([h["loss"] for h in r1.history], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo"])
def test_a_per_micro_batch_mean_is_told_apart(big_batch, monkeypatch, loss_type):
    """The peers' reduction: each micro-batch's mean divided by N (TRL's grpo / bnpo)."""
    monkeypatch.setattr(steps, "loss_weight", lambda items, window, processes: 1 / 3)
    w2, _, _ = grpo_run(2, 3, f"model.loss_type={loss_type}")
    assert rel(w2, big_batch[loss_type][0]) > 100 * EXACT


def test_the_loss_tolerance_of_the_two_process_check_still_catches_a_wrong_loss(big_batch):
    """tests/test_distributed.py accepts GRPO losses 1e-7 apart (they sum to about 0); 1e-6 apart is refused."""
    from tests.helpers import assert_same_history
    from tests.test_distributed import GRPO_LOSS_ABS

    history = big_batch["grpo"][1].history
    assert_same_history(history, history, loss_abs=GRPO_LOSS_ABS)
    off = [{**h, "loss": h["loss"] + 10 * GRPO_LOSS_ABS} for h in history]
    with pytest.raises(AssertionError, match="loss"):
        assert_same_history(off, history, loss_abs=GRPO_LOSS_ABS)


def test_loss_types_are_different_losses(big_batch):
    """With completions of several lengths, the four normalisations give three different steps (bnpo = dapo)."""
    w = {lt: big_batch[lt][0] for lt in grpo.LOSS_TYPES}
    assert torch.equal(w["bnpo"], w["dapo"])
    assert min(rel(w["grpo"], w["bnpo"]), rel(w["dr_grpo"], w["bnpo"]), rel(w["grpo"], w["dr_grpo"])) > 100 * EXACT


def test_resume_mid_generation_batch_is_bit_identical(tmp_path):
    """The checkpoint after step 3 falls inside a generation batch: its rollouts come back from the checkpoint."""
    out = tmp_path / "run"
    whole, _, _ = grpo_run(2, 3, "model.loss_type=grpo", "training.max_steps=6",
                           output=Reporting(dir=out, save_every=3))
    resumed, result, _ = grpo_run(2, 3, "model.loss_type=grpo", "training.max_steps=6",
                                  resume_from=out / "checkpoints" / "step-000003")
    assert result.optimizer_steps == 6 and torch.equal(resumed, whole)


def test_rollouts_are_written_and_advantages_are_group_normalised(tmp_path):
    from finetune.cli import run_main

    tiny_chat_assets()
    out = tmp_path / "run"
    code = run_main(["--recipe", "grpo-smollm2", *[x for s in SMALL["grpo-smollm2"] for x in ("--set", s)],
                     "--max-steps", "2", "--output-dir", str(out)])
    assert code == 0
    records = [json.loads(x) for x in (out / "rollouts.jsonl").read_text().splitlines()]
    assert records and {"prompts", "completions", "rewards", "advantages", "old_log_probs"} <= set(records[0])
    adv = torch.tensor(records[0]["advantages"]).view(-1, 4)
    assert adv.sum(1).abs().max() < 1e-6  # each prompt's group is centred


def test_advantages_scale_as_trl():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    group = grpo.advantages(r, 4, "group")
    assert group[:4].tolist() == pytest.approx(((r[:4] - 0.25) / (r[:4].std() + 1e-4)).tolist())
    assert group[4:].abs().max() == 0  # a group with one reward has no signal
    assert grpo.advantages(r, 4, "none")[:4].tolist() == pytest.approx((r[:4] - 0.25).tolist())


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def bad_reward_module(tmp_path, body):
    path = tmp_path / "rewards.py"
    path.write_text(body)
    return f"model.reward_funcs=[{path}:reward]"


@pytest.mark.parametrize("setting, message, when", [
    (lambda p: bad_reward_module(p, "import no_such_module\n"), "model.reward_funcs: cannot load", "set-up"),
    # found only when the rewards are first computed: the run's config.yaml and tracker folder exist by then
    (lambda p: bad_reward_module(p, "def reward(prompts, completions, **kw):\n    return [1.0]\n"),
     "returned 1 rewards for", "first step"),
    (lambda p: "model.num_generations=5", "model.num_generations: 5 does not divide the generation batch", "set-up"),
    (lambda p: "model.max_prompt_length=4", "model.max_prompt_length: prompt 0 has", "set-up"),
    # the core's refusal (Job.windows_in_order), after the task is built and before anything is written
    (lambda p: "training.shuffle=true", "training.shuffle: this task's samples must come in order", "set-up"),
    (lambda p: "training.sort_within_window=true", "training.sort_within_window: this task's samples must come in "
                                                   "order", "set-up"),
    (lambda p: "data.max_operand=0", "data.max_operand: got 0; must be an integer >= 1", "set-up"),
    # its micro-batches are rollouts generated in the run: no micro-step to measure before it (Job.unplannable)
    (lambda p: "training.batch_size=auto", "training.batch_size: auto measures micro-steps before the run, and the "
                                           "grpo task trains on the rollouts it generates", "set-up"),
])
def test_bad_input_is_one_line(capsys, tmp_path, setting, message, when):
    tiny_chat_assets()
    args = ["--recipe", "grpo-smollm2", *[x for s in SMALL["grpo-smollm2"] for x in ("--set", s)], "--set",
            setting(tmp_path), "--max-steps", "1", "--output-dir", str(tmp_path / "o")]
    refused_in_process(capsys, args, message)
    left = {p.name for p in (tmp_path / "o").iterdir()} if (tmp_path / "o").exists() else set()
    assert left <= ({"config.yaml", "finetune"} if when == "first step" else set())  # finetune/: the tracker


def test_answer_reward_pays_the_right_sum_in_any_format():
    rows = grpo.sums(40, max_operand=9)
    assert all(2 <= int(r["answer"]) <= 18 for r in rows)
    texts = ["19", "12 + 7 = 19", "The answer is 19.", "12 + 7 = 20", "12", "To solve this", "19 = 12 + 7"]
    assert grpo.answer_reward(None, texts, ["19"] * len(texts)) == [1.0, 1.0, 1.0, 0.1, 0.1, 0.0, 0.1]
    assert grpo.sum_reward(None, texts, ["19"] * len(texts)) == [1.0, 0.2, 1.0, 0.2, 0.2, 0.0, 1.0]


def test_grpo_through_test_fine_tuning():
    """The Python API trains the task's job (its hooks passed as keywords) and takes the loop's steps."""
    from finetune import test_fine_tuning
    from finetune.loading import load_recipe
    from finetune.startup import build_job

    tiny_chat_assets()
    cfg = load_recipe("grpo-smollm2", [*SMALL["grpo-smollm2"], *BASE, "training.batch_size=2",
                                       "training.gradient_accumulation_steps=3", "model.loss_type=grpo",
                                       "training.max_steps=4"])
    job = build_job(cfg)
    end_early(job)
    result = test_fine_tuning(job.model, config=cfg, train_data=job.train_data, collate_fn=job.collate_fn,
                              loss_fn=job.loss_fn, count_items=job.count_items, before_window=job.before_window)
    through_loop, _, _ = grpo_run(2, 3, "model.loss_type=grpo", "training.max_steps=4")
    assert result.optimizer_steps == 4 and len(rollouts_of(job)) == 2
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in result.model.parameters()]), through_loop)


# ---------------------------------------------------------------------------------------------------------------
# recorded rollouts: replayed, and compared


def cli_run(tmp_path, name, *sets):
    from finetune.cli import run_main

    tiny_chat_assets()
    out = tmp_path / name
    args = [x for s in [*SMALL["grpo-smollm2"], *BASE, "output.tracker=none", *sets] for x in ("--set", s)]
    assert run_main(["--recipe", "grpo-smollm2", *args, "--output-dir", str(out)]) == 0
    return out


def test_a_run_replayed_from_its_rollouts_takes_its_steps_and_compare_says_so(tmp_path):
    from finetune.reproduce.compare import compare_runs
    from finetune.reproduce.runs import read_run

    recorded = cli_run(tmp_path, "recorded", "training.batch_size=6", "training.gradient_accumulation_steps=1")
    replayed = cli_run(tmp_path, "replayed", "training.batch_size=2", "training.gradient_accumulation_steps=3",
                       f"model.rollouts={recorded / 'rollouts.jsonl'}")
    assert read_run(replayed).rollouts == read_run(recorded).rollouts
    c = compare_runs(recorded, replayed)
    by_name = {name: ok for name, ok, _, _ in c.checks}
    assert by_name["rollouts"] is True and c.equivalent, c.checks  # every layer, the loss's (floored) included

    # the loss layer's floor still catches a loss 1e-6 off where the loss is about 0 (the first step)
    history = [json.loads(x) for x in (replayed / "history.jsonl").read_text().splitlines()]
    history[0]["loss"] += 1e-6
    (replayed / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    c = compare_runs(recorded, replayed)
    assert c.first_difference is not None and c.first_difference.startswith("loss curve"), c.checks

    # the negative control: one reward changed in the record is a different run, and compare names the rollouts
    records = [json.loads(x) for x in (recorded / "rollouts.jsonl").read_text().splitlines()]
    records[1]["rewards"][0] += 1.0
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in records))
    other = cli_run(tmp_path, "other", "training.batch_size=2", "training.gradient_accumulation_steps=3",
                    f"model.rollouts={tampered}")
    c = compare_runs(recorded, other)
    assert c.first_difference is not None and c.first_difference.startswith("rollouts")


def test_plan_refuses_a_task_whose_micro_steps_are_made_in_the_run(capsys):
    """``finetune plan`` of the grpo recipe: one line naming why (its rollouts), exit 2, with or without
    ``--model-config``."""
    from tests.helpers import ROOT, assert_one_error_line, cli_in_process

    tiny_chat_assets()
    tiny = [x for s in SMALL["grpo-smollm2"] for x in ("--set", s)]
    for extra in ([], ["--model-config", str(ROOT / "tests" / "assets" / "llama-3.1-8b")]):
        code, said = cli_in_process(capsys, "plan", "--recipe", "grpo-smollm2", *tiny, "--gpu", "8GiB", *extra)
        assert code == 2, said[-2000:]
        assert_one_error_line(said, "plan: the grpo task trains on the rollouts it generates during the run")


def test_rollouts_that_do_not_fit_the_run_are_refused(capsys, tmp_path):
    recorded = cli_run(tmp_path, "recorded", "training.batch_size=6", "training.gradient_accumulation_steps=1")
    args = ["--recipe", "grpo-smollm2", *[x for s in [*SMALL["grpo-smollm2"], *BASE, "training.batch_size=6",
                                                      "training.gradient_accumulation_steps=1", "training.seed=7",
                                                      f"model.rollouts={recorded / 'rollouts.jsonl'}"]
                                          for x in ("--set", s)], "--output-dir", str(tmp_path / "o")]
    refused_in_process(capsys, args, "model.rollouts: ")


MOVED = ("note: training.rollouts moved to model.rollouts; the old key still works in this release and will be "
         "removed in a later one")


def test_training_rollouts_still_replays_with_a_note_and_model_rollouts_is_silent(capsys, tmp_path):
    """The key's old place works for a release: the same replay as model.rollouts, one note on stderr."""
    from finetune.reproduce.runs import read_run
    from tests.helpers import load_weights, same_bytes

    layout = ("training.batch_size=6", "training.gradient_accumulation_steps=1", "training.max_steps=2")
    recorded = cli_run(tmp_path, "recorded", *layout)
    path = recorded / "rollouts.jsonl"
    capsys.readouterr()
    old = cli_run(tmp_path, "old", *layout, f"training.rollouts={path}")
    assert [x for x in capsys.readouterr().err.splitlines() if "training.rollouts" in x] == [MOVED]
    new = cli_run(tmp_path, "new", *layout, f"model.rollouts={path}")
    assert "training.rollouts" not in capsys.readouterr().err
    assert read_run(old).rollouts == read_run(new).rollouts == read_run(recorded).rollouts
    assert same_bytes(load_weights(old), load_weights(new))
    assert read_run(old).config["model"]["rollouts"] == str(path)  # the run records the new key


def test_rollouts_in_both_places_are_carried_when_equal_and_refused_in_one_line_when_not(tmp_path):
    from finetune.loading import load_recipe
    from tests.helpers import assert_one_error_line, cli

    cfg = load_recipe("grpo-smollm2", ["training.rollouts=a.jsonl", "model.rollouts=a.jsonl"])
    assert cfg.model.rollouts == "a.jsonl" and cfg.notes == [MOVED]
    assert load_recipe("grpo-smollm2", ["model.rollouts=a.jsonl"]).notes == []
    proc = cli("--recipe", "grpo-smollm2", "--set", "training.rollouts=a.jsonl", "--set", "model.rollouts=b.jsonl",
               "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_error_line(proc.stderr, "model.rollouts: 'b.jsonl' here and 'a.jsonl' in training.rollouts, its old "
                                       "place; give model.rollouts only")
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# the shipped recipe at any micro-batch: the generation batch is the recipe's, not N's


def shipped(*sets) -> list:
    """The shipped recipe on the tiny model, as shipped but for the model and data size: its effective batch (16)
    and generation batch (32) are its own. 24 prompts × 4 completions: 6 steps, 3 generation batches."""
    ours = [s for s in SMALL["grpo-smollm2"] if not s.startswith(("training.batch_size", "training.effective"))]
    return [x for s in [*ours, "output.tracker=none", "training.eval_at_start=false", "model.dropout=0", *sets]
            for x in ("--set", s)]


def shipped_run(tmp_path, name, batch_size, *sets):
    from finetune.cli import run_main

    tiny_chat_assets()
    out = tmp_path / name
    code = run_main(["--recipe", "grpo-smollm2", *shipped(*sets), "--batch-size", str(batch_size), "--max-steps",
                     "4", "--output-dir", str(out)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def shipped_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shipped")
    return folder, {b: shipped_run(folder, f"b{b}", b) for b in (16, 8, 4, 2)}


@pytest.mark.parametrize("b", [8, 4, 2])
def test_the_shipped_recipe_takes_the_same_steps_at_any_micro_batch(shipped_runs, b):
    from finetune.reproduce.compare import compare_runs
    from finetune.reproduce.runs import read_run

    _, runs = shipped_runs
    records = read_run(runs[b]).rollouts
    assert len(records) == 2 and all(len(r["completions"]) == 32 for r in records)  # 4 steps, 2 of 16 each
    c = compare_runs(runs[16], runs[b])
    assert c.equivalent, c.checks


def test_the_shipped_recipe_on_two_processes_takes_the_same_steps(shipped_runs):
    from finetune.reproduce.compare import compare_runs
    from tests.helpers import ACCELERATE, ENV, ROOT, RUN

    folder, runs = shipped_runs
    out = folder / "two"
    proc = subprocess.run([ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" /
                                                                        "multi_cpu_2.yaml"),
                           "--main_process_port", "29541", RUN, "--recipe", "grpo-smollm2", *shipped(),
                           "--batch-size", "4", "--max-steps", "4", "--output-dir", str(out)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generation batch 32 completions (model.generation_batch_size)" in proc.stdout
    assert "Effective batch size: 16 (4 × 2 × 2 processes)" in proc.stdout
    c = compare_runs(runs[16], out)
    assert c.equivalent, c.checks


def test_another_generation_batch_is_another_run(shipped_runs):
    """The negative twin: the same layout with generation batches of 16 (one step each) reads "differs" at the
    rollouts."""
    from finetune.reproduce.compare import compare_runs
    from finetune.reproduce.runs import read_run

    folder, runs = shipped_runs
    other = shipped_run(folder, "gbs16", 4, "model.generation_batch_size=16")
    assert [len(r["completions"]) for r in read_run(other).rollouts] == [16] * 4
    c = compare_runs(runs[16], other)
    by_name = {name: ok for name, ok, _, _ in c.checks}
    assert not c.equivalent and by_name["rollouts"] is False, c.checks
    assert c.first_difference == "settings: model.generation_batch_size 32 vs 16", c.first_difference


@pytest.mark.parametrize("setting, message", [
    ("model.generation_batch_size=24", "model.generation_batch_size: 24 completions (model.generation_batch_size) "
                                       "is not a multiple of the effective batch of 16"),
    ("model.steps_per_generation=2", "model.steps_per_generation: replaced by model.generation_batch_size, in "
                                     "completions"),
    ("model.generation_batch_size=0", "model.generation_batch_size: got 0; must be an integer >= 1"),
])
def test_a_generation_batch_that_does_not_fit_is_one_line(capsys, tmp_path, setting, message):
    tiny_chat_assets()
    refused_in_process(capsys, ["--recipe", "grpo-smollm2", *shipped(setting), "--max-steps", "1", "--output-dir",
                                str(tmp_path / "o")], message)
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------------------------
# import of a TRL GRPOTrainer folder


def train_trl_grpo(out, data) -> None:
    """A TRL 1.16 GRPOTrainer run on the tiny model: 4 × 2 (effective 8 completions), steps_per_generation 4 micro-
    batches (a generation batch of 16), settings away from the recipe's, one the grpo task has no counterpart for."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model_dir = tiny_chat_assets()["model"]
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      steps_per_generation=4, num_generations=4, max_completion_length=5, num_iterations=2,
                      loss_type="bnpo", scale_rewards="batch", epsilon=0.25, epsilon_high=0.3, beta=0.04,
                      temperature=0.9, top_p=0.95, mask_truncated_completions=True, max_steps=2, learning_rate=1e-3,
                      report_to=[], save_strategy="no", logging_steps=1, seed=3, use_cpu=True, disable_tqdm=True,
                      bf16=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                          reward_funcs=[grpo.answer_reward], args=args,
                          train_dataset=load_dataset("json", data_files=data)["train"],
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    trainer.save_model()
    trainer.save_state()


def test_import_of_a_trl_grpo_folder_carries_its_generation_batch_and_loss(tmp_path, capsys):
    import yaml

    from finetune.cli import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in grpo.sums(16, seed=5, max_operand=9)))
    baseline = tmp_path / "trl-grpo"
    train_trl_grpo(baseline, str(data))
    recipe = tmp_path / "imported.yaml"
    capsys.readouterr()
    assert main(["import", str(baseline), "--recipe", "grpo-smollm2", "--data", str(data), "--model",
                 tiny_chat_assets()["model"], "-o", str(recipe)]) == 0
    table = capsys.readouterr().out
    m, t = (yaml.safe_load(recipe.read_text().split("\n", 2)[2])[k] for k in ("model", "training"))
    # 4 per device × 1 process × 4 micro-batches: 16 completions, two optimizer steps of 8
    assert m["generation_batch_size"] == 16 and t["effective_batch_size"] == 8
    assert {k: m[k] for k in ("num_generations", "num_iterations", "loss_type", "scale_rewards", "epsilon",
                              "epsilon_high", "beta", "temperature", "top_p", "max_completion_length")} == {
        "num_generations": 4, "num_iterations": 2, "loss_type": "bnpo", "scale_rewards": "batch", "epsilon": 0.25,
        "epsilon_high": 0.3, "beta": 0.04, "temperature": 0.9, "top_p": 0.95, "max_completion_length": 5}
    assert m["use_bias_correction_kl"] is True  # TRL 1.16's default, written by its arguments
    assert "not carried: mask_truncated_completions=True" in table
    assert "not carried: the sampler's draws" in table and "not carried: the reward functions" in table
    # the imported recipe runs at another micro-batch with the baseline's generation batch
    capsys.readouterr()
    assert main(["run", "--recipe", str(recipe), "--batch-size", "2", "--max-steps", "2", "--output-dir",
                 str(tmp_path / "mine"), "--set", "output.tracker=none", "--set", "training.eval_at_start=false"]) == 0
    assert "generation batch 16 completions (model.generation_batch_size) for 2 × 2 optimizer steps" in \
        capsys.readouterr().out


def test_import_names_a_loss_type_the_task_does_not_have(tmp_path):
    from finetune.reproduce.importer import Request, import_recipe

    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                "num_generations": 4, "loss_type": "cispo", "generation_batch_size": 8,
                                "learning_rate": 1e-6}))
    raw, imported, _ = import_recipe(args, Request("grpo-smollm2", model=tiny_chat_assets()["model"]))
    assert "loss_type" not in raw["model"] or raw["model"]["loss_type"] == "dapo"  # the recipe's kept
    assert any(line.startswith("not carried: loss_type=cispo") for line in imported.lines())
    assert raw["model"]["generation_batch_size"] == 8


def test_the_kl_is_bias_corrected_as_trl_by_default():
    """TRL 1.16 multiplies each token's KL by its ratio (use_bias_correction_kl): on-policy the value is the same,
    the gradient gains the KL itself; off, the plain k3 gradient."""
    from finetune.loading import load_recipe

    def grads(correct: bool):
        m = load_recipe("grpo-smollm2", ["model.beta=0.5", f"model.use_bias_correction_kl={str(correct).lower()}"])
        logps = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
        ref = torch.tensor([[-1.5, -1.0, -0.7]])
        loss, kl, _ = grpo.token_losses(m.model, logps, logps.detach(), ref, torch.zeros(1, 1))
        loss.sum().backward()
        return loss.detach(), kl.detach(), logps.grad

    (on, kl_on, g_on), (off, kl_off, g_off) = grads(True), grads(False)
    assert torch.equal(on, off) and torch.equal(kl_on, kl_off)
    assert torch.allclose(g_on - g_off, 0.5 * kl_off)  # d(kl·ratio)/dlogp = dkl + kl at ratio 1
