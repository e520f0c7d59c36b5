"""keras_hub GPT2 under ``fit``: Keras ``mixed_bfloat16``, polyamp bf16-mixed and each recipe, step times.

    python benchmarks/keras_hub_recipes.py [--steps 6] [--rounds 5] [--recipes fp8-tensorwise,mxfp8]

Model: ``keras_hub.models.GPT2Backbone`` (2 layers, hidden 128, 2 heads, MLP 512, vocabulary 512) with a
Dense head, next-token cross-entropy, Adam, batch 8 x 64 tokens. Every contender has its own copy of the
model with the same weights and the same batch; they differ only in the policy: Keras's own
``mixed_bfloat16`` (the plain optimizer), ``MixedPrecision("bf16-mixed")`` (``mp.scope()``,
``mp.optimizer``) and each recipe (also ``mp.watch``; the count of matmul layers it quantizes, of all the
model's, from ``mp.recipe_layers``). Each round calls ``fit`` for ``--steps`` steps on each contender in
turn (the order rotates every round; one warm-up ``fit`` each first, which traces the step); a step's time
is the interval between two ``on_train_batch_end`` calls (the loss read on the host), the first step of
each call dropped. Printed: the median step time of each contender, its ratio to polyamp bf16-mixed and
to Keras ``mixed_bfloat16`` (ratios of the medians; ``paired``: the median of the per-round ratios of the
round medians, steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import polyamp as pa  # noqa: E402

RECIPES = ("fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4")
VOCAB, SEQ, BATCH = 512, 64, 8


def build(seed: int = 0):
    """GPT2Backbone 2 x 128 with a Dense head, in the dtype policy in force."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=128,
                                             intermediate_dim=512, max_sequence_length=SEQ)  # fmt: skip
    inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}  # fmt: skip
    return keras.Model(inputs, keras.layers.Dense(VOCAB, name="head")(backbone(inputs)))


def data(steps: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (steps * BATCH, SEQ + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((steps * BATCH, SEQ), "int32")}
    return x, tokens[:, 1:]


class StepTimes(keras.callbacks.Callback):
    """The intervals between consecutive ``on_train_batch_end`` calls of one ``fit`` (the loss read)."""

    def on_train_begin(self, logs=None):
        self.times, self.last = [], None

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def contender(policy: str, weights):
    """(compiled model, quantized/all matmul layers or None) for ``policy``: "native" is Keras's own."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if policy == "native":
        keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            model = build()
        finally:
            keras.config.set_dtype_policy("float32")
        model.set_weights(weights)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        return model, None
    mp = pa.MixedPrecision(policy, framework="tensorflow")
    with mp.scope():
        model = build()
    model.set_weights(weights)
    count = None
    if mp.recipe is not None:
        mp.watch(model)
        record = mp.recipe_layers
        count = f"{len(record.quantized)}/{len(record.quantized) + len(record.kept)}"
    model.compile(optimizer=mp.optimizer(keras.optimizers.Adam(1e-3)), loss=loss)
    return model, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="fit steps per round and contender")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    weights = build().get_weights()
    names = ["native", "bf16-mixed", *(r for r in args.recipes.split(",") if r)]
    models = {name: contender(name, weights) for name in names}
    x, y = data(args.steps + 1)
    timer = StepTimes()

    def fit(name):
        models[name][0].fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        return statistics.median(timer.times)

    t0 = time.perf_counter()
    for name in names:
        fit(name)  # warm-up: traces the step
        print(f"warmed up {name} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    rounds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            rounds[name].append(fit(name))
    med = {name: statistics.median(ts) for name, ts in rounds.items()}

    def paired(name, ref):
        return statistics.median(a / b for a, b in zip(rounds[name], rounds[ref]))

    print(f"keras_hub GPT2Backbone 2 x 128 + Dense head, fit, batch {BATCH} x {SEQ}, {args.rounds} rounds x "
          f"{args.steps} steps (median step; {time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(f"{'contender':28s} {'quantized':>9s} {'ms/step':>9s} {'/bf16-mixed':>11s} {'paired':>7s} "
          f"{'/native':>8s} {'paired':>7s}")  # fmt: skip
    for name in names:
        label = "Keras mixed_bfloat16" if name == "native" else f"polyamp {name}"
        count = models[name][1] or "-"
        ours, native = med[name] / med["bf16-mixed"], med[name] / med["native"]
        print(f"{label:28s} {count:>9s} {med[name] * 1e3:9.1f} {ours:11.3f} "
              f"{paired(name, 'bf16-mixed'):7.3f} {native:8.3f} {paired(name, 'native'):7.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
