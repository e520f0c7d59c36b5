import math
from decimal import Decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from conftest import ML_DTYPES
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import neighbours, round_exact

from polyamp import PolyampError
from polyamp.numerics import FORMATS, decode, encode, get_format, quantize

ML_DTYPES_ROUNDS_FLOAT64_ONCE = tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2]) >= (0, 7)

MODES = ("nearest", "toward_zero", "stochastic")


def bits_equal(a, b):
    """Same bits, or both NaN (NaN payloads and signs are not part of the contract)."""
    a, b = np.asarray(a), np.asarray(b)
    both_nan = np.isnan(a) & np.isnan(b)
    same = (a == b) & (np.signbit(a) == np.signbit(b))
    return same | both_nan


def edge_values(name):
    """Ties, neighbours of ties, subnormals, max, just above max, +-0, +-inf, NaN, as float32."""
    f = get_format(name)
    if f.bits <= 16:
        v = np.unique(decode(np.arange(1 << f.bits), f))
        v = v[np.isfinite(v)]
    else:
        v = np.array([0.0, f.min_normal, f.max, 1.0, 1.0 + f.eps])
    mids = (v[:-1] + v[1:]) / 2
    top = np.array([f.max, f.max * (1 + f.eps / 2), f.max * (1 + f.eps / 4), f.max * 2, 1e30])
    base = np.concatenate([v, mids, top, [np.inf, np.nan, f.smallest_positive / 2]])
    with np.errstate(over="ignore"):
        base = np.concatenate([base, -base]).astype(np.float32)
        ups = np.nextafter(base, np.float32(np.inf))
        downs = np.nextafter(base, np.float32(-np.inf))
    return np.concatenate([base, ups, downs])


