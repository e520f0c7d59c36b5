"""polyamp's one exception family: every message says what was received and what is accepted."""

from __future__ import annotations

import difflib
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
    """Build the standard message: ``unknown <what> <received!r>; accepted: a, b, c``, with
    ``did you mean 'x'?`` first when ``received`` is a near miss of one accepted string."""
    if not isinstance(accepted, str):
        accepted = [str(a) for a in accepted]
        hint = suggestion(received, accepted)
        return PolyampError(f"unknown {what} {received!r}; {hint}accepted: {', '.join(accepted)}")
    return PolyampError(f"unknown {what} {received!r}; accepted: {accepted}")


def suggestion(received: object, choices: Iterable[str]) -> str:
    """``"did you mean 'x'? "`` for the closest of ``choices`` to a string ``received``, else ``""``."""
    if not isinstance(received, str) or not received.strip():
        return ""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(received.strip().lower(), list(lowered), n=1, cutoff=0.75)
    return f"did you mean {lowered[close[0]]!r}? " if close else ""
