"""What a recipe quantizes in a traced loss, for the JAX doctor's recipe tables (``doctor.py``).

A recipe (``recipe.py``) quantizes the two operands of each dense matmul and convolution it can
(``recipe.eligible``) and the gradient of its output. The doctor observes weights as params leaves,
activations as the tapped outputs of the layer that produced them, and output gradients per layer; so
a recipe measures the leaves that are such a GEMM's operand, the tapped values that are one, and the
output gradients of the layers that hold one (kept layers too: ``keep`` is the user's choice to make
from these rows). A weight is measured in its GEMM's ``(N, K)`` layout, blocks along the reduction
axis ``K``, as the recipe blocks it: ``x @ W`` as ``W.T``, Equinox's ``W @ x`` as ``W``, an NNX
``LinearGeneral`` kernel flattened to 2-d; a convolution's kernel and a leaf that reaches its GEMM
through a cast, transpose or reshape are measured as ``blocks.gemm_layout`` lays out any kernel.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..doctor.blocks import gemm_layout
from .recipe import Dense, dense_form, eligible, weight_names

AS_KERNEL = "kernel"  # laid out by blocks.gemm_layout
AS_IS = "as-is"


class RecipeOperands:
    """Filled by :meth:`visit` during the doctor's abstract walk of the jaxpr (``doctor._analyse``):
    ``params`` (leaf index -> its layout: a ``recipe.Dense`` form, ``AS_KERNEL`` or ``AS_IS``),
    ``values`` (the ids of the walk's nodes that are a GEMM's operand) and ``layers`` (those that hold
    a GEMM)."""

    def __init__(self, jaxpr, floating: list[bool]):
        leaves = {v: i for i, (v, f) in enumerate(zip(jaxpr.invars, floating)) if f}
        self.weights = weight_names(jaxpr, leaves)  # every var that holds a leaf -> the leaf's index
        self.params: dict[int, object] = {}
        self.values: set[int] = set()
        self.layers: set[str] = set()

    def visit(self, eqn, invals, layer: str) -> None:
        """Note ``eqn``'s operands if it is a GEMM a recipe quantizes; ``invals`` are the walk's nodes
        (``param``: the leaf a node is, else None; ``id``: the value's number)."""
        if not eligible(eqn, self.weights):
            return
        form = dense_form(eqn, self.weights) if eqn.primitive.name == "dot_general" else None
        w = 1 if form is None else form.weight
        self.layers.add(layer)
        for k, (var, node) in enumerate(zip(eqn.invars[:2], invals[:2])):
            param = getattr(node, "param", None)
            if param is not None:
                self.params.setdefault(param, (form or AS_KERNEL) if k == w else AS_IS)
            elif var in self.weights:
                self.params.setdefault(self.weights[var], AS_KERNEL)
            elif getattr(node, "id", None) is not None:
                self.values.add(node.id)

    def how(self, source: str, i: int, order: list[int], taps: dict[int, str]):
        """How a recipe measures the tensor ``(source, i)`` of a doctor group (:func:`layout`), or None
        when it quantizes no such tensor; ``order``: the tapped values' ids, ``taps``: id -> layer."""
        if source in ("param", "grad"):
            return self.params.get(i)
        if source == "tap":
            return AS_IS if order[i] in self.values else None
        if source == "grad_tap":  # a GEMM layer's output gradient
            return AS_IS if taps[order[i]] in self.layers else None
        return None  # an update


def layout(t, how, kind: str):
    """``t`` (a weight leaf or its gradient when ``how`` is a ``Dense`` form or ``AS_KERNEL``) in the
    layout its GEMM quantizes it in."""
    if isinstance(how, Dense):
        t = jnp.transpose(t, how.order)
        k = math.prod(t.shape[: how.k])
        return t.reshape(k, -1).T
    return gemm_layout(t, kind) if how == AS_KERNEL else t
