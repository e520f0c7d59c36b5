"""Emulated fp8 / MX / NVFP4 training in MXNet Gluon (``polyamp/mxnet/quantize.py``, ``recipe.py``; run in
.venv-mxnet): the quantization against the numpy core bit for bit, the three GEMMs against a hand
computation, keep lists, checkpoints of the recipe state, training, and the errors.

MXNet's AMP is process-wide: a recipe's MixedPrecision sets up bf16-mixed once, before any network."""

import json
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import PolyampError, UnsupportedError, recipes
from polyamp.numerics import BLOCK_FORMATS, FORMATS, hadamard_tiles
from polyamp.recipe_layers import RecipeWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mx = require("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet.contrib import amp  # noqa: E402
from mxnet_caps import bf16_or_none, needs_bf16  # noqa: E402

MP = bf16_or_none("fp8-tensorwise")  # amp.init, before any network exists (None: no bf16 here)
from polyamp.mxnet import quantize as mq  # noqa: E402
from polyamp.mxnet import recipe as mr  # noqa: E402
from polyamp.mxnet.keep import dtype_name  # noqa: E402

RECIPE_NAMES = list(recipes.RECIPES)
L2 = gluon.loss.L2Loss()
BF16 = amp.amp.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")


def host(t) -> np.ndarray:
    if np.dtype(t.dtype).names == ("bfloat16",):
        t = mx.nd.cast(t, dtype="float32")  # exact (amp_cast makes -0 +0 without AVX-512)
    return t.asnumpy()


def same(got, want) -> bool:
    """Bit for bit and the same dtype, NaN payloads aside."""
    a, b = host(got), np.asarray(want)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes()


def specials(n, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(dtype)
    tiny = 1e-42 if dtype == np.float32 else 1e-310  # a subnormal of x's dtype
    x[:9] = [0.0, -0.0, math.inf, -math.inf, math.nan, tiny, 2.5, -0.75, 1.5]  # 2.5, 0.75, 1.5: ties
    return x


def mlp(seed=0, width=48, hybrid=False):
    rng = np.random.default_rng(seed)
    net = gluon.nn.HybridSequential() if hybrid else gluon.nn.Sequential()
    for units, act in ((width, "relu"), (width, "relu"), (width, "relu"), (4, None)):
        net.add(gluon.nn.Dense(units, activation=act, in_units=16 if not len(net) else width))
    net.initialize()
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(-0.3, 0.3, p.shape).astype(np.float32)))
    return net


def batches(n, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        yield mx.nd.array(x), mx.nd.array(np.sin(x[:, :4]))


def train(net, mp, steps, start=0, trainer=None):
    trainer = trainer or mp.trainer(gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-2},
                                                  update_on_kvstore=False))  # fmt: skip
    losses = []
    for x, y in list(batches(start + steps))[start:]:
        with autograd.record():
            loss = L2(net(x), y).mean()
            with mp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        mp.step(trainer, 1)
        losses.append(float(loss.asscalar()))
    return losses, trainer


# -- quantization, bit for bit against the numpy core ----------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_equals_the_core_for_every_format_rounding_and_overflow(fmt, dtype):
    x = specials(3000, seed=2, dtype=dtype)
    for rounding in ("nearest", "stochastic", "toward_zero"):
        for saturate in (False, True):
            want = pa.quantize(x, fmt, rounding=rounding, saturate=saturate, seed=7)
            got = pa.quantize(mx.nd.array(x, dtype=dtype), fmt, rounding=rounding, saturate=saturate, seed=7)
            assert same(got, want), (rounding, saturate)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "bf16", "fp16", "e2m1fn"])
def test_16_bit_inputs_keep_the_core_s_result_dtype(fmt):
    x = specials(500, seed=3).astype(np.float16)
    assert same(pa.quantize(mx.nd.array(x, dtype="float16"), fmt), pa.quantize(x, fmt))
    b = mx.nd.amp_cast(mx.nd.array(specials(500, seed=4)), dtype=BF16)
    want = pa.quantize(host(b).astype(ml_dtypes.bfloat16), fmt, rounding="stochastic", seed=5)
    got = pa.quantize(b, fmt, rounding="stochastic", seed=5)
    assert dtype_name(got.dtype) == want.dtype.name and same(got, want.astype(np.float32))


