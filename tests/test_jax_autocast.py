"""JAX op-level autocast: the dtype of every equation of the rewritten jaxpr, numerics against
float32 with tolerances from the format's epsilon, and composition with jit, grad and vmap."""

import dataclasses
import functools
import itertools
import re
import warnings

import numpy as np
import pytest
from frameworks import require

jax = require("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend import core as jcore  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError, UnsupportedError  # noqa: E402
from polyamp.compare import jax as cj  # noqa: E402
from polyamp.compare.workloads import get_workload  # noqa: E402
from polyamp.jax import autocast as jax_autocast  # noqa: E402
from polyamp.jax.autocast import DEFAULT_RULES, AutocastRules  # noqa: E402

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
EPS = {"bf16-mixed": pa.get_format("bf16").eps, "fp16-mixed": pa.get_format("fp16").eps}
LOW = {"bf16-mixed": BF16, "fp16-mixed": F16}


def equations(jaxpr):
    """Every equation of a jaxpr and of its sub-jaxprs, depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def float_dtypes(atoms):
    return [np.dtype(a.aval.dtype) for a in atoms if jnp.issubdtype(a.aval.dtype, jnp.floating)]


def mp_for(policy="bf16-mixed"):
    return pa.MixedPrecision(policy, framework="jax")


@pytest.fixture(scope="module")
def charlm():
    wl = get_workload("charlm", quick=True)
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    x, y = cj.inputs(wl, *wl.batch_at(0))
    return wl, params, x, y


def check_rules(jaxpr, low, output=F32):
    """Assert the rules on every equation; returns how many of each kind were seen."""
    seen = {"dot": 0, "fp32": 0, "low": 0}
    for eqn in equations(jaxpr):
        name, ins, outs = eqn.primitive.name, float_dtypes(eqn.invars), float_dtypes(eqn.outvars)
        if name in ("dot_general", "conv_general_dilated"):
            assert ins and set(ins) == {low}, (name, ins)
            assert eqn.params["preferred_element_type"] == F32
            seen["dot"] += 1
        elif name in DEFAULT_RULES.keep_fp32:
            assert set(ins) <= {F32} and set(outs) <= {F32}, (name, ins, outs)
            seen["fp32"] += ins == [F32] * len(ins) and bool(ins)
        elif name == "convert_element_type":
            seen["low"] += outs == [low]
        elif name in DEFAULT_RULES.follow:
            assert len(set(ins)) <= 1, (name, ins)
        if low in outs and name not in (
            "convert_element_type",
            "dot_general",
            "conv_general_dilated",
            "custom_vjp_call",
        ):
            # a matmul operand moved into the layout XLA CPU multiplies natively: data movement only
            assert name in ("broadcast_in_dim", "transpose", "squeeze") and ins == [low], (name, ins)
    return seen


# -- the rewritten jaxpr -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_every_equation_of_a_transformer_step_follows_the_rules(charlm, policy):
    """Forward and backward of a small transformer: matmuls low-precision-in/f32-accumulate,
    reductions, softmax, exp/log, rsqrt in f32, elementwise ops on one dtype; the only
    low-precision values are the casts feeding the matmuls."""
    wl, params, x, y = charlm
    loss = mp_for(policy).autocast(functools.partial(cj.loss_fn, wl))
    forward = jax.make_jaxpr(loss)(params, x, y).jaxpr
    seen = check_rules(forward, LOW[policy])
    # 6 dense layers per block (q, k, v, o, ff1, ff2), 2 attention matmuls, the head
    assert seen["dot"] == 8 * wl.layers + 1
    assert seen["fp32"] >= 10 and seen["low"] >= seen["dot"]
    names = {e.primitive.name for e in equations(forward)}
    assert {"reduce_max", "exp", "reduce_sum", "log", "rsqrt", "erfc"} <= names
    step = jax.make_jaxpr(jax.value_and_grad(loss))(params, x, y).jaxpr
    seen = check_rules(step, LOW[policy])
    assert seen["dot"] >= 3 * (8 * wl.layers + 1) - 1  # forward + both transposes (no d/d ids)


def test_integer_and_boolean_values_are_untouched():
    def f(x, ids):
        mask = x > 0
        counts = jnp.cumsum(ids) * 3 + mask.sum()
        return (x @ x.T).sum(), counts, mask, jnp.argmax(x, -1)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    ids = jnp.arange(5, dtype=jnp.int32)
    ref, got = f(x, ids), mp_for().autocast(f)(x, ids)
    for a, b in zip(ref[1:], got[1:]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for eqn in equations(jax.make_jaxpr(mp_for().autocast(f))(x, ids).jaxpr):
        if eqn.primitive.name == "convert_element_type":
            assert jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating) == jnp.issubdtype(
                eqn.params["new_dtype"], jnp.floating
            ), "a cast between integer/bool and float that the function did not ask for"


def test_output_dtypes_are_the_original_ones():
    def f(x):
        return (x @ x.T).sum(), x.astype(jnp.bfloat16) @ x.T.astype(jnp.bfloat16), x @ x.T

    x = jnp.ones((3, 4))
    outs = mp_for("p=f32,c=f16,o=f16").autocast(f)(x)
    assert [o.dtype for o in outs] == [o.dtype for o in f(x)] == [F32, BF16, F32]


# -- numerics against float32 --------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_matmul_error_is_within_the_rounding_bound(policy):
    """Each product of two inputs rounded to the format (unit roundoff u = eps/2) is off by at most
    (2u + u^2)|a||b|; float32 accumulation adds at most K * 2^-24 of sum |a||b|."""
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((32, 256), (256, 16)))
    got = mp_for(policy).autocast(jnp.matmul)(a, b)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    u = EPS[policy] / 2
    bound = (2 * u + u * u + 256 * 2.0**-24) * (np.abs(np.asarray(a)) @ np.abs(np.asarray(b)))
    assert got.dtype == F32 and np.all(np.abs(np.asarray(got) - ref) <= bound)
    assert np.abs(np.asarray(got) - ref).max() > 2.0**-24 * np.abs(ref).max()  # it did round


def loss_grads_logits(wl, mp=None):
    """One jitted function: (loss, grads) of the loss and the logits, autocast by ``mp``; the logits are
    the loss's own (``cj.loss_fn`` is the cross entropy of ``cj.forward``): one forward to compile."""
    assert wl.loss_kind == "cross_entropy"

    def loss_and_logits(p, x, y):
        logits = cj.forward(wl, p, x)
        return cj.cross_entropy(logits, y), logits

    f = loss_and_logits if mp is None else mp.autocast(loss_and_logits)

    def run(p, x, y):
        (loss, logits), grads = jax.value_and_grad(f, has_aux=True)(p, x, y)
        return (loss, grads), logits

    return jax.jit(run)


@pytest.fixture(scope="module")
def float32_reference(charlm):
    wl, params, x, y = charlm
    return loss_grads_logits(wl)(params, x, y)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_transformer_loss_logits_and_grads_match_float32(charlm, float32_reference, policy):
    wl, params, x, y = charlm
    eps = EPS[policy]
    (l32, g32), logits32 = float32_reference
    (l16, g16), logits = loss_grads_logits(wl, mp_for(policy))(params, x, y)
    assert l16.dtype == F32 and abs(float(l16 - l32)) <= eps * abs(float(l32))
    assert float(jnp.abs(logits - logits32).max()) <= 4 * eps * float(jnp.abs(logits32).max())
    total = np.sqrt(sum(float(jnp.sum(g**2)) for g in g32.values()))
    diff = np.sqrt(sum(float(jnp.sum((g16[k] - g32[k]) ** 2)) for k in g32))
    assert diff <= 2 * eps * total
    assert diff > 0  # the backward did run in low precision


# -- composition ---------------------------------------------------------------------------------
def mlp_loss(p, x):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"]) ** 2)


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.standard_normal((8, 16)) / 3, jnp.float32), "b1": jnp.zeros(16),
            "w2": jnp.asarray(rng.standard_normal((16, 4)) / 4, jnp.float32)}  # fmt: skip


