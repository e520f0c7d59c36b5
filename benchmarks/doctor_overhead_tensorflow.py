"""What the doctor's TensorFlow taps cost: a plain float32 training step against ``collect`` of one step.

    python benchmarks/doctor_overhead_tensorflow.py [--workloads mlp,charlm] [--repeats 7] [--quick]

The compare workloads' Keras networks (``polyamp.compare.tensorflow``: same weights, batch 0, Keras's Adam
with epsilon 1e-8 as compare trains them). Two plain steps (forward, loss, ``tape.gradient``,
``optimizer.apply``): eagerly, as ``collect`` runs, and inside a ``tf.function``, as compare and ``fit``
train. Cases, each against both:
- ``collect(..., optimizer=opt)``: one tapped step with update ratios, including the snapshot of variables
  and optimizer state and their restore (what ``doctor`` pays per call of one step);
- ``collect(...)``: no optimizer, so no update ratios and no restore of the trainable variables;
- ``collect(..., steps=4, optimizer=opt)`` divided by 4: a tapped step with the snapshot spread over 4 steps.
Contenders alternate in rotating rounds in one process; medians after one warm-up call each, and the median
of the per-round ratios. The issue's budget: 1.5x a plain step. ``collect`` traces its step once per model,
loss, optimizer and batch shapes and keeps it (XLA compiles its binning once per tensor size): first printed
is each case's first call, which pays that (the steps=4 case reuses the optimizer case's trace), and the
plain tf.function step's first call.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timing import ratio_row, run_paired  # noqa: E402  (benchmarks/_timing.py; this folder is on sys.path)

from polyamp.compare import tensorflow as compare_tf  # noqa: E402
from polyamp.compare.workloads import get_workload  # noqa: E402
from polyamp.tensorflow.doctor import collect  # noqa: E402

NETWORKS = {"dense": compare_tf.mlp, "transformer": compare_tf.CharLM}


def loss_of(kind: str):
    """``loss_fn(y_true, y_pred)`` in Keras's order."""
    if kind == "mse":
        return lambda y, out: tf.reduce_mean(tf.square(out - y))
    return lambda y, out: tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))


def setup(name: str, quick: bool):
    wl = get_workload(name, quick=quick)
    keras.utils.set_random_seed(wl.seed)
    model = NETWORKS[wl.architecture](wl)
    x, y = (tf.convert_to_tensor(a) for a in wl.batch_at(0))
    model(x[:1])  # builds every layer
    opt = keras.optimizers.Adam(wl.lr, epsilon=1e-8)
    opt.build(model.trainable_variables)
    return model, opt, (x, y), loss_of(wl.loss_kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (a smoke run)")
    args = parser.parse_args()
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count()
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}, {threads} threads, float32, Adam")
    print(f"{'workload':8s} {'case':34s} {'plain ms':>10s} {'tapped ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        measure(name, args.quick, args.repeats)


def measure(name: str, quick: bool, repeats: int) -> None:
    model, opt, (x, y), loss_fn = setup(name, quick)

    def plain():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    traced = tf.function(plain)
    cases = {
        "collect, optimizer": lambda: collect(model, (x, y), loss_fn, optimizer=opt),
        "collect, no optimizer": lambda: collect(model, (x, y), loss_fn),
        "collect steps=4 optimizer, /4": lambda: collect(model, (x, y), loss_fn, steps=4, optimizer=opt),
    }
    firsts = []
    for case, fn in {"plain tf.function": lambda: float(traced()), **cases}.items():
        start = time.perf_counter()
        fn()
        firsts.append(f"{case} {time.perf_counter() - start:.2f} s")
    print(f"{name:8s} first calls: " + ", ".join(firsts))
    runs = run_paired({
        "plain eager": lambda: float(plain()),
        "plain tf.function": lambda: float(traced()),
        **cases,
    }, repeats)  # fmt: skip
    median, rounds = runs["collect steps=4 optimizer, /4"]
    runs["collect steps=4 optimizer, /4"] = (median / 4, [t / 4 for t in rounds])
    print(ratio_row(name, "plain: tf.function / eager", runs["plain eager"], runs["plain tf.function"]))
    for baseline, short in (("plain eager", "eager"), ("plain tf.function", "tf.fn")):
        for case in cases:
            print(ratio_row(name, f"{case} / {short}", runs[baseline], runs[case]), flush=True)


if __name__ == "__main__":
    main()
