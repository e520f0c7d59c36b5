"""Why TensorFlow's fp16 inference ratio moves when a core is taken: each policy's mlp forward pass
timed with 1 and with 2 intra-op threads (median of 7 after one warm-up call).

    python benchmarks/tf_threads_fp16.py 2 && python benchmarks/tf_threads_fp16.py 1
"""

import statistics
import sys
import time

import tensorflow as tf

threads = int(sys.argv[1])
tf.config.threading.set_intra_op_parallelism_threads(threads)
tf.config.threading.set_inter_op_parallelism_threads(threads)
import keras

x = tf.random.normal((256, 1024))
out = {}
for policy in ("float32", "mixed_float16", "mixed_bfloat16"):
    keras.mixed_precision.set_global_policy(policy)
    m = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="gelu"),
                          keras.layers.Dense(4096, activation="gelu"), keras.layers.Dense(1024)])
    f = tf.function(lambda v: m(v, training=False))
    f(x).numpy()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter(); f(x).numpy(); ts.append(time.perf_counter() - t0)
    out[policy] = statistics.median(ts) * 1e3
print(threads, {k: round(v, 1) for k, v in out.items()}, "fp16/fp32 speed", round(out["float32"] / out["mixed_float16"], 2))
