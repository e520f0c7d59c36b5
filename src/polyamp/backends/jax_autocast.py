"""Deprecated alias of ``polyamp.jax.autocast``."""

import warnings

from ..jax.autocast import *  # noqa: F403
from ..jax.autocast import __all__  # noqa: F401

warnings.warn("polyamp.backends.jax_autocast moved to polyamp.jax.autocast", DeprecationWarning, stacklevel=2)
