"""Pytree helpers for a jitted mixed-precision step: select, cast, step only if finite; and the split of a
model's array leaves from its other leaves (an Equinox module holds functions such as ``jax.nn.relu``),
which JAX transformations cannot take: those pass through untouched, as ``eqx.partition`` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import PolyampError

_SCALARS = (bool, int, float, complex, np.generic, np.ndarray)


def is_array(x) -> bool:
    """A leaf JAX traces: a jax array (or tracer), a numpy array or scalar, a Python number."""
    return isinstance(x, (jax.Array, *_SCALARS))


def is_floating_array(x) -> bool:
    """An array leaf of a floating dtype: what a gradient is taken of."""
    return is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def split_static(args: tuple, nums: tuple[int, ...], keep=is_floating_array):
    """``(args', restore)``: ``args`` with each argument in ``nums`` reduced to its leaves that ``keep``
    accepts (None in place of the others, which vanish from its pytree), and ``restore(args')`` putting
    the others back; ``restore`` is the identity when no leaf was taken out."""
    parts = {}
    for i in nums:
        if i < len(args):
            leaves, treedef = jax.tree.flatten(args[i])
            mask = [keep(x) for x in leaves]
            if not all(mask):
                parts[i] = (leaves, treedef, mask)
    if not parts:
        return args, lambda a: a
    reduced = list(args)
    for i, (leaves, treedef, mask) in parts.items():
        reduced[i] = jax.tree.unflatten(treedef, [x if m else None for x, m in zip(leaves, mask)])

    def restore(a):
        full = list(a)
        for i, (leaves, treedef, mask) in parts.items():
            kept = iter(jax.tree.leaves(a[i]))
            full[i] = jax.tree.unflatten(treedef, [next(kept) if m else x for x, m in zip(leaves, mask)])
        return tuple(full)

    return tuple(reduced), restore


def eval_shape(fn, *args, **kwargs):
    """``jax.eval_shape(fn, *args, **kwargs)`` with the leaves that are not arrays (an Equinox module's
    functions) passed to ``fn`` as they are, as ``eqx.filter_eval_shape`` does."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    mask = [is_array(x) for x in leaves]

    def call(*xs):
        it = iter(xs)
        a, k = jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, mask)])
        return fn(*a, **k)

    return jax.eval_shape(call, *(x for x, m in zip(leaves, mask) if m))


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
    ``apply_if_finite``, a gradient transformation with another meaning. ``params`` may be a whole
    model (an Equinox module): its leaves that are not arrays pass through, and a leaf whose update is
    None (as ``eqx.filter_grad`` and ``mp.value_and_grad`` give leaves not differentiated) is kept.
    """
    import optax

    (arrays,), restore = split_static((params,), (0,), keep=is_array)
    plain = arrays is params  # nothing to pass through

    def apply(p, u):
        return p if u is None else optax.apply_updates(p, u)

    def step(operands):
        grads, opt_state, params = operands
        updates, opt_state = optimizer.update(grads, opt_state, params)
        if plain:
            return optax.apply_updates(params, updates), opt_state
        return jax.tree.map(apply, params, updates, is_leaf=lambda x: x is None), opt_state

    new, opt_state = lax.cond(finite, step, lambda operands: (operands[2], operands[1]),
                              (grads, opt_state, arrays))  # fmt: skip
    return restore((new,))[0], opt_state


def all_finite(tree):
    """One fused reduction: True when every floating leaf of ``tree`` is finite."""
    flags = [jnp.isfinite(g).all() for g in jax.tree.leaves(tree) if jnp.issubdtype(g.dtype, jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.asarray(True)
