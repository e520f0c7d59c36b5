"""``low_precision``: an optax transformation over bf16 / fp16 parameters and low-precision moments.

    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    tx = polyamp.jax.low_precision(optax.adamw(1e-3), update="sr", states="int8")
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)       # params are required
    params = optax.apply_updates(params, updates)           # optax's own apply: exact, see below

``inner`` (any ``optax.GradientTransformation``) updates float32 copies of the parameters (plus the Kahan
buffer), of the gradients and of its decoded state; the result ``y`` is rounded onto the parameters'
dtype by ``polyamp.training_state``'s rule (``sr``: the stream of ``polyamp.quantize``, seed
``seed + step * n + i``, bit-identical to torch's ``LowPrecisionOptimizer``). The returned updates are
float32 ``w_new - w``: both are 16-bit values, so the difference is exact in float32 and
``optax.apply_updates`` (``(w + u).astype(w.dtype)``) lands on ``w_new`` exactly. Floating leaves of
``inner``'s state that are not scalars are stored in the ``states`` form (``numerics.state_codes``);
second moments (``nu``) take the unsigned 8-bit table. Everything traces: it runs under ``jax.jit``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import training_state as ts
from ..errors import PolyampError
from ..numerics import state_codes
from ..numerics.formats import get_format
from ..numerics.grid import Grid
from . import xp
from .quantize import _STOCHASTIC, _quantize
from .recipe_state import seed_key


@jax.tree_util.register_pytree_node_class
class Stored:
    """A moment in a low form: its arrays, and (static) its shape, form and table."""

    def __init__(self, arrays: dict, shape: tuple[int, ...], form: str, signed: bool):
        self.arrays, self.shape, self.form, self.signed = arrays, shape, form, signed

    def tree_flatten(self):
        return (self.arrays,), (self.shape, self.form, self.signed)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def decode(self):
        return state_codes.decode(xp, self.arrays, self.form, self.shape, self.signed)


class LowPrecisionState(NamedTuple):
    inner: Any  # the inner transformation's state, moments as Stored
    steps: jax.Array  # uint32: steps taken (the stochastic-rounding seeds)
    compensation: Any  # Kahan buffers (the parameters' dtype), else None


def low_precision(inner, update: str = "nearest", states: str | None = None, seed: int = 0):
    """``inner`` with ``update`` rounding of 16-bit parameters and its state stored as ``states`` (None: in
    the parameters' dtype, as optax keeps it with ``mu_dtype`` unset); see the module docstring."""
    import optax

    if not isinstance(inner, optax.GradientTransformation):
        raise PolyampError(f"low_precision wraps an optax.GradientTransformation, got {type(inner).__name__}")
    update = ts.check_update(update)
    form = None if states is None else state_codes.check_form(states)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 32:
        raise PolyampError(f"seed must be an int in [0, 2^32), got {seed!r}")

    def check(params) -> None:
        if params is None:
            raise PolyampError("polyamp.jax.low_precision needs the parameters: "
                               "tx.update(grads, state, params)")
        if update != "nearest":
            wide = [p.dtype for p in jax.tree.leaves(params) if p.dtype not in (jnp.bfloat16, jnp.float16)]
            if wide:
                raise PolyampError(f"update={update!r} rounds 16-bit parameters, but {len(wide)} leaf(s) are "
                                   f"{wide[0]}: cast them (jax.tree.map(lambda p: p.astype(jnp.bfloat16), "
                                   "params)) or use update='nearest'")  # fmt: skip

    def store(tree, params):
        dtypes = {p.dtype for p in jax.tree.leaves(params)}
        keep = next(iter(dtypes)) if len(dtypes) == 1 else jnp.float32

        def one(path, v):
            if not (hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating) and v.ndim):
                return v
            if form is None:
                return v.astype(keep)
            signed = not any(getattr(k, "name", None) in ts.UNSIGNED_STATES for k in path)
            return Stored(state_codes.encode(xp, v.astype(jnp.float32), form, signed), v.shape, form, signed)

        return jax.tree_util.tree_map_with_path(one, tree)

    def load(tree):
        def one(v):
            if isinstance(v, Stored):
                return v.decode()
            if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.floating) and v.ndim:
                return v.astype(jnp.float32)
            return v

        return jax.tree.map(one, tree, is_leaf=lambda v: isinstance(v, Stored))

    def init(params):
        check(params)
        f32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
        comp = jax.tree.map(jnp.zeros_like, params) if update == "kahan" else None
        return LowPrecisionState(store(inner.init(f32), params), jnp.zeros((), jnp.uint32), comp)

    def update_fn(grads, state, params=None):
        check(params)
        leaves, treedef = jax.tree.flatten(params)
        w32 = [p.astype(jnp.float32) for p in leaves]
        if update == "kahan":
            w32 = [w + c.astype(jnp.float32) for w, c in zip(w32, jax.tree.leaves(state.compensation))]
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        p32 = jax.tree.unflatten(treedef, w32)
        steps32, inner_state = inner.update(g32, load(state.inner), p32)
        y = [w + u for w, u in zip(w32, jax.tree.leaves(steps32))]
        new = [_round(v, p.dtype, update, state.steps * np.uint32(len(leaves)), seed + i)
               for i, (v, p) in enumerate(zip(y, leaves))]  # fmt: skip
        updates = [n.astype(jnp.float32) - p.astype(jnp.float32) for n, p in zip(new, leaves)]
        comp = None
        if update == "kahan":
            comp = jax.tree.unflatten(treedef, [(v - n.astype(jnp.float32)).astype(n.dtype)
                                                for v, n in zip(y, new)])  # fmt: skip
        out = LowPrecisionState(store(inner_state, params), state.steps + np.uint32(1), comp)
        return jax.tree.unflatten(treedef, updates), out

    return optax.GradientTransformation(init, update_fn)


def _round(y, dtype, update: str, calls, position: int):
    """float32 ``y`` onto ``dtype``: stochastically from the seed ``calls + position``, else to nearest."""
    if update != "sr" or dtype == jnp.float32:
        return y.astype(dtype)
    grid = Grid.of(get_format("bf16" if dtype == jnp.bfloat16 else "fp16"), False).arrays()
    return _quantize(y, seed_key(calls, position), grid, mode=_STOCHASTIC, dtype="float32").astype(dtype)
