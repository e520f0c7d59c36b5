"""XLA CPU layout passes for autocast's bfloat16 matmuls (used by ``autocast.py``).

XLA CPU multiplies bfloat16 x bfloat16 -> float32 natively only in some operand layouts and
converts both operands to float32 in the others; these passes keep the matmuls that autocast
emits in the native layouts. They change how a dot is laid out, never its value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore


def fold_transposed_dots(jaxpr):
    """``transpose(dot_general(a, b))`` that only swaps the two operands' free dimensions, as JAX's
    own dot transposes emit, becomes ``dot_general(b, a)``: XLA CPU folds the transpose into the
    dot's layout and then cannot run some bf16 x bf16 = f32 dots (``Unsupported element type for
    DotThunk``). Returns ({id(dot eqn): swapped eqn}, {id(transpose eqn)})."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jcore.Literal):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            uses[v] = uses.get(v, 0) + 2
    producer = {eqn.outvars[0]: eqn for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"}
    swapped, skip = {}, set()
    for eqn in jaxpr.eqns:
        dot = producer.get(eqn.invars[0]) if eqn.primitive.name == "transpose" else None
        if dot is None or uses.get(eqn.invars[0]) != 1:
            continue
        (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
        lhs, rhs = (v.aval.ndim for v in dot.invars)
        nb, nl, nr = len(lb), lhs - len(lc) - len(lb), rhs - len(rc) - len(rb)
        block_swap = (*range(nb), *range(nb + nl, nb + nl + nr), *range(nb, nb + nl))
        if tuple(eqn.params["permutation"]) != block_swap:
            continue
        params = {**dot.params, "dimension_numbers": ((rc, lc), (rb, lb))}
        swapped[id(dot)] = dot.replace(invars=dot.invars[::-1], outvars=eqn.outvars, params=params)
        skip.add(id(eqn))
    return swapped, skip


def bind_allowed(eqn, invals, params, compute, bind) -> list:
    """``bind(eqn, invals, params)`` for an ``allow`` primitive on compute-dtype operands.

    On XLA CPU a bfloat16 ``dot_general`` runs natively (bf16 x bf16, float32 accumulation) only
    when its left operand is laid out (batch, free, contracting); in any other order XLA converts
    both operands to float32 and runs a float32 dot. The weight gradient ``x^T @ dy`` of every
    dense layer is such a dot, so here the left operand is first transposed into that order."""
    if not (eqn.primitive.name == "dot_general" and compute == jnp.bfloat16
            and jax.default_backend() == "cpu"):
        return bind(eqn, invals, params)
    lhs, rhs = invals
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    free = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    order = (*lb, *free, *lc)
    if order == tuple(range(lhs.ndim)):
        return bind(eqn, invals, params)
    # through a leading unit dimension: XLA's transpose folding would otherwise fold a plain
    # transpose back into the dot's dimension numbers, leaving the dot as it was
    lhs = lax.squeeze(lax.transpose(lax.expand_dims(lhs, (0,)), (0, *(d + 1 for d in order))), (0,))
    nb, nf = len(lb), len(free)
    numbers = ((tuple(range(nb + nf, lhs.ndim)), rc), (tuple(range(nb)), rb))
    out = bind(eqn, [lhs, rhs], {**params, "dimension_numbers": numbers})
    # a transpose of the result, if one follows, must stay a copy: folded into this dot, it would
    # make XLA swap the operands into a layout it cannot run in bf16 ("Unsupported element type")
    return lax.optimization_barrier(out)