def test_bf16_signed_zeros_and_subnormals_keep_their_bits_in_and_out():
    """Regression: the bf16 input and result went through oneDNN's amp_cast, which on a CPU without
    AVX-512 turns -0 into +0 and flushes subnormals: quantize(bf16 x, 'bf16') must be x, bit for bit."""
    bits = np.array([0x8000, 0x0001, 0x8001, 0x007F, 0x3FC0, 0xFF80], np.uint16)  # -0, subnormals, 1.5, -inf
    x = mx.nd.cast(mx.nd.array(bits.view(ml_dtypes.bfloat16).astype(np.float32)), dtype=BF16)
    for out in (pa.quantize(x, "bf16"), pa.quantize(x, "bf16", rounding="stochastic", seed=3)):
        assert dtype_name(out.dtype) == "bfloat16" and out.asnumpy().view(np.uint16).ravel().tolist() == \
            bits.tolist()
    assert same(pa.quantize(x, "fp16"), pa.quantize(bits.view(ml_dtypes.bfloat16), "fp16"))  # float32 result


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_quantize_blocks_equals_the_core_on_shapes_axes_rules_and_specials(fmt):
    bf = BLOCK_FORMATS[fmt]
    cases = [((37, 70), -1), ((37, 70), 0), ((3, 64, 5), 1), ((64,), 0)]  # partial blocks; zero blocks below
    for i, (shape, axis) in enumerate(cases):
        x = specials(int(np.prod(shape)), seed=10 + i).reshape(shape)
        x[1] = 0.0
        for rule in bf.rules or (None,):
            for rounding in ("nearest", "stochastic"):
                want = pa.quantize_blocks(x, fmt, axis=axis, scale_rule=rule, rounding=rounding, seed=3)
                got = pa.quantize_blocks(mx.nd.array(x), fmt, axis=axis, scale_rule=rule, rounding=rounding,
                                         seed=3)  # fmt: skip
                assert same(got, want), (shape, axis, rule, rounding)
    if bf.blocks_2d:
        for shape in ((40, 35), (2, 32, 48)):
            x = specials(int(np.prod(shape)), seed=20).reshape(shape)
            for rounding in ("nearest", "stochastic"):
                want = pa.quantize_blocks(x, fmt, axis=(-2, -1), block=(16, 16), rounding=rounding, seed=4)
                got = pa.quantize_blocks(mx.nd.array(x), fmt, block=(16, 16), rounding=rounding, seed=4)
                assert same(got, want), (shape, rounding)
    x64 = specials(96, seed=21, dtype=np.float64).reshape(3, 32)
    assert same(pa.quantize_blocks(mx.nd.array(x64, dtype="float64"), fmt), pa.quantize_blocks(x64, fmt))


def test_pa_quantize_and_quantize_blocks_take_an_ndarray_and_return_one():
    x = specials(640, seed=30).reshape(20, 32)
    scalar = {"rounding": "stochastic", "seed": 9}
    got = pa.quantize(mx.nd.array(x), "e4m3fn", **scalar)
    assert isinstance(got, mx.nd.NDArray) and same(got, pa.quantize(x, "e4m3fn", **scalar))
    blocks = {"axis": 0, "scale_rule": "floor"}
    got = pa.quantize_blocks(mx.nd.array(x), "mxfp8_e4m3", **blocks)
    assert isinstance(got, mx.nd.NDArray) and same(got, pa.quantize_blocks(x, "mxfp8_e4m3", **blocks))
    with pytest.raises(PolyampError, match="block"):
        pa.quantize_blocks(mx.nd.array(x), "mxfp4", block=16)


@pytest.mark.parametrize("amax", [0.0, 1e-45, 1e-30, 0.37, 3.5, 448.0, 6e37, 3e38, math.inf, math.nan])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("margin, eps", [(0, 0.0), (2, 0.0), (0, 1e-12)])
def test_current_scale_equals_the_core(amax, fmt, margin, eps):
    got = mq.current_scale(mx.np.array(np.array([amax], np.float32)), fmt, margin, eps).asnumpy()
    want = recipes.current_scale(amax, fmt, margin, eps)
    assert got.dtype == np.float32 and got.tobytes() == np.float32(want).tobytes()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_tensorwise_cast_equals_the_core(fmt):
    x = specials(5000, seed=6)
    for scale in (1.0, 0.5, 3.0, 2.0**-20, 1e30, 448.0 / 7.3):
        assert same(
            mq.quantize_tensorwise(mx.nd.array(x), fmt, scale), recipes.quantize_tensorwise(x, fmt, scale)
        )
    got = mq.quantize_tensorwise(mx.nd.array(x), fmt, 8.0, "stochastic", 11)
    assert same(got, recipes.quantize_tensorwise(x, fmt, 8.0, rounding="stochastic", seed=11))