def test_jit_grad_and_vmap_compose():
    p = mlp_params()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 8)), jnp.float32)
    f = mp_for().autocast(mlp_loss)
    eager, jitted = jax.grad(f)(p, x), jax.jit(jax.grad(f))(p, x)
    ref = jax.jit(jax.grad(mlp_loss))(p, x)
    for k in p:
        np.testing.assert_allclose(eager[k], jitted[k], rtol=1e-6, atol=1e-7)
        tol = 4 * EPS["bf16-mixed"] * float(jnp.abs(ref[k]).max())
        np.testing.assert_allclose(jitted[k], ref[k], rtol=0, atol=tol)
    one = jax.jit(f)
    per_example = jax.jit(jax.vmap(f, in_axes=(None, 0)))(p, x[:, None])
    assert np.allclose(per_example, [one(p, x[i : i + 1]) for i in range(6)], rtol=1e-6)
    per_example_grads = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(p, x[:, None])
    assert per_example_grads["w1"].shape == (6, 8, 16)
    np.testing.assert_allclose(per_example_grads["w1"][2], jax.jit(jax.grad(f))(p, x[2:3])["w1"],
                               rtol=1e-5, atol=1e-7)  # fmt: skip
    assert jax.make_jaxpr(f)(p, x).out_avals[0].dtype == F32


