"""How the report writes its numbers: ratios, intervals, times and bytes, the same in every table."""

from __future__ import annotations

from typing import Any

from .rows import finite, num

SHORT_POLICY = {"float32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def short(policy: str) -> str:
    return SHORT_POLICY.get(policy, policy)


def times(v: float | None) -> str:
    """``1.71x``, or ``-``."""
    return f"{num(v)}x" if finite(v) else "-"


def interval(ci) -> str:
    """``1.62-1.80``, or an empty string."""
    return f"{num(ci[0])}-{num(ci[1])}" if ci else ""


def ratio(v: float | None, ci=None, rounds: int | None = None, slower: bool = False) -> str:
    """``1.71x [1.62-1.80] n=9``: a paired ratio, its 95 % interval and its rounds."""
    if not finite(v):
        return "n/a"
    text = f"{num(v)}x" + (" (slower)" if slower else "")
    if ci:
        text += f" [{interval(ci)}]"
    if rounds is not None:
        text += f" n={rounds}" + (" (warm-up)" if rounds == 0 else "")
    return text


def ms(seconds: float | None) -> str:
    """Milliseconds with three significant digits at most."""
    if not finite(seconds):
        return "-"
    m = seconds * 1000
    return f"{m:.0f}" if m >= 100 else f"{m:.1f}" if m >= 10 else f"{m:.2f}"


def mib(n: int | None) -> str:
    if not finite(n):
        return "n/a"
    return f"{n / 2**20:.3g}"


def number(v: Any, fmt: str = ".4g", signed: bool = False) -> str:
    if v is None:
        return "-"
    if not finite(v):
        return str(v)
    return format(v, ("+" if signed else "") + fmt)


def md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def one_line(text: str | None, width: int | None = None) -> str:
    """An error's text on one line, cut at ``width`` characters with an ellipsis."""
    line = " ".join(str(text or "").split())
    return line if not width or len(line) <= width else line[: width - 1] + "…"
