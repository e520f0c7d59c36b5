"""The TensorFlow/Keras 3 backend end to end, against Keras's own LossScaleOptimizer.

What every front end must do (fault injection, skip agreement, resume, bad input, every policy
skipping) is tests/test_contract.py; this file keeps what is this framework's own.
"""

import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from frameworks import require  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import NonFiniteError, PolyampError  # noqa: E402

tf = require("tensorflow")
keras = require("keras")

INF = float("inf")


def tiny_model(mp=None, seed=0, width=16):
    keras.utils.set_random_seed(seed)
    with mp.scope() if mp is not None else _null():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(width, activation="gelu"),
                                 keras.layers.Dense(1)])  # fmt: skip


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def fp16(**loss_scale):
    ls = pa.DynamicLossScale(**loss_scale)
    return pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)


def batches(n, seed=1, size=32):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        x = rng.standard_normal((size, 8)).astype(np.float32)
        yield x, np.sin(x.sum(axis=1, keepdims=True))


def mse(model, x, y):
    return tf.reduce_mean(tf.square(tf.cast(model(x, training=True), tf.float32) - y))


def values(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def poison(grads, inject, value=INF):
    """Put ``value`` into the first gradient where ``inject`` (a bool tensor) holds."""
    return [grads[0] + tf.where(inject, tf.constant(value, grads[0].dtype), tf.zeros((), grads[0].dtype)),
            *grads[1:]]  # fmt: skip


def polyamp_step(mp, model, opt):
    @tf.function
    def step(x, y, inject):
        with tf.GradientTape() as tape:
            scaled = mp.scale(mse(model, x, y))
        grads = poison(tape.gradient(scaled, model.trainable_variables), inject)
        return mp.apply(opt, grads, model.trainable_variables)

    return step


# -- scope and policies ----------------------------------------------------------------------------
def test_scope_sets_the_layer_policy_and_restores_the_previous_one():
    keras.config.set_dtype_policy("float32")
    mp = pa.MixedPrecision("bf16-mixed", framework="tensorflow")
    with mp.scope() as policy:
        assert policy.name == "mixed_bfloat16"
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Softmax()])
    assert keras.config.dtype_policy().name == "float32"
    dense, softmax = model.layers
    assert (dense.compute_dtype, dense.variable_dtype) == ("bfloat16", "float32")
    assert softmax.dtype_policy.name == "float32"
    out = model(np.ones((2, 8), np.float32))
    assert out.dtype == tf.float32
    assert dense.kernel.dtype == "float32"


def test_probability_layers_stay_float32_only_where_the_policy_says_so():
    layers = keras.layers
    for policy, expected in [("fp16-mixed", "float32"), ("p=f32,c=f16,o=f16", "float16"),
                             ("bf16-true", "bfloat16"), ("p=bf16,c=bf16,o=f32", "float32")]:  # fmt: skip
        with pa.MixedPrecision(policy, framework="tensorflow").scope():
            made = [layers.Softmax(), layers.Activation("log_softmax"), layers.Activation("sigmoid")]
            relu = layers.Activation("relu")
            explicit = layers.Softmax(dtype="bfloat16")
        assert [layer.compute_dtype for layer in made] == [expected] * 3, policy
        assert relu.compute_dtype != "float32" and explicit.compute_dtype == "bfloat16"
        assert made[0].get_config()["axis"] == -1  # Keras still records the layer's config
    assert layers.Softmax().compute_dtype == "float32"  # outside a scope: the global policy


@pytest.mark.parametrize(
    "policy, keras_name",
    [("float32", "float32"), ("bf16-mixed", "mixed_bfloat16"), ("mixed_float16", "mixed_float16"),
     ("bf16-true", "bfloat16"), ("fp16-true", "float16"), ("64-true", "float64")],
)  # fmt: skip
def test_each_accepted_policy_maps_to_its_keras_policy(policy, keras_name):
    with pa.MixedPrecision(policy, framework="tensorflow").scope() as keras_policy:
        assert keras_policy.name == keras_name
        assert keras.layers.Dense(2).dtype_policy.name == keras_name


@pytest.mark.parametrize(
    "policy", ["p=bf16,c=f32,o=f32", "p=f16,c=bf16", "p=f32,c=f32,o=bf16", "p=f64,c=f32"]
)
def test_a_policy_keras_cannot_honour_is_one_clear_error(policy):
    mp = pa.MixedPrecision(policy, framework="tensorflow")
    before = keras.config.dtype_policy().name
    with pytest.raises(PolyampError, match="Keras cannot honour") as err:
        with mp.scope():
            pass
    message = str(err.value)
    assert "accepted: float32, bf16-mixed, fp16-mixed, bf16-true, fp16-true" in message
    assert repr(mp.policy.name) in message
    assert keras.config.dtype_policy().name == before
    with pytest.raises(PolyampError, match="Keras cannot honour"):
        mp.optimizer(keras.optimizers.SGD(0.1))


