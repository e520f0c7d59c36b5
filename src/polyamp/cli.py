"""The ``polyamp`` command line: ``formats`` and ``cast``."""

from __future__ import annotations

import argparse
import json
import math
import sys

from .errors import PolyampError
from .numerics import FORMATS, ROUNDINGS, encode, get_format, neighbours, quantize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyamp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("formats", help="every low-precision format and its derived facts")
    p.add_argument("names", nargs="*", help="formats to show (default: all named formats)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("cast", help="round a value onto formats: value, neighbours, error, bits")
    p.add_argument("value", help="a decimal, hex float (0x1p-9), inf or nan")
    p.add_argument("--to", default="fp16,bf16,e4m3fn,e5m2", help="comma-separated format names")
    p.add_argument("--rounding", default="nearest", help=f"one of {', '.join(ROUNDINGS)}")
    p.add_argument("--saturate", action="store_true", help="clamp overflow to +-max")
    p.add_argument("--seed", type=int, default=None, help="seed for stochastic rounding")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("compare", help="the same workloads on every installed framework and policy")
    p.add_argument("--frameworks", help="comma-separated (default: every installed one)")
    p.add_argument("--workloads", help="comma-separated: mlp, charlm, digits (default: all)")
    p.add_argument("--policies", help="comma-separated (default: float32,bf16-mixed,fp16-mixed)")
    p.add_argument("--steps", type=int, help="training steps per case (default: per workload)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run in seconds")
    p.add_argument("--budget", type=float, default=6.0, help="seconds of training per case before capping")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a case is abandoned")
    p.add_argument("--out", default="compare-report", help="output folder (default: compare-report)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    args = parser.parse_args(argv)
    try:
        if args.command == "formats":
            return _formats(args)
        if args.command == "compare":
            from .compare.cli import compare

            return compare(args)
        return _cast(args)
    except PolyampError as err:
        print(f"polyamp: error: {err}", file=sys.stderr)
        return 2


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
            f.name, f"{int(f.signed)}/{f.ebits}/{f.mbits}", str(f.bias), _num(f.max),
            _num(f.min_normal), _num(f.min_subnormal), _num(f.eps), str(f.digits),
            str(f.finite_codes), "yes" if f.has_inf else "no", _nan_rule(f),
            "yes" if f.has_negative_zero else "no",
        ]
        for f in fmts
    ]  # fmt: skip
    print(_table(headers, rows))
    return 0


def _cast(args) -> int:
    value = _parse_value(args.value)
    results = []
    for name in (n for n in args.to.split(",") if n.strip()):
        f = get_format(name)
        rounded = float(quantize(value, f, args.rounding, args.saturate, args.seed))
        below, above = neighbours(value, f)
        code = None if (math.isnan(rounded) and not f.has_nan) else int(encode(rounded, f))
        rel = (
            abs(rounded - value) / abs(value)
            if value not in (0.0,) and math.isfinite(rounded) and math.isfinite(value)
            else (0.0 if rounded == value else None)
        )
        results.append({
            "format": f.name, "input": value, "rounded": rounded, "below": below, "above": above,
            "relative_error": rel, "status": _status(value, rounded, f, args.rounding),
            "code": code, "hex": None if code is None else f"0x{code:0{(f.bits + 3) // 4}X}",
            "bits": None if code is None else _fields(code, f),
        })  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{args.value} = {value!r} (float64), rounding={args.rounding}, saturate={args.saturate}")
    headers = ["format", "rounded", "below", "above", "rel. error", "bits", "hex", "status"]
    rows = [[r["format"], _num(r["rounded"]), _num(r["below"]), _num(r["above"]),
             "-" if r["relative_error"] is None else f"{r['relative_error']:.3g}",
             r["bits"] or "-", r["hex"] or "-", r["status"]] for r in results]  # fmt: skip
    print(_table(headers, rows))
    return 0


def _parse_value(text: str) -> float:
    try:
        return float.fromhex(text) if "0x" in text.lower() else float(text)
    except ValueError:
        raise PolyampError(
            f"cannot read {text!r} as a number; accepted: a decimal (68.0000036), "
            "a hex float (0x1.2p-3), inf, -inf or nan"
        ) from None


def _status(value: float, rounded: float, f, rounding: str) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isnan(rounded):
        return "overflow -> NaN"
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


def _nan_rule(f) -> str:
    return {"ieee": "IEEE", "fn": "all-ones", "fnuz": "0x80..", "none": "none"}[f.special]


def _num(x) -> str:
    if x is None:
        return "-"
    if x == 0 or math.isnan(x) or math.isinf(x):
        return str(x)
    e = math.frexp(abs(x))[1] - 1
    if x == math.copysign(2.0**e, x) and abs(e) > 12:
        return f"{'-' if x < 0 else ''}2^{e}"
    return f"{x:.6g}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


if __name__ == "__main__":
    sys.exit(main())
