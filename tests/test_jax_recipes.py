"""Emulated fp8 / MX / NVFP4 training in JAX (``polyamp/jax/recipe.py``): the stateful GEMMs (seeds and
delayed scales of a step) against core-quantized operands, keep lists, training under jit, and what is
refused (the stateless quantization and GEMMs against the numpy core: test_recipes_frameworks.py)."""

import functools
import math

import numpy as np
import pytest
from frameworks import require

jax = require("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError, recipes  # noqa: E402
from polyamp.jax import recipe as jr  # noqa: E402
from polyamp.jax import recipe_operands as jo  # noqa: E402
from polyamp.jax import recipe_state as rs  # noqa: E402
from polyamp.numerics import hadamard_tiles  # noqa: E402
from polyamp.recipe_layers import RecipeWarning  # noqa: E402

# the operands' shapes of test_recipes_frameworks.py's GEMM test: x [2, 16, 64] (x2 [32, 64] flattened),
# w [64, 96], g [32, 96]; the tests here quantize these shapes too where the shape is not what they are
# about, so that each quantizer compiles once per process
X3, W, G = (2, 16, 64), (64, 96), (32, 96)


def same(got, want) -> bool:
    """Bit for bit, NaN payloads aside."""
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(a)
    return a.shape == b.shape and np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes()


def wide(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, (shape[0],) + (1,) * (len(shape) - 1)))
    return x.astype(np.float32)


def test_a_transposed_operand_rounded_to_nearest_is_the_same_program():
    """Only stochastic rounding indexes a transposed operand's elements as its transpose's: rounded to
    nearest, ``transposed=True`` is blocking along axis 0, values and compilation alike."""
    from polyamp.jax import blocks64

    r = recipes.parse_recipe("mxfp8")
    w = jnp.asarray(wide((48, 80), 8))  # a shape no other test quantizes
    before = blocks64.values_jit._cache_size()
    transposed = jo.quantize_operand(w, r, "weight", -1, transposed=True)
    assert same(transposed, jo.quantize_operand(w, r, "weight", 0))
    assert blocks64.values_jit._cache_size() <= before + 1  # (before: a program for each)


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
    with pytest.raises(PolyampError, match="or convolution's scope; their scopes: 'fc0'"):
        jr.kept_layers(closed.jaxpr, ("attn*",))
    # a two-layer model with both kept computes exactly as bf16-mixed
    small, y = init([16, 32, 4]), jnp.ones((8, 4))

    def loss_under(policy):  # compiled: one program instead of op-by-op dispatch
        return jax.jit(pa.MixedPrecision(policy, framework="jax").autocast(loss_fn))(small, x, y)

    # the keep list is the recipes' own, whatever they quantize with: per-tensor scales compile fastest
    plain, kept = loss_under("bf16-mixed"), loss_under("fp8-tensorwise")
    everything = loss_under("fp8-tensorwise:keep=")
    assert float(kept) == float(plain) and float(everything) != float(plain)


# a recipe without state, through jax.value_and_grad: MX blocks (the dense layers' only MX training; NVFP4
# and delayed scaling, per-tensor scales from a history, train in the test below)
@pytest.mark.parametrize("spec", ["mxfp8"])
def test_each_recipe_trains_under_jit(spec):
    mp = pa.MixedPrecision(spec, framework="jax")
    f = mp.autocast(loss_fn)
    p = init([16, 48, 48, 4])  # fc1 quantized, the first and the last layer kept
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


@pytest.mark.parametrize("spec", [*recipes.RECIPES, "nvfp4:hadamard=true"])
def test_jax_takes_every_recipe(spec):
    assert pa.MixedPrecision(spec, framework="jax").recipe == recipes.parse_recipe(spec)