# -- against Keras's LossScaleOptimizer ---------------------------------------------------------------
OVERFLOWS = {2, 3, 9, 10, 11, 17, 25}


def test_custom_loop_in_tf_function_matches_loss_scale_optimizer_bit_for_bit():
    """fp16 model, same data and overflow pattern: polyamp's keras preset inside tf.function and
    the real LossScaleOptimizer give the same scale sequence, skips and weights."""
    ls = dataclasses.replace(pa.DynamicLossScale.preset("keras"), growth_interval=3)
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)
    ours, native = tiny_model(mp), tiny_model(mp)
    native.set_weights(ours.get_weights())
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    lso = keras.optimizers.LossScaleOptimizer(inner, dynamic_growth_steps=3)
    step = polyamp_step(mp, ours, opt)

    @tf.function
    def native_step(x, y, inject):
        with tf.GradientTape() as tape:
            scaled = lso.scale_loss(mse(native, x, y))
        grads = poison(tape.gradient(scaled, native.trainable_variables), inject)
        lso.apply(grads, native.trainable_variables)

    scales, native_scales, stepped = [], [], []
    for i, (x, y) in enumerate(batches(30)):
        inject = tf.constant(i in OVERFLOWS)
        result = step(x, y, inject)
        native_step(x, y, inject)
        stepped.append(bool(result.stepped))
        scales.append(float(result.scale))
        native_scales.append(float(lso.dynamic_scale.numpy()))
        for a, b in zip(ours.trainable_variables, native.trainable_variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"step {i}")
    assert scales == native_scales and any(b > a for a, b in zip(scales, scales[1:]))
    assert [i for i, s in enumerate(stepped) if not s] == sorted(OVERFLOWS)
    assert mp.current_scale == scales[-1] and mp.state.skipped == len(OVERFLOWS)
    assert int(opt.iterations.numpy()) == int(lso.iterations.numpy()) == 30 - len(OVERFLOWS)


def test_fit_matches_loss_scale_optimizer_bit_for_bit():
    """``model.fit`` with ``mp.optimizer`` vs ``fit`` with Keras's LossScaleOptimizer, NaN inputs in
    some batches: same per-batch scales and the same weights."""
    ls = dataclasses.replace(pa.DynamicLossScale.preset("keras"), growth_interval=3)
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)
    ours, native = tiny_model(mp), tiny_model(mp)
    native.set_weights(ours.get_weights())
    ours.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.05)), loss="mse")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), dynamic_growth_steps=3)
    native.compile(optimizer=lso, loss="mse")
    assert type(ours.optimizer).__name__ == "PolyampOptimizer"  # compile did not wrap it again
    x, y = (np.concatenate(a) for a in zip(*batches(20, size=8)))
    bad = [1, 2, 7, 12]
    x[[8 * b + 3 for b in bad], 0] = np.nan  # one NaN sample in each of these batches

    def record(model, into):
        cb = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: into.append(float(model.optimizer.dynamic_scale.numpy()))
        )
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])

    scales, native_scales = [], []
    record(ours, scales)
    record(native, native_scales)
    assert scales == native_scales and any(b > a for a, b in zip(scales, scales[1:]))
    for a, b in zip(ours.trainable_variables, native.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert mp.state.skipped == len(bad) and mp.state.steps == 20
    assert all(np.isfinite(v).all() for v in values(ours))


def test_keras_preset_flushes_the_scale_to_zero_in_tf_function_as_loss_scale_optimizer_does():
    """From 2^15, 141 overflows reach 2^-126; the next halving is subnormal and TF flushes it."""
    ls = dataclasses.replace(pa.DynamicLossScale.preset("keras"), max_consecutive_skips=None)
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)
    ours, native = (keras.Variable(np.zeros(3, np.float32)) for _ in range(2))
    opt, lso = keras.optimizers.SGD(0.0), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0))
    grad = tf.constant([1.0, INF, 1.0])
    step = tf.function(lambda: mp.apply(opt, [grad], [ours]).scale)
    native_step = tf.function(lambda: lso.apply([grad], [native]))
    scales, native_scales = [], []
    for _ in range(143):
        scales.append(float(step()))
        native_step()
        native_scales.append(float(lso.dynamic_scale.numpy()))
    assert scales == native_scales and scales[140:] == [2.0**-126, 0.0, 0.0]


def test_an_eager_step_warns_when_the_scale_falls_below_one():
    ls = dataclasses.replace(pa.DynamicLossScale.preset("torch"), init_scale=1.0)
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)
    variable = keras.Variable(np.zeros(3, np.float32))
    with pytest.warns(RuntimeWarning, match="fell below 1"):
        result = mp.apply(keras.optimizers.SGD(0.1), [tf.constant([1.0, np.nan, 1.0])], [variable])
    assert result.scale == 0.5 and not result.stepped


