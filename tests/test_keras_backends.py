"""Keras 3 on its JAX and torch backends (``polyamp.keras``), against Keras's own LossScaleOptimizer.

Keras picks its backend once per process, so the Makefile runs this file once per backend
(``KERAS_BACKEND=jax``, then ``torch``); under the TensorFlow backend of the main run it is skipped, and
``tests/test_tensorflow.py`` holds the same scenarios for the TensorFlow front end. The LSO scenarios are
Keras's ``keras/src/optimizers/loss_scale_optimizer_test.py`` (finite, infinite, downscaling, upscaling,
config; stateless and stateful), its ``overwrite_with_gradient`` and inner ``loss_scale_factor`` cases, and
``fit`` bit for bit with NaN batches.
"""

import dataclasses
import os

import numpy as np
import pytest

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
if BACKEND not in ("jax", "torch"):
    pytest.skip("Keras's JAX and torch backends: the Makefile runs this file with KERAS_BACKEND=jax, =torch",
                allow_module_level=True)  # fmt: skip

import keras  # noqa: E402
from keras import ops  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp.errors import NonFiniteError, PolyampError  # noqa: E402

INF = float("inf")
# Keras's own conversions on numpy 2 (keras/src/backend/*/core.py), not polyamp's
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn:DeprecationWarning")


def keras_preset(policy="fp16-mixed", **changes):
    ls = dataclasses.replace(pa.DynamicLossScale.preset("keras"), **changes)
    return pa.MixedPrecision(policy, framework="keras", loss_scale=ls)


def numpy(x):
    return ops.convert_to_numpy(x)


def four(values=(1.0, 2.0, 3.0, 4.0)):
    return keras.Variable(np.array(values, np.float32))


def step(opt, grads, variables, stateless):
    """One step through ``stateless_apply`` (the JAX trainer's path; the variables assigned after it, as
    Keras's test does) or ``apply`` (the torch trainer's)."""
    if not opt.built:
        opt.build(variables)
    if stateless:
        values = [v.value for v in opt.variables], [v.value for v in variables]
        new_vars, new_opt = opt.stateless_apply(values[0], grads, values[1])
        for v, value in [*zip(variables, new_vars), *zip(opt.variables, new_opt)]:
            v.assign(value)
    else:
        opt.apply(grads, variables)


PATHS = [pytest.param(True, id="stateless"), pytest.param(False, id="stateful")]


def native_step(lso, grads, variables, stateless):
    """``step`` for Keras's LossScaleOptimizer, whose stateful path does not run on JAX (its ``apply`` leaks
    a tracer from ``ops.cond``; Keras's test skips it): there, the stateless one. polyamp's runs on both."""
    step(lso, grads, variables, stateless or BACKEND == "jax")


# -- Keras's LossScaleOptimizer scenarios --------------------------------------------------------------
@pytest.mark.parametrize("stateless", PATHS)
def test_finite_and_infinite_steps_as_loss_scale_optimizer(stateless):
    """Keras's test_finite_step / test_infinite_step: [0.5, -1, -0.5, 3] from scaled grads; inf: kept."""
    for grads, want in (([1.0, 6.0, 7.0, 2.0], [0.5, -1.0, -0.5, 3.0]), ([INF] * 4, [1.0, 2.0, 3.0, 4.0])):
        mp = keras_preset()
        ours, native = four(), four()
        g = [ops.array(grads) * 2.0**15]
        step(mp.optimizer(keras.optimizers.SGD(0.5)), g, [ours], stateless)
        native_step(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5)), g, [native], stateless)
        np.testing.assert_allclose(numpy(ours), want, rtol=1e-6)
        np.testing.assert_array_equal(numpy(ours), numpy(native))
        assert mp.state.skipped == (want == [1.0, 2.0, 3.0, 4.0]) and mp.state.steps == 1


@pytest.mark.parametrize("stateless", PATHS)
@pytest.mark.parametrize("grad, init, steps, growth, expected",
                         [(1.0, 2.0, 8, 2, 32.0), (INF, 400.0, 4, 2000, 25.0)],
                         ids=["upscaling", "downscaling"])  # fmt: skip
