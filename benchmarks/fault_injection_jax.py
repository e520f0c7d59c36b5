"""10,000 jitted JAX training steps with inf, -inf and NaN injected into random gradient elements
on ~5% of steps.

    python benchmarks/fault_injection_jax.py [--steps 10000] [--rate 0.05] [--policy fp16-mixed]

The fault enters through an identity whose custom VJP adds it to one element of one parameter's
gradient, inside the jitted step, before polyamp's finite check. Checks what the test suite checks
on 2,000 steps: no parameter or optimizer state ever becomes non-finite, the skipped steps are
exactly the injected ones, and the scale stays within [min_scale, max_scale]. Prints the counts
and the scale range; exits 1 if any check fails.
"""

from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _fault import arguments, verdict  # benchmarks/_fault.py (this folder is on sys.path)

import polyamp as pa
from polyamp.jax import step_if_finite


@jax.custom_vjp
def poison(w, fault):
    return w


poison.defvjp(lambda w, fault: (w, fault), lambda fault, ct: (ct + fault, jnp.zeros_like(fault)))


def loss_fn(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - jnp.tanh(x.sum(1, keepdims=True))) ** 2)


def main() -> int:
    args = arguments(__doc__)
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.uniform(-0.25, 0.25, (16, 64)), jnp.float32), "b1": jnp.zeros(64),
              "w2": jnp.asarray(rng.uniform(-0.125, 0.125, (64, 1)), jnp.float32),
              "b2": jnp.zeros(1)}  # fmt: skip
    ls = pa.DynamicLossScale(growth_interval=100)
    mp = pa.MixedPrecision(args.policy, framework="jax", loss_scale=ls)
    optimizer = optax.adam(1e-3)
    value_and_grad = mp.value_and_grad(
        lambda p, faults, x: mp.autocast(loss_fn)(jax.tree.map(poison, p, faults), x)
    )

    @jax.jit
    def step(params, opt_state, state, faults, x):
        (_, grads), finite, state = value_and_grad(params, faults, x, state=state)
        params, opt_state = step_if_finite(finite, optimizer, grads, opt_state, params)
        return params, opt_state, state, finite

    opt_state, state = optimizer.init(params), mp.init()
    names = sorted(params)
    clean = {k: np.zeros(v.shape, np.float32) for k, v in params.items()}
    injected = skipped = 0
    scales = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        faults = clean
        if rng.random() < args.rate:
            injected += 1
            name = names[rng.integers(len(names))]
            faults = {**clean, name: clean[name].copy()}
            faults[name].reshape(-1)[rng.integers(faults[name].size)] = rng.choice(
                [math.inf, -math.inf, math.nan]
            )
        x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
        params, opt_state, state, finite = step(params, opt_state, state, faults, x)
        skipped += not bool(finite)
        scales.append(float(state.scale))
    seconds = time.perf_counter() - t0
    mp.sync(state)
    nonfinite = sum(int((~np.isfinite(np.asarray(a))).sum()) for a in jax.tree.leaves((params, opt_state)))
    label = f"{args.steps} steps ({args.policy})"
    return verdict(
        label, injected, skipped, nonfinite, scales, ls, seconds, extra_ok=skipped == mp.state.skipped
    )


if __name__ == "__main__":
    sys.exit(main())