# -- the step --------------------------------------------------------------------------------------
def test_clipping_reports_the_unscaled_norm_and_clips():
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=1024.0)
    model = tiny_model()
    opt = keras.optimizers.SGD(1.0)
    x, y = next(batches(1))
    with tf.GradientTape(persistent=True) as tape:
        loss = mse(model, x, y)
        scaled = mp.scale(loss)
    expected = float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))
    before = values(model)
    result = mp.apply(opt, tape.gradient(scaled, model.trainable_variables), model.trainable_variables,
                      clip_grad_norm=1e-3)  # fmt: skip
    assert result.grad_norm == pytest.approx(expected, rel=1e-5)
    update = [a - b for a, b in zip(before, values(model))]  # SGD(lr=1): the clipped gradient
    norm = np.sqrt(sum((u.astype(np.float64) ** 2).sum() for u in update))
    assert float(norm) == pytest.approx(1e-3, rel=1e-3)


def test_step_result_comes_back_from_a_tf_function():
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    model = tiny_model(mp)
    step = polyamp_step(mp, model, keras.optimizers.SGD(0.01))
    x, y = next(batches(1))
    result = step(x, y, tf.constant(True))
    assert isinstance(result, pa.StepResult) and result.nonfinite == () and result.grad_norm is None
    assert result.stepped.dtype == tf.bool and not bool(result.stepped)
    assert float(result.scale) == mp.current_scale == 2.0**15


def test_the_state_inside_a_tf_function_is_one_clear_error_and_repr_still_works():
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    model = tiny_model(mp)
    step = polyamp_step(mp, model, keras.optimizers.SGD(0.01))
    x, y = next(batches(1))
    step(x, y, tf.constant(True))  # the state now lives in tf.Variables
    seen = {}

    @tf.function
    def inspect():
        seen["repr"] = repr(mp)
        with pytest.raises(PolyampError, match=r"read eagerly.*loss_scale_variables\(\)\.scale"):
            seen["scale"] = mp.current_scale
        return mp.loss_scale_variables().scale.read_value()

    assert float(inspect()) == mp.current_scale == 2.0**15
    assert seen["repr"] == "MixedPrecision('fp16-mixed', framework='tensorflow', scale=<traced>)"
    assert repr(mp) == "MixedPrecision('fp16-mixed', framework='tensorflow', scale=32768)"


def test_scaled_loss_is_float32_even_for_a_float16_loss():
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    scaled = mp.scale(tf.constant(4.0, tf.float16))
    assert scaled.dtype == tf.float32 and float(scaled) == 4.0 * 2.0**16  # would overflow in fp16


def cast_step(mp, opt, variable):
    """A traced step whose gradient is ``tf.cast(source, float32)``, as a ``mixed_*`` backward makes
    it: the check reads ``source`` when that cast widens exactly."""

    @tf.function
    def step(source):
        return mp.apply(opt, [tf.cast(source, tf.float32)], [variable])

    return step


@pytest.mark.parametrize(("dtype", "policy", "loss_scale", "read"), [
    ("bfloat16", "bf16-mixed", "none", "bfloat16"),
    ("bfloat16", "fp16-mixed", 4.0, "bfloat16"),
    ("float16", "fp16-mixed", 4.0, "float32"),  # a float16 sum would overflow: the float32 is read
])  # fmt: skip
def test_a_traced_step_checks_the_gradient_in_the_dtype_the_backward_made_it(dtype, policy, loss_scale, read):
    mp = pa.MixedPrecision(policy, framework="tensorflow", loss_scale=loss_scale)
    variable = keras.Variable(np.ones(4, np.float32))
    opt = keras.optimizers.SGD(0.5)
    step = cast_step(mp, opt, variable)
    for bad in (np.nan, INF, -INF):
        assert not bool(step(tf.constant([1.0, bad, 2.0, 3.0], dtype)).stepped)
    assert variable.numpy().tolist() == [1.0] * 4 and int(opt.iterations.numpy()) == 0
    graph = step.get_concrete_function(tf.TensorSpec([4], dtype)).graph  # the traced step
    assert any(op.type == "Sum" and op.inputs[0].dtype == read for op in graph.get_operations())
    good = 2.0 * (1.0 if loss_scale == "none" else loss_scale)  # unscaled: 2, so SGD(0.5) gives 0
    assert bool(step(tf.constant([good] * 4, dtype)).stepped)
    assert variable.numpy().tolist() == [0.0] * 4 and mp.state.skipped == 3


