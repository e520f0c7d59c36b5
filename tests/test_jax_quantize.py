"""``pa.quantize`` / ``pa.quantize_blocks`` on JAX arrays (``polyamp.jax.quantize``): bit-identical to
the numpy core for every format, rounding, saturate, input dtype, block format, scale rule and axis,
eagerly and under ``jax.jit``; JAX arrays in and out; the core's errors."""

import itertools

import ml_dtypes
import numpy as np
import pytest
from frameworks import require

jax = require("jax")
import jax.numpy as jnp  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.numerics import FORMATS  # noqa: E402

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4")
RULES = ("floor", "rceil", "ceil", "even")
ROUNDINGS = ("nearest", "toward_zero", "stochastic")
BF16 = np.dtype(ml_dtypes.bfloat16)


def same_bits(got, want):
    """Same dtype, shape and bit pattern; NaNs need only agree in sign (payloads are not compared)."""
    assert isinstance(got, jax.Array), type(got)
    got, want = np.asarray(got), np.asarray(want)
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


# -- quantize -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_quantize_matches_core(dtype, rounding):
    x = sample(dtype)
    for name in FORMATS:
        for saturate in (False, True):
            for seed in (0, 2**64 - 1) if rounding == "stochastic" else (None,):
                want = pa.quantize(x, name, rounding, saturate, seed=seed)
                same_bits(pa.quantize(jnp.asarray(x), name, rounding, saturate, seed=seed), want)


def test_quantize_float64_matches_core():
    x = np.concatenate([sample(np.float32).astype(np.float64), [1e-310, -5e-324, 1e300, 68.00000356923152]])
    with jax.enable_x64(True):
        xj = jnp.asarray(x)
        assert xj.dtype == jnp.float64
        for name in FORMATS:
            for rounding in ROUNDINGS:
                seed = 7 if rounding == "stochastic" else None
                for saturate in (False, True):
                    same_bits(pa.quantize(xj, name, rounding, saturate, seed=seed),
                              pa.quantize(x, name, rounding, saturate, seed=seed))  # fmt: skip


def test_quantize_under_jit_and_shapes():
    x = sample(np.float32, n=604).reshape(-1, 2, 3)
    f = jax.jit(lambda v: pa.quantize(v, "e4m3fn", "stochastic", seed=11))
    same_bits(f(jnp.asarray(x)), pa.quantize(x, "e4m3fn", "stochastic", seed=11))
    g = jax.jit(lambda v: pa.quantize(v, "e2m1fn", saturate=True))
    same_bits(g(jnp.asarray(x)), pa.quantize(x, "e2m1fn", saturate=True))
    scalar = pa.quantize(jnp.float32(464.0), "e4m3fn")
    assert isinstance(scalar, jax.Array) and scalar.shape == () and float(scalar) == 448.0
    assert pa.quantize(jnp.zeros((0, 3)), "e5m2", "stochastic", seed=1).shape == (0, 3)


def test_stochastic_is_unbiased_and_seeded():
    x = jnp.full((20000,), 1 + 2.0**-5, jnp.float32)  # a quarter of e4m3's step above 1
    a = pa.quantize(x, "e4m3fn", "stochastic", seed=3)
    assert np.array_equal(np.asarray(a), np.asarray(pa.quantize(x, "e4m3fn", "stochastic", seed=3)))
    assert not np.array_equal(np.asarray(a), np.asarray(pa.quantize(x, "e4m3fn", "stochastic", seed=4)))
    assert abs(float(jnp.mean(a)) - (1 + 2.0**-5)) < 2e-3


def test_result_dtype_follows_the_core():
    for dtype, name, want in [(jnp.float16, "bf16", jnp.float32), (jnp.float16, "e4m3fn", jnp.float16),
                              (jnp.bfloat16, "fp16", jnp.float32), (jnp.bfloat16, "e5m2", jnp.bfloat16),
                              (jnp.float32, "e2m1fn", jnp.float32)]:  # fmt: skip
        assert pa.quantize(jnp.ones(3, dtype), name).dtype == want


# -- quantize_blocks ----------------------------------------------------------------------------------
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


DTYPES = (np.float32, np.float16, BF16)


