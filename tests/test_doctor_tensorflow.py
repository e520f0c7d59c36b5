"""The doctor's TensorFlow / Keras 3 taps (polyamp.tensorflow.doctor) against the numpy core, on real
TensorFlow, and ``keep_fp32`` in the TensorFlow front end."""

import math
import os
import random

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from frameworks import require  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.doctor import KINDS, N_BINS, LogHistogram, Observation, update_ratio_histogram  # noqa: E402

tf = require("tensorflow")
keras = require("keras")

from polyamp.doctor.blocks import measure, parse  # noqa: E402
from polyamp.tensorflow.doctor import collect, histogram, ratio_histogram  # noqa: E402


def reference(t) -> LogHistogram:
    return LogHistogram.of(np.asarray(t.numpy() if hasattr(t, "numpy") else t))


NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "float64": np.float64}  # fmt: skip


def special_values(dtype: str) -> np.ndarray:
    info = ml_dtypes.finfo(NP_DTYPES[dtype])
    big, tiny = float(info.max), float(info.smallest_normal)
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, big, -big, tiny, tiny / 2, tiny / 8, -tiny / 1024]
    if dtype in ("float32", "float64"):
        values += [1e-45, -3e-44, 1.17e-38] if dtype == "float32" else [5e-324, 1e-310]
    return np.array(values, np.float64).astype(NP_DTYPES[dtype])


def wide(n: int, dtype: str, seed: int) -> np.ndarray:
    """Random magnitudes over most of the dtype's exponent range (subnormals included), both signs."""
    rng = np.random.default_rng(seed)
    info = ml_dtypes.finfo(NP_DTYPES[dtype])
    e = rng.uniform(math.log2(float(info.smallest_normal)) - 8, math.log2(float(info.max)) - 1, n)
    return (np.sign(rng.standard_normal(n)) * np.exp2(e)).astype(NP_DTYPES[dtype])


# -- binning on the device equals the numpy core ---------------------------------------------------
def test_float64_ratios_round_as_the_core_and_mixed_dtypes_widen_exactly():
    u = np.array([1e-310, 1e300, 5e-324, 1.0, 3.0, 0.0], np.float64)
    w = np.array([1e-310, 1e-300, 1e300, 5e-324, 1e-5, 2.0], np.float64)
    got, want = ratio_histogram(tf.constant(u), tf.constant(w)), update_ratio_histogram(u, w)
    assert got == want and got.amin_nonzero is None and got.amax == np.finfo(np.float64).max
    u32 = np.array([1e-45, 1e-40, 2.5, -7.0], np.float32)  # float32 subnormals against float64 weights
    w64 = np.array([1e-300, 3e-42, 1e-8, 1e10], np.float64)
    assert ratio_histogram(tf.constant(u32), tf.constant(w64)) == update_ratio_histogram(u32, w64)


def test_only_small_arrays_reach_the_host(monkeypatch):
    """The taps read counts and a few scalars, never a whole tensor (every eager read goes through
    ``_numpy``: ``.numpy()``, ``int()``, ``float()``, ``np.asarray``): what they read does not grow with
    the tensors."""
    from tensorflow.python.framework import ops

    seen = []
    original = ops._EagerTensorBase._numpy

    def spy(self):
        seen.append(int(np.prod(self.shape)))
        return original(self)

    monkeypatch.setattr(ops._EagerTensorBase, "_numpy", spy)

    def reads(width: int) -> list[int]:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                                  keras.layers.Dense(64)])  # fmt: skip
        x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
        x[0, 0] = 1e-40  # subnormals, zeros (relu) and the special-element paths
        seen.clear()
        collect(model, (tf.constant(x), tf.zeros((256, 64))), keras.losses.MeanSquaredError(),
                optimizer=keras.optimizers.Adam())  # fmt: skip
        return sorted(seen)

    small = reads(512)
    assert small == reads(2048) and len(small) == 1  # one record a step
    seen.clear()
    histogram(tf.constant([0.0, 1e-41, math.inf] * 5000))
    ratio_histogram(tf.constant([0.0, 1e-41, 1.0] * 5000), tf.constant([1.0, 0.0, 1e-40] * 5000))
    assert seen and max(seen) <= 2 * N_BINS + 7 < 15000


