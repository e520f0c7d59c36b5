"""The doctor's JAX taps: ``collect(params, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the JAX idiom): the model is its ``params`` pytree; ``loss_fn(params, batch)`` returns the
scalar loss (required: JAX has no module that knows its loss); ``batch`` is any pytree of jax arrays;
``optimizer`` is an optax ``GradientTransformation`` (its state ``optimizer.init(params)``) or a pair
``(optimizer, opt_state)`` to step from a live state.

The model may also be a Flax NNX or an Equinox module (its leaves that are not arrays pass through;
the optimizer steps its array leaves). Layers are the module paths of NNX / Equinox modules
(``modules.py``: ``blocks.0.attn``), else ``jax.named_scope`` paths (``scopes.layer_of``).
``loss_fn`` is traced to a jaxpr (``jax.make_jaxpr``); each equation's
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

Binning is ``binning.py``'s: inside the program, integer arithmetic, exact.

Measured formats (``measure``: block formats and recipes, ``doctor/blocks.py``): the program also returns
the tapped tensors (a second compiled form, for that call only), and each is cast outside it by
``polyamp.jax.quantize`` (tensorwise: ``polyamp.jax.recipe.tensorwise`` at the host's scale) and counted
with JAX ops (``measure_tensor``: integer bit patterns for the counts, float64 sums); the blocks' amaxes
go to the host for the clip thresholds (``blocks.plan``).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jcore

from ..doctor import blocks as _blocks
from ..doctor.recommend import KINDS, Observation
from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..frameworks import detect
from .binning import _F64, _histogram, _layout, _stats, histogram, ratio_histogram
from .doctor_measure import OPS as _MEASURE_OPS
from .doctor_recipe import RecipeOperands, layout
from .modules import leaf_names, model_leaves, module_scopes
from .scopes import layer_of, name_scopes

_INLINED = {"jit", "pjit", "closed_call", "core_call", "call", "remat2", "checkpoint"}
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()  # key -> _Program, least recent first
_CACHE_SIZE = 8


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None, measure=()) -> list[Observation]:
    """Observe ``steps`` float32 training steps of the params pytree ``model`` on ``batch``; nothing
    passed in is changed (module docstring). ``measure``: ``blocks.Target``s."""
    params = _check_params(model)
    leaves = params.leaves
    batch_leaves = _check(batch, loss_fn, steps)
    optimizer, live, opt_state = _check_optimizer(optimizer)
    program = _program(loss_fn, optimizer, params, batch, batch_leaves)
    if live:
        program.check_state(opt_state, params.arrays)
    floating = [leaf for leaf, f in zip(leaves, program.floating) if f]
    others = [leaf for leaf, f in zip(leaves, program.floating) if not f]
    runs = steps if optimizer is not None else 1
    if runs > 1 and not live:
        opt_state = optimizer.init(params.arrays)  # later steps take the state a step returns: one signature
    found, parts = [], collections.defaultdict(lambda: collections.defaultdict(list))
    for step in range(runs):
        out = program.run(floating, others, batch_leaves, opt_state, step + 1 < runs, bool(measure))
        found.append(out[0])
        for (layer, kind, _), tensors in zip(program.groups, out[2] or ()):
            for target in measure:
                if kind in target.casts:
                    ms = [measure_tensor(t, target.casts[kind]) for t in program.measured(
                        layer, kind, tensors, target.label.startswith(_blocks.PREFIX))]  # fmt: skip
                    if ms:
                        parts[layer, kind][target.label] += ms * (steps // runs)
        if step + 1 < runs:
            new_leaves, opt_state = out[1]
            floating = [leaf for leaf, f in zip(new_leaves, program.floating) if f]
    found = jax.device_get(found)  # counts and extremes only, for all steps at once
    observations = []
    for g, (layer, kind, lay) in enumerate(program.groups):
        ratio, n = kind == "update_ratio", (4 if kind == "update_ratio" else 2)
        hists = [_histogram(counts[g], ends[g, :n], lay, ratio) for counts, ends in found] * (steps // runs)
        hist = hists[0].merge(*hists[1:]) if hists[1:] else hists[0]
        observations.append(Observation(layer, kind, hist, _blocks.merged(parts, (layer, kind))))
    return observations


class _Params(NamedTuple):
    """The model's array leaves (``leaves``, named ``names``), ``arrays`` the model with None in place of
    its other leaves (what the optimizer steps; ``treedef`` its structure), ``rebuild(leaves)`` the model
    from new array leaves, and ``key`` what identifies the other leaves (for the program cache)."""

    leaves: list
    treedef: Any
    names: list[str]
    arrays: Any
    rebuild: Callable
    key: tuple


def _check_params(model) -> _Params:
    """The model's leaves: jax arrays; inside an Equinox or NNX module, also other values (functions such
    as ``jax.nn.relu``), which pass through untouched as ``eqx.partition`` leaves them."""
    try:
        with_paths, full = jax.tree_util.tree_flatten_with_path(model)
    except Exception as err:  # a pytree node whose flatten fails
        raise PolyampError(f"model: expected the params pytree of jax arrays, got {_type(model)}: "
                           f"{err}") from err  # fmt: skip
    every = [leaf for _, leaf in with_paths]
    for leaf, inside in zip(every, model_leaves(model)):
        if not isinstance(leaf, jax.Array) and (isinstance(leaf, np.ndarray) or not inside):
            numpy = isinstance(leaf, np.ndarray)
            hint = "; convert it with jax.tree.map(jnp.asarray, params)" if numpy else ""
            raise PolyampError(f"model: expected the params pytree of jax arrays (JAX's model is its "
                               f"params) or a Flax NNX / Equinox module, got a leaf "
                               f"{_type(leaf)}{hint}")  # fmt: skip
    mask = [isinstance(leaf, jax.Array) for leaf in every]
    leaves = [leaf for leaf, m in zip(every, mask) if m]
    if not any(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in leaves):
        which = "no leaves" if not leaves else "no floating-point leaf"
        raise PolyampError(f"model (params {_type(model)}) has {which}; the doctor observes the weights "
                           "it trains")  # fmt: skip
    others = [leaf for leaf, m in zip(every, mask) if not m]
    arrays = jax.tree.unflatten(full, [x if m else None for x, m in zip(every, mask)]) if others else model

    def rebuild(xs):
        it = iter(xs)
        return jax.tree.unflatten(full, [next(it) if m else x for x, m in zip(every, mask)])

    names = [n or "params" for n, m in zip(leaf_names(model), mask) if m]
    key = (full, tuple(x if _hashable(x) else id(x) for x in others))
    return _Params(leaves, jax.tree.structure(arrays), names, arrays, rebuild, key)


def _hashable(x) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


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


def _program(loss_fn, optimizer, params: _Params, batch, batch_leaves) -> _Program:
    """The cached _Program for these arguments' function, optimizer, structures and types."""
    key = (loss_fn, optimizer, params.key, jax.tree.structure(batch),
           tuple(jax.typeof(x) for x in (*params.leaves, *batch_leaves)))  # fmt: skip
    program = _PROGRAMS.get(key)
    if program is None:
        program = _Program(loss_fn, optimizer, params, key[3], batch_leaves)
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
            outs = visit(eqn, invals, layer_of(path))
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

    def __init__(self, loss_fn, optimizer, params: _Params, batch_tree, batch_leaves):
        self.optimizer, self.treedef, self.batch_tree = optimizer, params.treedef, batch_tree
        leaves, paths = params.leaves, params.names
        self.floating = [_is_float(leaf.dtype) for leaf in leaves]
        n = len(leaves)

        def flat_loss(*xs):
            model = params.rebuild(xs[:n])
            with module_scopes(model):  # NNX / Equinox modules named by their paths
                return loss_fn(model, jax.tree.unflatten(batch_tree, xs[n:]))

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
        self.run = jax.jit(self._step, static_argnums=(4, 5))
        self._state_shape = None  # optimizer.init's, for check_state

    def _analyse(self, leaves, paths, n_batch) -> None:
        """An abstract walk of the jaxpr: the layers in order, the owner of each floating leaf, the
        tapped outputs (numbered by the order in which the walk produces values) and the (layer, kind)
        groups of the program's results, each with the layout its tensors are binned in."""
        layers: dict[str, None] = {}  # an ordered set
        owner: dict[int, str] = {}
        taps: dict[int, str] = {}
        avals: list = []  # of every produced value

        operands = RecipeOperands(self.closed.jaxpr, self.floating)

        def visit(eqn, invals, layer):
            operands.visit(eqn, invals, layer)
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
        self.recipe_refs = {}  # (layer, kind) -> per ref, the layout a recipe measures it in, or None
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
                    hows = [operands.how(src, i, order, taps) for src, i in sources[kind]]
                    self.recipe_refs[layer, kind] = hows
                    dtypes = [self.tap_avals[i].dtype if src.endswith("tap") else leaves[i].dtype
                              for src, i in sources[kind]]  # fmt: skip
                    self.groups.append((layer, kind, _layout(*dtypes)))

    def measured(self, layer: str, kind: str, tensors: list, recipe: bool) -> list:
        """The tensors of group ``(layer, kind)`` a block format measures (every one, kernels in
        ``blocks.gemm_layout``) or a recipe does (``doctor_recipe``), laid out for it."""
        if not recipe:
            return [_blocks.gemm_layout(t, kind) for t in tensors]
        hows = self.recipe_refs[layer, kind]
        return [layout(t, how, kind) for t, how in zip(tensors, hows) if how is not None]

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

    def _step(self, floating, others, batch_leaves, opt_state, want_next: bool, keep: bool = False):
        """The tapped step: stats per group in ``self.groups`` order, (want_next) the new params'
        leaves and optimizer state, and (keep) each group's tensors (updates: none)."""
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
        kept = None
        if keep:
            kept = [[] if kind == "update_ratio" else [tensors[src][i] for src, i in self.refs[layer, kind]]
                    for layer, kind, _ in self.groups]  # fmt: skip
        return stats, ((new_leaves, opt_state) if want_next else None), kept


__all__ = ["collect", "histogram", "ratio_histogram"]


def measure_tensor(t, cast: _blocks.Cast) -> _blocks.Measured:
    """``blocks.measure`` of a JAX array, on its device (``measure_on`` over ``doctor_measure.OPS``)."""
    return _blocks.measure_on(_MEASURE_OPS, t, cast)
