"""polyamp's JAX autocast against the ways people do mixed precision in JAX by hand, side by side.

    python benchmarks/jax_autocast.py [--workloads mlp,charlm] [--repeats 7] [--quick] [--no-donate]

Contenders, each one jitted train step (value_and_grad + optax Adam; params, optimizer and scale
state donated, as a training loop does, unless ``--no-donate``) on the compare workloads'
networks, weights and batches (``polyamp/compare/jax.py``):

- ``fp32``: the float32 function;
- ``naive bf16``: the whole parameter tree and the inputs cast to bfloat16 (jmp/MPX style), so
  every op, layer norms and softmax included, runs in bfloat16;
- ``hand bf16``: every matmul written as ``jnp.matmul(a.astype(bf16), b.astype(bf16),
  preferred_element_type=float32)``, the rest float32;
- ``polyamp``: ``mp.autocast(loss)`` with ``bf16-mixed`` (no source changes);
- ``polyamp+guard``: ``mp.value_and_grad(mp.autocast(loss))`` plus ``step_if_finite``: the
  finite check, the loss-scale state update and the ``lax.cond`` that skips a bad step;
- ``polyamp+select``: the same with the skip as a select of the stepped and the old
  params/optimizer state (``select_tree``), the alternative without donation.

The contenders run in turn, repeat after repeat (medians after one warm-up step each;
``benchmarks/_timing.py``). Also
reported: tracing and compile time of each step, ``make_jaxpr`` time of the loss with and
without autocast, and a ceiling: how much faster every matmul of the step (forward and backward,
nothing else) runs in bf16 than in float32 on this machine. Targets: polyamp >= 2x naive bf16's
speed and within 5% of hand bf16. Where the naive cast runs at about float32's speed, the 2x
target asks polyamp to beat float32 by 2x; the script prints that requirement next to the
ceiling.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import optax
from _timing import alternate  # benchmarks/_timing.py (this folder is on sys.path)
from jax import lax
from jax.extend import core as jcore

import polyamp as pa
from polyamp.compare import jax as cj
from polyamp.compare.workloads import get_workload
from polyamp.jax import select_tree, step_if_finite

BF16, F32 = jnp.bfloat16, jnp.float32


def hand_mm(a, b):
    return jnp.matmul(a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


def to_bf16(tree):
    return jax.tree.map(lambda a: a.astype(BF16) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def select_if_finite(finite, opt, grads, opt_state, params):
    """The skip as a select of the stepped and the old trees."""
    updates, new_opt_state = opt.update(grads, opt_state, params)
    stepped = (optax.apply_updates(params, updates), new_opt_state)
    return select_tree(finite, stepped, (params, opt_state))


def contenders(wl):
    """label -> (loss function, MixedPrecision for the guarded step or None, how it skips)."""
    loss = functools.partial(cj.loss_fn, wl)
    mp = pa.MixedPrecision("bf16-mixed", framework="jax")
    return {
        "fp32": (loss, None, None),
        "naive bf16": (lambda p, x, y: loss(to_bf16(p), to_bf16(x), y), None, None),
        "hand bf16": (functools.partial(cj.loss_fn, wl, mm=hand_mm), None, None),
        "polyamp": (mp.autocast(loss), None, None),
        "polyamp+guard": (mp.autocast(loss), mp, step_if_finite),
        "polyamp+select": (mp.autocast(loss), mp, select_if_finite),
    }


def make_step(loss, mp, opt, skip):
    """One train step; with ``mp``: polyamp's value_and_grad and ``skip`` keeping the update only
    if finite."""
    if mp is not None:
        value_and_grad = mp.value_and_grad(loss)

        def guarded(params, opt_state, state, x, y):
            (value, grads), finite, state = value_and_grad(params, x, y, state=state)
            params, opt_state = skip(finite, opt, grads, opt_state, params)
            return params, opt_state, state, value

        return guarded

    def step(params, opt_state, state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    return step


def step_dots(loss, params, x, y) -> list:
    """Every ``dot_general`` of the float32 train step (forward and backward): (lhs, rhs, numbers)."""
    closed = jax.make_jaxpr(jax.grad(loss))(params, x, y)
    todo, found = [closed.jaxpr], []
    while todo:
        for eqn in todo.pop().eqns:
            todo.extend(jcore.jaxprs_in_params(eqn.params))
            if eqn.primitive.name == "dot_general":
                lhs, rhs = (v.aval for v in eqn.invars)
                found.append((lhs.shape, rhs.shape, eqn.params["dimension_numbers"]))
    return found


def matmul_ceiling(wl, repeats: int) -> dict[str, float]:
    """Median ms of the step's matmuls alone in float32 and in bf16 (polyamp's autocast: bf16
    operands, float32 accumulation), operands already in their dtype. Their ratio bounds a bf16
    step's speed-up over float32 unless the step's other ops get faster in bf16 too."""
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    dots = step_dots(functools.partial(cj.loss_fn, wl), params, *cj.inputs(wl, *wl.batch_at(0)))
    key = jax.random.key(0)
    operands = [jax.random.normal(key, shape, F32) for lhs, rhs, _ in dots for shape in (lhs, rhs)]

    def all_dots(*ops):
        return [lax.dot_general(a, b, numbers, preferred_element_type=F32)
                for a, b, (_, _, numbers) in zip(ops[::2], ops[1::2], dots)]  # fmt: skip

    f32 = jax.jit(all_dots)
    bf16 = jax.jit(pa.MixedPrecision("bf16-mixed", framework="jax").autocast(all_dots))
    low = [a.astype(BF16) for a in operands]
    seconds = alternate({"f32": lambda: jax.block_until_ready(f32(*operands)),
                         "bf16": lambda: jax.block_until_ready(bf16(*low))}, repeats)  # fmt: skip
    return {k: 1e3 * s for k, s in seconds.items()}


def stepper(compiled, carry, x, y, donate: bool):
    """One compiled train step per call; with donation each call takes the previous one's outputs."""
    state = [carry]

    def call():
        out = jax.block_until_ready(compiled(*state[0], x, y))
        if donate:
            state[0] = out[:3]

    return call


