"""The doctor's torch binning on the CPU: the compiled kernel against torch ops, side by side.

    python benchmarks/doctor_binning_torch.py [--n 25000000] [--repeats 7]

One float32 weight of ``n`` values (normal, std 0.02) and a stepped copy (an Adam-like step of 1e-4
in sign): the histogram of the weight (``binned``) and the weight's histogram with the update ratio's
(``collect``'s ``_update``), each by the compiled kernel (``doctor/_bin_kernel.py``, numba) and by torch
ops (``_COMPILED_MIN`` out of reach), alternating in one process; median of ``repeats`` after a
warm-up. The torch-ops calls share one ``Scratch`` (as within one ``collect``), so the first call's
page faults are not in their medians. Both results are checked equal.
"""

from __future__ import annotations

import argparse

import torch
from _timing import alternate  # benchmarks/_timing.py (this folder is on sys.path)

from polyamp.torch import binning
from polyamp.torch.doctor import _update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if binning._kernel_module() is None:
        raise SystemExit("numba is not installed (the `fast` extra): no compiled kernel to time")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.n, generator=g) * 0.02
    p = w - 1e-4 * torch.randn(args.n, generator=g).sign()
    scratch = binning.Scratch()
    compiled_min = binning._COMPILED_MIN

    def torch_ops(fn):
        def call():
            binning._COMPILED_MIN = 1 << 62
            try:
                return fn()
            finally:
                binning._COMPILED_MIN = compiled_min

        return call

    def histogram():
        return binning.binned(w, scratch)

    def weight_and_ratio():
        return _update(p, w, scratch)

    cases = {
        "histogram, compiled": histogram,
        "histogram, torch ops": torch_ops(histogram),
        "weight + ratio, compiled": weight_and_ratio,
        "weight + ratio, torch ops": torch_ops(weight_and_ratio),
    }
    for name in ("histogram", "weight + ratio"):
        a, b = cases[f"{name}, compiled"](), cases[f"{name}, torch ops"]()
        parts = (a, b) if name == "histogram" else (a[1], b[1])
        assert binning.merged([parts[0]]) == binning.merged([parts[1]]), name
    times = alternate(cases, args.repeats)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.n:,} float32 values")
    for name in ("histogram", "weight + ratio"):
        c, t = times[f"{name}, compiled"], times[f"{name}, torch ops"]
        print(f"{name:16s} compiled {c * 1e3:7.1f} ms   torch ops {t * 1e3:7.1f} ms   torch ops / compiled "
              f"{t / c:5.2f}")
    scratch.__exit__()


if __name__ == "__main__":
    main()
