"""Real Hugging Face models under polyamp's PyTorch front end: tiny GPT2LMHeadModel, LlamaForCausalLM and
BertForSequenceClassification built from their config classes (no downloads; dropout off so that runs
compare bit for bit): bf16-mixed equals native ``torch.autocast`` training, fp16-mixed trains, each recipe
quantizes the layers ``mp.recipe_layers`` names (GPT-2's ``Conv1D`` included), a checkpoint resumes in a
new process bit for bit, and the doctor names its rows by module path."""

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
from frameworks import require

torch = require("torch")
transformers = require("transformers")

import polyamp as pa  # noqa: E402
from polyamp.recipe_layers import RecipeWarning  # noqa: E402

KINDS = ("gpt2", "llama", "bert")
VOCAB, SEQ, BATCH = 96, 12, 2


def build(kind: str, seed: int = 0):
    """A tiny model of ``kind``: 2 layers, hidden 32, vocabulary 96, no dropout."""
    T = transformers
    torch.manual_seed(seed)
    if kind == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # fmt: skip
    if kind == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip
    return T.BertForSequenceClassification(T.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))  # fmt: skip


def batch(kind: str, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 3, (BATCH,), generator=g) if kind == "bert" else ids
    return {"input_ids": ids, "labels": labels}


def train(kind: str, model, mp, opt, steps, start: int = 0) -> list[float]:
    """``steps`` steps of ``opt`` under ``mp`` (None: native bf16 ``torch.autocast``, ``loss.backward()``)."""
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        with mp.autocast() if mp is not None else torch.autocast("cpu", torch.bfloat16):
            loss = model(**batch(kind, step)).loss
        if mp is None:
            loss.backward()
            opt.step()
        else:
            mp.backward(loss)
            assert mp.step(opt).stepped
        losses.append(loss.item())
    return losses


@functools.cache
def trained(kind: str, policy: str | None, steps: int = 3):
    """(losses, parameters) of ``steps`` steps of a fresh model under ``policy`` (None: native autocast)."""
    model = build(kind)
    mp = None
    if policy is not None:
        mp = pa.MixedPrecision(policy, framework="torch", device="cpu")
        mp.watch(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on the CPU is slow: polyamp says so
        losses = train(kind, model, mp, opt, steps)
    return losses, [p.detach().clone() for p in model.parameters()], mp, model


def matmul_names(model) -> list[str]:
    """The model's matmul modules (nn.Linear and transformers' Conv1D), in named_modules order."""
    conv1d = transformers.pytorch_utils.Conv1D
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, conv1d))]


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_mixed_trains_bit_identically_to_native_autocast(kind):
    ours, params, mp, _ = trained(kind, "bf16-mixed")
    native, native_params, _, _ = trained(kind, None)
    assert ours == native and len(ours) == 3
    assert all(torch.equal(a, b) for a, b in zip(params, native_params))
    assert mp.current_scale == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_mixed_trains_with_a_loss_scale(kind):
    losses, _, mp, _ = trained(kind, "fp16-mixed", 2)
    assert all(map(torch.isfinite, torch.tensor(losses))) and len(losses) == 2
    assert mp.current_scale == 2.0**16 and mp.state.steps == 2


@pytest.mark.parametrize("kind, recipe", [(k, "mxfp8") for k in KINDS] + [("gpt2", "fp8-delayed")])
def test_recipes_quantize_every_matmul_module_but_the_kept_ones(kind, recipe):
    losses, params, mp, model = trained(kind, recipe)
    names = matmul_names(model)
    record = mp.recipe_layers
    assert record.quantized == names[1:-1]
    assert list(record.kept) == [names[0], names[-1]]
    assert record.kept[names[0]].startswith("keep 'first'")
    assert record.kept[names[-1]].startswith("keep 'last'")
    if kind == "gpt2":  # 4 Conv1D per block: c_attn, attn.c_proj, c_fc, mlp.c_proj; lm_head a Linear
        assert len(names) == 4 * model.config.n_layer + 1 and names[-1] == "lm_head"
    _, bf16 = trained(kind, "bf16-mixed")[:2]
    assert not all(torch.equal(a, b) for a, b in zip(params, bf16))
    state = mp.state_dict()["recipe"]["state"]
    assert state["calls"] > 0
    if recipe == "fp8-delayed":  # a history per quantized layer and operand
        assert sorted(state["delayed"]) == sorted(f"{n}|{o}" for n in names[1:-1]
                                                  for o in ("input", "weight", "grad"))  # fmt: skip


