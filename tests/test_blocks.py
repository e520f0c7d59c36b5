"""MX / NVFP4 block formats: hand cases from the specs, two references, edge cases, errors, SR."""

import doctest
import importlib.util
import math
import pathlib
import zlib
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

import polyamp
from polyamp import BLOCK_FORMATS, PolyampError, decode_blocks, encode_blocks, quantize_blocks
from polyamp.numerics import blocks as blocks_module

_spec = importlib.util.spec_from_file_location(
    "blocks_reference", pathlib.Path(__file__).parent.parent / "benchmarks" / "blocks_reference.py"
)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4")
RULES = ("floor", "rceil", "ceil", "even")
F32_MAX = float(np.finfo(np.float32).max)


def block(*head, n=32, dtype=np.float32):
    """One block: ``head`` then zeros up to ``n`` elements."""
    return np.array(list(head) + [0.0] * (n - len(head)), dtype)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = np.isnan(a) & np.isnan(b)
    assert ((a == b) & (np.signbit(a) == np.signbit(b)) | nan).all(), (a, b)


# -- hand cases: expected values worked out from the rules, not from the code -----------------------
# (format, rule, block head, expected head). Element grids: e4m3 at [128, 256) steps by 16; e2m1 is
# 0, 0.5, 1, 1.5, 2, 3, 4, 6; e5m2 at [16384, 32768) steps by 4096; e3m2 at [8, 16) by 2; e2m3 at [2, 4)
# by 0.25, subnormal step 0.125.
HAND = [
    # amax 480 = 1.875 * 2^8. floor: k = 8 - 8 = 0, 480 clips to 448. rceil: 480/448 -> k = 1, 240 exact.
    # ceil: ceil(log2 480) = 9 -> k = 1. even: 1.875 has 3 mantissa bits already -> k = 0, clips.
    ("mxfp8_e4m3", "floor", [480, 1], [448, 1]),
    ("mxfp8_e4m3", "rceil", [480, 1], [480, 1]),
    ("mxfp8_e4m3", "ceil", [480, 1], [480, 1]),
    ("mxfp8_e4m3", "even", [480, 1], [448, 1]),
    # amax 500 = 1.953125 * 2^8 rounds up to 2^9 at 3 mantissa bits -> even: k = 1; 250 -> 256.
    ("mxfp8_e4m3", "floor", [500, -3], [448, -3]),
    ("mxfp8_e4m3", "even", [500, -3], [512, -3]),
    ("mxfp8_e4m3", "rceil", [500, 1.25], [512, 1.25]),
    # amax exactly 448 * 2: rceil k = 1 (896 / 2 = 448 fits); ceil: ceil(log2 896) = 10 -> k = 2, 224.
    ("mxfp8_e4m3", "rceil", [896, 3], [896, 3]),
    ("mxfp8_e4m3", "ceil", [896, 3], [896, 3]),
    # subnormal elements (amax 256 -> k = 0): 2^-8 = 2 * 2^-9 exact; 3 * 2^-10 is a tie of 2^-9
    # (code 1, odd) and 2^-8 (code 2, even) -> 2^-8; 2^-11 is below half the smallest step -> -0.
    ("mxfp8_e4m3", "floor", [256, 2.0**-8, 3 * 2.0**-10, -(2.0**-11)], [256, 2.0**-8, 2.0**-8, -0.0]),
    # amax 7: floor k = 2 - 2 = 0, 7 saturates to 6; 0.75 ties 0.5 (code 1) / 1 (code 2) -> 1;
    # -0.25 ties 0 / 0.5 -> -0; 2.5 ties 2 (code 4) / 3 -> 2. rceil: k = 1: 3.5 ties 3 / 4 (code 6)
    # -> 4 -> 8; 0.375 -> 0.5 -> 1; 1.25 ties 1 (code 2) / 1.5 -> 1 -> 2.
    ("mxfp4", "floor", [7, 0.75, -0.25, 2.5], [6, 1, -0.0, 2]),
    ("mxfp4", "rceil", [7, 0.75, -0.25, 2.5], [8, 1, -0.0, 2]),
    ("mxfp4", "ceil", [7, 0.75], [8, 1]),
    # even: 7 = 1.75 * 4 ties 1.5 / 2.0 at 1 mantissa bit -> 2.0: k = 1. 5 = 1.25 * 4 ties 1.0 / 1.5
    # -> 1.0: k = 0, and 5 ties 4 (code 6) / 6 (code 7) -> 4.
    ("mxfp4", "even", [7, 0.75], [8, 1]),
    ("mxfp4", "even", [5, 0.75], [4, 1]),
    # amax 60000 (e5m2: emax 15, max 57344): floor clips; rceil k = 1: 30000 -> 28672 -> 57344; 1.5 -> 3.
    ("mxfp8_e5m2", "floor", [60000, 3], [57344, 3]),
    ("mxfp8_e5m2", "rceil", [60000, 3], [57344, 3]),
    # e3m2 (emax 4, max 28): floor clips 30 to 28; rceil k = 1: 15 ties 14 (odd) / 16 (even) -> 32.
    ("mxfp6_e3m2", "floor", [30, 1.1], [28, 1]),
    ("mxfp6_e3m2", "rceil", [30, 1.1], [32, 1]),
    # e2m3 (emax 2, max 7.5): floor clips 7.9; 0.0625 ties 0 / 0.125 -> 0; 0.1875 ties 0.125 / 0.25 ->
    # 0.25. rceil k = 1: 3.95 -> 4 -> 8.
    ("mxfp6_e2m3", "floor", [7.9, 0.0625, 0.1875], [7.5, 0, 0.25]),
    ("mxfp6_e2m3", "rceil", [7.9, 0.0625], [8, 0]),
]


