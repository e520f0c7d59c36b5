"""The doctor's JAX taps (polyamp.jax.doctor) against the numpy core, and keep_fp32 in mp.autocast,
on real JAX and optax."""

import math

import ml_dtypes
import numpy as np
import pytest
from frameworks import require

jax = require("jax")
optax = require("optax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend import core as jcore  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.compare import jax as cj  # noqa: E402
from polyamp.compare.workloads import get_workload  # noqa: E402
from polyamp.doctor import KINDS, N_BINS, LogHistogram, Observation, update_ratio_histogram  # noqa: E402
from polyamp.jax.binning import _CHUNK  # noqa: E402
from polyamp.jax.doctor import collect, histogram, ratio_histogram  # noqa: E402

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)
# one optimizer object per kind for the whole module: the doctor caches its compiled step per loss
# function, optimizer, structure and types, so the tests of the same network share one compilation
ADAM, SGD = optax.adam(1e-2), optax.sgd(0.1)


def normal(rng, shape, scale=1.0):
    """Standard normal float32 values from a numpy generator (``jax.random.normal`` would compile a
    program per shape)."""
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def reference(x) -> LogHistogram:
    return LogHistogram.of(np.asarray(x))


def wide(n, dtype, seed):
    """Random magnitudes over most of the dtype's exponent range, both signs."""
    rng = np.random.default_rng(seed)
    info = ml_dtypes.finfo(dtype)
    e = rng.uniform(math.log2(float(info.smallest_normal)) - 8, math.log2(float(info.max)) - 1, n)
    return (np.sign(rng.standard_normal(n)) * np.exp2(e)).astype(dtype)


# -- binning in XLA equals the numpy core ------------------------------------------------------------
@pytest.mark.parametrize("extra", [0, 1, -7])
def test_arrays_binned_in_chunks_equal_the_numpy_core(extra):
    """Arrays over _CHUNK elements are binned chunk by chunk, the last chunk overlapping the one before."""
    rng = np.random.default_rng(extra + 10)
    n = (1 if extra == 1 else 2) * _CHUNK + extra
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-140, 120, n))).astype(np.float32)
    x[-3:], x[n - _CHUNK + 5], x[_CHUNK - 1] = [np.inf, 0.0, 1e-42], np.nan, 3e38  # overlap, edge
    assert histogram(jnp.asarray(x)) == reference(x)
    w = rng.standard_normal(n).astype(np.float32)
    w[-1] = 0.0
    assert ratio_histogram(jnp.asarray(x), jnp.asarray(w)) == update_ratio_histogram(x, w)


def test_float64_histograms_with_x64():
    with jax.enable_x64(True):
        specials = [0.0, -0.0, np.inf, np.nan, 5e-324, 1e-310, 1e300]
        x = np.concatenate([wide(5000, np.float64, seed=3), specials])
        assert histogram(jnp.asarray(x)) == reference(x)
        w = wide(3000, np.float64, seed=4)
        u = w * np.exp2(np.random.default_rng(5).uniform(-60, 10, 3000))
        u[:4], w[4:8] = [0.0, np.nan, 5e-324, 1e300], [0.0, np.inf, 1e-310, 1e-300]
        assert ratio_histogram(jnp.asarray(u), jnp.asarray(w)) == update_ratio_histogram(u, w)


def test_fp8_and_bfloat16_subnormals_are_widened_exactly():
    x = np.clip(wide(3000, np.float32, seed=7), -400, 400)
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        a = x.astype(dtype)
        assert histogram(jnp.asarray(a)) == reference(a.astype(np.float32))
    sub = np.array([1e-39, -5e-41, 9.2e-41, 1.0], np.float32).astype(BF16)  # bfloat16 subnormals
    assert histogram(jnp.asarray(sub)) == reference(sub)
    with pytest.raises(PolyampError, match="cannot bin a int32 array"):
        histogram(jnp.ones(3, jnp.int32))
    with pytest.raises(PolyampError, match="x: expected a jax array, got numpy.ndarray"):
        histogram(np.ones(3, np.float32))