def test_records_in_a_traced_graph_equal_the_numpy_core():
    """``records``, as the traced step bins: many tensors at once (the general kernel batched over small
    ones and float64, the XLA kernel one by one over large ones), every dtype, special values, zero-size
    tensors, update ratios of (after, before) pairs; the large ones of the sizes the tests above take (the
    XLA kernels are compiled per size)."""
    from polyamp.tensorflow.binning import decode, records

    items, want = [], []
    for dtype, np_dtype in NP_DTYPES.items():
        x = wide(20000, dtype, seed=3)
        x[::89] = np.resize(special_values(dtype), x[::89].size)
        for a in (x, x[:5000], special_values(dtype), np.zeros(0, np_dtype)):
            items.append(tf.constant(a))
            want.append(LogHistogram.of(a))
    relu = np.maximum(np.random.default_rng(4).standard_normal((1 << 18) + 7), 0).astype(np.float32)
    relu[-3:] = [np.nan, 1e-42, -np.inf]  # in the last chunk, shifted back over the one before
    items.append(tf.constant(relu))
    want.append(LogHistogram.of(relu))
    rng = np.random.default_rng(5)
    for n, dtype in ((20000, np.float32), (300, np.float32), (3000, np.float16), (20000, np.float64)):
        before = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(dtype)
        after = (before + rng.standard_normal(n) * np.exp2(rng.integers(-50, 0, n))).astype(dtype)
        after[:n:7], before[1:n:97] = before[:n:7], 0  # lost updates, zero weights
        after[5], before[9] = np.inf, 1e-40 if dtype == np.float32 else 0
        items.append((tf.constant(after), tf.constant(before)))
        with np.errstate(invalid="ignore"):
            want.append(update_ratio_histogram(after - before, before))
    spans = []

    @tf.function
    def binned():
        vector, where = records(items)
        spans[:] = where
        return vector

    vector = binned().numpy()
    assert {layout for layout, _, _ in spans} == {"hist", "ratio"} and len(spans) == len(want)
    assert vector.size == sum(stop - start for _, start, stop in spans)
    for i, ((layout, start, stop), hist) in enumerate(zip(spans, want)):
        assert decode(layout, vector[start:stop]) == hist, i


# -- collect: never changes the model or the optimizer ----------------------------------------------
class Net(keras.Model):
    """A variable at the root and variables in leaves, a frozen layer, BatchNormalization (moving
    statistics), Dropout (a seed generator) and keras.random with the global seed generator."""

    def __init__(self):
        super().__init__()
        self.scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(1.5), name="scale")
        self.fc1 = keras.layers.Dense(16, name="fc1")
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.drop = keras.layers.Dropout(0.25, name="drop")
        self.frozen = keras.layers.Dense(16, name="frozen", trainable=False)
        self.fc2 = keras.layers.Dense(3, name="fc2")

    def call(self, x, training=False):
        x = x * self.scale + keras.random.normal(tf.shape(x), stddev=1e-3)
        return self.fc2(self.frozen(self.drop(tf.nn.relu(self.bn(self.fc1(x), training=training)),
                                              training=training)))  # fmt: skip


def bits(v) -> bytes:
    return np.asarray(v.numpy()).tobytes()


def snapshot(model, optimizer):
    """Everything collect must leave as it found: values bitwise, identities, policies, calls, RNGs."""
    from keras.src.backend.common import global_state

    gen = global_state.get_global_attribute("global_seed_generator")
    layers = [model, *model._flatten_layers(include_self=False)]
    return {
        "variables": [(v.path, id(v), v.trainable, bits(v)) for v in model.variables],
        "metrics": [(v.path, bits(v)) for v in model.metrics_variables],
        "optimizer": ([(v.path, id(v), bits(v)) for v in optimizer.variables], optimizer.built)
        if optimizer is not None
        else None,
        "policies": [(layer.name, id(layer.dtype_policy)) for layer in layers],
        "calls": [layer.name for layer in layers if "call" in vars(layer)],
        "keras rng": bits(gen.state) if gen is not None else None,
        "python rng": random.getstate(),
        "eager": tf.config.functions_run_eagerly(),
    }


def mse(y, out):
    return tf.reduce_mean(tf.square(out - y))


def trained_net(steps=3):
    keras.utils.set_random_seed(0)
    model = Net()
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((32, 6)).astype(np.float32))
    y = tf.constant(rng.standard_normal((32, 3)).astype(np.float32))
    opt = keras.optimizers.Adam(1e-2)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = mse(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return model, opt, (x, y)


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_collect_leaves_model_optimizer_and_rng_bitwise_unchanged(with_optimizer):
    """One step and three (the kept trace run again, from what the first left: its model as it was)."""
    model, opt, batch = trained_net()
    assert int(opt.iterations) == 3  # Adam has state: momentums, velocities, iterations
    opt = opt if with_optimizer else None
    before = snapshot(model, opt)
    for steps in (1, 3):
        obs = collect(model, batch, mse, steps=steps, optimizer=opt)
        assert snapshot(model, opt) == before, steps
        kinds = {o.kind for o in obs}
        assert ("update_ratio" in kinds) == with_optimizer


def test_a_global_seed_generator_made_during_the_step_is_forgotten_again():
    from keras.src.backend.common import global_state

    model, opt, batch = trained_net()
    global_state.set_global_attribute("global_seed_generator", None)
    before = snapshot(model, opt)
    collect(model, batch, mse, optimizer=opt)  # Net's keras.random.normal makes one, seeded by Python's
    assert snapshot(model, opt) == before
    assert global_state.get_global_attribute("global_seed_generator") is None


def test_collect_puts_everything_back_when_the_loss_raises():
    model, opt, batch = trained_net()
    before = snapshot(model, opt)

    def failing_when_run(y, out):  # the graph fails in the second step: after a real optimizer step
        check = tf.debugging.assert_less(opt.iterations, tf.constant(4, opt.iterations.dtype), "second step")
        with tf.control_dependencies([check]):
            return mse(y, out)

    with pytest.raises(tf.errors.InvalidArgumentError, match="second step"):
        collect(model, batch, failing_when_run, steps=3, optimizer=opt)
    assert snapshot(model, opt) == before
    calls = []

    def failing(y, out):  # raises in Python: while tracing, then eagerly
        calls.append(1)
        raise ZeroDivisionError("user loss failed")

    with pytest.raises(ZeroDivisionError, match="user loss failed"):
        collect(model, batch, failing, steps=3, optimizer=opt)
    assert snapshot(model, opt) == before and len(calls) == 2


def test_an_optimizer_not_yet_built_is_left_built_in_its_initial_state():
    def run(opt, doctor: bool):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        x = tf.constant(np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32))
        if doctor:
            collect(model, x, mse, optimizer=opt)
            assert opt.built and int(opt.iterations) == 0
            slots = [v for v in opt.variables if "momentum" in v.path or "velocity" in v.path]
            assert slots and not any(np.any(v.numpy()) for v in slots)
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = mse(x, model(x))
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return [bits(v) for v in model.variables] + [bits(v) for v in opt.variables]

    assert run(keras.optimizers.Adam(0.1), doctor=True) == run(keras.optimizers.Adam(0.1), doctor=False)


