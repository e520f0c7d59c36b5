"""Convolutions under a recipe in Keras 3 (``polyamp/tensorflow/recipe_conv.py``): the layer's call (bias,
activation, channels_first, groups, causal padding) against ``keras.ops.conv`` at operands quantized by
the numpy core on ``np.moveaxis``'d arrays, bit for bit; the keep list over Conv and Dense layers; a small
CNN training, with delayed-scaling histories per conv layer; the convolutions in ``tf.function``. The
forward and both gradients on their own: ``test_recipe_conv_frameworks.py``."""

import numpy as np
import pytest
from frameworks import require

tf = require("tensorflow")
import keras  # noqa: E402
from test_tensorflow_recipes import core, same, wide  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError, recipes  # noqa: E402
from polyamp.tensorflow import recipe as tr  # noqa: E402
from polyamp.tensorflow import recipe_conv as rc  # noqa: E402

# x shape, kernel shape, (strides, padding, dilation, data_format)
CONV1D_DILATED = ((10, 9, 40), (3, 40, 36), ((1,), "same", (2,), "channels_last"))


def along(t, r, operand, axis):
    """The core's quantization of ``t`` blocked along ``axis``: that axis moved last and back (NVFP4's
    16x16 weight blocks: the kernel's last two axes, as it lies)."""
    if r.kind != "block" or (r.weight_2d and operand == "weight"):
        return core(t, r, operand, -1)
    return np.moveaxis(core(np.moveaxis(t, axis, -1), r, operand, -1), -1, axis)


def conv(x, w, options):
    strides, padding, dilation, data_format = options
    return keras.ops.conv(x, w, strides=list(strides), padding=padding, dilation_rate=list(dilation),
                          data_format=data_format)  # fmt: skip


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


STEPS = 5


def test_a_small_cnn_trains_with_fp8_delayed_keeping_a_history_per_conv_layer():
    mp = pa.MixedPrecision("fp8-delayed:keep=head", framework="tensorflow")
    model = cnn(mp)
    mp.watch(model)
    losses = train(mp, model, STEPS, traced=False)
    assert np.mean(losses[-2:]) < 0.5 * losses[0], losses  # ~0.3 of the first
    delayed = mp.state_dict()["recipe"]["state"]["delayed"]
    assert sorted(delayed) == sorted(f"{n}|{o}" for n in ("c0", "c1") for o in ("input", "weight", "grad"))
    assert all(v["steps"] == STEPS for v in delayed.values())
    want = recipes.DelayedScaling.from_recipe(mp.recipe)  # c0's input: each step's batch in bf16
    for i in range(STEPS):
        x, _ = images(i % 4)
        want.update(float(np.abs(np.asarray(tf.cast(tf.cast(x, tf.bfloat16), tf.float32))).max()))
    assert delayed["c0|input"] == want.state_dict()
    assert delayed["c0|weight"] != delayed["c1|weight"]


def test_the_convolutions_are_the_same_in_tf_function():
    xs, ks, options = CONV1D_DILATED
    x, w, g = tf.constant(wide(xs, 3)), tf.Variable(wide(ks, 4) / 8), tf.constant(wide((*xs[:2], ks[-1]), 5))
    fn = rc.conv(tr.Quantizer(recipes.parse_recipe("mxfp8")), "conv", tf.bfloat16, options)

    def run(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x, w)
        return (y, *tape.gradient(y, [x, w], output_gradients=g))

    assert all(same(a, b) for a, b in zip(tf.function(run)(x, g), run(x, g)))