def test_only_counts_and_a_few_scalars_reach_the_host(monkeypatch):
    """Every host copy of a jax array goes through ``_value`` or ``__array__``: record their shapes, which
    do not grow with the tensors."""
    cls = type(jnp.ones(1))
    seen = []
    value = cls.__dict__["_value"]
    array = cls.__array__
    monkeypatch.setattr(cls, "_value", property(lambda self: seen.append(self.shape) or value.fget(self)))
    monkeypatch.setattr(cls, "__array__", lambda x, *a, **k: seen.append(x.shape) or array(x, *a, **k))
    shapes = []
    # the network of the tests below (their compiled step: the doctor caches it), and one whose tensors
    # are over _CHUNK elements: the chunked loop too
    for n_in, hidden, n in ((8, 32, 16), (512, 600, 512)):
        params, batch = tiny_params(n_in=n_in, hidden=hidden), tiny_batch(n_in=n_in, n=n)
        x = batch[0].at[0, 0].set(1e-40)  # subnormals, zeros and inf take the other branches
        seen.clear()
        obs = collect(params, (x, batch[1]), tiny_loss, optimizer=ADAM)
        shapes.append(sorted(set(seen)))
    # per (layer, kind): its counts (N_BINS and three extra slots) and up to four extremes
    assert shapes[0] == shapes[1] == [(len(obs), 4), (len(obs), N_BINS + 3)]
    seen.clear()
    histogram(jnp.asarray([0.0, 1e-41, math.inf] * 5000))
    assert sorted(set(seen)) == [(2,), (N_BINS + 3,)]


# -- collect: a small network of named scopes --------------------------------------------------------
def tiny_params(n_in=8, hidden=32, seed=3):
    rng = np.random.default_rng(seed)
    return {"fc0": {"w": normal(rng, (n_in, hidden), 1 / math.sqrt(n_in)), "b": jnp.zeros(hidden)},
            "fc1": {"w": normal(rng, (hidden, 4), 1 / math.sqrt(hidden)),
                    "b": normal(rng, (4,), 0.1)}}  # fmt: skip


def tiny_batch(n_in=8, n=16, seed=4):
    rng = np.random.default_rng(seed)
    return normal(rng, (n, n_in)), normal(rng, (n, 4))


def tiny_forward(p, x):
    with jax.named_scope("fc0"):
        h = x @ p["fc0"]["w"] + p["fc0"]["b"]
    h = jax.nn.gelu(h)  # outside any scope: no layer
    with jax.named_scope("fc1"):
        return h @ p["fc1"]["w"] + p["fc1"]["b"]


def tiny_loss(p, batch):
    x, y = batch
    return jnp.mean((tiny_forward(p, x) - y) ** 2)


def bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)] + [str(jax.tree.structure(tree))]


