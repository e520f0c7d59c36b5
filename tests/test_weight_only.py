"""Weight-only inference forms: the core's codes (numpy), torch's quantize_weights on tiny Hugging Face
models (what was stored low and what was kept, the bytes, the logits, the export) and JAX's on a flax
model under jit."""

from __future__ import annotations

import numpy as np
import pytest

import polyamp as pa
from polyamp import weight_forms
from polyamp.numerics import xp

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from polyamp.jax import dequantize_weights  # noqa: E402
from polyamp.jax import quantize_weights as jax_quantize_weights  # noqa: E402
from polyamp.jax import xp as jax_xp  # noqa: E402
from polyamp.torch import LowWeightLinear, quantize_weights  # noqa: E402
from polyamp.torch import xp as torch_xp  # noqa: E402

BYTES = {"bf16": 0.5, "fp16": 0.5, "int8": 0.25, "fp8": 0.25, "nvfp4": 0.5625 / 4, "mxfp4": 0.53125 / 4}


@pytest.mark.parametrize("form", weight_forms.FORMS)
def test_forms_decode_as_defined_with_their_bytes(form):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((96, 512)) * np.logspace(-3, 1, 96)[:, None]).astype(np.float32)
    w[3] = 0
    stored = weight_forms.encode(w, form, axis=-1)
    got = weight_forms.decode(xp, stored, form, w.shape, axis=-1)
    if form in ("nvfp4", "mxfp4"):
        assert np.array_equal(got, pa.quantize_blocks(w, form, axis=-1))
    elif form in ("bf16", "fp16"):
        assert np.array_equal(got, pa.quantize(w, form).astype(np.float32))
    else:
        top = 127 if form == "int8" else 448
        s = np.abs(w).max(axis=1, keepdims=True) / np.float32(top)
        s[3] = 1
        q = np.rint(w / s) if form == "int8" else pa.quantize(np.clip(w / s, -448, 448), "e4m3fn")
        assert np.array_equal(got, (q * s).astype(np.float32))
    per_channel = 4 * 96 if form in ("int8", "fp8") else 4 if form == "nvfp4" else 0
    assert weight_forms.nbytes(stored) == BYTES[form] * 4 * w.size + per_channel  # BYTES: of float32's
    other = weight_forms.encode(w.T.copy(), form, axis=0)  # the input axis first (flax's kernels)
    assert np.array_equal(weight_forms.decode(xp, other, form, w.T.shape, axis=0), got.T)


def test_bad_forms_and_weights_are_one_clear_error_each():
    with pytest.raises(pa.PolyampError, match="unknown weight-only form 'int4'"):
        weight_forms.check_form("int4")
    with pytest.raises(pa.PolyampError, match="2 or more axes"):
        weight_forms.encode(np.zeros(8, np.float32), "int8")
    with pytest.raises(pa.PolyampError, match="found no nn.Linear"):
        quantize_weights(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3)), "int8")
    with pytest.raises(pa.PolyampError, match="keep names 'nope'"):
        quantize_weights(torch.nn.Sequential(torch.nn.Linear(4, 4)), "int8", keep="nope")


def _llama(seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32)).eval()  # fmt: skip


# the logits' largest error relative to their largest value, per form (float32 is the reference)
TOLERANCE = {"bf16": 0.02, "fp16": 0.005, "int8": 0.03, "fp8": 0.1, "nvfp4": 0.4, "mxfp4": 0.5}