# -- recipes that keep state: delayed scaling, stochastic rounding ----------------------------------------
# the seeds' layouts: delayed scales (no seeds); per-tensor stochastic gradients (one seed per backward);
# NVFP4 with 16x16 weights (three backward seeds); MX and NVFP4 with 1-d weights rounding the forward
# stochastically too (two forward, four backward seeds). A history length, amax algorithm or margin only
# changes the delayed update (test_the_delayed_update_is_the_cores_step_for_step); Hadamard tiles only the
# wgrad operands (test_recipes_frameworks.py's GEMM tests; with seeds, under jit,
# test_steps_draw_the_seeds_and_scales_of_torchs_recipe)
STATEFUL = ["fp8-delayed", "fp8-tensorwise:grad_rounding=stochastic", "nvfp4",
            "mxfp8:forward_rounding=stochastic:grad_rounding=stochastic",
            "nvfp4:weight_2d=false:forward_rounding=stochastic"]  # fmt: skip


@pytest.mark.parametrize("calls", [0, 1, 41, 2**32 - 3, 2**32 - 1])
@pytest.mark.parametrize("position", [1, 2, 7, 1000])
def test_the_traced_seed_key_is_the_cores_key_of_calls_plus_position(calls, position):
    from polyamp.jax.quantize import _key

    got = jax.jit(rs.seed_key, static_argnums=1)(jnp.uint32(calls), position)
    want = _key(calls + position)
    assert [int(v) for v in got] == [int(v) for v in want]


def delayed_entry(ds):
    return {"scale": jnp.float32(ds.scale), "history": jnp.asarray(ds.history), "steps": jnp.int32(ds.steps)}


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_the_delayed_update_is_the_cores_step_for_step(algo, margin):
    r = recipes.get_recipe("fp8-delayed", history_len=4, amax_compute_algo=algo, margin=margin)
    amaxes = [0.0, 3.5, 1e-42, math.nan, 2.0, math.inf, 0.0, 0.0, 0.0, 6e37, 1e-30, 0.25, 0.0, 0.0, 0.0, 0.0]
    for operand in ("input", "grad"):
        ds = rs.delayed_config(r, operand)
        entry = delayed_entry(ds)
        step = jax.jit(functools.partial(rs.update, r, operand))
        for a in amaxes:
            entry = step(entry, jnp.float32(a))
            ds.update(a)
            assert np.asarray(entry["scale"]).tobytes() == np.float32(ds.scale).tobytes(), (operand, a)
            assert same(entry["history"], ds.history) and int(entry["steps"]) == ds.steps


def stateful_reference(r, x, w, g, calls, n, j, scales=(None, None, None)):
    """The forward and both gradients of matmul j of n from core-quantized operands with torch's seeds."""
    forward, per = rs.calls_per_matmul(r)
    seeds = iter(range(calls + forward * j + 1, calls + forward * (j + 1) + 1))
    back = iter(range(calls + forward * n + per * (n - 1 - j) + 1, 2**64))

    def q(a, operand, seeds, axis=-1, scale=None):
        grad = operand == "grad"
        fmt = r.backward_format if grad else r.forward_format
        rounding = r.grad_rounding if grad else r.forward_rounding
        if r.kind == "block":
            two_d = r.weight_2d and operand == "weight"
            axes, block = ((-2, -1), (16, 16)) if two_d else (axis, None)
            return pa.quantize_blocks(a, fmt, axis=axes, block=block, scale_rule=r.scale_rule,
                                      rounding=rounding, seed=next(seeds))  # fmt: skip
        if scale is None:
            scale = recipes.current_scale(float(np.abs(a).max()), fmt, r.margin)
        return recipes.quantize_tensorwise(a, fmt, scale, rounding, next(seeds))

    def mm(a, b):
        dims = (((np.ndim(a) - 1,), (0,)), ((), ()))
        return np.asarray(jax.lax.dot_general(jnp.asarray(a), jnp.asarray(b), dims,
                                              preferred_element_type=jnp.float32))  # fmt: skip

    sx, sw, sg = scales
    x2 = x.reshape(-1, x.shape[-1])
    xq, wq = q(x, "input", seeds, scale=sx), q(w.T, "weight", seeds, scale=sw).T  # torch's weight is w^T
    if r.kind == "block":
        gq = q(g, "grad", back)
        w_op = wq if r.weight_2d else q(w, "weight", back)
        gt, xt = (hadamard_tiles(g.T), hadamard_tiles(x2.T)) if r.hadamard else (g.T, x2.T)
        g_op, x_op = q(gt, "grad", back).T, q(xt, "input", back).T
    else:
        gq = g_op = q(g, "grad", back, scale=sg)
        w_op, x_op = wq, xq.reshape(x2.shape)
    return mm(xq, wq), mm(gq, w_op.T).reshape(x.shape), mm(x_op.T, g_op)