@pytest.mark.parametrize("steps, live_state", [(1, False), (3, True)])
def test_collect_leaves_params_and_optimizer_state_unchanged(steps, live_state):
    params, batch = tiny_params(), tiny_batch()
    adam = ADAM
    state = adam.init(params)

    @jax.jit  # one program, not an eager dispatch of each operation
    def adam_step(params, state):
        updates, state = adam.update(jax.grad(tiny_loss)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(2):  # a live state with non-zero moments and count
        params, state = adam_step(params, state)
    before = bits(params), bits(state), bits(batch)
    optimizer = (adam, state) if live_state else adam
    obs = collect(params, batch, tiny_loss, steps=steps, optimizer=optimizer)
    assert (bits(params), bits(state), bits(batch)) == before
    assert {o.kind for o in obs} == set(KINDS)
    assert obs == collect(params, batch, tiny_loss, steps=steps, optimizer=optimizer)  # deterministic


def test_a_live_optimizer_state_is_the_one_stepped_from():
    params, batch = tiny_params(), tiny_batch()
    adam = ADAM
    state = adam.init(params)
    updates, state = adam.update(jax.tree.map(jnp.ones_like, params), state, params)  # moments of 1
    fresh = {(o.layer, o.kind): o.hist for o in collect(params, batch, tiny_loss, optimizer=adam)}
    live = {(o.layer, o.kind): o.hist for o in collect(params, batch, tiny_loss, optimizer=(adam, state))}
    assert fresh["fc0", "weight"] == live["fc0", "weight"]
    assert fresh["fc0", "update_ratio"] != live["fc0", "update_ratio"]
    with pytest.raises(PolyampError, match="opt_state does not match optimizer.init"):
        collect(params, batch, tiny_loss, optimizer=(optax.sgd(0.1, momentum=0.9), state))


def test_collect_leaves_everything_as_it_was_when_the_loss_raises():
    params, batch = tiny_params(), tiny_batch()
    state = optax.adam(1e-2).init(params)
    before = bits(params), bits(state)

    def failing(p, b):
        tiny_loss(p, b)
        raise ZeroDivisionError("user loss failed")

    with pytest.raises(ZeroDivisionError, match="user loss failed"):
        collect(params, batch, failing, steps=3, optimizer=(optax.adam(1e-2), state))
    assert (bits(params), bits(state)) == before


def test_observations_equal_the_numpy_core_on_the_same_tensors_in_layer_order():
    params, (x, y) = tiny_params(), tiny_batch()
    obs = collect(params, (x, y), tiny_loss)

    @jax.jit
    def by_hand(p):  # the same step, each layer's output perturbed by a zero to get its gradient
        def f(p, e):
            h0 = x @ p["fc0"]["w"] + p["fc0"]["b"] + e[0]
            h1 = jax.nn.gelu(h0) @ p["fc1"]["w"] + p["fc1"]["b"] + e[1]
            return jnp.mean((h1 - y) ** 2), (h0, h1)

        zeros = [jnp.zeros((16, 32)), jnp.zeros((16, 4))]
        (_, outs), (grads, grad_outs) = jax.value_and_grad(f, (0, 1), has_aux=True)(p, zeros)
        return outs, grad_outs, grads

    (h0, h1), (g0, g1), grads = jax.device_get(by_hand(params))

    def merged(*arrays):
        hs = [reference(a) for a in arrays]
        return hs[0].merge(*hs[1:])

    want = [
        ("fc0", "output", merged(h0)), ("fc0", "grad_output", merged(g0)),
        ("fc0", "weight", merged(params["fc0"]["b"], params["fc0"]["w"])),
        ("fc0", "grad_weight", merged(grads["fc0"]["b"], grads["fc0"]["w"])),
        ("fc1", "output", merged(h1)), ("fc1", "grad_output", merged(g1)),
        ("fc1", "weight", merged(params["fc1"]["b"], params["fc1"]["w"])),
        ("fc1", "grad_weight", merged(grads["fc1"]["b"], grads["fc1"]["w"])),
    ]  # fmt: skip
    assert [(o.layer, o.kind) for o in obs] == [(layer, kind) for layer, kind, _ in want]
    for o, (_, _, hist) in zip(obs, want):
        assert isinstance(o, Observation) and o.hist == hist, (o.layer, o.kind)
    assert obs[0].hist.zeros == 0 and obs[2].hist.zeros == 32  # fc0's bias starts at zero


def test_steps_merge_into_one_observation_per_layer_and_kind():
    params, batch = tiny_params(), tiny_batch()
    for optimizer in (SGD, None):
        obs = collect(params, batch, tiny_loss, steps=3, optimizer=optimizer)
        pairs = [(o.layer, o.kind) for o in obs]
        assert len(pairs) == len(set(pairs))
        table = {(o.layer, o.kind): o.hist for o in obs}
        assert table["fc0", "output"].total == 3 * 16 * 32
        assert table["fc0", "weight"].total == 3 * (8 * 32 + 32)
        assert ("fc0", "update_ratio") in table if optimizer else ("fc0", "update_ratio") not in table
    one = {(o.layer, o.kind): o.hist for o in collect(params, batch, tiny_loss)}
    assert table["fc0", "grad_output"] == one["fc0", "grad_output"].merge(*[one["fc0", "grad_output"]] * 2)


def test_update_ratios_are_the_update_applied():
    params, (x, y) = tiny_params(), tiny_batch()  # test_steps_merge_into_one_observation_per_layer_and_kind's
    sgd = SGD
    table = {(o.layer, o.kind): o.hist for o in collect(params, (x, y), tiny_loss, optimizer=sgd)}
    # the step compiled, as the doctor's is: an eager one may round a gradient differently by an ulp
    grads = jax.jit(jax.grad(tiny_loss))(params, (x, y))
    new = jax.jit(lambda p, g: optax.apply_updates(p, sgd.update(g, sgd.init(p))[0]))(params, grads)
    for layer in ("fc0", "fc1"):
        old = [np.asarray(params[layer][k]) for k in ("b", "w")]
        applied = [update_ratio_histogram(np.asarray(new[layer][k]) - o, o) for k, o in zip(("b", "w"), old)]
        assert table[layer, "update_ratio"] == applied[0].merge(applied[1])  # exactly, the update as applied
        ideal = [update_ratio_histogram(np.float32(0.1) * np.asarray(grads[layer][k]), o)
                 for k, o in zip(("b", "w"), old)]  # fmt: skip
        ideal = ideal[0].merge(ideal[1])  # lr * grad, up to the rounding of w - lr * g to w's ulp
        got = table[layer, "update_ratio"]
        assert got.total == ideal.total and got.apart == ideal.apart
        assert np.abs(np.cumsum(got.counts) - np.cumsum(ideal.counts)).max() <= 0.02 * got.total
    assert table["fc0", "update_ratio"].apart == 32  # fc0's bias is zero: no ratio to its weight


def test_layer_names_follow_named_scopes_through_jit_remat_custom_jvp_loops_and_cond():
    rng = np.random.default_rng(0)
    params = {"embed": normal(rng, (10, 8)), "block": [{"w": normal(rng, (8, 8), 0.3)} for _ in (1, 2)],
              "cell": normal(rng, (3, 8, 8), 0.3), "unused": jnp.ones(5),
              "step": jnp.array(7, jnp.int32)}  # fmt: skip

    @jax.jit
    def ff(p, h):  # a jitted function: the scopes inside it are seen under the caller's
        with jax.named_scope("ff"):
            return jax.nn.relu(h @ p["w"])  # relu: a custom_jvp function

    def loss(p, ids):
        h = p["embed"][ids]  # read outside any scope: a layer named by its path
        with jax.named_scope("block"):
            for i, q in enumerate(p["block"]):
                with jax.named_scope(str(i)):
                    h = ff(q, h)
            h = jax.checkpoint(jax.nn.softmax)(h)  # the block's own equations, remat inlined
        with jax.named_scope("rnn"):
            h, _ = lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, p["cell"])  # one equation
            h = lax.cond(jnp.sum(h) > 0, lambda h: 2 * h, lambda h: -h, h)
        return jnp.mean(h**2) * p["step"].astype(jnp.float32)

    ids = jnp.array([[1, 2, 3], [4, 5, 6]])
    obs = collect(params, ids, loss, optimizer=SGD)
    layers = list(dict.fromkeys(o.layer for o in obs))
    assert layers == ["embed", "block/0/ff", "block/1/ff", "block", "rnn", "unused"]
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert ("embed", "output") not in table and table["embed", "grad_weight"].zeros > 0  # rows not looked up
    assert table["block/0/ff", "output"].total == 2 * 3 * 8
    assert table["block/0/ff", "output"].zeros > 0  # relu's
    assert table["rnn", "weight"].total == 3 * 64 and table["rnn", "output"].total == 2 * 3 * 8
    assert table["unused", "grad_weight"].zeros == 5 and ("unused", "output") not in table
    assert table["block/1/ff", "weight"].total == 64 and table["block", "output"].total == 2 * 3 * 8

    single = collect(jnp.ones(3), jnp.ones(3), lambda w, x: jnp.sum(w * x))
    assert {o.layer for o in single} == {"params"}


