"""What MXNet's recipe layers share (``recipe.py``'s Dense, ``recipe_conv.py``'s convolutions, the
hybridized graph's custom operator in ``recipe_graph.py``): the operand quantizer with its state, the
casts to the compute dtype, and putting a block's own forward back."""

from __future__ import annotations

import warnings

from ..errors import UnsupportedError
from ..quantizer_state import QuantizerState
from . import xp
from .keep import dtype_name
from .quantize import amax, quantize_tensorwise

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet.contrib import amp

SEVERAL_CONTEXTS = (
    "fp8-delayed keeps one amax history per layer, and the net runs on several contexts ({}): each "
    "device's copy of a layer would update it in turn. Train delayed scaling on one context, or use "
    "fp8-tensorwise (each call scales by its own amax)"
)


class Quantizer(QuantizerState):
    """The recipe's quantize-dequantize of one GEMM operand, with the state it keeps: ``QuantizerState``'s
    rule over MXNet's ops (``quantize.py``), delayed scaling on one context."""

    ops = xp
    _amax = staticmethod(amax)
    _quantize_tensorwise = staticmethod(quantize_tensorwise)

    def __init__(self, recipe):
        super().__init__(recipe)
        self.context = None  # delayed scaling: the one context its calls run on

    def __call__(self, x, layer: str, operand: str, axis: int = -1):
        """``x`` (an NDArray) quantized and dequantized as the recipe's ``operand`` ("input", "weight",
        "grad"), blocked along ``axis``; a float32 NDArray."""
        if self.recipe.kind == "delayed":
            self.context = self.context or str(x.context)
            if str(x.context) != self.context:
                raise UnsupportedError(SEVERAL_CONTEXTS.format(f"{self.context} and {x.context}"))
        return super().__call__(x, layer, operand, axis)


def cast(x, compute: str):
    """``x`` (an NDArray) in the compute dtype."""
    return like(x.as_nd_ndarray(), "bfloat16" if compute == "bf16" else "float32")


def like(x, dtype: str):
    """An NDArray in ``dtype`` (the input's or parameter's)."""
    have = dtype_name(x.dtype)
    if have == dtype:
        return x
    if have == "float64":
        x, have = x.astype("float32"), "float32"
    if "bfloat16" in (have, dtype) or "float16" in (have, dtype):
        return mx.nd.amp_cast(x, dtype=amp.amp.bfloat16 if dtype == "bfloat16" else dtype)
    return x.astype(dtype)


def restore_forward(block, own) -> None:
    """Put back the ``hybrid_forward`` a recipe replaced (``own``: an instance attribute, or None)."""
    if own is None:
        vars(block).pop("hybrid_forward", None)
    else:
        vars(block)["hybrid_forward"] = own
