"""polyamp's MX / NVFP4 block formats, bit for bit against two independent references.

    python benchmarks/blocks_reference.py [--blocks 1000000] [--fraction-blocks 2000] [--gfloat-blocks 1000]

1. ``fraction``: scalar Python written from the format descriptions (OCP MX v1.0 conversion with the
   scale rules as torchao defines them; TransformerEngine's NVFP4 two-level scaling), exact rational
   arithmetic with ``fractions.Fraction``; its element grids are enumerated from the bit layouts
   here, not taken from polyamp. Run on a sample (``--fraction-blocks`` per format and rule).
2. ``gfloat``: Graphcore's gfloat package rounds the elements (``round_ndarray``, ties to even,
   saturating) and the NVFP4 block scales; the scale exponents come from float formulas
   (``floor(log2 amax)``, ``ceil(log2(amax / Fmax))``, torchao's EVEN bit trick). Run on
   ``--blocks`` blocks per format and rule.
3. ``gfloat.quantize_block``: gfloat's own MX block path (OCP floor rule only), on a sample;
   blocks holding inf are left out there (gfloat saturates them; polyamp, microxcaling and torchao
   give the block a NaN scale), and a NaN block that gfloat refuses (its element format has no NaN)
   counts as NaN.

The data mixes blocks of few-bit values (many exact ties), normal values, all-zero blocks, blocks
with NaN or +-inf, amax near float32's max, amax in the floor rule's clipping zone, amax exactly at
and one ulp around every rule's boundary, tiny blocks (E8M0's lower clamp, float32 subnormals), and
wide blocks (element subnormals); every row ends in a partial block. NVFP4 tensors are drawn one
at a time (its global scale is per tensor), in 1x16 and 16x16 blocks.

Prints, per reference, format and rule: blocks compared, values compared, mismatching values and
mismatching scale codes. The test suite imports ``reference_blocks`` and ``make_tensor``.
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
import time
from fractions import Fraction

import numpy as np

F32_MAX = float(np.finfo(np.float32).max)

# element format -> (exponent bits, mantissa bits, bias, special values): the OCP bit layouts
LAYOUTS = {
    "e4m3": (4, 3, 7, "fn"),  # OFP8 E4M3: no inf, S.1111.111 is NaN
    "e5m2": (5, 2, 15, "ieee"),  # OFP8 E5M2: IEEE-style inf and NaN
    "e3m2": (3, 2, 3, "none"),  # MX FP6 E3M2
    "e2m3": (2, 3, 1, "none"),  # MX FP6 E2M3
    "e2m1": (2, 1, 1, "none"),  # MX FP4 E2M1
}
FORMATS = {  # block format -> (element, block size)
    "mxfp8_e4m3": ("e4m3", 32),
    "mxfp8_e5m2": ("e5m2", 32),
    "mxfp6_e3m2": ("e3m2", 32),
    "mxfp6_e2m3": ("e2m3", 32),
    "mxfp4": ("e2m1", 32),
    "nvfp4": ("e2m1", 16),
}
RULES = ("floor", "rceil", "ceil", "even")


# -- reference 1: exact rationals, one block at a time ------------------------------------------------
def grid(name: str) -> tuple[list[Fraction], list[int]]:
    """The non-negative finite values of an element format, ascending, with their codes."""
    ebits, mbits, bias, special = LAYOUTS[name]
    top = (1 << ebits) - 1
    out = []
    for field in range(top + 1):
        for mant in range(1 << mbits):
            if special == "ieee" and field == top:
                continue
            if special == "fn" and field == top and mant == (1 << mbits) - 1:
                continue
            if field == 0:
                value = Fraction(mant, 1 << mbits) * Fraction(2) ** (1 - bias)
            else:
                value = (1 + Fraction(mant, 1 << mbits)) * Fraction(2) ** (field - bias)
            out.append((value, (field << mbits) | mant))
    out.sort()
    return [v for v, _ in out], [c for _, c in out]


GRIDS = {name: grid(name) for name in LAYOUTS}


def floor_log2(a: Fraction) -> int:
    e = a.numerator.bit_length() - a.denominator.bit_length()
    return e - 1 if Fraction(2) ** e > a else e


def round_grid(v: Fraction, name: str) -> tuple[Fraction, int]:
    """|v| to the nearest grid value, ties to the even code, saturating: (value, code)."""
    values, codes = GRIDS[name]
    a = abs(v)
    if a >= values[-1]:
        return values[-1], codes[-1]
    i = bisect.bisect_right(values, a) - 1  # values[i] <= a < values[i + 1]
    lo, hi = values[i], values[i + 1]
    if a - lo < hi - a or (a - lo == hi - a and codes[i] % 2 == 0):
        return lo, codes[i]
    return hi, codes[i + 1]


def round_sig(a: Fraction, bits: int) -> Fraction:
    """a > 0 rounded to ``bits`` significant bits, ties to even (unbounded exponent)."""
    q = Fraction(2) ** (floor_log2(a) - bits + 1)
    return round(a / q) * q  # Python rounds a Fraction half to even


def round_float32(a: Fraction) -> Fraction:
    """a > 0 rounded to float32 (ties to even, subnormals)."""
    q = Fraction(2) ** (max(floor_log2(a), -126) - 23)
    return round(a / q) * q


def mx_scale_exponent(amax: Fraction, name: str, rule: str) -> int:
    """The shared exponent, from the rule's own words, then clamped to E8M0's [-127, 127]."""
    if amax == 0:
        return -127
    fmax = GRIDS[name][0][-1]
    emax = floor_log2(fmax)
    if rule == "floor":  # OCP v1.0: floor(log2(amax)) - emax_elem
        k = floor_log2(amax) - emax
    elif rule == "rceil":  # the smallest power of two with amax / 2^k <= Fmax
        k = floor_log2(amax) - emax - 1
        while amax > fmax * Fraction(2) ** k:
            k += 1
    elif rule == "ceil":  # torchao CEIL: ceil(log2(amax)) - emax
        c = floor_log2(amax)
        k = (c if Fraction(2) ** c == amax else c + 1) - emax
    else:  # torchao EVEN: amax rounded to the element's mantissa width, then floor
        k = floor_log2(round_sig(amax, LAYOUTS[name][1] + 1)) - emax
    return min(max(k, -127), 127)


def signed(value: Fraction, negative: bool) -> float:
    return -float(value) if negative else float(value)


def reference_blocks(blocks: list[list[float]], fmt: str, rule: str | None = None) -> tuple[list, list]:
    """Values (Python floats, float64-exact) and scale codes of ``blocks`` of one tensor.

    ``blocks``: each block's elements (the zero padding of a partial block left out). For nvfp4 all
    blocks form one tensor (its global scale); the caller rounds the values to float32.
    """
    name = FORMATS[fmt][0]
    out_values, out_codes = [], []
    if fmt == "nvfp4":
        finite = [abs(Fraction(v)) for b in blocks for v in b if math.isfinite(v)]
        amax_t = max(finite, default=Fraction(0))
        s_global = round_float32(amax_t / (448 * 6)) if amax_t else Fraction(1)
    for b in blocks:
        if not all(math.isfinite(v) for v in b):
            out_values.append([math.nan] * len(b))
            out_codes.append(0x7F if fmt == "nvfp4" else 0xFF)
            continue
        amax = max(abs(Fraction(v)) for v in b)
        if fmt == "nvfp4":
            s_block, code = round_grid(amax / 6 / s_global, "e4m3")
            scale = s_block * s_global
            vals = []
            for v in b:
                q = round_grid(Fraction(v) / scale, name)[0] if scale else Fraction(0)
                vals.append(signed(q * scale, math.copysign(1, v) < 0))
            out_values.append(vals)
            out_codes.append(code)
        else:
            k = mx_scale_exponent(amax, name, rule)
            scale = Fraction(2) ** k
            out_values.append([signed(round_grid(Fraction(v) / scale, name)[0] * scale,
                                      math.copysign(1, v) < 0) for v in b])  # fmt: skip
            out_codes.append(k + 127)
    return out_values, out_codes


# -- the data -------------------------------------------------------------------------------------------
KINDS = ("grid", "normal", "zero", "nan", "inf", "maxexp", "clip", "boundary", "tiny", "wide")


def _blocks(rng, kind: str, count: int, n: int, fmax: float, emax: int, e_range) -> np.ndarray:
    """``count`` blocks of ``n`` float64 values of one kind (see the module docstring)."""
    e = rng.integers(e_range[0], e_range[1] + 1, (count, 1)).astype(float)
    rows, pos = np.arange(count), rng.integers(0, n, count)  # one chosen element per block
    if kind in ("grid", "nan", "inf"):
        bits = rng.choice([2, 3, 4, 6, 9, 13], (count, 1))
        v = rng.integers(-(2**bits), 2**bits + 1, (count, n)) * 2.0 ** (e - bits)
        if kind == "nan":
            v[rows, pos] = np.nan
        elif kind == "inf":
            v[rows, pos] = rng.choice([np.inf, -np.inf], count)
    elif kind == "normal":
        v = rng.standard_normal((count, n)) * 2.0 ** np.minimum(e, 120)
    elif kind == "zero":
        v = np.where(rng.random((count, n)) < 0.5, -0.0, 0.0)
    elif kind == "maxexp":  # amax at float32's top binade
        v = rng.uniform(-1, 1, (count, n)) * F32_MAX
        v[rows, pos] = rng.choice([F32_MAX, -F32_MAX, 2.0**127 * 1.5, 2.0**127], count)
    elif kind == "clip":  # amax in (Fmax, 2^(emax+1)) * 2^j: the floor rule clips it
        top = (fmax + rng.random((count, 1)) * (2.0 ** (emax + 1) - fmax)) * 2.0 ** np.minimum(e, 126 - emax)
        v = rng.uniform(-1, 1, (count, n)) * top
        v[rows, pos] = top[:, 0] * rng.choice([1, -1], count)
    elif kind == "boundary":  # amax at a rule's boundary (Fmax 2^j, 2^j, even's cuts) or one ulp off
        cuts = [fmax, 1.0, 2.0 - 2.0**-3, 2.0 - 2.0**-4, 2.0 - 2.0**-5, 2.0 - 2.0**-2]
        edge = (rng.choice(cuts, (count, 1)) * 2.0 ** np.minimum(e, 100)).astype(np.float32)
        step = rng.integers(-1, 2, (count, 1))
        up, down = np.nextafter(edge, np.float32(np.inf)), np.nextafter(edge, np.float32(0))
        edge = np.where(step > 0, up, np.where(step < 0, down, edge)).astype(float)
        v = rng.uniform(-1, 1, (count, n)) * edge
        v[rows, pos] = edge[:, 0]
    elif kind == "tiny":  # float32 subnormals, E8M0's lower clamp
        bits = rng.choice([1, 3, 8], (count, 1))
        v = rng.integers(-(2**bits), 2**bits + 1, (count, n)) * 2.0 ** rng.integers(-149, -115, (count, 1))
    else:  # wide: one large element, the rest far below it (element subnormals and zeros)
        v = rng.standard_normal((count, n)) * 2.0 ** (rng.uniform(-30, 0, (count, n)) + np.minimum(e, 120))
        v[rows, pos] = 2.0 ** np.minimum(e[:, 0], 120)
    return v


def make_tensor(rng, rows: int, fmt: str, per_row: int = 8, e_range: tuple[int, int] = (-136, 126),
                kinds=KINDS, tiles: bool = False) -> np.ndarray:  # fmt: skip
    """A float32 array of blocks of mixed kinds; its last block along each blocked axis is short.

    1-D: (rows, per_row * block - 5), blocks along the last axis. ``tiles``: 16x16 blocks,
    (16 * rows - 3, 16 * per_row - 5), each tile of one kind.
    """
    name, block = FORMATS[fmt]
    fmax = float(GRIDS[name][0][-1])
    emax = floor_log2(GRIDS[name][0][-1])
    height = 16 if tiles else 1
    which = rng.choice(list(kinds), rows * per_row)
    out = np.empty((rows * per_row, height * block))
    for kind in set(which.tolist()):
        at = np.flatnonzero(which == kind)
        out[at] = _blocks(rng, kind, at.size, height * block, fmax, emax, e_range)
    out = out.reshape(rows, per_row, height, block).transpose(0, 2, 1, 3)
    out = out.reshape(rows * height, per_row * block)
    with np.errstate(over="ignore"):
        return out[: rows * height - (3 if tiles else 0), : per_row * block - 5].astype(np.float32)


def nvfp4_tensor(rng, rows: int, tiles: bool = False) -> np.ndarray:
    """One NVFP4 tensor: block exponents within 2^-40 of a random top (so block scales vary)."""
    top = int(rng.integers(-100, 120))
    kinds = [k for k in KINDS if k != "maxexp"] if top < 100 else KINDS
    return make_tensor(rng, rows, "nvfp4", e_range=(top - 40, top), kinds=kinds, tiles=tiles)


def blocks_of(x: np.ndarray, block: tuple[int, ...]) -> tuple[list[list[float]], list[np.ndarray]]:
    """The blocks of a 2-D array (along the last axis, or 16x16 tiles) as lists, with their flat indices."""
    index = np.arange(x.size).reshape(x.shape)
    b0, b1 = (1, block[0]) if len(block) == 1 else block
    starts = [(r, c) for r in range(0, x.shape[0], b0) for c in range(0, x.shape[1], b1)]
    where = [index[r : r + b0, c : c + b1].ravel() for r, c in starts]
    flat = x.ravel()
    return [flat[idx].tolist() for idx in where], where


def fraction_reference(x: np.ndarray, fmt: str, rule: str | None, block: tuple[int, ...]):
    """The exact reference's float32 values (x's shape) and scale codes (one per block, row-major)."""
    blocks, where = blocks_of(x, block)
    values, codes = reference_blocks(blocks, fmt, rule)
    out = np.empty(x.size, np.float32)
    with np.errstate(over="ignore"):
        for idx, vals in zip(where, values):
            out[idx] = np.array(vals, np.float64).astype(np.float32)
    return out.reshape(x.shape), np.array(codes)


# -- reference 2: gfloat's element rounding, vectorised --------------------------------------------------
def gfloat_reference(x: np.ndarray, fmt: str, rule: str | None, block: tuple[int, ...]):
    """Values and scale codes (in the scales' layout) with gfloat rounding every element and scale."""
    from gfloat import RoundMode, round_ndarray
    from gfloat import formats as gf

    info = {"e4m3": gf.format_info_ocp_e4m3, "e5m2": gf.format_info_ocp_e5m2, "e3m2": gf.format_info_ocp_e3m2,
            "e2m3": gf.format_info_ocp_e2m3, "e2m1": gf.format_info_ocp_e2m1}  # fmt: skip
    name = FORMATS[fmt][0]
    rows, cols = x.shape
    b0, b1 = (1, block[0]) if len(block) == 1 else block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = np.zeros((nr * b0, nc * b1))
    padded[:rows, :cols] = x
    tiles = padded.reshape(nr, b0, nc, b1)
    amax = np.abs(tiles).max(axis=(1, 3))
    bad = ~np.isfinite(amax)
    amax = np.where(bad, 0.0, amax)

    def spread(per_block):
        return np.repeat(np.repeat(per_block, b0, axis=0), b1, axis=1)[:rows, :cols]

    x64 = np.where(spread(bad), 0.0, x.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if fmt == "nvfp4":
            finite = np.abs(x[np.isfinite(x)]).astype(np.float64)
            amax_t = finite.max() if finite.size else 0.0
            s_global = float(np.float32(amax_t / 2688.0)) if amax_t else 1.0
            s_block = round_ndarray(info["e4m3"], amax / 6.0 / s_global, RoundMode.TiesToEven, True)
            scale = s_block * s_global
            full = spread(scale)
            quotient = np.where(full == 0, np.copysign(0.0, x64), x64 / np.where(full == 0, 1, full))
            elems = round_ndarray(info[name], quotient, RoundMode.TiesToEven, True)
            values = elems * full
            from gfloat import encode_ndarray

            codes = encode_ndarray(info["e4m3"], s_block).astype(np.int64)
            codes = np.where(bad, 0x7F, codes)
        else:
            fmax = float(GRIDS[name][0][-1])
            emax = floor_log2(GRIDS[name][0][-1])
            mbits = LAYOUTS[name][1]
            if rule == "floor":
                k = np.floor(np.log2(amax)) - emax
            elif rule == "rceil":
                k = np.ceil(np.log2(amax / fmax))
            elif rule == "ceil":
                k = np.ceil(np.log2(amax)) - emax
            else:  # torchao's EVEN on the float32 bits: add half an element ulp, drop the mantissa
                bits = amax.astype(np.float32).view(np.int32).astype(np.int64)
                rounded = ((bits + (1 << (23 - mbits - 1))) & 0x7F800000).astype(np.int32).view(np.float32)
                k = np.where(np.isinf(rounded), 128.0, np.floor(np.log2(rounded.astype(np.float64)))) - emax
            k = np.clip(np.where(amax == 0, -127, k), -127, 127)
            full = spread(2.0**k)
            elems = round_ndarray(info[name], x64 / full, RoundMode.TiesToEven, True)
            values = elems * full
            codes = np.where(bad, 0xFF, k + 127).astype(np.int64)
        values = np.where(spread(bad), np.nan, values).astype(np.float32)
    return values, codes


# -- reference 3: gfloat's own MX block path (floor rule) ------------------------------------------------
def gfloat_block_reference(blocks: list[list[float]], fmt: str) -> list[list[float]]:
    from gfloat import compute_scale_amax, quantize_block
    from gfloat import formats as gf

    info = {"mxfp8_e4m3": gf.format_info_mxfp8_e4m3, "mxfp8_e5m2": gf.format_info_mxfp8_e5m2,
            "mxfp6_e3m2": gf.format_info_mxfp6_e3m2, "mxfp6_e2m3": gf.format_info_mxfp6_e2m3,
            "mxfp4": gf.format_info_mxfp4_e2m1}[fmt]  # fmt: skip
    out = []
    for b in blocks:
        padded = np.zeros(32)
        padded[: len(b)] = b
        try:
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                out.append(quantize_block(info, padded, compute_scale_amax)[: len(b)].tolist())
        except ValueError:  # a NaN block of an element format without NaN: gfloat refuses it
            out.append([math.nan] * len(b))
    return out


# -- comparing ---------------------------------------------------------------------------------------------
def mismatches(a: np.ndarray, b: np.ndarray) -> int:
    """Elements whose float32 bits differ (any NaN equals any NaN)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
    return int((~same).sum())


def polyamp_result(x, fmt, rule, block):
    import polyamp

    axis = (0, 1) if block == (16, 16) else -1
    blocks = polyamp.encode_blocks(x, fmt, axis=axis, block=block, scale_rule=rule)
    values = polyamp.decode_blocks(blocks)
    if mismatches(values, polyamp.quantize_blocks(x, fmt, axis=axis, block=block, scale_rule=rule)):
        raise AssertionError("decode_blocks(encode_blocks(x)) != quantize_blocks(x)")
    return values, blocks.scales.astype(np.int64)


def layouts(fmt):
    """(label, rule, block) for every rule (MX) or block shape (NVFP4) of ``fmt``."""
    if fmt == "nvfp4":
        return [("1x16", None, (16,)), ("16x16", None, (16, 16))]
    return [(rule, rule, (32,)) for rule in RULES]


def sample(rng, fmt, block, blocks_wanted):
    """One tensor of at most about ``blocks_wanted`` blocks (NVFP4: each tensor its own global scale)."""
    rows = max(1, -(-blocks_wanted // 8))
    if fmt != "nvfp4":
        return make_tensor(rng, rows, fmt)
    if block == (16, 16):
        return nvfp4_tensor(rng, min(rows, 64), tiles=True)
    return nvfp4_tensor(rng, min(rows, 1024))


class Tally:
    def __init__(self):
        self.rows = {}
        self.bad = 0

    def add(self, key, blocks, values, dv, ds, seconds):
        row = self.rows.setdefault(key, [0, 0, 0, 0, 0.0])
        for i, v in enumerate((blocks, values, dv, ds, seconds)):
            row[i] += v
        self.bad += dv + ds

    def print(self):
        print(f"{'reference':<22} {'format':<11} {'rule':<6} {'blocks':>9} {'values':>11} {'value diff':>10} "
              f"{'scale diff':>10} {'seconds':>8}")  # fmt: skip
        for (ref, fmt, label), (b, v, dv, ds, sec) in self.rows.items():
            print(f"{ref:<22} {fmt:<11} {label:<6} {b:>9} {v:>11} {dv:>10} {ds:>10} {sec:>8.1f}")


def compare(tally, ref_name, ref_fn, x, fmt, label, rule, block):
    t0 = time.perf_counter()
    ours, our_codes = polyamp_result(x, fmt, rule, block)
    ref, ref_codes = ref_fn(x, fmt, rule, block)
    dv = mismatches(ours, ref)
    ds = 0 if ref_codes is None else int((our_codes.ravel() != np.ravel(ref_codes)).sum())
    tally.add((ref_name, fmt, label), our_codes.size, x.size, dv, ds, time.perf_counter() - t0)


def run(args) -> int:
    rng = np.random.default_rng(args.seed)
    tally = Tally()
    for fmt in FORMATS:
        for block in ((16,), (16, 16)) if fmt == "nvfp4" else ((32,),):
            group = [(label, rule) for label, rule, b in layouts(fmt) if b == block]
            wanted = args.blocks if block != (16, 16) else args.tiles
            done = 0
            while done < wanted:  # gfloat: every rule on the same data
                x = sample(rng, fmt, block, min(131072, wanted - done))
                for label, rule in group:
                    compare(tally, "gfloat", gfloat_reference, x, fmt, label, rule, block)
                done = tally.rows[("gfloat", fmt, group[0][0])][0]
            done = 0
            while done < args.fraction_blocks:
                x = sample(rng, fmt, block, 16 if block == (16, 16) else 128)
                for label, rule in group:
                    compare(tally, "fraction", fraction_reference, x, fmt, label, rule, block)
                done = tally.rows[("fraction", fmt, group[0][0])][0]
            if fmt != "nvfp4" and args.gfloat_blocks:
                x = make_tensor(rng, -(-args.gfloat_blocks // 8), fmt, kinds=[k for k in KINDS if k != "inf"])
                compare(tally, "gfloat.quantize_block", gfloat_block_values, x, fmt, "floor", "floor", block)
        print(f"{fmt} done", file=sys.stderr)
    tally.print()
    print(f"total mismatches: {tally.bad}")
    informational(rng)
    return 1 if tally.bad else 0


def gfloat_block_values(x, fmt, rule, block):
    """gfloat.quantize_block's values (x's shape); it returns no scale codes to compare."""
    blocks, where = blocks_of(x, block)
    ref = np.empty(x.size, np.float32)
    with np.errstate(over="ignore"):
        for idx, vals in zip(where, gfloat_block_reference(blocks, fmt)):
            ref[idx] = np.array(vals).astype(np.float32)
    return ref.reshape(x.shape), None


# -- informational: the float32 arithmetic of torchao's RCEIL and of TE's NVFP4 kernels ---------------
def torchao_rceil_exponent(amax: np.ndarray, fmax: float) -> np.ndarray:
    """torchao ``_to_mx_rceil`` without a GPU: ``descale = amax * float32(1 / Fmax)`` in float32, then
    E8M0 rounded up (any mantissa bit set; a float32 subnormal only above 2^-127)."""
    descale = (amax.astype(np.float32) * (np.float32(1.0) / np.float32(fmax))).astype(np.float32)
    bits = descale.view(np.int32)
    field, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    return field + np.where(field == 0, mantissa > 0x400000, mantissa != 0) - 127


def te_nvfp4(x: np.ndarray):
    """TE's NVFP4 1x16 arithmetic in float32 (``core_nvfp4.cuh``, ``dequantize_nvfp4.cuh``), emulated:
    ``S_enc = 2688 / amax``; ``s_block = e4m3(amax_b * (S_enc * (1/6)))``; elements
    ``e2m1(x * (1 / (s_block * (1 / S_enc))))``; values ``e2m1 * ((s_block * amax) * (1/2688))``."""
    import ml_dtypes

    f32 = np.float32
    amax_t = f32(np.abs(x).max())
    s_enc = f32(f32(2688.0) / amax_t) if amax_t else f32(1)
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 16, 16)
    s_block = (np.abs(blocks).max(-1).astype(f32) * f32(s_enc * f32(f32(1) / f32(6)))).astype(f32)
    s_block = np.clip(s_block, 0, 448).astype(ml_dtypes.float8_e4m3fn)  # satfinite, then RNE
    sb = s_block.astype(f32)
    with np.errstate(divide="ignore"):
        rcp = np.minimum(f32(1) / (sb * f32(f32(1) / s_enc)), np.finfo(f32).max).astype(f32)
    q = np.clip((blocks * rcp[..., None]).astype(f32), -6, 6).astype(ml_dtypes.float4_e2m1fn)
    final = ((sb * amax_t).astype(f32) * f32(1.0 / (6.0 * 448.0))).astype(f32)
    values = (q.astype(f32) * final[..., None]).astype(f32).reshape(rows, cols)
    return values, s_block.view(np.uint8), q.view(np.uint8).reshape(rows, cols)


def informational(rng) -> None:
    import polyamp

    print("\ninformational: float32 formulas of other libraries against polyamp's exact definitions")
    for fmt in [f for f in FORMATS if f != "nvfp4"]:
        name = FORMATS[fmt][0]
        fmax = float(GRIDS[name][0][-1])
        edges = np.array([fmax * 2.0**k for k in range(-120, 110)], np.float32).view(np.int32)
        amax = (edges[:, None] + np.arange(-300, 301)).astype(np.int32).view(np.float32).ravel()
        x = np.zeros((amax.size, 32), np.float32)
        x[:, 0] = amax
        ours = polyamp.encode_blocks(x, fmt, scale_rule="rceil").scales.astype(np.int64).ravel() - 127
        diff = int((torchao_rceil_exponent(amax, fmax) != ours).sum())
        print(f"  torchao RCEIL (float32 amax * (1/Fmax)), {fmt}: {diff} of {amax.size} scales differ "
              "(amax within 300 float32 steps of every Fmax * 2^k)")  # fmt: skip
    total = dv = ds = de = 0
    worst = 0.0
    for _ in range(100):
        x = rng.standard_normal((64, 256)) * np.exp(rng.uniform(-3, 3, (64, 1))) * 10.0 ** rng.uniform(-5, 5)
        x = x.astype(np.float32)
        values, s_block, codes = te_nvfp4(x)
        b = polyamp.encode_blocks(x, "nvfp4")
        ours = polyamp.decode_blocks(b)
        total, dv = total + x.size, dv + int((values != ours).sum())
        ds += int((s_block != b.scales).sum())
        de += int(((codes & 7) != (b.elements & 7)).sum())  # magnitudes (TE may keep the sign of a 0)
        nz = ours != 0
        worst = max(worst, float(np.max(np.abs(values[nz] - ours[nz]) / np.abs(ours[nz]))))
    print(f"  TE NVFP4 float32 arithmetic (emulated), 100 normal tensors of 64x256: block scales differ "
          f"{ds} of {total // 16}, element magnitudes {de} of {total}; values {dv} of {total} "
          f"(largest relative difference {worst:.2g}: TE decodes via float32 products of amax)")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="blocks per format and rule (gfloat)")
    p.add_argument("--tiles", type=int, default=100_000, help="nvfp4 16x16 blocks (gfloat)")
    p.add_argument("--fraction-blocks", type=int, default=2000, help="blocks per format and rule (exact)")
    p.add_argument("--gfloat-blocks", type=int, default=1000, help="blocks per MX format (quantize_block)")
    p.add_argument("--seed", type=int, default=0)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
