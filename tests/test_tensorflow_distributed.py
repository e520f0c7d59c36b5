"""MirroredStrategy over two logical CPU devices: an overflow on one replica skips the step on all.

TensorFlow fixes its logical devices when it first initialises, so the strategy runs in a fresh
process (``WORKER``), which writes what each replica saw as JSON.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from frameworks import require

WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import numpy as np, tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, polyamp as pa

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    BAD = {2: 1, 5: 0, 6: 1, 11: 1}  # step -> the one replica whose gradients overflow
    rng = np.random.default_rng(0)
    data = rng.standard_normal((14, 16, 8)).astype(np.float32)

    def build(mp, optimizer, hidden=(16,)):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            with mp.scope():
                model = keras.Sequential([keras.Input((8,)),
                                          *[keras.layers.Dense(n, activation="gelu") for n in hidden],
                                          keras.layers.Dense(1)])
            optimizer = optimizer()
            optimizer.build(model.trainable_variables)  # outside tf.function, as mirrored variables need
            return model, optimizer

    def replicas(value):
        return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]

    def copies(model):
        return [[np.asarray(c) for c in strategy.experimental_local_results(v.value)]
                for v in model.trainable_variables]

    def loss_of(model, x):
        out = tf.cast(model(x, training=True), tf.float32)
        return tf.reduce_sum(tf.square(out - tf.sin(tf.reduce_sum(x, 1, keepdims=True)))) / 16.0

    def poisoned(grads, bad):
        mine = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, bad)
        return [grads[0] + tf.where(mine, float("inf"), 0.0), *grads[1:]]

    out = {}
    # 1. custom loop with polyamp
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow",
                           loss_scale=pa.DynamicLossScale(growth_interval=3))
    model, opt = build(mp, lambda: keras.optimizers.Adam(1e-2))

    @tf.function
    def train(x, bad):
        def replica_step(x):
            with tf.GradientTape() as tape:
                scaled = mp.scale(loss_of(model, x))
            grads = poisoned(tape.gradient(scaled, model.trainable_variables), bad)
            summed = tf.distribute.get_replica_context().all_reduce("SUM", grads)
            expected_norm = tf.linalg.global_norm(summed) / mp.scale(tf.constant(1.0))
            result = mp.apply(opt, grads, model.trainable_variables, clip_grad_norm=1e6)
            traced_ranks.append(result.nonfinite_ranks)  # static: empty inside tf.function
            # tf.identity: each replica's own copy of what it saw (not one shared tensor)
            return [tf.identity(t) for t in (result.stepped, result.scale, result.grad_norm, expected_norm)]
        return strategy.run(replica_step, args=(x,))

    steps, traced_ranks = [], []
    for i in range(14):
        x = strategy.experimental_distribute_values_from_function(
            lambda ctx, i=i: data[i][ctx.replica_id_in_sync_group * 8:(ctx.replica_id_in_sync_group + 1) * 8])
        seen = train(x, tf.constant(BAD.get(i, -1)))
        steps.append(dict(zip(["stepped", "scale", "norm", "expected_norm"], map(replicas, seen))))
    c = copies(model)
    out["custom"] = {"steps": steps, "state": mp.state.as_dict(),
                     "replicas_equal": all(np.array_equal(a, b) for a, b in c),
                     "finite": all(np.isfinite(a).all() for a, _ in c),
                     "iterations": int(opt.iterations.numpy()), "traced_ranks": traced_ranks}

    # 2. the same overflow with Keras's own LossScaleOptimizer
    fp16 = pa.MixedPrecision("fp16-mixed", framework="tensorflow")  # builds the same mixed_float16 model
    native, lso = build(fp16, lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)))

    @tf.function
    def native_train(x, bad):
        def replica_step(x):
            with tf.GradientTape() as tape:
                scaled = lso.scale_loss(loss_of(native, x))
            grads = poisoned(tape.gradient(scaled, native.trainable_variables), bad)
            lso.apply(grads, native.trainable_variables)
        strategy.run(replica_step, args=(x,))

    x = strategy.experimental_distribute_values_from_function(lambda ctx: data[0][:8])
    native_train(x, tf.constant(1))  # replica 1 overflows
    c = copies(native)
    out["keras"] = {"finite": all(np.isfinite(a).all() for a, _ in c),
                    "scale": float(lso.dynamic_scale.numpy())}

    # 3. fit: a NaN sample in the half of a batch that replica 1 gets
    mp2 = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    model2, opt2 = build(mp2, lambda: mp2.optimizer(keras.optimizers.SGD(0.01)))
    with strategy.scope():
        model2.compile(optimizer=opt2, loss="mse")
    xs = data.reshape(-1, 8)[:96].copy()
    xs[[16 * 2 + 12, 16 * 4 + 9]] = np.nan  # batches 2 and 4, second half
    ys = np.sin(np.nan_to_num(xs).sum(1, keepdims=True))
    model2.fit(xs, ys, batch_size=16, epochs=1, shuffle=False, verbose=0)
    c = copies(model2)
    out["fit"] = {"state": mp2.state.as_dict(), "replicas_equal": all(np.array_equal(a, b) for a, b in c),
                  "finite": all(np.isfinite(a).all() for a, _ in c),
                  "iterations": int(opt2.iterations.numpy())}

    # 4. an optimizer first built inside a tf.function step under the strategy: a clear error
    with strategy.scope():
        unbuilt = keras.optimizers.SGD(0.1)

    @tf.function
    def unbuilt_step(x):
        def replica_step(x):
            with tf.GradientTape() as tape:
                scaled = mp.scale(loss_of(model, x))
            mp.apply(unbuilt, tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        strategy.run(replica_step, args=(x,))

    try:
        unbuilt_step(x)
        out["unbuilt"] = "no error"
    except pa.PolyampError as err:
        out["unbuilt"] = str(err)

    # 5. eagerly, each replica's own StepResult: which replicas overflowed, and what
    mp3 = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    model3, opt3 = build(mp3, lambda: keras.optimizers.SGD(0.01))
    mp3.watch(model3)
    out["eager"] = []
    for bad in ([1], [0, 1], []):
        seen = {}

        def eager_step(x, bad=bad):
            ctx = tf.distribute.get_replica_context()
            replica = int(ctx.replica_id_in_sync_group)
            with tf.GradientTape() as tape:
                scaled = mp3.scale(loss_of(model3, x))
            grads = tape.gradient(scaled, model3.trainable_variables)
            if replica in bad:
                grads[0] = grads[0] + float("inf")
            r = mp3.apply(opt3, grads, model3.trainable_variables)
            seen[replica] = [bool(r.stepped), list(r.nonfinite), r.origin, list(r.nonfinite_ranks)]

        strategy.run(eager_step, args=(x,))
        out["eager"].append([seen[0], seen[1]])
    out["kernel"] = model3.trainable_variables[0].path

    # 6. fp8-delayed on one Dense layer: each replica's copy of every amax history, with reduce_amax in a
    # tf.function step, without it eagerly (each replica's update the same ops; a second trace of the
    # emulated GEMMs for two replicas would cost more than the rest of this worker)
    out["delayed"] = {}
    for reduce_amax in (True, False):
        mp4 = pa.MixedPrecision(f"fp8-delayed:keep=:history_len=4:reduce_amax={reduce_amax}",
                                framework="tensorflow")
        model4, opt4 = build(mp4, lambda: keras.optimizers.SGD(0.01), hidden=())
        mp4.watch(model4)

        def delayed_step(x):
            def replica_step(x):
                with tf.GradientTape() as tape:
                    scaled = mp4.scale(loss_of(model4, x))
                mp4.apply(opt4, tape.gradient(scaled, model4.trainable_variables), model4.trainable_variables)
            strategy.run(replica_step, args=(x,))

        delayed_step = tf.function(delayed_step) if reduce_amax else delayed_step

        def larger(ctx, i):  # replica 1's x 4x larger
            r = ctx.replica_id_in_sync_group
            return data[i][r * 8:(r + 1) * 8] * (1 + 3 * r)

        for i in range(2):
            x = strategy.experimental_distribute_values_from_function(lambda ctx, i=i: larger(ctx, i))
            delayed_step(x)
        out["delayed"][str(reduce_amax)] = {
            f"{k[0]}|{k[1]}": [np.asarray(v).tolist() for v in strategy.experimental_local_results(h.history)]
            for k, h in mp4._quantizer.delayed.items()}
    json.dump(out, open(sys.argv[1], "w"))
    """
)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """What the worker saw, run once for this module's tests."""
    require("tensorflow")
    folder = tmp_path_factory.mktemp("mirrored")
    script, out = folder / "worker.py", folder / "out.json"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_mirrored_strategy_replicas_agree_on_skipping(worker):
    result = worker

    custom = result["custom"]
    skipped = [i for i, s in enumerate(custom["steps"]) if not all(s["stepped"])]
    assert skipped == [2, 5, 6, 11]  # one replica overflowed at each; every replica skipped
    for step in custom["steps"]:
        assert step["stepped"][0] == step["stepped"][1] and step["scale"][0] == step["scale"][1]
        if all(step["stepped"]):  # the norm of the gradients summed over replicas, unscaled
            assert abs(step["norm"][0] - step["expected_norm"][0]) <= 1e-5 * step["expected_norm"][0]
    assert custom["replicas_equal"] and custom["finite"] and custom["iterations"] == 10
    assert custom["state"]["skipped"] == 4 and custom["state"]["steps"] == 14

    # Keras 3's LossScaleOptimizer reads the finite flag of replica 0 only (its gradients are not
    # all-reduced yet), so an overflow on replica 1 alone is applied and the weights go non-finite.
    assert not result["keras"]["finite"] and result["keras"]["scale"] == 2.0**15

    fit = result["fit"]
    assert fit["state"]["skipped"] == 2 and fit["state"]["steps"] == 6 and fit["iterations"] == 4
    assert fit["replicas_equal"] and fit["finite"]
    assert "build the SGD before the first tf.function step" in result["unbuilt"]