def random_float32(n, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 1 << 32, n // 2, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scales = rng.choice([1e-8, 1e-5, 1e-3, 0.1, 1, 10, 300, 1e4, 1e5, 1e38], n - n // 2)
    return np.concatenate([raw, (rng.standard_normal(n - n // 2) * scales).astype(np.float32)])


X32 = random_float32(1_000_000)


@pytest.mark.parametrize("name", ML_DTYPES)
def test_nearest_equals_ml_dtypes_for_float32(name, implementation):
    x = np.concatenate([X32, edge_values(name)])
    f = get_format(name)
    if f.saturates_always:  # ml_dtypes turns NaN into -0 in fp6/fp4; polyamp keeps NaN
        x = x[~np.isnan(x)]
    if name == "e8m0fnu":  # ml_dtypes rounds float32 subnormals up (checked against exact below)
        x = x[~(np.abs(x) < 2.0**-126)]
    ours = quantize(x, name)
    with np.errstate(invalid="ignore", over="ignore"):
        theirs = x.astype(ML_DTYPES[name]).astype(np.float32)
    assert ours.dtype == np.float32
    bad = ~bits_equal(ours, theirs)
    assert not bad.any(), f"{bad.sum()} differ, e.g. {x[bad][:4]} -> {ours[bad][:4]} vs {theirs[bad][:4]}"


def test_e8m0_float32_subnormals_round_to_nearest(implementation):
    x = np.array([8.0e-39, 7.0e-39, 2.0**-127 * 1.5, 2.0**-127 * 1.6, 2.0**-130], np.float32)
    expected = [round_exact(float(v), FORMATS["e8m0fnu"]) for v in x]
    np.testing.assert_array_equal(quantize(x, "e8m0fnu"), np.array(expected, np.float32))


def test_fp6_fp4_keep_nan_and_saturate_inf(implementation):
    for name in ("e2m3fn", "e3m2fn", "e2m1fn"):
        out = quantize(np.array([np.nan, np.inf, -np.inf, 1e9], np.float32), name)
        f = FORMATS[name]
        assert np.isnan(out[0]) and list(out[1:]) == [f.max, -f.max, f.max]


@pytest.mark.parametrize("name", ["tf32", "fp16", "bf16", "e4m3fn", "e5m2fnuz", "e2m1fn", "e3m4_ieee"])
@pytest.mark.parametrize("mode", ["nearest", "toward_zero"])
def test_matches_exact_reference(name, mode, implementation):
    f = get_format(name)
    x = np.concatenate([random_float32(4000, seed=3), edge_values(name)[::7]])
    ours = quantize(x, f, rounding=mode)
    ref = np.array([round_exact(float(v), f, mode) for v in x], np.float32)
    assert bits_equal(ours, ref).all()


def double_rounding_traps(fmt, n, rng):
    """float64 values just off a tie of ``fmt`` that land exactly on the tie in float32."""
    f = get_format(fmt)
    v = np.unique(decode(np.arange(1 << f.bits), f)) if f.bits <= 16 else None
    v = v[np.isfinite(v) & (v > 0)]
    lo = rng.choice(v[:-1], n)
    hi = v[np.searchsorted(v, lo) + 1]
    mid = (lo + hi) / 2
    offset = rng.uniform(1e-12, 1e-9, n) * mid * rng.choice([-1, 1], n)
    return mid + offset


@pytest.mark.parametrize("name", ["e4m3fn", "e5m2", "bf16", "fp16", "e2m1fn", "e3m2fn"])
def test_float64_input_is_rounded_once(name, implementation):
    rng = np.random.default_rng(7)
    f = get_format(name)
    x = np.concatenate([double_rounding_traps(name, 1500, rng), rng.standard_normal(1500) * 10])
    ours = quantize(x, f)
    assert ours.dtype == np.float64
    ref = np.array([round_exact(float(v), f) for v in x])
    assert bits_equal(ours, ref).all()
    # ...where a detour through float32 rounds twice and differs on the traps:
    via32 = quantize(x[:1500].astype(np.float32), f).astype(np.float64)
    assert (via32 != ours[:1500]).sum() > 100
    # ml_dtypes took that detour before 0.7.0 (jax-ml/ml_dtypes#401); from 0.7.0 it rounds once, like ours.
    if name in ML_DTYPES and ML_DTYPES_ROUNDS_FLOAT64_ONCE:
        assert bits_equal(x.astype(ML_DTYPES[name]).astype(np.float64), ours).all()


def test_documented_double_rounding_cases():
    assert quantize(68.00000356923152, "e4m3fn") == 72.0
    assert quantize(np.float32(68.00000356923152), "e4m3fn") == 64.0  # float32(68.0000036) is the tie 68
    cast = np.array([68.00000356923152]).astype(ml_dtypes.float8_e4m3fn).astype(float)[0]
    assert cast == (72.0 if ML_DTYPES_ROUNDS_FLOAT64_ONCE else 64.0)
    assert quantize(1 + 2.0**-8 + 2.0**-40, "bf16") == 1.0078125


@pytest.mark.parametrize(
    ("name", "value", "non_saturating", "saturating"),
    [
        ("e4m3fn", 448.0, 448.0, 448.0),
        ("e4m3fn", 464.0, 448.0, 448.0),  # a tie rounds to even (448), then fits
        ("e4m3fn", 465.0, math.nan, 448.0),
        ("e4m3fn", math.inf, math.nan, 448.0),
        ("e4m3fn", -1e6, math.nan, -448.0),
        ("e5m2", 61439.0, 57344.0, 57344.0),
        ("e5m2", 61440.0, math.inf, 57344.0),
        ("e5m2", -math.inf, -math.inf, -57344.0),
        ("fp16", 65519.0, 65504.0, 65504.0),
        ("fp16", 65520.0, math.inf, 65504.0),
        ("e4m3fnuz", 247.0, 240.0, 240.0),
        ("e4m3fnuz", 248.0, math.nan, 240.0),  # a tie: 240 = 15 * 16 is odd, so it rounds up to 256
        ("e2m1fn", 100.0, 6.0, 6.0),  # no inf/NaN: fp4 always saturates
        ("e3m2fn", -math.inf, -28.0, -28.0),
        ("e4m3fn", math.nan, math.nan, math.nan),
    ],
)  # fmt: skip
def test_saturation(name, value, non_saturating, saturating, implementation):
    for saturate, expected in ((False, non_saturating), (True, saturating)):
        for dtype in (np.float32, np.float64):
            got = float(quantize(np.array([value], dtype), name, saturate=saturate)[0])
            assert got == expected or (math.isnan(got) and math.isnan(expected)), (saturate, dtype)


def test_signed_zero_and_fnuz(implementation):
    x = np.array([-0.0, -1e-30, 0.0], np.float32)
    assert np.signbit(quantize(x, "e4m3fn")).tolist() == [True, True, False]
    assert np.signbit(quantize(x, "e4m3fnuz")).tolist() == [False, False, False]


def test_unsigned_and_zero_free_e8m0(implementation):
    out = quantize(np.array([-1.0, 0.0, 1.4, 1.5, 3.0, 2.0**-140], np.float32), "e8m0fnu")
    assert np.isnan(out[:2]).all()
    assert out[2:].tolist() == [1.0, 2.0, 4.0, 2.0**-127]


def test_toward_zero_never_overflows_a_finite_value(implementation):
    x = np.array([449.0, 1e30, -500.0, np.inf], np.float32)
    assert quantize(x, "e4m3fn", "toward_zero")[:3].tolist() == [448.0, 448.0, -448.0]
    assert np.isnan(quantize(x, "e4m3fn", "toward_zero")[3])


# -- stochastic rounding ---------------------------------------------------------------------------
def test_stochastic_results_are_the_two_neighbours(implementation):
    f = get_format("e4m3fn")
    x = random_float32(20_000, seed=5)
    x = x[np.isfinite(x) & (np.abs(x) <= f.max)]
    out = quantize(x, f, "stochastic", seed=11)
    lows, highs = zip(*(neighbours(abs(__import__("fractions").Fraction(float(v))), f) for v in x))
    lo = np.copysign(np.array(lows, float), x)
    hi = np.copysign(np.array(highs, float), x)
    assert ((out == lo) | (out == hi)).all()
    inexact = lo != hi
    assert (out[inexact] == lo[inexact]).any() and (out[inexact] == hi[inexact]).any()


@pytest.mark.parametrize(("name", "value"), [("bf16", 1.001), ("e4m3fn", 1.03125), ("e5m2", -3e-6),
                                             ("e2m1fn", 2.7), ("fp16", 1e-7)])  # fmt: skip
def test_stochastic_is_unbiased(name, value, implementation):
    n = 100_000
    x = np.full(n, value, np.float64)
    out = quantize(x, name, "stochastic", seed=2024)
    lo, hi = np.unique(out)
    p = (value - lo) / (hi - lo)  # the exact probability of rounding up
    sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(out.mean() - value) < 4 * sigma
    assert abs((out == hi).mean() - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_stochastic_unbiased_over_random_values(implementation):
    x = np.random.default_rng(3).uniform(-400, 400, 100_000).astype(np.float32)
    err = quantize(x, "e4m3fn", "stochastic", seed=9).astype(np.float64) - x
    assert abs(err.mean()) < 4 * err.std() / math.sqrt(x.size)


def test_stochastic_is_reproducible(implementation):
    x = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    a = quantize(x, "e4m3fn", "stochastic", seed=42)
    assert bits_equal(a, quantize(x, "e4m3fn", "stochastic", seed=42)).all()
    assert not bits_equal(a, quantize(x, "e4m3fn", "stochastic", seed=43)).all()
    assert bits_equal(
        a.reshape(100, 100), quantize(x.reshape(100, 100), "e4m3fn", "stochastic", seed=42)
    ).all()


def test_stochastic_never_rounds_into_nan(implementation):
    x = np.linspace(440, 464, 50_000, dtype=np.float32)  # up to the overflow midpoint
    out = quantize(x, "e4m3fn", "stochastic", seed=0)
    assert np.isfinite(out).all() and out.max() == 448.0


def test_numba_and_numpy_agree_bit_for_bit(monkeypatch):
    from polyamp.numerics import rounding

    x = np.concatenate([X32[:200_000], edge_values("e5m2")])
    results = {}
    for impl in ("numba", "numpy"):
        monkeypatch.setenv("POLYAMP_NO_NUMBA", "1" if impl == "numpy" else "")
        rounding._kernel.cache_clear()
        with np.errstate(invalid="ignore"):
            results[impl] = [quantize(x.astype(dt), name, mode, sat, seed=5)
                             for name in ("e5m2", "e4m3fn", "fp16", "e2m1fn", "tf32")
                             for mode in MODES for sat in (False, True)
                             for dt in (np.float32, np.float64)]  # fmt: skip
    rounding._kernel.cache_clear()
    for a, b in zip(results["numba"], results["numpy"]):
        assert bits_equal(a, b).all()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_16bit_inputs_keep_their_dtype_and_agree_with_float32(dtype, mode):
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    out = quantize(x, "e4m3fn", mode, seed=3)
    assert out.dtype == np.dtype(dtype)
    ref = quantize(x.astype(np.float32), "e4m3fn", mode, seed=3).astype(dtype)
    assert bits_equal(out.astype(np.float32), ref.astype(np.float32)).all()


def test_shapes_scalars_and_views():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4) * 7.3
    out = quantize(x[:, ::2, 1:], "e4m3fn")
    assert out.shape == (2, 2, 3)
    np.testing.assert_array_equal(out, quantize(np.ascontiguousarray(x[:, ::2, 1:]), "e4m3fn"))
    assert isinstance(quantize(3.3, "bf16"), np.float64) and quantize(3.3, "bf16") == 3.296875
    assert quantize([1, 2, 3], "e2m1fn").tolist() == [1.0, 2.0, 3.0]
    assert quantize(np.zeros((0, 3), np.float32), "fp16").shape == (0, 3)


# -- properties -----------------------------------------------------------------------------------
finite32 = hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=False))
names = st.sampled_from(["fp16", "bf16", "e4m3fn", "e5m2", "e4m3fnuz", "e2m3fn", "e2m1fn", "tf32"])


@given(finite32, names, st.sampled_from(["nearest", "toward_zero"]), st.booleans())
def test_idempotent(x, name, mode, saturate):
    once = quantize(x, name, mode, saturate)
    assert bits_equal(quantize(once, name, mode, saturate), once).all()


@given(finite32, names, st.sampled_from(["nearest", "toward_zero"]))
def test_monotone(x, name, mode):
    xs = np.sort(x)
    out = quantize(xs, name, mode, saturate=True)
    assert (np.diff(out.astype(np.float64)) >= 0).all()


@given(finite32, names)
def test_within_half_an_ulp(x, name):
    f = get_format(name)
    x = x[np.abs(x) <= f.max]
    out = quantize(x, f).astype(np.float64)
    ulp = np.ldexp(1.0, np.maximum(np.frexp(np.abs(x.astype(np.float64)))[1] - 1, f.emin) - f.mbits)
    assert (np.abs(out - x) <= ulp / 2).all()


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fmt": "fp7"}, "unknown format 'fp7'.*accepted: fp32"),
        ({"rounding": "up"}, "unknown rounding 'up'; accepted: nearest, stochastic, toward_zero"),
        ({"rounding": "stochastic", "seed": -1}, "seed must be an integer"),
        ({"rounding": "stochastic", "seed": 1.5}, "seed must be an integer"),
        ({"rounding": "nearest", "seed": "x"}, "seed must be an integer"),
        ({"saturate": "yes"}, "saturate must be True or False"),
    ],
)  # fmt: skip
def test_bad_arguments(kwargs, match):
    args = {"fmt": "e4m3fn", **kwargs}
    with pytest.raises(PolyampError, match=match):
        quantize(np.ones(3, np.float32), **args)


@pytest.mark.parametrize("x", [np.arange(3), np.ones(3, bool), np.ones(3, complex), "abc", True])
def test_non_float_input(x):
    with pytest.raises(PolyampError, match="expected a floating-point array"):
        quantize(x, "fp16")


# -- 16-bit inputs: one rounding, codes that depend on the value only ------------------------------
SIXTEEN = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
HELD_BY = {  # formats whose every value the 16-bit dtype holds, so quantize keeps that dtype
    "float16": {"fp16", "e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e2m3fn", "e3m2fn", "e2m1fn", "e3m4_ieee",
                "e4m4_fnuz"},
    "bfloat16": {"bf16", "e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e2m3fn", "e3m2fn", "e2m1fn", "e8m0fnu",
                 "e3m4_ieee", "e5m3_fn", "e4m4_fnuz"},
}  # fmt: skip


@pytest.mark.parametrize("dtype", SIXTEEN)
@pytest.mark.parametrize("name", [*FORMATS, "e3m4_ieee", "e5m3_fn", "e4m4_fnuz", "e6m9_ieee"])
def test_every_16bit_input_is_rounded_once(dtype, name):
    """All 65,536 bit patterns, nearest and toward zero, saturating or not: quantize gives exactly
    the float64 result (in the input dtype where it holds every value of the format, else float32),
    and encode gives the same codes as for the equal float64 values."""
    x = np.arange(1 << 16, dtype=np.uint16).view(SIXTEEN[dtype])
    wide = x.astype(np.float64)
    f = get_format(name)
    keep = ~np.isnan(wide) if not f.has_nan else np.ones(x.shape, bool)  # fp6/fp4 cannot encode NaN
    for mode in ("nearest", "toward_zero"):
        for saturate in (False, True):
            out = quantize(x, f, mode, saturate)
            assert out.dtype == (SIXTEEN[dtype] if name in HELD_BY[dtype] else np.float32)
            exact = quantize(wide, f, mode, saturate)
            bad = ~bits_equal(out.astype(np.float64), exact)
            assert not bad.any(), f"{mode} sat={saturate}: {bad.sum()} differ, e.g. {wide[bad][:3]}"
            assert (encode(x[keep], f, mode, saturate) == encode(wide[keep], f, mode, saturate)).all()


def test_16bit_double_rounding_cases_from_the_issue():
    bf16, fp16 = ml_dtypes.bfloat16, np.float16
    out = quantize(np.array([1e6], bf16), "fp16", saturate=True)
    assert out.dtype == np.float32 and out.tolist() == [65504.0]
    for kwargs in ({"saturate": True}, {"rounding": "toward_zero"}):
        assert encode(np.array([65536], bf16), "fp16", **kwargs).tolist() == [0x7BFF]
    assert encode(np.array([65408], fp16), "bf16").tolist() == [0x4780]
    assert encode(np.array([49152], fp16), "e8m0fnu").tolist() == [127 + 16]
    assert quantize(np.array([65504], fp16), "bf16").tolist() == [65536.0]


@pytest.mark.parametrize("dtype", SIXTEEN.values())
def test_16bit_stochastic_is_the_float32_result(dtype):
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    for name in ("fp16", "bf16", "e4m3fn", "e8m0fnu"):
        out = quantize(x, name, "stochastic", saturate=True, seed=4)
        ref = quantize(x.astype(np.float32), name, "stochastic", saturate=True, seed=4)
        assert bits_equal(out.astype(np.float32), ref).all()


# -- Python numbers are rounded from their exact value ---------------------------------------------
def test_python_numbers_are_rounded_exactly():
    tie_plus_one = 2**60 + 2**36 + 1  # float64 drops the +1 and lands on an fp32 tie (-> 2^60)
    assert quantize(tie_plus_one, "fp32") == 2.0**60 + 2.0**37
    assert quantize(10**400, "e4m3fn", "toward_zero") == 448.0  # finite: clamps, never NaN
    assert np.isnan(quantize(10**400, "e4m3fn"))
    assert quantize(-(10**400), "fp16", saturate=True) == -65504.0
    assert quantize(Fraction(464 * 10**20 + 1, 10**20), "e4m3fn", saturate=True) == 448.0
    assert np.isnan(quantize(Fraction(464 * 10**20 + 1, 10**20), "e4m3fn"))  # just above the tie
    assert quantize(Decimal("464.00000000000000000001"), "e4m3fn", saturate=True) == 448.0
    assert quantize(Decimal("1e-400"), "e8m0fnu") == 2.0**-127  # positive, so never NaN
    assert np.signbit(quantize(Decimal("-0"), "fp16"))
    mixed = [[Decimal("464.00000000000000000001"), 10**30], [tie_plus_one, Fraction(1, 3)]]
    assert quantize(mixed, "e4m3fn", saturate=True).tolist() == [[448.0, 448.0], [448.0, 0.34375]]


# -- every bad input is one PolyampError -------------------------------------------------------------
@pytest.mark.parametrize(
    ("x", "fmt", "kwargs", "match"),
    [
        (1.0, "e0m3_fn", {}, "0 exponent"),
        ([[1.0], [1.0, 2.0]], "fp16", {}, "cannot read .* as an array|ragged"),
        ([1.0, None], "fp16", {}, "object"),
        (np.ones(2), "fp16", {"rounding": ["nearest"]}, "unknown rounding"),
        (np.ones(2), "fp16", {"rounding": None}, "unknown rounding"),
        ([1.0, [2.0]], "fp16", {}, "cannot read .* as an array|object"),
    ],
)  # fmt: skip
def test_bad_input_is_one_polyamp_error(x, fmt, kwargs, match):
    with pytest.raises(PolyampError, match=match):
        quantize(x, fmt, **kwargs)


def test_non_native_byte_order_is_read():
    x = np.array([1.1, 464.0], ">f4")
    assert quantize(x, "e4m3fn").tolist() == [1.125, 448.0]
