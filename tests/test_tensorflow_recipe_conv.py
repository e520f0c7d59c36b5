"""Convolutions under a recipe in Keras 3 (``polyamp/tensorflow/recipe_conv.py``): the forward and both
gradients against the same convolution ops (``keras.ops.conv`` and its tape gradients, run eagerly) at
operands quantized by the numpy core on ``np.moveaxis``'d arrays, bit for bit (the same TF ops on the same
values); the layer's call (bias, activation, channels_first, groups, causal padding); the keep list over
Conv and Dense layers; a small CNN training, with delayed-scaling histories per conv layer."""

import numpy as np
import pytest
from frameworks import require

tf = require("tensorflow")
import keras  # noqa: E402
from test_tensorflow_recipes import core, same, wide  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError, recipes  # noqa: E402
from polyamp.numerics import hadamard_tiles  # noqa: E402
from polyamp.tensorflow import recipe as tr  # noqa: E402
from polyamp.tensorflow import recipe_conv as rc  # noqa: E402

# one per way a convolution's operands are quantized: one per-tensor scale (fp8-delayed's wiring is
# test_a_small_cnn_trains_with_fp8_delayed_keeping_a_history_per_conv_layer's), blocks along the channels
# and the batch, NVFP4's 2D weight blocks of the kernel as it lies and stochastic rounding, the Hadamard
# tiles along the batch; a scale rule or a rounding is the Quantizer's (test_tensorflow_recipes.py)
SPECS = ["fp8-tensorwise", "mxfp8", "nvfp4", "nvfp4:hadamard=true"]
# x shape, kernel shape, (strides, padding, dilation, data_format), compute dtype
GEOMETRIES = {
    "conv2d-stride2-same": ((12, 7, 7, 40), (3, 3, 40, 36), ((2, 2), "same", (1, 1), "channels_last"),
                            tf.bfloat16),
    "conv2d-channels_first-groups2": ((10, 64, 4, 4), (3, 3, 32, 24), ((1, 1), "valid", (1, 1),
                                      "channels_first"), tf.float32),
    "conv1d-dilated": ((10, 9, 40), (3, 40, 36), ((1,), "same", (2,), "channels_last"), tf.float32),
}  # fmt: skip


def along(t, r, operand, axis, seed=None, scale=None):
    """The core's quantization of ``t`` blocked along ``axis``: that axis moved last and back (NVFP4's
    16x16 weight blocks: the kernel's last two axes, as it lies)."""
    if r.kind != "block" or (r.weight_2d and operand == "weight"):
        return core(t, r, operand, -1, seed, scale)
    return np.moveaxis(core(np.moveaxis(t, axis, -1), r, operand, -1, seed, scale), -1, axis)


def conv(x, w, options):
    strides, padding, dilation, data_format = options
    return keras.ops.conv(x, w, strides=list(strides), padding=padding, dilation_rate=list(dilation),
                          data_format=data_format)  # fmt: skip


def vjp(x, w, g, options, compute):
    """d conv(x, w) / d(x, w) with ``g`` flowing back, eagerly, in ``compute``."""
    x, w, g = (tf.cast(tf.constant(np.asarray(t, np.float32)), compute) for t in (x, w, g))
    with tf.GradientTape() as tape:
        tape.watch([x, w])
        y = conv(x, w, options)
    return tape.gradient(y, [x, w], output_gradients=g)


