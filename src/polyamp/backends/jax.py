"""Deprecated alias of ``polyamp.jax``."""

import warnings

from ..jax import *  # noqa: F403
from ..jax import __all__  # noqa: F401

warnings.warn("polyamp.backends.jax moved to polyamp.jax", DeprecationWarning, stacklevel=2)
