"""``jax.named_scope`` paths of a jaxpr's equations and names of pytree leaves: how the doctor,
``keep_fp32`` and the recipes name a JAX model's layers.

An equation's scope path is the tuple of ``Scope`` names on its name stack (prefixed by those of the
equations that hold its jaxpr); its layer (:func:`layer_of`) is the innermost NNX / Equinox module path
on it (``modules.py`` marks those scopes: ``blocks.0.attn.query``), else the scopes joined by "/"
(``block1/ff1``).
"""

from __future__ import annotations

from jax.extend import core as jcore

from .modules import MARK


def name_scopes(eqn) -> tuple[str, ...]:
    """The ``jax.named_scope`` names an equation was traced under, outermost first, relative to the
    jaxpr that holds it (transforms such as ``jvp`` left out)."""
    return tuple(s.name for s in eqn.source_info.name_stack.stack if type(s).__name__ == "Scope")


def layer_of(path: tuple[str, ...] | None) -> str:
    """The layer of a scope path: its innermost module path, else its scopes joined by "/"."""
    if not path:
        return ""
    for name in reversed(path):
        if name.startswith(MARK):
            return name[len(MARK) :]
    return "/".join(path)


def scope_paths(jaxpr, scope: tuple[str, ...] = ()):
    """The layer (:func:`layer_of`) of every equation of ``jaxpr`` and of its sub-jaxprs that has one
    (with duplicates)."""
    for eqn in jaxpr.eqns:
        path = scope + name_scopes(eqn)
        if path:
            yield layer_of(path)
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from scope_paths(sub, path)