@pytest.mark.parametrize("fmt, rule, head, expected", HAND)
def test_hand_cases(fmt, rule, head, expected):
    got = quantize_blocks(block(*head), fmt, scale_rule=rule)
    same_bits(got[: len(expected)], np.array(expected, np.float32))
    assert (got[len(expected) :] == 0).all()


def test_default_rule_is_ocp_floor():
    x = block(480, 1)
    same_bits(quantize_blocks(x, "mxfp8_e4m3"), quantize_blocks(x, "mxfp8_e4m3", scale_rule="floor"))
    assert {f.default_rule for f in BLOCK_FORMATS.values()} == {"floor", None}


def nvfp4_by_hand(rows):
    """NVFP4 of a 2-D array (1x16 blocks along the last axis) from TE's description, in Fractions."""
    e2m1 = [Fraction(v) for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]
    subnormal = {Fraction(m, 8) * Fraction(2) ** -6 for m in range(8)}
    normal = {(1 + Fraction(m, 8)) * Fraction(2) ** e for e in range(-6, 9) for m in range(8)}
    e4m3 = sorted(subnormal | normal - {Fraction(480)})  # 480's code is NaN

    def nearest(v, grid):  # saturating; a tie goes to the even index (= the even code, on both grids)
        a = min(abs(v), grid[-1])
        i = max(j for j, g in enumerate(grid) if g <= a)
        if i + 1 < len(grid):
            up, down = grid[i + 1] - a, a - grid[i]
            i += up < down or (up == down and i % 2)
        return grid[i]

    amax = max(abs(Fraction(float(v))) for v in np.ravel(rows))
    s_global = Fraction(float(np.float32(float(amax / 2688))))
    out = []
    for row in rows:
        vals = []
        for start in range(0, len(row), 16):
            chunk = [Fraction(float(v)) for v in row[start : start + 16]]
            s_block = nearest(max(abs(v) for v in chunk) / 6 / s_global, e4m3)
            scale = s_block * s_global
            vals += [math.copysign(float(nearest(v / scale, e2m1) * scale), v) for v in chunk]
        out.append(vals)
    return np.array(out).astype(np.float32)