@pytest.mark.parametrize("name", RECIPE_NAMES)
@pytest.mark.parametrize("operand", ["input", "weight", "grad"])
def test_each_operand_is_quantized_as_the_core_does(name, operand):
    """The Quantizer's output, for each recipe and operand, against the numpy core's functions."""
    r = recipes.get_recipe(name)
    q = mr.Quantizer(r)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((48, 64)) * np.exp2(rng.integers(-8, 8, (48, 1)))).astype(np.float32)
    x[3, 5] = 0.0
    fmt = r.backward_format if operand == "grad" else r.forward_format
    rounding = r.grad_rounding if operand == "grad" else r.forward_rounding
    ds = recipes.DelayedScaling(fmt) if r.kind == "delayed" else None
    for axis in (-1, 0):
        got = q(mx.nd.array(x), "layer", operand, axis=axis)
        seed = q.calls if rounding == "stochastic" else None
        if r.kind == "block":
            two_d = r.weight_2d and operand == "weight"
            block = (16, 16) if two_d else None
            want = pa.quantize_blocks(x, fmt, axis=(-2, -1) if two_d else axis, block=block,
                                      scale_rule=r.scale_rule, rounding=rounding, seed=seed)  # fmt: skip
        else:
            scale = ds.scale if ds is not None else recipes.current_scale(float(np.abs(x).max()), fmt)
            want = recipes.quantize_tensorwise(x, fmt, scale, rounding=rounding, seed=seed)
            if ds is not None:  # the next call uses the scale this one leaves
                ds.update(float(np.abs(x).max()))
        assert same(got, want), (axis, operand)


# -- the three GEMMs against a hand computation -----------------------------------------------------
def fc(a, b_t, bias=None):
    """a @ b_t^T (+ bias) by MXNet's float32 FullyConnected, the recipe's product in fp32."""
    args = [mx.nd.array(a), mx.nd.array(b_t)] + ([mx.nd.array(bias)] if bias is not None else [])
    return mr._FC(*args, no_bias=bias is None, num_hidden=b_t.shape[0]).asnumpy()


@pytest.mark.parametrize(("name", "hadamard"), [("fp8-tensorwise", False), ("mxfp8", False), ("nvfp4", False),
                                               ("nvfp4", True)])  # fmt: skip
def test_forward_and_both_gradients_are_the_quantized_gemms(name, hadamard):
    extra = {"hadamard": True} if hadamard else {}
    r = recipes.get_recipe(name, keep=(), grad_rounding="nearest", compute_dtype="fp32", **extra)
    rng = np.random.default_rng(5)
    x, w, b, gy = (rng.standard_normal(s).astype(np.float32) for s in ((32, 48), (64, 48), (64,), (32, 64)))
    X, W, B = mx.nd.array(x), mx.nd.array(w), mx.nd.array(b)
    for t in (X, W, B):
        t.attach_grad()
    with autograd.record():
        y = mr.QuantizedDense(mr.Quantizer(r), "l", "fp32")(W, B, X)
    y.backward(mx.nd.array(gy))

    def q(t, fmt, axis=-1, two_d=False):
        if r.kind != "block":
            return recipes.quantize_tensorwise(t, fmt, recipes.current_scale(float(np.abs(t).max()), fmt))
        out = pa.quantize_blocks(t, fmt, axis=(-2, -1) if two_d else axis, block=(16, 16) if two_d else None,
                                 scale_rule=r.scale_rule)  # fmt: skip
        return np.asarray(out, np.float32)

    f, bk, two_d = r.forward_format, r.backward_format, r.weight_2d
    wq = q(w, f, two_d=two_d)
    assert np.array_equal(y.asnumpy(), fc(q(x, f), wq, b))
    w_dgrad = wq if (two_d or r.kind != "block") else q(w, f, axis=0)
    assert np.array_equal(X.grad.asnumpy(), fc(q(gy, bk), w_dgrad.T))
    x_wgrad = q(x, f) if r.kind != "block" else q(x, f, axis=0)
    g_wgrad = q(gy, bk) if r.kind != "block" else q(gy, bk, axis=0)
    if hadamard:  # g^T and x^T times H in tiles of 16 along M (32 rows: no padding), then quantized
        x_wgrad, g_wgrad = q(hadamard_tiles(x.T), f).T, q(hadamard_tiles(gy.T), bk).T
        assert not np.array_equal(x_wgrad, q(x, f, axis=0))
    assert np.array_equal(W.grad.asnumpy(), fc(g_wgrad.T, x_wgrad.T))
    assert np.array_equal(B.grad.asnumpy(), mx.nd.sum(mx.nd.array(gy), axis=0).asnumpy())


