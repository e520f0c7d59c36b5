"""The doctor's JAX taps: ``collect(params, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the JAX idiom): the model is its ``params`` pytree; ``loss_fn(params, batch)`` returns the
scalar loss (required: JAX has no module that knows its loss); ``batch`` is any pytree of jax arrays;
``optimizer`` is an optax ``GradientTransformation`` (its state ``optimizer.init(params)``) or a pair
``(optimizer, opt_state)`` to step from a live state.

Layers are ``jax.named_scope`` paths. ``loss_fn`` is traced to a jaxpr (``jax.make_jaxpr``); each equation's
path is the ``Scope`` entries of its ``source_info.name_stack`` joined by "/" (``block1/ff1``), prefixed by
those of the equation that holds its sub-jaxpr. ``jit``, ``closed_call`` and ``remat`` sub-jaxprs are
inlined; any other equation (``scan``, ``while``, ``cond``, a ``custom_jvp``/``custom_vjp`` function such as
``jax.nn.relu``) is one equation of the path it was called under. A layer is one path:
- "output": each floating value its equations produce that is used outside it (by an equation of another
  path, also a sub-scope's or one outside any scope, or as the loss); "grad_output": the loss's gradient
  w.r.t. that value;
- "weight", "grad_weight", "update_ratio": each floating ``params`` leaf belongs to the layer of the first
  equation that reads it; a leaf first read outside any scope, or never, is a layer of its own named by its
  pytree path (``embed``, ``blocks/0/w``), so that only its weight kinds are observed.
Equations outside any scope belong to no layer: their outputs (the loss, an embedding lookup) are not
observed. Layers come in the order their first equation runs, kinds in ``KINDS`` order.

One jitted program per (loss_fn, optimizer, shapes and dtypes), cached as ``jax.jit`` caches a function:
it evaluates the jaxpr with a zero perturbation added to each tapped output, takes ``jax.value_and_grad``
w.r.t. the floating leaves and the perturbations (whose gradients are the output gradients), then
``optimizer.update`` and ``optax.apply_updates``; the update observed is ``new - old`` in float32, the one
applied. Every tensor is binned inside the program and only counts and a few scalars per (layer, kind)
reach the host. Several steps thread the new params and optimizer state from one call to the next;
nothing passed in is changed (nothing is donated), and JAX has no global RNG or train flag to restore.
Without an optimizer every step is the same, so one is run and counted ``steps`` times.

Binning: a float32 (narrower floats widened exactly; float64 likewise on int64) is read as int32 bits,
``a = bits & 0x7fffffff``; a normal float's index is ``(a >> 19) + 353``, a subnormal's comes from the
float ``a`` (exact, ``a < 2^23``) less 149 binades, and zeros, inf/NaN (and, for ratios, zero weights) go to
extra slots of one scatter-add (``bincount``) per (layer, kind). Integer arithmetic throughout: XLA on CPU
treats subnormal floats as zero in float arithmetic and comparisons. The extremes are the max and min of
the magnitude bits (one variadic integer reduction). An update ratio ``|u| / 2^b(w)`` takes ``b(u) - b(w)``
and ``k(u)`` from the bits; its extremes are kept as (binade, mantissa) keys, as the ratio can leave
float32's range (``_ratio_elements``). Arrays over ``_CHUNK`` elements are binned in a loop over chunks
(``_stats``). The results equal ``LogHistogram.of`` / ``update_ratio_histogram`` exactly.
"""

from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jcore

from ..doctor.histogram import B_MIN, N_BINS, SUB, LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..errors import PolyampError
from ..frameworks import detect
from .autocast import leaf_name, name_scopes

ZERO, NONFINITE, APART = N_BINS, N_BINS + 1, N_BINS + 2  # the extra slots of the one bincount
_SLOTS = N_BINS + 3
IGNORE = _SLOTS  # where the elements that a chunk repeats are counted, and dropped
_CHUNK = 1 << 18
_SCATTER = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0,),
                                       scatter_dims_to_operand_dims=(0,))  # fmt: skip