def run(name: str, quick: bool, repeats: int, donate: bool) -> None:
    wl = get_workload(name, quick=quick)
    params = {k: jnp.asarray(v) for k, v in wl.weights.items()}
    opt = optax.adam(wl.lr)
    x, y = cj.inputs(wl, *wl.batch_at(0))
    steps, timing = {}, {}
    table = contenders(wl)
    donate = (0, 1, 2) if donate else ()
    for label, (fn, mp, skip) in table.items():
        own = jax.tree.map(jnp.copy, params)  # donated buffers are consumed, so each has its own
        carry = (own, opt.init(own), mp.init() if mp else None)
        t0 = time.perf_counter()
        traced = jax.jit(make_step(fn, mp, opt, skip), donate_argnums=donate).trace(*carry, x, y)
        t1 = time.perf_counter()
        compiled = traced.lower().compile()
        t2 = time.perf_counter()
        steps[label] = stepper(compiled, carry, x, y, bool(donate))
        timing[label] = {"trace_ms": 1e3 * (t1 - t0), "compile_ms": 1e3 * (t2 - t1)}
    med = {label: 1e3 * seconds for label, seconds in alternate(steps, repeats).items()}
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
    dots = matmul_ceiling(wl, repeats)
    print(f"  2x naive bf16 needs {2 * med['fp32'] / med['naive bf16']:.2f}x fp32's speed; polyamp has "
          f"{med['fp32'] / med['polyamp']:.2f}x; the step's matmuls alone: {dots['f32']:.1f} ms fp32, "
          f"{dots['bf16']:.1f} ms bf16 ({dots['f32'] / dots['bf16']:.2f}x)")  # fmt: skip
    jaxpr_ms = {}
    for label, (fn, _, _) in (("plain", table["fp32"]), ("autocast", table["polyamp"])):
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
    no_donate = "keep the inputs alive (new output buffers each step) instead of donating them"
    parser.add_argument("--no-donate", action="store_true", help=no_donate)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; bf16 autocast, Adam, one jit per step")
    for name in args.workloads.split(","):
        run(name, args.quick, args.repeats, not args.no_donate)


if __name__ == "__main__":
    main()
