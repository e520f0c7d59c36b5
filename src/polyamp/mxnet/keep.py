"""Layers as the doctor and ``keep_fp32`` name them, and float32 under MXNet's process-wide contrib.amp.

Importing this module (``ops.py`` does, before any ``amp.init``) keeps the operator functions of ``mx.nd``
and ``mx.sym`` as they were before contrib.amp patched them. ``keep_fp32`` hands them to the kept blocks'
``hybrid_forward`` (``Float32Block``); the doctor swaps them in for its step (``float32_operators``).
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from typing import Any, NamedTuple

import numpy as np

from ..errors import PolyampError, UnsupportedError
from ..mixed_precision import kept, unmatched_layers

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import gluon
    from mxnet.contrib import amp

def dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype).names == ("bfloat16",) else np.dtype(dtype).name


def _op_modules(root) -> list[types.ModuleType]:
    """The modules whose functions ``amp.init`` replaces (its ``_wrap_symbol_functions``)."""
    prefixed = [getattr(root, prefix[1:-1]) for prefix in mx.base._OP_NAME_PREFIX_LIST]
    return [root, root.op, root._internal, *prefixed]


# the operator functions before contrib.amp patched them (None: amp.init ran before this import)
_ORIGINAL_OPS: dict[str, dict[str, Any]] | None = (
    None
    if amp.amp._amp_initialized
    else {m.__name__: dict(vars(m)) for root in (mx.nd, mx.sym) for m in _op_modules(root)}
)
_LOSS_OUTPUT_OPS = frozenset(amp.list_loss_output_functions("float16"))


# -- layers, and float32 under contrib.amp (keep_fp32, the doctor) ---------------------------------
class Layer(NamedTuple):
    """One layer as the doctor and ``keep_fp32`` name it: a block observed as a whole (``leaf``), or
    a parameter of a block with parameters below it (``block`` is that owner), with the parameters
    it observes."""

    name: str
    block: Any
    params: list
    leaf: bool


def layers(model) -> list[Layer]:
    """The layers of a Gluon block, depth-first through its children as ``collect_params`` walks them.

    A layer is a leaf block, or a block that owns parameters while the blocks below it own none
    (``Dense(..., activation="relu")`` and its ``act`` child are one layer): it is named by its path
    of child names (``0``, ``body.1.dense``; a model that is itself a layer by its class name) and
    holds its parameters. A parameter of any other block is a layer of its own (``embed``,
    ``body.scale``: the owner's path and the parameter's attribute name). Each parameter is in the
    first layer that owns it; non-differentiable ones (BatchNorm's running statistics, MXNet's
    auxiliary states) are in none."""
    out: list[Layer] = []
    seen: set[int] = set()

    def walk(block, path: str) -> None:
        own = _own_parameters(block)
        children = block._children.values()
        whole = not children or (own and not any(_owns_parameters(c) for c in children))
        own = [(n, p) for n, p in own if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        own = [(n, p) for n, p in own if getattr(p, "_differentiable", True)]
        if whole:
            out.append(Layer(path or type(block).__name__, block, [p for _, p in own], True))
            return
        out.extend(Layer(f"{path}.{n}" if path else n, block, [p], False) for n, p in own)
        for name, child in block._children.items():
            walk(child, f"{path}.{name}" if path else name)

    walk(model, "")
    return out


def blocks(model) -> list[tuple[str, Any]]:
    """(path, block) of ``model`` and every block below it, depth-first (the model's path is "")."""
    out, stack = [], [("", model)]
    while stack:
        path, block = stack.pop()
        out.append((path, block))
        stack.extend(reversed([(f"{path}.{n}" if path else n, c) for n, c in block._children.items()]))
    return out


def _owns_parameters(block) -> bool:
    """Whether ``block`` or a block below it has a parameter."""
    return bool(len(block.collect_params().keys()))


def _own_parameters(block) -> list[tuple[str, Any]]:
    """(attribute name, Parameter) of a block's own parameters: its attributes, then the rest of
    ``block.params`` named without the block's prefix."""
    own = list(block._reg_params.items())
    ids = {id(p) for _, p in own}
    for full, p in block.params.items():
        if id(p) not in ids:
            own.append((full[len(block.prefix) :] if full.startswith(block.prefix) else full, p))
    return own


def _originals() -> dict[str, dict[str, Any]]:
    if _ORIGINAL_OPS is None:
        raise PolyampError(
            "contrib.amp.init ran before polyamp.mxnet was imported, so polyamp cannot reach MXNet's "
            "float32 operators (amp.init replaced them); import polyamp.mxnet (or create "
            "MixedPrecision(..., framework='mxnet'), which calls amp.init itself) before amp.init"
        )
    return _ORIGINAL_OPS


@contextlib.contextmanager
def float32_operators():
    """MXNet's operator functions as they were before ``amp.init`` (and polyamp's loss-output
    wrappers) replaced them, process-wide until the block exits: a float32 run in a process whose
    contrib.amp casts to 16 bits (a no-op when amp is off)."""
    swapped = []
    if amp.amp._amp_initialized:
        for name, original in _originals().items():
            module = sys.modules[name]
            current = vars(module)
            for attr, f in [(a, f) for a, f in original.items() if current.get(a, f) is not f]:
                swapped.append((module, attr, current[attr]))
                setattr(module, attr, f)
    try:
        yield
    finally:
        for module, attr, patched in swapped:
            setattr(module, attr, patched)


class _Float32Namespace:
    """``F`` for a kept block's ``hybrid_forward``: ``mx.nd`` / ``mx.sym`` (and their submodules)
    with the operators amp.init replaced put back, except the loss-output ops, whose polyamp
    wrappers follow the loss scale."""

    _cache: dict[str, _Float32Namespace] = {}

    def __init__(self, module: types.ModuleType):
        self._module = module
        self._ops = _originals().get(module.__name__, {})

    @classmethod
    def of(cls, module: Any) -> Any:
        if not isinstance(module, types.ModuleType) or module.__name__ not in _originals():
            return module
        if module.__name__ not in cls._cache:
            cls._cache[module.__name__] = cls(module)
        return cls._cache[module.__name__]

    def __getattr__(self, name: str) -> Any:
        value = self._ops.get(name) if name not in _LOSS_OUTPUT_OPS else None
        value = getattr(self._module, name) if value is None else value
        value = _Float32Namespace.of(value)
        self.__dict__[name] = value
        return value


def _as_float32(F, x):
    """A 16-bit float input (NDArray) or any Symbol as float32 (amp_cast leaves other dtypes)."""
    if isinstance(x, mx.sym.Symbol) or (
        isinstance(x, mx.nd.NDArray) and dtype_name(x.dtype) in ("float16", "bfloat16")
    ):
        return F.amp_cast(x, dtype="float32")
    if isinstance(x, (list, tuple)):
        return type(x)(_as_float32(F, v) for v in x)
    return x


class Float32Block:
    """A ``keep_fp32`` handle: the block's ``hybrid_forward`` runs with ``_Float32Namespace`` as
    ``F`` and its inputs cast to float32 (an instance attribute shadowing the class's method), so
    it computes in float32 imperatively and in a hybridized graph alike; ``remove()`` undoes it."""

    def __init__(self, name: str, block, model):
        self.name, self.block, self.model = name, block, model
        self._own = vars(block).get("hybrid_forward")
        forward = block.hybrid_forward

        def hybrid_forward(F, *args, **kwargs):
            F = _Float32Namespace.of(F)
            return forward(F, *(_as_float32(F, a) for a in args), **kwargs)

        hybrid_forward.keeps = name
        vars(block)["hybrid_forward"] = hybrid_forward

    def remove(self) -> None:
        if self._own is None:
            vars(self.block).pop("hybrid_forward", None)
        else:
            vars(self.block)["hybrid_forward"] = self._own
        _clear_cached_graphs(self.model)


def _clear_cached_graphs(model) -> None:
    """Make every hybridized block under ``model`` trace its graph again at the next call."""
    for _, block in blocks(model):
        if isinstance(block, gluon.HybridBlock):
            block._clear_cached_op()


def keep_float32(model, keep_fp32: tuple[str, ...]) -> list[Float32Block]:
    """Make the ``keep_fp32`` layers of a Gluon ``model`` compute in float32 under contrib.amp.

    A name keeps the block of that path (or the leaf of that layer name) and every block below it;
    a parameter layer (``embed``) keeps its owner's own operations, not its children's. Each kept
    HybridBlock gets a ``Float32Block``; the model's cached graphs are cleared, so a hybridized
    model traces them again. A kept leaf that is a plain ``Block`` (no ``hybrid_forward`` to hand
    ``F`` to) is refused."""
    if not isinstance(model, gluon.Block):
        raise PolyampError(
            f"expected a mxnet.gluon.Block, got {type(model).__module__}.{type(model).__name__}"
        )
    table = layers(model)
    paths = blocks(model)
    names = list(dict.fromkeys([layer.name for layer in table] + [p for p, _ in paths if p]))
    unmatched_layers(keep_fp32, names)
    chosen: dict[int, tuple[str, Any]] = {}
    for path, block in paths:
        name = path or (type(block).__name__ if not block._children else "")
        if name and kept(name, keep_fp32):
            chosen.setdefault(id(block), (name, block))
    for layer in table:
        if not layer.leaf and kept(layer.name, keep_fp32):
            chosen.setdefault(id(layer.block), (layer.name, layer.block))
    handles = []
    for name, block in chosen.values():
        if getattr(vars(block).get("hybrid_forward"), "keeps", None) is not None:
            continue  # kept by an earlier mp.watch
        if not isinstance(block, gluon.HybridBlock):
            if not block._children:
                raise UnsupportedError(
                    f"keep_fp32 names {name!r}, a {type(block).__name__} (a plain gluon.Block): its "
                    "forward calls mx.nd directly, where contrib.amp's casts cannot be undone; make it a "
                    "HybridBlock (hybrid_forward(self, F, ...)) or keep the HybridBlocks inside it"
                )
            continue  # its HybridBlock children are kept in their own right
        handles.append(Float32Block(name, block, model))
    _clear_cached_graphs(model)
    return handles