def test_a_mixed_policy_model_is_observed_in_float32_and_keeps_its_policies():
    def build(policy):
        keras.utils.set_random_seed(4)
        with _policy(policy):
            return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="gelu", name="a"),
                                     keras.layers.Dense(4, name="b")])  # fmt: skip

    x = tf.constant(np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32))
    mixed, plain = build("mixed_bfloat16"), build("float32")
    policies = [id(layer.dtype_policy) for layer in mixed.layers]
    got = collect(mixed, x, lambda y, out: tf.reduce_mean(tf.square(out)))
    want = collect(plain, x, lambda y, out: tf.reduce_mean(tf.square(out)))
    assert [(o.layer, o.kind, o.hist) for o in got] == [(o.layer, o.kind, o.hist) for o in want]
    assert [id(layer.dtype_policy) for layer in mixed.layers] == policies
    assert mixed.layers[0](x).dtype == tf.bfloat16


class _policy:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(self.name)

    def __exit__(self, *exc):
        keras.config.set_dtype_policy(self.previous)


# -- what collect observes --------------------------------------------------------------------------
def tiny():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, name="fc1"),
                             keras.layers.Activation("gelu", name="act"),
                             keras.layers.Dense(4, name="fc2")])  # fmt: skip


def batch_of(n=16, seed=4):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.standard_normal((n, 8)).astype(np.float32)), tf.constant(
        rng.standard_normal((n, 4)).astype(np.float32))  # fmt: skip


@pytest.mark.parametrize("eagerly", [False, True])
def test_observations_equal_the_numpy_core_on_the_same_tensors_in_model_order(eagerly):
    """Traced, the step is a graph (grappler may fuse and reorder float ops, as in a tf.function training
    step), so the reference is the same step by hand in a tf.function; eagerly, by hand eagerly."""
    model = tiny()
    x, y = batch_of()
    tf.config.run_functions_eagerly(eagerly)
    try:
        obs = collect(model, (x, y), keras.losses.MeanSquaredError())
    finally:
        tf.config.run_functions_eagerly(False)
    fc1, act, fc2 = model.layers

    def by_hand():
        with tf.GradientTape() as tape:
            h0 = fc1(x, training=True)
            h1 = act(h0, training=True)
            h2 = fc2(h1, training=True)
            loss = keras.losses.MeanSquaredError()(y, h2)
        return h0, h1, h2, tape.gradient(loss, [h0, h1, h2, *fc1.trainable_weights, *fc2.trainable_weights])

    h0, h1, h2, g = by_hand() if eagerly else tf.function(by_hand)()

    def merged(*ts):
        hs = [reference(t) for t in ts]
        return hs[0].merge(*hs[1:])

    want = [
        ("fc1", "output", merged(h0)), ("fc1", "grad_output", merged(g[0])),
        ("fc1", "weight", merged(fc1.kernel, fc1.bias)), ("fc1", "grad_weight", merged(g[3], g[4])),
        ("act", "output", merged(h1)), ("act", "grad_output", merged(g[1])),
        ("fc2", "output", merged(h2)), ("fc2", "grad_output", merged(g[2])),
        ("fc2", "weight", merged(fc2.kernel, fc2.bias)), ("fc2", "grad_weight", merged(g[5], g[6])),
    ]  # fmt: skip
    assert [(o.layer, o.kind) for o in obs] == [(layer, kind) for layer, kind, _ in want]
    for o, (_, _, hist) in zip(obs, want):
        assert isinstance(o, Observation) and o.hist == hist, (o.layer, o.kind)


def test_steps_merge_into_one_observation_per_layer_and_kind():
    model = tiny()
    x, _ = batch_of()
    obs = collect(model, (x, tf.zeros((16, 4))), mse, steps=3, optimizer=keras.optimizers.SGD(0.1))
    pairs = [(o.layer, o.kind) for o in obs]
    assert len(pairs) == len(set(pairs))
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["fc1", "output"].total == 3 * 16 * 32
    assert table["fc1", "weight"].total == table["fc1", "update_ratio"].total == 3 * (8 * 32 + 32)
    # the second step starts from the first step's weights: the weights differ between steps
    one = {(o.layer, o.kind): o.hist for o in collect(model, (x, tf.zeros((16, 4))), mse, steps=1)}
    assert table["fc1", "weight"] != one["fc1", "weight"].merge(one["fc1", "weight"], one["fc1", "weight"])


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gain = self.add_weight(shape=(8,), initializer="ones", name="gain")
        self.fc = keras.layers.Dense(8, name="fc")
        self.twin = keras.layers.Dense(8, name="fc")  # a sibling of the same name

    def call(self, x):
        return self.twin(self.fc(x)) * self.gain


