"""polyamp's JAX step against the native JAX way (plain ``jax.value_and_grad`` + optax; jmp for
loss scaling): median step-time ratios.

    python benchmarks/overhead_jax.py [--repeats 15] [--models mlp,charlm]

Models: the ``mlp`` and ``charlm`` workloads of ``polyamp compare`` at full size, Adam. Every
contender runs the same function (the workload's loss rewritten by ``mp.autocast``, so the
matmuls are identical), from the same weights on the same batch, as one jitted step with params,
optimizer state and loss-scale state donated; only the step around the gradients differs. The
contenders alternate (their order rotates every round), medians after one warm-up step each;
``ratio`` is the ratio of the medians, ``paired`` the median of the per-round ratios. Cases:
- bf16: native (no check, as a jmp bf16 policy runs) vs ``MixedPrecision("bf16-mixed")`` (guarded:
  one fused all-finite reduction and a ``lax.cond`` around the optimizer step) and ``guard=False``;
- fp16 loss scaling: jmp's ``DynamicLossScale`` idiom (scale, grad, unscale, ``all_finite``,
  ``adjust``, ``select_tree``) vs ``MixedPrecision("fp16-mixed", loss_scale="jmp")`` with
  ``step_if_finite``.
- ``--floor``: two more bf16 rows, the native step with the optimizer update inside a ``lax.cond``
  on a flag known before the backward pass (what the conditional costs) and on the all-finite flag
  of the gradients (what waiting for every gradient before any update costs, as an exact skip must:
  without it XLA overlaps the last layers' updates with the first layers' backward).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import jmp
import optax
from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)
from jax import lax

import polyamp as pa
from polyamp.compare import jax as jax_workloads
from polyamp.compare.workloads import get_workload
from polyamp.jax import all_finite, step_if_finite


def setup(name: str, policy: str, **kwargs):
    """The workload's batch, a fresh copy of its weights and Adam, and the autocast loss."""
    wl = get_workload(name)
    mp = pa.MixedPrecision(policy, framework="jax", **kwargs)
    params = {k: jnp.asarray(w) for k, w in wl.weights.items()}
    opt = optax.adam(1e-4)
    loss = mp.autocast(functools.partial(jax_workloads.loss_fn, wl))
    x, y = jax_workloads.inputs(wl, *wl.batch_at(0))
    return mp, params, opt, loss, x, y


def runner(step, carry, x, y):
    """A contender: one donated, jitted step per call, timed to the loss on the host."""
    compiled = jax.jit(step, donate_argnums=(0,))
    box = [carry]

    def call():
        box[0], loss = compiled(box[0], x, y)
        return float(loss)

    return call


def native_bf16(name, gate=None):
    """The native bf16 step; ``gate``: its update under ``lax.cond`` on a flag passed in
    (``"input"``) or on whether every gradient is finite (``"grads"``)."""
    _, params, opt, loss, x, y = setup(name, "bf16-mixed")

    def update(operands):
        grads, opt_state, params = operands
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(carry, x, y):
        params, opt_state, flag = carry
        value, grads = jax.value_and_grad(loss)(params, x, y)
        if gate is None:
            return (*update((grads, opt_state, params)), flag), value
        flag = all_finite(grads) if gate == "grads" else flag
        params, opt_state = lax.cond(flag, update, lambda ops: (ops[2], ops[1]), (grads, opt_state, params))
        return (params, opt_state, flag), value

    return runner(step, (params, opt.init(params), jnp.asarray(True)), x, y)


def polyamp_step(name, policy, **kwargs):
    mp, params, opt, loss, x, y = setup(name, policy, **kwargs)
    value_and_grad = mp.value_and_grad(loss)

    def step(carry, x, y):
        params, opt_state, state = carry
        (value, grads), finite, state = value_and_grad(params, x, y, state=state)
        params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
        return (params, opt_state, state), value

    return runner(step, (params, opt.init(params), mp.init()), x, y)


def jmp_fp16(name):
    _, params, opt, loss, x, y = setup(name, "fp16-mixed")
    scale = jmp.DynamicLossScale(jnp.float32(2.0**15))

    def step(carry, x, y):
        params, opt_state, scale = carry
        value, grads = jax.value_and_grad(lambda p: scale.scale(loss(p, x, y)))(params)
        grads = scale.unscale(grads)
        finite = jmp.all_finite(grads)
        scale = scale.adjust(finite)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt_state)
        params, opt_state = jmp.select_tree(finite, new, (params, opt_state))
        return (params, opt_state, scale), value

    return runner(step, (params, opt.init(params), scale), x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--models", default="mlp,charlm")
    parser.add_argument("--floor", action="store_true", help="add the two gated native bf16 rows")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, optax {optax.__version__}, jmp {jmp.__version__}, Adam, jitted donated "
          "steps, median step time")  # fmt: skip
    print(f"{'model':8s} {'case':34s} {'native ms':>10s} {'polyamp ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.models.split(","):
        contenders = {
            "native": native_bf16(name),
            "guarded": polyamp_step(name, "bf16-mixed"),
            "guard=False": polyamp_step(name, "bf16-mixed", guard=False),
        }
        if args.floor:
            contenders["native, cond on input flag"] = native_bf16(name, "input")
            contenders["native, cond on all grads"] = native_bf16(name, "grads")
        bf16 = run_paired(contenders, args.repeats)
        scaled = polyamp_step(name, "fp16-mixed", loss_scale="jmp")
        fp16 = run_paired({"jmp": jmp_fp16(name), "polyamp": scaled}, args.repeats)
        rows = (("bf16 guarded vs native", bf16["native"], bf16["guarded"]),
                ("bf16 guard=False vs native", bf16["native"], bf16["guard=False"]),
                *((f"bf16 {case}", bf16["native"], bf16[case]) for case in contenders if "cond" in case),
                ("fp16 vs jmp DynamicLossScale", fp16["jmp"], fp16["polyamp"]))  # fmt: skip
        for case, native, ours in rows:
            print(ratio_row(name, case, native, ours), flush=True)


if __name__ == "__main__":
    main()