@pytest.mark.parametrize(
    ("spec", "geometry"),
    [(spec, "conv2d-stride2-same") for spec in SPECS] + [("mxfp8", g) for g in list(GEOMETRIES)[1:]],
)
def test_forward_and_both_gradients_are_the_quantized_convolutions(spec, geometry):
    xs, ks, options, compute = GEOMETRIES[geometry]
    r = recipes.parse_recipe(spec)
    x, w = wide(xs, 3), wide(ks, 4) / 8
    q = tr.Quantizer(r)
    for operand in ("input", "weight", "grad") if r.kind == "delayed" else ():
        q.add("conv", operand)
    fn = rc.conv(q, "conv", compute, options)
    xt, wt = tf.constant(x), tf.Variable(w)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = fn(xt, wt)
    g = wide(tuple(y.shape), 5)
    dx, dw = tape.gradient(y, [xt, wt], output_gradients=tf.constant(g))
    assert y.dtype == dx.dtype == dw.dtype == tf.float32

    block, sr = r.kind == "block", r.grad_rounding == "stochastic"  # seeds: g along channels, then batch
    channel = -1 if options[3] == "channels_last" else 1
    scale = 1.0 if r.kind == "delayed" else None  # a fresh history's scale
    xq, wq = along(x, r, "input", channel, scale=scale), along(w, r, "weight", -2, scale=scale)
    assert same(y, tf.cast(conv(tf.cast(xq, compute), tf.cast(wq, compute), options), tf.float32))
    g_dgrad = along(g, r, "grad", channel, seed=1 if sr else None, scale=scale)
    w_dgrad = along(w, r, "weight", -1) if block and not r.weight_2d else wq
    assert same(dx, tf.cast(vjp(x, w_dgrad, g_dgrad, options, compute)[0], tf.float32))
    x_w, g_w = (hadamard_tiles(x, 0), hadamard_tiles(g, 0)) if r.hadamard else (x, g)  # tiles along the batch
    x_wgrad = along(x_w, r, "input", 0) if block else xq
    g_wgrad = along(g_w, r, "grad", 0, seed=2 if sr else None) if block else g_dgrad
    assert same(dw, tf.cast(vjp(x_wgrad, w, g_wgrad, options, compute)[1], tf.float32))
    assert int(q.calls.numpy()) == (2 if sr else 0)


def test_blocks_follow_the_channels_not_the_memory_layout():
    """mxfp8 on a channels_first input differs from blocking its last (spatial) axis."""
    r = recipes.parse_recipe("mxfp8")
    x = wide((4, 64, 6, 6), 1) * np.exp2(np.random.default_rng(1).integers(-8, 8, (4, 64, 6, 6)))
    got = rc._blocked(tr.Quantizer(r), tf.constant(x), "conv", "input", 1)
    assert same(got, along(x, r, "input", 1)) and not same(got, core(x, r, "input", -1))


def conv_layer_model(mp, make, input_shape, seed=0):
    keras.utils.set_random_seed(seed)
    with mp.scope():
        layer = make()
        return keras.Sequential([keras.Input(input_shape), layer]), layer


@pytest.mark.parametrize(
    ("make", "input_shape"),
    [(lambda: keras.layers.Conv2D(24, 3, groups=2, data_format="channels_first", activation="relu",
                                  bias_initializer="random_normal", name="c"), (64, 6, 6)),
     (lambda: keras.layers.Conv1D(40, 3, padding="causal", dilation_rate=2, bias_initializer="ones",
                                  name="c"), (9, 36))],
    ids=["conv2d-channels_first-groups", "conv1d-causal"],
)  # fmt: skip
def test_a_watched_conv_layer_adds_bias_and_activation_as_keras(make, input_shape):
    mp = pa.MixedPrecision("mxfp8:keep=", framework="tensorflow")
    model, layer = conv_layer_model(mp, make, input_shape)
    mp.watch(model)
    assert "call" in vars(layer)
    x = wide((8, *input_shape), 2)
    r, channel = mp.recipe, -1 if layer.data_format == "channels_last" else 1
    if layer.padding == "causal":  # Keras pads the input on the left, then convolves "valid"
        x_pad = np.pad(x, [(0, 0), (layer.dilation_rate[0] * 2, 0), (0, 0)])
        options = ((1,), "valid", tuple(layer.dilation_rate), "channels_last")
    else:
        x_pad, options = x, rc.conv_options(layer)
    x16 = np.asarray(tf.cast(tf.cast(x_pad, tf.bfloat16), tf.float32))  # Keras casts inputs to bf16
    xq, wq = along(x16, r, "input", channel), along(layer.kernel.numpy(), r, "weight", -2)
    y = conv(tf.cast(xq, tf.bfloat16), tf.cast(wq, tf.bfloat16), options)
    shape = (1, -1) + (1,) * layer.rank if channel == 1 else (-1,)
    y = y + tf.reshape(tf.cast(layer.bias, tf.bfloat16), shape)
    want = layer.activation(y)
    got = model(x)
    assert got.dtype == tf.bfloat16 and same(tf.cast(got, tf.float32), tf.cast(want, tf.float32))