def test_autocast_of_a_closure_over_traced_values_under_jit():
    p = mlp_params()
    x = jnp.ones((4, 8))

    @jax.jit
    def outer(p, x):
        return mp_for().autocast(lambda p: mlp_loss(p, x * 2))(p)

    assert np.isclose(outer(p, x), mlp_loss(p, x * 2), rtol=4 * EPS["bf16-mixed"])


def sub_jaxpr_fn(w, x, loop=True):
    """Matmuls inside scan, while (reverse mode cannot differentiate it), cond, remat, jit,
    custom_jvp and custom_vjp."""

    def body(c, xi):
        return c + jnp.tanh(xi @ w).sum(), xi @ w

    c, ys = lax.scan(body, 0.0, x)
    n, z = (
        lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, s[1] @ w), (0, x[0])) if loop else (0, x[0])
    )
    branch = lax.cond(c > 0, lambda a: (a @ w).sum(), lambda a: a.sum(), x[1])
    remat = jax.checkpoint(lambda a: jnp.sin(a @ w).sum())(x[2])
    inner = jax.jit(lambda a: jax.nn.relu(a @ w).sum())(x[0])
    return (
        c + ys.sum() + z.sum() + branch + remat + inner + twice_grad(x[0] @ w).sum() + x[1] @ w @ ones_vjp(w)
    )


@jax.custom_jvp
def twice_grad(a):
    return a * 1.0


twice_grad.defjvp(lambda primals, tangents: (twice_grad(primals[0]), 2.0 * tangents[0]))


@jax.custom_vjp
def ones_vjp(w):
    return w @ jnp.ones((w.shape[1],))


ones_vjp.defvjp(lambda w: (ones_vjp(w), None), lambda _, ct: (jnp.full((8, 8), 7.0) * ct.sum(),))


def body_of(eqn):
    p = eqn.params
    closed = p.get("jaxpr") or p.get("body_jaxpr") or (p["branches"][-1] if "branches" in p else None)
    return getattr(closed, "jaxpr", closed)


def test_recurses_into_control_flow_remat_jit_and_custom_derivatives():
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((8, 8)) / 4, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    f = mp_for().autocast(sub_jaxpr_fn)
    jaxpr = jax.make_jaxpr(f)(w, x).jaxpr
    seen = check_rules(jaxpr, BF16)
    assert seen["dot"] >= 9
    bodies = {e.primitive.name: body_of(e) for e in jaxpr.eqns}
    assert {"scan", "while", "cond"} <= set(bodies) and {"remat2", "checkpoint"} & set(bodies)
    for name in ("scan", "while", "cond"):  # the loop and branch bodies hold bf16 matmuls
        assert any(e.primitive.name == "dot_general" and float_dtypes(e.invars) == [BF16, BF16]
                   for e in equations(bodies[name])), name  # fmt: skip
    tol = 8 * EPS["bf16-mixed"]
    np.testing.assert_allclose(jax.jit(f)(w, x), jax.jit(sub_jaxpr_fn)(w, x), rtol=tol)
    no_loop = functools.partial(sub_jaxpr_fn, loop=False)
    g = jax.jit(jax.grad(mp_for().autocast(no_loop), argnums=(0, 1)))(w, x)
    ref = jax.jit(jax.grad(no_loop, argnums=(0, 1)))(w, x)
    for a, b in zip(g, ref):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(jnp.abs(b).max()))


def test_custom_derivative_rules_are_kept():
    x = jnp.ones((2, 8))
    w = jnp.eye(8)
    f = mp_for().autocast(lambda x: twice_grad(x @ w).sum())
    assert np.allclose(jax.grad(f)(x), 2.0)  # the custom jvp's 2, not the primal's 1
    g = mp_for().autocast(lambda w: ones_vjp(w).sum())
    assert np.allclose(jax.grad(g)(w), 7.0 * 8)  # the custom bwd's 7 * sum(ct)


