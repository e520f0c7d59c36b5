"""``pa.quantize`` / ``pa.quantize_blocks`` on TensorFlow tensors (``polyamp.tensorflow.quantize``):
bit-identical to the numpy core for every format, rounding, saturate, input dtype, block format, scale
rule and axis, eagerly (where TF's CPU kernels flush float32 subnormals), inside ``tf.function`` and
with ``jit_compile=True``; TF tensors in and out; the core's errors."""

import numpy as np
import pytest
from frameworks import require

tf = require("tensorflow")

import ml_dtypes  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.numerics import FORMATS  # noqa: E402

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4")
RULES = ("floor", "rceil", "ceil", "even")
ROUNDINGS = ("nearest", "toward_zero", "stochastic")
BF16 = np.dtype(ml_dtypes.bfloat16)


def same_bits(got, want):
    """Same dtype, shape and bit pattern; NaNs need only agree in sign (payloads are not compared)."""
    assert isinstance(got, tf.Tensor), type(got)
    got, want = got.numpy(), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape)
    u = f"u{got.itemsize}"
    nan = np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
    ok = (got.view(u) == want.view(u)) | (nan & (np.signbit(got) == np.signbit(want)))
    bad = np.flatnonzero(~ok)[:5]
    assert ok.all(), f"{bad}: got {got.flat[bad]}, want {want.flat[bad]}"


def specials(dtype) -> np.ndarray:
    """+-0, +-inf, NaN, float32/16-bit subnormals and extremes, every format's max, just above it,
    its ties (midpoints between neighbours at 1 and at the subnormal step) and subnormals."""
    info = np.finfo(np.float32)
    v = [0.0, -0.0, np.inf, -np.inf, np.nan, info.max, -info.max, info.smallest_subnormal, 2.0**-126,
         3 * 2.0**-149, 1e-40, 2.0**-24, 2.0**-14, 65504.0, 65520.0, 3.39e38]  # fmt: skip
    for f in FORMATS.values():
        step = 2.0 ** (f.emin - f.mbits)
        v += [f.max, f.max * (1 + 2.0 ** -(f.mbits + 2)), f.max * (1 + 2.0 ** -(f.mbits + 1)), f.max * 2]
        v += [1 + 2.0 ** -(f.mbits + 1), 1 + 3 * 2.0 ** -(f.mbits + 1)]
        v += [step, step / 2, 1.5 * step, 2.5 * step]
        v += [f.min_normal, f.min_normal * (1 - 2.0**-30)]
    v = np.array(v, np.float64)
    v = np.concatenate([v, -v])
    with np.errstate(over="ignore"):
        return v.astype(dtype)


def sample(dtype, n=3000, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    low = -160 if dtype != np.float16 else -26
    high = 130 if dtype != np.float16 else 17
    x = rng.standard_normal(n) * np.exp2(rng.integers(low, high, n))
    with np.errstate(over="ignore"):
        return np.concatenate([specials(dtype), x.astype(dtype)])


def block_sample(dtype, shape=(37, 70), seed=1) -> np.ndarray:
    """Random rows of different magnitudes plus a NaN block, an inf block, a zero block, a partial
    block, a float32-subnormal block, a max-exponent row and ties on the element grids."""
    rng = np.random.default_rng(seed)
    big = 30 if dtype != np.float16 else 6
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-big, big, (shape[0], 1)))
    x[0, 3] = np.nan
    x[1, 35] = -np.inf
    x[2, 32:64] = 0
    x[3, :32] = [3e-41 * (i + 1) for i in range(32)] if dtype != np.float16 else 0
    x[4, :4] = [480, 1, -500, 0.75]  # floor clips, even rounds up
    x[5, :8] = [6, 5, 2.5, 1.25, 0.25, -0.75, 3.5, -0.0]  # e2m1 ties
    x[6] = np.linspace(-1, 1, shape[1]) * (3.4e38 if dtype != np.float16 else 65504)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


def tensor(x):
    """``x`` as a TF tensor, bit for bit (a cast to bfloat16 would drop NaN signs)."""
    return tf.constant(x) if x.dtype != BF16 else tf.bitcast(tf.constant(x.view(np.uint16)), tf.bfloat16)


# -- quantize -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64],
                         ids=["float32", "float16", "bfloat16", "float64"])  # fmt: skip
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_matches_core(dtype, rounding):
    """Every format, saturate or not; the stream's seeds 0 and 2^64 - 1 on float32 (the stream indexes
    elements whatever their dtype), one of them per format on the other dtypes."""
    x = sample(dtype)
    if dtype == np.float64:
        x = np.concatenate([x, [1e-310, -5e-324, 1e300, 68.00000356923152]])
    xt = tensor(x)
    for i, name in enumerate(FORMATS):
        seeds = (0, 2**64 - 1) if dtype == np.float32 else ((0, 2**64 - 1)[i % 2],)
        for saturate in (False, True):
            for seed in seeds if rounding == "stochastic" else (None,):
                want = pa.quantize(x, name, rounding, saturate, seed=seed)
                same_bits(pa.quantize(xt, name, rounding, saturate, seed=seed), want)


