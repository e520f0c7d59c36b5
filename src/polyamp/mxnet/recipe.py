"""Emulated low-precision training in MXNet Gluon: ``polyamp.recipes`` applied to ``nn.Dense`` (and, through
``recipe_conv.py``, to ``nn.Conv1D`` / ``Conv2D`` / ``Conv3D``).

After ``mp.watch(net)`` of a ``MixedPrecision`` made from a recipe (``"fp8-tensorwise"``,
``"fp8-delayed"``, ``"mxfp8"``, ``"nvfp4"``), each ``gluon.nn.Dense`` of the net that the keep list
leaves in runs its FullyConnected as three quantized GEMMs (an ``mx.autograd.Function``), as
``polyamp/recipe_gemms.py`` states them (the rule, written once):

    forward        y  = Qf(x) @ Qf(W)^T (+ b)
    input grad     dx = Qb(g) @ Qf'(W)
    weight grad    dW = Qb'(g^T) @ Qf'(x^T)^T

``Qf`` / ``Qb`` quantize-dequantize to the recipe's forward / backward format; ``Qf'`` / ``Qb'`` are the
transposed tensors blocked along their last axis for block formats (the other GEMM axis), and the
forward casts themselves for per-tensor scaling and NVFP4's 16x16 weight blocks; with ``hadamard=True``
``g^T`` and ``x^T`` are first multiplied by NVFP4's random Hadamard matrix in tiles of 16 along M
(``polyamp.numerics.hadamard``). A GEMM the recipe
leaves unquantized takes its operands as they are. The products are FullyConnected on operands cast
to the compute dtype: bfloat16 (MXNet's CPU FullyConnected computes in bf16 through oneDNN and returns
bf16, as torch's bf16 matmul does) or float32; they call MXNet's own operator, which contrib.amp does
not cast. The rest of the net computes as bf16-mixed (contrib.amp, process-wide); the Dense layers
in the keep list (by default the first and last) do too. ``Dense(flatten=True)`` flattens the input
to 2-D first, ``flatten=False`` multiplies along its last axis.

A hybridized net runs a cached graph of symbols, which an ``autograd.Function`` cannot enter: a Dense
traced into one emits ``recipe_graph.py``'s custom operator, which calls the same ``QuantizedDense``
(``mp.watch`` clears the cached graphs, so they are traced again). MXNet 1.9's ``autograd.Function``
shapes the rest: its backward stops writing gradients at the first input that takes none, so the
inputs are ``(weight, bias, x)`` (the net's data, which takes none, last) and a Dense with a frozen
parameter is left unquantized (``unsupported`` in ``mp.recipe_layers``); ``x`` enters as float32
(under contrib.amp a bfloat16 input's gradient buffer is filled wrongly), and the backward transposes
float32 copies (transposing a bfloat16 NDArray corrupts the heap). With ``fp8-delayed`` the net runs on
one context (one history per layer, not per device).

Quantization is ``recipe_operands.Quantizer``, bit-identical to the numpy core: tensorwise with the
scale ``current_scale(amax)``; delayed with the scale of the layer's ``DelayedScaling`` for that
operand, updated with this call's amax after the cast (TE's order; the histories and the
stochastic-rounding counter are in ``mp.state_dict()``); blocks with ``quantize_blocks``, stochastic
rounding seeded by a counter of calls.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings

import numpy as np

from ..errors import PolyampError, UnsupportedError
from ..numerics.hadamard import hadamard_tiles
from ..recipe_gemms import INPUT_GRAD, backward_operands, forward_operands
from ..recipe_layers import RecipeLayers
from ..recipes import recipe_spec
from . import recipe_graph as graph
from .keep import _ORIGINAL_OPS, blocks, dtype_name
from .recipe_conv import RecipeConv, conv_unsupported, is_conv
from .recipe_operands import SEVERAL_CONTEXTS, Quantizer, cast, like, restore_forward

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import gluon


# MXNet's own FullyConnected: contrib.amp's would cast the operands to its dtype
_FC = (_ORIGINAL_OPS or {}).get("mxnet.ndarray", {}).get("FullyConnected", mx.nd.FullyConnected)


def _gemm(a, b_t, compute: str, bias=None):
    """``a @ b_t^T (+ bias)``: MXNet's own FullyConnected (not contrib.amp's) in the compute dtype; an
    NDArray of that dtype."""
    args = (cast(a, compute), cast(b_t, compute)) + (() if bias is None else (cast(bias, compute),))
    return _FC(*args, no_bias=bias is None, num_hidden=b_t.shape[0], flatten=True)


class QuantizedDense(mx.autograd.Function):
    """FullyConnected of a 2-D ``x`` with the recipe's three quantized GEMMs (module docstring)."""

    def __init__(self, quantizer: Quantizer, layer: str, compute: str):
        super().__init__()
        self.quantizer, self.layer, self.compute = quantizer, layer, compute

    def forward(self, weight, *rest):
        bias, x = rest if len(rest) == 2 else (None, rest[0])
        quantize = _linear_operand(self.quantizer, self.layer)
        xq, wq = forward_operands(self.quantizer.recipe, quantize, x, weight)
        self.save_for_backward(x, weight, xq, wq)
        self.dtypes = (dtype_name(x.dtype), dtype_name(weight.dtype), bias is not None)
        return _gemm(xq, wq, self.compute, bias)

    def backward(self, grad):
        x, weight, xq, wq = self.saved_tensors
        x_dtype, w_dtype, has_bias = self.dtypes
        # float32 (exact for bf16): MXNet 1.9's transpose of a bfloat16 NDArray corrupts the heap
        grad, x = like(grad, "float32"), like(x, "float32")
        quantize = _linear_operand(self.quantizer, self.layer)
        dgrad, wgrad = backward_operands(self.quantizer.recipe, quantize, grad, x, weight, xq, wq,
                                         hadamard=_hadamard, transpose=_transposed)  # fmt: skip
        dx = _gemm(dgrad[0], dgrad[1].T, self.compute)
        dw = _gemm(*wgrad, self.compute)  # dW = g^T x, its operands g^T and x^T
        out = [like(dw, w_dtype)]
        if has_bias:
            out.append(like(mx.nd.sum(grad, axis=0), w_dtype))
        return (*out, like(dx, x_dtype))


