"""Policy parsing: every ecosystem's spelling, the canonical names, and the errors."""

import dataclasses
import doctest
import itertools
import pickle

import pytest

import polyamp.policy
from polyamp.errors import PolyampError
from polyamp.policy import DTYPES, POLICY_NAMES, Policy

F32, BF16, F16, F64 = "float32", "bfloat16", "float16", "float64"
FULL32 = (F32, F32, F32)
MIXED_BF16 = (F32, BF16, F32)
MIXED_F16 = (F32, F16, F32)
TRUE_BF16 = (BF16, BF16, BF16)
TRUE_F16 = (F16, F16, F16)
FULL64 = (F64, F64, F64)

# spelling -> (param, compute, output)
SPELLINGS = {
    # polyamp's own
    "float32": FULL32,
    "fp32": FULL32,
    "full": FULL32,
    "bf16-mixed": MIXED_BF16,
    "fp16-mixed": MIXED_F16,
    "bf16-true": TRUE_BF16,
    "fp16-true": TRUE_F16,
    # Keras: mixed_* keep float32 variables; a bare dtype is that dtype everywhere
    "mixed_float16": MIXED_F16,
    "mixed_bfloat16": MIXED_BF16,
    "bfloat16": TRUE_BF16,
    "float16": TRUE_F16,
    "float64": FULL64,
    # Lightning (precision=16 means 16-mixed there)
    "16-mixed": MIXED_F16,
    "32-true": FULL32,
    "32": FULL32,
    "16-true": TRUE_F16,
    "16": MIXED_F16,
    "64-true": FULL64,
    "64": FULL64,
    # Lightning's "bf16" and Accelerate's mixed_precision values
    "bf16": MIXED_BF16,
    "fp16": MIXED_F16,
    "no": FULL32,
    # jmp: bare dtypes set all three; unspecified params f32, compute follows params,
    # output follows compute
    "f32": FULL32,
    "f16": TRUE_F16,
    "half": TRUE_F16,
    "f64": FULL64,
    "c=f16": (F32, F16, F16),
    "c=bf16": (F32, BF16, BF16),
    "p=f16": TRUE_F16,
    "p=bf16,c=f32": (BF16, F32, F32),
    "p=f16,c=bf16": (F16, BF16, BF16),
    "o=bf16": (F32, F32, BF16),
    "p=f32,c=bf16,o=f32": MIXED_BF16,
    "params=float32,compute=half,output=full": MIXED_F16,
    "param=bfloat16,o=float32": (BF16, BF16, F32),
    "compute=f64": (F32, F64, F64),
}


@pytest.mark.parametrize("spec", list(SPELLINGS))
def test_every_spelling_parses_to_its_dtypes(spec):
    expected = SPELLINGS[spec]
    for variant in (spec, spec.upper(), f"  {spec.title()} "):
        p = Policy.parse(variant)
        assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected, variant


def test_lightning_integer_precisions():
    assert Policy.parse(16) == Policy(*MIXED_F16)
    assert Policy.parse(32) == Policy(*FULL32)
    assert Policy.parse(64) == Policy(*FULL64)


def test_jmp_grammar_tolerates_spaces_and_any_key_order():
    assert Policy.parse(" o = f32 , c = bf16 ") == Policy(*MIXED_BF16)


def test_named_spellings_are_all_listed():
    named = {spec for spec in SPELLINGS if "=" not in spec}
    assert named == set(POLICY_NAMES)
    assert len(POLICY_NAMES) == len(set(POLICY_NAMES))


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("full", "float32"),
        ("mixed_bfloat16", "bf16-mixed"),
        ("16-mixed", "fp16-mixed"),
        ("bfloat16", "bf16-true"),
        ("half", "fp16-true"),
        ("c=f16", "p=f32,c=f16,o=f16"),
        ("float64", "p=f64,c=f64,o=f64"),
    ],
)
def test_canonical_names(spec, name):
    p = Policy.parse(spec)
    assert p.name == name and str(p) == name


@pytest.mark.parametrize("dtypes", list(itertools.product(DTYPES, repeat=3)))
def test_name_round_trips_and_properties(dtypes):
    p = Policy(*dtypes)
    param, compute, _ = dtypes
    assert Policy.parse(p.name) == p
    assert Policy.parse(p) is p
    assert p.needs_loss_scaling == (F16 in (param, compute))
    assert p.is_mixed == (param != compute)
    assert pickle.loads(pickle.dumps(p)) == p and hash(p) == hash(Policy(*dtypes))


def test_loss_scaling_is_needed_only_for_fp16():
    needs = {spec: Policy.parse(spec).needs_loss_scaling for spec in POLICY_NAMES}
    assert {spec for spec, need in needs.items() if need} == {
        "fp16-mixed",
        "mixed_float16",
        "16-mixed",
        "16",
        "fp16",
        "fp16-true",
        "16-true",
        "float16",
        "f16",
        "half",
    }


def test_constructor_canonicalises_aliases_and_is_frozen():
    p = Policy("f32", "BF16", "full")
    assert p == Policy.parse("bf16-mixed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute_dtype = F16
    with pytest.raises(PolyampError, match="'float8'"):
        Policy("float32", "float8", "float32")


@pytest.mark.parametrize(
    ("spec", "meant"),
    [("bf16-mixd", "bf16-mixed"), ("Mixed_BFloat", "mixed_bfloat16"), ("bf32", "f32"), ("fp61", "fp16")],
)
def test_a_near_miss_gets_a_suggestion_and_a_short_list(spec, meant):
    with pytest.raises(PolyampError) as err:
        Policy.parse(spec)
    message = str(err.value)
    assert f"{spec!r}; did you mean {meant!r}?" in message
    for name in ("float32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true", "p=f32,c=bf16,o=f32"):
        assert name in message
    assert len(message) < 400 and "mixed_float16" not in message


@pytest.mark.parametrize(
    "spec", ["fp8", "mixed_float8", "", "16-bf16", "true", 8, 3.5, None, ["bf16"]]
)
def test_unknown_spelling_names_it_and_lists_the_accepted(spec):
    with pytest.raises(PolyampError) as err:
        Policy.parse(spec)
    message = str(err.value)
    assert repr(spec) in message
    for accepted in ("bf16-mixed", "mixed_float16", "16-mixed", "no", "p=f32,c=bf16,o=f32"):
        assert accepted in message


@pytest.mark.parametrize(
    ("spec", "part"),
    [
        ("c=f8", "'c=f8'"),
        ("q=f16", "'q=f16'"),
        ("c=f16,c=bf16", "repeats"),
        ("p=", "'p='"),
        ("c=f16,", "''"),
    ],
)
def test_bad_jmp_grammar(spec, part):
    with pytest.raises(PolyampError) as err:
        Policy.parse(spec)
    message = str(err.value)
    assert repr(spec) in message and part in message and "p|params|param" in message


def test_docstring_examples():
    result = doctest.testmod(polyamp.policy)
    assert result.attempted >= 2 and result.failed == 0