_LOG_SUB = SUB.bit_length() - 1  # SUB is a power of two
_INLINED = {"jit", "pjit", "closed_call", "core_call", "call", "remat2", "checkpoint"}
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()  # key -> _Program, least recent first
_CACHE_SIZE = 8


@dataclass(frozen=True)
class _Layout:
    """A float dtype's bits: the same-width int, the mantissa bits and the exponent bias."""

    float: np.dtype
    int: np.dtype
    mant: int
    bias: int

    @property
    def inf(self) -> int:  # also the exponent field's mask
        return (2 * self.bias + 1) << self.mant

    @property
    def normal(self) -> int:
        return 1 << self.mant

    @property
    def tiny(self) -> int:  # the smallest subnormal is 2^-tiny
        return self.bias - 1 + self.mant

    @property
    def window(self) -> tuple[int, int]:
        """(top, offset): a ratio key ``e << mant | mantissa`` with e in [-top - 1, top] lies strictly
        between the int's min and max; a ratio's binade is within +-(top + offset) (``_ratio_elements``)."""
        top = (1 << (8 * self.int.itemsize - 1 - self.mant)) - 2
        return top, self.tiny + self.bias - top


_F32 = _Layout(np.dtype(np.float32), np.dtype(np.int32), 23, 127)
_F64 = _Layout(np.dtype(np.float64), np.dtype(np.int64), 52, 1023)


def _layout(*dtypes) -> _Layout:
    for d in dtypes:
        if not jnp.issubdtype(d, jnp.floating):
            raise PolyampError(f"cannot bin a {np.dtype(d)} array; accepted: floating-point dtypes")
    return _F64 if any(np.dtype(d).itemsize > 4 for d in dtypes) else _F32


def _magnitude_bits(x, lay: _Layout):
    """Flat magnitude bits of ``x`` widened exactly to ``lay``'s float (bfloat16 by shifting its bits:
    XLA's conversion may flush its subnormals)."""
    x = jnp.ravel(x)
    if x.dtype == jnp.bfloat16 and lay is _F32:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.int32) << 16
    else:
        bits = lax.bitcast_convert_type(x.astype(lay.float), lay.int)
    return bits & jnp.asarray(lay.inf | (lay.normal - 1), lay.int)


def _binade(a, lay: _Layout):
    """(b, key, mantissa) of finite non-zero magnitudes with bits ``a``: ``2^b <= |x| < 2^(b+1)``,
    ``key = SUB * (b + bias) + k``, and the mantissa bits of the normalised value."""
    sub = a < lay.normal
    n = jnp.where(sub, lax.bitcast_convert_type(a.astype(lay.float), lay.int), a)  # float(a) is normal
    shift = jnp.where(sub, lay.tiny, 0).astype(lay.int)
    b = (n >> lay.mant) - lay.bias - shift
    return b, (n >> (lay.mant - _LOG_SUB)) - SUB * shift, n & (lay.normal - 1)


def _reduce(maxima: list, minima: list) -> list:
    """Max of each of ``maxima`` and min of each of ``minima`` (int arrays) in one variadic reduction:
    XLA on CPU vectorises it, unlike a lone integer max (10x faster), and compiles one kernel."""
    n = len(maxima)
    lows = [np.iinfo(x.dtype).min for x in maxima]
    highs = [np.iinfo(x.dtype).max for x in minima]
    inits = [np.asarray(v, x.dtype) for v, x in zip([*lows, *highs], [*maxima, *minima])]

    def combine(p, q):
        return tuple(jnp.maximum(a, b) if i < n else jnp.minimum(a, b) for i, (a, b) in enumerate(zip(p, q)))

    return list(lax.reduce(tuple([*maxima, *minima]), tuple(inits), combine, (0,)))


