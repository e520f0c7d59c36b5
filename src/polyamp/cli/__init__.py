"""The ``polyamp`` command line: ``formats``, ``cast``, ``compare``, ``doctor`` and ``tune`` (``polyamp
--help``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from decimal import Decimal
from fractions import Fraction

from .. import __version__
from ..errors import PolyampError
from ..numerics import FORMATS, ROUNDINGS, encode, get_format, neighbours, quantize
from ..numerics.rounding import exact_float64

_CAST_OPTIONS_WITH_VALUE = ("--to", "--rounding", "--seed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="polyamp", description="Exact low-precision numerics and mixed-precision measurements."
    )
    parser.add_argument("--version", action="version", version=f"polyamp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="<command>")

    p = sub.add_parser("formats", help="every low-precision format and its derived facts")
    p.add_argument("names", nargs="*", help="formats to show (default: all named formats)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("cast", help="round values onto formats: neighbours, error, bits", allow_abbrev=False)
    p.add_argument("values", nargs="+", metavar="value",
                   help="decimals (rounded from their exact value), hex floats (0x1p-9), inf, -inf, nan")
    p.add_argument("--to", default="fp16,bf16,e4m3fn,e5m2", help="comma-separated format names")
    p.add_argument("--rounding", default="nearest", help=f"one of {', '.join(ROUNDINGS)}")
    p.add_argument("--saturate", action="store_true", help="clamp overflow to +-max")
    p.add_argument("--seed", type=int, default=None, help="seed for stochastic rounding")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("compare", help="workloads x frameworks x policies: speed, memory, parity",
                       epilog="exit status: 0 every case ran or is unsupported here, 1 a case crashed or "
                       "timed out, 2 bad options")  # fmt: skip
    p.add_argument("--frameworks", help="comma-separated (default: all four; one not installed gets rows "
                   "that say how to install it)")  # fmt: skip
    p.add_argument("--workloads", help="comma-separated: mlp, charlm, digits (default: all)")
    p.add_argument("--policies", help="comma-separated (default: float32,bf16-mixed,fp16-mixed), and the "
                   "training recipes fp8-tensorwise, fp8-delayed, mxfp8, nvfp4, with overrides as "
                   "name:field=value (docs/recipes.md)")  # fmt: skip
    p.add_argument("--steps", type=_steps, help="training steps per case, >= 1 (default: per workload)")
    p.add_argument("--quick", action="store_true", help="a smoke check: tiny sizes, 4 steps, one process per "
                   "framework; its timings are not findings")  # fmt: skip
    p.add_argument("--budget", type=_seconds, default=6.0, help="seconds of training per case before capping "
                   "(with --quick only the timed steps count; before 5 paired rounds a case may spend 3 "
                   "budgets; a capped case never caps its float32 baseline)")  # fmt: skip
    p.add_argument("--infer-budget", type=_seconds, default=None, help="seconds of inference calls per "
                   "policy (default: a quarter of --budget, at least 0.5)")  # fmt: skip
    p.add_argument("--timeout", type=_seconds, default=300.0, help="seconds before a case is abandoned")
    p.add_argument("--out", default="compare-report", help="output folder (default: compare-report)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--mxnet-python", metavar="PATH", help="the Python of MXNet's environment (default: "
                   "$POLYAMP_MXNET_PYTHON, else the project's .venv-mxnet)")  # fmt: skip
    p.add_argument("--converge", action="store_true", help="train each case to its workload's target "
                   "over several seeds instead: steps to target and final metric, mean ± sd, a parity "
                   "test; writes convergence.json, .md, .png (default: digits and charlm)")  # fmt: skip
    p.add_argument("--seeds", type=int, help="with --converge: seeds per case (default 3)")
    p.add_argument("--converge-budget", type=_seconds, metavar="SECONDS", help="with --converge: seconds "
                   "per run before it is capped and not counted (default 300; --budget and --timeout "
                   "are the default run's)")  # fmt: skip

    p.add_argument("--tuned", nargs="?", const="tune-report", metavar="FOLDER", help="instead: each "
                   "framework's tuned float32 and bf16 steps (polyamp tune's reports in FOLDER, made there "
                   "when missing; default tune-report) side by side in paired rounds, with a verdict: best "
                   "bf16 vs best float32 of any framework; writes tuned.json, .md, .png")  # fmt: skip
    p.add_argument("--tune-budget", type=_seconds, default=120.0, help="with --tuned: polyamp tune's budget "
                   "per missing report (default 120)")  # fmt: skip

    from .doctor import add_parser
    from .tune import add_parser as add_tune_parser

    add_parser(sub)
    add_tune_parser(sub)
    argv = _cast_values_last(sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    try:
        if args.command == "formats":
            return _formats(args)
        if args.command == "compare":
            from ..compare.cli import compare

            return compare(args)
        if args.command == "doctor":
            from .doctor import doctor

            return doctor(args, argv)
        if args.command == "tune":
            from .tune import tune

            return tune(args)
        return _cast(args)
    except PolyampError as err:
        print(f"polyamp: error: {err}", file=sys.stderr)
        return 2


# -- argument checks ------------------------------------------------------------------------------
def _steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        steps = 0
    if steps < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: a whole number of steps >= 1")
    return steps


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: a finite number of seconds > 0")
    return seconds


def _cast_values_last(argv: list[str]) -> list[str]:
    """Put ``cast``'s values after ``--``: argparse reads '-inf' or '-1e400' as an unknown option."""
    if not argv or argv[0] != "cast" or "--" in argv:
        return argv
    options, values, option_value_next = [], [], False
    for token in argv[1:]:
        if option_value_next or (token.startswith("-") and not _is_number(token)):
            options.append(token)
            option_value_next = not option_value_next and token in _CAST_OPTIONS_WITH_VALUE
        else:
            values.append(token)
    return ["cast", *options, "--", *values]