def _linear_operand(quantizer: Quantizer, layer: str):
    """``recipe_gemms``' quantize for FullyConnected's layouts (x [M, K], W [N, K], g [M, N], the weight
    gradient's g^T and x^T): each operand blocked along its last axis; the input gradient's W as W^T,
    the same blocks as the forward's."""

    def quantize(t, operand: str, gemm: str):
        if operand == "weight" and gemm == INPUT_GRAD:
            return quantizer(t.T, layer, operand).T
        return quantizer(t, layer, operand)

    return quantize


def _transposed(t):
    return t.T


def _hadamard(t, _operand: str):
    """NVFP4's RHT of g^T or x^T: tiles of 16 along M, their last axis."""
    return hadamard_tiles(t)


class RecipeDense:
    """One watched ``nn.Dense``: its ``hybrid_forward`` replaced (an instance attribute shadowing the
    class's method) by the quantized GEMMs; ``remove()`` puts the previous one back."""

    def __init__(self, name: str, block, quantizer: Quantizer, compute: str):
        self.name, self.block = name, block
        self._own = vars(block).get("hybrid_forward")
        original = getattr(self._own, "recipe_of", None)  # another recipe's forward: replace it
        if original is not None:
            self._own = original

        units, flatten = block._units, block._flatten

        def shapes(x_shape):  # weight, bias, output
            inputs = int(np.prod(x_shape[1:])) if flatten else x_shape[-1]
            return (units, inputs), (units,), (x_shape[0], units) if flatten else x_shape[:-1] + (units,)

        make = functools.partial(QuantizedDense, quantizer, name, compute)
        self.key = graph.register(graph.Layer(make, shapes, compute, dense=(flatten, units)))

        def hybrid_forward(F, x, weight, bias=None):
            if F is not mx.nd:  # traced into a hybridized graph: the custom operator
                y = graph.custom(F, self.key, weight, bias, x)
                return y if block.act is None else block.act(y)
            lead = x.shape[:1] if block._flatten else x.shape[:-1]
            flat = x.ndim != 2  # reshape only when needed
            x2 = x.reshape((lead[0], -1) if block._flatten else (-1, weight.shape[1])) if flat else x
            x2 = like(x2, "float32")  # a float32 gradient buffer (MXNet copies a bf16 one wrongly under amp)
            y = QuantizedDense(quantizer, name, compute)(
                *((weight, x2) if bias is None else (weight, bias, x2))
            )
            y = y.reshape(lead + (weight.shape[0],)) if flat else y
            return y if block.act is None else block.act(y)

        hybrid_forward.recipe_of = self._own
        vars(block)["hybrid_forward"] = hybrid_forward

    def remove(self) -> None:
        graph.unregister(self.key)
        if getattr(vars(self.block).get("hybrid_forward"), "recipe_of", False) is self._own:
            self.restore(self.block, self._own)

    restore = staticmethod(restore_forward)


def clear_graphs(model) -> None:
    """Drop the cached graphs of ``model``'s hybridized blocks: their next call traces the forwards as
    they are now."""
    for _, block in blocks(model):
        if isinstance(block, gluon.HybridBlock):
            block._clear_cached_op()


def unwind(model) -> None:
    """Put back every Dense and Conv forward of ``model`` that a recipe (of any MixedPrecision) replaced."""
    clear_graphs(model)
    for _, block in blocks(model):
        previous = vars(block).get("hybrid_forward")
        if hasattr(previous, "recipe_of"):
            RecipeDense.restore(block, previous.recipe_of)


def _check_one_context(model) -> None:
    """UnsupportedError when the net's parameters live on several contexts: each device's copy of a layer
    would enter the layer's one amax history in turn, several updates a step (TE reduces the devices'
    amaxes into one)."""
    contexts = set()
    for p in model.collect_params().values():
        try:
            contexts.update(str(c) for c in p.list_ctx())
        except (RuntimeError, mx.MXNetError):  # not initialized yet (deferred): its context is unknown
            pass
    if len(contexts) > 1:
        raise UnsupportedError(SEVERAL_CONTEXTS.format(", ".join(sorted(contexts))))


