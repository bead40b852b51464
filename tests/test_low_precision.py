"""Low-precision frozen weights (``model.dtype``), quantized bases (``model.quantization``, bitsandbytes) and the 8-bit
optimizers: exact windows, what the loop must not touch, checkpoints, the merged export, and bad input.

The tiny chat Llama (``tests.helpers.tiny_chat_assets``) stands in for the recipe's SmolLM2; 4-bit layers are built
by transformers' ``BitsAndBytesConfig`` as a user would, and trained through ``test_fine_tuning`` and the sft recipe.
"""

import copy
import json
import subprocess
import sys

import pytest
import torch

from finetune import test_fine_tuning
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.models import precision
from finetune.models.hf import merge_adapters, precision_kwargs
from finetune.tasks import chat
from tests.helpers import (
    ENV,
    ROOT,
    SMALL,
    checkpoint_copy,
    cli,
    pad_collate,
    refused_in_process,
    rel_diff,
    same_bytes,
    sft_recipe_run,
    tiny_chat_assets,
    token_data,
    write_tiny_gguf,
)

bnb = pytest.importorskip("bitsandbytes")
RECIPE = "sft-smollm2"
NF4 = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
           bnb_4bit_compute_dtype=torch.float32)


def user_qlora(path=None, **quantization):
    """A tiny Llama (the tiny chat model unless ``path``) loaded 4-bit by the user (transformers + bitsandbytes), with
    LoRA adapters (peft)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(path or tiny_chat_assets()["model"],
                                                 quantization_config=BitsAndBytesConfig(**(quantization or NF4)))
    torch.manual_seed(0)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0))


def quantized_bytes(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if precision.is_quantized(p)}


# ---------------------------------------------------------------------------------------------------------------
# exact windows: (b, N) = (b·N, 1)


def fit(model, b, n, data, **kw):
    """``test_fine_tuning`` on ``model`` itself (trained in place)."""
    return test_fine_tuning(model, train_data=data, val_data=token_data(6, seed=5), batch_size=b,
                            gradient_accumulation_steps=n, collate_fn=pad_collate, learning_rate=0.01, n_epochs=2,
                            seed=3, eval_every=1, **kw)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_4bit_base_the_user_loaded_accumulates_exactly(optimizer):
    """22 samples in windows of 12: the last holds 10 = 3 + 3 + 3 + 1. An evaluation after every step (the model in
    eval mode without gradients, where bitsandbytes would repack its weights for inference) sits between the steps."""
    model, data = user_qlora(), token_data(22, lo=4, hi=20)
    before, mine = quantized_bytes(model), copy.deepcopy(model)
    storage = [(id(p), p.data_ptr()) for p in mine.parameters() if precision.is_quantized(p)]
    small = fit(mine, 3, 4, data, optimizer=optimizer)
    big = fit(copy.deepcopy(model), 12, 1, data, optimizer=optimizer)
    assert small["optimizer_steps"] == big["optimizer_steps"] == 4
    assert rel_diff(small["model"], big["model"], trainable_only=True) <= 1e-5
    assert small["grad_norm_history"] == pytest.approx(big["grad_norm_history"], rel=1e-5)
    assert small["loss_history"] == pytest.approx(big["loss_history"], rel=1e-5)
    assert [v["loss"] for v in small["val_history"]] == pytest.approx([v["loss"] for v in big["val_history"]],
                                                                     rel=1e-5)
    # the adapters trained, the frozen 4-bit weights are the very bytes loaded (nothing cast, copied or repacked)
    assert rel_diff(small["model"], model, trainable_only=True) > 1e-3
    after = quantized_bytes(small["model"])
    assert before and after.keys() == before.keys()
    assert all(type(p).__name__ == "Params4bit" for p in small["model"].parameters() if p.dtype == torch.uint8)
    assert same_bytes(after, before)
    assert [(id(p), p.data_ptr()) for p in small["model"].parameters() if precision.is_quantized(p)] == storage


@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")  # the repacked layer (control)
def test_bitsandbytes_cpu_repacking_would_lose_the_gradients(tmp_path):
    """Why the loop turns bitsandbytes' CPU repacking off (precision.prepare_quantized): after one forward in eval
    mode without gradients, a repacked 4-bit layer passes no gradient back to the layers before it. (The tiny chat
    model's 32-wide layers are narrower than a quantization block: repacking them fails outright.) A 64-wide Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not bnb.functional.has_avx512bf16():
        pytest.skip("bitsandbytes repacks 4-bit weights only on CPUs with AVX512-BF16")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    ids = torch.randint(1, 64, (2, 12))

    def first_layer_grad(model, prepare):
        if prepare:
            precision.prepare_quantized(model)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        grad = next(p.grad for n, p in model.named_parameters() if "layers.0." in n and "lora_B" in n)
        return 0.0 if grad is None else float(grad.abs().sum())

    assert first_layer_grad(user_qlora(tmp_path / "llama"), prepare=True) > 0
    assert first_layer_grad(user_qlora(tmp_path / "llama"), prepare=False) == 0.0  # the control: repacked, lost


def test_int8_base_accumulates_exactly():
    model, data = user_qlora(load_in_8bit=True), token_data(22, lo=4, hi=20)
    small, big = fit(copy.deepcopy(model), 3, 4, data, optimizer="sgd"), fit(model, 12, 1, data, optimizer="sgd")
    assert rel_diff(small["model"], big["model"], trainable_only=True) <= 1e-5


def test_int8_layers_keep_their_inputs_where_checkpointing_cannot_free_them():
    """Why int8 refuses training.gradient_checkpointing (and activation_offloading): bitsandbytes' 8-bit matmul keeps
    each layer's input on itself, outside autograd's saved tensors. After a checkpointed forward the inputs of the
    MLP's int8 layers (gate, up, down) are all alive; with nf4 (saved tensors only) none is."""
    import gc
    import weakref

    def mlp_inputs_alive(model):
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        precision.prepare_quantized(model)
        refs = []
        hooks = [m.register_forward_pre_hook(lambda m, args: refs.append(weakref.ref(args[0])))
                 for name, m in precision.quantized_modules(model) if ".mlp." in name]
        ids = torch.randint(1, 64, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        alive = sum(r() is not None for r in refs)
        loss.backward()
        for h in hooks:
            h.remove()
        return alive, len(refs)

    assert mlp_inputs_alive(user_qlora(load_in_8bit=True)) == (6, 6)  # 2 layers × gate, up, down
    assert mlp_inputs_alive(user_qlora()) == (0, 6)


def recipe_run(b, n, *overrides):
    """The sft recipe with LoRA on the tiny chat model: (trained model, initial adapters)."""
    result, start = sft_recipe_run(b, n, "peft.enabled=true", *overrides)
    return result["model"], start


def update_diff(a, b, start) -> float:
    """max |Δa − Δb| / max |Δb| over the adapters (Δ: the change from their initial values)."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    da = torch.cat([(pa[k].detach() - w).flatten().double() for k, w in start.items()])
    db = torch.cat([(pb[k].detach() - w).flatten().double() for k, w in start.items()])
    return float((da - db).abs().max() / db.abs().max())


@pytest.mark.parametrize("setting", [["model.quantization=nf4"], ["model.dtype=bf16"],
                                     ["model.quantization=nf4", "model.dtype=bf16"]],
                         ids=["nf4", "bf16", "nf4+bf16"])
def test_recipe_low_precision_base_windows_are_exact(setting):
    """22 conversations in windows of 9: the last holds 4 = 3 + 1. fp32 compute (no mixed precision)."""
    small, start = recipe_run(3, 3, *setting)
    big, _ = recipe_run(9, 1, *setting)
    assert start and all("lora_" in k for k in start)
    assert all(p.dtype == torch.float32 for p in small.parameters() if p.requires_grad)  # fp32 master weights
    frozen = {p.dtype for p in small.parameters() if not p.requires_grad}
    assert frozen == ({torch.uint8} if "model.quantization=nf4" in setting else set()) | \
        ({torch.bfloat16} if "model.dtype=bf16" in setting else {torch.float32})
    assert update_diff(small, big, start) <= 1e-5


def test_bf16_weights_compute_as_the_fp32_model_holding_their_values():
    """fp32 compute from bf16 frozen weights (precision.compute_in_fp32) is the fp32 model whose frozen weights are
    rounded to bf16 — the same logits to fp32 rounding; bf16 arithmetic (the model as loaded) is not."""
    from transformers import AutoModelForCausalLM

    path, ids = tiny_chat_assets()["model"], torch.randint(1, 64, (3, 16))
    rounded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False)
    for p in rounded.parameters():
        p.data = p.data.bfloat16().float()
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).requires_grad_(False)
    native = bf16(input_ids=ids).logits.float()
    assert precision.compute_in_fp32(bf16) > 0
    fp32 = bf16(input_ids=ids).logits
    reference = rounded(input_ids=ids).logits
    assert fp32.dtype == torch.float32 and rel_diff(fp32.flatten(), reference.flatten()) <= 1e-6
    assert rel_diff(native.flatten(), reference.flatten()) > 1e-3  # the control: bf16 arithmetic differs


def test_full_fine_tuning_keeps_fp32_master_weights_whatever_model_dtype(capsys):
    """In full fine-tuning every weight trains: the model loads in fp32 (no weight rounded to bf16 first) and rank 0
    says that model.dtype changed nothing; with LoRA the base loads in bf16."""
    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], "peft.enabled=false", "model.dtype=bf16"])
    capsys.readouterr()
    assert precision_kwargs(cfg) == {"dtype": torch.float32}
    assert capsys.readouterr().err.startswith("note: model.dtype=bf16 keeps frozen weights in bf16; in full "
                                              "fine-tuning every weight trains and stays an fp32 master weight")
    cfg = load_recipe(RECIPE, [*SMALL[RECIPE], "peft.enabled=true", "model.dtype=bf16"])
    assert precision_kwargs(cfg) == {"dtype": torch.bfloat16} and capsys.readouterr().err == ""


@pytest.mark.parametrize("lora,autocast", [(False, "no"), (True, "no"), (False, "bf16")],
                         ids=["full", "lora", "full-autocast"])
def test_without_master_weights_what_trains_stays_bf16(lora, autocast):
    """``model.master_weights: false`` (torchtune's dtype: bf16; TRL's bf16 full fine-tuning under autocast): the
    trained weights are bf16 — full fine-tuning's every weight, LoRA's adapters too — and the steps move them. The
    control: the default keeps them fp32."""
    for masters in (False, True):
        result, start = sft_recipe_run(2, 2, f"peft.enabled={str(lora).lower()}", "model.dtype=bf16",
                                       f"model.master_weights={str(masters).lower()}", "training.learning_rate=0.01",
                                       f"training.mixed_precision={autocast}")
        trained = dict((k, p) for k, p in result["model"].named_parameters() if p.requires_grad)
        want = torch.float32 if masters else torch.bfloat16
        assert trained and {p.dtype for p in trained.values()} == {want}, {p.dtype for p in trained.values()}
        assert any(not torch.equal(p.detach(), start[k]) for k, p in trained.items())  # the steps moved them
        if not masters:
            assert precision.describe(result["model"]).endswith("(no fp32 master weights: each step rounds to them)")
            frozen = {p.dtype for p in result["model"].parameters() if not p.requires_grad}
            assert frozen == ({torch.bfloat16} if lora else set())


def test_8bit_optimizer_is_close_to_itself_but_not_the_fp32_step():
    """(b, N) and (b·N, 1) give the same gradients to fp32 rounding; AdamW8bit's block-quantized state can round
    them to neighbouring codes, so the runs drift apart by more than fp32 rounding, yet stay far closer to each
    other than to fp32 AdamW. The 64 × 256 weight is large enough for 8-bit state (bitsandbytes keeps tensors under
    4 096 elements in fp32)."""
    from tests.helpers import MLP, regression_data

    torch.manual_seed(0)
    model, data = MLP(d_in=64, hidden=256), regression_data(41, d_in=64)

    def run(optimizer, b, n):
        return test_fine_tuning(copy.deepcopy(model), train_data=data, batch_size=b, gradient_accumulation_steps=n,
                                optimizer=optimizer, learning_rate=1e-3, n_epochs=4, seed=3, max_grad_norm=None)

    small, big, fp32 = run("adamw8bit", 3, 4), run("adamw8bit", 12, 1), run("adamw", 12, 1)
    state = small["accelerator"]._optimizers[0].state
    assert any(s.get("state1") is not None and s["state1"].dtype == torch.uint8 for s in state.values())
    apart, other = rel_diff(small["model"], big["model"]), rel_diff(big["model"], fp32["model"])
    assert apart < other / 10 and other > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# loading from every source, the merged export


def test_every_model_source_quantizes(tmp_path):
    """A directory, a GGUF file (converted to an fp32 folder first, quantized when that folder loads) and a model in a
    package (MiniLM for sentiment, whose classifier head trains in full and stays unquantized)."""
    from finetune.tasks import sentiment

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    for source in (tiny_chat_assets()["model"], str(gguf)):
        cfg = load_recipe(RECIPE, [*SMALL[RECIPE], f"model.name_or_path={source}", "model.quantization=nf4"])
        model, _ = chat.load_model(cfg.model, **precision_kwargs(cfg))
        kinds = {type(m).__name__ for m in model.modules()}
        assert "Linear4bit" in kinds and type(model.lm_head) is torch.nn.Linear, source
    cfg = load_recipe(str(ROOT / "tests" / "assets" / "tiny-sentiment.yaml"),
                      ["model.config=null", "model.quantization=int8", "peft.enabled=true", "data.limit=20"])
    model = sentiment.build(cfg).model
    assert any(type(m).__name__ == "Linear8bitLt" for m in model.modules())
    head = model.base_model.model.classifier.modules_to_save["default"]
    assert type(head) is torch.nn.Linear and head.weight.requires_grad and head.weight.dtype == torch.float32


def test_merge_dequantizes_then_adds_the_adapters_in_the_given_dtype():
    model = user_qlora()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    expected = precision.dequantized(layer.get_base_layer()) + layer.get_delta_weight("default")
    merged = merge_adapters(model, torch.bfloat16)
    assert not precision.quantized_modules(merged) and not hasattr(merged.config, "quantization_config")
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    assert torch.equal(merged.model.layers[0].self_attn.q_proj.weight, expected.bfloat16())  # one rounding


BLOCKED = "import sys; sys.modules['bitsandbytes'] = None; sys.modules['peft'] = None\n"
GENERATE = BLOCKED + """import json
from transformers import AutoModelForCausalLM, AutoTokenizer
from finetune.tasks.sft import answer
path, prompts = sys.argv[1], json.loads(sys.argv[2])
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
print(json.dumps(answer(model, tok, [tok(p, add_special_tokens=False)["input_ids"] for p in prompts], 4)))
"""


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """The sft recipe with --set model.quantization=nf4 through the CLI, with the AdamW8bit optimizer (rank 128:
    4 096-element adapters, whose state is 8-bit) and a checkpoint every 2 of its 6 steps."""
    out = tmp_path_factory.mktemp("qlora") / "run"
    proc = cli(*QLORA, "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    banner = proc.stdout.splitlines()
    assert "Optimizer: adamw8bit, lr 0.02, schedule cosine, warm-up 0 steps" in banner
    weights = next(x for x in banner if x.startswith("Weights: "))  # the 4-bit layers, the rest, the adapters
    assert weights == "Weights: frozen 20.6 k fp32 + 18.4 k nf4; trainable 131.1 k fp32"
    return out


QLORA = ["--recipe", RECIPE, *[a for s in SMALL[RECIPE] for a in ("--set", s)], "--set", "model.quantization=nf4",
         "--set", "training.optimizer=adamw8bit", "--set", "peft.r=128", "--set", "training.learning_rate=0.02",
         "--set", "training.warmup_steps=0", "--set", "data.limit=24", "--batch-size", "2", "--set",
         "training.effective_batch_size=4", "--save-every", "2", "--set", "output.plots=false", "--set",
         "output.tracker=none"]


def test_qlora_recipe_saves_adapter_and_a_merged_model_that_needs_neither_peft_nor_bitsandbytes(qlora_run):
    assert (qlora_run / "model" / "adapter_model.safetensors").is_file()
    merged = qlora_run / "model-merged"
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    triples = [json.loads(x) for x in (qlora_run / "samples.jsonl").read_text().splitlines()]
    prompts = [t["prompt"] for t in triples]
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(merged), json.dumps(prompts)], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == [t["generated"] for t in triples]  # the trained model's text
    # the control: the untrained base answers otherwise, so the merge is what made the answers equal
    untrained = subprocess.run([sys.executable, "-c", GENERATE, tiny_chat_assets()["model"], json.dumps(prompts)],
                               capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert json.loads(untrained.stdout.splitlines()[-1]) != [t["generated"] for t in triples]


def test_qlora_checkpoints_leave_the_4bit_base_out_and_resume_bit_identically(qlora_run, tmp_path):
    from safetensors.torch import load_file

    step = qlora_run / "checkpoints" / "step-000004"
    saved = load_file(str(step / "model.safetensors"))
    assert any("lora_A" in k for k in saved)
    assert not any("absmax" in k or "quant_state" in k or "q_proj.base_layer.weight" in k for k in saved)
    optimizer = torch.load(step / "optimizer.bin", weights_only=True)
    states = [s.get("__bnb_optimizer_quant_state__", s) for s in optimizer["state"].values()]  # bitsandbytes' nesting
    assert any(s.get("state1") is not None and s["state1"].dtype == torch.uint8 for s in states)  # 8-bit state

    out = checkpoint_copy(qlora_run, tmp_path / "resumed", 4)
    proc = cli(*QLORA, "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = lambda run: load_file(str(run / "model" / "adapter_model.safetensors"))  # noqa: E731
    assert same_bytes(adapter(out), adapter(qlora_run))
    strip = lambda run: [{k: v for k, v in json.loads(x).items() if k != "seconds" and not k.startswith("mem_")}
                         for x in (run / "history.jsonl").read_text().splitlines()]  # noqa: E731
    assert strip(out) == strip(qlora_run)


def test_qlora_checkpoint_of_two_processes_resumes_on_one(qlora_run, tmp_path):
    """Elastic resume: the same QLoRA + AdamW8bit run on 2 gloo processes, resumed from its step-4 checkpoint on one
    process, finishes the same windows as the one-process run, the 8-bit state carried over."""
    two = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "finetune", "run", "--processes", "2", *QLORA, "--output-dir",
                           str(two)], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = checkpoint_copy(two, tmp_path / "resumed", 4)
    proc = cli(*QLORA, "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: saved on 2 processes, continuing on 1" in proc.stderr
    history = lambda run: [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]  # noqa: E731
    assert [h["window_hash"] for h in history(out)] == [h["window_hash"] for h in history(qlora_run)]
    assert [h["loss"] for h in history(out)] == pytest.approx([h["loss"] for h in history(qlora_run)], rel=1e-4)


def test_compare_does_not_call_8bit_runs_equivalent(qlora_run, tmp_path):
    """The same recipe as (4, 1): the same windows, lr and (nearly) losses, weights apart by more than fp32 rounding.
    compare names the 8-bit optimizer, reports the weights without an fp32 verdict, and never says equivalent."""
    import shutil

    out = tmp_path / "4x1"
    proc = cli(*QLORA, "--batch-size", "4", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    compare = lambda *args: subprocess.run([sys.executable, "-m", "finetune", "compare", *map(str, args)],  # noqa
                                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    proc = compare(qlora_run, out)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and "verdict: equivalent" not in proc.stdout, proc.stdout
    assert lines[0].split()[:8] == ["ok", "settings", "the", "same", "update:", "adamw8bit", "(8-bit", "optimizer:"]
    assert any(x.startswith("ok") and "window samples" in x for x in lines)
    weights = next(x for x in lines if "weights" in x)
    assert weights.startswith("info") and "not judged: 8-bit optimizer: not the fp32 step" in weights
    assert lines[-1] == ("verdict: the same windows and schedule, loss curves close; no fp32 equivalence claimed — "
                         "adamw8bit: 8-bit optimizer: not the fp32 step")
    assert float(weights.split("largest element ")[1].split()[0]) > 1e-5  # apart by more than fp32 rounding
    strict = compare(qlora_run, out, "--rtol", "1e-5")
    assert strict.returncode == 1 and "verdict: differs — weights" in strict.stdout
    # the control: another optimizer is a difference, named first
    fp32 = tmp_path / "fp32"
    shutil.copytree(out, fp32)
    (fp32 / "config.yaml").write_text((out / "config.yaml").read_text().replace("optimizer: adamw8bit",
                                                                                "optimizer: adamw"))
    other = compare(qlora_run, fp32)
    assert other.returncode == 1 and "verdict: differs — settings: training.optimizer adamw8bit vs adamw" in \
        other.stdout


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line naming the field, exit 2, nothing written


BAD = [
    (["peft.enabled=false", "model.quantization=nf4"],
     "model.quantization: nf4 needs peft.enabled=true (the base stays frozen and LoRA adapters train on it"),
    (["model.dtype=fp8"], "model.dtype: got 'fp8'; expected 'fp32' | 'bf16' | 'fp16'"),
    (["model.quantization=int4"], "model.quantization: got 'int4'; expected 'none' | 'nf4' | 'fp4' | 'int8'"),
    (["model.dtype=fp16"], "model.dtype: fp16 weights need a CUDA device"),
    (["model.quantization=int8", "training.gradient_checkpointing=true"],
     "model.quantization: int8 layers keep their inputs outside autograd, which training.gradient_checkpointing "
     "cannot free"),
    (["training.optimizer=adamw16"], "training.optimizer: got 'adamw16'"),
    (["model.master_weights=false"], "model.master_weights: false trains the weights in model.dtype, which is fp32 "
                                     "here"),
]
WITHOUT_BITSANDBYTES = [
    (["model.quantization=nf4"], "model.quantization: nf4 needs bitsandbytes, which is not installed (pip install "
                                 "'finetune[quant]')"),
    (["training.optimizer=paged_adamw8bit"], "training.optimizer: paged_adamw8bit needs bitsandbytes, which is not "
                                             "installed (pip install 'finetune[quant]')"),
]


@pytest.mark.parametrize("overrides,message,blocked", [(*c, False) for c in BAD] + [(*c, True) for c in
                                                                                     WITHOUT_BITSANDBYTES],
                         ids=[m.split(":")[0] + f"-{i}" for i, (_, m) in enumerate(BAD + WITHOUT_BITSANDBYTES)])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, overrides, message, blocked):
    if "fp16" in message and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if blocked:  # as on a machine without bitsandbytes: importing it fails, looking it up finds nothing
        monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    out = tmp_path / "out"
    sets = [a for s in [*SMALL[RECIPE], *overrides] for a in ("--set", s)]
    refused_in_process(capsys, ["--recipe", RECIPE, *sets, "--output-dir", str(out)], message)
    assert not out.exists()


def test_new_model_from_a_config_refuses_dtype_and_quantization():
    with pytest.raises(ConfigError) as e:
        load_recipe("clm-pydoc", ["model.name_or_path=null", "model.config={model_type: gpt2, n_layer: 1}",
                                  "model.quantization=nf4", "peft.enabled=true"])
    assert e.value.problems == ["model.quantization: nf4 applies to pretrained weights (model.name_or_path); a model "
                                "built from model.config trains every weight in fp32"]


def test_full_fine_tuning_of_a_4bit_model_is_refused():
    """test_fine_tuning with a model the user quantized and gave no adapters: only its embeddings, norms and head
    would train. Refused, naming the model."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_chat_assets()["model"],
                                                 quantization_config=BitsAndBytesConfig(**NF4))
    with pytest.raises(ConfigError, match=r"model: its linear layers are quantized \(Params4bit, bitsandbytes\) and "
                                          r"cannot train, and every other weight trains \(full fine-tuning\)"):
        test_fine_tuning(model, train_data=token_data(8), batch_size=4, collate_fn=pad_collate)


def test_refusal_on_two_processes_is_one_line(tmp_path):
    """fp16 weights on a machine without CUDA, found when each process loads its model: one line, exit 2."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "run"
    sets = [a for s in [*SMALL[RECIPE], "model.dtype=fp16"] for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "finetune", "run", "--processes", "2", "--recipe", RECIPE, *sets,
                           "--output-dir", str(out)], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: model.dtype: fp16 weights need a CUDA device (CPUs lack fast "
                                                "fp16 kernels); use bf16 or fp32 on this machine"], proc.stderr[-3000:]
    assert not out.exists()
