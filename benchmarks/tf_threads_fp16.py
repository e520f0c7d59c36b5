"""Why TensorFlow's fp16 inference ratio moves when a core is taken: each policy's mlp forward pass
timed with a given number of intra-op threads (median of 7 after one warm-up call).

    python benchmarks/tf_threads_fp16.py 2 && python benchmarks/tf_threads_fp16.py 1
"""

from __future__ import annotations

import statistics
import sys
import time

import keras
import tensorflow as tf

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


def forward_ms(policy: str, x) -> float:
    """Median ms of the compare mlp's forward pass (1024 -> 4096 -> 4096 -> 1024) under ``policy``."""
    keras.mixed_precision.set_global_policy(policy)
    dense = keras.layers.Dense
    model = keras.Sequential([keras.Input((1024,)), dense(4096, activation="gelu"),
                              dense(4096, activation="gelu"), dense(1024)])  # fmt: skip
    forward = tf.function(lambda v: model(v, training=False))
    forward(x).numpy()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        forward(x).numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    x = tf.random.normal((256, 1024))
    ms = {policy: forward_ms(policy, x) for policy in POLICIES}
    print(f"{threads} thread(s): " + ", ".join(f"{p} {v:.1f} ms" for p, v in ms.items())
          + f"; fp16 speed over fp32 {ms['float32'] / ms['mixed_float16']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