def _hist_elements(a, lay: _Layout):
    """Each element's slot, and the keys of the extremes: [amax bits] maxima, [amin non-zero bits] minima."""
    _, key, _ = _binade(a, lay)
    idx = key + (1 - SUB * (lay.bias + B_MIN))  # SUB * (b - B_MIN) + k + 1
    if lay is _F64:
        idx = jnp.clip(idx, 0, N_BINS - 1)
    finite = a < lay.inf
    big = np.iinfo(lay.int).max
    slots = jnp.where(a == 0, ZERO, jnp.where(finite, idx, NONFINITE))
    return slots, [jnp.where(finite, a, 0)], [jnp.where(finite & (a > 0), a, big)]


def _ratio_elements(au, aw, lay: _Layout):
    """Each element's slot for ``|u| / 2^b(w)``, and the keys of the extremes. The ratio is ``(1 + m /
    2^mant) * 2^s``, ``s = b(u) - b(w)`` within +-276 for float32, more than an int32 key ``s << 23 | m``
    holds; the extremes are those of ``clamp(s + o, -255, 254) << 23 | m`` for o = -22 and +22 (float64:
    int64, 52, -2047..2046, 51): maxima [with -22, with +22], minima [with +22, with -22]; ``_decode``
    takes the one in whose window the extreme lies unclamped."""
    bad = (au >= lay.inf) | (aw >= lay.inf)
    apart = ~bad & (aw == 0)
    zero = ~bad & ~apart & (au == 0)
    bu, key, mant = _binade(au, lay)
    shift = bu - _binade(aw, lay)[0]
    idx = jnp.clip(SUB * (shift - B_MIN) + (key & (SUB - 1)) + 1, 0, N_BINS - 1)
    slots = jnp.where(bad, NONFINITE, jnp.where(apart, APART, jnp.where(zero, ZERO, idx)))
    counted = ~(bad | apart | zero)
    top, offset = lay.window
    info = np.iinfo(lay.int)

    def keys(o, none):
        return jnp.where(counted, (jnp.clip(shift + o, -top - 1, top) << lay.mant) | mant, none)

    maxima = [keys(-offset, info.min), keys(offset, info.min)]
    return slots, maxima, [keys(offset, info.max), keys(-offset, info.max)]


def _elements(arrays: list, kind: str, lay: _Layout):
    """(slots, maxima, minima) of flat arrays: [x] ("hist"), [u, w] ("ratio") or [new, old] ("update":
    u = new - old, w = old, computed here so that the difference is never stored whole)."""
    if kind == "hist":
        return _hist_elements(_magnitude_bits(arrays[0], lay), lay)
    u, w = arrays
    if kind == "update":
        u = u.astype(lay.float) - w.astype(lay.float)
    return _ratio_elements(_magnitude_bits(u, lay), _magnitude_bits(w, lay), lay)


def _accumulate(carry, slots, maxima, minima, valid=None):
    counts, hi, lo = carry
    if valid is not None:  # a chunk's elements that an earlier chunk counted: to the IGNORE slot
        slots = jnp.where(valid, slots, IGNORE)
        maxima = [jnp.where(valid, k, np.iinfo(k.dtype).min) for k in maxima]
        minima = [jnp.where(valid, k, np.iinfo(k.dtype).max) for k in minima]
    counts = lax.scatter_add(counts, slots.astype(jnp.uint16)[:, None], jnp.ones(slots.shape, jnp.int32),
                             _SCATTER, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)  # fmt: skip
    ends = _reduce(maxima, minima)
    hi, lo = jnp.maximum(hi, jnp.stack(ends[: len(maxima)])), jnp.minimum(lo, jnp.stack(ends[len(maxima) :]))
    return counts, hi, lo