@pytest.mark.parametrize("spec", STATEFUL)
def test_a_stateful_matmul_is_the_quantized_gemms_with_torchs_seeds(spec):
    """Matmuls 0 and 2 of 3, the counter wrapping within the step's positions: bit for bit, eagerly (the
    two share their compiled quantizers); matmul 0 also under jit, the counter traced. The block
    quantizer is one jitted program taking the seed's key as an argument in both cases, and compiles
    slowly inlined in another: block recipes' seeds under jit are
    test_steps_draw_the_seeds_and_scales_of_torchs_recipe's (NVFP4) and test_quantize_frameworks.py's
    test_blocks_under_jit_and_3d (MX, stochastic)."""
    r = recipes.parse_recipe(spec)
    x, w, g = wide(X3, 13), wide(W, 14) / 8, wide(G, 15)
    calls, n = 2**32 - 9, 3  # the counter wraps within the step's positions
    scales = (np.float32(16.0), np.float32(2.0), np.float32(0.5)) if r.kind == "delayed" else (None,) * 3
    f32 = jnp.float32
    svals = [jnp.float32(1.0 if s is None else s) for s in scales]
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(g).reshape(2, 16, 96), jnp.uint32(calls))

    def of_matmul(j):
        run = rs.Run(r, jnp.uint32(calls), {})
        run.count, run.closed = n, True
        fn = jr.dot(r, f32, f32, f32, run, j)

        def forward_and_back(x, w, g, c):
            y, vjp = jax.vjp(lambda a, b, *s: fn(a, b, *s, c), x, w, *svals)
            return y, *vjp(g)

        return forward_and_back

    for j in (0, 2):
        forward_and_back = of_matmul(j)
        y, dx, dw, *amaxes = forward_and_back(*args)
        want = stateful_reference(r, x, w, g, calls, n, j, scales)
        assert same(y, want[0]) and same(dx, want[1]) and same(dw, want[2]), j
        if j == 0 and r.kind != "block":  # under jit XLA may sum the products in another order
            for got, ref in zip(jax.jit(forward_and_back)(*args), want):
                np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
        if r.kind == "delayed":  # the amaxes come back as the scales' cotangents
            assert [float(a) for a in amaxes] == [float(np.abs(t).max()) for t in (x, w, g)]


def test_different_steps_round_differently_and_the_same_step_the_same():
    r = recipes.parse_recipe("fp8-tensorwise:grad_rounding=stochastic")  # the seeds are every kind's
    x, w, g = wide((32, 64), 16), wide((64, 32), 17), wide((32, 32), 18)

    @jax.jit  # the step counter traced: one program for every step
    def grads(calls):
        run = rs.Run(r, calls, {})
        run.count, run.closed = 1, True
        fn = jr.dot(r, jnp.float32, jnp.float32, jnp.float32, run, 0)
        one = jnp.float32(1)
        return jax.vjp(lambda a, b: fn(a, b, one, one, one, calls), x, w)[1](g)

    a, b, c = grads(jnp.uint32(0)), grads(jnp.uint32(0)), grads(jnp.uint32(5))
    assert same(a[1], b[1]) and not same(a[1], c[1])


def stateful_step(mp, f, opt):
    @jax.jit
    def step(p, s, state, x, y):
        (loss, grads), finite, state = mp.value_and_grad(f)(p, x, y, state=state)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, state, loss

    return step


