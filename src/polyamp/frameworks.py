"""Which framework an object belongs to, and which front end drives it.

No framework is imported here: an object can only belong to a framework that is already
imported, so looking at ``type(x).__module__`` and ``sys.modules`` is enough. A front end
(``polyamp.torch``, ``polyamp.tensorflow``, ``polyamp.jax``, ``polyamp.mxnet``) imports its
framework when it is first imported itself.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .errors import PolyampError, invalid

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet")
_MODULE_ROOTS = {"torch": "torch", "tensorflow": "tensorflow", "keras": "tensorflow",
                 "tf_keras": "tensorflow", "jax": "jax", "jaxlib": "jax", "optax": "jax",
                 "flax": "jax", "equinox": "jax", "mxnet": "mxnet"}  # fmt: skip

# common names for the frameworks -> polyamp's
ALIASES = {"pytorch": "torch", "tf": "tensorflow", "tf.keras": "tensorflow", "flax": "jax", "mx": "mxnet",
           "gluon": "mxnet"}  # fmt: skip

# the methods that only one framework's MixedPrecision has; ``backward``, ``step``, ``watch``, ``autocast``
# and ``optimizer`` (Keras's wrapped optimizer; torch's and optax's under a training-state policy) are
# shared (tests/test_front_ends.py checks this table against the classes)
IDIOMS = {
    "unscale_": "torch",
    "scope": "tensorflow", "scale": "tensorflow", "apply": "tensorflow",
    "callback": "tensorflow",
    "init": "jax", "update": "jax", "grad": "jax", "value_and_grad": "jax", "sync": "jax",
    "trainer": "mxnet", "scale_loss": "mxnet",
}  # fmt: skip


# the Keras idioms: the tensorflow front end's on Keras's TensorFlow backend; on its JAX and torch backends
# polyamp.keras's, the one front end that is not a framework of its own
KERAS_IDIOMS = ("scope", "callback")


def keras_backend() -> str:
    """The backend Keras runs on (``keras.backend.backend()`` once Keras is imported), or will run on:
    ``KERAS_BACKEND``, else the ``backend`` of ``$KERAS_HOME/keras.json`` (``~/.keras``), else tensorflow,
    as Keras itself chooses."""
    if "keras" in sys.modules and hasattr(sys.modules["keras"], "backend"):
        return sys.modules["keras"].backend.backend()
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    config = Path(os.environ.get("KERAS_HOME", Path.home() / ".keras")) / "keras.json"
    try:
        return json.loads(config.read_text()).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def keras_front_end() -> str:
    """The front end that drives Keras here: 'tensorflow' on that backend, else 'keras'."""
    return "tensorflow" if keras_backend() == "tensorflow" else "keras"


def idiom_owner(method: str) -> str | None:
    """The front end whose idiom ``method`` is (``IDIOMS``; the Keras ones by the Keras backend)."""
    return keras_front_end() if method in KERAS_IDIOMS else IDIOMS.get(method)


def canonical_framework(name: Any) -> str:
    """polyamp's name for a framework name or alias ('pytorch' -> 'torch'; 'keras' -> 'tensorflow' or,
    on Keras's JAX and torch backends, 'keras'), else PolyampError."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key == "keras":
        return keras_front_end()
    key = ALIASES.get(key, key)
    if key not in FRAMEWORKS:
        raise invalid("framework", name, [*FRAMEWORKS, "keras", *ALIASES])
    return key


def detect(obj: Any) -> str | None:
    """The framework an object (tensor, model, optimizer) belongs to, or None."""
    for cls in type(obj).__mro__:
        root = cls.__module__.split(".")[0]
        if root == "keras" and keras_front_end() == "keras":
            return "keras"
        if root in _MODULE_ROOTS and _MODULE_ROOTS[root] in sys.modules:
            return _MODULE_ROOTS[root]
    return None


def imported_frameworks() -> list[str]:
    return [name for name in FRAMEWORKS if name in sys.modules]


def front_end_module(name: str, part: str | None = None) -> ModuleType:
    """``polyamp.<name>`` or its module ``polyamp.<name>.<part>``, imported (which imports the framework).

    The one place the core reaches a front end (the dependency test allows ``importlib`` nowhere else
    in it): the factory, the doctor's taps (``doctor``), tune's steps (``tune``) and the ops of a tensor
    (``xp``) come through here. A framework that is not installed is a ``PolyampError``.
    """
    name = canonical_framework(name)
    try:
        return importlib.import_module(f"polyamp.{name}" + (f".{part}" if part else ""))
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] in (name, "keras", "optax"):
            raise PolyampError(
                f"framework {name!r} is not installed; install it with pip install 'polyamp[{name}]'"
            ) from err
        raise


def ops_of(x: Any) -> ModuleType | None:
    """The ops module ``polyamp.<framework>.xp`` of a tensor whose framework is imported, else None.

    As einops' ``get_backend``: ``detect`` proves the framework is already in ``sys.modules``, so
    this costs no framework import; the core's algorithms then run on ``x`` over that module.
    """
    name = detect(x)
    if name not in FRAMEWORKS:
        return None
    xp = sys.modules.get(f"polyamp.{name}.xp") or front_end_module(name, "xp")  # torch.compile traces this
    return xp if xp.accepts(x) else None


def front_end(name: str) -> type:
    """The ``MixedPrecision`` class of a framework's front end; imports the framework."""
    return front_end_module(name).MixedPrecision


__all__ = ["ALIASES", "FRAMEWORKS", "IDIOMS", "KERAS_IDIOMS", "canonical_framework", "detect", "front_end",
           "front_end_module", "idiom_owner", "imported_frameworks", "keras_backend", "keras_front_end",
           "ops_of"]