def _stats(parts: list[list], kind: str, lay: _Layout):
    """(counts[_SLOTS], maxima, minima) of several arrays (``parts``: one list of ``_elements``' arrays
    each) binned as one. Arrays over ``_CHUNK`` elements run in a loop over chunks (the last one shifted
    back to end at the array's end, its repeated elements masked): XLA's scatter is 2x faster on a
    cache-sized index array than on one it must first write to memory. The smaller ones are joined."""
    n_keys = 1 if kind == "hist" else 2
    info = np.iinfo(lay.int)
    carry = (jnp.zeros(_SLOTS + 1, jnp.int32), jnp.full(n_keys, info.min, lay.int),
             jnp.full(n_keys, info.max, lay.int))  # fmt: skip
    small = [[jnp.ravel(a) for a in arrays] for arrays in parts if arrays[0].size <= _CHUNK]
    if small:
        joined = [jnp.concatenate(column) if len(small) > 1 else column[0] for column in zip(*small)]
        carry = _accumulate(carry, *_elements(joined, kind, lay))
    for arrays in parts:
        n = arrays[0].size
        if n <= _CHUNK:
            continue
        flat = [jnp.ravel(a) for a in arrays]

        def body(i, carry, flat=flat, n=n):
            start = jnp.minimum(i * _CHUNK, n - _CHUNK)
            chunk = [lax.dynamic_slice(a, (start,), (_CHUNK,)) for a in flat]
            valid = start + lax.iota(jnp.int32, _CHUNK) >= i * _CHUNK if n % _CHUNK else None
            return _accumulate(carry, *_elements(chunk, kind, lay), valid)

        carry = lax.fori_loop(0, -(-n // _CHUNK), body, carry)
    counts, hi, lo = carry
    return counts[:_SLOTS], jnp.concatenate([hi, lo])


def _decode(extremes: np.ndarray, lay: _Layout, ratio: bool) -> tuple[float, float | None]:
    """(amax, amin_nonzero) from a group's extremes (on the host)."""
    info = np.iinfo(lay.int)
    if not ratio:
        hi, lo = (int(v) for v in extremes)
        value = np.array([hi, lo if lo != info.max else 0], lay.int).view(lay.float).tolist()
        return value[0], (value[1] if lo != info.max else None)
    top, offset = lay.window
    hi_a, hi_b, lo_a, lo_b = (int(v) for v in extremes)

    def value(k: int, o: int) -> float:  # (1 + m / 2^mant) * 2^s, rounded once as numpy's ldexp
        s, m = (k >> lay.mant) - o, k & (lay.normal - 1)
        try:
            return min(math.ldexp(1.0 + m / lay.normal, s), float(np.finfo(np.float64).max))
        except OverflowError:
            return float(np.finfo(np.float64).max)

    if hi_b == info.min:  # no element has a ratio
        return 0.0, None
    amax = value(hi_a, -offset) if hi_a >> lay.mant > -top - 1 else value(hi_b, offset)
    amin = value(lo_a, offset) if lo_a >> lay.mant < top else value(lo_b, -offset)
    return amax, (amin or None)  # a float64 ratio below 2^-1074 leaves amin unknown, as in the core


def _histogram(counts: np.ndarray, extremes: np.ndarray, lay: _Layout, ratio: bool) -> LogHistogram:
    """A LogHistogram from the counts and extremes that the program brought back."""
    amax, amin = _decode(extremes, lay, ratio)
    counts = np.asarray(counts, np.int64)
    return LogHistogram.from_counts(counts[:N_BINS], int(counts[ZERO]), int(counts[NONFINITE]), amax, amin,
                                    apart=int(counts[APART]))  # fmt: skip


@functools.partial(jax.jit, static_argnums=1)
def _hist_jit(x, lay):
    return _stats([[x]], "hist", lay)


@functools.partial(jax.jit, static_argnums=2)
def _ratio_jit(u, w, lay):
    return _stats([[u, w]], "ratio", lay)


def histogram(x) -> LogHistogram:
    """The ``LogHistogram`` of a floating jax array, binned by XLA (module docstring)."""
    lay = _layout(_check_array(x, "x").dtype)
    return _histogram(*jax.device_get(_hist_jit(x, lay)), lay, ratio=False)


def ratio_histogram(update, weight) -> LogHistogram:
    """``update_ratio_histogram(update, weight)`` of the core, binned by XLA."""
    u, w = _check_array(update, "update"), _check_array(weight, "weight")
    if u.shape != w.shape:
        raise PolyampError(f"update shape {u.shape} differs from weight's {w.shape}; expected the same")
    lay = _layout(u.dtype, w.dtype)
    return _histogram(*jax.device_get(_ratio_jit(u, w, lay)), lay, ratio=True)


def _check_array(x, name: str):
    if not isinstance(x, jax.Array):
        raise PolyampError(f"{name}: expected a jax array, got {_type(x)}; convert it with jnp.asarray")
    return x


# -- collect ---------------------------------------------------------------------------------------
def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None) -> list[Observation]:
    """Observe ``steps`` float32 training steps of the params pytree ``model`` on ``batch``; nothing
    passed in is changed (module docstring)."""
    leaves, treedef, paths = _check_params(model)
    batch_leaves = _check(batch, loss_fn, steps)
    optimizer, live, opt_state = _check_optimizer(optimizer)
    program = _program(loss_fn, optimizer, treedef, leaves, paths, batch, batch_leaves)
    if live:
        program.check_state(opt_state, model)
    floating = [leaf for leaf, f in zip(leaves, program.floating) if f]
    others = [leaf for leaf, f in zip(leaves, program.floating) if not f]
    runs = steps if optimizer is not None else 1
    if runs > 1 and not live:
        opt_state = optimizer.init(model)  # later steps take the state a step returns: one signature
    found = []
    for step in range(runs):
        out = program.run(floating, others, batch_leaves, opt_state, step + 1 < runs)
        found.append(out[0])
        if step + 1 < runs:
            new_leaves, opt_state = out[1]
            floating = [leaf for leaf, f in zip(new_leaves, program.floating) if f]
    found = jax.device_get(found)  # counts and extremes only, for all steps at once
    observations = []
    for g, (layer, kind, lay) in enumerate(program.groups):
        ratio, n = kind == "update_ratio", (4 if kind == "update_ratio" else 2)
        hists = [_histogram(counts[g], ends[g, :n], lay, ratio) for counts, ends in found] * (steps // runs)
        observations.append(Observation(layer, kind, hists[0].merge(*hists[1:]) if hists[1:] else hists[0]))
    return observations


def _type(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


def _check_params(model):
    try:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(model)
    except Exception as err:  # a pytree node whose flatten fails
        raise PolyampError(f"model: expected the params pytree of jax arrays, got {_type(model)}: "
                           f"{err}") from err  # fmt: skip
    leaves = [leaf for _, leaf in with_paths]
    for leaf in leaves:
        if not isinstance(leaf, jax.Array):
            numpy = isinstance(leaf, np.ndarray)
            hint = "; convert it with jax.tree.map(jnp.asarray, params)" if numpy else ""
            raise PolyampError(f"model: expected the params pytree of jax arrays (JAX's model is its "
                               f"params), got a leaf {_type(leaf)}{hint}")  # fmt: skip
    if not any(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves):
        which = "no leaves" if not leaves else "no floating-point leaf"
        raise PolyampError(f"model (params {_type(model)}) has {which}; the doctor observes the weights "
                           "it trains")  # fmt: skip
    return leaves, treedef, [leaf_name(path) or "params" for path, _ in with_paths]


def _check(batch, loss_fn, steps) -> list:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolyampError(f"steps must be a whole number >= 1, got {steps!r}")
    if loss_fn is None:
        raise PolyampError("loss_fn is required: JAX's model is its params, so the doctor needs "
                           "loss_fn(params, batch) -> scalar loss")  # fmt: skip
    if not callable(loss_fn):
        raise PolyampError(f"loss_fn must be callable(params, batch) -> scalar loss, got {_type(loss_fn)}")
    leaves = jax.tree.leaves(batch)
    for leaf in leaves:
        if not isinstance(leaf, jax.Array):
            how = {"torch": "jnp.asarray(t.numpy()) or jax.dlpack.from_dlpack(t)",
                   "tensorflow": "jnp.asarray(t.numpy())", "mxnet": "jnp.asarray(a.asnumpy())"}.get(
                detect(leaf), "jnp.asarray")  # fmt: skip
            raise PolyampError(f"batch: expected a pytree of jax arrays, got {_type(leaf)}; convert it "
                               f"with {how}")  # fmt: skip
    return leaves


def _check_optimizer(optimizer):
    """(optax transformation or None, whether a live state was given, that state or None)."""
    if optimizer is None or isinstance(optimizer, optax.GradientTransformation):
        return optimizer, False, None
    if (isinstance(optimizer, tuple) and len(optimizer) == 2
            and isinstance(optimizer[0], optax.GradientTransformation)):  # fmt: skip
        return optimizer[0], True, optimizer[1]
    raise PolyampError(f"optimizer: expected an optax GradientTransformation, a pair (optimizer, "
                       f"opt_state) or None, got {_type(optimizer)}")  # fmt: skip


def _program(loss_fn, optimizer, treedef, leaves, paths, batch, batch_leaves) -> _Program:
    """The cached _Program for these arguments' function, optimizer, structures and types."""
    key = (loss_fn, optimizer, treedef, jax.tree.structure(batch),
           tuple(jax.typeof(x) for x in (*leaves, *batch_leaves)))  # fmt: skip
    program = _PROGRAMS.get(key)
    if program is None:
        program = _Program(loss_fn, optimizer, treedef, leaves, paths, key[3], batch_leaves)
        _PROGRAMS[key] = program
        while len(_PROGRAMS) > _CACHE_SIZE:
            _PROGRAMS.popitem(last=False)
    _PROGRAMS.move_to_end(key)
    return program


class _Node:
    """A value of the traced jaxpr during the analysis: who made it, whether it is a floating output."""

    __slots__ = ("id", "layer", "floating", "param", "depends")

    def __init__(self, id, layer, floating, param=None, depends=False):  # noqa: A002
        self.id, self.layer, self.floating, self.param, self.depends = id, layer, floating, param, depends


def _walk(jaxpr, consts, args, scope: tuple[str, ...], visit) -> list:
    """Evaluate ``jaxpr`` with ``visit(eqn, invals, path)`` for each equation, the sub-jaxprs of
    ``_INLINED`` primitives inlined under the equation's scope path."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        path = scope + name_scopes(eqn)
        invals = [read(v) for v in eqn.invars]
        sub = None
        if eqn.primitive.name in _INLINED:
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if isinstance(sub, jcore.ClosedJaxpr):
            outs = _walk(sub.jaxpr, sub.consts, invals, path, visit)
        elif isinstance(sub, jcore.Jaxpr):
            outs = _walk(sub, (), invals, path, visit)
        else:
            outs = visit(eqn, invals, "/".join(path))
        for var, val in zip(eqn.outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = val
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals) -> list:
    """Bind ``eqn``'s primitive as ``core.eval_jaxpr`` does; always a list of outputs."""
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


class _Program:
    """``loss_fn`` traced and analysed once, and its tapped step jitted (module docstring)."""

    def __init__(self, loss_fn, optimizer, treedef, leaves, paths, batch_tree, batch_leaves):
        self.optimizer, self.treedef, self.batch_tree = optimizer, treedef, batch_tree
        self.floating = [_is_float(leaf.dtype) for leaf in leaves]
        n = len(leaves)

        def flat_loss(*xs):
            return loss_fn(jax.tree.unflatten(treedef, xs[:n]), jax.tree.unflatten(batch_tree, xs[n:]))

        try:
            self.closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(*leaves, *batch_leaves)
        except PolyampError:
            raise
        except (TypeError, ValueError) as err:  # shapes or dtypes the loss cannot take
            shapes = [tuple(x.shape) for x in batch_leaves]
            raise PolyampError(f"loss_fn(params, batch) failed on the batch (input shapes {shapes}): "
                               f"{err}") from err  # fmt: skip
        out = jax.tree.leaves(out_shape)
        if len(out) != 1 or out[0].shape != () or not _is_float(out[0].dtype):
            what = f"{out[0].dtype}{list(out[0].shape)}" if len(out) == 1 else _type(out_shape)
            raise PolyampError(f"loss_fn(params, batch) must return a scalar floating-point loss, got {what}")
        self._analyse(leaves, paths, len(batch_leaves))
        self.run = jax.jit(self._step, static_argnums=4)
        self._state_shape = None  # optimizer.init's, for check_state

    def _analyse(self, leaves, paths, n_batch) -> None:
        """An abstract walk of the jaxpr: the layers in order, the owner of each floating leaf, the
        tapped outputs (numbered by the order in which the walk produces values) and the (layer, kind)
        groups of the program's results, each with the layout its tensors are binned in."""
        layers: dict[str, None] = {}  # an ordered set
        owner: dict[int, str] = {}
        taps: dict[int, str] = {}
        avals: list = []  # of every produced value

        def visit(eqn, invals, layer):
            if layer:
                layers.setdefault(layer)
            for x in invals:
                if isinstance(x, _Node) and x.param is not None and x.param not in owner:
                    owner[x.param] = layer or paths[x.param]
                    layers.setdefault(owner[x.param])
                elif isinstance(x, _Node) and x.layer and x.layer != layer and x.floating:
                    taps.setdefault(x.id, x.layer)
            depends = any(isinstance(x, _Node) and x.depends for x in invals)
            avals.extend(v.aval for v in eqn.outvars)
            return [_Node(len(avals) - len(eqn.outvars) + k, layer, _is_float(v.aval.dtype), depends=depends)
                    for k, v in enumerate(eqn.outvars)]  # fmt: skip

        params = [_Node(-1, "", f, param=i if f else None, depends=f) for i, f in enumerate(self.floating)]
        (loss,) = _walk(self.closed.jaxpr, self.closed.consts, [*params, *[None] * n_batch], (), visit)
        if not (isinstance(loss, _Node) and loss.depends):
            raise PolyampError("the loss does not depend on any floating-point leaf of params; "
                               "loss_fn(params, batch) must compute the loss from params")  # fmt: skip
        if loss.layer:  # the loss itself is computed inside a scope
            taps.setdefault(loss.id, loss.layer)
        for i, f in enumerate(self.floating):
            if f and i not in owner:  # a leaf the loss never reads
                owner[i] = paths[i]
                layers.setdefault(paths[i])
        order = sorted(taps)
        self.tap_ids = {value: j for j, value in enumerate(order)}
        self.tap_avals = [jax.ShapeDtypeStruct(avals[v].shape, avals[v].dtype) for v in order]
        self.refs = {}  # (layer, kind) -> [(source, index)]: what the program bins for each group
        self.groups = []  # (layer, kind, _Layout), in layer then KINDS order
        for layer in layers:
            mine = [j for j, v in enumerate(order) if taps[v] == layer]
            own = [i for i in sorted(owner) if owner[i] == layer]
            stepped = own if self.optimizer is not None else []
            sources = {"output": [("tap", j) for j in mine], "grad_output": [("grad_tap", j) for j in mine],
                       "weight": [("param", i) for i in own], "grad_weight": [("grad", i) for i in own],
                       "update_ratio": [("update", i) for i in stepped]}  # fmt: skip
            for kind in KINDS:
                if sources[kind]:
                    self.refs[layer, kind] = sources[kind]
                    dtypes = [self.tap_avals[i].dtype if src.endswith("tap") else leaves[i].dtype
                              for src, i in sources[kind]]  # fmt: skip
                    self.groups.append((layer, kind, _layout(*dtypes)))

    def check_state(self, opt_state, params) -> None:
        """PolyampError unless ``opt_state`` has the structure, shapes and dtypes of ``optimizer.init``'s."""
        if self._state_shape is None:
            self._state_shape = jax.eval_shape(self.optimizer.init, params)
        want, got = self._state_shape, opt_state
        same = jax.tree.structure(want) == jax.tree.structure(got) and all(
            getattr(g, "shape", None) == w.shape and getattr(g, "dtype", None) == w.dtype
            for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got))
        )
        if not same:
            raise PolyampError(f"opt_state does not match optimizer.init(params): expected "
                               f"{jax.tree.structure(want)}, got {_type(got)} "
                               f"{jax.tree.structure(got)}")  # fmt: skip

    def _loss_and_taps(self, floating, others, batch_leaves, eps):
        """The loss, and each tapped output plus its (zero) perturbation."""
        it_f, it_o = iter(floating), iter(others)
        leaves = [next(it_f) if f else next(it_o) for f in self.floating]
        taps = [None] * len(eps)
        produced = iter(range(1 << 62))

        def visit(eqn, invals, layer):
            outs = _bind(eqn, invals)
            for k, out in enumerate(outs):
                j = self.tap_ids.get(next(produced))
                if j is not None:
                    outs[k] = taps[j] = lax.add(out, eps[j])
            return outs

        (loss,) = _walk(self.closed.jaxpr, self.closed.consts, [*leaves, *batch_leaves], (), visit)
        return loss, taps

    def _step(self, floating, others, batch_leaves, opt_state, want_next: bool):
        """The tapped step: stats per group in ``self.groups`` order, and (want_next) the new params'
        leaves and optimizer state."""
        eps = [jnp.zeros(a.shape, a.dtype) for a in self.tap_avals]
        (_, taps), (grads, grad_taps) = jax.value_and_grad(self._loss_and_taps, argnums=(0, 3), has_aux=True)(
            floating, others, batch_leaves, eps
        )
        it_f, it_o = iter(floating), iter(others)
        leaves = [next(it_f) if f else next(it_o) for f in self.floating]
        it_g = iter(grads)
        grad_leaves = [next(it_g) if f else None for f in self.floating]
        tensors = {"tap": taps, "grad_tap": grad_taps, "param": leaves, "grad": grad_leaves}
        new_leaves = None
        if self.optimizer is not None:
            params = jax.tree.unflatten(self.treedef, leaves)
            grads_tree = jax.tree.unflatten(
                self.treedef, [g if g is not None else jnp.zeros_like(x) for g, x in zip(grad_leaves, leaves)]
            )
            if opt_state is None:
                opt_state = self.optimizer.init(params)
            updates, opt_state = self.optimizer.update(grads_tree, opt_state, params)
            new_leaves = jax.tree.leaves(optax.apply_updates(params, updates))
        counts, ends = [], []
        wide = jnp.int64 if any(lay is _F64 for _, _, lay in self.groups) else jnp.int32
        for layer, kind, lay in self.groups:
            refs = self.refs[layer, kind]
            if kind == "update_ratio":
                c, e = _stats([[new_leaves[i], leaves[i]] for _, i in refs], "update", lay)
            else:
                c, e = _stats([[tensors[source][i]] for source, i in refs], "hist", lay)
            counts.append(c)
            ends.append(jnp.pad(e.astype(wide), (0, 4 - e.size)))
        stats = (jnp.stack(counts), jnp.stack(ends))  # two arrays to bring back: one transfer
        return stats, ((new_leaves, opt_state) if want_next else None)


__all__ = ["collect", "histogram", "ratio_histogram"]
