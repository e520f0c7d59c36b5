"""PyTorch ``quantize`` / ``quantize_blocks`` (torch ops) against the numpy core, side by side.

    python benchmarks/quantize_torch.py [--n 4096] [--repeats 5] [--device cpu|cuda] [--compile]

One n x n float32 tensor (standard normal * 100); each case runs the torch front end on the tensor and
the numpy core (numba kernel where it applies) on the same values, alternating, median of --repeats
rounds after one warm-up each (``_timing.alternate``). Prints both medians and torch / numpy (below 1:
torch is faster). ``--compile`` adds torch.compile'd (inductor) versions of the torch calls. On CUDA
the timed call ends with a synchronize.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import numpy as np
import torch
from _timing import alternate

import polyamp
from polyamp.numerics import rounding

CASES = [  # (label, function name, args after x, kwargs)
    ("quantize e4m3fn nearest", "quantize", ("e4m3fn",), {}),
    ("quantize e4m3fn stochastic", "quantize", ("e4m3fn", "stochastic"), {"seed": 1}),
    ("quantize e2m1fn nearest sat", "quantize", ("e2m1fn",), {"saturate": True}),
    ("blocks mxfp8_e4m3 floor", "quantize_blocks", ("mxfp8_e4m3",), {}),
    ("blocks mxfp8_e4m3 rceil axis 0", "quantize_blocks", ("mxfp8_e4m3", 0, None, "rceil"), {}),
    ("blocks mxfp4 stochastic", "quantize_blocks", ("mxfp4",), {"rounding": "stochastic", "seed": 1}),
    ("blocks nvfp4 1x16", "quantize_blocks", ("nvfp4",), {}),
    ("blocks nvfp4 16x16", "quantize_blocks", ("nvfp4",), {"block": (16, 16)}),
]  # fmt: skip


def _timed_torch(fn, sync) -> None:
    fn()
    sync()


def _apply(fn, fargs, kwargs, t):
    return fn(t, *fargs, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()

    x = (np.random.default_rng(0).standard_normal((args.n, args.n)) * 100).astype(np.float32)
    xt = torch.from_numpy(x).to(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(f"float32 {args.n}x{args.n}, median of {args.repeats} after warm-up; torch {torch.__version__} on "
          f"{args.device} ({torch.get_num_threads()} threads), numpy core backend {rounding.backend()}, "
          f"{os.cpu_count()} cpus")  # fmt: skip
    header = f"{'case':32s} {'numpy ms':>9s} {'torch ms':>9s} {'torch/np':>8s}"
    print(header + (f" {'compiled ms':>11s} {'comp/np':>8s}" if args.compile else ""))
    for label, name, fargs, kwargs in CASES:
        core = partial(getattr(polyamp.numerics, name), x, *fargs, **kwargs)
        ours = getattr(polyamp, name)  # polyamp.quantize / quantize_blocks: the torch route for a tensor
        call = partial(_timed_torch, partial(ours, xt, *fargs, **kwargs), sync)
        contenders = {"numpy": core, "torch": call}
        if args.compile:
            compiled = torch.compile(partial(_apply, ours, fargs, kwargs))
            contenders["compiled"] = partial(_timed_torch, partial(compiled, xt), sync)
        t = alternate(contenders, args.repeats)
        row = f"{label:32s} {t['numpy'] * 1e3:9.1f} {t['torch'] * 1e3:9.1f} {t['torch'] / t['numpy']:8.2f}"
        if args.compile:
            row += f" {t['compiled'] * 1e3:11.1f} {t['compiled'] / t['numpy']:8.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
