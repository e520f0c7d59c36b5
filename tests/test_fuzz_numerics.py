"""Seeded fuzzing of every numerics entry point: each call returns or raises PolyampError, nothing else.

Format names (valid, near-valid, garbage, not strings), FloatFormat fields, arrays of every shape and
dtype (ragged, objects, strings), Python numbers, roundings, saturate flags and seeds. A raw numpy or
Python exception escaping any entry point fails the test with the input that caused it.
"""

import math
from decimal import Decimal

import ml_dtypes
import numpy as np
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from polyamp import PolyampError
from polyamp.numerics import FORMATS, ROUNDINGS, FloatFormat, decode, encode, get_format, neighbours, quantize
from polyamp.numerics.formats import ALIASES, CONVENTIONS

FUZZ = settings(max_examples=400, deadline=None)
SEED = 20251130

# -- formats ----------------------------------------------------------------------------------------
VALID = [*FORMATS, *ALIASES, "e3m4_ieee", "e5m3_fn", "e4m4_fnuz", "e3m3_none", "E4M3", "fp8-e5m2"]
CONVENTION_TYPOS = [*CONVENTIONS, "", "xx", "IEEE", "fnu"]
bits = st.integers(-3, 40)
custom = st.builds("e{}m{}_{}".format, bits, bits, st.sampled_from(CONVENTION_TYPOS))
mutated = st.builds(
    lambda name, i, c: name[:i] + c + name[i + 1 :],
    st.sampled_from(VALID),
    st.integers(0, 8),
    st.sampled_from(["", " ", "_", "-", "0", "9", "x", "é", "\0"]),
)
not_a_name = st.one_of(
    st.none(), st.integers(), st.floats(), st.binary(max_size=4), st.lists(st.text(), max_size=2)
)
format_specs = st.one_of(st.sampled_from(VALID), custom, mutated, st.text(max_size=12), not_a_name)

field = st.one_of(
    st.integers(-3, 260), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none()
)
near_layouts = st.fixed_dictionaries({  # mostly sensible layouts, so that many are accepted
    "name": st.just("custom"), "ebits": st.integers(0, 9), "mbits": st.integers(-1, 24),
    "bias": st.integers(-5, 140), "special": st.sampled_from(CONVENTIONS),
    "signed": st.booleans(), "subnormals": st.booleans(),
})  # fmt: skip
layouts = near_layouts | st.fixed_dictionaries({
    "name": st.one_of(st.text(max_size=5), st.none(), st.integers()),
    "ebits": field, "mbits": field, "bias": field,
    "special": st.one_of(st.sampled_from([*CONVENTIONS, "IEEE", ""]), field),
    "signed": st.one_of(st.booleans(), field), "subnormals": st.one_of(st.booleans(), field),
})  # fmt: skip

# -- values -----------------------------------------------------------------------------------------
DTYPES = [np.float16, np.float32, np.float64, ">f4", ">f8", np.int8, np.int64, np.uint64, np.bool_,
          np.complex64, "U3", "S2", "M8[s]"]  # fmt: skip
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
arrays = st.one_of(
    hnp.arrays(st.sampled_from(DTYPES), shapes),
    hnp.arrays(np.uint16, shapes).map(lambda a: a.view(ml_dtypes.bfloat16)),
    hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=4), elements=st.floats(width=32)).map(
        lambda a: a[..., ::2]  # not contiguous
    ),
)
numbers_ = st.one_of(
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2**60 + 2**36 + 1, Decimal("sNaN"), Decimal("1e999999"), -0.0]),
    st.floats(),
    st.fractions(),
    st.decimals(),
    st.booleans(),
    st.complex_numbers(max_magnitude=1e6),
)
oddities = st.one_of(
    st.none(),
    st.text(max_size=4),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.sets(st.integers(), max_size=2),
    st.just(object()),
)
nested = st.recursive(st.one_of(numbers_, oddities), lambda inner: st.lists(inner, max_size=3), max_leaves=8)
values = st.one_of(arrays, numbers_, oddities, nested)

roundings = st.one_of(
    st.sampled_from([*ROUNDINGS, "rne", "sr", "RTZ", "truncate", "Nearest", "up", ""]),
    st.none(),
    st.integers(-1, 3),
    st.lists(st.just("nearest"), max_size=1),
)
saturates = st.one_of(st.booleans(), st.sampled_from([np.bool_(True), 0, 1, "yes", None, 1.0]))
seeds = st.one_of(st.none(), st.integers(-2, 2**65), st.floats(), st.text(max_size=2), st.booleans())


def outcome(call, *args, **kwargs):
    """The call's result, or None when it raised PolyampError; any other exception propagates."""
    try:
        return call(*args, **kwargs)
    except PolyampError:
        return None


# -- the fuzz ---------------------------------------------------------------------------------------
@seed(SEED)
@FUZZ
@given(format_specs)
def test_get_format(spec):
    fmt = outcome(get_format, spec)
    assert fmt is None or isinstance(fmt, FloatFormat)


@seed(SEED)
@FUZZ
@given(layouts)
def test_float_format_fields(fields):
    """Accepted fields give a format whose every derived fact is computable and sensible."""
    fmt = outcome(FloatFormat, **fields)
    if fmt is not None:
        facts = fmt.facts()
        assert facts["max"] > 0 and math.isfinite(facts["max"]) and facts["finite_codes"] > 0


@seed(SEED)
@FUZZ
@given(values, format_specs | near_layouts, roundings, saturates, seeds)
def test_quantize(x, fmt, rounding, saturate, seed_):
    if isinstance(fmt, dict):
        fmt = outcome(FloatFormat, **fmt) or "fp16"
    out = outcome(quantize, x, fmt, rounding, saturate, seed_)
    if out is not None:
        assert np.asarray(out).dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64)
        assert np.shape(out) == np.shape(np.asarray(x)) or not isinstance(x, np.ndarray)


@seed(SEED)
@FUZZ
@given(values, format_specs | near_layouts, roundings, saturates, seeds)
def test_encode(x, fmt, rounding, saturate, seed_):
    if isinstance(fmt, dict):
        fmt = outcome(FloatFormat, **fmt) or "fp16"
    codes = outcome(encode, x, fmt, rounding, saturate, seed_)
    assert codes is None or np.asarray(codes).dtype.kind == "u"


@seed(SEED)
@FUZZ
@given(st.one_of(hnp.arrays(st.sampled_from([np.uint8, np.uint16, np.uint32, np.int64, np.float32, np.bool_]),
                            shapes), nested, oddities), format_specs)  # fmt: skip
def test_decode(codes, fmt):
    out = outcome(decode, codes, fmt)
    assert out is None or out.dtype == np.float64


@seed(SEED)
@FUZZ
@given(st.one_of(numbers_, oddities, arrays), format_specs)
def test_neighbours(x, fmt):
    pair = outcome(neighbours, x, fmt)
    if pair is not None:
        below, above = pair
        assert below is None or above is None or below <= above