def test_a_keep_pattern_keeps_the_first_block_whole():
    model = build("llama")
    mp = pa.MixedPrecision("fp8-tensorwise:keep=first|last|model.layers.0.*", framework="torch", device="cpu")
    mp.watch(model)
    names = matmul_names(model)
    block = [n for n in names if n.startswith("model.layers.0.")]
    assert len(block) == 7 and set(mp.recipe_layers.kept) == {*block, "lm_head"}
    assert mp.recipe_layers.quantized == [n for n in names if n not in block and n != "lm_head"]
    first = build("llama")
    plain = pa.MixedPrecision("fp8-tensorwise", framework="torch", device="cpu")
    plain.watch(first)
    assert "keep=first|last|model.layers.0.* keeps its whole block" in plain.recipe_layers.kept[names[0]]
    assert mp.recipe_layers.kept[block[1]] == "keep 'model.layers.0.*'"


def test_a_recipe_that_quantizes_nothing_warns():
    model = build("gpt2")
    mp = pa.MixedPrecision("mxfp8:keep=transformer.*|lm_head", framework="torch", device="cpu")
    with pytest.warns(RecipeWarning, match="quantizes no layer"):  # every matmul module kept
        mp.watch(model)
    assert not mp.recipe_layers.quantized and len(mp.recipe_layers.kept) == 9


_RESUME = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import polyamp as pa
from test_models_torch import build, train
saved = torch.load({path!r})
model = build("gpt2", seed=7)
model.load_state_dict(saved["model"])
mp = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
mp.watch(model)
mp.load_state_dict(saved["mp"])
opt = torch.optim.AdamW(model.parameters(), 1e-3)
opt.load_state_dict(saved["opt"])
losses = train("gpt2", model, mp, opt, 2, start=2)
weight = float(model.lm_head.weight.detach().double().sum()).hex()
print(json.dumps({{"losses": [float(x).hex() for x in losses], "weight": weight,
                   "recipe": mp.state_dict()["recipe"]}}))
"""


def test_a_recipe_checkpoint_resumes_bit_identically_in_a_new_process(tmp_path):
    model = build("gpt2")
    mp = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
    mp.watch(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    train("gpt2", model, mp, opt, 2)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()}, path)
    losses = train("gpt2", model, mp, opt, 2, start=2)
    script = _RESUME.format(tests=os.path.dirname(__file__), path=str(path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == [float(x).hex() for x in losses]
    assert resumed["weight"] == float(model.lm_head.weight.detach().double().sum()).hex()
    assert resumed["recipe"] == json.loads(json.dumps(mp.state_dict()["recipe"]))


def test_the_doctor_on_gpt2_names_rows_by_module_path_and_writes_its_report(tmp_path):
    model = build("gpt2")
    report = pa.doctor(model, batch("gpt2", 0), formats=("bf16", "recipe:fp8-tensorwise"))
    names = matmul_names(model)
    weights = {r.layer for r in report.rows if r.kind == "weight"}
    assert set(names[:-1]) <= weights  # lm_head's weight is wte's (tied): its row is transformer.wte
    grads = {r.layer for r in report.rows if r.kind == "grad_output"}
    assert set(names) <= grads
    measured = {(r.layer, r.kind) for r in report.rows if "recipe:fp8-tensorwise" in r.measured}
    assert {(n, "grad_output") for n in names} <= measured
    assert not any(layer.endswith(("ln_1", "ln_2", "ln_f")) and kind == "weight" for layer, kind in measured)
    assert ("transformer.h.0.ln_1", "output") in measured  # c_attn's input, filed as ln_1's output
    paths = report.write(tmp_path, plot=False)
    data = json.loads(paths["json"].read_text())
    assert {row["layer"] for row in data["rows"]} >= set(names)
    assert "transformer.h.1.mlp.c_proj" in paths["md"].read_text()