def test_the_scale_after_steps_and_the_config_as_loss_scale_optimizer(stateless, grad, init, steps, growth,
                                                                      expected):  # fmt: skip
    """Keras's test_upscaling / test_downscaling / test_config: the same scale after the same steps, a
    config naming the initial scale and growth interval polyamp uses, and a round trip through it."""
    mp = keras_preset(init_scale=init, growth_interval=growth)
    opt = mp.optimizer(keras.optimizers.SGD(0.5))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=init,
                                              dynamic_growth_steps=growth)  # fmt: skip
    ours, native = four(), four()
    for _ in range(steps):
        step(opt, [ops.array([grad, 6.0, 7.0, 2.0])], [ours], stateless)
        native_step(lso, [ops.array([grad, 6.0, 7.0, 2.0])], [native], stateless)
    assert float(numpy(opt.scale_loss(1.0))) == float(numpy(lso.scale_loss(1.0))) == expected
    np.testing.assert_array_equal(numpy(ours), numpy(native))
    assert mp.current_scale == expected and mp.state.steps == steps
    config = opt.get_config()
    assert {k: config[k] for k in ("initial_scale", "dynamic_growth_steps")} == {
        k: lso.get_config()[k] for k in ("initial_scale", "dynamic_growth_steps")} == {
        "initial_scale": init, "dynamic_growth_steps": growth}  # fmt: skip
    again = type(opt).from_config(config)
    assert again.get_config() == config and again.mixed_precision.loss_scale == mp.loss_scale
    with pytest.raises(PolyampError, match="needs 'mixed_precision'"):
        type(opt).from_config(lso.get_config())


@pytest.mark.parametrize("stateless", PATHS)
def test_overwrite_with_gradient_and_an_inner_loss_scale_factor(stateless):
    """Keras's test_finite_step_with_overwrite (the variable takes its "gradient", not divided by the
    scale) and test_finite_step_with_inner_loss_scale (the inner factor cleared, not divided again)."""
    mp = keras_preset()
    inner = keras.optimizers.SGD(0.5, loss_scale_factor=100)
    overwritten, plain = four(), four()
    overwritten.overwrite_with_gradient = True
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]), ops.array([1.0, 6.0, 7.0, 2.0]) * 2.0**15]
    step(mp.optimizer(inner), grads, [overwritten, plain], stateless)
    assert inner.loss_scale_factor is None
    np.testing.assert_array_equal(numpy(overwritten), [1.0, 6.0, 7.0, 2.0])
    np.testing.assert_allclose(numpy(plain), [0.5, -1.0, -0.5, 3.0], rtol=1e-6)


# -- fit ------------------------------------------------------------------------------------------------
def tiny_model(policy="float32", seed=0):
    keras.utils.set_random_seed(seed)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(2)])  # fmt: skip
    finally:
        keras.config.set_dtype_policy(previous)


def nan_data(n_batches=12, bad=(1, 2, 7), seed=0):
    """Batches of 8, one NaN sample in each of the ``bad`` batches."""
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((8 * n_batches, 6)).astype("float32"), rng.standard_normal((8 * n_batches, 2))
    x[[8 * b + 3 for b in bad], 0] = np.nan
    return x, y.astype("float32")


class Scales(keras.callbacks.Callback):
    """The optimizer's scale variable at each batch end (``self.model`` syncs a JAX model's state)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(float(numpy(self.model.optimizer.dynamic_scale.value)))


def weights(model):
    return [numpy(v) for v in model.trainable_variables]


def test_fit_matches_loss_scale_optimizer_bit_for_bit():
    """``fit`` with ``mp.optimizer`` vs ``fit`` with Keras's LossScaleOptimizer under mixed_float16: the
    same per-batch scales (skips at the NaN batches, growth after 3 clean ones) and the same weights."""
    mp = keras_preset(growth_interval=3)
    with mp.scope():
        ours = tiny_model(keras.config.dtype_policy().name)
    native = tiny_model("mixed_float16")
    native.set_weights(ours.get_weights())
    assert ours.layers[0].dtype_policy.name == "mixed_float16"
    ours.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                              dynamic_growth_steps=3)  # fmt: skip
    native.compile(optimizer=lso, loss="mse")
    assert type(ours.optimizer).__name__ == "KerasOptimizer"  # compile did not wrap it again
    x, y = nan_data()
    seen, native_seen = Scales(), Scales()
    history = ours.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[mp.callback(), seen])
    native.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[native_seen])
    assert seen.seen == native_seen.seen and any(b > a for a, b in zip(seen.seen, seen.seen[1:]))
    for a, b in zip(weights(ours), weights(native)):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in weights(ours))
    assert (mp.state.skipped, mp.state.steps) == (3, 12) and mp.current_scale == seen.seen[-1]
    assert history.history["loss_scale"] == [seen.seen[-1]] and history.history["skipped_steps"] == [3]


def test_bf16_fit_is_keras_mixed_bfloat16():
    """bf16-mixed needs no loss scale: the same weights as Keras's own mixed_bfloat16 fit."""
    mp = pa.MixedPrecision("bf16-mixed", framework="keras")
    with mp.scope():
        ours = tiny_model(keras.config.dtype_policy().name)
    native = tiny_model("mixed_bfloat16")
    native.set_weights(ours.get_weights())
    ours.compile(optimizer=mp.optimizer(keras.optimizers.Adam(1e-2)), loss="mse")
    native.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = nan_data(bad=())
    for model in (ours, native):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(weights(ours), weights(native)):
        np.testing.assert_array_equal(a, b)
    assert mp.state.steps == 12 and mp.state.skipped == 0 and mp.current_scale == 1.0