# -- rules, extension, fallbacks -----------------------------------------------------------------
def dtype_of(fn, name, *args):
    eqns = [e for e in equations(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == name]
    return float_dtypes(eqns[0].invars)[0]


def test_rules_are_a_table_users_extend():
    def f(x):
        return jnp.tanh(x @ x.T.astype(jnp.float16)).sum()

    x = jnp.ones((4, 4), jnp.float16)
    policy = "p=f32,c=f16,o=f16"  # matmul outputs stay float16, so the rule decides tanh's dtype
    assert dtype_of(mp_for(policy).autocast(f), "tanh", x) == F16
    rules = DEFAULT_RULES.extend(keep_fp32=["tanh"])
    assert "tanh" in rules.keep_fp32 and "tanh" not in rules.follow
    assert dtype_of(mp_for(policy).autocast(f, rules=rules), "tanh", x) == F32
    allowed = DEFAULT_RULES.extend(allow=["tanh"])
    g = mp_for("bf16-mixed").autocast(lambda x: jnp.tanh(x).sum(), rules=allowed)
    assert dtype_of(g, "tanh", jnp.ones(3)) == BF16
    with pytest.raises(PolyampError, match="unknown autocast rule class 'fp32'"):
        DEFAULT_RULES.extend(fp32=["exp"])
    with pytest.raises(PolyampError, match="list of primitive names, got the string"):
        DEFAULT_RULES.extend(allow="exp")
    with pytest.raises(PolyampError, match="'exp' is in both"):
        AutocastRules(allow={"exp"})
    with pytest.raises(PolyampError, match="rules must be an AutocastRules"):
        mp_for().autocast(f, rules={"allow": ["exp"]})
    with pytest.raises(PolyampError, match="JAX has no autocast context; mp.autocast rewrites a function"):
        mp_for().autocast(rules=rules)


def _sum_of_squares_primitive():
    from jax.interpreters import mlir

    prim = jcore.Primitive("polyamp_test_sumsq")
    prim.def_impl(lambda x: jnp.sum(x.astype(jnp.float32) ** 2).astype(x.dtype))
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray((), x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(prim.impl, multiple_results=False))
    return prim


def test_unknown_primitive_runs_in_its_original_dtype_with_one_warning():
    prim = _sum_of_squares_primitive()

    def f(x):
        return prim.bind(x @ x.T) + jnp.sum(x @ x.T)

    x = jnp.full((4, 64), 10.0)  # 6400 per element; their squares are past float16's 65504
    g = mp_for("p=f32,c=f16,o=f16").autocast(f)
    jax_autocast._warned.discard("polyamp_test_sumsq")
    with pytest.warns(RuntimeWarning, match="no rule for the JAX primitive 'polyamp_test_sumsq'"):
        jaxpr = jax.make_jaxpr(g)(x).jaxpr
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        out = g(x)
    eqn = next(e for e in equations(jaxpr) if e.primitive.name == "polyamp_test_sumsq")
    assert float_dtypes(eqn.invars) == [F32]
    assert np.isfinite(out) and np.isclose(out, f(x), rtol=1e-3)


def test_no_silent_float16_reduction():
    def f(x):
        h = x @ x.T
        return jnp.sum(h) + jax.nn.logsumexp(h) + jnp.cumsum(h, axis=0).max() + jnp.mean(jnp.exp(-h))

    x = jnp.full((4, 64), 10.0)  # 16 elements of 6400: a float16 sum would overflow
    for policy in ("fp16-mixed", "p=f32,c=f16,o=f16", "fp16-true"):
        g = mp_for(policy).autocast(f)
        for eqn in equations(jax.make_jaxpr(g)(x).jaxpr):
            if eqn.primitive.name in DEFAULT_RULES.keep_fp32:
                assert F16 not in float_dtypes(eqn.invars), (policy, eqn.primitive.name)
        assert np.isfinite(g(x)), policy


def test_float32_policy_is_the_identity_and_bad_input_is_refused():
    f = mp_for("float32").autocast(mlp_loss)
    assert f is mlp_loss
    assert mp_for("bf16-mixed").autocast(mlp_loss, enabled=False) is mlp_loss
    for policy in ("bf16-mixed", "float32"):
        with pytest.raises(PolyampError, match="expects a function to rewrite, got int"):
            mp_for(policy).autocast(3)
    with pytest.raises(UnsupportedError, match="needs float64, which JAX disables"):
        mp_for("float64").autocast(mlp_loss)
    with pytest.raises(PolyampError, match="JAX has no autocast context"):
        mp_for().autocast()


def test_convolution_forward_and_backward_run_in_low_precision():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 16, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 3, 3, 3)) / 5, jnp.float32)

    def loss(k, x):
        y = lax.conv_general_dilated(x, k, (1, 1), "SAME")
        return jnp.mean(jax.nn.relu(y) ** 2)

    f = mp_for().autocast(loss)
    step = jax.make_jaxpr(jax.grad(f))(k, x).jaxpr
    convs = [e for e in equations(step) if e.primitive.name == "conv_general_dilated"]
    assert len(convs) >= 2 and all(float_dtypes(e.invars) == [BF16, BF16] for e in convs)
    g, ref = jax.jit(jax.grad(f))(k, x), jax.jit(jax.grad(loss))(k, x)
    assert 0 < float(jnp.linalg.norm(g - ref)) <= 4 * EPS["bf16-mixed"] * float(jnp.linalg.norm(ref))