def test_nvfp4_by_hand():
    x = np.array([block(7, 1, 2, 3.1, -0.3, n=16), block(0.01, -0.02, 0.003, n=16)], np.float32)
    got = quantize_blocks(x, "nvfp4")
    same_bits(got, nvfp4_by_hand(x))
    # s_global = 7 / 2688 (float32); block 0: s_block = 448, so x / (7/6): 6, 6/7 -> 1, 12/7 -> 1.5, 2.66 -> 3
    b = encode_blocks(x, "nvfp4")
    assert b.global_scale == np.float32(7 / 2688) and b.scales[0, 0] == 0x7E  # e4m3 448
    assert got[0, :4].tolist() == pytest.approx([7, 7 / 6, 1.75, 3.5], rel=1e-6)


def test_nvfp4_16x16_tiles_share_one_scale():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 32)).astype(np.float32)
    x[0, 0] = 100.0  # the top-left tile's amax: only its 16x16 tile feels it
    tiles = encode_blocks(x, "nvfp4", block=(16, 16))
    rows = encode_blocks(x, "nvfp4")
    assert tiles.scales.shape == (2, 2) and tiles.axes == (0, 1) and rows.scales.shape == (32, 2)
    # a tile's amax is the largest of its 16 rows' amaxes, and the scale rounding is monotone
    assert (tiles.scales == rows.scales.reshape(2, 16, 2).max(axis=1)).all()
    same_bits(quantize_blocks(x, "nvfp4", block=(16, 16)), decode_blocks(tiles))
    # the transposed tensor in transposed tiles: the same values, transposed (TE's reason for 2-D)
    same_bits(quantize_blocks(x.T, "nvfp4", block=(16, 16)), quantize_blocks(x, "nvfp4", block=(16, 16)).T)


# -- the independent references, on a sample --------------------------------------------------------------
CASES = [(f, r, (32,)) for f in MX for r in RULES] + [("nvfp4", None, (16,)), ("nvfp4", None, (16, 16))]


@pytest.mark.parametrize("fmt, rule, shape", CASES)
def test_against_exact_fraction_reference(fmt, rule, shape):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, rule, shape)).encode()))
    for _ in range(2 if fmt == "nvfp4" else 1):
        x = ref.sample(rng, fmt, shape, 4 if shape == (16, 16) else 48)
        ours, codes = ref.polyamp_result(x, fmt, rule, shape)
        theirs, their_codes = ref.fraction_reference(x, fmt, rule, shape)
        assert ref.mismatches(ours, theirs) == 0
        assert (codes.ravel() == their_codes).all()


@pytest.mark.parametrize("fmt, rule, shape", CASES)
def test_against_gfloat(fmt, rule, shape):
    # gfloat is in the dev extra: without it this fails (ImportError), it is not skipped
    rng = np.random.default_rng(1)
    x = ref.sample(rng, fmt, shape, 32 if shape == (16, 16) else 4096)
    ours, codes = ref.polyamp_result(x, fmt, rule, shape)
    theirs, their_codes = ref.gfloat_reference(x, fmt, rule, shape)
    assert ref.mismatches(ours, theirs) == 0
    assert (codes == their_codes).all()


def test_reference_data_has_the_hard_cases():
    """The sample mixes every kind, and the rules really disagree on it (so agreement means something)."""
    rng = np.random.default_rng(2)
    x = ref.make_tensor(rng, 512, "mxfp8_e4m3")
    assert x.shape == (512, 8 * 32 - 5)
    assert np.isnan(x).any() and np.isinf(x).any() and (np.abs(x) == F32_MAX).any()
    assert (x[np.isfinite(x)] != 0).any() and ((x != 0) & (np.abs(x) < 2.0**-126)).any()
    scales = {r: encode_blocks(x, "mxfp8_e4m3", scale_rule=r).scales for r in RULES}
    for a in RULES:
        for b in RULES:
            if a < b:
                assert (scales[a] != scales[b]).any(), (a, b)


