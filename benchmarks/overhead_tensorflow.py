"""polyamp's step against native Keras mixed precision in TensorFlow: median step-time ratios.

    python benchmarks/overhead_tensorflow.py [--repeats 15] [--fp16-repeats 7] [--models mlp,charlm]

Models: the ``mlp`` and ``charlm`` workloads of ``polyamp compare`` at full size (1024-4096-4096-1024
MLP, batch 256; 2-block character transformer, d 256, batch 32 x 64), Adam. Every contender has its
own copy of the same model (built in ``mp.scope()``, so the layers and their dtype policies are
identical), the same weights and the same batch; only the train step differs. Each step is one
``tf.function`` call timed to the loss on the host; the contenders alternate (their order rotates
every round) and medians are taken after one warm-up step each; ``ratio`` is the ratio of the medians,
``paired`` the median of the per-round ratios (steadier on a shared machine). Cases:
- bf16: Keras ``mixed_bfloat16`` with the plain optimizer (no check) vs ``MixedPrecision("bf16-mixed")``
  (guarded: it checks every gradient for inf/NaN, which native bf16 does not) and with ``guard=False``;
- fp16: Keras ``mixed_float16`` with ``LossScaleOptimizer`` vs ``MixedPrecision("fp16-mixed",
  loss_scale="keras")``. TensorFlow has no fp16 kernels for this CPU (Eigen fallback), so this
  case is slow and gets fewer repeats.
- ``--floor``: two more bf16 rows, the native step with its ``opt.apply`` inside a ``tf.cond``
  on a flag known before the backward pass (what a conditional costs) and on a flag that needs
  every gradient (what waiting for all gradients before any update costs, as a guard must).
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _timing import ratio_row, run_paired  # noqa: E402 - benchmarks/_timing.py (this folder is on sys.path)

import polyamp as pa  # noqa: E402
from polyamp.compare import tensorflow as tf_workloads  # noqa: E402
from polyamp.compare.workloads import get_workload  # noqa: E402


def build(name: str, policy: str):
    wl = get_workload(name)
    with pa.MixedPrecision(policy, framework="tensorflow").scope():
        model = tf_workloads.CharLM(wl) if name == "charlm" else tf_workloads.mlp(wl)
    x, y = wl.batch_at(0)
    model(x[:1])
    return model, x, y


def loss_of(name, model, x, y):
    out = tf.cast(model(x, training=True), tf.float32)
    if name == "mlp":
        return tf.reduce_mean(tf.square(out - y))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))


def native_step(name, policy, loss_scale_optimizer):
    model, x, y = build(name, policy)
    opt = keras.optimizers.Adam(1e-4)
    if loss_scale_optimizer:
        opt = keras.optimizers.LossScaleOptimizer(opt)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_of(name, model, x, y)
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, variables), variables)
        return loss

    return lambda: float(step(x, y))


def gated_step(name, wait_for_gradients):
    """The native bf16 step with ``opt.apply`` under ``tf.cond``: on whether the loss is finite,
    or on whether every gradient is (one sum each, as read where the backward made them)."""
    model, x, y = build(name, "bf16-mixed")
    opt = keras.optimizers.Adam(1e-4)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_of(name, model, x, y)
        grads = tape.gradient(loss, variables)
        flag = tf.math.is_finite(loss)
        if wait_for_gradients:
            made = [g.op.inputs[0] if g.op.type == "Cast" else g for g in grads]
            flag = tf.math.is_finite(tf.add_n([tf.cast(tf.reduce_sum(g), tf.float32) for g in made]))
        tf.cond(flag, lambda: opt.apply(grads, variables), lambda: None)
        return loss

    return lambda: float(step(x, y))


def polyamp_step(name, mp):
    model, x, y = build(name, mp.policy.name)
    opt = keras.optimizers.Adam(1e-4)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_of(name, model, x, y)
            scaled = mp.scale(loss)
        mp.apply(opt, tape.gradient(scaled, variables), variables)
        return loss

    return lambda: float(step(x, y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--fp16-repeats", type=int, default=7)
    parser.add_argument("--models", default="mlp,charlm")
    parser.add_argument("--floor", action="store_true", help="add the two gated native bf16 rows")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(
        f"tensorflow {tf.__version__}, keras {keras.__version__}, Adam, tf.function steps, median step time"
    )
    print(f"{'model':8s} {'case':34s} {'native ms':>10s} {'polyamp ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.models.split(","):
        rows = []
        contenders = {
            "native": native_step(name, "bf16-mixed", False),
            "guarded": polyamp_step(name, pa.MixedPrecision("bf16-mixed", framework="tensorflow")),
            "guard=False": polyamp_step(name, pa.MixedPrecision(
                "bf16-mixed", framework="tensorflow", guard=False, loss_scale="none")),
        }  # fmt: skip
        if args.floor:
            contenders["native, cond on loss"] = gated_step(name, False)
            contenders["native, cond on all grads"] = gated_step(name, True)
        bf16 = run_paired(contenders, args.repeats)
        rows.append(("bf16 guarded vs mixed_bfloat16", bf16["native"], bf16["guarded"]))
        rows.append(("bf16 guard=False vs mixed_bfloat16", bf16["native"], bf16["guard=False"]))
        for case in ("native, cond on loss", "native, cond on all grads") if args.floor else ():
            rows.append((f"bf16 {case}", bf16["native"], bf16[case]))
        if args.fp16_repeats:
            fp16 = run_paired({
                "native": native_step(name, "fp16-mixed", True),
                "polyamp": polyamp_step(name, pa.MixedPrecision(
                    "fp16-mixed", framework="tensorflow", loss_scale="keras")),
            }, args.fp16_repeats)  # fmt: skip
            rows.append(("fp16 vs mixed_float16 + LSO", fp16["native"], fp16["polyamp"]))
        for case, native, ours in rows:
            print(ratio_row(name, case, native, ours), flush=True)


if __name__ == "__main__":
    main()
