"""polyamp's JAX autocast against the ways people do mixed precision in JAX by hand, side by side.

    python benchmarks/jax_autocast.py [--workloads mlp,charlm] [--repeats 7] [--quick]

Contenders, each one jitted train step (value_and_grad + optax Adam) on the compare workloads'
networks, weights and batches (``polyamp/compare/jax.py``):

- ``fp32``: the float32 function;
- ``naive bf16``: the whole parameter tree and the inputs cast to bfloat16 (jmp/MPX style), so
  every op, layer norms and softmax included, runs in bfloat16;
- ``hand bf16``: every matmul written as ``jnp.matmul(a.astype(bf16), b.astype(bf16),
  preferred_element_type=float32)``, the rest float32;
- ``polyamp``: ``mp.autocast(loss)`` with ``bf16-mixed`` (no source changes);
- ``polyamp+guard``: ``mp.value_and_grad(mp.autocast(loss))`` plus ``apply_if_finite``: the
  finite check, the loss-scale state update and the select that skips a bad step.

The contenders run in turn, repeat after repeat (medians after one warm-up step each). Also
reported: tracing and compile time of each step, and ``make_jaxpr`` time of the loss with and
without autocast. Targets: polyamp >= 2x naive bf16's speed and within 5% of hand bf16.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import polyamp as pa
from polyamp.backends.jax import apply_if_finite
from polyamp.compare import jax as cj
from polyamp.compare.workloads import get_workload

BF16, F32 = jnp.bfloat16, jnp.float32


def hand_mm(a, b):
    return jnp.matmul(a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


def to_bf16(tree):
    return jax.tree.map(lambda a: a.astype(BF16) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def contenders(wl):
    """label -> (loss function, MixedPrecision for the guarded step or None)."""
    loss = functools.partial(cj.loss_fn, wl)
    mp = pa.MixedPrecision("bf16-mixed", framework="jax")
    return {
        "fp32": (loss, None),
        "naive bf16": (lambda p, x, y: loss(to_bf16(p), to_bf16(x), y), None),
        "hand bf16": (functools.partial(cj.loss_fn, wl, mm=hand_mm), None),
        "polyamp": (mp.autocast(loss), None),
        "polyamp+guard": (mp.autocast(loss), mp),
    }


def make_step(loss, mp, opt):
    """One train step; with ``mp``: polyamp's value_and_grad and the update kept only if finite."""
    if mp is not None:
        value_and_grad = mp.value_and_grad(loss)

        def guarded(params, opt_state, state, x, y):
            (value, grads), finite, state = value_and_grad(params, x, y, state=state)
            params, opt_state = apply_if_finite(finite, opt, grads, opt_state, params)
            return params, opt_state, state, value

        return guarded

    def step(params, opt_state, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    return step


def run(name: str, quick: bool, repeats: int) -> None:
    wl = get_workload(name, quick=quick)
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    opt = optax.adam(wl.lr)
    x, y = cj.inputs(wl, *wl.batch_at(0))
    steps, timing = {}, {}
    table = contenders(wl)
    for label, (fn, mp) in table.items():
        args = (params, opt.init(params), mp.init() if mp else None, x, y)
        t0 = time.perf_counter()
        traced = jax.jit(make_step(fn, mp, opt)).trace(*args)
        t1 = time.perf_counter()
        compiled = traced.lower().compile()
        t2 = time.perf_counter()
        jax.block_until_ready(compiled(*args))  # warm-up
        steps[label] = (compiled, args)
        timing[label] = {"trace_ms": 1e3 * (t1 - t0), "compile_ms": 1e3 * (t2 - t1), "times": []}
    for _ in range(repeats):
        for label, (compiled, args) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            timing[label]["times"].append(time.perf_counter() - t0)
    med = {label: 1e3 * statistics.median(t["times"]) for label, t in timing.items()}
    print(f"\n{name} ({'quick' if quick else 'full'} size, median of {repeats}):")
    print(f"  {'contender':<14} {'ms/step':>9} {'vs fp32':>8} {'trace ms':>9} {'compile ms':>11}")
    for label, t in timing.items():
        print(f"  {label:<14} {med[label]:9.1f} {med['fp32'] / med[label]:7.2f}x "
              f"{t['trace_ms']:9.0f} {t['compile_ms']:11.0f}")  # fmt: skip
    vs_naive = med["naive bf16"] / med["polyamp"]
    vs_hand = med["polyamp"] / med["hand bf16"] - 1
    print(f"  polyamp vs naive bf16: {vs_naive:.2f}x faster (target >= 2x: "
          f"{'met' if vs_naive >= 2 else 'NOT met'}); vs hand bf16: {100 * vs_hand:+.1f}% time "
          f"(target within 5%: {'met' if vs_hand <= 0.05 else 'NOT met'})")  # fmt: skip
    jaxpr_ms = {}
    for label, (fn, _) in (("plain", table["fp32"]), ("autocast", table["polyamp"])):
        t0 = time.perf_counter()
        for _ in range(3):
            jax.make_jaxpr(jax.grad(fn))(params, x, y)
        jaxpr_ms[label] = 1e3 * (time.perf_counter() - t0) / 3
    print(f"  make_jaxpr(grad(loss)): {jaxpr_ms['plain']:.0f} ms plain, {jaxpr_ms['autocast']:.0f} ms "
          f"with autocast ({jaxpr_ms['autocast'] / jaxpr_ms['plain']:.1f}x)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; bf16 autocast, Adam, one jit per step")
    for name in args.workloads.split(","):
        run(name, args.quick, args.repeats)


if __name__ == "__main__":
    main()
