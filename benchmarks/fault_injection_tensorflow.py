"""10,000 tf.function training steps with inf, -inf and NaN injected into random gradients on ~5% of steps.

    python benchmarks/fault_injection_tensorflow.py [--steps 10000] [--rate 0.05] [--policy fp16-mixed]

Checks what the test suite checks on 2,000 steps: no variable ever becomes non-finite, the skipped
steps are exactly the injected ones (the model computes in float32, so no real overflow adds to
them), and the scale stays within [min_scale, max_scale]. The whole step (scale, unscale, check,
apply or skip, scale update) runs inside one ``tf.function``. Prints the counts and the scale
range; exits 1 if any check fails.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _fault import arguments, verdict  # noqa: E402  (benchmarks/_fault.py; this folder is on sys.path)

import polyamp as pa  # noqa: E402


def main() -> int:
    args = arguments(__doc__)
    warnings.simplefilter("ignore", RuntimeWarning)
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(1)]
    )
    opt = keras.optimizers.Adam(1e-3)
    ls = pa.DynamicLossScale(growth_interval=100)
    mp = pa.MixedPrecision(args.policy, framework="tensorflow", loss_scale=ls)
    variables = model.trainable_variables

    @tf.function
    def step(x, which, position, value):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            scaled = mp.scale(tf.reduce_mean(tf.square(out - tf.tanh(tf.reduce_sum(x, 1, keepdims=True)))))
        grads = tape.gradient(scaled, variables)
        grads = [g + tf.where(tf.equal(which, i) & tf.equal(tf.reshape(tf.range(tf.size(g)), g.shape),
                                                            position % tf.size(g)), value, 0.0)
                 for i, g in enumerate(grads)]  # fmt: skip
        result = mp.apply(opt, grads, variables)
        return result.stepped, result.scale

    injected = skipped = 0
    scales = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        bad = rng.random() < args.rate
        injected += bad
        which = np.int32(rng.integers(len(variables)) if bad else -1)
        value = np.float32(rng.choice([np.inf, -np.inf, np.nan]) if bad else 0.0)
        x = rng.standard_normal((32, 16)).astype(np.float32)
        stepped, scale = step(x, which, np.int32(rng.integers(1 << 20)), value)
        skipped += not bool(stepped)
        scales.append(float(scale))
    seconds = time.perf_counter() - t0
    nonfinite = sum(int((~np.isfinite(v.numpy())).sum()) for v in variables)
    counted = skipped == mp.state.skipped and mp.state.steps == args.steps
    label = f"{args.steps} steps ({args.policy}, tf.function)"
    return verdict(label, injected, skipped, nonfinite, scales, ls, seconds, extra_ok=counted)


if __name__ == "__main__":
    sys.exit(main())
