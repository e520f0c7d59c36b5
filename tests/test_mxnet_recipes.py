"""Emulated fp8 / MX / NVFP4 training in MXNet Gluon (``polyamp/mxnet/quantize.py``, ``recipe.py``; run in
.venv-mxnet): bf16 products, keep lists, checkpoints of the recipe state, training, hybridized nets, and
the errors (the quantization and the three GEMMs against the numpy core: test_recipes_frameworks.py and
test_quantize_frameworks.py).

MXNet's AMP is process-wide: a recipe's MixedPrecision sets up bf16-mixed once, before any network."""

import json
import warnings

import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import PolyampError, UnsupportedError, recipes
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


# -- the GEMMs' compute dtype --------------------------------------------------------------------------
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