# -- encode / decode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [*MX, "nvfp4"])
def test_decode_of_encode_is_quantize(fmt):
    rng = np.random.default_rng(3)
    x = ref.sample(rng, fmt, (BLOCK_FORMATS[fmt].block,), 256)
    for rounding in ("nearest", "stochastic"):
        b = encode_blocks(x, fmt, rounding=rounding, seed=7)
        assert b.elements.dtype == np.uint8 and b.scales.dtype == np.uint8 and b.elements.shape == x.shape
        assert b.scales.shape == (x.shape[0], -(-x.shape[1] // BLOCK_FORMATS[fmt].block))
        assert int(b.elements.max()) < 1 << BLOCK_FORMATS[fmt].element.bits
        same_bits(decode_blocks(b), quantize_blocks(x, fmt, rounding=rounding, seed=7))
    assert (b.global_scale is None) == (fmt != "nvfp4")
    if fmt == "nvfp4":
        assert isinstance(b.global_scale, np.float32)


def test_decode_checks_its_input():
    b = encode_blocks(np.ones((2, 64), np.float32), "mxfp4")
    with pytest.raises(PolyampError, match="Blocks"):
        decode_blocks({"elements": b.elements})
    bad = blocks_module.Blocks(b.format, b.scale_rule, b.axes, b.block, b.dtype, b.elements, b.scales[:, :1])
    with pytest.raises(PolyampError, match=r"scales has shape \(2, 1\); accepted: \(2, 2\)"):
        decode_blocks(bad)


# -- edge cases ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [*MX, "nvfp4"])
def test_all_zero_block(fmt):
    n = BLOCK_FORMATS[fmt].block
    x = np.concatenate([block(-0.0, 0.0, -0.0, n=n), block(1.5, n=n)])
    b = encode_blocks(x, fmt)
    assert b.scales[0] == 0  # E8M0 2^-127; e4m3 0
    same_bits(quantize_blocks(x, fmt)[:n], x[:n])  # signed zeros kept


@pytest.mark.parametrize("fmt", [*MX, "nvfp4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_block_with_nan_or_inf_is_nan(fmt, bad):
    n = BLOCK_FORMATS[fmt].block
    clean = np.concatenate([block(3.0, -1.0, n=n), block(0.5, 0.25, n=n), block(1.0, n=n)])
    x = clean.copy()
    x[n + 1] = bad
    got, b = quantize_blocks(x, fmt), encode_blocks(x, fmt)
    assert np.isnan(got[n : 2 * n]).all()
    assert b.scales[1] == (0x7F if fmt == "nvfp4" else 0xFF) and (b.elements[n : 2 * n] == 0).all()
    # the other blocks do not notice (NVFP4's global amax skips non-finite values)
    kept = np.r_[0:n, 2 * n : 3 * n]
    same_bits(got[kept], quantize_blocks(clean, fmt)[kept])


@pytest.mark.parametrize("fmt", [*MX, "nvfp4"])
def test_partial_trailing_block_is_zero_padded(fmt):
    n = BLOCK_FORMATS[fmt].block
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 2 * n + 5)) * 10).astype(np.float32)
    padded = np.concatenate([x, np.zeros((3, n - 5), np.float32)], axis=1)
    got = quantize_blocks(x, fmt)
    assert got.shape == x.shape
    same_bits(got, quantize_blocks(padded, fmt)[:, : x.shape[1]])
    assert encode_blocks(x, fmt).scales.shape == (3, 3)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4"])
def test_any_axis(fmt):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 37, 3)) * 8).astype(np.float32)
    along_1 = quantize_blocks(x, fmt, axis=1)
    same_bits(along_1, np.moveaxis(quantize_blocks(np.moveaxis(x, 1, -1), fmt), -1, 1))
    same_bits(along_1, quantize_blocks(x, fmt, axis=-2))
    b = encode_blocks(x, fmt, axis=1)
    assert b.axes == (1,) and b.scales.shape == (4, -(-37 // BLOCK_FORMATS[fmt].block), 3)
    along_0 = np.moveaxis(quantize_blocks(np.moveaxis(x, 0, -1), fmt), -1, 0)
    same_bits(quantize_blocks(x, fmt, axis=0), along_0)


def test_max_exponent_and_e8m0_clamps():
    # float32's max = (2 - 2^-23) 2^127: floor k = 127 - 8; x / 2^119 = 511.99997 clips to 448
    b = encode_blocks(block(F32_MAX, -F32_MAX), "mxfp8_e4m3")
    assert b.scales[0] == 119 + 127
    assert decode_blocks(b)[:2].tolist() == [448 * 2.0**119, -448 * 2.0**119]
    # rceil, mxfp4: k = ceil(log2(max / 6)) = 126; x / 2^126 = 3.99999 -> 4: 2^128 is past float32
    assert quantize_blocks(block(F32_MAX), "mxfp4", scale_rule="rceil")[0] == np.inf
    assert quantize_blocks(block(F32_MAX, dtype=np.float64), "mxfp4", scale_rule="rceil")[0] == 2.0**128
    # float64 beyond the top: k = floor(log2 1e300) - 2 = 994 clamps to 127 and the elements saturate
    b = encode_blocks(block(1e300, 1e299, dtype=np.float64), "mxfp4")
    assert b.scales[0] == 254 and decode_blocks(b)[:2].tolist() == [6 * 2.0**127, 6 * 2.0**127]
    # the bottom: amax 2^-130 gives k = -138, clamped to -127 (code 0): 2^-130 / 2^-127 = 1/8 is exact
    b = encode_blocks(block(2.0**-130, 2.0**-145), "mxfp8_e4m3")
    assert b.scales[0] == 0
    assert decode_blocks(b)[:2].tolist() == [2.0**-130, 0.0]  # 2^-145 / 2^-127 = 2^-18 < 2^-10: 0


def test_nvfp4_tiny_blocks_and_global_scale():
    # block 1's amax / 6 / s_global is far below e4m3's smallest step: its scale rounds to 0, values +-0
    x = np.concatenate([block(1e4, n=16), block(-1e-5, 1e-6, n=16)])
    b = encode_blocks(x, "nvfp4")
    assert b.scales[1] == 0
    same_bits(quantize_blocks(x, "nvfp4")[16:18], np.array([-0.0, 0.0], np.float32))
    assert encode_blocks(np.zeros(16, np.float32), "nvfp4").global_scale == 1.0
    assert encode_blocks(np.full(16, 1e-45, np.float32), "nvfp4").global_scale == np.float32(2.0**-149)
    assert encode_blocks(np.full(16, 1e300), "nvfp4").global_scale == np.finfo(np.float32).max


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_16_bit_inputs_come_back_as_float32(dtype):
    x = (np.random.default_rng(6).standard_normal(64) * 100).astype(dtype)
    for fmt in ("mxfp8_e4m3", "nvfp4"):
        got = quantize_blocks(x, fmt)
        assert got.dtype == np.float32
        same_bits(got, quantize_blocks(x.astype(np.float32), fmt))
    assert quantize_blocks(x.astype(np.float64), "mxfp4").dtype == np.float64
    assert quantize_blocks([1.0] * 32, "mxfp4").dtype == np.float64  # lists: float64, as quantize


def test_speed_is_vectorised():
    x = np.random.default_rng(7).standard_normal((20000, 32)).astype(np.float32)
    quantize_blocks(x[:2], "mxfp8_e4m3")
    import time

    t0 = time.perf_counter()
    quantize_blocks(x, "mxfp8_e4m3")
    assert time.perf_counter() - t0 < 2.0  # 10^6 blocks take about 1-3 s here


# -- stochastic rounding -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_stochastic_is_unbiased_and_seeded(fmt):
    n = BLOCK_FORMATS[fmt].block
    # amax 6: mxfp4's scale is 1, nvfp4's unit about 1; 0.3 lies between two neighbours
    x = np.tile(block(6.0, *([0.3] * (n - 2)), -2.6, n=n), 20000)
    a = quantize_blocks(x, fmt, rounding="stochastic", seed=11)
    table = a.reshape(-1, n).astype(np.float64)
    for column, value in ((table[:, 1:-1], float(np.float32(0.3))), (table[:, -1], float(np.float32(-2.6)))):
        lo, hi = np.unique(column)  # the two neighbours (nvfp4's unit is 448 * float32(6 / 2688), not 1)
        assert lo < value < hi
        p = (value - lo) / (hi - lo)
        assert abs(column.mean() - value) < 5 * (hi - lo) * math.sqrt(p * (1 - p) / column.size)
    same_bits(a, quantize_blocks(x, fmt, rounding="stochastic", seed=11))
    assert (a != quantize_blocks(x, fmt, rounding="stochastic", seed=12)).any()
    b = encode_blocks(x, fmt, rounding="sr", seed=11)
    same_bits(decode_blocks(b), a)


# -- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fmt": "mxfp8"}, r"unknown block format 'mxfp8'; .*accepted: mxfp8_e4m3, mxfp8_e5m2"),
        ({"fmt": "e4m3fn"}, r"unknown block format 'e4m3fn'.*accepted: .*nvfp4"),
        ({"scale_rule": "rciel"}, r"unknown scale rule 'rciel'; did you mean 'rceil'\? accepted: floor, "),
        ({"scale_rule": 3}, r"unknown scale rule 3; accepted: floor, rceil, ceil, even"),
        ({"fmt": "nvfp4", "scale_rule": "rceil"}, r"nvfp4 has one scale rule .* got scale_rule='rceil'"),
        ({"block": 16}, r"block 16 does not match mxfp8_e4m3; accepted: 32"),
        ({"block": (16, 16)}, r"block \(16, 16\) does not match mxfp8_e4m3; accepted: 32"),
        ({"fmt": "nvfp4", "block": 32}, r"block 32 does not match nvfp4; accepted: 16 or \(16, 16\)"),
        ({"block": True}, r"block True does not match"),
        ({"axis": 2}, r"axis 2 is not an axis of a 2-d array; accepted: integers in \[-2, 2\)"),
        ({"axis": 1.0}, r"axis 1.0 is not an axis"),
        ({"fmt": "nvfp4", "block": (16, 16), "axis": 0}, r"16x16 blocks tile two axes; got axis=0"),
        ({"fmt": "nvfp4", "block": (16, 16), "axis": (1, -1)}, r"two distinct axes, got axis=\(1, -1\)"),
        ({"rounding": "toward_zero"}, r"round 'nearest' or 'stochastic', got rounding='toward_zero'"),
        ({"rounding": "up"}, r"unknown rounding 'up'"),
        ({"seed": -1}, r"seed must be an integer"),
    ],
)
def test_errors_name_what_was_received_and_what_is_accepted(kwargs, message):
    args = {"x": np.ones((2, 40), np.float32), "fmt": "mxfp8_e4m3", **kwargs}
    with pytest.raises(PolyampError, match=message):
        quantize_blocks(**args)
    with pytest.raises(PolyampError, match=message):
        encode_blocks(**args)