def batches(n, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        yield x, np.sin(x[:, :4])


@pytest.mark.parametrize("spec", ["fp8-delayed", "nvfp4"])
def test_each_stateful_recipe_trains_under_jit_through_mp_value_and_grad(spec):
    """Delayed scales and NVFP4's stochastic rounding (the two kinds of state; per-tensor stochastic
    rounding's seeds: test_a_stateful_cnn_step_counts_each_convolution_as_a_matmul) train; the state
    made from the function (one compilation; ``mp.init()``'s empty one fills in at the first step:
    test_delayed_training_steps_are_the_cores_step_for_step)."""
    mp = pa.MixedPrecision(spec, framework="jax")
    f = mp.autocast(loss_fn)
    p, opt = init([16, 48, 48, 4]), optax.adam(1e-2)
    s, state = opt.init(p), mp.init(f, p, *next(batches(1)))
    step = stateful_step(mp, f, opt)
    losses = []
    for x, y in batches(60):
        p, s, state, loss = step(p, s, state, x, y)
        losses.append(float(loss))
    assert np.mean(losses[-10:]) < 0.2 * losses[0]
    # fc1 is quantized (fc0 and fc2 kept): 60 steps of its calls
    assert int(state.recipe.calls) == 60 * sum(rs.calls_per_matmul(mp.recipe))
    delayed = state.recipe.delayed
    if mp.recipe.kind == "delayed":
        assert sorted(delayed) == [f"fc1|{op}" for op in ("grad", "input", "weight")]
        assert all(int(e["steps"]) == 60 and float(e["scale"]) not in (0.0, 1.0) for e in delayed.values())
    else:
        assert delayed == {}


def test_delayed_training_steps_are_the_cores_step_for_step():
    """One quantized matmul, no loss scale, fp32 products: each step's output and weight gradient are the
    GEMMs of operands the core quantizes with its DelayedScaling's scales, which it then updates."""
    r = recipes.parse_recipe("fp8-delayed:history_len=3:keep=:compute_dtype=fp32")
    mp = pa.MixedPrecision(r, framework="jax")

    def loss(w, x, c):
        y = x @ w
        return jnp.sum(y * c), y

    f = mp.autocast(loss)
    step = jax.jit(lambda w, x, c, state: mp.value_and_grad(f, has_aux=True)(w, x, c, state=state))
    state, w = mp.init(), wide((32, 8), 20) / 4
    ds = {op: rs.delayed_config(r, op) for op in rs.OPERANDS}
    rng = np.random.default_rng(21)
    for k in range(6):
        x = wide((16, 32), 30 + k) * (1e4 if k == 3 else 1)
        c = (rng.standard_normal((16, 8)) * 2.0 ** rng.integers(-8, 8)).astype(np.float32)
        ((_, y), dw), finite, state = step(jnp.asarray(w), jnp.asarray(x), jnp.asarray(c), state)
        want_y, _, want_dw = stateful_reference(r, x, w, c, 0, 1, 0, [ds[op].scale for op in rs.OPERANDS])
        # under jit XLA may sum the products in another order; a wrong scale would move them by far more
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5 * float(np.abs(want_y).max()))
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5 * float(np.abs(want_dw).max()))
        for op, t in zip(rs.OPERANDS, (x, w, c)):
            ds[op].update(float(np.abs(t).max()))
            e = state.recipe.delayed[f"|{op}"]
            assert float(e["scale"]) == float(ds[op].scale) and same(e["history"], ds[op].history), (k, op)


def test_a_resumed_run_continues_bit_for_bit():
    """Three steps, saved as JSON; three more steps in the same run, and in a new MixedPrecision that
    loads the saved state: the same parameters, optimizer state and recipe state. Delayed scaling with
    stochastic gradients: both parts of a recipe's state, the amax histories and the seeds' counter
    (the state is the same for every recipe kind)."""
    import json

    spec = "fp8-delayed:history_len=4:grad_rounding=stochastic"

    def run(steps, step, p, s, state):
        for x, y in steps:
            p, s, state, _ = step(p, s, state, x, y)
        return p, s, state

    opt = optax.adam(1e-2)
    data = list(batches(6, seed=3))
    first = pa.MixedPrecision(spec, framework="jax")
    p0 = init([16, 32, 32, 4])
    f = first.autocast(loss_fn)
    step = stateful_step(first, f, opt)
    p, s, state = run(data[:3], step, p0, opt.init(p0), first.init(f, p0, *data[0]))
    first.sync(state)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["recipe"]["name"] == recipes.recipe_spec(first.recipe)
    assert saved["recipe"]["state"]["calls"] > 0
    assert sorted(saved["recipe"]["state"]["delayed"]) == [f"fc1|{op}" for op in ("grad", "input", "weight")]
    whole = run(data[3:], step, p, s, state)
    second = pa.MixedPrecision(spec, framework="jax")
    second.load_state_dict(saved)
    resumed = run(data[3:], stateful_step(second, second.autocast(loss_fn), opt), p, s, second.init())
    assert all(same(a, b) for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)))
    second.sync(resumed[2])
    assert second.state_dict() == (first.sync(whole[2]), first.state_dict())[1]