def test_a_finite_sum_that_overflows_or_a_narrowing_cast_are_decided_exactly():
    mp = pa.MixedPrecision("bf16-mixed", framework="tensorflow", loss_scale="none")
    variable = keras.Variable(np.zeros(2, np.float32))
    step = cast_step(mp, keras.optimizers.SGD(0.0), variable)
    # finite bfloat16 values whose sum overflows: the quick test fails, the exact check steps
    assert bool(step(tf.constant([3e38, 3e38], tf.bfloat16)).stepped)
    # float64 -> float32 narrows: +-1e300 (float64 sum 0) become +-inf; the float64 tensor must
    # not stand for them
    assert not bool(step(tf.constant([1e300, -1e300], tf.float64)).stepped)
    assert mp.state.skipped == 1 and variable.numpy().tolist() == [0.0, 0.0]


def test_unscaling_by_a_scale_below_one_that_overflows_is_skipped():
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=0.5)
    variable = keras.Variable(np.zeros(2, np.float32))
    step = cast_step(mp, keras.optimizers.SGD(0.0), variable)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # 3e38 is finite in bfloat16 and float32; 3e38 / 0.5 is not
        assert not bool(step(tf.constant([3e38, 1.0], tf.bfloat16)).stepped)
        assert bool(step(tf.constant([1e38, 1.0], tf.bfloat16)).stepped)


def test_too_many_consecutive_skips_raise_eagerly_and_inside_tf_function():
    ls = pa.DynamicLossScale(max_consecutive_skips=4)
    x, y = next(batches(1))
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)
    model = tiny_model(mp)
    opt = keras.optimizers.SGD(0.01)
    for i in range(4):
        with tf.GradientTape() as tape:
            loss = mp.scale(mse(model, x, y))
        grads = poison(tape.gradient(loss, model.trainable_variables), tf.constant(True), np.nan)
        if i < 3:
            assert not mp.apply(opt, grads, model.trainable_variables).stepped
    with pytest.raises(NonFiniteError, match=r"not finite \('sequential(_\d+)?/dense(_\d+)?/kernel'\)"):
        mp.apply(opt, grads, model.trainable_variables)

    graph_mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)
    step = polyamp_step(graph_mp, tiny_model(graph_mp), keras.optimizers.SGD(0.01))
    for _ in range(3):
        assert not bool(step(x, y, tf.constant(True)).stepped)
    with pytest.raises(tf.errors.InvalidArgumentError, match="polyamp NonFiniteError: 4 consecutive"):
        step(x, y, tf.constant(True))


# -- checkpoints -----------------------------------------------------------------------------------
@functools.cache
def trained_mp(steps=5):
    """(mp, model, optimizer) after ``steps`` traced steps, two of them overflowing; shared, read only."""
    mp = fp16(growth_interval=3)
    model = tiny_model(mp)
    opt = keras.optimizers.Adam(1e-2)
    step = polyamp_step(mp, model, opt)
    for i, (x, y) in enumerate(batches(steps)):
        step(x, y, tf.constant(i in (1, 2)))
    return mp, model, opt


def test_state_dict_round_trip_writes_the_variables_and_checks_the_policy():
    mp, _, _ = trained_mp()
    saved = copy.deepcopy(mp.state_dict())
    assert saved["state"]["scale"] == 2.0**14 and saved["state"]["good_steps"] == 2
    assert json.loads(json.dumps(saved)) == saved
    other = fp16(growth_interval=3)
    model = tiny_model(other)  # its variables exist: loading must assign them
    other.load_state_dict(saved)
    assert other.state == mp.state and other.current_scale == 2.0**14
    assert float(other.scale(tf.constant(1.0))) == 2.0**14  # the graph reads the loaded value
    step = polyamp_step(other, model, keras.optimizers.Adam(1e-2))
    x, y = next(batches(1))
    assert float(step(x, y, tf.constant(False)).scale) == 2.0**15  # third good step in a row: grows
    with pytest.raises(PolyampError, match="saved with policy 'fp16-mixed'"):
        pa.MixedPrecision("bf16-mixed", framework="tensorflow").load_state_dict(saved)


def test_tf_train_checkpoint_holds_the_loss_scale_state(tmp_path):
    mp, model, opt = trained_mp()
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))
    fresh = fp16(growth_interval=3)
    model2 = tiny_model(fresh, seed=5)
    opt2 = keras.optimizers.Adam(1e-2)
    tf.train.Checkpoint(model=model2, optimizer=opt2).restore(path)
    assert fresh.state == fresh.loss_scale.init()  # deferred: the state is not attached yet
    step = polyamp_step(fresh, model2, opt2)
    x, y = next(batches(1, seed=9))
    step(x, y, tf.constant(True))  # attaches the state (restored now), then one overflow
    assert fresh.state == mp.loss_scale.update(mp.state, False)


