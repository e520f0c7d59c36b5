"""Elements per second for float32 -> e4m3fn rounding, every implementation side by side.

    python benchmarks/quantize.py [--n 16777216] [--repeats 5] [--json]

polyamp (compiled kernel and numpy fallback) against ml_dtypes' cast (one way, and the
fake-quant round trip that returns float32 like polyamp does), gfloat, pychop, and a plain numpy
copy of the array as the memory-bandwidth ceiling. Median of --repeats runs after one warm-up.
pychop's "e4m3" is IEEE-like (max 240, not OCP's 448); it is timed as the same amount of work,
on float64 input (its numpy backend computes in float64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import ml_dtypes
import numpy as np

import polyamp
from polyamp.numerics import rounding


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cases(x: np.ndarray):
    import gfloat
    from gfloat.formats import format_info_ocp_e4m3
    from pychop import Chop

    rng = np.random.default_rng(0)
    x64 = x.astype(np.float64)
    # chunk_size=x.size: one chunk is pychop's fastest setting here (its default 800 is 3x slower).
    chop_rne = Chop(exp_bits=4, sig_bits=3, rmode=1, subnormal=True, chunk_size=x.size)
    chop_sr = Chop(exp_bits=4, sig_bits=3, rmode=5, subnormal=True, chunk_size=x.size)

    def numpy_path(mode):
        def run():
            os.environ["POLYAMP_NO_NUMBA"] = "1"
            rounding._kernel.cache_clear()
            try:
                polyamp.quantize(x, "e4m3fn", mode, seed=1)
            finally:
                del os.environ["POLYAMP_NO_NUMBA"]
                rounding._kernel.cache_clear()

        return run

    return [
        ("numpy copy (ceiling)", "-", lambda: x.copy()),
        ("polyamp numba", "nearest", lambda: polyamp.quantize(x, "e4m3fn")),
        ("polyamp numba", "stochastic", lambda: polyamp.quantize(x, "e4m3fn", "stochastic", seed=1)),
        ("polyamp numpy fallback", "nearest", numpy_path("nearest")),
        ("polyamp numpy fallback", "stochastic", numpy_path("stochastic")),
        ("ml_dtypes cast f32->e4m3fn", "nearest", lambda: x.astype(ml_dtypes.float8_e4m3fn)),
        ("ml_dtypes round trip f32->e4m3fn->f32", "nearest",
         lambda: x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)),
        ("gfloat round_ndarray", "nearest", lambda: gfloat.round_ndarray(format_info_ocp_e4m3, x)),
        ("gfloat round_ndarray", "stochastic", lambda: gfloat.round_ndarray(
            format_info_ocp_e4m3, x, gfloat.RoundMode.Stochastic,
            srbits=rng.integers(0, 1 << 20, x.size), srnumbits=20)),
        ("pychop Chop(4, 3) (float64 in)", "nearest", lambda: chop_rne(x64)),
        ("pychop Chop(4, 3) (float64 in)", "stochastic", lambda: chop_sr(x64)),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    x = (np.random.default_rng(0).standard_normal(args.n) * 100).astype(np.float32)
    rows = []
    for name, mode, fn in cases(x):
        seconds = median_seconds(fn, args.repeats)
        rows.append({"implementation": name, "rounding": mode, "seconds": seconds,
                     "melem_per_s": args.n / seconds / 1e6})  # fmt: skip
    speed = {(r["implementation"], r["rounding"]): r["melem_per_s"] for r in rows}
    ml = speed[("ml_dtypes cast f32->e4m3fn", "nearest")]
    chop = speed[("pychop Chop(4, 3) (float64 in)", "nearest")]
    for r in rows:
        r["x_ml_dtypes_cast"] = r["melem_per_s"] / ml
        r["x_pychop"] = r["melem_per_s"] / chop
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    import numba

    print(f"float32 -> e4m3fn, {args.n:,} elements, median of {args.repeats} after warm-up, "
          f"{os.cpu_count()} cpus, numba threads {numba.get_num_threads()}")  # fmt: skip
    print(f"{'implementation':40s} {'rounding':10s} {'Melem/s':>9s} {'x ml_dtypes':>12s} {'x pychop':>9s}")
    for r in rows:
        print(f"{r['implementation']:40s} {r['rounding']:10s} {r['melem_per_s']:9.1f} "
              f"{r['x_ml_dtypes_cast']:12.2f} {r['x_pychop']:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