def mx_cases(fmt):
    """(rule, dtype, axis, rounding) for ``fmt``: every format with every scale rule (a distinct scale
    computation each, as the rules compare with the format's own Fmax and mantissa width), and the input
    dtype, blocked axis and rounding spread over those 20 cases so that each pair of values of any two of
    the five factors (format, rule, dtype, axis, rounding) occurs at least once (each case compiles once;
    ``test_the_mx_cases_cover_every_pair`` checks the design)."""
    f = MX.index(fmt)
    return [(rule, DTYPES[(f + r) % 3], (-1, 0)[(f + r) % 2], ("nearest", "stochastic")[(f + r // 2) % 2])
            for r, rule in enumerate(RULES)]  # fmt: skip


def test_the_mx_cases_cover_every_pair():
    rows = [(fmt, *case) for fmt in MX for case in mx_cases(fmt)]
    levels = [MX, RULES, DTYPES, (-1, 0), ("nearest", "stochastic")]
    for i, j in itertools.combinations(range(5), 2):
        assert {(row[i], row[j]) for row in rows} == set(itertools.product(levels[i], levels[j])), (i, j)


@pytest.mark.parametrize("fmt", MX)
def test_mx_blocks_match_core(fmt):
    for rule, dtype, axis, rounding in mx_cases(fmt):
        x = block_sample(dtype)
        kw = dict(axis=axis, scale_rule=rule, rounding=rounding, seed=5 if rounding == "stochastic" else None)
        same_bits(pa.quantize_blocks(jnp.asarray(x), fmt, **kw), pa.quantize_blocks(x, fmt, **kw))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
def test_nvfp4_blocks_match_core(dtype):
    """float32: every layout (1x16 along either axis, 16x16 tiles in either order) rounding to nearest,
    two of them stochastically; float16 and bfloat16 (the input's decomposition): a 1x16 and a tile
    layout, one rounding to nearest and one stochastically, the other way round for the other (each
    case compiles once)."""
    x = block_sample(dtype)
    xj = jnp.asarray(x)
    if dtype == np.float32:
        cases = [(16, -1, "nearest"), (16, 0, "nearest"), ((16, 16), (-2, -1), "nearest"),
                 ((16, 16), (1, 0), "nearest"), (16, 0, "stochastic"),
                 ((16, 16), (1, 0), "stochastic")]  # fmt: skip
    else:
        first, second = ("nearest", "stochastic") if dtype == BF16 else ("stochastic", "nearest")
        cases = [(16, -1, first), ((16, 16), (-2, -1), second)]
    for block, axis, rounding in cases:
        kw = dict(axis=axis, block=block, rounding=rounding, seed=9 if rounding == "stochastic" else None)
        same_bits(pa.quantize_blocks(xj, "nvfp4", **kw), pa.quantize_blocks(x, "nvfp4", **kw))


def nvfp4_edges() -> list[np.ndarray]:
    """float32 arrays for NVFP4's edges: s_global 1 with blocks of amax 6, 9 and 6.375 (s_block 1, 1.5 and the
    e4m3 tie 1.0625 -> 1) holding the e2m1 midpoints times s_block; a full 24-bit s_global with float32
    neighbours of those products; a bad block whose finite element sets s_global; s_global tiny (2^-149,
    subnormal, also for a tensor of one value) and near float32's max; random bit patterns; zeros and
    -0; NaN; all zeros (s_global 1). Each zero padded to 48x48 (whole blocks of zeros: no block's amax
    changes, nor s_global), so that one compilation per layout serves them all; partial blocks are
    ``test_nvfp4_blocks_match_core``'s."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0, 4.0, 0.0, 1.0, 2.0, 0.1, 4.5, 5.5])
    ties = np.zeros((48, 32))
    for i, (s, top) in enumerate([(1.0, 6.0), (1.5, 9.0), (1.0, 6.375)] * 16):
        ties[i, :16] = np.where(np.arange(16) % 2, -1, 1) * mids * s
        ties[i, 16:] = -mids[::-1] * s
        ties[i, 15] = top
    ties[47, 31] = 2688.0
    g = np.float64(np.float32(2688 * (1 + 3 * 2.0**-23)) / 2688)  # amax / 2688, float32, 24 bits
    near = np.outer(np.ones(32), np.append(mids, 6)[:16] * float(np.float32(g))).astype(np.float32)
    near[1::3] = np.nextafter(near[1::3], np.float32(np.inf))
    near[2::3] = np.nextafter(near[2::3], np.float32(0))
    near[0, 0] = np.float32(2688 * (1 + 3 * 2.0**-23))
    bad = np.ones((32, 32))
    bad[0, :2], bad[20, 7] = [np.inf, 1e30], np.nan
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 1 << 32, (32, 48), dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = [ties, near, bad, raw, rng.standard_normal((32, 32)) * 1e-44, rng.standard_normal((32, 32)) * 1e-36,
           rng.standard_normal((32, 32)) * 3e38, np.where(np.arange(32 * 32).reshape(32, 32) % 3, 0.0, -0.0),
           np.full((16, 16), np.nan), np.full((2, 16), 1e-44), np.zeros((3, 20))]  # fmt: skip
    with np.errstate(over="ignore"):
        return [np.pad(a, [(0, 48 - a.shape[0]), (0, 48 - a.shape[1])]).astype(np.float32) for a in out]


def test_nvfp4_nearest_float32_edges_match_core():
    """NVFP4's ties, scale ties and global-scale edges (``nvfp4_edges``): every axis and tile layout."""
    cases = [(16, -1), (16, 0), ((16, 16), (-2, -1)), ((16, 16), (1, 0))]
    for x in nvfp4_edges():
        xj = jnp.asarray(x)
        for block, axis in cases:
            same_bits(pa.quantize_blocks(xj, "nvfp4", axis=axis, block=block),
                      pa.quantize_blocks(x, "nvfp4", axis=axis, block=block))  # fmt: skip
    cube = nvfp4_edges()[3][:32].reshape(2, 16, 48)  # tiles over (0, 2): test_blocks_under_jit_and_3d
    for block, axis in ((16, 1), ((16, 16), (2, 1))):
        same_bits(pa.quantize_blocks(jnp.asarray(cube), "nvfp4", axis=axis, block=block),
                  pa.quantize_blocks(cube, "nvfp4", axis=axis, block=block))  # fmt: skip


def test_blocks_float64_match_core():
    x = block_sample(np.float64, shape=(20, 48))
    x[7, :3] = [1e-310, 1e300, -(2.0**-1074)]
    with jax.enable_x64(True):
        xj = jnp.asarray(x)
        for fmt in (*MX, "nvfp4"):
            for rule in RULES if fmt != "nvfp4" else (None,):
                for rounding, seed in (("nearest", None), ("stochastic", 4)):
                    kw = dict(scale_rule=rule, rounding=rounding, seed=seed)
                    same_bits(pa.quantize_blocks(xj, fmt, **kw), pa.quantize_blocks(x, fmt, **kw))


def test_blocks_under_jit_and_3d():
    """Traced inside a caller's jit (the float64 route's scoped x64 in another trace): an MX format
    rounding stochastically along a middle axis, and NVFP4 tiles over two non-adjacent axes."""
    x = block_sample(np.float32, shape=(33, 40))[None].repeat(3, 0)
    for fmt, kw in (("mxfp8_e4m3", dict(axis=1, scale_rule="rceil", rounding="stochastic", seed=2)),
                    ("nvfp4", dict(block=(16, 16), axis=(0, 2), rounding="stochastic", seed=1))):  # fmt: skip
        f = jax.jit(lambda v, fmt=fmt, kw=kw: pa.quantize_blocks(v, fmt, **kw))
        same_bits(f(jnp.asarray(x)), pa.quantize_blocks(x, fmt, **kw))


# -- dispatch and errors ------------------------------------------------------------------------------
def test_dispatch_returns_jax_arrays():
    x = jnp.linspace(-3, 3, 64, dtype=jnp.float32)
    assert isinstance(pa.quantize(x, "e4m3fn"), jax.Array)
    x = jnp.asarray(block_sample(np.float32))  # the shape and arguments of a case above: no new compilation
    out = pa.quantize_blocks(x, "mxfp8_e4m3")
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32 and out.shape == x.shape
    assert pa.quantize_blocks(x.astype(jnp.bfloat16), "nvfp4").dtype == jnp.float32


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x: pa.quantize(x, "e9m9"), "unknown format"),
        (lambda x: pa.quantize(x, "e4m3fn", rounding="up"), "unknown rounding"),
        (lambda x: pa.quantize(x, "e4m3fn", saturate=1), "saturate must be True or False"),
        (lambda x: pa.quantize(x, "e4m3fn", "stochastic", seed=-1), "seed must be an integer"),
        (lambda x: pa.quantize(x.astype(jnp.int32), "e4m3fn"), "expected a floating-point array"),
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
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(PolyampError, match=message):
        call(x)
    with pytest.raises(PolyampError, match=message):  # the numpy path says the same
        call(np.ones((2, 32), np.float32))
