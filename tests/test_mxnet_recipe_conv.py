"""Emulated fp8 / MX / NVFP4 training of MXNet Gluon convolutions (``polyamp/mxnet/recipe_conv.py``; run in
.venv-mxnet): keep lists over Conv and Dense blocks, a watched block's own arguments, delayed-scaling
state per conv layer, training (imperative and hybridized), and the unsupported blocks. The forward and
both gradients against MXNet's Convolution at operands the numpy core quantized:
``test_recipe_conv_frameworks.py``."""

import warnings

import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import recipes

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mx = require("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet_caps import bf16_or_none, needs_bf16  # noqa: E402

MP = bf16_or_none("fp8-tensorwise")  # amp.init, before any network exists (None: no bf16 here)
from polyamp.mxnet import recipe as mr  # noqa: E402
from polyamp.mxnet import recipe_conv as mc  # noqa: E402

L2 = gluon.loss.L2Loss()
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")


def host(t) -> np.ndarray:
    if np.dtype(t.dtype).names == ("bfloat16",):
        t = mx.nd.cast(t, dtype="float32")  # exact (amp_cast makes -0 +0 without AVX-512)
    return t.asnumpy()


def same(got, want) -> bool:
    """Bit for bit, same dtype and shape."""
    a, b = host(got), host(want) if isinstance(want, mx.nd.NDArray) else np.asarray(want)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- blocks ------------------------------------------------------------------------------------------------
def cnn(seed=0, hybrid=True):
    """Conv2D -> relu -> Conv2D -> Conv2D -> GlobalAvgPool2D -> Dense."""
    net = gluon.nn.HybridSequential() if hybrid else gluon.nn.Sequential()
    net.add(gluon.nn.Conv2D(16, 3, padding=1, in_channels=3, activation="relu"),
            gluon.nn.Conv2D(32, 3, strides=2, padding=1, in_channels=16, activation="relu"),
            gluon.nn.Conv2D(32, 3, padding=1, groups=2, in_channels=32),
            gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(2, in_units=32))  # fmt: skip
    net.initialize()
    rng = np.random.default_rng(seed)
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(-0.3, 0.3, p.shape).astype(np.float32)))
    return net


def quantized_layers(net, x):
    """The Conv and Dense blocks that ran the recipe's GEMMs in one forward pass."""
    seen = []
    originals = {cls: cls.__init__ for cls in (mc.QuantizedConv, mr.QuantizedDense)}

    def spy(original):
        def init(self, quantizer, layer, *args):
            seen.append(layer)
            original(self, quantizer, layer, *args)

        return init

    for cls, original in originals.items():
        cls.__init__ = spy(original)
    try:
        with autograd.record():
            net(x)
    finally:
        for cls, original in originals.items():
            cls.__init__ = original
    return seen


@needs_bf16
def test_keep_counts_conv_and_dense_blocks_together():
    net = cnn()
    x = mx.nd.array(np.random.default_rng(1).standard_normal((4, 3, 8, 8)).astype(np.float32))
    pa.MixedPrecision("mxfp8", framework="mxnet").watch(net)  # first Conv2D and the Dense kept
    assert quantized_layers(net, x) == ["1", "2"]
    pa.MixedPrecision("nvfp4:keep=", framework="mxnet").watch(net)
    assert quantized_layers(net, x) == ["0", "1", "2", "4"]
    pa.MixedPrecision(recipes.get_recipe("fp8-tensorwise", keep=("last", "1")), framework="mxnet").watch(net)
    assert quantized_layers(net, x) == ["0", "2"]
    transposed = gluon.nn.Sequential()  # Conv2DTranspose is not quantized (nor counted)
    transposed.add(gluon.nn.Conv2DTranspose(4, 3, in_channels=3), gluon.nn.Conv2D(4, 3, in_channels=4))
    transposed.initialize()
    pa.MixedPrecision("mxfp8:keep=", framework="mxnet").watch(transposed)
    assert quantized_layers(transposed, x) == ["1"]


@pytest.mark.parametrize("block, shape", [
    (gluon.nn.Conv2D(8, 3, strides=2, padding=1, in_channels=32, activation="relu"), (2, 32, 6, 6)),
    (gluon.nn.Conv3D(8, 2, in_channels=32, use_bias=False), (2, 32, 3, 4, 4))])  # fmt: skip
