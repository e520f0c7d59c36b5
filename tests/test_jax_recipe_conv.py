"""Emulated fp8 / MX / NVFP4 training of JAX convolutions (``polyamp/jax/recipe_conv.py``): stateful
recipes' seeds and delayed scales against ``lax.conv_general_dilated`` and its VJP at operands the numpy
core quantizes (blocked axes moved last), keep lists, and a small CNN (the stateless forward and both
gradients: ``test_recipe_conv_frameworks.py``)."""

import numpy as np
import pytest
from frameworks import require
from test_jax_recipes import same, wide

jax = require("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import recipes  # noqa: E402
from polyamp.jax import recipe as jr  # noqa: E402
from polyamp.jax import recipe_state as rs  # noqa: E402
from polyamp.jax.recipe_conv import conv  # noqa: E402
from polyamp.numerics import hadamard_tiles  # noqa: E402

F32 = jnp.float32
NHWC = ("NHWC", "HWIO", "NHWC")
# flax's layout; and NCHW/OIHW with stride 2, uneven padding, dilation and two feature groups
CASES = {
    "nhwc": ((3, 6, 7, 40), (3, 3, 40, 48), {"window_strides": (1, 1), "padding": "SAME",
                                             "dimension_numbers": ("NHWC", "HWIO", "NHWC")}),
    "nchw-groups": ((5, 32, 9, 8), (40, 16, 3, 2), {"window_strides": (2, 2), "padding": ((1, 2), (0, 1)),
                                                     "rhs_dilation": (1, 2), "feature_group_count": 2,
                                                     "dimension_numbers": ("NCHW", "OIHW", "NCHW")}),
}  # fmt: skip


def operands(case, seed):
    xs, ws, kw = CASES[case]
    x, w = wide(xs, seed), wide(ws, seed + 1) / 8
    y = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kw), x, w)
    return x, w, wide(y.shape, seed + 2), kw


def params(x, w, kw):
    """The ``conv_general_dilated`` equation's parameters, as autocast hands them to ``conv``."""
    (eqn,) = jax.make_jaxpr(lambda a, b: lax.conv_general_dilated(a, b, **kw))(x, w).jaxpr.eqns
    return eqn.params


def core_q(r, a, operand, axes, seed=None, scale=None):
    """The numpy core's quantization of operand ``a``: blocks along ``axes`` moved last."""
    grad = operand == "grad"
    fmt = r.backward_format if grad else r.forward_format
    rounding = r.grad_rounding if grad else r.forward_rounding
    if r.kind != "block":
        if scale is None:
            scale = recipes.current_scale(float(np.abs(a).max()), fmt, r.margin)
        return recipes.quantize_tensorwise(a, fmt, scale, rounding, seed)
    last = tuple(range(-len(axes), 0))
    moved = np.moveaxis(a, axes, last)
    two_d = len(axes) == 2
    q = pa.quantize_blocks(moved, fmt, axis=last if two_d else -1, block=(16, 16) if two_d else None,
                           scale_rule=r.scale_rule, rounding=rounding, seed=seed)  # fmt: skip
    return np.moveaxis(q, last, axes)


def reference(r, x, w, g, kw, calls=0, n=1, j=0, scales=(None, None, None)):
    """y, dx, dW: ``lax.conv_general_dilated`` and ``jax.vjp`` of it at core-quantized operands, with the
    seeds of conv ``j`` of ``n`` quantized layers in a step starting at ``calls``."""
    forward, per = rs.calls_per_matmul(r)
    seeds = iter(range(calls + forward * j + 1, 2**64))
    back = iter(range(calls + forward * n + per * (n - 1 - j) + 1, 2**64))
    lhs, rhs, out = lax.conv_dimension_numbers(x.shape, w.shape, kw["dimension_numbers"])
    sx, sw, sg = scales

    def convolve(a, b):
        return lax.conv_general_dilated(jnp.asarray(a), jnp.asarray(b), **kw)

    xq = core_q(r, x, "input", (lhs[1],), next(seeds), sx)
    wq = core_q(r, w, "weight", (rhs[0], rhs[1]) if r.weight_2d else (rhs[1],), next(seeds), sw)
    if r.kind == "block":
        gq = core_q(r, g, "grad", (out[1],), next(back))
        w_op = wq if r.weight_2d else core_q(r, w, "weight", (rhs[0],), next(back))
        gm, xm = (hadamard_tiles(g, out[0]), hadamard_tiles(x, lhs[0])) if r.hadamard else (g, x)
        g_op = core_q(r, gm, "grad", (out[0],), next(back))
        x_op = core_q(r, xm, "input", (lhs[0],), next(back))
    else:
        gq = g_op = core_q(r, g, "grad", (), next(back), sg)
        w_op, x_op = wq, xq
    dx = jax.vjp(lambda a: convolve(a, w_op), x)[1](jnp.asarray(gq))[0]
    dw = jax.vjp(lambda b: convolve(x_op, b), w)[1](jnp.asarray(g_op))[0]
    return convolve(xq, wq), dx, dw


