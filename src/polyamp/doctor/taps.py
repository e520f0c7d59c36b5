"""What every front end's taps share: naming a received object, walking a nested batch."""

from __future__ import annotations


def type_name(x) -> str:
    """``module.QualName`` of ``x``'s type, for error messages."""
    return f"{type(x).__module__}.{type(x).__qualname__}"


def leaves(x) -> list:
    """The leaves of nested tuples, lists and dicts (a batch), in order."""
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in leaves(v)]
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in leaves(v)]
    return [x]