RESUME = textwrap.dedent(
    """
    import os, sys, json, time
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import numpy as np, tensorflow as tf, keras, polyamp as pa

    def main(mode, path, start, stop, save_at):
        saved = os.path.join(os.path.dirname(path), "saved")  # written once the full run's checkpoint is
        mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow",
                               loss_scale=pa.DynamicLossScale(growth_interval=3))
        keras.utils.set_random_seed(0)
        with mp.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="gelu"),
                                      keras.layers.Dense(1)])
        opt = keras.optimizers.Adam(1e-2)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
        if mode == "resume":
            deadline = time.time() + 300
            while not os.path.exists(saved) and time.time() < deadline:  # started with the full run
                time.sleep(0.05)
            status = ckpt.restore(path)
        @tf.function
        def step(x, y, inject):
            with tf.GradientTape() as tape:
                out = tf.cast(model(x, training=True), tf.float32)
                scaled = mp.scale(tf.reduce_mean(tf.square(out - y)))
            grads = tape.gradient(scaled, model.trainable_variables)
            grads[0] = grads[0] + tf.where(inject, float("inf"), 0.0)
            return mp.apply(opt, grads, model.trainable_variables)
        rng = np.random.default_rng(1)
        data = rng.standard_normal((stop, 16, 8)).astype(np.float32)
        for i in range(start, stop):
            if i == save_at:
                ckpt.save(path + ".ckpt")  # -> path.ckpt-1
                open(saved, "w").close()
            step(data[i], np.sin(data[i].sum(1, keepdims=True)), tf.constant(i % 7 == 3))
        if mode == "resume":
            status.assert_consumed()  # every saved value, the loss-scale state included, was restored
        np.savez(path + f".{mode}", *[v.numpy() for v in model.trainable_variables])
        json.dump(mp.state_dict(), open(path + f".{mode}.json", "w"))

    if __name__ == "__main__":
        tf.config.experimental.enable_op_determinism()
        main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
    """
)


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
    """The full run in this process (``RESUME``'s main, op determinism on as in the new one), the resumed
    one in a new process, started first: it imports TensorFlow while the full run trains, then waits for
    the checkpoint of step 17 that the full run writes on the way."""
    from tensorflow.python.framework import config as tf_config

    script = tmp_path / "train.py"
    script.write_text(RESUME)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
    resume_run = subprocess.Popen([sys.executable, str(script), "resume", str(tmp_path / "run.ckpt-1"), "17",
                                   "40", "-1"], env=env)  # fmt: skip
    try:
        namespace = {"__name__": "resume"}
        exec(compile(RESUME, str(script), "exec"), namespace)
        deterministic = tf_config.is_op_determinism_enabled()
        tf_config.enable_op_determinism()
        try:
            namespace["main"]("full", str(tmp_path / "run"), 0, 40, 17)
        finally:
            if not deterministic:
                tf_config.disable_op_determinism()
        assert resume_run.wait(timeout=300) == 0
    finally:
        resume_run.kill()
    full = json.loads((tmp_path / "run.full.json").read_text())
    resumed = json.loads((tmp_path / "run.ckpt-1.resume.json").read_text())
    assert full == resumed and full["state"]["steps"] == 40 and full["state"]["skipped"] >= 6
    a, b = np.load(tmp_path / "run.full.npz"), np.load(tmp_path / "run.ckpt-1.resume.npz")
    assert all(np.array_equal(a[k], b[k]) for k in a.files)


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input_is_one_clear_error_and_changes_nothing():
    torch = require("torch")
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    model = tiny_model(mp)
    opt = keras.optimizers.SGD(0.1)
    x, y = next(batches(1))
    with tf.GradientTape() as tape:
        loss = mp.scale(mse(model, x, y))
    grads = tape.gradient(loss, model.trainable_variables)
    variables = model.trainable_variables
    before = values(model)
    with pytest.raises(PolyampError, match="expected a Keras 3 optimizer .* got tensorflow.*GradientDescent"):
        mp.optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(PolyampError, match="expected a Keras 3 optimizer"):
        mp.apply(tf.compat.v1.train.GradientDescentOptimizer(0.1), grads, variables)
    with pytest.raises(PolyampError, match="LossScaleOptimizer, which already scales the loss"):
        mp.optimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    with pytest.raises(PolyampError, match="PolyampOptimizer, which already scales the loss"):
        mp.apply(mp.optimizer(keras.optimizers.SGD(0.1)), grads, variables)
    with pytest.raises(PolyampError, match=r"grads\[1\] is a torch.Tensor; mp.apply takes TensorFlow"):
        mp.apply(opt, [grads[0], torch.zeros(16), *grads[2:]], variables)
    with pytest.raises(PolyampError, match="drives tensorflow, but loss is a torch object"):
        mp.scale(torch.tensor(1.0))
    with pytest.raises(PolyampError, match="drives tensorflow, but optimizer is a torch object"):
        mp.apply(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), grads, variables)
    with pytest.raises(PolyampError, match="3 gradients for 4 variables"):
        mp.apply(opt, grads[:3], variables)
    with pytest.raises(PolyampError, match="loss must be a scalar"):
        mp.scale(tf.ones((2, 2)))
    with pytest.raises(PolyampError, match="mxnet.*no tf.function form"):
        pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale="mxnet").scale(tf.constant(1.0))
    in_graph = tf.function(lambda: mp.apply(opt, grads[:3], variables))
    with pytest.raises(PolyampError, match="3 gradients for 4 variables"):  # the same type in tf.function
        in_graph()
    with tf.GradientTape() as tape:
        unscaled = mse(model, x, y)
    outside = tape.gradient(mp.scale(unscaled), variables)  # the scaling ran after the tape closed
    with pytest.raises(PolyampError, match=r"every gradient is None.*mp.scale\(loss\) inside the `with tf"):
        mp.apply(opt, outside, variables)
    assert mp.state == mp.loss_scale.init() and int(opt.iterations.numpy()) == 0
    assert all((a == b).all() for a, b in zip(before, values(model)))
    assert mp.apply(opt, grads, variables).stepped  # and the good call still works