class Nested(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(10, 8, name="embed")
        self.block = Block(name="block")
        self.head = keras.layers.Dense(10, use_bias=False, name="head")
        self.again = self.head  # shared: observed once, by its first name

    def call(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_layer_names_follow_the_chain_of_keras_names_in_model_order():
    model = Nested()
    ids = tf.constant(np.random.default_rng(5).integers(0, 4, (4, 5)))  # rows 4..9 never looked up
    model(ids)
    obs = collect(model, (ids, ids), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    layers = list(dict.fromkeys(o.layer for o in obs))
    assert layers == ["embed", "block/gain", "block/fc", "block/fc#2", "head"]
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["embed", "grad_weight"].zeros >= 6 * 8  # IndexedSlices made dense: unused rows are zeros
    assert ("block/gain", "output") not in table and table["block/gain", "weight"].total == 8
    assert table["head", "weight"].total == 80
    assert {o.kind for o in obs} <= set(KINDS)
    single = keras.layers.Dense(1, name="solo")
    single.build((None, 3))
    names = {o.layer for o in collect(single, tf.ones((5, 3)), lambda x, out: tf.reduce_mean(out**2))}
    assert names == {"solo"}


def test_update_ratios_of_sgd_are_lr_times_grad_over_the_weight():
    model = tiny()
    x, y = batch_of(64, seed=5)
    table = {(o.layer, o.kind): o.hist
             for o in collect(model, (x, y), mse, optimizer=keras.optimizers.SGD(0.1))}  # fmt: skip
    w0 = [v.numpy() for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = mse(y, model(x, training=True))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    applied = [w - np.float32(0.1) * g for w, g in zip(w0, grads)]  # SGD's update, in float32
    for layer, (k, b) in (("fc1", (0, 1)), ("fc2", (2, 3))):
        exact = update_ratio_histogram(applied[k] - w0[k], w0[k]).merge(
            update_ratio_histogram(applied[b] - w0[b], w0[b]))  # fmt: skip
        assert table[layer, "update_ratio"] == exact
        ideal = update_ratio_histogram(np.float32(0.1) * grads[k], w0[k]).merge(
            update_ratio_histogram(np.float32(0.1) * grads[b], w0[b]))  # fmt: skip
        got = table[layer, "update_ratio"]
        assert got.total == ideal.total and got.apart == ideal.apart == {"fc1": 32, "fc2": 4}[layer]  # biases
        assert np.abs(np.cumsum(got.counts) - np.cumsum(ideal.counts)).max() <= 0.01 * got.total
        assert math.isclose(got.amax, ideal.amax, rel_tol=1e-3)


def test_nonfinite_outputs_are_observed_not_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"),
                              keras.layers.Dense(1, name="b")])  # fmt: skip
    model.layers[0].kernel.assign(tf.fill((4, 4), 3e38))
    obs = collect(model, tf.ones((2, 4)), lambda x, out: tf.reduce_mean(out))
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["a", "output"].nonfinite == 8 and table["b", "output"].nonfinite == 2


def test_batch_forms_compiled_losses_and_a_loss_returned_by_the_model():
    model = tiny()
    x, y = batch_of()
    by_pair = collect(model, (x, y), mse)
    by_list = collect(model, [x, y], keras.losses.MeanSquaredError())
    assert [(o.layer, o.kind, o.hist) for o in by_pair] == [(o.layer, o.kind, o.hist) for o in by_list]
    halves = tf.concat([tf.ones(8), tf.zeros(8)], 0)
    weighted = collect(model, (x, y, halves), keras.losses.MeanSquaredError())
    table = {(o.layer, o.kind): o.hist for o in weighted}
    assert table["fc2", "grad_output"].zeros == 8 * 4  # the zero-weighted half sends no gradient
    model.compile(loss="mse", jit_compile=True)  # the compiled loss; the taps run eagerly regardless
    compiled = collect(model, (x, y))
    assert [(o.layer, o.kind, o.hist) for o in compiled] == [(o.layer, o.kind, o.hist) for o in by_pair]
    assert not tf.config.functions_run_eagerly()

    class WithLoss(keras.Model):
        def __init__(self):
            super().__init__()
            self.fc = keras.layers.Dense(1, name="fc")

        def call(self, inputs):
            return tf.reduce_mean(tf.square(self.fc(inputs["x"]) - inputs["y"]))

    with_loss, inputs = WithLoss(), {"x": x, "y": y[:, :1]}
    with_loss(inputs)
    by_dict = collect(with_loss, inputs)  # x alone; the outputs are the loss
    assert {o.layer for o in by_dict} == {"fc"} and len(by_dict) == 4


def test_the_compiled_loss_trackers_are_left_as_they_were():
    def two_heads():
        keras.utils.set_random_seed(8)
        inputs = keras.Input((4,))
        heads = [keras.layers.Dense(2, name="a")(inputs), keras.layers.Dense(3, name="b")(inputs)]
        model = keras.Model(inputs, heads)
        model.compile(optimizer="sgd", loss=["mse", "mse"])
        return model

    x, y = tf.ones((5, 4)), (tf.zeros((5, 2)), tf.ones((5, 3)))
    fresh = two_heads()
    obs = collect(fresh, (x, y))  # builds the compiled loss, whose per-output trackers it then updates
    assert {o.layer for o in obs} == {"a", "b"}
    assert len(fresh.metrics_variables) == 6 and not any(np.any(v.numpy()) for v in fresh.metrics_variables)
    fitted = two_heads()
    fitted.fit(x, y, verbose=0)
    before = [(v.path, bits(v)) for v in fitted.metrics_variables]
    assert any(np.any(v.numpy()) for v in fitted.metrics_variables)
    collect(fitted, (x, y), optimizer=keras.optimizers.SGD())
    assert [(v.path, bits(v)) for v in fitted.metrics_variables] == before


def test_a_layer_called_inside_a_tf_function_is_tapped():
    class Traced(keras.Model):
        def __init__(self):
            super().__init__()
            self.fc = keras.layers.Dense(4, name="fc")

        @tf.function
        def call(self, x):
            return self.fc(x)

    x, y = batch_of()
    traced = Traced()
    traced(x)
    obs = collect(traced, (x, y), mse)
    assert [(o.layer, o.kind) for o in obs][:2] == [("fc", "output"), ("fc", "grad_output")]


# -- the traced step: kept, traced again when what it was traced for changes, or run eagerly ------------
@pytest.fixture
def traces(monkeypatch):
    """Every tracing of the step: (model, why it runs eagerly, "" when traced)."""
    from polyamp.tensorflow import doctor

    made = []
    trace = doctor._Job.trace

    def counted(job):
        result = trace(job)
        made.append((job.model, result.why))
        return result

    monkeypatch.setattr(doctor._Job, "trace", counted)
    return made


def table_of(obs):
    return {(o.layer, o.kind): o.hist for o in obs}


def test_the_traced_step_is_kept_and_traced_again_when_what_it_was_traced_for_changes(traces):
    model, (x, y) = tiny(), batch_of()
    sgd = keras.optimizers.SGD(0.1)

    def mse(y, out, sample_weight=None):
        weight = 1.0 if sample_weight is None else sample_weight[:, None]
        return tf.reduce_mean(weight * tf.square(out - y))

    first = collect(model, (x, y), mse, optimizer=sgd)
    again = collect(model, (x, y), mse, optimizer=sgd, steps=2)
    assert len(traces) == 1 and traces[0][1] == ""  # kept, and several steps reuse it
    assert table_of(again)["fc1", "weight"].total == 2 * table_of(first)["fc1", "weight"].total
    model.layers[0].kernel.assign(model.layers[0].kernel * 2)  # values are read when run: same trace
    doubled = table_of(collect(model, (x, y), mse, optimizer=sgd))
    assert len(traces) == 1 and doubled["fc1", "weight"].amax == 2 * table_of(first)["fc1", "weight"].amax
    changes = [
        lambda: collect(model, (x, y), mse),  # no optimizer
        lambda: collect(model, (x, y), mse, optimizer=keras.optimizers.SGD(0.1)),  # another optimizer
        lambda: collect(model, (x[:8], y[:8]), mse, optimizer=sgd),  # another batch shape
        lambda: collect(model, (x, y, tf.ones(16)), mse, optimizer=sgd),  # sample weights
        lambda: collect(model, (x, y), lambda y, out: mse(y, out), optimizer=sgd),  # another loss_fn
    ]
    for i, change in enumerate(changes):
        change()
        assert len(traces) == 2 + i, i
        if i == 0:
            collect(model, (x, y), mse, optimizer=sgd)  # kept beside it
            assert len(traces) == 2
    collect(model, (x, y), mse, optimizer=sgd)  # the latest 4 are kept: traced again
    assert len(traces) == 2 + len(changes)
    model.layers[2].trainable = False  # the variables it steps change
    frozen = table_of(collect(model, (x, y), mse, optimizer=sgd))
    assert ("fc2", "grad_weight") not in frozen and ("fc1", "grad_weight") in frozen
    assert len(traces) == 3 + len(changes)
    model.layers[2].trainable = True
    model.add(keras.layers.Dense(2, name="extra"))  # a layer more
    grown = collect(model, (x, y[:, :2]), mse, optimizer=keras.optimizers.SGD(0.1))
    assert [o.layer for o in grown][-1] == "extra" and traces[-1][1] == ""
    assert len(traces) == 4 + len(changes)


def test_a_compiled_loss_changed_by_compile_is_traced_again(traces):
    model, (x, y) = tiny(), batch_of()
    model.compile(loss="mse")
    mse_grads = table_of(collect(model, (x, y)))
    model.compile(loss="mae")
    mae_grads = table_of(collect(model, (x, y)))
    assert len(traces) == 2
    assert mae_grads["fc2", "grad_output"] != mse_grads["fc2", "grad_output"]
    sign = mae_grads["fc2", "grad_output"]  # d mae / d out = sign(out - y) / n: one magnitude
    assert np.count_nonzero(sign.counts) == 1


def test_kept_traces_hold_no_reference_to_the_model():
    import gc
    import weakref

    from polyamp.tensorflow import doctor

    model, batch = tiny(), batch_of()
    collect(model, batch, mse, optimizer=keras.optimizers.Adam())
    model_id, ref = id(model), weakref.ref(model)
    assert model_id in doctor._TRACES._by_model
    del model
    gc.collect()
    assert ref() is None and model_id not in doctor._TRACES._by_model


def test_the_traced_step_equals_the_eager_one():
    """Same observations traced and eagerly (``run_functions_eagerly``): a model with a root variable,
    BatchNormalization, Dropout and keras.random, and Adam, two steps; the float ops of a graph may
    differ in the last bit from eager ones, so what depends on them is compared in totals and ranges."""
    runs = []
    for eagerly in (False, True):
        model, opt, batch = trained_net()
        tf.config.run_functions_eagerly(eagerly)
        try:
            runs.append(table_of(collect(model, batch, mse, optimizer=opt, steps=2)))
        finally:
            tf.config.run_functions_eagerly(False)
    traced, eager = runs
    assert list(traced) == list(eager)
    for key in traced:  # fc1's bias (before BatchNormalization) has a gradient 0 in exact arithmetic:
        a, b = traced[key], eager[key]  # its rounding noise, and Adam's update of that, differ
        assert (a.total, a.nonfinite, a.apart) == (b.total, b.nonfinite, b.apart), key
        assert abs(a.zeros - b.zeros) <= 0.02 * a.total, key
        assert np.abs(np.cumsum(a.counts) - np.cumsum(b.counts)).max() <= 0.03 * a.total, key
        if key[1] in ("output", "grad_output", "weight"):
            assert math.isclose(a.amax, b.amax, rel_tol=1e-3), key
    assert traced["fc1", "weight"].total == 2 * 112


class Branchy(keras.Model):
    """Python control flow on a tensor's value (no autograph in the traced step: fails in a graph)."""

    def __init__(self):
        super().__init__()
        self.fc = keras.layers.Dense(4, name="fc")

    def call(self, x):
        out = self.fc(x)
        return out * 2 if float(tf.reduce_sum(out)) > 0 else out


class Looped(keras.Model):
    """A tapped layer called inside a tf.while_loop: its outputs live in the loop's graph."""

    def __init__(self):
        super().__init__()
        self.cell = keras.layers.Dense(8, activation="tanh", name="cell")

    def call(self, x):
        return tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, self.cell(h)), (0, x))[1]