def test_forward_mode_needs_the_plain_backward():
    x = jnp.ones((2, 8))
    plain = dataclasses.replace(DEFAULT_RULES, low_precision_backward=False)
    f = mp_for().autocast(lambda x: (x @ x.T).sum(), rules=plain)
    _, tangent = jax.jvp(f, (x,), (jnp.ones_like(x),))
    assert float(tangent) == 64.0  # d/dt |sum of rows of (x + t)|^2 = 2 * (2 * ones) . (2 * ones)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(mp_for().autocast(lambda x: (x @ x.T).sum()), (x,), (jnp.ones_like(x),))
    with pytest.raises(PolyampError, match="low_precision_backward must be True or False"):
        AutocastRules(low_precision_backward="yes")


def dense_loss(w, x, c):
    return jnp.sum(jax.nn.gelu(x @ w) * c)


def test_weight_gradients_are_float32_not_rounded_to_bf16():
    """With a float32-output policy, dW = x^T @ dy multiplies bf16 operands and leaves the
    float32 accumulator as float32: equal to that product, and finer than bf16."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((48, 32)), jnp.float32)

    def loss(w, x):
        return jnp.sum((x @ w) * c)

    expected = jnp.matmul(x.astype(BF16).T, c.astype(BF16), preferred_element_type=F32)
    grad = jax.grad(mp_for().autocast(loss))
    for run in (grad, jax.jit(grad)):  # eagerly, and compiled (where XLA may keep excess precision)
        got = run(w, x)
        assert got.dtype == F32
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)
        assert not np.array_equal(np.asarray(got), np.asarray(got.astype(BF16).astype(F32)))


def dot_operand_types(hlo: str) -> list[list[str]]:
    """The element types of the two operands of every ``dot`` in an optimized HLO module's text."""
    types: dict[str, str] = {}
    found = []
    for line in hlo.splitlines():
        header = re.match(r"\s*(?:ENTRY )?%\S+ \((.*)\) -> ", line)
        if header:  # a computation: its parameters' types
            types = dict(re.findall(r"(\S+): (\w+)\[", header.group(1)))
            continue
        instruction = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[\S* (\w[\w-]*)\((.*?)\)", line)
        if instruction:
            name, dtype, op, args = instruction.groups()
            types[name] = dtype
            if op == "dot":
                found.append([types.get(a.strip().lstrip("%"), "?") for a in args.split(",")])
    return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="an XLA CPU layout rule")
def test_every_matmul_of_the_compiled_backward_multiplies_bf16():
    """XLA CPU upcasts a bf16 dot whose left operand is not laid out (batch, free, contracting) to
    float32; autocast moves such operands first, so no dot of the compiled step (weight gradients
    x^T @ dy and attention's transposed products included) multiplies converted float32 copies."""
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((48, 32)), jnp.float32)

    def batched(q, k):
        return jnp.sum(jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k)) * 2)

    q = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
    for fn, args in ((dense_loss, (w, x, c)), (batched, (q, q + 1))):
        hlo = jax.jit(jax.grad(mp_for().autocast(fn), argnums=(0, 1))).lower(*args).compile().as_text()
        operands = dot_operand_types(hlo)
        assert len(operands) >= 3, operands  # forward, and the gradients of both operands
        assert all(types == ["bf16", "bf16"] for types in operands), (fn.__name__, operands)
    # the moved operand changes nothing but the layout
    got = jax.jit(jax.grad(mp_for().autocast(dense_loss)))(w, x, c)
    expected = jax.grad(dense_loss)(w.astype(BF16).astype(F32), x.astype(BF16).astype(F32), c)
    assert float(jnp.linalg.norm(got - expected)) <= 4 * EPS["bf16-mixed"] * float(jnp.linalg.norm(expected))


