"""Mixed precision for a plain JAX + optax model with polyamp: op-level autocast and loss scaling.

    python examples/jax_amp.py [--policy fp16-mixed|bf16-mixed|float32] [--steps 300]

JAX has no autocast, so the usual recipe (jmp, MPX) casts the whole parameter tree and the inputs
to half precision and runs the unchanged function: every op then runs in half precision, layer
norms, softmax and the loss's sums included. polyamp rewrites the function's jaxpr instead:
matmuls take half-precision inputs and accumulate in float32, reductions, exp/log and norms stay
float32. Loss scaling is a pytree state threaded through the jitted step; a step whose gradients
are not finite is skipped with a select, so nothing leaves the jit. This script shows both on the
same MLP and trains it with an overflow injected every 10 steps.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

import polyamp as pa
from polyamp.jax import step_if_finite

REDUCTIONS = {"reduce_sum", "reduce_max", "exp", "log", "rsqrt", "cumsum"}


def init_params(seed: int = 0, sizes=(16, 64, 64, 1)) -> dict:
    rng = np.random.default_rng(seed)
    return {f"l{i}": {"w": jnp.asarray(rng.uniform(-1, 1, (a, b)) / np.sqrt(a), jnp.float32),
                      "b": jnp.zeros(b, jnp.float32)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}  # fmt: skip


def loss_fn(params, x, y):
    h = x
    for i in range(len(params)):
        layer = params[f"l{i}"]
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5)
            h = jax.nn.gelu(h)
    return jnp.mean((h - y) ** 2)


def batches(steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 1)).astype(np.float32)
    for _ in range(steps):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        yield jnp.asarray(x), jnp.asarray(np.tanh(x @ w / 4))


def half_precision_ops(fn, *args) -> tuple[int, int]:
    """(reductions, exp/log, rsqrt running in half precision, matmuls with half-precision inputs)."""
    reductions = matmuls = 0

    def walk(jaxpr):
        nonlocal reductions, matmuls
        for eqn in jaxpr.eqns:
            half = any(v.aval.dtype in (jnp.bfloat16, jnp.float16) for v in eqn.invars)
            reductions += half and eqn.primitive.name in REDUCTIONS
            matmuls += half and eqn.primitive.name == "dot_general"
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return reductions, matmuls


def train(policy: str, steps: int, overflow_every: int = 10) -> dict:
    mp = pa.MixedPrecision(policy, framework="jax")  # loss scaling where the policy needs it
    value_and_grad = mp.value_and_grad(mp.autocast(loss_fn))
    optimizer = optax.adam(3e-3)

    # params, optimizer and scale state are donated, so XLA updates them in place (step_if_finite
    # is fastest that way; see its docstring)
    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, opt_state, scale_state, x, y):
        (loss, grads), finite, scale_state = value_and_grad(params, x, y, state=scale_state)
        params, opt_state = step_if_finite(finite, optimizer, grads, opt_state, params)
        return params, opt_state, scale_state, loss, finite

    params = init_params()
    opt_state, scale_state = optimizer.init(params), mp.init()
    losses, skipped = [], 0
    for i, (x, y) in enumerate(batches(steps)):
        if overflow_every and i % overflow_every == 0:
            x = x.at[0, 0].set(jnp.inf)  # what an overflow in the forward pass looks like
        params, opt_state, scale_state, loss, finite = step(params, opt_state, scale_state, x, y)
        skipped += not bool(finite)
        losses.append(float(loss))
    mp.sync(scale_state)  # mp.state_dict() now holds the scale, for a checkpoint
    finite_losses = [v for v in losses if np.isfinite(v)]
    return {"first": finite_losses[0], "last": finite_losses[-1], "skipped": skipped,
            "scale": mp.current_scale, "checkpoint": mp.state_dict()}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    params = init_params()
    x, y = next(batches(1))
    half = pa.Policy.parse(args.policy).compute_dtype
    if half != "float32":
        naive = jax.tree.map(lambda a: a.astype(half), (params, x))
        red, mm = half_precision_ops(loss_fn, *naive, y)
        print(f"naive whole-tree {half} cast: {red} reductions/exp/log/rsqrt and {mm} matmuls in {half}")
        red, mm = half_precision_ops(pa.MixedPrecision(args.policy, framework="jax").autocast(loss_fn),
                                     params, x, y)  # fmt: skip
        print(f"polyamp autocast: {red} reductions/exp/log/rsqrt and {mm} matmuls in {half} "
              "(matmuls accumulate in float32)")  # fmt: skip
    result = train(args.policy, args.steps)
    print(f"polyamp {args.policy}: loss {result['first']:.4f} -> {result['last']:.4f}, "
          f"{result['skipped']} overflow steps skipped, final scale {result['scale']:g}")  # fmt: skip
    print(f"checkpointable state: {result['checkpoint']['state']}")


if __name__ == "__main__":
    main()