@pytest.mark.parametrize("network, why", [(Branchy, "Error"), (Looped, "graph of its own")])
def test_a_step_that_cannot_be_traced_runs_eagerly(traces, network, why):
    x, y = batch_of()
    model = network()
    model(x)
    opt = keras.optimizers.Adam()
    obs = collect(model, (x, y if network is Branchy else x), mse, optimizer=opt)
    tf.config.run_functions_eagerly(True)
    try:
        want = collect(model, (x, y if network is Branchy else x), mse, optimizer=opt)
    finally:
        tf.config.run_functions_eagerly(False)
    assert [(o.layer, o.kind, o.hist) for o in obs] == [(o.layer, o.kind, o.hist) for o in want]
    name = "fc" if network is Branchy else "cell"
    assert table_of(obs)[name, "output"].total == 16 * (4 if network is Branchy else 3 * 8)
    collect(model, (x, y if network is Branchy else x), mse, optimizer=opt)
    assert len(traces) == 1 and why in traces[0][1]  # the verdict is kept too


# -- bad input: one clear PolyampError each ---------------------------------------------------------
@pytest.mark.parametrize(
    "case, match",
    [
        (lambda m, b: collect(_built(keras.layers.ReLU()), b, mse), "has no variables"),
        (lambda m, b: collect(keras.layers.Dense(3), b, mse), "not built"),
        (lambda m, b: collect(_frozen(m), b, mse), "no trainable variables"),
        (lambda m, b: collect(m, b, mse, steps=0), "steps must be a whole number >= 1, got 0"),
        (lambda m, b: collect(m, b, mse, steps=1.0), "steps must be a whole number"),
        (lambda m, b: collect(m, b, mse, steps=True), "steps must be a whole number"),
        (lambda m, b: collect(m, (b[0].numpy().tolist(), b[1]), mse), r"numpy arrays.*got builtins.float"),
        (lambda m, b: collect(m, (b[0], 1.0), mse), "got builtins.float"),
        (lambda m, b: collect(m, (b[0], b[1], b[1], b[1]), mse), r"\(x, y\) or \(x, y, sample_weight\)"),
        (lambda m, b: collect(m, (tf.ones((16, 5)), b[1]), mse), r"forward failed.*\(16, 5\)"),
        (lambda m, b: collect(m, b, lambda y, out: (out - y) ** 2), r"scalar .*shape \(16, 4\) float32"),
        (lambda m, b: collect(m, b, lambda y, out: 1.0), "loss tensor, got builtins.float"),
        (lambda m, b: collect(m, b, lambda y, out: tf.constant(1)), "shape \\(\\) int32"),
        (lambda m, b: collect(m, b[0]), r"the model \(loss_fn=None, not compiled with a loss\) must return"),
        (lambda m, b: collect(m, b, lambda y, out: tf.reduce_sum(tf.stop_gradient(out))), "does not depend"),
        (lambda m, b: collect(m, b, "mse"), r"loss_fn must be callable.*keras.losses.get\('mse'\)"),
        (lambda m, b: collect(m, b, mse, optimizer=object()), "optimizer: expected a keras.optimizers.Optim"),
        (
            lambda m, b: collect(m, b, mse, optimizer=_loss_scaled()),
            "LossScaleOptimizer, which scales the loss.*inner_optimizer",
        ),
        (lambda m, b: collect(m.get_weights(), b, mse), "model: expected a Keras model or layer"),
    ],
)
def test_bad_input_is_one_clear_error(case, match):
    model, batch = tiny(), batch_of()
    before = [bits(v) for v in model.variables]
    with pytest.raises(PolyampError, match=match):
        case(model, batch)
    assert [bits(v) for v in model.variables] == before
    assert "call" not in vars(model.layers[0]) and not tf.config.functions_run_eagerly()