@pytest.mark.parametrize("form", weight_forms.FORMS)
def test_torch_llama_stores_every_linear_low_and_exports(tmp_path, form):
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    model = _llama()
    with torch.no_grad():
        ref = model(ids).logits
    record = quantize_weights(model, form, keep=("model.layers.1.mlp.down_proj",))
    linears = [n for n, m in _llama().named_modules() if isinstance(m, torch.nn.Linear)]
    assert set(record.quantized) == set(linears) - {"model.layers.1.mlp.down_proj"}
    assert record.kept["model.layers.1.mlp.down_proj"] == "named in keep"
    assert record.kept["model.embed_tokens"].startswith("a Embedding")
    assert all(isinstance(model.get_submodule(n), LowWeightLinear) for n in record.quantized)
    with torch.no_grad():
        got = model(ids).logits
    err = float((got - ref).abs().max() / ref.abs().max())
    assert 0 < err < TOLERANCE[form], err
    low = sum(m.weight.numel() for n, m in _llama().named_modules() if n in record.quantized)
    stored = sum(b.nbytes for n, b in model.named_buffers() if ".w_" in n)
    assert stored <= (BYTES[form] + 0.07) * 4 * low  # + the per-channel scales of 64-wide rows
    path = tmp_path / "low.pt"
    torch.save(model.state_dict(), path)
    fresh = _llama(seed=5)
    quantize_weights(fresh, form, keep=("model.layers.1.mlp.down_proj",))
    fresh.load_state_dict(torch.load(path))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, got)
    w = model.get_submodule("model.layers.0.self_attn.q_proj")
    values = weight_forms.decode(torch_xp, {n: getattr(w, f"w_{n}") for n in w._names}, form, (64, 64))
    assert torch.equal(w.weight_value(), values)


def test_torch_gpt2_records_its_conv1d_layers_as_kept():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0))  # fmt: skip
    record = quantize_weights(model, "int8")
    assert set(record.quantized) == {"lm_head"}
    assert record.kept["transformer.h.0.attn.c_attn"] == "a Conv1D: weight-only forms cover nn.Linear"


@pytest.mark.parametrize("form", ["int8", "nvfp4"])
def test_jax_flax_kernels_stored_low_and_decoded_under_jit(form):
    linen = pytest.importorskip("flax.linen")

    class MLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(16)(linen.relu(linen.Dense(64)(x)))

    model, x = MLP(), jnp.asarray(np.random.default_rng(0).standard_normal((8, 48)), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)
    low, record = jax_quantize_weights(params, form)
    assert sorted(record.quantized) == ["['params']['Dense_0']['kernel']", "['params']['Dense_1']['kernel']"]
    assert all("1-D" in why for why in record.kept.values()) and len(record.kept) == 2
    kernel = params["params"]["Dense_0"]["kernel"]
    stored = weight_forms.encode(np.asarray(kernel), form, axis=0)
    arrays = {k: jnp.asarray(v) for k, v in stored.items()}
    want = weight_forms.decode(jax_xp, arrays, form, kernel.shape, axis=0)
    got = jax.jit(dequantize_weights)(low)["params"]["Dense_0"]["kernel"]
    assert np.array_equal(np.asarray(got), np.asarray(want))
    y = jax.jit(lambda low, x: model.apply(dequantize_weights(low), x))(low, x)
    ref = model.apply(params, x)
    err = float(jnp.abs(y - ref).max() / jnp.abs(ref).max())
    assert 0 < err < TOLERANCE[form]
    assert record.bytes_after < (0.3 if form == "int8" else 0.2) * record.bytes_before


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_compare_trainers_infer_with_a_weights_option(framework):
    """``bf16-mixed:weights=int8`` trains as bf16-mixed and infers on int8 weight-only forms: compare's
    inference rows read those bytes and outputs."""
    import importlib

    from polyamp.compare.workloads import get_workload

    module = importlib.import_module(f"polyamp.compare.{framework}")
    wl = get_workload("mlp", quick=True)
    plain, low = module.Trainer(wl, "bf16-mixed"), module.Trainer(wl, "bf16-mixed:weights=int8")
    for i in range(3):
        assert plain.step(i) == low.step(i)  # the option changes inference only
    x = wl.batch_at(0)[0]
    ref, got = plain.infer(x), low.infer(x)
    assert 0 < np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert "int8" in low.inference_form
    weights = low.memory()["inference_weights"]
    base = module.Trainer(wl, "float32").memory()["inference_weights"]
    assert weights < 0.3 * base, (weights, base)