def compare_network(name):
    """(workload, params, batch, loss(params, x, y), observations) of a compare workload (quick)."""
    wl = get_workload(name, quick=True)
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    x, y = cj.inputs(wl, *wl.batch_at(0))

    def loss(p, x, y):
        return cj.loss_fn(wl, p, x, y)

    return wl, params, (x, y), loss, collect(params, (x, y), lambda p, b: loss(p, *b))


@pytest.fixture(scope="module")
def charlm():
    return compare_network("charlm")


def test_the_compare_networks_have_named_layers(charlm):
    block = ["ln1", "attn/q", "attn", "attn/k", "attn/v", "attn/o", "", "ln2", "ff1", "ff2"]
    charlm_layers = ["embed", "pos", *(f"block0/{n}".rstrip("/") for n in block), "lnf", "head"]
    mlp = compare_network("mlp")
    for (wl, _, _, _, obs), want in ((mlp, ["fc0", "fc1", "fc2"]), (charlm, charlm_layers)):
        assert list(dict.fromkeys(o.layer for o in obs)) == want
        weights = sum(o.hist.total for o in obs if o.kind == "weight")
        assert weights == sum(v.size for v in wl.weights.values())
    kinds = {o.kind for o in charlm[4] if o.layer == "block0/attn"}
    assert kinds == {"output", "grad_output"}  # the attention's own equations: no weights