def test_unquantized_gemms_take_their_operands_as_they_are():
    r = recipes.get_recipe("fp8-tensorwise", keep=(), compute_dtype="fp32", quantize_input_grad=False,
                           quantize_weight_grad=False)  # fmt: skip
    rng = np.random.default_rng(6)
    x, w, gy = (rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (4, 16), (8, 4)))
    X, W = mx.nd.array(x), mx.nd.array(w)
    X.attach_grad()
    W.attach_grad()
    with autograd.record():
        y = mr.QuantizedDense(mr.Quantizer(r), "l", "fp32")(W, X)
    y.backward(mx.nd.array(gy))
    assert np.array_equal(X.grad.asnumpy(), fc(gy, w.T)) and np.array_equal(W.grad.asnumpy(), fc(gy.T, x.T))


@needs_bf16
def test_bf16_products_round_the_quantized_operands_to_bf16():
    r = recipes.get_recipe("mxfp8", keep=())
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal((4, 64)).astype(np.float32)
    y = mr.QuantizedDense(mr.Quantizer(r), "l", "bf16")(mx.nd.array(w), mx.nd.array(x))
    assert np.dtype(y.dtype).names == ("bfloat16",)
    xq, wq = (mx.nd.array(pa.quantize_blocks(t, "mxfp8_e4m3", scale_rule="rceil")) for t in (x, w))
    want = mr._FC(mx.nd.amp_cast(xq, dtype=BF16), mx.nd.amp_cast(wq, dtype=BF16), no_bias=True, num_hidden=4)
    assert same(y, host(want))


# -- MixedPrecision with a recipe --------------------------------------------------------------------
def quantized_layers(net, x):
    """The Dense layers whose FullyConnected ran the recipe's GEMMs in one forward pass."""
    seen = []
    original = mr.QuantizedDense.__init__

    def spy(self, quantizer, layer, compute):
        seen.append(layer)
        original(self, quantizer, layer, compute)

    mr.QuantizedDense.__init__ = spy
    try:
        with autograd.record():
            net(x)
    finally:
        mr.QuantizedDense.__init__ = original
    return seen


@needs_bf16
def test_the_first_and_last_dense_are_kept_by_default_and_patterns_keep_more():
    net = mlp()
    x = next(batches(1))[0]
    pa.MixedPrecision("fp8-tensorwise", framework="mxnet").watch(net)
    assert quantized_layers(net, x) == ["1", "2"]
    pa.MixedPrecision(recipes.get_recipe("mxfp8", keep=("first", "2")), framework="mxnet").watch(net)
    assert quantized_layers(net, x) == ["1", "3"]
    pa.MixedPrecision("nvfp4:keep=", framework="mxnet").watch(net)
    assert quantized_layers(net, x) == ["0", "1", "2", "3"]
    kept = pa.MixedPrecision("mxfp8:keep=", framework="mxnet", keep_fp32=("1",))
    kept.watch(net)  # keep_fp32 layers compute in float32, unquantized
    assert quantized_layers(net, x) == ["0", "2", "3"]


