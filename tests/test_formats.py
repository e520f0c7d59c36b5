import math

import ml_dtypes
import numpy as np
import pytest
from conftest import ML_DTYPES

from polyamp import PolyampError
from polyamp.numerics import FORMATS, FloatFormat, decode, encode, get_format, neighbours

# DESIGN.md section 5: exponent bits, mantissa bits, bias, max, min normal, min subnormal.
TABLE = {
    "fp32": (8, 23, 127, 3.4028234663852886e38, 2.0**-126, 2.0**-149),
    "tf32": (8, 10, 127, 3.4011621342146535e38, 2.0**-126, 2.0**-136),
    "fp16": (5, 10, 15, 65504.0, 2.0**-14, 2.0**-24),
    "bf16": (8, 7, 127, 3.3895313892515355e38, 2.0**-126, 2.0**-133),
    "e4m3fn": (4, 3, 7, 448.0, 2.0**-6, 2.0**-9),
    "e5m2": (5, 2, 15, 57344.0, 2.0**-14, 2.0**-16),
    "e4m3fnuz": (4, 3, 8, 240.0, 2.0**-7, 2.0**-10),
    "e5m2fnuz": (5, 2, 16, 57344.0, 2.0**-15, 2.0**-17),
    "e2m3fn": (2, 3, 1, 7.5, 1.0, 0.125),
    "e3m2fn": (3, 2, 3, 28.0, 0.25, 0.0625),
    "e2m1fn": (2, 1, 1, 6.0, 1.0, 0.5),
    "e8m0fnu": (8, 0, 127, 2.0**127, 2.0**-127, None),
}


@pytest.mark.parametrize("name", TABLE)
def test_facts_match_design_table(name):
    f = get_format(name)
    assert (f.ebits, f.mbits, f.bias, f.max, f.min_normal, f.min_subnormal) == TABLE[name]


@pytest.mark.parametrize("name", [n for n in ML_DTYPES if n != "fp32"])
def test_facts_match_ml_dtypes_finfo(name):
    f, info = get_format(name), ml_dtypes.finfo(ML_DTYPES[name])
    assert f.max == float(info.max)
    assert f.eps == float(info.eps)
    assert f.bits == info.bits
    if f.min_subnormal is not None:
        assert f.min_subnormal == float(info.smallest_subnormal)
    assert f.min_normal == float(info.smallest_normal)


@pytest.mark.parametrize("name", FORMATS)
def test_facts_agree_with_the_codes(name):
    """Every derived fact equals what enumerating the codes shows (sampled for 32-bit formats)."""
    f = get_format(name)
    if f.bits <= 19:
        values = decode(np.arange(1 << f.bits), f)
    else:
        values = decode(np.random.default_rng(0).integers(0, 1 << f.bits, 1 << 20), f)
    finite = values[np.isfinite(values)]
    assert finite.max() <= f.max and finite.min() >= -f.max
    top = int(encode([f.max], f)[0])
    assert decode([top], f)[0] == f.max
    above = top + 1  # the next code is inf/NaN, or the first negative code when there are none
    assert above == 1 << (f.bits - 1) if f.saturates_always else not np.isfinite(decode([above], f)[0])
    if f.bits <= 19:
        positive = finite[finite > 0]
        assert positive.min() == f.smallest_positive
        assert finite.size == f.finite_codes
        assert np.isinf(values).sum() == f.inf_codes
        assert np.isnan(values).sum() == f.nan_codes
        assert (np.signbit(values) & (values == 0)).any() == f.has_negative_zero
        one = np.searchsorted(np.unique(finite), 1.0)
        assert np.unique(finite)[one + 1] - 1.0 == f.eps


def test_digits_match_numpy():
    assert get_format("fp16").digits == np.finfo(np.float16).precision
    assert get_format("fp32").digits == np.finfo(np.float32).precision
    assert get_format("bf16").digits == ml_dtypes.finfo(ml_dtypes.bfloat16).precision


@pytest.mark.parametrize(
    ("alias", "name"),
    [("half", "fp16"), ("float16", "fp16"), ("bfloat16", "bf16"), ("E4M3", "e4m3fn"),
     ("fp8-e5m2", "e5m2"), ("fp4", "e2m1fn"), ("float32", "fp32"), ("e8m0", "e8m0fnu")],
)  # fmt: skip
def test_aliases(alias, name):
    assert get_format(alias) is FORMATS[name]


def test_custom_formats_state_their_convention():
    f = get_format("e3m4_ieee")
    assert (f.ebits, f.mbits, f.bias, f.max) == (3, 4, 3, 15.5)  # ml_dtypes float8_e3m4
    assert f.max == float(ml_dtypes.finfo(ml_dtypes.float8_e3m4).max)
    assert get_format("e4m3_ieee").max == 240.0  # the IEEE-like "e4m3" of pychop/chop
    assert get_format("e5m2_fnuz") == FloatFormat("e5m2_fnuz", 5, 2, 16, "fnuz")
    assert get_format("e3m3_none").max == 30.0  # no code reserved: 1.875 * 2^4
    with pytest.raises(PolyampError, match="ambiguous"):
        get_format("e3m4")


@pytest.mark.parametrize("bad", ["fp7", "e4m3_xyz", 16, None])
def test_unknown_format_lists_accepted(bad):
    with pytest.raises(PolyampError) as err:
        get_format(bad)
    assert repr(bad) in str(err.value) and "fp16" in str(err.value)


def test_custom_format_out_of_range():
    with pytest.raises(PolyampError, match="1-8 exponent bits"):
        get_format("e9m3_ieee")


