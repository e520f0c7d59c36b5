"""Pytree helpers for a jitted mixed-precision step: select, cast, step only if finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..errors import PolyampError


def select_tree(pred, on_true, on_false):
    """``on_true`` where the 0-d bool ``pred`` holds, else ``on_false``, leaf by leaf (no branch)."""
    if jnp.shape(pred) != () or jnp.result_type(pred) != jnp.bool_:
        raise PolyampError(
            f"select_tree needs a 0-d bool predicate (e.g. the finite flag); received dtype "
            f"{jnp.result_type(pred)} and shape {jnp.shape(pred)}"
        )
    if jax.tree.structure(on_true) != jax.tree.structure(on_false):
        raise PolyampError(
            f"select_tree needs two trees of one structure; received {jax.tree.structure(on_true)} "
            f"and {jax.tree.structure(on_false)}"
        )
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def cast_tree(tree, dtype: str):
    """``tree`` with every floating leaf cast to ``dtype`` (e.g. params for a "true" policy)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating)
                        else x, tree)  # fmt: skip


def step_if_finite(finite, optimizer, grads, opt_state, params):
    """Run an optax ``optimizer`` update only if ``finite``; ``(params, opt_state)`` either way.

    A ``lax.cond`` on the device, so the step stays in one ``jit`` (under ``vmap`` it becomes a
    select). With params and optimizer state donated to the step, XLA updates them in place under
    the ``cond``, where a select of the stepped and the old trees keeps both alive
    (``select_tree``; docs/BENCHMARKS.md compares the two). Named apart from optax's
    ``apply_if_finite``, a gradient transformation with another meaning.
    """
    import optax

    def step(operands):
        grads, opt_state, params = operands
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return lax.cond(finite, step, lambda operands: (operands[2], operands[1]), (grads, opt_state, params))


def all_finite(tree):
    """One fused reduction: True when every floating leaf of ``tree`` is finite."""
    flags = [jnp.isfinite(g).all() for g in jax.tree.leaves(tree) if jnp.issubdtype(g.dtype, jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.asarray(True)