# NVFP4 once (each compiles slowly): 16x16 kernel tiles, stochastic gradients and Hadamard tiles along
# the batch axes (the 1-d kernel's extra input-gradient operand: MX's in test_recipe_conv_frameworks.py,
# with a matmul's seeds in test_jax_recipes.py); delayed scales; per-tensor stochastic gradients
STATEFUL = [("nvfp4:hadamard=true", "nchw-groups"), ("fp8-delayed:margin=1", "nhwc"),
            ("fp8-tensorwise:grad_rounding=stochastic", "nchw-groups")]  # fmt: skip


@pytest.mark.parametrize(("spec", "case"), STATEFUL)
def test_a_stateful_convolution_takes_a_matmuls_seeds_and_scales(spec, case):
    """Conv 1 of 3 quantized layers, the counter wrapping within the step: the seeds ``calls + position``
    of a dense matmul in its place; a delayed recipe's scales, and its amaxes as their cotangents."""
    r = recipes.parse_recipe(spec)
    x, w, g, kw = operands(case, 13)
    calls, n, j = 2**32 - 9, 3, 1
    run = rs.Run(r, jnp.uint32(calls), {})
    run.count, run.closed = n, True
    scales = (np.float32(16.0), np.float32(2.0), np.float32(0.5)) if r.kind == "delayed" else (None,) * 3
    fn = conv(r, F32, F32, F32, params(x, w, kw), run, j)
    svals = [jnp.float32(1.0 if s is None else s) for s in scales]

    @jax.jit
    def forward_and_back(x, w, g, c):
        y, vjp = jax.vjp(lambda a, b, *s: fn(a, b, *s, c), x, w, *svals)
        return y, *vjp(g)

    y, dx, dw, *amaxes = forward_and_back(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g), jnp.uint32(calls))
    want = reference(r, x, w, g, kw, calls, n, j, scales)
    assert same(y, want[0]) and same(dx, want[1]) and same(dw, want[2])
    if r.kind == "delayed":
        assert [float(a) for a in amaxes] == [float(np.abs(t).max()) for t in (x, w, g)]


def test_delayed_convolution_steps_are_the_cores_step_for_step():
    """One quantized convolution through ``mp.value_and_grad``: each step's output and weight gradient
    from the core's DelayedScaling scales, which then take the step's amaxes (up to XLA's summation
    order under jit)."""
    r = recipes.parse_recipe("fp8-delayed:history_len=3:keep=:compute_dtype=fp32")
    mp = pa.MixedPrecision(r, framework="jax")
    x0, w, c, kw = operands("nhwc", 20)

    def loss(w, x, c):
        y = lax.conv_general_dilated(x, w, **kw)
        return jnp.sum(y * c), y

    f = mp.autocast(loss)
    step = jax.jit(lambda w, x, c, state: mp.value_and_grad(f, has_aux=True)(w, x, c, state=state))
    state = mp.init()
    ds = {op: rs.delayed_config(r, op) for op in rs.OPERANDS}
    for k in range(3):
        x = x0 * np.float32(1e3 if k == 1 else 1.0 + k)
        ((_, y), dw), _, state = step(jnp.asarray(w), jnp.asarray(x), jnp.asarray(c), state)
        want_y, _, want_dw = reference(r, x, w, c, kw, scales=[ds[op].scale for op in rs.OPERANDS])
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * float(np.abs(want_y).max()))
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5 * float(np.abs(want_dw).max()))
        for op, t in zip(rs.OPERANDS, (x, w, c)):
            ds[op].update(float(np.abs(t).max()))
            e = state.recipe.delayed[f"|{op}"]
            assert float(e["scale"]) == float(ds[op].scale) and same(e["history"], ds[op].history), (k, op)


