"""Deprecated alias of ``polyamp.tensorflow``."""

import warnings

from ..tensorflow import *  # noqa: F403
from ..tensorflow import __all__  # noqa: F401

warnings.warn("polyamp.backends.tensorflow moved to polyamp.tensorflow", DeprecationWarning, stacklevel=2)
