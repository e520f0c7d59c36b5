"""10,000 training steps with inf, -inf and NaN injected into random gradients on ~5% of steps.

    python benchmarks/fault_injection_torch.py [--steps 10000] [--rate 0.05] [--policy fp16-mixed]

Checks what the test suite checks on 2,000 steps: no parameter ever becomes non-finite, the
skipped steps are exactly the injected ones, and the scale stays within [min_scale, max_scale].
Prints the counts and the scale range; exits 1 if any check fails.
"""

from __future__ import annotations

import math
import sys
import time
import warnings

import numpy as np
import torch
from _fault import arguments, verdict  # benchmarks/_fault.py (this folder is on sys.path)
from torch import nn

import polyamp as pa


def main() -> int:
    args = arguments(__doc__)
    warnings.simplefilter("ignore", RuntimeWarning)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ls = pa.DynamicLossScale(growth_interval=100)
    mp = pa.MixedPrecision(args.policy, framework="torch", device="cpu", loss_scale=ls)
    params = list(model.parameters())
    injected = skipped = 0
    scales = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randn(32, 16)
        opt.zero_grad()
        mp.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).tanh()))
        if rng.random() < args.rate:
            injected += 1
            grad = params[rng.integers(len(params))].grad
            grad.view(-1)[rng.integers(grad.numel())] = rng.choice([math.inf, -math.inf, math.nan])
        result = mp.step(opt)
        skipped += not result.stepped
        scales.append(result.scale)
    seconds = time.perf_counter() - t0
    nonfinite_params = sum(int((~torch.isfinite(p)).sum()) for p in params)
    label = f"{args.steps} steps ({args.policy})"
    return verdict(label, injected, skipped, nonfinite_params, scales, ls, seconds)


if __name__ == "__main__":
    sys.exit(main())
