"""Keras ``EinsumDense`` (``MultiHeadAttention``'s query / key / value / output projections) as one GEMM
``x2d @ W2d``, so that a recipe quantizes it as it quantizes a Dense layer (``recipe.linear``).

An equation ``x,w->y`` (``"abc,cde->abde"``, ``"abcd,cde->abe"``, ``"...b,bc->...c"``) is a GEMM when each
axis letter is one of: a contracted axis (in ``x`` and ``w``, not in ``y``: K), a free axis of ``x`` (in
``x`` and ``y``: M), a free axis of the kernel (in ``w`` and ``y``: N), each letter once per operand. Then

    x2d = reshape(transpose(x, free_x + contracted), [-1, K])     blocks along K, as Dense's input
    W2d = reshape(transpose(W, contracted + free_w), [K, N])      K in the kernel's order of its letters
    y   = transpose(reshape(x2d @ W2d, x's free dims + w's free dims), y's order)

(transposes left out where they are the identity). ``...`` stands for the free axes of ``x`` it covers
(it must be in ``x`` and ``y``, not in the kernel). What is not a GEMM (an axis in all three operands:
a batch over the kernel; an axis summed within one operand; a repeated letter; no contracted axis) is
not quantized: ``gemm_plan`` says why, and the recipe records it as unsupported.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import tensorflow as tf


class EinsumGemm(NamedTuple):
    """How an EinsumDense equation is the GEMM ``x2d @ W2d`` (module docstring), for one input rank."""

    x_perm: tuple[int, ...] | None  # None: x already (free..., contracted...)
    n_free_x: int
    w_perm: tuple[int, ...] | None
    k_dims: int  # how many kernel axes are contracted (its leading ones after w_perm)
    out_perm: tuple[int, ...] | None


def _split(equation: str) -> tuple[str, str, str]:
    inputs, _, out = equation.replace(" ", "").partition("->")
    x, _, w = inputs.partition(",")
    return x, w, out


def gemm_plan(equation: str, rank: int | None = None) -> EinsumGemm | str:
    """The plan of ``equation`` for an input of ``rank`` axes (None: the ellipsis as one axis), or why it
    is not a GEMM (a string)."""
    x, w, out = _split(equation)
    if "..." in w or ("..." in x) != ("..." in out):
        return f"equation {equation!r}: an ellipsis must be in the input and the output, not the kernel"
    if "..." in x:
        fill = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in x + w + out]
        n = 1 if rank is None else rank - (len(x) - 3)
        x, out = x.replace("...", "".join(fill[:n])), out.replace("...", "".join(fill[:n]))
    if any(len(set(s)) != len(s) for s in (x, w, out)):
        return f"equation {equation!r}: a letter repeats within one operand (a diagonal)"
    if set(x) & set(w) & set(out):
        return f"equation {equation!r}: an axis in the input, the kernel and the output (a batched product)"
    if set(x) - set(w) - set(out) or set(w) - set(x) - set(out):
        return f"equation {equation!r}: an axis summed within one operand"
    contracted = [c for c in w if c in x and c not in out]
    if not contracted:
        return f"equation {equation!r}: no contracted axis (an outer product)"
    free_x = [c for c in x if c in out]
    free_w = [c for c in w if c not in x]
    x_perm = tuple(x.index(c) for c in free_x + contracted)
    w_perm = tuple(w.index(c) for c in contracted + free_w)
    out_perm = tuple((free_x + free_w).index(c) for c in out)
    return EinsumGemm(_or_none(x_perm), len(free_x), _or_none(w_perm), len(contracted), _or_none(out_perm))


def _or_none(perm: tuple[int, ...]) -> tuple[int, ...] | None:
    return None if perm == tuple(range(len(perm))) else perm


def einsum_gemm(plan: EinsumGemm, matmul, x, kernel):
    """``einsum(equation, x, kernel)`` as ``matmul(x[..., K], W2d)`` (``recipe.linear``) by ``plan``."""
    if plan.x_perm is not None:
        x = tf.transpose(x, plan.x_perm)
    if plan.w_perm is not None:
        kernel = tf.transpose(kernel, plan.w_perm)
    k_shape, n_shape = kernel.shape[: plan.k_dims], kernel.shape[plan.k_dims :]
    k, n = math.prod(k_shape), math.prod(n_shape)
    free = tf.shape(x)[: plan.n_free_x]
    x = tf.reshape(x, tf.concat([free, [k]], 0))
    y = matmul(x, tf.reshape(kernel, [k, n]))
    y = tf.reshape(y, tf.concat([free, list(n_shape)], 0))
    return y if plan.out_perm is None else tf.transpose(y, plan.out_perm)


def bias_and_activation(layer, x):
    """``x`` plus the layer's bias, through its activation, as Dense and EinsumDense finish ``call``."""
    if layer.bias is not None:
        x = keras.ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def einsum_call(layer, matmul):
    """EinsumDense's ``call`` with its einsum as ``matmul`` of the float32 kernel (read outside Keras's
    autocast), bias and activation as Keras adds them."""
    plans: dict[int, EinsumGemm] = {}

    def call(inputs, training=None):
        rank = inputs.shape.rank
        if rank not in plans:
            plan = gemm_plan(layer.equation, rank)
            if isinstance(plan, str):  # the equation was checked at mp.watch; a rank it cannot take
                raise ValueError(plan)
            plans[rank] = plan
        with keras.src.backend.AutocastScope(None):
            kernel = tf.convert_to_tensor(layer.kernel)
        return bias_and_activation(layer, einsum_gemm(plans[rank], matmul, inputs, kernel))

    return call
