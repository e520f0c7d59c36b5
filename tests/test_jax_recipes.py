"""Emulated fp8 / MX / NVFP4 training in JAX (``polyamp/jax/recipe.py``): quantization against the numpy
core bit for bit, the three GEMMs against the same products of core-quantized operands, keep lists,
training under jit, and what is refused."""

import math

import numpy as np
import pytest
from frameworks import require

jax = require("jax")
import jax.numpy as jnp  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError, recipes  # noqa: E402
from polyamp.jax import recipe as jr  # noqa: E402

JAX_RECIPES = ["fp8-tensorwise", "mxfp8", "mxfp8:scale_rule=floor", "nvfp4:grad_rounding=nearest"]


def same(got, want) -> bool:
    """Bit for bit, NaN payloads aside."""
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(a)
    return a.shape == b.shape and np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes()


def wide(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, (shape[0],) + (1,) * (len(shape) - 1)))
    return x.astype(np.float32)


@pytest.mark.parametrize("amax", [0.0, 1e-45, 1e-30, 0.37, 3.5, 448.0, 6e37, 3e38, math.inf, math.nan])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("margin", [0, 3])
def test_current_scale_equals_the_core(amax, fmt, margin):
    got = jr.current_scale(jnp.float32(amax), fmt, margin)
    assert np.asarray(got).tobytes() == np.float32(recipes.current_scale(amax, fmt, margin)).tobytes()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_tensorwise_equals_the_core(fmt):
    x = wide((64, 96), 1)
    x[0, :6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42]
    for t in (x, x[1:], x[1:] * 2.0**-100, np.zeros((3, 4), np.float32)):
        amax = float(np.max(np.abs(t))) if t.size else 0.0
        want = recipes.quantize_tensorwise(t, fmt, recipes.current_scale(amax, fmt))
        assert same(jr.tensorwise(jnp.asarray(t), fmt), want)


@pytest.mark.parametrize("spec", JAX_RECIPES)
@pytest.mark.parametrize("operand", ["input", "weight", "grad"])
def test_each_operand_is_quantized_as_the_core_does(spec, operand):
    r = recipes.parse_recipe(spec)
    x = wide((64, 128), 2)
    x[3, :40] = 0.0
    for axis in (-1, 0):
        got = jr.quantize(jnp.asarray(x), r, operand, axis)
        fmt = r.backward_format if operand == "grad" else r.forward_format
        if r.kind != "block":
            want = recipes.quantize_tensorwise(x, fmt, recipes.current_scale(float(np.abs(x).max()), fmt))
        elif r.weight_2d and operand == "weight":
            want = pa.quantize_blocks(x, fmt, axis=(-2, -1), block=(16, 16))
        else:
            want = pa.quantize_blocks(x, fmt, axis=axis, scale_rule=r.scale_rule)
        assert same(got, want), (axis, operand)


@pytest.mark.parametrize("spec", JAX_RECIPES)
def test_forward_and_both_gradients_are_the_quantized_gemms(spec):
    r = recipes.parse_recipe(spec)
    x, w, g = wide((2, 16, 64), 3).reshape(2, 16, 64), wide((64, 96), 4) / 8, wide((32, 96), 5)
    f32 = jnp.float32
    fn = jr.dot(r, f32, f32, f32)
    y, vjp = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g).reshape(2, 16, 96))

    def q(a, operand, axis):
        return jnp.asarray(np.asarray(jr.quantize(jnp.asarray(a), r, operand, axis)))

    def mm(a, b):
        return jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=f32)

    block = r.kind == "block"
    x2 = x.reshape(32, 64)
    assert same(y, mm(q(x, "input", -1), q(w, "weight", 0)))
    w_dgrad = q(w, "weight", 1) if block and not r.weight_2d else q(w, "weight", 0)
    assert same(dx, mm(q(g, "grad", -1), w_dgrad.T).reshape(x.shape))
    x_wgrad = q(x2, "input", 0) if block else q(x2, "input", -1)
    g_wgrad = q(g, "grad", 0) if block else q(g, "grad", -1)
    assert same(dw, mm(x_wgrad.T, g_wgrad))


def init(dims, seed=0):
    rng = np.random.default_rng(seed)
    return {f"fc{i}": {"w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
                       "b": jnp.zeros(b, jnp.float32)}
            for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))}  # fmt: skip


def model(p, x):
    for i in range(len(p)):
        with jax.named_scope(f"fc{i}"):
            x = x @ p[f"fc{i}"]["w"] + p[f"fc{i}"]["b"]
        x = jax.nn.gelu(x) if i < len(p) - 1 else x
    return x


def loss_fn(p, x, y):
    return jnp.mean((model(p, x).astype(jnp.float32) - y) ** 2)


def test_the_keep_list_names_scopes_and_keeps_first_and_last_by_default():
    p, x = init([16, 32, 32, 32, 4]), jnp.ones((8, 16))
    closed = jax.make_jaxpr(loss_fn)(p, x, jnp.ones((8, 4)))
    assert jr.kept_layers(closed.jaxpr, ("first", "last")) == {"fc0", "fc3"}
    assert jr.kept_layers(closed.jaxpr, ("fc[12]",)) == {"fc1", "fc2"}
    assert jr.kept_layers(closed.jaxpr, ()) == set()
    with pytest.raises(PolyampError, match="matches no dense matmul's scope; their scopes: 'fc0'"):
        jr.kept_layers(closed.jaxpr, ("attn*",))
    # a two-layer model with both kept computes exactly as bf16-mixed
    small, y = init([16, 32, 4]), jnp.ones((8, 4))
    plain = pa.MixedPrecision("bf16-mixed", framework="jax").autocast(loss_fn)(small, x, y)
    kept = pa.MixedPrecision("mxfp8", framework="jax").autocast(loss_fn)(small, x, y)
    everything = pa.MixedPrecision("mxfp8:keep=", framework="jax").autocast(loss_fn)(small, x, y)
    assert float(kept) == float(plain) and float(everything) != float(plain)


@pytest.mark.parametrize("spec", JAX_RECIPES)
def test_each_recipe_trains_under_jit(spec):
    import optax

    mp = pa.MixedPrecision(spec, framework="jax")
    f = mp.autocast(loss_fn)
    p = init([16, 48, 48, 48, 4])
    opt = optax.adam(1e-2)
    s = opt.init(p)

    @jax.jit
    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(f)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    rng = np.random.default_rng(1)
    losses = []
    for _ in range(60):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        p, s, loss = step(p, s, x, np.sin(x[:, :4]))
        losses.append(float(loss))
    assert np.mean(losses[-10:]) < 0.2 * losses[0]
    assert mp.recipe == recipes.parse_recipe(spec)


def test_what_jax_does_not_run_yet_is_refused_by_name():
    with pytest.raises(PolyampError, match="amax history"):
        pa.MixedPrecision("fp8-delayed", framework="jax")
    with pytest.raises(PolyampError, match="nvfp4:grad_rounding=nearest"):
        pa.MixedPrecision("nvfp4", framework="jax")
    with pytest.raises(PolyampError, match="Hadamard"):
        pa.MixedPrecision("nvfp4:grad_rounding=nearest:hadamard=true", framework="jax")
