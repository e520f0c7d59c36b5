"""The classic Keras mixed-precision custom loop, written correctly with polyamp, and the fit path.

    python examples/keras_amp.py [--policy fp16-mixed|bf16-mixed|float32] [--steps 300]

The loop this replaces (a widely copied answer) reads:

    policy = tf.keras.mixed_precision.Policy('mixed_float16')
    tf.keras.mixed_precision.set_global_policy(policy)
    model = Sequential([Dense(10, activation='relu', input_shape=(10,)), Dense(1)])
    loss_fn, optimizer = MeanSquaredError(), SGD(0.01)
    for data, target in dataset:
        with tf.GradientTape() as tape:
            predictions = model(data, training=True)
            loss = loss_fn(target, predictions)
        gradients = tape.gradient(loss, model.trainable_variables)   # <- never scaled
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

Only ``fit`` wraps the optimizer in a LossScaleOptimizer; a custom loop must scale the loss itself.
Without it the float16 backward pass flushes small gradients to zero: once the model fits well
(residuals around 1e-5) part of every gradient is lost. With polyamp the loss is scaled
(``mp.scale``), the gradients unscaled and checked and overflow steps skipped (``mp.apply``), the
same way in ``tf.function``, under ``fit`` (``mp.optimizer``) and under a distribution strategy.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import polyamp as pa  # noqa: E402


def data(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((10, 1)).astype(np.float32)
    x = rng.standard_normal((steps, 64, 10)).astype(np.float32)
    return x, x @ w + 0.1 * rng.standard_normal((steps, 64, 1)).astype(np.float32)


def build(mp: pa.MixedPrecision):
    keras.utils.set_random_seed(0)
    with mp.scope():  # layers take the policy; the previous global policy is restored on exit
        return keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, activation="relu"),
                                 keras.layers.Dense(1)])  # fmt: skip


def lost_gradient(residual: float = 1e-5) -> tuple[float, float, float]:
    """For a mixed_float16 model whose predictions miss the targets by ``residual``: the relative
    error of the seed loop's (unscaled) gradient and the share of its values flushed to zero, and
    the error of polyamp's scaled gradient; both against the same backward pass at scale 2^20."""
    mp = pa.MixedPrecision("fp16-mixed", framework="tensorflow")
    model = build(mp)
    x = np.random.default_rng(1).standard_normal((64, 10)).astype(np.float32)
    y = model(x).numpy().astype(np.float32) + residual * np.random.default_rng(2).standard_normal((64, 1))

    def grads(scale):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x, training=True)) * scale
        return np.concatenate(
            [g.numpy().ravel() / scale for g in tape.gradient(loss, model.trainable_variables)]
        )

    reference, seed, ours = grads(2.0**20), grads(1.0), grads(mp.current_scale)
    error = lambda g: float(np.linalg.norm(g - reference) / np.linalg.norm(reference))  # noqa: E731
    return error(seed), float(np.mean((seed == 0) & (reference != 0))), error(ours)


def train_custom_loop(policy: str, steps: int, overflow_every: int = 0) -> dict:
    """The seed's loop with polyamp: scaled loss, unscaled and checked gradients, skipped overflows."""
    mp = pa.MixedPrecision(policy, framework="tensorflow")  # once, before the loop
    model = build(mp)
    loss_fn, optimizer = keras.losses.MeanSquaredError(), keras.optimizers.SGD(0.01)

    @tf.function
    def train_step(x, y, overflow):
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = loss_fn(y, predictions)
            scaled_loss = mp.scale(loss)
        gradients = tape.gradient(scaled_loss, model.trainable_variables)
        # what an fp16 overflow in the backward pass looks like
        gradients[0] = gradients[0] + tf.where(overflow, float("inf"), 0.0)
        result = mp.apply(optimizer, gradients, model.trainable_variables)  # unscale, check, skip
        return loss, result.stepped

    xs, ys = data(steps)
    losses, skipped = [], 0
    for step in range(steps):
        overflow = tf.constant(bool(overflow_every) and step % overflow_every == 0)
        loss, stepped = train_step(xs[step], ys[step], overflow)
        losses.append(float(loss))
        skipped += not bool(stepped)
    return {"first": losses[0], "last": losses[-1], "skipped": skipped, "scale": mp.current_scale}


def train_fit(policy: str, steps: int) -> dict:
    """The fit path: ``mp.optimizer`` scales the loss in ``fit`` and checks and skips as above."""
    mp = pa.MixedPrecision(policy, framework="tensorflow")
    model = build(mp)
    model.compile(optimizer=mp.optimizer(keras.optimizers.SGD(0.01)), loss="mse")
    xs, ys = data(steps)
    history = model.fit(xs.reshape(-1, 10), ys.reshape(-1, 1), batch_size=64, epochs=3, verbose=0)
    losses = history.history["loss"]
    return {"first": losses[0], "last": losses[-1], "skipped": mp.state.skipped, "scale": mp.current_scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="fp16-mixed")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    seed_error, flushed, our_error = lost_gradient()
    print(f"seed loop (mixed_float16, no loss scaling), residual 1e-05: gradient off by "
          f"{100 * seed_error:.1f}%, {100 * flushed:.1f}% of its values flushed to zero; "
          f"polyamp: off by {100 * our_error:.1f}%")  # fmt: skip
    r = train_custom_loop(args.policy, args.steps, overflow_every=10)
    print(f"polyamp {args.policy} custom loop: loss {r['first']:.4f} -> {r['last']:.4f}, "
          f"{r['skipped']} overflow steps skipped, final scale {r['scale']:g}")  # fmt: skip
    r = train_fit(args.policy, args.steps)
    print(f"polyamp {args.policy} fit: epoch loss {r['first']:.4f} -> {r['last']:.4f}, "
          f"{r['skipped']} steps skipped, final scale {r['scale']:g}")  # fmt: skip


if __name__ == "__main__":
    main()