@needs_bf16
@pytest.mark.parametrize("hybrid", [False, True])
def test_recipe_layers_list_every_dense_quantized_or_kept_with_the_reason(hybrid):
    """mp.recipe_layers after mp.watch: each Dense by its block path (the names of keep_fp32 and the
    doctor), quantized or kept and why; a hybridized net (watched after hybridize) is named alike."""
    net = mlp(hybrid=hybrid)
    if hybrid:
        net.hybridize()
    mp = pa.MixedPrecision("fp8-tensorwise", framework="mxnet")
    with pytest.raises(PolyampError, match="known after mp.watch"):
        print(mp.recipe_layers)
    mp.watch(net)
    assert mp.recipe_layers.as_dict() == {"recipe": "fp8-tensorwise", "quantized": ["1", "2"],
                                          "kept": {"0": "keep 'first'", "3": "keep 'last'"}}  # fmt: skip
    patterns = pa.MixedPrecision(recipes.get_recipe("mxfp8", keep=("first", "2")), framework="mxnet")
    patterns.watch(net)
    assert patterns.recipe_layers.quantized == ["1", "3"]
    assert patterns.recipe_layers.kept == {"0": "keep 'first'", "2": "keep '2'"}
    kept = pa.MixedPrecision("mxfp8:keep=", framework="mxnet", keep_fp32=("1",))
    kept.watch(net)
    assert kept.recipe_layers.quantized == ["0", "2", "3"]
    assert kept.recipe_layers.kept == {"1": "keep_fp32 '1'"}


@needs_bf16
@pytest.mark.parametrize("flatten, shape", [(False, (2, 5, 16)), (True, (4, 2, 8))])
def test_dense_on_more_than_two_axes_multiplies_the_2d_view(flatten, shape):
    """flatten=False: along the last axis; flatten=True: the trailing axes as one (Dense's own rules)."""
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(32, flatten=flatten, in_units=16))
    net.initialize()
    pa.MixedPrecision("mxfp8:keep=", framework="mxnet").watch(net)
    x = mx.nd.array(np.random.default_rng(8).standard_normal(shape).astype(np.float32))
    x.attach_grad()
    with autograd.record():
        y = net(x)
    y.backward()
    view = x.reshape((-1, 16))
    want = mr.QuantizedDense(mr.Quantizer(recipes.get_recipe("mxfp8")), "0", "bf16")
    expected = want(net[0].weight.data(), net[0].bias.data(), view)
    assert y.shape == (shape[:-1] + (32,) if not flatten else (shape[0], 32))
    assert same(y, host(expected).reshape(y.shape)) and x.grad.shape == x.shape
    assert np.isfinite(host(x.grad)).all() and np.abs(host(x.grad)).sum() > 0


@needs_bf16
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_each_recipe_trains_and_differs_from_bf16(name):
    net, ref = mlp(), mlp()
    mp = pa.MixedPrecision(name, framework="mxnet")
    mp.watch(net)
    losses, _ = train(net, mp, 30)
    train(ref, pa.MixedPrecision("bf16-mixed", framework="mxnet"), 30)
    assert np.mean(losses[-5:]) < 0.3 * losses[0]
    mine, theirs = (host(p.data()) for p in (net[1].weight, ref[1].weight))
    assert not np.array_equal(mine, theirs)
    assert mp.recipe.name == name and repr(mp).startswith(f"MixedPrecision({name!r}")


@needs_bf16
@pytest.mark.parametrize("name", ["fp8-delayed", "nvfp4"])
def test_the_recipe_state_resumes_bit_identically_from_a_json_checkpoint(name):
    """Delayed-scaling histories and the stochastic-rounding counter travel in mp.state_dict()."""
    full_net = mlp()
    full = pa.MixedPrecision(name, framework="mxnet")
    full.watch(full_net)
    train(full_net, full, 6)

    net = mlp()
    first = pa.MixedPrecision(name, framework="mxnet")
    first.watch(net)
    _, trainer = train(net, first, 3)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["recipe"]["name"] == name and saved["recipe"]["state"]["calls"] > 0
    assert bool(saved["recipe"]["state"]["delayed"]) == (name == "fp8-delayed")
    resumed = pa.MixedPrecision(name, framework="mxnet")
    resumed.watch(net)
    resumed.load_state_dict(saved)
    train(net, resumed, 3, start=3, trainer=resumed.trainer(trainer))
    pairs = zip(full_net.collect_params().values(), net.collect_params().values())
    assert all(np.array_equal(host(a.data()), host(b.data())) for a, b in pairs)