def test_watch_learns_the_variable_names():
    mp = pa.MixedPrecision("bf16-mixed", framework="tensorflow")
    model = tiny_model(mp)
    assert mp.watch(model) is model
    assert sorted(mp._names.values()) == sorted(v.path for v in model.variables)
    with pytest.raises(PolyampError, match="must be a tensor/model/optimizer"):
        mp.watch(object())


# -- the example -----------------------------------------------------------------------------------
def test_keras_example_fixes_the_unscaled_custom_loop_and_trains_with_fit(monkeypatch, capsys):
    """The script as ``python examples/keras_amp.py`` runs it, in this process (TensorFlow imported)."""
    import runpy

    example = Path(__file__).parents[1] / "examples" / "keras_amp.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--policy", "fp16-mixed", "--steps", "60"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    seed_off, flushed, ours_off = map(float, re.search(
        r"gradient off by ([\d.]+)%, ([\d.]+)% of its values flushed to zero; polyamp: off by ([\d.]+)%", out
    ).groups())  # fmt: skip
    assert seed_off > 5 and flushed > 1 and ours_off < 0.1
    first, last, skipped, scale = re.search(
        r"custom loop: loss ([\d.]+) -> ([\d.]+), (\d+) overflow steps skipped, final scale ([\d.e+-]+)", out
    ).groups()
    # six injected overflows (steps 0, 10, ..., 50) plus any real fp16 overflow; each halves
    assert float(last) < float(first) / 2 and int(skipped) >= 6
    assert float(scale) == 2.0**16 / 2 ** int(skipped)
    first, last, skipped, scale = re.search(
        r"fit: epoch loss ([\d.]+) -> ([\d.]+), (\d+) steps skipped, final scale ([\d.e+-]+)", out
    ).groups()
    assert float(last) < float(first) / 5 and float(scale) == 2.0**16 / 2 ** int(skipped)


# -- issue 11: Keras's own LossScaleOptimizer scenarios (keras/src/optimizers/loss_scale_optimizer_test.py)
def four(values=(1.0, 2.0, 3.0, 4.0)):
    return keras.Variable(np.array(values, np.float32))


def keras_preset(**changes):
    ls = dataclasses.replace(pa.DynamicLossScale.preset("keras"), **changes)
    return pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=ls)


def native_lso(grads, variables, inner, **config):
    lso = keras.optimizers.LossScaleOptimizer(inner, **config)
    lso.apply(grads, variables)
    return [v.numpy() for v in variables]


PATHS = ["apply eager", "apply tf.function", "optimizer eager", "optimizer tf.function"]


def run_path(path, mp, inner, grads, variables):
    """One step of ``grads`` through mp.apply or the fit optimizer (its apply is what fit calls)."""
    if path.startswith("apply"):
        step = lambda: mp.apply(inner, grads, variables)  # noqa: E731
    else:
        opt = mp.optimizer(inner)
        opt.build(variables)
        step = lambda: opt.apply(grads, variables)  # noqa: E731
    return step() if path.endswith("eager") else tf.function(step)()