# -- formats --------------------------------------------------------------------------------------
def _formats(args) -> int:
    fmts = [get_format(n) for n in args.names] if args.names else list(FORMATS.values())
    facts = [f.facts() for f in fmts]
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    headers = ["format", "s/e/m", "bias", "max", "min normal", "min subnormal", "eps", "digits",
               "finite codes", "inf", "NaN", "-0"]  # fmt: skip
    rows = [
        [
            f.name, f"{int(f.signed)}/{f.ebits}/{f.mbits}", str(f.bias), f"{f.max:.6g}",
            _pow2(f.min_normal), _pow2(f.min_subnormal), _pow2(f.eps), str(f.digits),
            str(f.finite_codes), "yes" if f.has_inf else "no", _nan_rule(f),
            "yes" if f.has_negative_zero else "no",
        ]
        for f in fmts
    ]  # fmt: skip
    print(_table(headers, rows))
    return 0


def _pow2(x: float | None) -> str:
    """A power of two (every min normal, min subnormal and eps is one) as 2^k."""
    return "-" if x is None else f"2^{math.frexp(x)[1] - 1}"


def _nan_rule(f) -> str:
    return {"ieee": "IEEE", "fn": "all-ones", "fnuz": "0x80..", "none": "none"}[f.special]


# -- cast -----------------------------------------------------------------------------------------
def _cast(args) -> int:
    formats = [get_format(name) for name in args.to.split(",") if name.strip()]
    if not formats:
        raise PolyampError(f"--to names no format: got {args.to!r}; accepted: e.g. fp16,bf16,e4m3fn")
    parsed = [(text, _parse_value(text)) for text in args.values]
    tables = [(text, value, [_cast_row(value, f, args) for f in formats]) for text, value in parsed]
    if args.json:
        print(json.dumps([row for _, _, rows in tables for row in rows], indent=2))
        return 0
    headers = ["format", "rounded", "below", "above", "rel. error", "bits", "hex", "status"]
    blocks = []
    for text, value, results in tables:
        rows = [[r["format"], _num(r["rounded"]), _num(r["below"]), _num(r["above"]),
                 "-" if r["relative_error"] is None else f"{r['relative_error']:.3g}",
                 r["bits"] or "-", r["hex"] or "-", r["status"]] for r in results]  # fmt: skip
        blocks.append(f"{_describe(text, value)}, rounding={args.rounding}, saturate={args.saturate}\n"
                      + _table(headers, rows))  # fmt: skip
    print("\n\n".join(blocks))
    return 0


