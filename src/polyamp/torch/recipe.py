"""Emulated low-precision training in PyTorch: ``polyamp.recipes`` applied to ``F.linear``,
``F.convNd`` (``recipe_conv.py``) and transformers' ``Conv1D``.

Under ``mp.autocast()`` of a ``MixedPrecision`` made from a recipe (``"fp8-tensorwise"``,
``"fp8-delayed"``, ``"mxfp8"``, ``"nvfp4"``), each ``torch.nn.functional.linear`` call inside the
watched model (``nn.Linear``, and the functional calls of other modules) becomes three quantized GEMMs,
as TransformerEngine runs them:

    forward        y  = Qf(x) @ Qf(W)^T (+ b)
    input grad     dx = Qb(g) @ Qf'(W)
    weight grad    dW = Qb'(g^T) @ Qf'(x^T)^T

``Qf`` / ``Qb`` quantize-dequantize to the recipe's forward / backward format; ``Qf'`` / ``Qb'`` are the
same tensors blocked along the other GEMM dimension for block formats (TE keeps a row-wise and a
column-wise copy; here the transposed tensor is blocked along its last axis, the same blocks, and
stochastic rounding indexes the transposed tensor's elements) and the forward casts themselves for
per-tensor scaling and NVFP4's 16x16 weight blocks. With ``hadamard=True`` (NVFP4) ``g^T`` and ``x^T``
are first multiplied by the random Hadamard matrix in tiles of 16 along ``M`` (``numerics/hadamard.py``; ``M``
zero padded to a multiple of 16), so ``dW = Qb'(g^T H) @ Qf'(x^T H)^T``: ``H`` is orthogonal, and only
the quantization error changes.
A module that stores its weight ``(in, out)`` and computes ``x @ W`` (transformers' ``Conv1D``, GPT-2's
layers: ``torch.addmm(b, x, W)``) runs the same three GEMMs on ``W^T`` (``F.linear(x, W^T, b)``): a
``torch.addmm`` / ``matmul`` / ``mm`` call whose weight operand is that module's own ``weight``.
A GEMM the recipe leaves unquantized takes its operands as they are. Products run in the recipe's
compute dtype (bf16 or fp32), and so does everything else (``torch.autocast``); layers in the keep
list (by default the first and last matmul module, ``LayerStack``) compute as bf16-mixed.
``nn.MultiheadAttention``'s projections are not quantized: they run inside
``F.multi_head_attention_forward``, which a ``TorchFunctionMode`` sees as one call (its inner ``F.linear``
calls are dispatched with the mode off); ``matmul_modules`` records it, transposed convolutions,
recurrent layers and ``nn.Bilinear`` as unsupported in ``mp.recipe_layers``.

Quantization, bit-identical to the numpy core (``tests/test_recipes_frameworks.py``):
- tensorwise: ``scale = current_scale(amax)`` (TE's rule), ``fp32(x * scale)`` cast to e4m3fn / e5m2
  with saturation (torch's float8 dtypes round to nearest, ties to even), divided by ``scale``: the
  core's ``recipes.quantize_tensorwise``;
- delayed: the same with the scale of the layer's ``DelayedScaling`` for that operand, updated with
  this call's amax after the cast (TE's order), all-reduced (max) over the process group first when
  ``torch.distributed`` is initialized (``reduce_amax``, TE's default), so every rank keeps the same
  histories; the histories are in ``mp.state_dict()``;
- block: ``polyamp.quantize_blocks`` (torch's route); stochastic rounding draws its seed from a
  counter of calls.
"""

from __future__ import annotations

import contextlib
import fnmatch
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import PolyampError
from ..numerics import get_format, quantize
from ..numerics.hadamard import hadamard_tiles
from ..quantizer_state import QuantizerState
from ..recipe_gemms import INPUT_GRAD, backward_operands, forward_operands
from ..recipe_layers import RecipeLayers
from ..recipes import current_scale_of
from . import xp
from .recipe_conv import is_conv, quantized_conv