def test_a_recipe_state_that_does_not_fit_is_refused():
    mp = pa.MixedPrecision("fp8-delayed", framework="jax")
    good = {"format": "e4m3fn", "history_len": 1024, "amax_compute_algo": "max", "margin": 0, "scale": 1.0,
            "history": [0.0] * 1024, "steps": 0}  # fmt: skip
    base = mp.state_dict()
    with pytest.raises(PolyampError, match="history_len=16"):
        short = {**good, "history_len": 16, "history": [0.0] * 16}
        mp.load_state_dict({**base, "recipe": {"name": "fp8-delayed", "state": {"calls": 0, "delayed": {
            "fc1|input": short}}}})  # fmt: skip
    with pytest.raises(PolyampError, match="calls must be an integer"):
        mp.load_state_dict({**base, "recipe": {"name": "fp8-delayed", "state": {"calls": -1, "delayed": {}}}})
    with pytest.raises(PolyampError, match="saved with recipe 'nvfp4'"):
        mp.load_state_dict({**base, "recipe": {"name": "nvfp4", "state": {"calls": 0, "delayed": {}}}})
    with pytest.raises(PolyampError, match="has no place for"):
        saved = {"name": "nvfp4", "state": {"calls": 0, "delayed": {"a|input": good}}}
        pa.MixedPrecision("nvfp4", framework="jax").load_state_dict({**base, "recipe": saved})
    mp.load_state_dict({**base, "recipe": {"name": "fp8-delayed", "state": {"calls": 7, "delayed": {
        "fc1|input": {**good, "scale": 2.0}}}}})  # fmt: skip
    state = mp.init()
    assert int(state.recipe.calls) == 7 and float(state.recipe.delayed["fc1|input"]["scale"]) == 2.0


# stochastic rounding (here of the forward, which then rounds to nearest) and delayed scaling (then current)
@pytest.mark.parametrize(("spec", "plain"), [("fp8-tensorwise:forward_rounding=stochastic:keep=",
                                              "fp8-tensorwise:keep="),
                                             ("fp8-delayed:keep=", "fp8-tensorwise:keep=")])  # fmt: skip
def test_outside_its_step_a_stateful_recipe_evaluates_without_state_and_refuses_gradients(spec, plain):
    mp = pa.MixedPrecision(spec, framework="jax")
    p, x, y = init([16, 16, 4]), jnp.asarray(wide((8, 16), 40)), jnp.ones((8, 4))
    f = mp.autocast(loss_fn)
    assert same(jax.jit(f)(p, x, y), pa.MixedPrecision(plain, framework="jax").autocast(loss_fn)(p, x, y))
    with pytest.raises(PolyampError, match="take its gradients with mp.value_and_grad"):
        jax.grad(f)(p, x, y)


def test_init_with_the_function_makes_the_final_state_for_an_ahead_of_time_compiled_step():
    mp = pa.MixedPrecision("fp8-delayed:keep=first", framework="jax")
    f, opt = mp.autocast(loss_fn), optax.adam(1e-2)
    p, (x, y) = init([16, 32, 4]), next(batches(1))
    state = mp.init(f, p, x, y)
    assert sorted(state.recipe.delayed) == [f"fc1|{op}" for op in sorted(rs.OPERANDS)]
    step = stateful_step(mp, f, opt).lower(p, opt.init(p), state, x, y).compile()
    p2, _, after, _ = step(p, opt.init(p), state, x, y)
    assert jax.tree.structure(after) == jax.tree.structure(state)
    assert all(int(e["steps"]) == 1 for e in after.recipe.delayed.values())