def test_a_keras_file_reloads_and_trains_on_with_the_same_scale(tmp_path):
    mp = keras_preset(growth_interval=2)
    with mp.scope():
        model = tiny_model(keras.config.dtype_policy().name)
    model.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    model.fit(*nan_data(n_batches=8, bad=(1, 2, 5)), batch_size=8, shuffle=False, verbose=0)
    assert mp.state.skipped == 3 and mp.current_scale != 2.0**15
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer).__name__ == "KerasOptimizer"
    reloaded = loaded.optimizer.mixed_precision
    assert reloaded is not mp and reloaded.state == mp.state and reloaded.loss_scale == mp.loss_scale
    assert loaded.layers[0].dtype_policy.name == "mixed_float16"
    x2, y2 = nan_data(n_batches=8, bad=(0, 3), seed=2)
    for m in (model, loaded):
        m.fit(x2, y2, batch_size=8, shuffle=False, verbose=0)
    assert reloaded.state == mp.state and reloaded.state.skipped == 5
    for a, b in zip(weights(model), weights(loaded)):
        np.testing.assert_array_equal(a, b)


def test_state_dict_round_trips_before_and_after_the_optimizer_is_built():
    mp = keras_preset()
    saved = keras_preset()
    saved.load_state_dict({**saved.state_dict(), "state": {**saved.state.as_dict(), "scale": 512.0,
                                                           "skipped": 4, "steps": 9}})  # fmt: skip
    mp.load_state_dict(saved.state_dict())  # before: held by mp, the optimizer's variables start there
    opt = mp.optimizer(keras.optimizers.SGD(0.1))
    opt.build([four()])
    assert float(numpy(opt.dynamic_scale.value)) == 512.0 and mp.state == saved.state
    step(opt, [ops.array([INF, 1.0, 1.0, 1.0])], [four()], stateless=False)
    assert mp.state.scale == 256.0 and mp.state.skipped == 5
    mp.load_state_dict(saved.state_dict())  # after: written into the variables
    assert float(numpy(opt.dynamic_scale.value)) == 512.0 and mp.state == saved.state


def test_the_guard_stops_fit_after_consecutive_skips():
    mp = keras_preset(max_consecutive_skips=3)
    with mp.scope():
        model = tiny_model(keras.config.dtype_policy().name)
    model.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.05)), loss="mse")
    x, y = nan_data(n_batches=6, bad=(1, 2, 3, 4))
    with pytest.raises(NonFiniteError, match="3 consecutive steps were skipped"):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[mp.callback()])
    assert mp.state.skipped_in_a_row == 3


def test_scope_keeps_probabilities_float32_and_keep_fp32_applies_at_watch():
    mp = pa.MixedPrecision("fp16-mixed", framework="keras", keep_fp32=["head"])
    with mp.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="body"),
                                  keras.layers.Dense(3, name="head"), keras.layers.Softmax()])  # fmt: skip
    assert keras.config.dtype_policy().name == "float32"  # restored on exit
    assert model.layers[-1].dtype_policy.name == "float32"
    with pytest.raises(PolyampError, match=r"call mp.watch\(model\)"):
        mp.optimizer(keras.optimizers.SGD(0.1))
    mp.watch(model)
    assert [layer.dtype_policy.name for layer in model.layers] == ["mixed_float16", "float32", "float32"]
    with pytest.warns(UserWarning, match="every layer of .* computes in float32"):
        pa.MixedPrecision("bf16-mixed", framework="keras").watch(tiny_model())


def test_the_front_end_is_chosen_by_the_keras_backend_and_says_what_it_does_not_do():
    mp = pa.MixedPrecision("fp16-mixed", framework="keras")
    assert type(mp).__module__ == "polyamp.keras" and mp.framework == "keras"
    with pytest.raises(PolyampError, match=f"Keras runs on its '{BACKEND}' backend here.*framework='keras'"):
        pa.MixedPrecision("fp16-mixed", framework="tensorflow").scope()
    with pytest.raises(PolyampError, match="trains with Keras on its TensorFlow backend"):
        pa.MixedPrecision("mxfp8", framework="keras")
    with pytest.raises(PolyampError, match="already scales the loss"):
        mp.optimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    with pytest.raises(PolyampError, match="has no compiled Keras form"):
        pa.MixedPrecision("fp16-mixed", framework="keras",
                          loss_scale=pa.DynamicLossScale.preset("mxnet")).optimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(PolyampError, match=r"scale\(\) is the tensorflow idiom; this MixedPrecision drives "
                                           r"keras\. In keras: fit with mp.optimizer"):  # fmt: skip
        mp.scale(1.0)


def test_the_docs_example_runs_as_it_says(tmp_path):
    from docs_example import run_example

    run_example("keras-backends.md", "keras", tmp_path)
