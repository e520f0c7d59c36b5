"""Flax NNX's optimizer, skip-aware: ``update_if_finite(finite, optimizer, model, grads)``.

``nnx.Optimizer.update(model, grads)`` applies every update; after an overflow that writes inf/NaN into
the weights and the optimizer's moments. This is the same update (``optimizer.tx.update`` on the ``wrt``
state of the model, then ``optax.apply_updates``, written back with ``nnx.update``) under one
``lax.cond`` on the finite flag: on a skipped step the weights, the optimizer state and
``optimizer.step`` stay as they were, as ``step_if_finite`` does for plain optax. It is array ops on the
live module and optimizer, so it composes with ``nnx.jit``:

    @nnx.jit
    def train_step(model, optimizer, batch, state):
        (loss, grads), finite, state = mp.value_and_grad(f)(model, batch, state=state)
        update_if_finite(finite, optimizer, model, grads)
        return loss, state

``grads`` may be ``mp.value_and_grad``'s (the model's structure, gradients at its floating leaves) or
``nnx.grad``'s (an ``nnx.State``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..errors import PolyampError


def update_if_finite(finite, optimizer, model, grads, **kwargs):
    """``optimizer.update(model, grads, **kwargs)`` if ``finite`` (a 0-d bool), else nothing (module
    docstring); returns the updates applied (zeros on a skipped step)."""
    import optax
    from flax import nnx

    if not isinstance(optimizer, nnx.Optimizer):
        raise PolyampError(f"update_if_finite takes an nnx.Optimizer, got {type(optimizer).__name__}; for "
                           "plain optax use polyamp.jax.step_if_finite")  # fmt: skip
    if jnp.shape(finite) != () or jnp.result_type(finite) != jnp.bool_:
        raise PolyampError(f"finite must be the 0-d bool flag mp.value_and_grad returns, got dtype "
                           f"{jnp.result_type(finite)} and shape {jnp.shape(finite)}")  # fmt: skip
    graph = getattr(optimizer, "graph", None)
    params = nnx.as_pure(nnx.state(model, optimizer.wrt, graph=graph))
    grad_arrays = nnx.as_pure(nnx.state(grads, optimizer.wrt, graph=graph))
    opt_state = nnx.as_pure(optimizer.opt_state)
    extra = nnx.as_pure(kwargs)

    def step(operands):
        g, state, p = operands
        updates, state = optimizer.tx.update(g, state, p, **extra)
        return optax.apply_updates(p, updates), state, updates

    def skip(operands):
        g, state, p = operands
        return p, state, jax.tree.map(jnp.zeros_like, g)

    new_params, new_state, updates = lax.cond(finite, step, skip, (grad_arrays, opt_state, params))
    nnx.update(model, new_params)
    nnx.update(optimizer.opt_state, nnx.state(new_state, graph=graph))
    optimizer.step[...] += finite.astype(optimizer.step[...].dtype)
    return updates


__all__ = ["update_if_finite"]