def test_a_stateful_recipe_inside_a_loop_or_with_a_wrong_state_is_one_clear_error():
    mp = pa.MixedPrecision("fp8-tensorwise:grad_rounding=stochastic:keep=", framework="jax")
    p, x, y = init([16, 16, 4]), jnp.ones((8, 16)), jnp.ones((8, 4))

    def looped(p, x, y):
        def body(h, _):
            with jax.named_scope("fc"):
                return jnp.tanh(h @ p["fc0"]["w"][:, :16]), None

        return jnp.mean(jax.lax.scan(body, x, None, length=2)[0])

    with pytest.raises(PolyampError, match="'fc' is inside a scan"):
        mp.value_and_grad(mp.autocast(looped))(p, x, y, state=mp.init())

    def checkpointed(p, x, y):  # named as the user wrote it (before: "inside a remat2")
        return loss_fn(p, jax.checkpoint(lambda x: x)(x) * 1.0, y) + jnp.mean(jax.checkpoint(model)(p, x))

    with pytest.raises(PolyampError, match=r"'fc0' is inside a jax.checkpoint \(jax.remat\)"):
        mp.value_and_grad(mp.autocast(checkpointed))(init([16, 16, 4]), x, y, state=mp.init())
    with pytest.raises(PolyampError, match="pass the state from mp.init"):
        plain = pa.MixedPrecision("bf16-mixed", framework="jax").init()
        mp.value_and_grad(mp.autocast(loss_fn))(p, x, y, state=plain)


@pytest.mark.parametrize("reduce_amax", [True, False])
def test_amaxes_are_all_reduced_over_the_data_parallel_axis(reduce_amax):
    mp = pa.MixedPrecision(f"fp8-delayed:keep=:history_len=4:reduce_amax={reduce_amax}", framework="jax")
    f = mp.autocast(loss_fn)
    p = init([16, 8, 4])
    (x, y), (x2, y2) = batches(2, seed=5)
    xs, ys = jnp.stack([x, x2 * 100]), jnp.stack([y, y2])
    state = mp.init(f, p, x, y)

    def step(x, y):
        return mp.value_and_grad(f, axis_name="b")(p, x, y, state=state)[2]

    after = jax.jit(jax.vmap(step, axis_name="b"))(xs, ys).recipe.delayed
    recorded = np.asarray(after["fc0|input"]["history"])[:, -1]  # this step's amax, rolled to the end
    if reduce_amax:
        assert list(recorded) == [float(np.abs(xs).max())] * 2
        assert all(same(e["scale"][0], e["scale"][1]) for e in after.values())
    else:  # each replica keeps its own
        assert list(recorded) == [float(np.abs(x).max()), float(np.abs(xs[1]).max())]
        assert not same(after["fc0|input"]["scale"][0], after["fc0|input"]["scale"][1])


# delayed scales; NVFP4 with its 16x16 weights (three backward seeds per matmul), the forward also
# stochastic (two more) and Hadamard tiles: each block recipe compiles slowly. The 1-d weights' extra seed
# (W^T for the input gradient, as torch/recipe.py draws it): bit for bit with MX and NVFP4 in
# test_a_stateful_matmul_is_the_quantized_gemms_with_torchs_seeds
TORCH_CASES = ["fp8-delayed:history_len=2", "nvfp4:hadamard=true:forward_rounding=stochastic"]