def test_nonfinite_outputs_are_observed_not_refused():
    params = tiny_params()
    params["fc0"]["w"] = params["fc0"]["w"].at[:].set(3e38)
    # the shapes and types of tiny_batch: the compiled step of the tests above
    obs = collect(params, (jnp.ones((16, 8)), jnp.ones((16, 4))), tiny_loss)
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["fc0", "output"].nonfinite == 16 * 32 and table["fc1", "output"].nonfinite == 16 * 4


def test_the_doctor_recommendation_applies_to_autocast_as_is():
    """polyamp.doctor on a params pytree: a layer whose outputs overflow fp16 is kept in float32, and
    that name is a keep_fp32 that mp.autocast takes."""
    params = tiny_params()
    params["fc0"]["w"] = params["fc0"]["w"] * 4e4  # fc0's outputs beyond half fp16's max

    def loss(p, batch):
        x, y = batch
        with jax.named_scope("fc0"):
            h = x @ p["fc0"]["w"] + p["fc0"]["b"]
        with jax.named_scope("fc1"):
            out = (h * 1e-5) @ p["fc1"]["w"] + p["fc1"]["b"]
        return jnp.mean((out - y) ** 2)

    report = pa.doctor(params, tiny_batch(), loss)
    assert report.framework == "jax" and report.policy == "fp16-mixed" and report.keep_fp32 == ("fc0",)
    mp = pa.MixedPrecision(report.policy, framework="jax", keep_fp32=report.keep_fp32)
    assert dot_dtypes(mp.autocast(loss), params, tiny_batch()) == {(8, 32): F32, (32, 4): F16}