_FLOAT8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_COMPUTE = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Quantizer(QuantizerState):
    """The recipe's quantize-dequantize of one GEMM operand, with the state it keeps: ``QuantizerState``'s
    rule over torch's hooks (detached float32 operands, ``_tensorwise``'s float8 cast, ``_reduced``).
    ``group``: the process group whose ranks share the delayed histories (``reduce_amax``; None is the
    world when ``torch.distributed`` is initialized)."""

    ops = xp

    def __init__(self, recipe, group=None):
        super().__init__(recipe)
        self.group = group

    def _operand(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().float()

    def _amax(self, x32: torch.Tensor) -> torch.Tensor:
        return x32.abs().amax() if x32.numel() else x32.new_zeros(())

    def _quantize_tensorwise(self, x32: torch.Tensor, fmt: str, scale, rounding: str, seed) -> torch.Tensor:
        if isinstance(scale, float):  # delayed scaling's, from the host
            scale = torch.tensor(scale, dtype=torch.float32, device=x32.device)
        return _tensorwise(x32, fmt, scale, rounding, seed)

    def _reduced(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax``, all-reduced (max) over ``group`` when the recipe reduces amaxes and
        ``torch.distributed`` is initialized: one scalar all-reduce per call, in call order, which
        every rank's identical forward and backward share. The float32 bit patterns are reduced as
        int32 (an amax is >= 0, so they order as the values do, and a NaN, then an inf, outranks every
        number on any rank, where a float max would depend on the order of the ranks)."""
        dist = torch.distributed
        if not (self.recipe.reduce_amax and dist.is_available() and dist.is_initialized()):
            return amax
        bits = amax.float().reshape(1).view(torch.int32).clone()
        dist.all_reduce(bits, dist.ReduceOp.MAX, group=self.group)
        return bits.view(torch.float32)[0]


def current_scale(amax: torch.Tensor, fmt: str, margin: int = 0, eps: float = 0.0) -> torch.Tensor:
    """``polyamp.recipes.current_scale`` of a 0-d float32 amax tensor, on its device (no host read)."""
    return current_scale_of(xp, amax, fmt, margin, eps)


def _tensorwise(x32: torch.Tensor, fmt: str, scale: torch.Tensor, rounding: str, seed) -> torch.Tensor:
    """``recipes.quantize_tensorwise``: ``quantize(fp32(x * scale), fmt, saturate) / scale``, float32."""
    y = x32 * scale
    if rounding == "nearest" and fmt in _FLOAT8:
        fmax = float(get_format(fmt).max)
        q = y.clamp(-fmax, fmax).to(_FLOAT8[fmt]).float()
    else:
        q = quantize(y, fmt, rounding=rounding, saturate=True, seed=seed)
    return q / scale


class _QuantizedLinear(torch.autograd.Function):
    """``F.linear`` with the recipe's three quantized GEMMs (module docstring), their operands by
    ``recipe_gemms``; the backward skips a gradient that autograd does not need."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantizer: Quantizer, layer: str, compute: torch.dtype):
        xq, wq = forward_operands(quantizer.recipe, _linear_operand(quantizer, layer), x, weight)
        ctx.save_for_backward(x, weight, xq, wq)
        ctx.args = (quantizer, layer, compute, bias is not None, x.dtype, weight.dtype)
        b = None if bias is None else bias.to(compute)
        return F.linear(xq.to(compute), wq.to(compute), b)

    @staticmethod
    def backward(ctx, grad):
        x, weight, xq, wq = ctx.saved_tensors
        quantizer, layer, compute, has_bias, x_dtype, w_dtype = ctx.args
        k = x.shape[-1]
        g2 = grad.reshape(-1, grad.shape[-1])
        dgrad, wgrad = backward_operands(
            quantizer.recipe, _linear_operand(quantizer, layer), g2, x.reshape(-1, k), weight,
            xq.reshape(-1, k), wq, hadamard=_hadamard_rows, transpose=torch.Tensor.t,
            want=ctx.needs_input_grad[:2])  # fmt: skip
        dx = dw = db = None
        if dgrad is not None:
            g_op, w_op = dgrad
            dx = (g_op.to(compute) @ w_op.to(compute)).reshape(x.shape).to(x_dtype)
        if wgrad is not None:  # dW = g^T x, its operands g^T and x^T
            g_op, x_op = wgrad
            dw = (g_op.to(compute) @ x_op.to(compute).t()).to(w_dtype)
        if has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(w_dtype)
        return dx, dw, db, None, None, None


def _linear_operand(quantizer: Quantizer, layer: str):
    """``recipe_gemms``' quantize for ``F.linear``'s layouts (x [M, K], W [N, K], g [M, N], the
    weight gradient's g^T and x^T): each operand blocked along its last axis; the input gradient's W
    as W^T, the same blocks as the forward's."""

    def quantize(t: torch.Tensor, operand: str, gemm: str) -> torch.Tensor:
        if operand == "weight" and gemm == INPUT_GRAD:
            return quantizer(t.t(), layer, operand).t()
        return quantizer(t, layer, operand)

    return quantize


def _hadamard_rows(t: torch.Tensor, _operand: str) -> torch.Tensor:
    """The Hadamard tiles of ``t`` (g^T or x^T) along M, split along the rows of g or x: a contiguous
    result, whose transpose quantizes in place."""
    return hadamard_tiles(t.t(), 0).t()


class RecipeMode(TorchFunctionMode):
    """Routes ``F.linear`` calls to ``_QuantizedLinear`` (``F.convNd`` to ``recipe_conv``; a transposed-weight
    module's ``torch.addmm`` / ``matmul`` / ``mm`` with its own weight to ``_QuantizedLinear`` of that weight
    transposed) while the innermost running module (``layers``' stack, kept by ``mp.watch``'s hooks) is not
    kept."""

    def __init__(self, quantizer: Quantizer, layers: LayerStack, compute: torch.dtype):
        super().__init__()
        self.quantizer, self.layers, self.compute = quantizer, layers, compute

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear or is_conv(func) or func in _GEMMS:
            layer = self.layers.current()
            if layer is not None and not self.layers.is_kept(layer):
                if func is F.linear:
                    named = dict(zip(("input", "weight", "bias"), args), **kwargs)
                    self.layers.note(layer)
                    return _QuantizedLinear.apply(named["input"], named["weight"], named.get("bias"),
                                                  self.quantizer, layer, self.compute)  # fmt: skip
                if func not in _GEMMS:
                    self.layers.note(layer)
                    return quantized_conv(func, args, kwargs, self.quantizer, layer, self.compute)
                weight = self.layers.transposed.get(layer)
                operands = None if weight is None else _times_weight(func, args, kwargs, weight)
                if operands is not None:
                    return _QuantizedLinear.apply(operands[0], weight.t(), operands[1], self.quantizer, layer,
                                                  self.compute)  # fmt: skip
        return func(*args, **kwargs)


_GEMMS = (torch.addmm, torch.Tensor.addmm, torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm)


def _times_weight(func, args, kwargs, weight: torch.Tensor):
    """``(x, bias)`` when the call is ``x @ weight`` (``bias`` None) or ``torch.addmm(bias, x, weight)`` with
    a 1-d bias, ``beta`` and ``alpha`` 1 (transformers' ``Conv1D``); else None."""
    if func in (torch.addmm, torch.Tensor.addmm):
        named = dict(zip(("input", "mat1", "mat2"), args), **kwargs)
        plain = named.get("beta", 1) == 1 and named.get("alpha", 1) == 1 and set(named) <= {
            "input", "mat1", "mat2", "beta", "alpha"}  # fmt: skip
        bias = named.get("input")
        if named.get("mat2") is weight and plain and isinstance(bias, torch.Tensor) and bias.dim() == 1:
            return named["mat1"], bias
        return None
    names = ("input", "other") if func in (torch.matmul, torch.Tensor.matmul) else ("input", "mat2")
    named = dict(zip(names, args), **kwargs)
    return (named["input"], None) if set(named) == set(names) and named[names[1]] is weight else None


_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_MHA_WHY = ("its in- and out-projections run inside F.multi_head_attention_forward, which a "
            "TorchFunctionMode sees as one call (the F.linear calls inside it never reach the recipe); "
            "attention built from nn.Linear projections (as Hugging Face models build it) is "
            "quantized")  # fmt: skip
_UNSUPPORTED = (
    ((torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d),
     "transposed convolutions are not quantized; it computes in the recipe's compute dtype"),
    ((torch.nn.MultiheadAttention,), _MHA_WHY),
    ((torch.nn.RNNBase,), "a recurrent layer's matmuls run inside one fused kernel, not quantized"),
    ((torch.nn.Bilinear,), "F.bilinear is not one of the recipes' GEMMs"),
)  # fmt: skip


def _transposed_types() -> tuple[type, ...]:
    """Module types whose forward is ``x @ weight`` with ``weight`` stored ``(in, out)``: transformers'
    ``Conv1D`` (GPT-2's layers: ``torch.addmm(bias, x, weight)``), when transformers is imported."""
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    return (conv1d,) if isinstance(conv1d, type) else ()


def matmul_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """Every matmul module of ``model`` (``named_modules`` order; the model itself named by its type) with how
    the recipe runs it: ``"linear"`` (``nn.Linear``: ``F.linear``), ``"conv"`` (``nn.ConvNd``: ``F.convNd``),
    ``"transposed"`` (transformers' ``Conv1D``: ``x @ W``, ``W`` stored ``(in, out)``, quantized as the
    linear GEMMs of ``W^T``), or ``"unsupported: <type>: <why>"`` (computes in the compute dtype)."""
    transposed = _transposed_types()
    out: list[tuple[str, torch.nn.Module, str]] = []
    attention: list[str] = []  # nn.MultiheadAttention modules: their out_proj never runs as a module
    for name, m in model.named_modules():
        inside = next((a for a in attention if name.startswith(a + ".")), None)
        how = next((f"unsupported: {type(m).__name__}: {why}" for types, why in _UNSUPPORTED
                    if isinstance(m, types)), None)  # fmt: skip
        if isinstance(m, torch.nn.MultiheadAttention):
            attention.append(name)
        if inside is not None and isinstance(m, torch.nn.Linear):
            how = f"unsupported: {type(m).__name__} inside MultiheadAttention {inside!r}: {_MHA_WHY}"
        elif how is None:
            how = ("linear" if isinstance(m, torch.nn.Linear) else "conv" if isinstance(m, _CONVS)
                   else "transposed" if isinstance(m, transposed) else None)  # fmt: skip
        if how is not None and not name:
            how = (f"unsupported: {type(m).__name__}: the watched model itself runs unnamed; wrap it "
                   "(nn.Sequential(model)) to quantize it")  # fmt: skip
        if how is not None:
            out.append((name or type(m).__name__, m, how))
    return out


def _block_of(name: str) -> str | None:
    """The repeated block ``name`` lies in (its longest prefix ending in an index: ``model.layers.0`` for
    ``model.layers.0.self_attn.q_proj``), when that is not ``name`` itself."""
    parts = name.split(".")
    ends = [i for i, p in enumerate(parts[:-1]) if p.isdigit()]
    return ".".join(parts[: ends[-1] + 1]) if ends else None


class _Enter:
    """A forward pre-hook pushing the module's name on the stack (picklable: an unpickled copy is a
    ``_Detached`` no-op, so that a watched model still pickles and ``torch.save``s)."""

    def __init__(self, stack: list[str], name: str):
        self.stack, self.name = stack, name

    def __call__(self, *_) -> None:
        self.stack.append(self.name)

    def __reduce__(self):
        return _Detached, ()


class _Leave(_Enter):
    """The forward hook popping it (returns None: a forward hook's result would replace the output)."""

    def __call__(self, *_) -> None:
        self.stack.pop()


class _Detached:
    """What a watch's hook becomes in a copy of the model: nothing (watch the copy to quantize it)."""

    def __call__(self, *_) -> None:
        return None


class LayerStack:
    """Which module is running (forward pre/post hooks on every module of the watched model), the recipe's
    keep list resolved to module names, and the record of what the recipe quantizes (``record``,
    ``mp.recipe_layers``): ``first`` / ``last`` are the first and last matmul module the recipe quantizes
    (``matmul_modules``: ``nn.Linear``, ``nn.ConvNd``, transformers' ``Conv1D``) in ``named_modules``
    order; other entries are ``fnmatch`` patterns over module names; a kept module keeps the modules below
    it. A module not in ``matmul_modules`` whose own ``F.linear`` / ``F.convNd`` calls are quantized enters
    the record when it first runs."""

    def __init__(self, model: torch.nn.Module, keep: tuple[str, ...], recipe: str):
        if not isinstance(model, torch.nn.Module):
            raise PolyampError(f"expected a torch.nn.Module, got {type(model).__name__}")
        modules = [(n, m) for n, m in model.named_modules() if n]
        matmuls = matmul_modules(model)
        supported = [n for n, _, how in matmuls if not how.startswith("unsupported")]
        self.kept: dict[str, str] = {}  # module name -> the keep entry that keeps it (and those below)
        for entry in keep:
            if entry in ("first", "last"):
                if supported:
                    self.kept.setdefault(supported[0] if entry == "first" else supported[-1], entry)
                continue
            found = [n for n, _ in modules if fnmatch.fnmatchcase(n, entry)]
            if not found:
                raise PolyampError(f"the recipe's keep entry {entry!r} matches no module of the model; "
                                   f"its modules: {', '.join(n for n, _ in modules[:20])}")  # fmt: skip
            for n in found:
                self.kept.setdefault(n, entry)
        self.transposed = {n: m.weight for n, m, how in matmuls if how == "transposed"}
        self._keeper: dict[str, str | None] = {}
        self.record = RecipeLayers(recipe)
        for name, _, how in matmuls:
            entry = self.keeper(name)
            self.record.add(name, how if how.startswith("unsupported") else
                            None if entry is None else self._reason(entry, name))  # fmt: skip
        self._recorded = {*self.record.quantized, *self.record.kept}
        known = {id(m) for _, m, _ in matmuls}  # a module owning a matrix may call F.linear with it
        self.functional = any(p.dim() >= 2 for _, m in modules if id(m) not in known
                              and not isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                              for p in m.parameters(recurse=False))  # fmt: skip
        self.checked = False  # the first mp.autocast() block has run
        self._stack: list[str] = []
        self.handles = []
        for name, m in modules:
            self.handles.append(m.register_forward_pre_hook(_Enter(self._stack, name)))
            self.handles.append(m.register_forward_hook(_Leave(self._stack, name)))

    def _reason(self, entry: str, name: str) -> str:
        """The record's reason for a module ``entry`` keeps: ``keep 'first'`` / ``keep 'last'`` (and the
        pattern that would keep the first module's whole block) or ``keep '<pattern>'``."""
        if entry not in ("first", "last"):
            return f"keep {entry!r}"
        block = _block_of(name)
        more = f"; keep=first|last|{block}.* keeps its whole block" if entry == "first" and block else ""
        return f"keep {entry!r}: the {entry} matmul module in named_modules order{more}"

    def keeper(self, layer: str) -> str | None:
        """The keep entry that keeps ``layer`` (it or an ancestor), else None."""
        if layer not in self._keeper:
            parts = layer.split(".")
            prefixes = (".".join(parts[:i]) for i in range(len(parts), 0, -1))
            self._keeper[layer] = next((self.kept[p] for p in prefixes if p in self.kept), None)
        return self._keeper[layer]

    def warn_if_none(self, where: str) -> None:
        """``RecipeLayers.warn_if_none``: at ``mp.watch`` unless a module outside ``matmul_modules`` owns a
        matrix (its own ``F.linear`` calls are found when they run), then after the first
        ``mp.autocast()`` block."""
        if where == "mp.watch" and self.functional:
            return
        self.record.warn_if_none("torch", where)

    def note(self, layer: str) -> None:
        """Record ``layer`` as quantized (its own ``F.linear`` / ``F.convNd`` call, met at run time)."""
        if layer not in self._recorded:
            self._recorded.add(layer)
            self.record.add(layer)

    def reset(self) -> None:
        """Forget modules left on the stack by a forward that raised."""
        self._stack.clear()

    def current(self) -> str | None:
        return self._stack[-1] if self._stack else None

    def is_kept(self, layer: str) -> bool:
        """``layer`` or one of its ancestors is kept."""
        return self.keeper(layer) is not None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


@contextlib.contextmanager
def autocast(quantizer: Quantizer, layers: LayerStack, device: str):
    """torch.autocast to the recipe's compute dtype, with the recipe's GEMMs (module docstring)."""
    compute = _COMPUTE[quantizer.recipe.compute_dtype]
    layers.reset()
    with contextlib.ExitStack() as stack:
        if compute != torch.float32:
            stack.enter_context(torch.autocast(device.split(":")[0], dtype=compute))
        stack.enter_context(RecipeMode(quantizer, layers, compute))
        yield
    if not layers.checked:
        layers.checked = True
        if layers.functional:
            layers.warn_if_none("mp.autocast")