def _unsupported_blocks() -> tuple:
    """(block types, why) of the Gluon matmul blocks a recipe leaves to contrib.amp."""
    nn, rnn = gluon.nn, gluon.rnn
    out = [((nn.Conv1DTranspose, nn.Conv2DTranspose, nn.Conv3DTranspose), "a transposed convolution"),
           ((rnn.RNN, rnn.LSTM, rnn.GRU), "the fused RNN operator computes its matmuls inside"),
           ((rnn.RNNCell, rnn.LSTMCell, rnn.GRUCell), "the cell calls FullyConnected itself, not a Dense")]
    cnn = getattr(getattr(gluon, "contrib", None), "cnn", None)
    deformable = tuple(getattr(cnn, n) for n in ("DeformableConvolution", "ModulatedDeformableConvolution")
                       if hasattr(cnn, n))  # fmt: skip
    return tuple(out) + (((deformable, "a deformable convolution"),) if deformable else ())


def unsupported(block) -> str | None:
    """Why a recipe cannot quantize this matmul block ("unsupported: <type>: <why>"); None when it can, or
    when the block is no matmul block."""
    kind = type(block).__name__
    if isinstance(block, gluon.nn.Dense) or is_conv(block):
        why = conv_unsupported(block) if is_conv(block) else None
        frozen = [p.name for p in block.collect_params().values() if p.grad_req == "null"]
        if why is None and frozen:
            why = (f"parameters without gradients ({', '.join(frozen)}, grad_req='null'): MXNet 1.9's "
                   "autograd.Function, which runs the recipe's GEMMs, stops writing gradients at the first "
                   "input that takes none")  # fmt: skip
        return None if why is None else f"unsupported: {kind}: {why}"
    for types, why in _unsupported_blocks():
        if isinstance(block, types):
            return f"unsupported: {kind}: {why}"
    return None


def matmul_blocks(model) -> list[tuple[str, object, str | None]]:
    """(path, block, None) of each block a recipe quantizes (``nn.Dense``, channels-first ``Conv1D`` /
    ``Conv2D`` / ``Conv3D`` with trainable parameters) and (path, block, "unsupported: <type>: <why>") of
    every other matmul block, depth-first in child-name order; paths as ``keep.blocks`` names them (the
    model itself by its class name)."""
    out = []
    for path, block in blocks(model):
        why = unsupported(block)
        if why is not None or isinstance(block, gluon.nn.Dense) or is_conv(block):
            out.append((path or type(block).__name__, block, why))
    return out


def watch(model, quantizer: Quantizer, compute: str, dry_run: bool = False) -> tuple[list, RecipeLayers]:
    """Quantize the blocks of ``model`` that ``matmul_blocks`` finds quantizable and the recipe's keep list
    leaves in: ``first`` / ``last`` are the first and last of them (Dense and Conv counted together), other
    entries ``fnmatch`` patterns over the block paths (``0``, ``body.1.dense``; a kept block keeps the
    blocks below it). Blocks kept in float32 by ``keep_fp32`` are left as they are. ``dry_run``: only
    check. Returns the RecipeDense / RecipeConv handles and the record of every matmul block (quantized,
    or kept with its reason) for ``mp.recipe_layers``."""
    if not isinstance(model, gluon.Block):
        raise PolyampError(
            f"expected a mxnet.gluon.Block, got {type(model).__module__}.{type(model).__name__}"
        )
    paths = [(p or type(b).__name__, b) for p, b in blocks(model)]
    found = matmul_blocks(model)
    layers = [(p, b) for p, b, why in found if why is None]
    if quantizer.recipe.kind == "delayed":
        _check_one_context(model)
    reasons: dict[str, str] = {}  # a kept block -> the first keep entry that keeps it
    for entry in quantizer.recipe.keep:
        if entry in ("first", "last"):
            if layers:
                reasons.setdefault(layers[0 if entry == "first" else -1][0], f"keep {entry!r}")
            continue
        hits = [p for p, _ in paths if fnmatch.fnmatchcase(p, entry)]
        if not hits:
            raise PolyampError(f"the recipe's keep entry {entry!r} matches no block of the net; its blocks: "
                               f"{', '.join(p for p, _ in paths[:20])}")  # fmt: skip
        for path, _ in layers:
            if any(path == k or path.startswith(k + ".") for k in hits):
                reasons.setdefault(path, f"keep {entry!r}")
    record = RecipeLayers(recipe_spec(quantizer.recipe))
    handles = []
    if not dry_run:
        clear_graphs(model)
        quantizer.context = None
    for path, block, why in found:
        kept_fp32 = getattr(vars(block).get("hybrid_forward"), "keeps", None)
        why = why or reasons.get(path) or (None if kept_fp32 is None else f"keep_fp32 {kept_fp32!r}")
        record.add(path, why)
        if why is None and not dry_run:
            handles.append((RecipeConv if is_conv(block) else RecipeDense)(path, block, quantizer, compute))
    return handles, record