@pytest.mark.parametrize("spec", TORCH_CASES)
def test_steps_draw_the_seeds_and_scales_of_torchs_recipe(spec):
    """The same two-layer network in torch and JAX, three steps: the weight gradients agree up to the
    order XLA and torch sum products in (rounding with other seeds or scales moves them by ~10%)."""
    torch = require("torch")
    spec += ":keep=:compute_dtype=fp32"
    rng = np.random.default_rng(50)
    w0, w1 = (rng.standard_normal(s).astype(np.float32) / 4 for s in ((16, 32), (32, 8)))
    xs = [rng.standard_normal((24, 16)).astype(np.float32) * 4.0**k for k in range(3)]
    t = rng.standard_normal((24, 8)).astype(np.float32)

    def jax_loss(p, x, t):
        with jax.named_scope("fc0"):
            h = jnp.tanh(x @ p["w0"])
        with jax.named_scope("fc1"):
            return jnp.mean((h @ p["w1"] - t) ** 2)

    mp = pa.MixedPrecision(spec, framework="jax")
    f, state, p = mp.autocast(jax_loss), mp.init(), {"w0": jnp.asarray(w0), "w1": jnp.asarray(w1)}
    step = jax.jit(lambda x, state: mp.value_and_grad(f)(p, x, t, state=state))
    tmp = pa.MixedPrecision(spec, framework="torch")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8, bias=False))  # fmt: skip
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(w0.T))
        model[2].weight.copy_(torch.from_numpy(w1.T))
    tmp.watch(model)
    for x in xs:
        (_, grads), _, state = step(jnp.asarray(x), state)
        model.zero_grad()
        with tmp.autocast():  # the input needs a gradient, as every JAX input has one
            loss = torch.mean((model(torch.from_numpy(x).requires_grad_()) - torch.from_numpy(t)) ** 2)
        loss.backward()
        for got, layer in zip((grads["w0"], grads["w1"]), (model[0], model[2])):
            want = layer.weight.grad.T.numpy()
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_a_recipe_that_quantizes_nothing_warns_and_records_why():
    mp = pa.MixedPrecision("fp8-tensorwise:keep=fc*", framework="jax")
    p, x, y = init([16, 32, 4]), jnp.ones((8, 16)), jnp.ones((8, 4))
    with pytest.warns(RecipeWarning, match="quantizes no layer of this JAX model"):
        mp.autocast(loss_fn)(p, x, y)
    assert mp.recipe_layers.as_dict() == {"recipe": "fp8-tensorwise:keep=fc*", "quantized": [],
                                          "kept": {"fc0": "keep 'fc*'", "fc1": "keep 'fc*'"}}  # fmt: skip
    mp = pa.MixedPrecision("mxfp8", framework="jax")
    with pytest.raises(PolyampError, match="known after mp.watch"):
        mp.recipe_layers  # noqa: B018
    jax.eval_shape(mp.autocast(loss_fn), init([16, 32, 32, 4]), x, y)
    assert mp.recipe_layers.quantized == ["fc1"]
    assert mp.recipe_layers.kept == {"fc0": "keep 'first'", "fc2": "keep 'last'"}


# MX's blocks along K, which a wrongly transposed weight would change (the forms are found before a recipe
# applies; per-tensor scales see no layout, and NVFP4's 16x16 weight tiles hold the same elements for W
# and W^T)
@pytest.mark.parametrize("spec", ["mxfp8"])
def test_the_dense_forms_of_real_layers_are_the_same_quantized_gemm(spec):
    # Equinox's vmapped W @ x, x @ W.T, and an NNX LinearGeneral's 3-d kernel (before: run as bf16-mixed)
    eqx = require("equinox")
    mp = pa.MixedPrecision(f"{spec}:keep=", framework="jax")
    r = recipes.parse_recipe(f"{spec}:keep=")
    x, w = jnp.asarray(wide((8, 64), 6)), jnp.asarray(wide((96, 64), 7) / 8)  # w: [N, K], torch's layout
    f32 = jnp.float32
    want = jr.dot(r, jnp.bfloat16, f32, f32)(x, w.T)
    lin = eqx.nn.Linear(64, 96, use_bias=False, key=jax.random.PRNGKey(0))
    lin = eqx.tree_at(lambda m: m.weight, lin, w)
    got = {"eqx W @ x": mp.autocast(lambda m, x: jax.vmap(m)(x))(lin, x),
           "x @ W.T": mp.autocast(lambda w, x: x @ w.T)(w, x),
           "3-d kernel": mp.autocast(lambda k, x: jnp.einsum("bk,knh->bnh", x, k))(w.T.reshape(64, 8, 12),
                                                                                    x)}  # fmt: skip
    assert same(got["3-d kernel"].reshape(8, 96), want)
    for form in ("eqx W @ x", "x @ W.T"):
        assert same(got[form], want), form
    g_want = jax.grad(lambda w: jnp.sum(jr.dot(r, jnp.bfloat16, f32, f32)(x, w.T) ** 2))(w)
    g_got = jax.grad(lambda m: jnp.sum(mp.autocast(lambda m, x: jax.vmap(m)(x))(m, x) ** 2))(lin).weight
    assert same(g_got, g_want)