def _loss_scaled():
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())


def _built(layer):
    layer.build((None, 8))
    return layer


def _frozen(model):
    model.trainable = False
    return model


def test_a_batch_of_another_framework_is_refused():
    torch = require("torch")
    with pytest.raises(PolyampError, match="TensorFlow tensors or numpy arrays .*got torch.Tensor"):
        collect(tiny(), (torch.zeros(2, 8), tf.zeros((2, 4))), mse)
    jnp = require("jax").numpy
    with pytest.raises(PolyampError, match="expected TensorFlow tensors or numpy arrays .*got jax"):
        collect(tiny(), ({"x": jnp.ones((2, 8))}, tf.zeros((2, 4))), mse)


def test_numpy_batches_are_taken_as_fit_takes_them():
    """numpy arrays (float64 ones cast to floatx, as fit does), tuples of them and dicts of them (a
    keras_hub model's inputs) observe what the same TensorFlow tensors do."""
    x, y = batch_of()
    want = table_of(collect(tiny(), (x, y), mse))
    for batch in ((x.numpy(), y.numpy()), (x.numpy().astype(np.float64), y.numpy()), [x.numpy(), y]):
        assert table_of(collect(tiny(), batch, mse)) == want
    keras.utils.set_random_seed(3)
    ids, mask = keras.Input((6,), dtype="int32", name="token_ids"), keras.Input((6,), name="padding_mask")
    h = keras.layers.Embedding(10, 8, name="embed")(ids) * keras.ops.expand_dims(mask, -1)
    model = keras.Model({"token_ids": ids, "padding_mask": mask}, keras.layers.Dense(4, name="head")(h))
    rng = np.random.default_rng(0)
    inputs = {"token_ids": rng.integers(0, 10, (3, 6)).astype(np.int32), "padding_mask": np.ones((3, 6))}
    target = rng.standard_normal((3, 6, 4))
    got = table_of(collect(model, (inputs, target), mse))
    tensors = ({k: tf.constant(v, tf.int32 if k == "token_ids" else tf.float32) for k, v in inputs.items()},
               tf.constant(target, tf.float32))  # fmt: skip
    assert got == table_of(collect(model, tensors, mse)) and ("embed", "grad_weight") in got


