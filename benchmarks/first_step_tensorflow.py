"""Seconds to the first training step of a custom TensorFlow loop under each policy: the trace, the
graph's optimisation and one step, paid once per process before training starts.

    python benchmarks/first_step_tensorflow.py [--policies fp16-mixed,bf16-mixed,fp8-tensorwise]
                                               [--runs 3]

Each (policy, run) in a fresh interpreter, so nothing traced or converted by an earlier one is reused:
a Keras MLP 16 -> 48 -> 48 -> 48 -> 4 (gelu), Adam, a ``tf.function`` step with ``mp.scale`` and
``mp.apply`` (``mp.watch`` for a recipe), 64 examples. Prints the median and the range over the runs,
the median of ten later steps for scale, and the nodes of the traced step's function library.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

_CHILD = """
import time, numpy as np, tensorflow as tf, keras, polyamp as pa
mp = pa.MixedPrecision({policy!r}, framework="tensorflow")
keras.utils.set_random_seed(0)
with mp.scope():
    layers = [keras.layers.Dense(48, activation="gelu", name=f"fc{{i}}") for i in range(3)]
    model = keras.Sequential([keras.Input((16,)), *layers, keras.layers.Dense(4, name="fc3")])
if mp.recipe is not None:
    mp.watch(model)
opt = keras.optimizers.Adam(1e-2)

@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = mp.scale(tf.reduce_mean(tf.square(tf.cast(model(x), tf.float32) - y)))
    mp.apply(opt, tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss

x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
y = np.sin(x[:, :4])
t = time.perf_counter(); float(step(x, y)); first = time.perf_counter() - t
later = []
for _ in range(10):
    t = time.perf_counter(); float(step(x, y)); later.append(time.perf_counter() - t)
graph = step.get_concrete_function(x, y).graph.as_graph_def()
print(first, sorted(later)[5], sum(len(f.node_def) for f in graph.library.function))
"""


def first_step(policy: str) -> tuple[float, float, int]:
    out = subprocess.run([sys.executable, "-c", _CHILD.format(policy=policy)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    first, later, nodes = out.split()[-3:]
    return float(first), float(later), int(nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="fp16-mixed,bf16-mixed,fp8-tensorwise")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"{'policy':<20} {'first step s (median, range)':>30} {'later step ms':>14} {'nodes':>7}")
    for policy in args.policies.split(","):
        runs = [first_step(policy) for _ in range(args.runs)]
        firsts = [f for f, _, _ in runs]
        later = statistics.median(v for _, v, _ in runs) * 1e3
        span = f"{statistics.median(firsts):.2f} ({min(firsts):.2f}-{max(firsts):.2f})"
        print(f"{policy:<20} {span:>30} {later:>14.1f} {runs[0][2]:>7}", flush=True)


if __name__ == "__main__":
    main()