def test_moving_the_left_operand_keeps_every_layout_exact():
    """Every order of a left operand with a batch, a free and two contracting dimensions: the
    autocast dot equals the float32 one on bf16-representable inputs (float32 accumulation), and
    so do both gradients up to bf16 cotangent rounding. All 24 orders in one compiled step, each its
    own dot with its own operands; the reference is numpy's in float64."""
    sizes = {"b": 3, "m": 5, "k": 7, "c": 2, "n": 4}
    rng = np.random.default_rng(7)

    def bf16_exact(dims):  # rounded to bfloat16 in numpy (ml_dtypes): no program per shape
        return rng.standard_normal([sizes[d] for d in dims]).astype(BF16).astype(F32)

    rhs_dims = "nckb"
    rhs = bf16_exact(rhs_dims)
    orders = ["".join(order) for order in itertools.permutations("bmkc")]
    lhs = [bf16_exact(order) for order in orders]
    numbers = [(((d.index("k"), d.index("c")), (rhs_dims.index("k"), rhs_dims.index("c"))),
                ((d.index("b"),), (rhs_dims.index("b"),))) for d in orders]  # fmt: skip

    def loss(lhs, rhs):
        ys = [lax.dot_general(a, b, n, preferred_element_type=F32) for a, b, n in zip(lhs, rhs, numbers)]
        return sum((y**2).sum() for y in ys), ys

    step = jax.jit(jax.grad(mp_for().autocast(loss), argnums=(0, 1), has_aux=True))
    (dlhs, drhs), ys = step([jnp.asarray(a) for a in lhs], [jnp.asarray(rhs)] * len(orders))
    for order, a, y, da, db in zip(orders, lhs, ys, dlhs, drhs):
        # y[b, m, n] = sum over k, c of lhs * rhs; L = sum y^2, so dL/dy = 2 y
        want = np.einsum(f"{order},nckb->bmn", a.astype(np.float64), rhs.astype(np.float64))
        np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-5, err_msg=order)
        want_da = np.einsum(f"bmn,nckb->{order}", 2 * want, rhs.astype(np.float64))
        want_db = np.einsum(f"bmn,{order}->nckb", 2 * want, a.astype(np.float64))
        for got, ref in ((da, want_da), (db, want_db)):
            assert got.shape == ref.shape
            error = np.linalg.norm(np.asarray(got, np.float64) - ref)
            assert error <= 4 * EPS["bf16-mixed"] * np.linalg.norm(ref), order


def test_a_transposed_result_of_a_moved_dot_compiles():
    """x^T @ y inside a jit, transposed outside it: the fold of transposes into dots cannot see
    across the jit, so XLA would fold it into the moved dot and fail ("Unsupported element type
    for DotThunk") unless the moved dot's result stays as it is."""
    rng = np.random.default_rng(8)
    a = jnp.asarray(rng.standard_normal((64, 32)), F32)
    b = jnp.asarray(rng.standard_normal((64, 48)), F32)
    inner = jax.jit(lambda a, b: jnp.einsum("ki,kj->ij", a, b))
    got = jax.jit(mp_for().autocast(lambda a, b: inner(a, b).T))(a, b)
    expected = (a.astype(BF16).astype(F32).T @ b.astype(BF16).astype(F32)).T
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)


def installed_primitive_names():
    """The name of every ``Primitive`` object defined in the installed JAX's modules."""
    import importlib
    import pkgutil
    import sys

    import jax._src

    for info in pkgutil.walk_packages(jax._src.__path__, "jax._src."):
        try:
            importlib.import_module(info.name)
        except Exception:  # optional back ends (GPU, TPU plugins) that this machine lacks
            continue
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("jax") and m is not None]
    return {v.name for m in modules for v in list(vars(m).values()) if isinstance(v, jcore.Primitive)}


def test_every_primitive_the_rules_name_exists_in_this_jax():
    """The rule table is written against the JAX range pyproject pins: a primitive renamed or
    removed in another version would silently stop following its rule, so this fails instead."""
    names = installed_primitive_names()
    assert {"dot_general", "reduce_sum", "exp", "add"} <= names  # the walk found the primitives
    table = set().union(*(getattr(DEFAULT_RULES, cls) for cls in jax_autocast.CLASSES))
    assert sorted(table - names) == []
