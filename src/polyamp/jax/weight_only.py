"""Weight-only inference in JAX: the kernels of a parameter tree stored in a low form.

    low, record = polyamp.jax.quantize_weights(params, "int8")        # or "bf16", "fp8", "nvfp4", ...
    y = jax.jit(lambda low, x: model.apply({"params": polyamp.jax.dequantize_weights(low)}, x))(low, x)

Every floating leaf of 2 or more axes (kernels, embedding tables) not under a path named in ``keep``
becomes a ``LowWeight`` (a pytree node holding ``polyamp.weight_forms``' arrays), encoded along ``axis``,
the input axis (-2: flax's ``(in, out)`` and ``(h, w, in, out)`` kernels). ``dequantize_weights`` decodes
them in JAX ops, so under ``jit`` each weight is decoded where the model uses it. 1-D leaves (biases,
norm scales) stay as they are. The stored tree is the export: ``jax.tree.leaves`` are its arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import weight_forms
from ..errors import PolyampError
from ..weight_forms import WeightOnlyRecord
from . import xp


@jax.tree_util.register_pytree_node_class
class LowWeight:
    """One weight in ``form``: its arrays, and (static) its shape, input axis and original dtype."""

    def __init__(self, arrays: dict, form: str, shape: tuple[int, ...], axis: int, dtype: str):
        self.arrays, self.form, self.shape, self.axis, self.dtype = arrays, form, shape, axis, dtype

    def tree_flatten(self):
        return (self.arrays,), (self.form, self.shape, self.axis, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def value(self, dtype=None):
        w = weight_forms.decode(xp, self.arrays, self.form, self.shape, self.axis)
        return w.astype(dtype or self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


def quantize_weights(params, form: str, keep=(), axis: int = -2):
    """``(tree, record)``: ``params`` with its kernels stored in ``form`` (module docstring)."""
    form = weight_forms.check_form(form)
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    record = WeightOnlyRecord(form)

    def one(path, leaf):
        name = jax.tree_util.keystr(path)
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        record.bytes_before += int(leaf.nbytes)
        why = ("under a path named in keep" if any(k in name for k in keep) else
               f"{leaf.ndim}-D: biases and norm scales stay" if leaf.ndim < 2 else None)  # fmt: skip
        if why is not None:
            record.kept[name] = why
            record.bytes_after += int(leaf.nbytes)
            return leaf
        stored = weight_forms.encode(np.asarray(jnp.asarray(leaf, jnp.float32)), form, axis)
        low = LowWeight({k: jnp.asarray(v) for k, v in stored.items()}, form, tuple(leaf.shape),
                        axis % leaf.ndim, str(leaf.dtype))  # fmt: skip
        record.quantized[name] = form
        record.bytes_after += low.nbytes
        return low

    tree = jax.tree_util.tree_map_with_path(one, params)
    if not record.quantized:
        raise PolyampError(f"quantize_weights found no floating leaf of 2 or more axes to store in {form!r} "
                           f"(kept: {record.kept or 'no floating leaf'})")  # fmt: skip
    return tree, record


def dequantize_weights(tree, dtype=None):
    """``tree`` with every ``LowWeight`` decoded (to ``dtype``, else its original dtype)."""
    return jax.tree.map(lambda v: v.value(dtype) if isinstance(v, LowWeight) else v, tree,
                        is_leaf=lambda v: isinstance(v, LowWeight))  # fmt: skip