def test_a_recipe_measures_only_what_it_would_quantize():
    """recipe:mxfp8's rows: each Dense / EinsumDense's kernel and output gradient, and the outputs that
    are a matmul layer's input; a block format measures every tapped tensor."""
    keras.utils.set_random_seed(3)
    x = keras.Input((6, 8))
    h = keras.layers.Dense(16, name="fc1")(x)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.MultiHeadAttention(2, 8, name="attn")(h, h)
    model = keras.Model(x, keras.layers.Dense(4, name="head")(keras.layers.Activation("gelu", name="act")(h)))
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((2, 6, 8)), rng.standard_normal((2, 6, 4)))
    obs = collect(model, batch, mse, measure=(parse("recipe:mxfp8"), parse("mxfp8_e4m3")))
    recipe = {(o.layer, o.kind) for o in obs if "recipe:mxfp8" in o.measured}
    matmuls = ["fc1", "attn/query", "attn/key", "attn/value", "attn/attention_output", "head"]
    assert recipe == {*((n, k) for n in matmuls for k in ("weight", "grad_output")), ("norm", "output"),
                      ("act", "output")}  # fmt: skip
    assert {(o.layer, o.kind) for o in obs if "mxfp8_e4m3" in o.measured} == {(o.layer, o.kind) for o in obs}
    kernel = model.get_layer("head").kernel.numpy().T  # measured as (in, out) transposed: blocks along in
    want = measure(kernel, parse("recipe:mxfp8").casts["weight"]).to_json()
    head = next(o for o in obs if (o.layer, o.kind) == ("head", "weight"))
    assert head.measured["recipe:mxfp8"].to_json() == want  # the kernel alone, not the bias