@pytest.mark.parametrize(
    "x, message",
    [
        (np.arange(32), r"expected a floating-point array, got dtype int64"),
        (np.array(["a"] * 32), r"expected a floating-point array, got dtype <U1"),
        (3.0, r"axis -1 is not an axis of a 0-d array.*no axis to block along"),
        (np.ones(32, np.complex64), r"expected a floating-point array, got dtype complex64"),
    ],
)
def test_non_float_input(x, message):
    with pytest.raises(PolyampError, match=message):
        quantize_blocks(x, "mxfp4")


def test_framework_tensors_are_refused_by_name():
    fake = type("Tensor", (), {"__module__": "torch"})()
    with pytest.raises(PolyampError, match=r"quantize_blocks takes numpy arrays, .* got a torch.Tensor"):
        quantize_blocks(fake, "mxfp4")


def test_16x16_needs_two_dimensions():
    with pytest.raises(PolyampError, match=r"16x16 blocks tile two axes; got axis=-1 for a 1-d array"):
        quantize_blocks(np.ones(32, np.float32), "nvfp4", block=(16, 16))


def test_public_surface_and_doctests():
    assert polyamp.quantize_blocks is quantize_blocks and "BLOCK_FORMATS" in polyamp.__all__
    assert list(BLOCK_FORMATS) == [*MX, "nvfp4"]
    assert {f.block for f in BLOCK_FORMATS.values()} == {32, 16}
    assert doctest.testmod(blocks_module).failed == 0
