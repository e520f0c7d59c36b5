"""polyamp's one exception family: every message says what was received and what is accepted."""

from __future__ import annotations

from collections.abc import Iterable


class PolyampError(ValueError):
    """Bad input or an unsupported request; the message names what was received and what to do."""

    # TensorFlow's autograph re-raises an error from inside a tf.function as its own type only if
    # that type's __init__ is Exception's (otherwise it becomes a StagingError).
    __init__ = Exception.__init__


class UnsupportedError(PolyampError):
    """The framework cannot honour the request on this machine (e.g. MXNet fp16 without cuDNN)."""

    unsupported = True


class NonFiniteError(PolyampError):
    """Training produced non-finite gradients for too many consecutive steps."""


def invalid(what: str, received: object, accepted: Iterable[object] | str) -> PolyampError:
    """Build the standard message: ``unknown <what> <received!r>; accepted: a, b, c``."""
    if not isinstance(accepted, str):
        accepted = ", ".join(str(a) for a in accepted)
    return PolyampError(f"unknown {what} {received!r}; accepted: {accepted}")
