"""Flax NNX and Equinox modules named by their attribute paths while polyamp traces a function.

Neither library names its layers in the jaxpr (NNX emits no ``jax.named_scope``; Equinox names every
``Linear`` ``eqx.nn.Linear``), so polyamp does: while :func:`module_scopes` is active (autocast and the
doctor trace the user's function under it), each call of an NNX or Equinox module runs under a
``jax.named_scope`` of the module's path, marked with :data:`MARK` (``@blocks.0.attn.query``); an
equation's layer is then the innermost marked path on its name stack (``scopes.layer_of``), whatever
scopes lie around or inside it.

A module's path comes from its arrays: the tree being traced (the function's arguments) maps each array
leaf to its key path (``blocks.0.attn.query.kernel.value``); a called module's own leaves have paths
relative to it (``kernel.value``), so its path is what precedes them (``blocks.0.attn.query``; the root
module: its class name). This names a module however the function reaches it: passed in, rebuilt by
``nnx.merge`` from an ``nnx.State`` argument, or by ``eqx.combine`` from ``eqx.partition``'s halves. A
module none of whose arrays come from the tree (created inside the function) gets no scope.

The ``__call__`` of each module class found in the tree (with an ``nnx.State``: every NNX module class
defined) is wrapped for the duration of the trace and restored after; nothing else is changed. Neither
library is imported here: a module can only come from a library already imported.
"""

from __future__ import annotations

import contextlib
import sys

import jax

MARK = "@"  # the prefix of the named scopes that hold module paths

_active: list[dict[int, tuple[str, ...]]] = []  # the leaf maps of the traces under way, innermost last
_patched: dict[type, object] = {}  # class -> its own __call__ before the patch


def _nnx():
    flax = sys.modules.get("flax.nnx")
    return flax if flax is not None and hasattr(flax, "Module") else None


def _eqx():
    eqx = sys.modules.get("equinox")
    return eqx if eqx is not None and hasattr(eqx, "Module") else None


def is_model_node(x) -> bool:
    """An NNX module or state, or an Equinox module: a node whose array leaves are a model's weights."""
    nnx, eqx = _nnx(), _eqx()
    return bool((nnx is not None and isinstance(x, (nnx.Module, nnx.State)))
                or (eqx is not None and isinstance(x, eqx.Module)))  # fmt: skip


def key_name(key) -> str:
    """One pytree key as a name part: an attribute, a dict key or a sequence index."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _names(path) -> tuple[str, ...]:
    return tuple(key_name(k) for k in path)


def model_leaves(tree) -> list[bool]:
    """For each leaf of ``tree`` (``jax.tree.leaves`` order), whether it lies inside a model node."""
    flags: list[bool] = []
    for sub in jax.tree.leaves(tree, is_leaf=is_model_node):
        flags += [True] * len(jax.tree.leaves(sub)) if is_model_node(sub) else [False]
    return flags


def module_path(path) -> str:
    """A leaf's name inside a model: its keys joined by "." without NNX's trailing ``value``."""
    names = _names(path)
    return ".".join(names[:-1] if names[-1:] == ("value",) and len(names) > 1 else names)


def leaf_names(tree, skip: int = 0) -> list[str]:
    """A name for each leaf of ``tree``: inside a model, :func:`module_path` (``blocks.0.ln1.scale``),
    elsewhere its keys joined by "/" (``blocks/0/w``); ``skip`` leading keys left out."""
    flags = model_leaves(tree)
    with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [module_path(p[skip:]) if inside else "/".join(_names(p[skip:]))
            for (p, _), inside in zip(with_paths, flags)]  # fmt: skip


@contextlib.contextmanager
def module_scopes(tree, skip: int = 0):
    """While active, each call of an NNX or Equinox module whose arrays come from ``tree`` runs under
    ``jax.named_scope(MARK + path)`` (module docstring); ``skip``: leading keys of ``tree``'s paths that
    are not part of the names (autocast's ``(args, kwargs)`` and the argument's position)."""
    classes = _module_classes(tree)
    if not classes:
        yield
        return
    paths = {id(leaf): _names(path[skip:]) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
             if isinstance(leaf, jax.Array)}  # fmt: skip
    mine = [cls for cls in classes if cls not in _patched]
    for cls in mine:
        _patched[cls] = cls.__dict__["__call__"]
        cls.__call__ = _named_call(_patched[cls])
    _active.append(paths)
    try:
        yield
    finally:
        _active.remove(paths)
        for cls in mine:
            cls.__call__ = _patched.pop(cls)


def _named_call(original):
    def __call__(self, *args, **kwargs):
        call = original.__get__(self, type(self))
        path = _path_of(self)
        if path is None:
            return call(*args, **kwargs)
        with jax.named_scope(MARK + (".".join(path) or type(self).__name__)):
            return call(*args, **kwargs)

    __call__.__wrapped__ = original
    return __call__


def _path_of(module) -> tuple[str, ...] | None:
    """The path of ``module`` in the tree of a trace under way (module docstring), or None."""
    for rel, leaf in _own_leaves(module):
        for paths in reversed(_active):
            full = paths.get(id(leaf))
            if full is not None and len(full) >= len(rel) and full[len(full) - len(rel):] == rel:
                return full[: len(full) - len(rel)]
    return None


def _own_leaves(module):
    nnx = _nnx()
    tree = nnx.state(module) if nnx is not None and isinstance(module, nnx.Module) else module
    return [(_names(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(leaf, jax.Array)]  # fmt: skip


def _module_classes(tree) -> list[type]:
    """The classes whose ``__call__`` to wrap: the one defining ``__call__`` for each module type found
    in ``tree`` (every NNX module class if ``tree`` holds an ``nnx.State``)."""
    nnx, eqx = _nnx(), _eqx()
    if nnx is None and eqx is None:
        return []
    found: dict[type, None] = {}
    states = False

    def visit(node):
        nonlocal states
        if nnx is not None and isinstance(node, nnx.State):
            states = True
        elif nnx is not None and isinstance(node, nnx.Module):
            found.update((type(n), None) for _, n in nnx.iter_graph(node) if isinstance(n, nnx.Module))
        elif eqx is not None and isinstance(node, eqx.Module):
            found[type(node)] = None
            for sub in jax.tree.leaves(node, is_leaf=lambda x: x is not node and is_model_node(x)):
                if sub is not node and is_model_node(sub):
                    visit(sub)

    for node in jax.tree.leaves(tree, is_leaf=is_model_node):
        if is_model_node(node):
            visit(node)
    if states:
        found.update((cls, None) for cls in _subclasses(nnx.Module))
    bases = tuple(b.Module for b in (nnx, eqx) if b is not None)
    owners: dict[type, None] = {}
    for cls in found:
        owner = next((c for c in cls.__mro__ if "__call__" in c.__dict__), None)
        if owner is not None and issubclass(owner, bases) and owner not in bases:
            owners[owner] = None
    return list(owners)


def _subclasses(cls) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


__all__ = ["MARK", "is_model_node", "leaf_names", "model_leaves", "module_path", "module_scopes"]