@needs_bf16
@pytest.mark.filterwarnings("ignore:All children of this Sequential layer:UserWarning")  # "blocks"
@pytest.mark.parametrize("spec", ["fp8-delayed", "nvfp4:hadamard=true:keep=", "mxfp8:keep="])
def test_a_hybridized_net_trains_bit_identically_to_the_imperative_one(spec):
    """The quantized Dense layers inside a hybridized graph (an MXNet custom operator) round, seed and keep
    state as the imperative ones: hybridized before mp.watch, after it (static_alloc), or a Sequential's
    blocks each hybridized alone (each its own graph)."""
    runs = []
    for how in ("imperative", "before", "after", "blocks"):
        mp = pa.MixedPrecision(spec, framework="mxnet")
        net = mlp(hybrid=how in ("before", "after"))
        if how in ("before", "blocks"):
            net.hybridize()
        mp.watch(net)
        if how == "after":
            net.hybridize(static_alloc=True, static_shape=True)
        losses, _ = train(net, mp, 3)
        params = [host(p.data()) for p in net.collect_params().values()]
        runs.append((losses, params, json.dumps(mp.state_dict()["recipe"])))
    for losses, params, state in runs[1:]:
        assert losses == runs[0][0] and state == runs[0][2]
        assert all(np.array_equal(a, b) for a, b in zip(params, runs[0][1]))


@needs_bf16
def test_a_hybridized_dense_takes_any_rank_deferred_shapes_and_a_new_recipe():
    """Dense(flatten=False) on 3-D input and Dense(flatten=True) on 4-D, with in_units left to deferred
    initialisation, hybridized: the outputs and gradients of the imperative run. mp.watch with another
    recipe re-traces the graph."""
    def build():
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(8, flatten=False), gluon.nn.Dense(5, flatten=False, activation="tanh"),
                gluon.nn.Dense(3))  # fmt: skip
        net.initialize()
        return net

    x = mx.nd.array(np.random.default_rng(3).standard_normal((2, 3, 4, 6)).astype(np.float32))
    results = []
    for spec, hybrid in (("mxfp8:keep=", False), ("mxfp8:keep=", True), ("fp8-tensorwise:keep=", False)):
        net = build()
        mp = pa.MixedPrecision(spec, framework="mxnet")
        mp.watch(net)
        if hybrid:
            net.hybridize()
        net(x)  # the deferred shapes, inferred through the custom operator when hybridized
        rng = np.random.default_rng(4)
        for p in net.collect_params().values():
            p.set_data(mx.nd.array(rng.uniform(-0.3, 0.3, p.shape).astype(np.float32)))
        with autograd.record():
            y = net(x)
        y.backward()
        results.append((host(y), [host(p.grad()) for p in net.collect_params().values()], net))
    (y0, g0, _), (y1, g1, hybrid_net), (y2, _, _) = results
    assert y1.shape == (2, 3) and np.array_equal(y0, y1) and all(np.array_equal(a, b) for a, b in zip(g0, g1))
    pa.MixedPrecision("fp8-tensorwise:keep=", framework="mxnet").watch(hybrid_net)
    assert np.array_equal(host(hybrid_net(x)), y2) and not np.array_equal(y2, y1)


class Gates(gluon.HybridBlock):
    """A block with a Dense inside a child and an LSTM cell: matmuls the recipe does not reach."""

    def __init__(self):
        super().__init__()
        self.proj = gluon.nn.Dense(8, in_units=16)
        self.cell = gluon.rnn.LSTMCell(8, input_size=8)

    def hybrid_forward(self, F, x, h, c):
        return self.cell(self.proj(x), [h, c])[0]