def test_each_replica_learns_which_replicas_overflowed(worker):
    """Eagerly, a replica whose own gradients were finite still learns why the step was skipped:
    ``nonfinite_ranks`` and an ``origin`` naming the other replica and its variable; inside
    tf.function ``nonfinite_ranks`` stays empty (documented)."""
    result = worker
    kernel = result["kernel"]
    one, both, none = result["eager"]
    assert one == [[False, [], f"the gradients of replica 1 ({kernel})", [1]], [False, [kernel], None, [1]]]
    assert both == [[False, [kernel], None, [0, 1]], [False, [kernel], None, [0, 1]]]
    assert none == [[True, [], None, []], [True, [], None, []]]
    assert all(ranks == [] for ranks in result["custom"]["traced_ranks"])


def test_delayed_scaling_amaxes_are_reduced_across_replicas(worker):
    """fp8-delayed under MirroredStrategy: with reduce_amax (TE's default) each amax history records the
    larger of the two replicas' amaxes and both replicas' copies agree; without it each replica keeps its
    own (replica 1's inputs are 4x larger, so its layer's input history is larger)."""
    reduced, local = worker["delayed"]["True"], worker["delayed"]["False"]
    assert len(reduced) == len(local) == 3  # (input, weight, grad) of the Dense layer
    for r0, r1 in reduced.values():
        assert r0 == r1
        assert all(v > 0 for v in r0[-2:])  # two steps recorded
    (first, (r0, _)), (first_local, (l0, l1)) = next(iter(reduced.items())), next(iter(local.items()))
    assert first.endswith("|input") and first_local.endswith("|input")  # the Dense's input: the data
    assert l0 != l1 and r0[-1] == max(l0[-1], l1[-1]) == l1[-1]