def test_ieee_needs_a_mantissa():
    with pytest.raises(PolyampError, match="ieee"):
        FloatFormat("e5m0", 5, 0, 15, "ieee")


# -- bit codes ------------------------------------------------------------------------------------
SMALL = [n for n, f in FORMATS.items() if f.bits <= 16]


@pytest.mark.parametrize("name", [*SMALL, "e3m4_ieee", "e5m3_fn", "e4m4_fnuz", "e3m3_none"])
def test_every_code_decodes_and_reencodes(name):
    f = get_format(name)
    codes = np.arange(1 << f.bits)
    values = decode(codes, f)
    back = encode(values, f)
    assert back.dtype == f.storage_dtype
    nan = np.isnan(values)
    np.testing.assert_array_equal(back[~nan], codes[~nan])
    if nan.any():
        assert np.isnan(decode(back[nan], f)).all()


@pytest.mark.parametrize("name", SMALL)
def test_decode_matches_ml_dtypes_on_every_code(name):
    f, dtype = get_format(name), ML_DTYPES[name]
    codes = np.arange(1 << f.bits)
    ours = decode(codes, f)
    theirs = codes.astype(np.uint16 if f.bits > 8 else np.uint8).view(dtype).astype(np.float64)
    same = (ours == theirs) & (np.signbit(ours) == np.signbit(theirs))
    assert (same | (np.isnan(ours) & np.isnan(theirs))).all()


@pytest.mark.parametrize("name", ["fp32", "tf32"])
def test_wide_codes_round_trip(name):
    f = get_format(name)
    codes = np.random.default_rng(1).integers(0, 1 << f.bits, 1 << 18).astype(np.uint32)
    values = decode(codes, f)
    if name == "fp32":
        ref = codes.view(np.float32).astype(np.float64)
        assert ((values == ref) | (np.isnan(values) & np.isnan(ref))).all()
    finite = np.isfinite(values)
    np.testing.assert_array_equal(encode(values, f)[finite], codes[finite])


def test_nan_encodes_to_canonical_codes():
    assert encode([np.nan], "fp16")[0] == 0x7E00
    assert encode([np.nan], "e4m3fn")[0] == 0x7F
    assert encode([np.nan], "e4m3fnuz")[0] == 0x80
    assert encode([np.nan], "e8m0fnu")[0] == 0xFF


def test_codes_bad_input():
    with pytest.raises(PolyampError, match="0..255"):
        decode([256], "e4m3fn")
    with pytest.raises(PolyampError, match="integer"):
        decode([1.5], "e4m3fn")
    with pytest.raises(PolyampError, match="no NaN"):
        encode([1.0, math.nan], "e2m1fn")


# -- every entry point answers bad input with one PolyampError --------------------------------------
@pytest.mark.parametrize(
    ("spec", "match"),
    [("e0m3_fn", "0 exponent and 3 mantissa bits"), ("e0m0_none", "0 exponent"),
     ("e4m24_none", "0-23 mantissa bits"), ("e1m0_fn", "no finite non-zero value"),
     ("e1234m3_fn", "unknown format"), ("e4m3fm", "did you mean 'e4m3fn'")],
)  # fmt: skip
def test_bad_format_names(spec, match):
    with pytest.raises(PolyampError, match=match):
        get_format(spec)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"ebits": "4"}, "ebits must be an integer, got '4'"), ({"mbits": 3.0}, "mbits must be an integer"),
     ({"bias": None}, "bias must be an integer"), ({"ebits": True}, "ebits must be an integer"),
     ({"name": 5}, "name must be a string"), ({"signed": 1}, "signed must be True or False"),
     ({"special": ["fn"]}, "unknown special-value convention"),
     ({"signed": False, "special": "fnuz"}, "unsigned"), ({"ebits": -1}, "-1 exponent")],
)  # fmt: skip
def test_float_format_checks_its_fields(kwargs, match):
    fields = {"name": "x", "ebits": 4, "mbits": 3, "bias": 7, "special": "fn", **kwargs}
    with pytest.raises(PolyampError, match=match):
        FloatFormat(**fields)


@pytest.mark.parametrize("x", ["1.5", None, [1.0, 2.0], np.ones(2), True, 1j])
def test_neighbours_takes_one_real_number(x):
    with pytest.raises(PolyampError, match="one real number"):
        neighbours(x, "fp16")


def test_neighbours_of_formats_without_zero_or_sign():
    assert neighbours(0.0, "e8m0fnu") == (None, 2.0**-127)
    assert neighbours(-1.0, "e8m0fnu") == (None, 2.0**-127)
    assert neighbours(3.0, "e8m0fnu") == (2.0, 4.0)
    no_zero = FloatFormat("signed_e8m0", 8, 0, 127, "fn", subnormals=False)
    assert neighbours(-1e-40, no_zero) == (-(2.0**-127), 2.0**-127)
    assert neighbours(-0.3, "e2m1fn") == (-0.5, 0.0)
    assert neighbours(10**400, "e4m3fn") == (448.0, None)


def test_codes_bad_input_is_one_polyamp_error():
    assert decode([], "e4m3fn").shape == (0,)
    bad = (([[1], [1, 2]], "cannot read|integer array"), ("abc", "integer"), ([10**30], "integer"))
    for codes, match in bad:
        with pytest.raises(PolyampError, match=match):
            decode(codes, "e4m3fn")


def test_numerics_docstring_examples_run():
    import doctest

    from polyamp.numerics import codes, formats, rounding

    for module in (formats, rounding, codes):
        result = doctest.testmod(module)
        assert result.failed == 0 and (module is formats or result.attempted > 0), module.__name__