@needs_bf16
def test_recipe_layers_record_unsupported_blocks_and_warn_when_none_is_quantized():
    """Transposed convolutions, channels-last convolutions, frozen Dense layers, RNN layers and cells are
    recorded as unsupported (they compute as bf16-mixed); a recipe that quantizes nothing warns."""
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Conv2DTranspose(4, 3, in_channels=3),
            gluon.nn.Conv2D(4, 3, layout="NHWC", in_channels=4), gluon.nn.Dense(4, in_units=16), Gates(),
            gluon.rnn.LSTM(8, input_size=8),
            gluon.nn.Dense(4, in_units=8), gluon.nn.Dense(4, in_units=4))  # fmt: skip
    net.initialize()
    net[2].weight.grad_req = "null"
    mp = pa.MixedPrecision("mxfp8", framework="mxnet")
    mp.watch(net)
    record = mp.recipe_layers
    assert record.quantized == ["5"]
    assert list(record.kept) == ["0", "1", "2", "3.proj", "3.cell", "4", "6"]
    assert record.kept["0"] == "unsupported: Conv2DTranspose: a transposed convolution"
    assert record.kept["1"].startswith("unsupported: Conv2D: layout 'NHWC'")
    assert record.kept["2"].startswith("unsupported: Dense: parameters without gradients")
    assert record.kept["3.cell"].startswith("unsupported: LSTMCell: ")
    assert record.kept["4"].startswith("unsupported: LSTM: the fused RNN operator")
    assert (record.kept["3.proj"], record.kept["6"]) == ("keep 'first'", "keep 'last'")
    none = r"recipe 'mxfp8' quantizes no layer of this MXNet Gluon model \(mp.watch\).*Dense: keep 'first'"
    with pytest.warns(RecipeWarning, match=none):
        pa.MixedPrecision("mxfp8", framework="mxnet").watch(gluon.nn.Dense(4, in_units=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeWarning)
        pa.MixedPrecision("mxfp8", framework="mxnet").watch(mlp())  # two quantized: no warning


# -- bad input ---------------------------------------------------------------------------------------
@needs_bf16
def test_recipe_errors():
    unwatched = pa.MixedPrecision("mxfp8", framework="mxnet")
    net = mlp()
    trainer = unwatched.trainer(gluon.Trainer(net.collect_params(), "sgd", update_on_kvstore=False))
    with pytest.raises(PolyampError, match="call mp.watch"), autograd.record():
        unwatched.scale_loss(L2(net(mx.nd.ones((2, 16))), mx.nd.ones((2, 4))).mean(), trainer)
    with pytest.raises(PolyampError, match="matches no block"):
        pa.MixedPrecision(recipes.get_recipe("mxfp8", keep=("nope*",)), framework="mxnet").watch(mlp())
    with pytest.raises(PolyampError, match="mp.watch no longer quantizes.*hybridize the net again"):
        mr.graph._layer("no such key")
    delayed = pa.MixedPrecision("fp8-delayed:keep=", framework="mxnet")
    two = gluon.nn.Sequential()
    two.add(gluon.nn.Dense(4, in_units=3))
    two.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    with pytest.raises(UnsupportedError, match="several contexts \\(cpu\\(0\\), cpu\\(1\\)\\)"):
        delayed.watch(two)
    two.initialize(ctx=mx.cpu(0), force_reinit=True)
    delayed.watch(two)  # one context: accepted; the net moved to two after mp.watch refuses at its call
    two.initialize(ctx=[mx.cpu(0), mx.cpu(1)], force_reinit=True)
    two(mx.nd.ones((2, 3), ctx=mx.cpu(0)))
    before = delayed.state_dict()["recipe"]["state"]
    with pytest.raises(UnsupportedError, match="cpu\\(0\\) and cpu\\(1\\)"):
        two(mx.nd.ones((2, 3), ctx=mx.cpu(1)))
    assert delayed.state_dict()["recipe"]["state"] == before  # the refused call changed nothing
    tensorwise = pa.MixedPrecision("fp8-tensorwise:keep=", framework="mxnet")
    tensorwise.watch(two)  # each call scales by its own amax: several contexts are fine
    assert two(mx.nd.ones((2, 3), ctx=mx.cpu(1))).shape == (2, 4)
    saved = pa.MixedPrecision("fp8-delayed", framework="mxnet").state_dict()
    with pytest.raises(PolyampError, match="recipe 'fp8-delayed'"):
        pa.MixedPrecision("bf16-mixed", framework="mxnet").load_state_dict(saved)


def test_quantizer_input_errors():
    with pytest.raises(PolyampError, match="accepted: float16, bfloat16, float32, float64"):
        pa.quantize(mx.nd.ones(3, dtype="int32"), "e4m3fn")
    with pytest.raises(PolyampError, match="block format"):
        pa.quantize_blocks(mx.nd.ones(32), "mxfp9")
    with pytest.raises(PolyampError, match="scale must be a finite number"):
        mq.quantize_tensorwise(mx.nd.ones(3), "e4m3fn", 0.0)