@pytest.mark.parametrize("jit", [False, True], ids=["tf.function", "jit_compile"])
def test_quantize_in_tf_function_and_shapes(jit):
    """Under XLA in a tf.function as a user writes it (AutoGraph converting polyamp's code); without XLA
    as ``graph_call`` traces the recipes' kernels (no AutoGraph: its conversion is most of a trace)."""
    x = sample(np.float32, n=604).reshape(-1, 2, 3)
    for fmt, kw in (("e4m3fn", dict(rounding="stochastic", seed=11)), ("e2m1fn", dict(saturate=True)),
                    ("e5m2", {}), ("bf16", dict(rounding="toward_zero"))):  # fmt: skip
        f = tf.function(lambda v, fmt=fmt, kw=kw: pa.quantize(v, fmt, **kw), jit_compile=jit, autograph=jit)
        same_bits(f(tf.constant(x)), pa.quantize(x, fmt, **kw))
    scalar = pa.quantize(tf.constant(464.0), "e4m3fn")
    assert isinstance(scalar, tf.Tensor) and scalar.shape == () and float(scalar) == 448.0
    assert pa.quantize(tf.zeros((0, 3)), "e5m2", "stochastic", seed=1).shape == (0, 3)
    variable = tf.Variable(x[:, 0, 0])
    same_bits(pa.quantize(variable, "e4m3fn"), pa.quantize(x[:, 0, 0], "e4m3fn"))


def test_stochastic_is_unbiased_and_seeded():
    x = tf.fill((20000,), tf.constant(1 + 2.0**-5, tf.float32))  # a quarter of e4m3's step above 1
    a = pa.quantize(x, "e4m3fn", "stochastic", seed=3).numpy()
    assert np.array_equal(a, pa.quantize(x, "e4m3fn", "stochastic", seed=3).numpy())
    assert not np.array_equal(a, pa.quantize(x, "e4m3fn", "stochastic", seed=4).numpy())
    assert abs(float(np.mean(a)) - (1 + 2.0**-5)) < 2e-3


def test_a_traced_seed_gives_the_cores_stream():
    from polyamp.tensorflow.quantize import key_of, quantize_keyed

    x = sample(np.float32, n=300)
    f = tf.function(lambda v, s: quantize_keyed(v, FORMATS["e5m2"], 1, False, key_of(s)))
    for seed in (0, 1, 12345, 2**40 + 3):
        want = pa.quantize(x, "e5m2", "stochastic", seed=seed)
        same_bits(f(tf.constant(x), tf.constant(seed, tf.int64)), want)


def test_result_dtype_follows_the_core():
    for dtype, name, want in [(tf.float16, "bf16", tf.float32), (tf.float16, "e4m3fn", tf.float16),
                              (tf.bfloat16, "fp16", tf.float32), (tf.bfloat16, "e5m2", tf.bfloat16),
                              (tf.float32, "e2m1fn", tf.float32),
                              (tf.float64, "e5m2", tf.float64)]:  # fmt: skip
        assert pa.quantize(tf.ones(3, dtype), name).dtype == want


