"""polyamp.keras's ``fit`` (``mp.optimizer`` and ``mp.callback()``, as docs/keras-backends.md uses them)
against Keras's own ``LossScaleOptimizer`` under ``mixed_float16`` (and, for bf16-mixed, Keras's
``mixed_bfloat16`` with the plain optimizer), on Keras's JAX or torch backend, paired: each round builds
both models, fits each once to compile, then times one ``fit`` epoch of each, in alternating order; the
round's ratio is polyamp's epoch time over Keras's. Prints every round and the median ratio with its range.

    .venv/bin/python benchmarks/keras_backends_overhead.py --backend jax --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("jax", "torch"), default="jax")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=60, help="batches in the timed epoch")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--policies", default="fp16-mixed,bf16-mixed")
    return parser.parse_args()


def main() -> None:
    args = parse()
    os.environ["KERAS_BACKEND"] = args.backend  # before Keras is imported
    import keras
    import numpy as np

    import polyamp as pa

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batches * args.batch, 64)).astype("float32")
    y = rng.integers(0, 10, len(x))

    def build(policy: str):
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy(policy)
        try:
            return keras.Sequential([keras.Input((64,)), keras.layers.Dense(args.hidden, activation="relu"),
                                     keras.layers.Dense(args.hidden, activation="relu"),
                                     keras.layers.Dense(10)])  # fmt: skip
        finally:
            keras.config.set_dtype_policy("float32")

    def ours(name):
        mp = pa.MixedPrecision(name, framework="keras")
        with mp.scope():
            model = build(keras.config.dtype_policy().name)
        model.compile(optimizer=mp.optimizer(keras.optimizers.Adam(1e-3)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        return model, [mp.callback()]

    def native(name):
        model = build("mixed_float16" if name == "fp16-mixed" else "mixed_bfloat16")
        inner = keras.optimizers.Adam(1e-3)  # compile wraps it in a LossScaleOptimizer under mixed_float16
        model.compile(optimizer=inner, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, []

    def epoch(model, callbacks) -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
        return time.perf_counter() - start

    print(f"Keras {keras.__version__} on {args.backend}; MLP 64-{args.hidden}-{args.hidden}-10, batch "
          f"{args.batch}, {args.batches} batches an epoch (timed after one compiling epoch)")  # fmt: skip
    for name in [p for p in args.policies.split(",") if p]:
        ratios = []
        for r in range(args.rounds):
            runs = {"polyamp": ours(name), "keras": native(name)}
            for model, callbacks in runs.values():
                epoch(model, callbacks)  # compile
            order = ["polyamp", "keras"] if r % 2 == 0 else ["keras", "polyamp"]
            t = {label: epoch(*runs[label]) for label in order}
            ratios.append(t["polyamp"] / t["keras"])
            print(f"{name} round {r}: polyamp {t['polyamp'] * 1e3:.0f} ms, keras {t['keras'] * 1e3:.0f} ms, "
                  f"ratio {ratios[-1]:.3f}", flush=True)  # fmt: skip
        print(f"{name}: polyamp / keras median {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