# -- bad input: one clear PolyampError each --------------------------------------------------------
@pytest.mark.parametrize(
    "case, match",
    [
        (lambda p, b: collect({}, b, tiny_loss), "has no leaves"),
        (lambda p, b: collect({"n": jnp.ones(3, jnp.int32)}, b, tiny_loss), "no floating-point leaf"),
        (lambda p, b: collect(jax.tree.map(np.asarray, p), b, tiny_loss), "leaf numpy.ndarray; convert"),
        (lambda p, b: collect(object(), b, tiny_loss), "params pytree of jax arrays"),
        (lambda p, b: collect(p, b, tiny_loss, steps=0), "steps must be a whole number >= 1, got 0"),
        (lambda p, b: collect(p, b, tiny_loss, steps=1.0), "steps must be a whole number"),
        (lambda p, b: collect(p, b, tiny_loss, steps=True), "steps must be a whole number"),
        (lambda p, b: collect(p, b), r"loss_fn is required.*loss_fn\(params, batch\)"),
        (lambda p, b: collect(p, b, "mse"), "loss_fn must be callable"),
        (
            lambda p, b: collect(p, (np.asarray(b[0]), b[1]), tiny_loss),
            "expected a pytree of jax arrays, got numpy.ndarray; convert it with jnp.asarray",
        ),
        (lambda p, b: collect(p, (jnp.ones((16, 5)), b[1]), tiny_loss), r"failed on the batch.*\(16, 5\)"),
        (
            lambda p, b: collect(p, b, lambda p, b: (tiny_forward(p, b[0]) - b[1]) ** 2),
            r"scalar floating-point loss, got float32\[16, 4\]",
        ),
        (lambda p, b: collect(p, b, lambda p, b: jnp.sum(b[0] > 0)), "scalar floating-point loss, got int32"),
        (lambda p, b: collect(p, b, lambda p, b: 1.0), "does not depend on any floating-point leaf"),
        (lambda p, b: collect(p, b, lambda p, b: jnp.mean(b[0])), "does not depend"),
        (lambda p, b: collect(p, b, tiny_loss, optimizer=object()), "optimizer: expected an optax"),
        (lambda p, b: collect(p, b, tiny_loss, optimizer=(optax.sgd(0.1), None)), "opt_state does not match"),
    ],
)
def test_bad_input_is_one_clear_error(case, match):
    params, batch = tiny_params(), tiny_batch()
    before = bits(params)
    with pytest.raises(PolyampError, match=match):
        case(params, batch)
    assert bits(params) == before


def test_a_batch_or_model_of_another_framework_is_refused():
    torch = require("torch")
    with pytest.raises(PolyampError, match=r"got torch.Tensor; convert it with jnp.asarray\(t.numpy\(\)\)"):
        collect(tiny_params(), (torch.zeros(16, 8), jnp.zeros((16, 4))), tiny_loss)
    with pytest.raises(PolyampError, match="model: expected the params pytree.*got a leaf torch.nn"):
        collect(torch.nn.Linear(8, 4), tiny_batch(), tiny_loss)


# -- keep_fp32 in mp.autocast -------------------------------------------------------------------------
def scoped(p, x):
    """Three layers of distinct shapes: fc0 (8 -> 32), block/fc1 (32 -> 16), block/head (16 -> 4)."""
    with jax.named_scope("fc0"):
        h = jax.nn.gelu(x @ p["w0"])
    with jax.named_scope("block"):
        with jax.named_scope("fc1"):
            h = jnp.tanh(h @ p["w1"])
        h = jax.jit(lambda h: h @ p["w2"])(h)  # the block's own equation, inside a jit
    return jnp.mean(h**2)


def scoped_params():
    rng = np.random.default_rng(9)
    return {"w0": normal(rng, (8, 32), 0.3), "w1": normal(rng, (32, 16), 0.2),
            "w2": normal(rng, (16, 4), 0.3)}  # fmt: skip