def cnn(mp, seed=0, extra=()):
    """Conv2D c0 -> relu -> Conv2D c1 -> (extra) -> GlobalAveragePooling2D -> Dense head, in mp.scope()."""
    keras.utils.set_random_seed(seed)
    with mp.scope():
        return keras.Sequential([
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c0"),
            keras.layers.Conv2D(32, 3, strides=2, padding="same", name="c1"),
            *extra,
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(2, name="head"),
        ])  # fmt: skip


def test_the_keep_list_counts_conv_and_dense_layers_together():
    mp = pa.MixedPrecision("mxfp8", framework="tensorflow")
    extra = (keras.layers.DepthwiseConv2D(3, padding="same", name="dw"),
             keras.layers.Conv2DTranspose(32, 3, padding="same", name="up"))  # fmt: skip
    model = cnn(mp, extra=extra)
    mp.watch(model)
    layers = mp._dense
    assert layers.kept == ["c0", "head"] and [n for n, _ in layers.quantized] == ["c1"]
    assert all("call" not in vars(model.get_layer(n)) for n in ("c0", "dw", "up", "head"))
    assert [n for n, _ in tr.MatmulLayers(model, ()).quantized] == ["c0", "c1", "head"]
    assert tr.MatmulLayers(model, ("last",)).kept == ["head"]
    mp.watch(model)  # watched again: the call replaced once, not wrapped
    assert model(np.zeros((2, 8, 8, 3), np.float32)).shape == (2, 2)
    model.get_layer("c1").enable_lora(2)
    with pytest.raises(PolyampError, match="Conv2D layer 'c1' is LoRA-enabled or Keras-quantized"):
        mp.watch(model)


def images(seed):
    x = np.random.default_rng(seed).standard_normal((32, 8, 8, 3)).astype(np.float32)
    return x, np.stack([x[..., 0].mean((1, 2)), np.abs(x[..., 1]).mean((1, 2))], -1) * 4


def train(mp, model, steps, traced=True):
    opt = keras.optimizers.Adam(1e-2)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y))
        grads = tape.gradient(mp.scale(loss), model.trainable_variables)
        mp.apply(opt, grads, model.trainable_variables)
        return loss

    step = tf.function(step) if traced else step
    return [float(step(*images(i % 4))) for i in range(steps)]


def test_a_small_cnn_trains_with_fp8_delayed_keeping_a_history_per_conv_layer():
    mp = pa.MixedPrecision("fp8-delayed:keep=head", framework="tensorflow")
    model = cnn(mp)
    mp.watch(model)
    losses = train(mp, model, 8, traced=False)  # the last four's mean: ~0.1 of the first
    assert np.mean(losses[-4:]) < 0.5 * losses[0], losses
    delayed = mp.state_dict()["recipe"]["state"]["delayed"]
    assert sorted(delayed) == sorted(f"{n}|{o}" for n in ("c0", "c1") for o in ("input", "weight", "grad"))
    assert all(v["steps"] == 8 for v in delayed.values())
    want = recipes.DelayedScaling.from_recipe(mp.recipe)  # c0's input: each step's batch in bf16
    for i in range(8):
        x, _ = images(i % 4)
        want.update(float(np.abs(np.asarray(tf.cast(tf.cast(x, tf.bfloat16), tf.float32))).max()))
    assert delayed["c0|input"] == want.state_dict()
    assert delayed["c0|weight"] != delayed["c1|weight"]


def test_the_convolutions_are_the_same_in_tf_function():
    xs, ks, options, _ = GEOMETRIES["conv1d-dilated"]
    x, w, g = tf.constant(wide(xs, 3)), tf.Variable(wide(ks, 4) / 8), tf.constant(wide((*xs[:2], ks[-1]), 5))
    fn = rc.conv(tr.Quantizer(recipes.parse_recipe("mxfp8")), "conv", tf.bfloat16, options)

    def run(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x, w)
        return (y, *tape.gradient(y, [x, w], output_gradients=g))

    assert all(same(a, b) for a, b in zip(tf.function(run)(x, g), run(x, g)))