def _cast_row(value: float | Decimal, f, args) -> dict:
    """One value in one format; ``value`` keeps its exact decimal value (a Decimal) when float64 cannot."""
    x = exact_float64(value)  # a float64 that every format rounds as it rounds the exact value
    rounded = float(quantize(x, f, args.rounding, args.saturate, args.seed))
    below, above = neighbours(x, f)
    code = None if (math.isnan(rounded) and not f.has_nan) else int(encode(rounded, f))
    return {
        "format": f.name, "input": float(value), "rounded": rounded, "below": below, "above": above,
        "relative_error": _relative_error(x, rounded), "status": _status(x, rounded, f, args.rounding),
        "code": code, "hex": None if code is None else f"0x{code:0{(f.bits + 3) // 4}X}",
        "bits": None if code is None else _fields(code, f),
    }  # fmt: skip


def _parse_value(text: str) -> float | Decimal:
    """A float for hex floats, inf and nan; a Decimal (exact) for decimals."""
    try:
        if "0x" in text.lower():
            return float.fromhex(text)
        value = Decimal(text.strip())
    except (ValueError, ArithmeticError):
        raise PolyampError(
            f"cannot read {text!r} as a number; accepted: a decimal (68.0000036, -1e400), "
            "a hex float (0x1.2p-3), inf, -inf or nan"
        ) from None
    return value if value.is_finite() else float("nan" if value.is_nan() else value)


def _is_number(text: str) -> bool:
    try:
        _parse_value(text)
    except PolyampError:
        return False
    return True


def _describe(text: str, value: float | Decimal) -> str:
    """The value as typed, and its float64 where that reads differently."""
    nearest = float(value)
    if repr(nearest) == text:
        return text
    if isinstance(value, float) or (math.isfinite(nearest) and Fraction(value) == Fraction(nearest)):
        return f"{text} = {nearest!r} (float64)"
    return f"{text} ~= {nearest!r} (nearest float64; each format rounds the exact value)"


def _relative_error(x: float, rounded: float) -> float | None:
    if x == rounded:
        return 0.0
    if not (math.isfinite(x) and math.isfinite(rounded)) or abs(x) < sys.float_info.min:
        return None  # below float64's normal range the stand-in x is not close to the exact value
    return float(abs(Fraction(rounded) - Fraction(x)) / abs(Fraction(x)))


def _status(value: float, rounded: float, f, rounding: str) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isnan(rounded):
        if value == 0 and not f.has_zero:
            return "no zero -> NaN"
        return "no sign -> NaN" if value < 0 and not f.signed else "overflow -> NaN"
    if math.isinf(rounded) and not math.isinf(value):
        return "overflow -> inf"
    if abs(rounded) == f.max and abs(value) > f.max:
        top_ulp = math.ldexp(1.0, f.emax - f.mbits)
        limit = f.max + (top_ulp if rounding.startswith("toward") else top_ulp / 2)
        tie_goes_down = abs(value) == limit and (f.max / top_ulp) % 2 == 0
        return "rounded" if abs(value) < limit or tie_goes_down else "saturated"
    if rounded == value:
        return "exact"
    if rounded == 0:
        return "underflow -> 0"
    if f.min_subnormal and abs(rounded) < f.min_normal:
        return "subnormal"
    return "rounded"


def _fields(code: int, f) -> str:
    bits = format(code, f"0{f.bits}b")
    s = 1 if f.signed else 0
    parts = [bits[:s], bits[s : s + f.ebits], bits[s + f.ebits :]]
    return " ".join(p for p in parts if p)


def _num(x: float | None) -> str:
    """The shortest decimal that reads back as exactly ``x`` (whole numbers without '.0')."""
    if x is None:
        return "-"
    return str(int(x)) if x.is_integer() and 0 < abs(x) < 1e16 else repr(x)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


if __name__ == "__main__":
    sys.exit(main())
