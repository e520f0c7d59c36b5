"""Emulated low-precision training in Keras 3: ``polyamp.recipes`` on the matmuls of Dense, EinsumDense and
Conv layers.

``mp.watch(model)`` of a ``MixedPrecision`` made from a recipe gives every ``keras.layers.Dense``,
``EinsumDense`` (also those inside ``MultiHeadAttention``) and ``Conv1D`` / ``Conv2D`` / ``Conv3D`` of the
model that the keep list does not keep a ``call`` of its own (on that layer object; ``mp.watch`` again
restores the others). In a Dense layer ``inputs @ kernel`` becomes :func:`linear`, the recipe's three
quantized GEMMs, as ``polyamp/torch/recipe.py`` describes, in a ``tf.custom_gradient``; bias and
activation as Dense's:

    forward        y  = Qf(x) @ Qf(W)           blocks along K (x's last axis, W's first)
    input grad     dx = Qb(g) @ Qf'(W)^T        blocks along N (g's last axis, W's last)
    weight grad    dW = Qf'(x)^T @ Qb'(g)       blocks along the rows M of x and g (Hadamard first)

An EinsumDense's einsum is the same :func:`linear` on ``x2d @ W2d`` (``recipe_einsum.py``: contracted
axes flattened into K, free axes into M and N); an equation that is not a GEMM is left as Keras runs it.
In a Conv layer the convolution becomes ``recipe_conv.conv``, the same three GEMMs as implicit GEMMs
(blocks along the channels and the batch; that module's docstring); transposed, depthwise and separable
convolutions are left as Keras runs them.
``W`` is the float32 kernel (read outside Keras's autocast), ``x`` the layer's input in its compute
dtype; products run in the recipe's compute dtype (bf16 or fp32), outputs and ``dx`` in ``x``'s dtype,
``dW`` in the kernel's. Per-tensor formats quantize each operand once (one scale, one cast: ``Qf' = Qf``)
and so does NVFP4's 16x16 weight. A layer's name is ``keep.py``'s ("block/dense_1"); the keep list's
``first`` / ``last`` are the first and last quantizable matmul layer in that order, other entries
``fnmatch`` patterns (a matching layer keeps the matmul layers below it). ``MatmulLayers.record`` lists
every matmul layer, quantized or kept with its reason (``keep 'first'``, ``unsupported: ...``), for
``mp.recipe_layers``.

Quantization is integer TF ops (``quantize.py``), bit-identical to the numpy core in eager mode, in
``tf.function`` and under XLA (``tests/test_recipes_frameworks.py``):
- tensorwise: ``scale = current_scale(amax)`` (TE's rule: ``Fmax 2^-margin / amax`` rounded once to
  float32, by long division), ``fp32(x * scale)`` rounded to the format with saturation, divided by
  ``scale`` (one rounding to float32): the core's ``recipes.quantize_tensorwise``;
- delayed: the same with the scale of that (layer, operand)'s amax history, updated with this call's
  amax after the cast (TE's order, ``recipes.DelayedScaling``), the largest of the replicas' under a
  distribution strategy (``reduce_amax``, TE's default); the histories are ``tf.Variable``s (mirrored
  under a strategy, each replica's copy the same), so a ``tf.function`` step updates them, and
  ``mp.state_dict()`` holds them;
- block: ``quantize.blocks_keyed``.
Stochastic rounding seeds each call with a counter of the stochastically rounded calls (a
``tf.Variable``, also in the state; 1, 2, ... in call order: ``g`` along N, then along M); the stream
indexes the operand's elements in the layout it is quantized in (``g`` as [M, N], not transposed).
Kernels run through ``quantize.graph_call`` (one ``tf.function`` per shape and static arguments)."""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..errors import PolyampError
from ..keras.keep import named_layers
from ..numerics import BLOCK_FORMATS, exact_int, get_format
from ..numerics import blocks as _blocks
from ..numerics.hadamard import hadamard_tiles
from ..numerics.rounding import _MODE
from ..recipe_gemms import FORWARD, INPUT_GRAD, WEIGHT_GRAD, backward_operands, forward_operands
from ..recipe_layers import RecipeLayers
from ..recipes import DelayedScaling, Recipe
from . import xp_int
from .quantize import _U, _Stream, blocks_keyed, graph_call, key_of
from .recipe_conv import CONV_LAYERS, conv, conv_call, conv_options
from .recipe_einsum import bias_and_activation, einsum_call, gemm_plan

