"""10,000 MXNet training steps with inf, -inf and NaN injected into random gradients on ~5% of steps.

    .venv-mxnet/bin/python benchmarks/fault_injection_mxnet.py [--steps 10000] [--rate 0.05]

bf16-mixed (MXNet's CPU path) with dynamic loss scaling (polyamp's defaults, growth every 100 clean
steps), a hybridized Gluon network and Adam. Checks what the test suite checks on 2,000 steps: the
skipped steps are exactly the injected ones, a skipped step leaves every parameter unchanged, no
parameter ever becomes non-finite, the scale follows ``DynamicLossScale.update`` and stays within
[min_scale, max_scale]. Prints the counts and the scale range; exits 1 if any check fails.
"""

from __future__ import annotations

import sys
import time
import warnings

import numpy as np
from _fault import arguments, verdict  # benchmarks/_fault.py (this folder is on sys.path)

import polyamp as pa

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import autograd, gluon


def main() -> int:
    args = arguments(__doc__, policy=False)
    warnings.simplefilter("ignore")
    ls = pa.DynamicLossScale(growth_interval=100)
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=ls)  # before the network
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, activation="tanh", in_units=16), gluon.nn.Dense(1, in_units=64))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}))
    params = list(net.collect_params().values())
    loss_fn = gluon.loss.L2Loss()
    injected = skipped = unchanged_on_skip = 0
    state, expected_ok, scales = ls.init(), True, []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x = mx.nd.array(rng.standard_normal((32, 16)).astype(np.float32))
        with autograd.record():
            loss = loss_fn(net(x), x.sum(axis=1, keepdims=True).tanh())
            with mp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        hit = rng.random() < args.rate
        if hit:
            injected += 1
            flat = params[rng.integers(len(params))].grad().reshape((-1,))
            flat[int(rng.integers(flat.size))] = float(rng.choice([np.inf, -np.inf, np.nan]))
            before = [p.data().asnumpy() for p in params]
        result = mp.step(trainer, x.shape[0])
        skipped += not result.stepped
        if hit and not result.stepped:
            unchanged_on_skip += all(np.array_equal(b, p.data().asnumpy()) for b, p in zip(before, params))
        state = ls.update(state, not hit)
        expected_ok = expected_ok and state.scale == result.scale
        scales.append(result.scale)
    seconds = time.perf_counter() - t0
    nonfinite_params = sum(int((~np.isfinite(p.data().asnumpy())).sum()) for p in params)
    label = (
        f"MXNet {mx.__version__}: {args.steps} steps (bf16-mixed, dynamic loss scale; {unchanged_on_skip} "
        f"skipped with every parameter unchanged; scale {'as' if expected_ok else 'NOT as'} "
        "DynamicLossScale.update)"
    )
    ok = expected_ok and skipped == unchanged_on_skip
    return verdict(label, injected, skipped, nonfinite_params, scales, ls, seconds, extra_ok=ok)


if __name__ == "__main__":
    sys.exit(main())
