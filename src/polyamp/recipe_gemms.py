"""The recipes' three-GEMM operand rule, framework-neutral: which operand of each GEMM is quantized how.

A matmul or convolution under a recipe (``recipes.py``) runs three GEMMs, as TransformerEngine does::

    forward        y  = Qf(x)  . Qf(W)
    input grad     dx = Qb(g)  . Qf'(W)
    weight grad    dW = Qb'(g) . Qf'(x)      (contracting the rows M, or a convolution's batch)

A GEMM the recipe leaves unquantized (``quantize_forward`` / ``_input_grad`` / ``_weight_grad``) takes its
operands as they are. Per-tensor recipes (tensorwise, delayed) quantize each tensor once, with one scale:
``g`` once (in its input-gradient layout) for both backward GEMMs, and ``Qf' = Qf``, the forward's own
quantized ``x`` and ``W``. Block recipes quantize each operand for each GEMM, blocked along a dimension
that GEMM sums over: ``g`` again for the weight gradient, ``W`` again for the input gradient unless
NVFP4's 16x16 weight blocks serve both GEMMs (``weight_2d``: ``Qf'(W) = Qf(W)``), and ``x`` again for the
weight gradient; with ``hadamard`` (NVFP4's random Hadamard transform) the weight-gradient ``g`` and
``x`` are multiplied by ``H`` in tiles of 16 along M first.

A front end supplies its vocabulary as callables: ``quantize(t, operand, gemm)``, its quantize-dequantize
of ``t`` as the recipe's ``operand`` (``"input"``, ``"weight"``, ``"grad"``) blocked along ``gemm``'s
contraction axis in its own layout (``gemm``: ``"forward"``, ``"input_grad"``, ``"weight_grad"``),
``hadamard(t, operand)``, and the GEMMs themselves, which it runs on the operands returned here.

The quantize calls come in one order, from which stateful quantizers draw stochastic-rounding seeds (a
call counter) and delayed scales: ``x``, ``W`` forward; then per-tensor ``g`` once, or block ``g`` and
``W`` (unless 16x16) for the input gradient, then the weight gradient's ``g``, ``x`` (or ``x``, ``g``:
``weight_grad_first="input"``, TensorFlow's order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FORWARD, INPUT_GRAD, WEIGHT_GRAD = "forward", "input_grad", "weight_grad"
Quantize = Callable[[Any, str, str], Any]

# a convolution operand's blocked dimension in each implicit GEMM: one that GEMM sums over
CONV_BLOCKED = {(FORWARD, "input"): "channels", (FORWARD, "weight"): "in_channels",
                (INPUT_GRAD, "grad"): "channels", (INPUT_GRAD, "weight"): "out_channels",
                (WEIGHT_GRAD, "input"): "batch", (WEIGHT_GRAD, "grad"): "batch"}  # fmt: skip


def forward_operands(recipe, quantize: Quantize, x, w) -> tuple[Any, Any]:
    """``(Qf(x), Qf(W))``, or ``(x, W)`` when the forward GEMM is unquantized."""
    if not recipe.quantize_forward:
        return x, w
    return quantize(x, "input", FORWARD), quantize(w, "weight", FORWARD)


def backward_operands(recipe, quantize: Quantize, g, x, w, xq, wq, *, hadamard: Callable[[Any, str], Any],
                      transpose: Callable[[Any], Any] | None = None, want: tuple[bool, bool] = (True, True),
                      weight_grad_first: str = "grad") -> tuple[tuple[Any, Any] | None, ...]:  # fmt: skip
    """``((Qb(g), Qf'(W)), (Qb'(g), Qf'(x)))``: the input-gradient and weight-gradient GEMMs' operands
    (module docstring), each pair None where ``want`` (dx, dW) says that gradient is not wanted.

    ``g``, ``x``, ``w``: the output gradient and the forward's operands in the front end's GEMM layouts;
    ``xq``, ``wq``: what :func:`forward_operands` returned for them. ``transpose``: how the
    weight-gradient GEMM lays out ``g`` and ``x`` (applied to them, and to the per-tensor ``Qb(g)`` and
    ``xq``, before the Hadamard transform and the quantize calls; default: as they are).
    ``weight_grad_first``: the operand the weight gradient quantizes first, ``"grad"`` or ``"input"``.
    """
    block = recipe.kind == "block"
    wanted = (want[0] and recipe.quantize_input_grad, want[1] and recipe.quantize_weight_grad)
    once = quantize(g, "grad", INPUT_GRAD) if any(wanted) and not block else None  # one cast, one scale
    dgrad = wgrad = None
    if want[0]:
        dgrad = g, w
        if wanted[0]:
            g_op = quantize(g, "grad", INPUT_GRAD) if block else once
            w_op = quantize(w, "weight", INPUT_GRAD) if block and not recipe.weight_2d else wq
            dgrad = g_op, w_op
    if want[1]:
        t = transpose or _same
        wgrad = t(g), t(x)
        if wanted[1] and not block:
            wgrad = t(once), t(xq)
        elif wanted[1]:
            ops = {"grad": t(g), "input": t(x)}
            order = ("grad", "input") if weight_grad_first == "grad" else ("input", "grad")
            if recipe.hadamard:
                ops = {name: hadamard(ops[name], name) for name in order}
            ops = {name: quantize(ops[name], name, WEIGHT_GRAD) for name in order}
            wgrad = ops["grad"], ops["input"]
    return dgrad, wgrad


def _same(t):
    return t