_COMPUTE = {"bf16": tf.bfloat16, "fp32": tf.float32}
_INF32, _NAN32 = 0x7F800000, 0x7FC00000
_MATMUL_LAYERS = (keras.layers.Dense, keras.layers.EinsumDense, *CONV_LAYERS)
_UNSUPPORTED = (  # matmul layers a recipe leaves as Keras runs them
    ((keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose),
     "a transposed convolution"),
    ((keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D), "a depthwise convolution"),
    ((keras.layers.SeparableConv1D, keras.layers.SeparableConv2D), "a separable convolution"),
)


class Quantizer:
    """The recipe's quantize-dequantize of one GEMM operand, with its state in ``tf.Variable``s: the
    stochastic-rounding counter and, for delayed scaling, each (layer, operand)'s history."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.calls = None
        self.place()
        self.delayed: dict[tuple[str, str], _History] = {}

    def place(self) -> None:
        """The counter created (its value kept) under the current distribution strategy, unless it is
        there already."""
        strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        if self.calls is not None and getattr(self.calls, "distribute_strategy", None) is strategy:
            return
        with tf.init_scope():
            value = 0 if self.calls is None else int(self.calls.numpy())
            self.calls = tf.Variable(value, dtype=tf.int64, trainable=False, name="polyamp_recipe_calls")

    def __call__(self, x, layer: str, operand: str, axis=-1):
        """``x`` quantized and dequantized as the recipe's ``operand`` ("input", "weight", "grad"),
        blocked along ``axis``; float32 out."""
        r = self.recipe
        grad = operand == "grad"
        fmt = r.backward_format if grad else r.forward_format
        mode = _MODE[r.grad_rounding if grad else r.forward_rounding]
        key = key_of(self.calls.assign_add(1) if mode == _MODE["stochastic"] else 0)
        x = tf.convert_to_tensor(x)
        if r.kind == "block":
            bf = BLOCK_FORMATS[fmt]
            block = (16, 16) if (r.weight_2d and operand == "weight") else None
            shape = _blocks._block_shape(bf, block)
            axes = _blocks._axes((-2, -1) if block else axis, x.shape.rank, len(shape))
            return graph_call(_block_values, (x, key), (bf, axes, shape, r.scale_rule, mode))
        if r.kind == "delayed":
            history = self.delayed.get((layer, operand)) or self.add(layer, operand)
            out, amax = graph_call(_delayed, (x, history.scale.read_value(), key), (fmt, mode))
            with tf.control_dependencies([out]):
                history.update(across_replicas(amax) if r.reduce_amax else amax)
            return tf.identity(out)
        return graph_call(_current, (x, key), (fmt, r.margin, float(r.amax_epsilon), mode))

    def add(self, layer: str, operand: str) -> _History:
        """The history of ``layer``'s ``operand`` (delayed scaling), created outside any tf.function."""
        r = self.recipe
        fmt = r.backward_format if operand == "grad" else r.forward_format
        ds = DelayedScaling(fmt, r.history_len, r.amax_compute_algo, r.margin)
        with tf.init_scope():
            h = self.delayed[layer, operand] = _History(ds)
        return h

    def state_dict(self) -> dict[str, Any]:
        """The counter and the delayed-scaling states (``"layer|operand" -> DelayedScaling.state_dict()``)."""
        return {"calls": int(self.calls.numpy()),
                "delayed": {f"{k[0]}|{k[1]}": v.state_dict() for k, v in self.delayed.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"calls", "delayed"}:
            raise PolyampError(f"a recipe state must be Quantizer.state_dict()'s dict; received {state!r}")
        calls = state["calls"]
        if isinstance(calls, bool) or not isinstance(calls, (int, np.integer)) or calls < 0:
            raise PolyampError(f"a recipe state's calls must be an integer >= 0; received {calls!r}")
        checked = []
        for key, value in state["delayed"].items():  # all checked before any is assigned
            layer, _, operand = key.rpartition("|")
            if (layer, operand) not in self.delayed:
                mine = ", ".join(f"{k[0]}|{k[1]}" for k in self.delayed) or "none"
                raise PolyampError(f"the recipe state holds an amax history for {key!r}, which this "
                                   f"model has not; its histories: {mine}")  # fmt: skip
            checked.append((self.delayed[layer, operand], self.delayed[layer, operand].checked(value)))
        for history, ds in checked:
            history.assign(ds)
        self.calls.assign(int(calls))


def across_replicas(amax_bits):
    """The largest of the replicas' amaxes (float32 bit patterns; a NaN, then an inf, outranks every
    number) when a distribution strategy runs more than one replica in sync: an all-gather, as
    ``ReplicaContext.all_reduce`` has no max. Every replica then records the same history."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return amax_bits
    every = ctx.all_gather(tf.reshape(tf.cast(amax_bits, tf.int64), [1]), axis=0)
    return tf.cast(tf.reduce_max(every), amax_bits.dtype)


class _History:
    """One ``DelayedScaling`` held in ``tf.Variable``s (scale, history, steps); ``update`` is
    ``DelayedScaling.update`` in TF ops."""

    def __init__(self, ds: DelayedScaling):
        self.config = ds
        self.scale = tf.Variable(np.float32(ds.scale), trainable=False, name="polyamp_delayed_scale")
        self.history = tf.Variable(ds.history, trainable=False, name="polyamp_amax_history")
        self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="polyamp_delayed_steps")

    def update(self, amax_bits) -> None:
        """Record this step's amax (float32 bit pattern, uint64) and set the next step's scale: one
        ``graph_call`` (eagerly a few hundred integer ops, the scale's long division among them, would
        otherwise run one by one: most of an eager fp8-delayed step)."""
        ds = self.config
        scale, history = graph_call(
            _delayed_update,
            (tf.cast(amax_bits, _U), self.history.read_value(), self.scale.read_value()),
            (ds.amax_compute_algo, float(ds._scaled_max)),
        )
        self.scale.assign(scale)
        self.history.assign(history)
        self.steps.assign_add(1)

    def state_dict(self) -> dict[str, Any]:
        """``DelayedScaling.state_dict()``'s dict of the variables' values."""
        ds = self.config
        return {"format": ds.format.name, "history_len": ds.history_len,
                "amax_compute_algo": ds.amax_compute_algo, "margin": ds.margin,
                "scale": float(self.scale.numpy()), "history": [float(v) for v in self.history.numpy()],
                "steps": int(self.steps.numpy())}  # fmt: skip

    def checked(self, state) -> DelayedScaling:
        """``state`` loaded into a fresh ``DelayedScaling`` of this config (the core's checks)."""
        ds = self.config
        out = DelayedScaling(ds.format.name, ds.history_len, ds.amax_compute_algo, ds.margin)
        out.load_state_dict(state)
        return out

    def assign(self, ds: DelayedScaling) -> None:
        self.scale.assign(np.float32(ds.scale))
        self.history.assign(ds.history)
        self.steps.assign(ds.steps)


def _delayed_update(amax_bits, history, scale, algo: str, scaled_max: float):
    """``DelayedScaling.update`` of one history: (the next scale, the next history)."""
    h = tf.concat([tf.reshape(tf.bitcast(tf.cast(amax_bits, tf.uint32), tf.float32), [1]), history[1:]], 0)
    bits = tf.cast(tf.bitcast(h, tf.uint32), _U) & tf.constant(0x7FFFFFFF, _U)
    if algo == "max":  # NaN entries skipped, as np.fmax
        number = bits <= _INF32
        used = tf.reduce_max(tf.where(number, bits, tf.constant(0, _U)))
        used = tf.where(tf.reduce_any(number), used, tf.constant(_NAN32, _U))
    else:
        used = bits[0]
    rolled = tf.concat([h[1:], h[:1]], 0)
    return _scale(used, scaled_max, scale), tf.concat([tf.zeros([1], tf.float32), rolled[1:]], 0)


# -- per-tensor scaling in integers --------------------------------------------------------------------
def _float32(x) -> tf.Tensor:
    """``x`` as float32 (rounded once, as a cast), by its bit pattern (no subnormal flushed)."""
    num = exact_int.decompose(xp_int, x)
    rounded = exact_int.round_to_grid(xp_int, num, exact_int.FP32, _MODE["nearest"], None)
    return exact_int.compose(xp_int, rounded, tf.float32)


def _block_values(x, key, bf, axes, shape, rule, mode):
    """One operand in a block format (``Quantizer`` with a block recipe)."""
    return blocks_keyed(x, bf, axes, shape, rule, mode, key)


def _current(x, key, fmt, margin, eps, mode):
    """Current scaling of one operand (``Quantizer`` with a tensorwise recipe)."""
    x32 = _float32(x)
    return tensorwise(x32, fmt, current_scale(_amax_bits(x32), fmt, margin, eps), mode, key)


def _delayed(x, scale, key, fmt, mode):
    """One operand quantized with a delayed scale; with its amax for the history."""
    x32 = _float32(x)
    return tensorwise(x32, fmt, scale, mode, key), _amax_bits(x32)


def _amax_bits(x32) -> tf.Tensor:
    """max |x| of a float32 tensor as a float32 bit pattern (uint64): NaN when x holds a NaN."""
    return xp_int.max_all(xp_int.abs_bits(x32))


def _scale(amax_bits, scaled_max: float, fallback, eps: float = 0.0) -> tf.Tensor:
    """``recipes._scale`` of one float32 amax given as its bit pattern (``exact_int.scale_from_amax``)."""
    return exact_int.scale_from_amax(xp_int, amax_bits, scaled_max, fallback, eps)


def current_scale(amax_bits, fmt: str, margin: int = 0, eps: float = 0.0) -> tf.Tensor:
    """``polyamp.recipes.current_scale`` of a float32 amax given as its bit pattern, as TF ops."""
    return _scale(amax_bits, float(np.float32(float(get_format(fmt).max) * 2.0**-margin)), 1.0, float(eps))


def tensorwise(x32, fmt: str, scale, mode: int, key) -> tf.Tensor:
    """``recipes.quantize_tensorwise(x32, fmt, scale)``: ``fp32(x * scale)`` rounded to ``fmt`` with
    saturation, divided by ``scale`` (rounded to float32); float32 in and out."""
    stream = _Stream(key, x32) if mode == _MODE["stochastic"] else None
    grid = exact_int.Grid.of(get_format(fmt), True)
    return exact_int.tensorwise(xp_int, x32, tf.convert_to_tensor(scale, tf.float32), grid, mode, stream)


# -- the GEMMs -----------------------------------------------------------------------------------------
def linear(quantizer: Quantizer, layer: str, compute):
    """``x @ w`` (x [..., K], w [K, N]) with the recipe's three quantized GEMMs (module docstring), their
    operands by ``recipe_gemms`` (the weight gradient quantizes ``x`` before ``g``)."""

    def quantize(t, operand, gemm):
        return quantizer(t, layer, operand, _LINEAR_AXES[gemm, operand])

    def matmul(a, b, **kw):
        return tf.linalg.matmul(tf.cast(a, compute), tf.cast(b, compute), **kw)

    @tf.custom_gradient
    def fn(x, w):
        k, n = w.shape
        x2 = tf.reshape(x, [-1, k])
        xq, wq = forward_operands(quantizer.recipe, quantize, x2, w)
        y = tf.reshape(matmul(xq, wq), tf.concat([tf.shape(x)[:-1], [n]], 0))

        def grad(g):
            g2 = tf.reshape(g, [-1, n])
            (gq, w_op), (g_op, x_op) = backward_operands(
                quantizer.recipe, quantize, g2, x2, w, xq, wq, hadamard=_hadamard_rows,
                weight_grad_first="input")  # fmt: skip
            dx = tf.cast(tf.reshape(matmul(gq, w_op, transpose_b=True), tf.shape(x)), x.dtype)
            return dx, tf.cast(matmul(x_op, g_op, transpose_a=True), w.dtype)

        return tf.cast(y, x.dtype), grad

    @tf.autograph.experimental.do_not_convert
    def apply(x, w):  # a variable read here, so the custom gradient sees only tensors
        return fn(tf.convert_to_tensor(x), tf.convert_to_tensor(w))

    return apply


# each operand's blocked axis, the one its GEMM sums over: K forward, N input grad, M weight grad
_LINEAR_AXES = {(FORWARD, "input"): -1, (FORWARD, "weight"): 0, (INPUT_GRAD, "grad"): -1,
                (INPUT_GRAD, "weight"): 1, (WEIGHT_GRAD, "input"): 0, (WEIGHT_GRAD, "grad"): 0}  # fmt: skip


def _hadamard_rows(t, _operand: str):
    return hadamard_tiles(t, 0)


# -- the model's matmul layers ----------------------------------------------------------------------
def matmul_layers(model) -> list[tuple[str, keras.layers.Layer, str | None]]:
    """(name, layer, None) of each layer a recipe can quantize (Dense, EinsumDense whose equation is a
    GEMM, Conv1D/2D/3D) and (name, layer, "unsupported: <type>: <why>") of every other matmul layer, in
    ``named_layers`` order."""
    out = []
    for name, layer in named_layers(model):
        why = unsupported(layer)
        if why is not None or isinstance(layer, _MATMUL_LAYERS):
            out.append((name, layer, why))
    return out


def unsupported(layer) -> str | None:
    """Why a matmul layer is not quantized ("unsupported: <type>: <why>"), None when it is quantizable or
    not a matmul layer."""
    if isinstance(layer, keras.layers.EinsumDense):
        plan = gemm_plan(layer.equation)
        return f"unsupported: EinsumDense: {plan}" if isinstance(plan, str) else None
    for types, why in _UNSUPPORTED:
        if isinstance(layer, types):
            return f"unsupported: {type(layer).__name__}: {why}"
    return None


class MatmulLayers:
    """The watched model's matmul layers (``matmul_layers``), the keep list resolved to them, and the
    ``call`` each quantized one gets (``install`` / ``remove``); ``record(recipe)`` is what
    ``mp.recipe_layers`` shows."""

    def __init__(self, model, keep: tuple[str, ...]):
        if not isinstance(model, keras.layers.Layer):
            raise PolyampError(f"a recipe applies to a Keras model or layer, got {type(model).__name__}")
        self.strategy = _strategy_of(model)
        layers = named_layers(model)
        found = matmul_layers(model)
        matmuls = [(name, layer) for name, layer, why in found if why is None]
        reasons: dict[str, str] = {}  # a kept layer -> the first keep entry that keeps it
        for entry in keep:
            if entry in ("first", "last"):
                if matmuls:
                    reasons.setdefault(matmuls[0 if entry == "first" else -1][0], f"keep {entry!r}")
                continue
            hits = [name for name, _ in layers if fnmatch.fnmatchcase(name, entry)]
            if not hits:
                raise PolyampError(f"the recipe's keep entry {entry!r} matches no layer of the model; "
                                   f"its layers: {', '.join(n for n, _ in layers[:20])}")  # fmt: skip
            for n, _ in matmuls:
                if any(n == k or n.startswith(k + "/") for k in hits):
                    reasons.setdefault(n, f"keep {entry!r}")
        self.kept = sorted(reasons)
        self.quantized = [(n, layer) for n, layer in matmuls if n not in reasons]
        self.reasons = {**reasons, **{name: why for name, _, why in found if why is not None}}
        self.order = [name for name, _, _ in found]
        for name, layer in self.quantized:
            if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None) is not None:
                raise PolyampError(f"{type(layer).__name__} layer {name!r} is LoRA-enabled or Keras-"
                                   "quantized; a recipe quantizes plain Dense, EinsumDense and Conv layers "
                                   "only: keep it (keep=...)")  # fmt: skip

    def record(self, recipe: str) -> RecipeLayers:
        """Every matmul layer in model order: quantized, or kept with its reason."""
        out = RecipeLayers(recipe)
        for name in self.order:
            out.add(name, self.reasons.get(name))
        return out

    def install(self, quantizer: Quantizer, compute) -> None:
        """Each quantized layer's ``call``; the recipe's variables created where the model's are (under
        its distribution strategy: one copy per replica, each updated by its own replica)."""
        s = self.strategy
        with s.scope() if s is not None and not tf.distribute.has_strategy() else contextlib.nullcontext():
            quantizer.place()
            for name, _ in self.quantized:
                if quantizer.recipe.kind == "delayed":
                    for operand in ("input", "weight", "grad"):
                        if (name, operand) not in quantizer.delayed:
                            quantizer.add(name, operand)
        for name, layer in self.quantized:
            if isinstance(layer, keras.layers.Dense):
                layer.call = _dense_call(layer, linear(quantizer, name, compute))
            elif isinstance(layer, keras.layers.EinsumDense):
                layer.call = einsum_call(layer, linear(quantizer, name, compute))
            else:
                layer.call = conv_call(layer, conv(quantizer, name, compute, conv_options(layer)))

    def remove(self) -> None:
        for _, layer in self.quantized:
            if "call" in vars(layer):
                del layer.call


def _strategy_of(model):
    """The distribution strategy the model's variables were created under, or None."""
    for v in model.weights:
        strategy = getattr(getattr(v, "value", v), "distribute_strategy", None)
        if strategy is not None:
            return strategy
    return None


def _dense_call(layer, matmul):
    """Dense's ``call`` with ``matmul`` for ``inputs @ kernel`` (the float32 kernel, read outside
    Keras's autocast)."""

    def call(inputs, training=None):
        with keras.src.backend.AutocastScope(None):
            kernel = tf.convert_to_tensor(layer.kernel)
        return bias_and_activation(layer, matmul(inputs, kernel))

    return call