def backward_dots(fn, *args):
    """({shapes of the operands and result}, input dtype) of each dot_general of fn's jaxpr."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                shapes = {tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars)}
                yield shapes, np.dtype(eqn.invars[0].aval.dtype)
            for sub in jcore.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    found = list(walk(jax.make_jaxpr(fn)(*args).jaxpr))
    assert len(found) >= 8  # 3 forward, 3 weight gradients, 2 input gradients
    return found


def dot_dtypes(fn, *args):
    """{shape of the right operand: input dtype} of every forward dot_general of fn's jaxpr."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                a, b = (v.aval for v in eqn.invars)
                assert a.dtype == b.dtype, eqn
                yield b.shape, np.dtype(a.dtype)
            for sub in jcore.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return dict(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("policy, low", [("bf16-mixed", BF16), ("fp16-mixed", F16)])
def test_a_kept_layer_computes_in_float32_and_the_others_in_16_bit(policy, low):
    p, x = scoped_params(), normal(np.random.default_rng(1), (2, 8))
    shapes = {"fc0": (8, 32), "block/fc1": (32, 16), "block": (16, 4)}
    default = pa.MixedPrecision(policy, framework="jax")
    assert default.keep_fp32 == ()
    assert dot_dtypes(default.autocast(scoped), p, x) == dict.fromkeys(shapes.values(), low)
    keeps = (("block/fc1", ["block/fc1"]), (("block",), ["block/fc1", "block"]), (["fc0"], ["fc0"]))
    mps = [pa.MixedPrecision(policy, framework="jax", keep_fp32=keep) for keep, _ in keeps]
    # gradients flow, under jit: the three keeps' and the float32 gradients in one compiled program
    fns = [*(mp.autocast(scoped) for mp in mps), scoped]
    *every, exact = jax.jit(lambda p, x: [jax.grad(f)(p, x) for f in fns])(p, x)
    for (keep, f32), mp, grads in zip(keeps, mps, every):
        want = {shape: F32 if name in f32 else low for name, shape in shapes.items()}
        assert dot_dtypes(mp.autocast(scoped), p, x) == want, keep
        for name in ("w0", "w1", "w2"):
            assert grads[name].dtype == F32
            scale = float(jnp.abs(exact[name]).max())
            np.testing.assert_allclose(grads[name], exact[name], rtol=0.1, atol=0.03 * scale)
        # and the kept layers' backward matmuls run in float32 too
        for operands, dtype in backward_dots(jax.grad(mp.autocast(scoped)), p, x):
            layer = next(n for n, shape in shapes.items() if {shape, shape[::-1]} & operands)
            assert dtype == (F32 if layer in f32 else low), (keep, operands, dtype)


def test_keep_fp32_names_that_match_no_scope_raise_when_traced():
    p, x = scoped_params(), jnp.ones((4, 8))
    mp = pa.MixedPrecision("bf16-mixed", framework="jax", keep_fp32=("block/fc1", "fc9", "block/fc"))
    f = mp.autocast(scoped)  # names are checked when the function is traced
    with pytest.raises(PolyampError, match=r"'fc9', 'block/fc'.* its layers: 'fc0', 'block/fc1', 'block'"):
        f(p, x)
    with pytest.raises(PolyampError, match="'fc9'"):
        jax.jit(f)(p, x)
    ignored = pa.MixedPrecision("float32", framework="jax", keep_fp32=("fc9",))
    assert ignored.autocast(scoped) is scoped  # float32: a no-op
    with pytest.raises(PolyampError, match="keep_fp32 must be non-empty layer names"):
        pa.MixedPrecision("bf16-mixed", framework="jax", keep_fp32=("",))


def test_keep_fp32_takes_a_parameter_layer_that_no_scope_reads():
    """A params leaf first read outside any scope is a doctor layer named by its path; keeping it keeps
    the equations outside any scope that read it, also inside a jit."""
    p = {"w": scoped_params()["w0"], "head": {"w": scoped_params()["w2"][:4].T @ jnp.ones((4, 4))}}
    x = jnp.ones((2, 8))

    def loss(p, x):
        h = jnp.tanh(x @ p["w"])
        with jax.named_scope("head"):
            return jnp.mean((h[:, :4] @ p["head"]["w"]) ** 2)

    assert [o.layer for o in collect(p, x, loss) if o.kind == "weight"] == ["w", "head"]
    mp = pa.MixedPrecision("bf16-mixed", framework="jax", keep_fp32=("w",))
    for f in (loss, jax.jit(loss)):
        assert dot_dtypes(mp.autocast(f), p, x) == {(8, 32): F32, (4, 4): BF16}
    wrong = pa.MixedPrecision("bf16-mixed", framework="jax", keep_fp32=("head/w",))  # read inside "head"
    with pytest.raises(PolyampError, match=r"'head/w', which match no layer.* its layers: 'head', 'w'"):
        wrong.autocast(loss)(p, x)


def test_keep_fp32_takes_the_doctor_names_of_the_compare_charlm(charlm):
    _, params, (x, y), loss, obs = charlm
    assert {"block0/attn", "block0/ff1", "head"} <= {o.layer for o in obs}
    mp = pa.MixedPrecision("bf16-mixed", framework="jax", keep_fp32=("block0/attn", "head"))
    forward = [dtype for _, dtype in backward_dots(mp.autocast(loss), params, x, y)]
    assert sorted(forward) == sorted([F32] * (4 + 2 + 1) + [BF16] * 2)  # qkvo, 2 products, head | ff1, ff2
    both = [dtype for _, dtype in backward_dots(jax.grad(mp.autocast(loss)), params, x, y)]
    assert both.count(F32) == 7 * 3 and both.count(BF16) == 2 * 3  # forward, and both operands' gradients


def test_a_recipe_measures_only_what_it_would_quantize():
    """recipe:mxfp8's rows: each matmul's weight (in its GEMM layout, without the bias) and output
    gradient, and the outputs that are a matmul's input; a block format measures every tapped tensor."""
    from polyamp.doctor.blocks import measure, parse

    def loss(p, batch):
        x, y = batch
        with jax.named_scope("fc1"):
            h = x @ p["w1"] + p["b1"]
        with jax.named_scope("norm"):
            h = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * p["g"]
        with jax.named_scope("act"):
            h = jnp.tanh(h)
        with jax.named_scope("head"):
            out = h @ p["w2"].T  # a (out, in) weight: x @ W.T
        return jnp.mean((out - y) ** 2)

    # square 40x40 matrices: the tapped tensors have two shapes, (40, 40) and (40,), so each measured cast
    # compiles once or twice (a weight measured as it is, not in its GEMM layout, still gives other blocks)
    rng = np.random.default_rng(2)
    params = {"w1": normal(rng, (40, 40), 1 / 3), "b1": jnp.ones(40), "g": jnp.ones(40),
              "w2": normal(rng, (40, 40), 1 / 6)}  # fmt: skip
    batch = (normal(rng, (40, 40)), normal(rng, (40, 40)))
    # the block format with the recipe's scale rule: their e4m3 casts are one program
    obs = collect(params, batch, loss, measure=(parse("recipe:mxfp8"), parse("mxfp8_e4m3:rceil")))
    recipe = {(o.layer, o.kind) for o in obs if "recipe:mxfp8" in o.measured}
    assert recipe == {("fc1", "weight"), ("fc1", "grad_output"), ("head", "weight"), ("head", "grad_output"),
                      ("act", "output")}  # fmt: skip
    assert {(o.layer, o.kind) for o in obs if "mxfp8_e4m3:rceil" in o.measured} == {
        (o.layer, o.kind) for o in obs if o.kind != "update_ratio"}
    cast = parse("recipe:mxfp8").casts["weight"]
    rows = {(o.layer, o.kind): o for o in obs}
    for layer, gemm in (("fc1", params["w1"].T), ("head", params["w2"])):  # (N, K): blocks along K
        want = measure(np.asarray(gemm), cast).to_json()  # sums in another order: to rounding
        assert rows[layer, "weight"].measured["recipe:mxfp8"].to_json() == pytest.approx(want), layer
