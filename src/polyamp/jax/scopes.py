"""``jax.named_scope`` paths of a jaxpr's equations and names of pytree leaves: how the doctor and
``keep_fp32`` name a JAX model's layers."""

from __future__ import annotations

from jax.extend import core as jcore


def name_scopes(eqn) -> tuple[str, ...]:
    """The ``jax.named_scope`` names an equation was traced under, outermost first, relative to the
    jaxpr that holds it (transforms such as ``jvp`` left out)."""
    return tuple(s.name for s in eqn.source_info.name_stack.stack if type(s).__name__ == "Scope")


def leaf_name(path) -> str:
    """A pytree leaf's name from its key path: the keys joined by "/" (``embed``, ``blocks/0/w``)."""
    names = (next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k) for k in path)
    return "/".join(map(str, names))


def scope_paths(jaxpr, scope: tuple[str, ...] = ()):
    """The scope path of every equation of ``jaxpr`` and of its sub-jaxprs (with duplicates)."""
    for eqn in jaxpr.eqns:
        path = scope + name_scopes(eqn)
        if path:
            yield "/".join(path)
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from scope_paths(sub, path)