@pytest.mark.parametrize("path", PATHS)
def test_overwrite_with_gradient_variables_take_the_value_unscaled(path):
    """Keras's test_finite_step_with_overwrite: the variable becomes [1, 6, 7, 2] (not divided by
    the scale); a plain variable next to it is unscaled and clipped as before."""
    mp = keras_preset()
    overwritten, plain = four(), four()
    overwritten.overwrite_with_gradient = True
    grads = [tf.constant([1.0, 6.0, 7.0, 2.0]), tf.constant([1.0, 6.0, 7.0, 2.0]) * 2.0**15]
    run_path(path, mp, keras.optimizers.SGD(0.5), grads, [overwritten, plain])
    native = [four(), four()]
    native[0].overwrite_with_gradient = True
    expected = native_lso(grads, native, keras.optimizers.SGD(0.5))
    np.testing.assert_array_equal(overwritten.numpy(), [1.0, 6.0, 7.0, 2.0])
    np.testing.assert_array_equal(overwritten.numpy(), expected[0])
    np.testing.assert_allclose(plain.numpy(), expected[1], rtol=1e-6)
    np.testing.assert_allclose(plain.numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-6)


def test_overwrite_values_are_checked_but_not_clipped_or_counted_in_the_norm():
    mp = keras_preset()
    overwritten, plain = four(), four()
    overwritten.overwrite_with_gradient = True
    grads = [tf.constant([100.0, 600.0, 700.0, 200.0]), tf.constant([3.0, 0.0, 4.0, 0.0]) * 2.0**15]
    result = mp.apply(keras.optimizers.SGD(1.0), grads, [overwritten, plain], clip_grad_norm=1.0)
    assert result.grad_norm == pytest.approx(5.0)
    np.testing.assert_array_equal(overwritten.numpy(), [100.0, 600.0, 700.0, 200.0])
    np.testing.assert_allclose(plain.numpy(), [1.0 - 0.6, 2.0, 3.0 - 0.8, 4.0], rtol=1e-5)
    bad = [tf.constant([1.0, np.inf, 7.0, 2.0]), grads[1]]  # Keras checks these values too: a skip
    result = mp.apply(keras.optimizers.SGD(1.0), bad, [overwritten, plain])
    assert not result.stepped and result.nonfinite == (overwritten.path,)
    np.testing.assert_array_equal(overwritten.numpy(), [100.0, 600.0, 700.0, 200.0])


@pytest.mark.parametrize("path", PATHS)
def test_an_inner_loss_scale_factor_does_not_divide_the_update_again(path):
    """Keras's test_finite_step_with_inner_loss_scale: SGD(0.5, loss_scale_factor=100) under the
    loss scale gives [0.5, -1, -0.5, 3], as LossScaleOptimizer (which clears the factor) does."""
    mp = keras_preset()
    inner = keras.optimizers.SGD(0.5, loss_scale_factor=100)
    variable = four()
    run_path(path, mp, inner, [tf.constant([1.0, 6.0, 7.0, 2.0]) * 2.0**15], [variable])
    expected = native_lso([tf.constant([1.0, 6.0, 7.0, 2.0]) * 2.0**15], [four()],
                          keras.optimizers.SGD(0.5, loss_scale_factor=100))  # fmt: skip
    np.testing.assert_allclose(variable.numpy(), expected[0], rtol=1e-6)
    np.testing.assert_allclose(variable.numpy(), [0.5, -1.0, -0.5, 3.0], rtol=1e-6)
    assert inner.loss_scale_factor is None


@pytest.mark.parametrize(
    "grad, init, steps, growth, expected",
    [(1.0, 2.0, 8, 2, 32.0), (np.inf, 400.0, 4, 2000, 25.0)],
    ids=["upscaling", "downscaling"],
)  # fmt: skip
def test_the_optimizer_config_describes_the_loss_scale_in_use(grad, init, steps, growth, expected):
    """Keras's test_upscaling / test_downscaling / test_serialization: the same scale after the
    same steps as LossScaleOptimizer, and a config that names the initial scale and the growth
    interval polyamp actually uses."""
    mp = keras_preset(init_scale=init, growth_interval=growth)
    opt = mp.optimizer(keras.optimizers.SGD(0.5))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=init,
                                              dynamic_growth_steps=growth)  # fmt: skip
    ours, native = four(), four()
    grads = [tf.constant([grad, 6.0, 7.0, 2.0])]
    for _ in range(steps):
        opt.apply(grads, [ours])
        lso.apply(grads, [native])
    assert float(opt.scale_loss(tf.constant(1.0))) == float(lso.scale_loss(1.0)) == expected
    config = opt.get_config()
    assert (config["initial_scale"], config["dynamic_growth_steps"]) == (init, growth)
    assert {k: config[k] for k in ("initial_scale", "dynamic_growth_steps")} == {
        k: lso.get_config()[k] for k in ("initial_scale", "dynamic_growth_steps")
    }
    assert config["mixed_precision"] == mp.state_dict() and json.loads(json.dumps(config)) == config
    again = type(opt).from_config(copy.deepcopy(config))
    assert again.get_config() == config and again.mixed_precision.state == mp.state
    static = pa.MixedPrecision("fp16-mixed", framework="tensorflow", loss_scale=128.0)
    config = static.optimizer(keras.optimizers.SGD(0.5)).get_config()
    assert (config["initial_scale"], config["dynamic_growth_steps"]) == (128.0, None)
    with pytest.raises(PolyampError, match="needs 'mixed_precision'"):
        type(opt).from_config(lso.get_config())