# -- layers: keep lists, eligibility, a small CNN ---------------------------------------------------------
def cnn_init(seed=0):
    rng = np.random.default_rng(seed)

    def he(*shape):
        return jnp.asarray(rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[:-1])), F32)

    return {"conv0": he(3, 3, 3, 32), "conv1": he(3, 3, 32, 32), "fc": he(32, 4)}


def cnn(p, x):
    dn = NHWC
    with jax.named_scope("conv0"):
        h = jax.nn.relu(lax.conv_general_dilated(x, p["conv0"], (1, 1), "SAME", dimension_numbers=dn))
    with jax.named_scope("conv1"):
        h = lax.conv_general_dilated(h, p["conv1"], (2, 2), "SAME", dimension_numbers=dn)
    with jax.named_scope("fc"):
        return jnp.mean(h, axis=(1, 2)) @ p["fc"]


def cnn_loss(p, x, y):
    return jnp.mean((cnn(p, x).astype(F32) - y) ** 2)


def cnn_batches(n, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.standard_normal((16, 8, 8, 3)).astype(np.float32)
        yield x, np.tanh(x[:, :4, 0, 0] + x[:, 0, :4, 1])


def test_first_and_last_count_convolutions_and_a_kept_convolution_runs_as_bf16():
    p, (x, y) = cnn_init(), next(cnn_batches(1))
    closed = jax.make_jaxpr(cnn_loss)(p, x, y)
    assert jr.kept_layers(closed.jaxpr, ("first", "last")) == {"conv0", "fc"}
    assert jr.kept_layers(closed.jaxpr, ("conv*",)) == {"conv0", "conv1"}

    def first_conv(p, x):
        with jax.named_scope("conv0"):
            return lax.conv_general_dilated(x, p["conv0"], (1, 1), "SAME", dimension_numbers=NHWC)

    def under(policy):
        return jax.jit(pa.MixedPrecision(policy, framework="jax").autocast(first_conv))(p, x)

    plain = under("bf16-mixed")
    assert same(under("mxfp8:keep=conv0"), plain) and same(under("mxfp8"), plain)  # the first layer kept
    assert not same(under("mxfp8:keep="), plain)


def test_only_convolutions_without_batch_groups_of_narrow_floats_are_quantized():
    x, w = jnp.ones((2, 4, 4, 8)), jnp.ones((3, 3, 8, 8))

    def eqn(a, b, **kw):
        f = jax.make_jaxpr(lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", **kw))
        return f(a, b).jaxpr.eqns[0]

    dn = {"dimension_numbers": ("NHWC", "HWIO", "NHWC")}
    assert jr.eligible(eqn(x, w, **dn)) and jr.eligible(eqn(x, w[:, :, :4], feature_group_count=2, **dn))
    assert jr.eligible(eqn(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), **dn))
    assert not jr.eligible(eqn(x, w, batch_group_count=2, **dn))
    assert not jr.eligible(eqn(x.astype(jnp.int32), w.astype(jnp.int32), **dn))
    with jax.enable_x64(True):
        assert not jr.eligible(eqn(x.astype(jnp.float64), w.astype(jnp.float64), **dn))


def test_a_small_cnn_trains_with_mxfp8():
    import optax

    mp = pa.MixedPrecision("mxfp8", framework="jax")  # conv1 quantized, the first and last layers kept
    f, opt, p = mp.autocast(cnn_loss), optax.adam(3e-3), cnn_init()
    s = opt.init(p)

    @jax.jit
    def step(p, s, x, y):
        loss, grads = jax.value_and_grad(f)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for x, y in cnn_batches(8):
        p, s, loss = step(p, s, x, y)
        losses.append(float(loss))
    assert np.mean(losses[-3:]) < 0.7 * losses[0], losses


def test_a_stateful_cnn_step_counts_each_convolution_as_a_matmul():
    mp = pa.MixedPrecision("fp8-tensorwise:grad_rounding=stochastic:keep=", framework="jax")
    f, p, state = mp.autocast(cnn_loss), cnn_init(), mp.init()
    step = jax.jit(lambda p, x, y, state: mp.value_and_grad(f)(p, x, y, state=state))
    data = list(cnn_batches(2))
    (_, g1), _, state = step(p, *data[0], state)
    (_, g2), _, state = step(p, *data[0], state)
    # three quantized layers (two convolutions, one dense) per step; another step, other seeds
    assert int(state.recipe.calls) == 2 * 3 * sum(rs.calls_per_matmul(mp.recipe))
    assert not same(g1["conv1"], g2["conv1"])
