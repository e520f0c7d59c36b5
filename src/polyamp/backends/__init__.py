"""Backend registry: a framework is found from an object's type through ``sys.modules``.

No framework is imported here: an object can only belong to a framework that is already
imported, so looking at ``type(x).__module__`` and ``sys.modules`` is enough.
"""

from __future__ import annotations

import importlib
import sys
from functools import cache
from typing import Any

from ..errors import PolyampError, invalid
from ._base import Backend

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet")
_MODULE_ROOTS = {"torch": "torch", "tensorflow": "tensorflow", "keras": "tensorflow",
                 "tf_keras": "tensorflow", "jax": "jax", "jaxlib": "jax", "optax": "jax",
                 "flax": "jax", "mxnet": "mxnet"}  # fmt: skip


# common names for the frameworks -> polyamp's
ALIASES = {"pytorch": "torch", "tf": "tensorflow", "keras": "tensorflow", "tf.keras": "tensorflow",
           "flax": "jax", "mx": "mxnet", "gluon": "mxnet"}  # fmt: skip


def canonical_framework(name: Any) -> str:
    """polyamp's name for a framework name or alias ('pytorch' -> 'torch'), else PolyampError."""
    key = name.strip().lower() if isinstance(name, str) else None
    key = ALIASES.get(key, key)
    if key not in FRAMEWORKS:
        raise invalid("framework", name, [*FRAMEWORKS, *ALIASES])
    return key


def detect(obj: Any) -> str | None:
    """The framework an object (tensor, model, optimizer) belongs to, or None."""
    for cls in type(obj).__mro__:
        root = cls.__module__.split(".")[0]
        if root in _MODULE_ROOTS and _MODULE_ROOTS[root] in sys.modules:
            return _MODULE_ROOTS[root]
    return None


def imported_frameworks() -> list[str]:
    return [name for name in FRAMEWORKS if name in sys.modules]


@cache
def get_backend(name: str) -> Backend:
    """The backend for a framework name; imports that framework."""
    name = canonical_framework(name)
    try:
        module = importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{name}":
            raise PolyampError(f"polyamp has no {name} backend yet") from None
        if err.name and err.name.split(".")[0] in (name, "keras"):
            raise PolyampError(
                f"framework {name!r} is not installed; install it with pip install 'polyamp[{name}]'"
            ) from err
        raise
    return module.BACKEND


__all__ = ["ALIASES", "FRAMEWORKS", "Backend", "canonical_framework", "detect", "get_backend",
           "imported_frameworks"]