@needs_bf16
def test_a_watched_block_runs_the_quantized_convolution_with_its_own_arguments(block, shape):
    net = gluon.nn.Sequential()
    net.add(block)
    net.initialize()
    pa.MixedPrecision("mxfp8:keep=", framework="mxnet").watch(net)
    x = mx.nd.array(np.random.default_rng(2).standard_normal(shape).astype(np.float32))
    with autograd.record():
        y = net(x)
    y.backward()
    kw = {k: v for k, v in block._kwargs.items() if k != "no_bias"}
    params = (block.weight.data(),) + (() if block.bias is None else (block.bias.data(),))
    want = mc.QuantizedConv(mr.Quantizer(recipes.get_recipe("mxfp8")), "0", "bf16", kw)(*params, x)
    assert same(y, want if block.act is None else block.act(want))
    assert np.isfinite(host(block.weight.grad())).all() and np.abs(host(block.weight.grad())).sum() > 0


@needs_bf16
def test_delayed_histories_are_kept_per_conv_layer_in_the_state_dict():
    net = cnn(hybrid=False)
    mp = pa.MixedPrecision("fp8-delayed:keep=", framework="mxnet")
    mp.watch(net)
    x = mx.nd.array(np.random.default_rng(3).standard_normal((4, 3, 8, 8)).astype(np.float32))
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    mx.nd.waitall()  # the backward runs on MXNet's engine threads
    delayed = mp.state_dict()["recipe"]["state"]["delayed"]
    assert {f"{layer}|{op}" for layer in "0124" for op in ("input", "weight", "grad")} == set(delayed)
    amax_x = float(np.abs(x.asnumpy()).max())
    assert max(delayed["0|input"]["history"]) == amax_x and delayed["0|input"]["steps"] == 1


@needs_bf16
def test_a_small_cnn_trains_with_mxfp8():
    net = cnn()
    mp = pa.MixedPrecision("mxfp8", framework="mxnet")
    mp.watch(net)
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-2},
                                       update_on_kvstore=False))  # fmt: skip
    rng = np.random.default_rng(4)
    teacher = rng.standard_normal((3, 2)).astype(np.float32)
    losses = []
    for _ in range(15):
        x = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
        target = np.tanh(x.mean(axis=(2, 3)) * 4) @ teacher
        with autograd.record():
            loss = L2(net(mx.nd.array(x)), mx.nd.array(target)).mean()
            with mp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        mp.step(trainer, 1)
        losses.append(float(loss.asscalar()))
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses


@needs_bf16
@pytest.mark.parametrize("spec", ["fp8-delayed:keep=", "nvfp4:hadamard=true"])
def test_a_hybridized_cnn_trains_bit_identically_to_the_imperative_one(spec):
    """The quantized convolutions inside a hybridized graph (the custom operator, shapes from
    Convolution's own inference) round, seed and keep state as the imperative ones."""
    runs = []
    for hybrid in (False, True):
        net, mp = cnn(), pa.MixedPrecision(spec, framework="mxnet")
        mp.watch(net)
        if hybrid:
            net.hybridize()
        trainer = mp.trainer(gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-2},
                                           update_on_kvstore=False))  # fmt: skip
        rng, losses = np.random.default_rng(5), []
        for _ in range(2):
            x = mx.nd.array(rng.standard_normal((16, 3, 8, 8)).astype(np.float32))
            with autograd.record():
                loss = L2(net(x), mx.nd.ones((16, 2))).mean()
                with mp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            mp.step(trainer, 1)
            losses.append(float(loss.asscalar()))
        params = [host(p.data()) for p in net.collect_params().values()]
        runs.append((losses, params, mp.state_dict()["recipe"]))
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@needs_bf16
def test_recipe_layers_count_the_convs_and_record_frozen_and_channels_last_ones_unsupported():
    """Conv and Dense blocks counted together (first / last), by block path; a frozen conv and a
    channels-last conv are recorded as unsupported (they compute as bf16-mixed), not quantized."""
    mp = pa.MixedPrecision("mxfp8", framework="mxnet")
    mp.watch(cnn())
    assert mp.recipe_layers.quantized == ["1", "2"]
    assert mp.recipe_layers.kept == {"0": "keep 'first'", "4": "keep 'last'"}
    frozen = cnn(hybrid=False)
    frozen[1].weight.grad_req = "null"
    mp = pa.MixedPrecision("mxfp8:keep=", framework="mxnet")
    mp.watch(frozen)
    assert mp.recipe_layers.quantized == ["0", "2", "4"]
    assert mp.recipe_layers.kept["1"].startswith("unsupported: Conv2D: parameters without gradients")
    nhwc = gluon.nn.Sequential()
    nhwc.add(gluon.nn.Conv2D(4, 3, layout="NHWC", in_channels=3), gluon.nn.Dense(2, in_units=4))
    nhwc.initialize()
    mp = pa.MixedPrecision("mxfp8:keep=", framework="mxnet")
    mp.watch(nhwc)
    assert mp.recipe_layers.quantized == ["1"]
    assert mp.recipe_layers.kept == {
        "0": "unsupported: Conv2D: layout 'NHWC'; the recipe's quantized "
        "convolution takes the channels-first layouts NCW, NCHW, NCDHW"
    }