# -- quantize_blocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("fmt", MX)
def test_mx_blocks_match_core(dtype, fmt):
    """float32: every scale rule x axis x rounding; float16 and bfloat16 (which only change how the
    elements and their amax decompose) every rule, with the axes and roundings taken in turn."""
    x = block_sample(dtype)
    xt = tensor(x)
    for i, rule in enumerate(RULES):
        for axis in (-1, 0) if dtype == np.float32 else ((-1, 0)[i % 2],):
            for rounding, seed in (("nearest", None), ("stochastic", 5)) if dtype == np.float32 else (
                    (("nearest", None), ("stochastic", 5))[i // 2],):  # fmt: skip
                kw = dict(axis=axis, scale_rule=rule, rounding=rounding, seed=seed)
                same_bits(pa.quantize_blocks(xt, fmt, **kw), pa.quantize_blocks(x, fmt, **kw))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
def test_nvfp4_blocks_match_core(dtype):
    x = block_sample(dtype)
    xt = tensor(x)
    cases = [(16, -1, "nearest"), (16, 0, "stochastic"), ((16, 16), (-2, -1), "nearest"),
             ((16, 16), (1, 0), "stochastic"), (16, -1, "stochastic"), (16, 0, "nearest"),
             ((16, 16), (1, 0), "nearest"), ((16, 16), (-2, -1), "stochastic")]  # fmt: skip
    if dtype != np.float32:  # each block shape and axis order once, each rounding twice
        cases = cases[:4]
    for block, axis, rounding in cases:
        kw = dict(axis=axis, block=block, rounding=rounding, seed=9 if rounding == "stochastic" else None)
        same_bits(pa.quantize_blocks(xt, "nvfp4", **kw), pa.quantize_blocks(x, "nvfp4", **kw))
    if dtype == np.float32:
        tiny = np.full((2, 16), 1e-44, np.float32)  # s_global underflows to 2^-149
        same_bits(pa.quantize_blocks(tf.constant(tiny), "nvfp4"), pa.quantize_blocks(tiny, "nvfp4"))
        zeros = np.zeros((3, 20), np.float32)
        same_bits(pa.quantize_blocks(tf.constant(zeros), "nvfp4"), pa.quantize_blocks(zeros, "nvfp4"))


def test_blocks_float64_match_core():
    x = block_sample(np.float64, shape=(20, 48))
    x[7, :3] = [1e-310, 1e300, -(2.0**-1074)]
    xt = tf.constant(x)
    for fmt in (*MX, "nvfp4"):
        for rule in RULES if fmt != "nvfp4" else (None,):
            for rounding, seed in (("nearest", None), ("stochastic", 4)):
                kw = dict(scale_rule=rule, rounding=rounding, seed=seed)
                same_bits(pa.quantize_blocks(xt, fmt, **kw), pa.quantize_blocks(x, fmt, **kw))


@pytest.mark.parametrize("jit", [False, True], ids=["tf.function", "jit_compile"])
def test_blocks_in_tf_function_and_3d(jit):
    """AutoGraph (a user's default) converting polyamp's code in the first case under XLA; the others
    traced as ``graph_call`` traces the recipes' kernels (AutoGraph's conversion is most of a trace)."""
    x = block_sample(np.float32, shape=(33, 40))[None].repeat(3, 0)
    for i, (fmt, kw) in enumerate((
            ("mxfp8_e4m3", dict(axis=1, scale_rule="rceil", rounding="stochastic", seed=2)),
            ("mxfp4", dict(axis=-1)), ("nvfp4", dict(block=(16, 16), axis=(0, 2))),
            ("nvfp4", dict(rounding="stochastic", seed=1)))):  # fmt: skip
        f = tf.function(lambda v, fmt=fmt, kw=kw: pa.quantize_blocks(v, fmt, **kw), jit_compile=jit,
                        autograph=jit and i == 0)  # fmt: skip
        same_bits(f(tf.constant(x)), pa.quantize_blocks(x, fmt, **kw))


# -- dispatch and errors ------------------------------------------------------------------------------
def test_dispatch_returns_tf_tensors():
    x = tf.linspace(-3.0, 3.0, 64)
    assert isinstance(pa.quantize(x, "e4m3fn"), tf.Tensor)
    out = pa.quantize_blocks(x, "mxfp8_e4m3")
    assert isinstance(out, tf.Tensor) and out.dtype == tf.float32 and out.shape == (64,)
    assert pa.quantize_blocks(tf.ones((2, 16), tf.bfloat16), "nvfp4").dtype == tf.float32


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x: pa.quantize(x, "e9m9"), "unknown format"),
        (lambda x: pa.quantize(x, "e4m3fn", rounding="up"), "unknown rounding"),
        (lambda x: pa.quantize(x, "e4m3fn", saturate=1), "saturate must be True or False"),
        (lambda x: pa.quantize(x, "e4m3fn", "stochastic", seed=-1), "seed must be an integer"),
        (lambda x: pa.quantize_blocks(x, "mxfp9"), "block format"),
        (lambda x: pa.quantize_blocks(x, "mxfp4", scale_rule="round"), "scale rule"),
        (lambda x: pa.quantize_blocks(x, "mxfp4", block=16), "does not match mxfp4"),
        (lambda x: pa.quantize_blocks(x, "nvfp4", scale_rule="floor"), "nvfp4 has one scale rule"),
        (lambda x: pa.quantize_blocks(x, "mxfp4", rounding="toward_zero"), "block formats round"),
        (lambda x: pa.quantize_blocks(x, "mxfp4", axis=2), "is not an axis"),
        (lambda x: pa.quantize_blocks(x[0], "nvfp4", block=(16, 16)), "16x16 blocks tile two axes"),
    ],
)
def test_errors_are_the_cores(call, message):
    with pytest.raises(PolyampError, match=message):
        call(tf.ones((2, 32), tf.float32))
    with pytest.raises(PolyampError, match=message):  # the numpy path says the same
        call(np.ones((2, 32), np.float32))


def test_tf_only_errors():
    with pytest.raises(PolyampError, match="expected a floating-point tensor, got dtype int32"):
        pa.quantize(tf.ones(3, tf.int32), "e4m3fn")
    f = tf.function(lambda v: pa.quantize(v, "e4m3fn"), input_signature=[tf.TensorSpec([None], tf.float32)])
    with pytest.raises(PolyampError, match="needs a static shape"):
        f.get_concrete_function()
