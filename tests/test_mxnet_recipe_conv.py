"""Emulated fp8 / MX / NVFP4 training of MXNet Gluon convolutions (``polyamp/mxnet/recipe_conv.py``; run in
.venv-mxnet): the forward and both gradients against MXNet's Convolution (and its autograd) at operands
quantized by the numpy core, keep lists over Conv and Dense blocks, delayed-scaling state per conv
layer, training, and the errors.

The products run the same MXNet operator as the reference (Convolution, its autograd backward), so the
comparisons are bit for bit."""

import warnings

import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import recipes
from polyamp.numerics import hadamard_tiles

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mx = require("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet.contrib import amp  # noqa: E402
from mxnet_caps import bf16_or_none, needs_bf16  # noqa: E402

MP = bf16_or_none("fp8-tensorwise")  # amp.init, before any network exists (None: no bf16 here)
from polyamp.mxnet import recipe as mr  # noqa: E402
from polyamp.mxnet import recipe_conv as mc  # noqa: E402

BF16 = amp.amp.bfloat16
L2 = gluon.loss.L2Loss()
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")


def conv_args(n, stride, groups, filters):
    """Convolution's arguments for a kernel of 3, padding 1, in ``n`` spatial dimensions."""
    return {"kernel": (3,) * n, "stride": (stride,) * n, "pad": (1,) * n, "dilate": (1,) * n,
            "num_filter": filters, "num_group": groups, "layout": ("NCW", "NCHW")[n - 1]}  # fmt: skip


# (x shape, W shape, Convolution arguments): stride 2 + padding 1, groups=2, Conv1D; partial blocks of 32
GEOMETRIES = {
    "2d": ((20, 48, 7, 7), (32, 48, 3, 3), conv_args(2, 2, 1, 32)),
    "groups": ((6, 64, 5, 5), (32, 32, 3, 3), conv_args(2, 1, 2, 32)),
    "1d": ((5, 40, 11), (24, 40, 3), conv_args(1, 2, 1, 24)),
}


def host(t) -> np.ndarray:
    if np.dtype(t.dtype).names == ("bfloat16",):
        t = mx.nd.cast(t, dtype="float32")  # exact (amp_cast makes -0 +0 without AVX-512)
    return t.asnumpy()


def same(got, want) -> bool:
    """Bit for bit, same dtype and shape."""
    a, b = host(got), host(want) if isinstance(want, mx.nd.NDArray) else np.asarray(want)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


class CoreQuantizer:
    """The Quantizer's rule on numpy arrays with the numpy core: one count per call (stochastic rounding's
    seed), a delayed-scaling history per operand, block operands blocked along ``axis`` moved last."""

    def __init__(self, r):
        self.r, self.calls, self.ds = r, 0, {}

    def __call__(self, t, operand, axis=-1):
        r = self.r
        grad = operand == "grad"
        fmt = r.backward_format if grad else r.forward_format
        self.calls += 1
        rounding = {"rounding": r.grad_rounding if grad else r.forward_rounding}
        rounding["seed"] = self.calls if rounding["rounding"] == "stochastic" else None
        if r.kind == "block":
            if r.weight_2d and operand == "weight":  # 16x16 over (O, I) at each kernel position
                moved = np.moveaxis(t, (0, 1), (-2, -1))
                out = pa.quantize_blocks(moved, fmt, axis=(-2, -1), block=(16, 16), **rounding)
                return np.moveaxis(np.asarray(out, np.float32), (-2, -1), (0, 1))
            out = pa.quantize_blocks(np.moveaxis(t, axis, -1), fmt, scale_rule=r.scale_rule, **rounding)
            return np.moveaxis(np.asarray(out, np.float32), -1, axis)
        amax = float(np.abs(t).max())
        if r.kind == "delayed":
            ds = self.ds.setdefault(operand, recipes.DelayedScaling(fmt, r.history_len, r.amax_compute_algo))
            out = recipes.quantize_tensorwise(t, fmt, ds.scale, **rounding)
            ds.update(amax)
            return out
        return recipes.quantize_tensorwise(t, fmt, recipes.current_scale(amax, fmt), **rounding)


def conv_and_grads(x, w, b, gy, kw, compute):
    """MXNet's Convolution of float32 operands cast to the compute dtype, and its autograd gradients
    (float32) for the output gradient ``gy``."""
    leaves = [mx.nd.array(t) for t in (x, w, b)]
    for t in leaves:
        t.attach_grad()
    dtype = BF16 if compute == "bf16" else "float32"
    with autograd.record():
        y = mc._CONV(*(mx.nd.amp_cast(t, dtype=dtype) for t in leaves), **kw)
    y.backward(mx.nd.amp_cast(mx.nd.array(gy), dtype=dtype))
    return y, *(host(t.grad) for t in leaves)


def core_reference(q, r, x, w, gy):
    """The operands of the three GEMMs, quantized by the core in the recipe's documented order."""
    block = r.kind == "block"
    xq, wq = q(x, "input", 1), q(w, "weight", 1)
    once = None if block else q(gy, "grad")
    g_dx = q(gy, "grad", 1) if block else once
    w_dx = q(w, "weight", 0) if block and not r.weight_2d else wq
    g_dw, x_dw = gy, x
    if r.hadamard:  # tiles of 16 along the batch axis, zero padded
        g_dw, x_dw = hadamard_tiles(gy, axis=0), hadamard_tiles(x, axis=0)
    g_dw = q(g_dw, "grad", 0) if block else once
    x_dw = q(x_dw, "input", 0) if block else xq
    return xq, wq, g_dx, w_dx, g_dw, x_dw


def spread(rng, shape):
    """Normal samples times powers of two per entry of the first two axes, so that blocking along either
    of them changes the block scales."""
    lead = (1,) * (len(shape) - 2)
    scales = np.exp2(rng.integers(-4, 4, (shape[0], 1) + lead) + rng.integers(-4, 4, (1, shape[1]) + lead))
    return (rng.standard_normal(shape) * scales).astype(np.float32)


def bf16(*case):
    """A case computing in bf16: skipped where MXNet computes no bf16 on this CPU (mxnet_caps.py)."""
    return pytest.param(*case, marks=needs_bf16)


CASES = [("fp8-tensorwise", {}, "2d", "fp32"), bf16("fp8-tensorwise", {}, "groups", "bf16"),
         ("fp8-delayed", {}, "2d", "fp32"), bf16("fp8-delayed", {}, "1d", "bf16"),
         ("mxfp8", {"scale_rule": "floor"}, "2d", "fp32"), bf16("mxfp8", {}, "2d", "bf16"),
         ("mxfp8", {}, "groups", "fp32"), ("mxfp8", {}, "1d", "fp32"),
         ("nvfp4", {}, "2d", "fp32"), bf16("nvfp4", {}, "groups", "bf16"), ("nvfp4", {}, "1d", "fp32"),
         ("nvfp4", {"hadamard": True}, "2d", "fp32"),
         bf16("nvfp4", {"hadamard": True}, "1d", "bf16")]  # fmt: skip


@pytest.mark.parametrize(("name", "extra", "geometry", "compute"), CASES)
def test_forward_and_gradients_are_the_convolution_at_core_quantized_operands(name, extra, geometry, compute):
    """Two steps (the second uses delayed scaling's history and later stochastic-rounding seeds)."""
    r = recipes.get_recipe(name, keep=(), compute_dtype=compute, **extra)
    xs, ws, kw = GEOMETRIES[geometry]
    rng = np.random.default_rng(5)
    w, b = spread(rng, ws) * 0.2, rng.standard_normal(ws[0]).astype(np.float32)
    quantizer, core = mr.Quantizer(r), CoreQuantizer(r)
    for _ in range(2):
        x = spread(rng, xs)
        x[0, 1] = 0.0
        X, W, B = mx.nd.array(x), mx.nd.array(w), mx.nd.array(b)
        for t in (X, W, B):
            t.attach_grad()
        with autograd.record():
            y = mc.QuantizedConv(quantizer, "c", compute, kw)(W, B, X)
        gy = spread(rng, y.shape)
        y.backward(mx.nd.array(gy))

        xq, wq, g_dx, w_dx, g_dw, x_dw = core_reference(core, r, x, w, gy)
        want_y, *_ = conv_and_grads(xq, wq, b, gy, kw, compute)
        _, want_dx, _, _ = conv_and_grads(x, w_dx, b, g_dx, kw, compute)
        _, _, want_dw, _ = conv_and_grads(x_dw, w, b, g_dw, kw, compute)
        assert same(y, want_y) and (np.dtype(y.dtype).names == ("bfloat16",)) == (compute == "bf16")
        assert same(X.grad, want_dx) and same(W.grad, want_dw)
        assert same(B.grad, mx.nd.sum(mx.nd.array(gy), axis=1, exclude=True))
        assert not np.array_equal(host(y), host(conv_and_grads(x, w, b, gy, kw, compute)[0]))  # quantized
    assert quantizer.calls == core.calls
    if r.kind == "delayed":
        assert quantizer.state_dict()["delayed"].keys() == {"c|input", "c|weight", "c|grad"}
        assert all(quantizer.history("c", k).state_dict() == v.state_dict() for k, v in core.ds.items())


def test_the_batch_hadamard_is_the_core_s_and_leaves_the_weight_gradient_unchanged():
    """``dW = sum_n conv_weight(x_n, g_n)`` and ``H H^T = I``: the transformed (padded) batch gives the same
    float32 weight gradient up to rounding."""
    xs, ws, kw = GEOMETRIES["2d"]
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    gy = rng.standard_normal((xs[0], ws[0], 4, 4)).astype(np.float32)
    hx = hadamard_tiles(mx.nd.array(x), axis=0)
    assert same(hx, hadamard_tiles(x, axis=0)) and hx.shape[0] == 32
    _, _, dw, _ = conv_and_grads(x, w, np.zeros(ws[0], np.float32), gy, kw, "fp32")
    hg = hadamard_tiles(gy, axis=0)
    _, _, dw_h, _ = conv_and_grads(host(hx), w, np.zeros(ws[0], np.float32), hg, kw, "fp32")
    np.testing.assert_allclose(dw_h, dw, rtol=1e-4, atol=1e-4)


def test_unquantized_gemms_take_their_operands_as_they_are():
    r = recipes.get_recipe("mxfp8", keep=(), compute_dtype="fp32", quantize_input_grad=False,
                           quantize_weight_grad=False)  # fmt: skip
    xs, ws, kw = GEOMETRIES["groups"]
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    X, W = mx.nd.array(x), mx.nd.array(w)
    X.attach_grad()
    W.attach_grad()
    with autograd.record():
        y = mc.QuantizedConv(mr.Quantizer(r), "c", "fp32", kw)(W, X)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(mx.nd.array(gy))
    _, dx, dw, _ = conv_and_grads(x, w, np.zeros(ws[0], np.float32), gy, kw, "fp32")
    assert same(X.grad, dx) and same(W.grad, dw)


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
    for _ in range(25):
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
    assert mp.recipe_layers.kept == {"0": "unsupported: Conv2D: layout 'NHWC'; the recipe's quantized "
                                          "convolution takes the channels-first layouts NCW, NCHW, NCDHW"}