def test_non_floating_tensors_are_refused():
    with pytest.raises(PolyampError, match="cannot bin a int32 tensor"):
        histogram(tf.ones(3, tf.int32))


# -- keep_fp32: the doctor's names, applied by mp.watch ---------------------------------------------
def kept_model(mp):
    keras.utils.set_random_seed(6)
    with mp.scope():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="gelu", name="fc1")(inputs)
        h = keras.layers.Dense(16, activation="gelu", name="fc2")(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def outputs_by_layer(model, x):
    """Each layer's output dtype and its compute dtype inside call (the dtype its kernel is read in)."""
    seen = {}
    for layer in model.layers[1:]:
        original = layer.call

        def call(inputs, *args, _layer=layer, _original=original, **kwargs):
            out = _original(inputs, *args, **kwargs)
            seen[_layer.name] = (inputs.dtype.name, out.dtype.name)
            return out

        layer.call = call
    try:
        model(x)
    finally:
        for layer in model.layers[1:]:
            del layer.call
    return seen


def test_keep_fp32_layers_compute_in_float32_and_train_in_a_custom_loop():
    mp = pa.MixedPrecision("bf16-mixed", framework="tensorflow", keep_fp32=("fc2",))
    model = mp.watch(kept_model(mp))
    x, y = batch_of(seed=6)
    y = y[:, :4]
    assert outputs_by_layer(model, x) == {"fc1": ("bfloat16", "bfloat16"), "fc2": ("float32", "float32"),
                                          "head": ("bfloat16", "bfloat16")}  # fmt: skip
    assert all(v.dtype == "float32" for v in model.variables)
    opt = keras.optimizers.Adam(1e-2)
    before = [v.numpy() for v in model.trainable_variables]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = mse(y, tf.cast(model(x, training=True), tf.float32))
        grads = tape.gradient(mp.scale(loss), model.trainable_variables)
        return loss, mp.apply(opt, grads, model.trainable_variables).stepped

    loss, stepped = step()
    assert bool(stepped) and np.isfinite(float(loss))
    assert all(not np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


def test_keep_fp32_with_fit_and_the_doctors_names_as_they_are():
    x, y = batch_of(seed=7)
    keras.utils.set_random_seed(7)
    nested = Nested()
    ids = tf.constant(np.random.default_rng(7).integers(0, 10, (8, 5)))
    nested(ids)
    names = [o.layer for o in collect(nested, (ids, ids), keras.losses.SparseCategoricalCrossentropy(True))]
    assert "block/fc#2" in names
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow", keep_fp32=("block/fc#2", "embed"))
    with mp.scope():
        keras.utils.set_random_seed(7)
        model = Nested()
    model(ids)
    mp.watch(model)
    policies = {layer.name: layer.dtype_policy.name for layer in model._flatten_layers(include_self=False)}
    assert policies["embed"] == "float32" and policies["head"] == "mixed_float16"
    assert model.block.twin.dtype_policy.name == "float32"
    assert model.block.fc.dtype_policy.name == "mixed_float16"

    mp2 = pa.MixedPrecision("bf16-mixed", framework="tensorflow", keep_fp32=("fc1",))
    fitted = mp2.watch(kept_model(mp2))
    fitted.compile(optimizer=mp2.optimizer(keras.optimizers.SGD(0.01)), loss="mse")
    history = fitted.fit(x, y[:, :4], epochs=2, batch_size=8, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
    assert fitted.get_layer("fc1").compute_dtype == "float32"
    assert fitted.get_layer("fc2").compute_dtype == "bfloat16"


def test_keep_fp32_names_that_match_no_layer_raise_and_the_default_is_unchanged():
    mp = pa.MixedPrecision("bf16-mixed", framework="tensorflow", keep_fp32=("fc2", "nope"))
    model = kept_model(mp)
    with pytest.raises(PolyampError, match=r"names 'nope', which match no layer.*'fc1', 'fc2', 'head'"):
        mp.watch(model)
    assert model.get_layer("fc2").compute_dtype == "bfloat16"  # nothing was set
    plain = pa.MixedPrecision("bf16-mixed", framework="tensorflow")
    assert plain.keep_fp32 == ()
    default = plain.watch(kept_model(plain))
    assert {layer.compute_dtype for layer in default.layers[1:]} == {"bfloat16"}
    f32 = pa.MixedPrecision("float32", framework="tensorflow", keep_fp32=("nope",))
    assert f32.watch(kept_model(f32)) is not None  # a no-op under float32


def test_keep_fp32_asks_for_watch_and_refuses_16_bit_variables():
    mp = pa.MixedPrecision("bf16-mixed", framework="tensorflow", keep_fp32=("fc1",))
    kept_model(mp)
    with pytest.raises(PolyampError, match=r"call mp.watch\(model\) once before training"):
        mp.optimizer(keras.optimizers.SGD())
    with pytest.raises(PolyampError, match=r"call mp.watch\(model\)"):
        mp.apply(keras.optimizers.SGD(), [tf.zeros(2)], [tf.Variable(tf.zeros(2))])
    true = pa.MixedPrecision("bf16-true", framework="tensorflow", keep_fp32=("fc1",))
    with pytest.raises(PolyampError, match="'fc1' holds bfloat16 variables.*mixed"):
        true.watch(kept_model(true))