# -- issue 11: a model left in float32 ---------------------------------------------------------------
def test_a_model_built_outside_the_scope_is_warned_about_once():
    keras.config.set_dtype_policy("float32")
    mp = fp16()
    outside = tiny_model()
    step = polyamp_step(mp, outside, keras.optimizers.SGD(0.01))
    x, y = next(batches(1))
    float32_step = r"'fp16-mixed' computes in float16, but no op .* outside `mp.scope\(\)`"
    with pytest.warns(UserWarning, match=float32_step):
        step(x, y, tf.constant(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        step(x[:16], y[:16], tf.constant(False))  # a second trace: once per run
        inside_mp = fp16()
        inside = tiny_model(inside_mp)
        inside_mp.watch(inside)
        polyamp_step(inside_mp, inside, keras.optimizers.SGD(0.01))(x, y, tf.constant(False))
    with pytest.warns(UserWarning, match="every layer of .* computes in float32"):
        pa.MixedPrecision("bf16-mixed", framework="tensorflow").watch(tiny_model())
    fit_mp = fp16()
    model = tiny_model()
    model.compile(optimizer=fit_mp.optimizer(keras.optimizers.SGD(0.01)), loss="mse")
    with pytest.warns(UserWarning, match="outside `mp.scope"):
        model.fit(x, y, verbose=0)


# -- issue 11: saving and logging with fit -------------------------------------------------------------
def nan_data(n_batches=8, bad=(1, 2, 5), seed=1):
    """Batches of 8 with one NaN sample in each of the ``bad`` batches."""
    x, y = (np.concatenate(a) for a in zip(*batches(n_batches, seed=seed, size=8)))
    x[[8 * b + 3 for b in bad], 0] = np.nan
    return x, y


def test_a_keras_file_reloads_and_trains_on_with_the_same_scale(tmp_path):
    mp = keras_preset(growth_interval=2)
    model = tiny_model(mp)
    model.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss="mse")
    x, y = nan_data()
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert mp.state.skipped == 3 and mp.current_scale != 2.0**15
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer).__name__ == "PolyampOptimizer"
    reloaded = loaded.optimizer.mixed_precision
    assert reloaded is not mp and reloaded.state == mp.state and reloaded.loss_scale == mp.loss_scale
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 5
    assert loaded.layers[0].dtype_policy.name == "mixed_float16"
    x2, y2 = nan_data(bad=(0, 3), seed=2)
    for m in (model, loaded):
        m.fit(x2, y2, batch_size=8, shuffle=False, verbose=0)
    assert reloaded.state == mp.state and reloaded.state.skipped == 5
    for a, b in zip(model.trainable_variables, loaded.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_fit_logs_hold_the_loss_scale_and_the_skipped_steps():
    from polyamp.tensorflow import LossScaleLogger

    mp = keras_preset(growth_interval=2)
    model = tiny_model(mp)
    model.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.05)), loss="mse")
    x, y = nan_data()
    seen = []  # per batch: the logged scale and the optimizer's own
    after = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            (logs["loss_scale"], float(model.optimizer.dynamic_scale.numpy()), logs["skipped_steps"])
        )
    )
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                        callbacks=[LossScaleLogger(), after])  # fmt: skip
    assert history.history["skipped_steps"] == [3, 3] and mp.state.skipped == 6
    assert history.history["loss_scale"][-1] == mp.current_scale
    assert [s for s, _, _ in seen] == [native for _, native, _ in seen] and len(seen) == 16
    assert [k for _, _, k in seen[:8]] == [0, 1, 2, 2, 2, 3, 3, 3]
    plain = tiny_model()
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    with pytest.raises(PolyampError, match="compiled with mp.optimizer"):
        plain.fit(x, y, batch_size=8, verbose=0, callbacks=[LossScaleLogger()])
    with_mp = tiny_model(mp)  # a custom train_step may use mp.apply: pass mp itself
    with_mp.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    logged = with_mp.fit(x[:8], y[:8], verbose=0, callbacks=[mp.callback()]).history
    assert logged["loss_scale"] == [mp.current_scale] and logged["skipped_steps"] == [0]
    with pytest.raises(PolyampError, match=r"polyamp's own optimizer .*mixed_precision.state_dict"):
        pa.from_native(model.optimizer)
