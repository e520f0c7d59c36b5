"""JAX ``quantize`` / ``quantize_blocks`` (polyamp.jax.quantize, jitted JAX integer ops) against the numpy
core on a 4096x4096 float32 tensor: median wall time after warm-up, side by side, and the ratio.

    .venv/bin/python benchmarks/quantize_jax.py [--n 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import polyamp as pa
from polyamp.numerics import rounding

CASES = [
    ("quantize e4m3fn nearest", lambda x: pa.quantize(x, "e4m3fn")),
    ("quantize e5m2 stochastic", lambda x: pa.quantize(x, "e5m2", "stochastic", seed=1)),
    ("quantize bf16 nearest", lambda x: pa.quantize(x, "bf16")),
    ("blocks mxfp8_e4m3 floor", lambda x: pa.quantize_blocks(x, "mxfp8_e4m3")),
    ("blocks mxfp4 rceil stochastic", lambda x: pa.quantize_blocks(x, "mxfp4", scale_rule="rceil",
                                                                   rounding="stochastic", seed=1)),
    ("blocks nvfp4 1x16", lambda x: pa.quantize_blocks(x, "nvfp4")),
    ("blocks nvfp4 16x16", lambda x: pa.quantize_blocks(x, "nvfp4", block=(16, 16))),
    ("blocks nvfp4 stochastic", lambda x: pa.quantize_blocks(x, "nvfp4", rounding="stochastic", seed=1)),
]  # fmt: skip


def median_time(fn, x, repeat: int, sync) -> float:
    sync(fn(x))  # warm-up (compiles the JAX path)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sync(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal((args.n, args.n)).astype(np.float32)
    xj = jax.device_put(jnp.asarray(x))
    print(f"{args.n}x{args.n} float32; numpy core backend: {rounding.backend()}; JAX device: "
          f"{jax.devices()[0]}; median of {args.repeat} after warm-up")  # fmt: skip
    print(f"{'case':32s} {'numpy s':>9s} {'jax s':>9s} {'jax/numpy':>10s}")
    for name, fn in CASES:
        t_np = median_time(fn, x, args.repeat, lambda r: r)
        t_jax = median_time(fn, xj, args.repeat, lambda r: r.block_until_ready())
        print(f"{name:32s} {t_np:9.3f} {t_jax:9.3f} {t_jax / t_np:10.2f}")


if __name__ == "__main__":
    main()
