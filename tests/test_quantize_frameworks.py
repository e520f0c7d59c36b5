"""``pa.quantize`` / ``pa.quantize_blocks`` on each framework's tensors agree bit for bit with the numpy core.

Every check is written once and run on each installed framework through its adapter
(``framework_ops.py``): every format, rounding, saturate and input dtype (every 16-bit code), the
stochastic stream and its seeds, shapes, the result dtype rule, the block formats (every scale rule and
axis, NVFP4's tiles, partial blocks, float64 extremes), the framework's compilers, dispatch to the
framework's tensor type and the core's errors. A framework that compiles each new layout (JAX) takes a
covering subset of the largest grids; grids written for one framework's data run where they are cheap
(``only``). Framework-only behaviour follows at the end: torch's block-plane
fast path and in-place safety, TF's traced seeds and static shapes, MXNet's oneDNN casts, CUDA.
"""

import functools
import itertools

import numpy as np
import pytest
from framework_ops import ADAPTERS, BF16, adapter, ops_array, same_bits
from test_rounding import edge_values, random_float32

import polyamp as pa
from polyamp import BLOCK_FORMATS, PolyampError
from polyamp.numerics import FORMATS, exact_float, stream
from polyamp.numerics import xp as numpy_ops

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4")
RULES = ("floor", "rceil", "ceil", "even")
ROUNDINGS = ("nearest", "toward_zero", "stochastic")
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
DTYPES64 = (*DTYPES, np.dtype(np.float64))
BLOCK_CASES = [(f, r) for f, b in BLOCK_FORMATS.items() for r in (b.rules or (None,))]
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")  # mxnet


@pytest.fixture(params=list(ADAPTERS))
def fw(request):
    return adapter(request.param)


def compiled_cases(but=()):
    return [pytest.param(a.name, c, id=f"{a.name}-{c}") for a in ADAPTERS.values() for c in a.compiler_names
            if c not in but]  # fmt: skip


_CORE = {}


def core(fn, x, *args, **kwargs):
    """``fn(x, *args, **kwargs)`` on the numpy array ``x``, computed once for all frameworks."""
    key = (fn.__name__, x.dtype.str, x.shape, hash(x.tobytes()), args, tuple(sorted(kwargs.items())))
    if key not in _CORE:
        with np.errstate(over="ignore", invalid="ignore"):
            _CORE[key] = fn(x, *args, **kwargs)
    return _CORE[key]


def check(fw, fn, x, *args, **kwargs):
    """``fn`` (``pa.quantize`` or ``pa.quantize_blocks``) on ``x`` as ``fw``'s tensor equals it on ``x``."""
    with fw.holding(x.dtype):
        same_bits(fw, fn(fw.tensor(x), *args, **kwargs), core(fn, x, *args, **kwargs))


def only(fw, *names):
    """Skip unless ``fw`` is one of ``names``: a grid written for those frameworks' data stays theirs
    where elsewhere it would cost more than it adds (JAX compiles each new layout, TF runs op by op)."""
    if fw.name not in names:
        pytest.skip(f"run on {', '.join(names)} (the other frameworks run the grids written for them)")


# -- inputs ---------------------------------------------------------------------------------------------
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
    """``specials`` and random values over the dtype's range."""
    rng = np.random.default_rng(seed)
    low = -160 if dtype != np.float16 else -26
    high = 130 if dtype != np.float16 else 17
    x = rng.standard_normal(n) * np.exp2(rng.integers(low, high, n))
    with np.errstate(over="ignore"):
        return np.concatenate([specials(dtype), x.astype(dtype)])


def mixed(n, seed, dtype=np.float32) -> np.ndarray:
    """Random values of 60 binades after +-0, +-inf, NaN, a subnormal of ``dtype`` and ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(dtype)
    tiny = 1e-42 if dtype == np.float32 else 1e-310
    x[:9] = [0.0, -0.0, np.inf, -np.inf, np.nan, tiny, 2.5, -0.75, 1.5]  # 2.5, 0.75, 1.5: ties
    return x


def edges() -> np.ndarray:
    """Random float32 bit patterns and magnitudes, every format's ``edge_values``, float32 subnormals."""
    tiny = [2.0**-149, -(2.0**-149), 2.0**-127, 1.1754942e-38]  # float32 subnormals, e8m0's bottom
    with np.errstate(over="ignore", invalid="ignore"):
        return np.concatenate([random_float32(40_000, seed=1), *(edge_values(n) for n in FORMATS),
                               np.array(tiny, np.float32)])  # fmt: skip


def edges64() -> np.ndarray:
    """``edges`` in float64 and values float64 alone holds, or rounds twice through float32."""
    wide = [1e300, -1e-310, 5e-324, 68.00000356923152, 448.00000000000006, 464.0, 464.00000000000006, 3.5e38,
            np.nextafter(2.0**-10, 1)]  # fmt: skip
    return np.concatenate([edges().astype(np.float64), wide])


EXTRA64 = [1e-310, -5e-324, 1e300, 68.00000356923152]
# name -> (input, the seeds of stochastic rounding, the seed the other roundings are given); the 40 000
# ``edges`` are torch's alone (they would take longer than all the other frameworks' checks together)
QUANTIZE_OWNERS = {"edges": ("torch",), "mixed": ("torch", "mxnet")}
QUANTIZE_INPUTS = {
    "sample-float32": (lambda: sample(np.float32), (0, 2**64 - 1), None),
    "sample-float16": (lambda: sample(np.float16), (0, 2**64 - 1), None),
    "sample-bfloat16": (lambda: sample(BF16), (0, 2**64 - 1), None),
    "sample-float64": (lambda: np.concatenate([sample(np.float64), EXTRA64]), (0, 2**64 - 1), None),
    "sample32-float64": (lambda: np.concatenate([sample(np.float32), EXTRA64]), (7,), None),
    "edges-float32": (edges, (2**64 - 12345,), None),
    "edges-float64": (edges64, (2**64 - 12345,), None),
    "mixed-float32": (lambda: mixed(3000, seed=2), (7,), 7),
    "mixed-float64": (lambda: mixed(3000, seed=2, dtype=np.float64), (7,), 7),
}


@functools.cache
def quantize_input(case: str) -> np.ndarray:
    return QUANTIZE_INPUTS[case][0]()


# -- quantize ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("case", list(QUANTIZE_INPUTS))
def test_quantize_matches_core(fw, case, rounding):
    """Every format, saturate or not; the stream indexes elements whatever their dtype."""
    only(fw, *QUANTIZE_OWNERS.get(case.split("-")[0], ADAPTERS))
    _, seeds, other = QUANTIZE_INPUTS[case]
    x = quantize_input(case)
    with fw.holding(x.dtype):
        xt = fw.tensor(x)
        for name in FORMATS:
            for saturate in (False, True):
                for seed in seeds if rounding == "stochastic" else (other,):
                    want = core(pa.quantize, x, name, rounding, saturate, seed=seed)
                    same_bits(fw, pa.quantize(xt, name, rounding, saturate, seed=seed), want)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_every_16_bit_input_matches_core_with_its_result_dtype(fw, dtype, rounding):
    only(fw, "torch")
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)  # every code, NaNs and subnormals included
    seed = 99 if rounding == "stochastic" else None
    xt = fw.tensor(x)
    for name in FORMATS:
        for saturate in (False, True):
            want = core(pa.quantize, x, name, rounding, saturate, seed=seed)
            same_bits(fw, pa.quantize(xt, name, rounding, saturate, seed=seed), want)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "bf16", "fp16", "e2m1fn"])
def test_16_bit_mixed_inputs_keep_the_core_s_result_dtype(fw, fmt):
    x = mixed(500, seed=3).astype(np.float16)
    check(fw, pa.quantize, x, fmt)
    b = mixed(500, seed=4).astype(BF16)
    check(fw, pa.quantize, b, fmt, rounding="stochastic", seed=5)


def test_result_dtype_follows_the_core(fw):
    for dtype, name, want in [(np.float16, "bf16", np.float32), (np.float16, "e4m3fn", np.float16),
                              (BF16, "fp16", np.float32), (BF16, "e5m2", BF16),
                              (np.float32, "e2m1fn", np.float32),
                              (np.float64, "e5m2", np.float64)]:  # fmt: skip
        with fw.holding(dtype):
            assert fw.numpy(pa.quantize(fw.tensor(np.ones(3, dtype)), name)).dtype == want


def test_stochastic_stream_is_the_cores(fw):
    """Where the front end draws the core's stream over its ops (torch, MXNet); JAX and TF draw it in
    their own kernels, which the quantize checks above hold to the core's bits."""
    ops = pa.frameworks.front_end_module(fw.name, "xp")
    if not hasattr(ops, "unit53"):
        pytest.skip(f"{fw.name} draws the stream in its own quantize kernel")
    like = ops_array(fw, np.empty(0))
    for seed in (0, 1, 2**63, 2**64 - 1):
        key = stream.mix(seed)
        ours = fw.numpy(stream.uniform53(ops, key, 100_000, like))
        assert np.array_equal(ours, stream.uniform53(numpy_ops, key, 100_000, np.empty(0)))


def test_stochastic_is_unbiased_and_seeded(fw):
    x = fw.tensor(np.full(20000, 1 + 2.0**-5, np.float32))  # a quarter of e4m3's step above 1
    a = fw.numpy(pa.quantize(x, "e4m3fn", "stochastic", seed=3))
    assert np.array_equal(a, fw.numpy(pa.quantize(x, "e4m3fn", "stochastic", seed=3)))
    assert not np.array_equal(a, fw.numpy(pa.quantize(x, "e4m3fn", "stochastic", seed=4)))
    assert abs(float(np.mean(a)) - (1 + 2.0**-5)) < 2e-3
    x = fw.tensor(np.full(20_000, 1.1, np.float32))
    a, b = (fw.numpy(pa.quantize(x, "e4m3fn", "sr", seed=s)) for s in (1, 2))
    assert not np.array_equal(a, b) and np.array_equal(a, fw.numpy(pa.quantize(x, "e4m3fn", "sr", seed=1)))
    fresh = fw.numpy(pa.quantize(x, "e4m3fn", "stochastic"))  # no seed: fresh entropy, still on the grid
    assert set(np.unique(fresh).tolist()) <= {1.0, 1.125} and abs(float(fresh.mean()) - 1.1) < 0.01


def test_scalars_and_empty_tensors(fw):
    """MXNet 1.9 has neither: an empty NDArray is refused with the reason."""
    if not fw.has_scalars:
        with pytest.raises(PolyampError, match="MXNet 1.9 has no zero-size arrays"):
            pa.quantize(fw.tensor(np.zeros((0, 3), np.float32)), "e4m3fn")
        return
    for dtype in (np.float32, np.float64):
        with fw.holding(dtype):
            scalar = pa.quantize(fw.tensor(np.array(464.0, dtype)), "e4m3fn")
            assert isinstance(scalar, fw.tensor_type) and scalar.shape == ()
            assert float(fw.numpy(scalar)) == 448.0
    for args in (("e4m3fn",), ("e5m2", "stochastic", False, 1)):
        assert tuple(pa.quantize(fw.tensor(np.zeros((0, 3), np.float32)), *args).shape) == (0, 3)


@pytest.mark.parametrize("framework,compiler", compiled_cases(but=("torch.compile",)))
def test_quantize_compiled_and_shapes(framework, compiler):
    """(torch.compile traces ``quantize`` in ``test_blocks_compiled_and_3d``.)"""
    fw = adapter(framework)
    x = sample(np.float32, n=604).reshape(-1, 2, 3)
    for fmt, kw in (("e4m3fn", dict(rounding="stochastic", seed=11)), ("e2m1fn", dict(saturate=True)),
                    ("e5m2", {}), ("bf16", dict(rounding="toward_zero"))):  # fmt: skip
        f = fw.compilers[compiler](lambda v, fmt=fmt, kw=kw: pa.quantize(v, fmt, **kw), True)
        same_bits(fw, f(fw.tensor(x)), pa.quantize(x, fmt, **kw))


def test_nvfp4_global_scale_float32_quotient_rounds_as_the_exact_one(fw):
    """Elementwise over the framework's ops: each amax's scale is the exact quotient, rounded once."""
    rng = np.random.default_rng(6)
    raw = rng.integers(1, 1 << 32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = 2688 * (1 + np.arange(1, 2000) * 2.0**-24)  # quotients next to float32 midpoints
    amax = np.concatenate([raw, near]).astype(np.float32)
    amax = np.abs(amax[np.isfinite(amax) & (amax != 0)]).astype(np.float64)
    ops = pa.frameworks.front_end_module(fw.name, "xp")
    if not hasattr(ops, "float32_round"):
        pytest.skip(f"{fw.name} computes NVFP4's global scale in its own block kernel")
    with fw.holding(np.float64):
        ours = fw.numpy(exact_float.nvfp4_global_of(ops, ops_array(fw, amax), False)).tolist()
    assert ours == [exact_float.nvfp4_global_of(numpy_ops, np.array([v], np.float64), False).item()
                    for v in amax]  # fmt: skip
    assert ours == [exact_float.global_scale(float(v)) for v in amax]


# -- quantize_blocks --------------------------------------------------------------------------------------
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


def block_data(shape=(37, 70), seed=0) -> np.ndarray:
    """Random magnitudes per row, NaN / inf / all-zero / -0 / tiny / huge blocks, ties, partial blocks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-30, 30, (shape[0], 1)))
    x[3, 5], x[7, 40], x[8, 2] = np.nan, np.inf, -np.inf
    x[9, :] = 0.0
    x[10, :] = -0.0
    x[11, :32] = 2.0**-140
    x[12, :] = 3.0e38
    x[13, :32] = [448.0, 464.0, 480.0, 500.0, 512.0, 6.0, 5.0, 0.25, 0.75, 2.0**-9 * 3] * 3 + [1.0, -1.0]
    x[14, :] = rng.integers(-12, 13, shape[1]) * 0.25  # many ties on the element grids
    return x


@pytest.mark.parametrize("fmt,rule", BLOCK_CASES)
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_blocks_match_core_on_every_dtype_and_axis(fw, fmt, rule, mode):
    only(fw, "torch")
    x = block_data()
    axes = [(-1, None), (0, None), (1, None)]
    if fmt == "nvfp4":
        axes += [((0, 1), (16, 16)), ((1, 0), (16, 16)), (-1, (16, 16))]
    seed = 11 if mode == "stochastic" else None
    for dtype in DTYPES64:
        with np.errstate(over="ignore"):
            xx = x.astype(dtype)
        for axis, block in axes:
            check(fw, pa.quantize_blocks, xx, fmt, axis, block, rule, mode, seed)


def mx_cases(fmt):
    """(rule, dtype, axis, rounding) for ``fmt``: every format with every scale rule (a distinct scale
    computation each, as the rules compare with the format's own Fmax and mantissa width), and the input
    dtype, blocked axis and rounding spread over those 20 cases so that each pair of values of any two of
    the five factors (format, rule, dtype, axis, rounding) occurs at least once (each case compiles once
    in JAX; ``test_the_mx_cases_cover_every_pair`` checks the design)."""
    f = MX.index(fmt)
    return [(rule, DTYPES[(f + r) % 3], (-1, 0)[(f + r) % 2], ("nearest", "stochastic")[(f + r // 2) % 2])
            for r, rule in enumerate(RULES)]  # fmt: skip


def test_the_mx_cases_cover_every_pair():
    rows = [(fmt, *case) for fmt in MX for case in mx_cases(fmt)]
    levels = [MX, RULES, DTYPES, (-1, 0), ("nearest", "stochastic")]
    for i, j in itertools.combinations(range(5), 2):
        assert {(row[i], row[j]) for row in rows} == set(itertools.product(levels[i], levels[j])), (i, j)


@pytest.mark.parametrize("fmt", MX)
def test_mx_blocks_match_core(fw, fmt):
    """Every scale rule x dtype x axis x rounding; the pairwise cover ``mx_cases`` where each compiles."""
    cases = itertools.product(RULES, DTYPES, (-1, 0), ("nearest", "stochastic"))
    for rule, dtype, axis, rounding in mx_cases(fmt) if fw.compiles_each_shape else cases:
        kw = dict(axis=axis, scale_rule=rule, rounding=rounding, seed=5 if rounding == "stochastic" else None)
        check(fw, pa.quantize_blocks, block_sample(dtype), fmt, **kw)


NVFP4_LAYOUTS = [(16, -1, "nearest"), (16, 0, "nearest"), ((16, 16), (-2, -1), "nearest"),
                 ((16, 16), (1, 0), "nearest"), (16, 0, "stochastic"), ((16, 16), (1, 0), "stochastic"),
                 (16, -1, "stochastic"), ((16, 16), (-2, -1), "stochastic")]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
def test_nvfp4_blocks_match_core(fw, dtype):
    """Every layout (1x16 along either axis, 16x16 tiles in either order) and rounding; where each
    compiles, float32 takes six, float16 and bfloat16 (the input's decomposition) a 1x16 and a tile
    layout, one rounding to nearest and one stochastically, the other way round for the other."""
    cases = NVFP4_LAYOUTS
    if fw.compiles_each_shape:
        first, second = ("nearest", "stochastic") if dtype == BF16 else ("stochastic", "nearest")
        cases = NVFP4_LAYOUTS[:6] if dtype == np.float32 else [(16, -1, first), ((16, 16), (-2, -1), second)]
    x = block_sample(dtype)
    for block, axis, rounding in cases:
        kw = dict(axis=axis, block=block, rounding=rounding, seed=9 if rounding == "stochastic" else None)
        check(fw, pa.quantize_blocks, x, "nvfp4", **kw)
    if dtype == np.float32 and not fw.compiles_each_shape:  # JAX: nvfp4_edges, padded to one layout
        check(fw, pa.quantize_blocks, np.full((2, 16), 1e-44, np.float32), "nvfp4")  # s_global 2^-149
        check(fw, pa.quantize_blocks, np.zeros((3, 20), np.float32), "nvfp4")


def nvfp4_edges() -> list[np.ndarray]:
    """float32 arrays for NVFP4's edges: s_global 1 with blocks of amax 6, 9 and 6.375 (s_block 1, 1.5 and the
    e4m3 tie 1.0625 -> 1) holding the e2m1 midpoints times s_block; a full 24-bit s_global with float32
    neighbours of those products; a bad block whose finite element sets s_global; s_global tiny (2^-149,
    subnormal, also for a tensor of one value) and near float32's max; random bit patterns; zeros and
    -0; NaN; all zeros (s_global 1). Each zero padded to 48x48 (whole blocks of zeros: no block's amax
    changes, nor s_global), so that one compilation per layout serves them all."""
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


def test_nvfp4_nearest_float32_edges_match_core(fw):
    """NVFP4's ties, scale ties and global-scale edges (``nvfp4_edges``): every axis and tile layout."""
    for x in nvfp4_edges():
        for block, axis in ((16, -1), (16, 0), ((16, 16), (-2, -1)), ((16, 16), (1, 0))):
            check(fw, pa.quantize_blocks, x, "nvfp4", axis=axis, block=block)
    cube = nvfp4_edges()[3][:32].reshape(2, 16, 48)  # tiles over (0, 2): test_blocks_compiled_and_3d
    for block, axis in ((16, 1), ((16, 16), (2, 1))):
        check(fw, pa.quantize_blocks, cube, "nvfp4", axis=axis, block=block)


def test_blocks_float64_match_core(fw):
    x = block_sample(np.float64, shape=(20, 48))
    x[7, :3] = [1e-310, 1e300, -(2.0**-1074)]
    for fmt in (*MX, "nvfp4"):
        for rule in RULES if fmt != "nvfp4" else (None,):
            for rounding, seed in (("nearest", None), ("stochastic", 4)):
                check(fw, pa.quantize_blocks, x, fmt, scale_rule=rule, rounding=rounding, seed=seed)


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_3d_partial_and_float64_extremes(fw, fmt):
    only(fw, "torch")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 20, 35)) * 10.0 ** rng.integers(-300, 300, (3, 20, 1))
    x[0, 0, :] = [1e308] * 35
    x[1, 1, :] = 5e-324
    block = (16, 16) if fmt == "nvfp4" else None
    for axis in [(0, 2), (2, 1)] if fmt == "nvfp4" else [0, 1, 2]:
        check(fw, pa.quantize_blocks, x, fmt, axis, block)
    for x in (np.zeros((2, 16)), np.full((2, 16), np.nan), np.array([[np.inf] * 16, [1.0] * 16])):
        check(fw, pa.quantize_blocks, x, fmt)


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_match_core_on_shapes_axes_rules_and_specials(fw, fmt):
    """Partial blocks along every axis of 1-, 2- and 3-d tensors, a zero row, NVFP4's tiles of a 2- and a
    3-d tensor, float64; every scale rule and both roundings."""
    only(fw, "torch", "mxnet")
    bf = BLOCK_FORMATS[fmt]
    cases = [((37, 70), -1), ((37, 70), 0), ((3, 64, 5), 1), ((64,), 0)]  # partial blocks, a zero row
    for i, (shape, axis) in enumerate(cases):
        x = mixed(int(np.prod(shape)), seed=10 + i).reshape(shape)
        x[1] = 0.0
        for rule in bf.rules or (None,):
            for rounding in ("nearest", "stochastic"):
                check(fw, pa.quantize_blocks, x, fmt, axis=axis, scale_rule=rule, rounding=rounding, seed=3)
    if bf.blocks_2d:
        for shape in [(40, 35), (2, 32, 48)]:
            x = mixed(int(np.prod(shape)), seed=20).reshape(shape)
            for rounding in ("nearest", "stochastic"):
                kw = dict(axis=(-2, -1), block=(16, 16), rounding=rounding, seed=4)
                check(fw, pa.quantize_blocks, x, fmt, **kw)
                got = pa.quantize_blocks(fw.tensor(x), fmt, block=(16, 16), rounding=rounding, seed=4)
                same_bits(fw, got, core(pa.quantize_blocks, x, fmt, **kw))  # the default axes: the last two
    check(fw, pa.quantize_blocks, mixed(96, seed=21, dtype=np.float64).reshape(3, 32), fmt)


@pytest.mark.parametrize("framework,compiler", compiled_cases())
def test_blocks_compiled_and_3d(framework, compiler):
    """An MX format rounding stochastically along a middle axis, NVFP4 tiles over two non-adjacent axes
    (in JAX the float64 route's scoped x64 in another trace), and whole-tensor NVFP4 and MX (AutoGraph,
    a user's default, converts polyamp's code in the first case under XLA); torch.compile the 2-d
    ``block_data`` (each tracer's compilation is most of its time)."""
    fw = adapter(framework)
    x = block_sample(np.float32, shape=(33, 40))[None].repeat(3, 0)
    for i, (fmt, kw) in enumerate(() if framework == "torch" else (
            ("mxfp8_e4m3", dict(axis=1, scale_rule="rceil", rounding="stochastic", seed=2)),
            ("mxfp4", dict(axis=-1)), ("nvfp4", dict(block=(16, 16), axis=(0, 2))),
            ("nvfp4", dict(rounding="stochastic", seed=1)),
            *[("nvfp4", dict(block=(16, 16), axis=(0, 2), rounding="stochastic", seed=1))]
            * (framework == "jax"))):  # fmt: skip
        f = fw.compilers[compiler](lambda v, fmt=fmt, kw=kw: pa.quantize_blocks(v, fmt, **kw), i == 0)
        same_bits(fw, f(fw.tensor(x)), pa.quantize_blocks(x, fmt, **kw))
    x = block_data().astype(np.float32)
    for fn in () if framework != "torch" else (lambda t: pa.quantize(t, "e4m3fn", "stochastic", seed=3),
               lambda t: pa.quantize_blocks(t, "nvfp4", block=(16, 16), rounding="sr", seed=3),
               lambda t: pa.quantize_blocks(t, "mxfp8_e4m3", axis=0, scale_rule="even")):  # fmt: skip
        same_bits(fw, fw.compilers[compiler](fn, False)(fw.tensor(x)), fn(x))


# -- dispatch and errors ----------------------------------------------------------------------------------
def test_polyamp_dispatches_the_framework_s_tensors(fw):
    x = np.linspace(-500, 500, 64, dtype=np.float32).reshape(2, 32)
    out = pa.quantize(fw.tensor(x), "e4m3fn", saturate=True)
    assert isinstance(out, fw.tensor_type) and fw.numpy(out).dtype == np.float32
    same_bits(fw, out, pa.quantize(x, "e4m3fn", saturate=True))
    out = pa.quantize_blocks(fw.tensor(x.astype(BF16)), "mxfp4", scale_rule="rceil")
    assert isinstance(out, fw.tensor_type) and fw.numpy(out).dtype == np.float32
    line = np.linspace(-3.0, 3.0, 64, dtype=np.float32)
    assert isinstance(pa.quantize(fw.tensor(line), "e4m3fn"), fw.tensor_type)
    out = pa.quantize_blocks(fw.tensor(line), "mxfp8_e4m3")
    assert isinstance(out, fw.tensor_type) and fw.numpy(out).dtype == np.float32 and out.shape == (64,)
    x = block_sample(np.float32)  # the shape and arguments of a case above: no new compilation in JAX
    out = pa.quantize_blocks(fw.tensor(x), "mxfp8_e4m3")
    assert isinstance(out, fw.tensor_type) and fw.numpy(out).dtype == np.float32 and out.shape == x.shape
    assert fw.numpy(pa.quantize_blocks(fw.tensor(x.astype(BF16)), "nvfp4")).dtype == np.float32
    assert fw.numpy(pa.quantize_blocks(fw.tensor(np.ones((2, 16), BF16)), "nvfp4")).dtype == np.float32
    x = mixed(640, seed=30).reshape(20, 32)
    check(fw, pa.quantize, x, "e4m3fn", rounding="stochastic", seed=9)
    check(fw, pa.quantize_blocks, x, "mxfp8_e4m3", axis=0, scale_rule="floor")
    fake = type("Tensor", (), {"__module__": fw.module_root})()  # not a tensor of it: the core refuses it
    with pytest.raises(PolyampError, match="takes numpy arrays"):
        pa.quantize_blocks(fake, "mxfp4")


BOTH = ((32,), (2, 32))
ERRORS = [  # (function, positional args after x, keyword args, the shapes of x, what the message says)
    ("quantize", ("e9m9",), {}, BOTH, "unknown format"),
    ("quantize", ("e4m3fn", "up"), {}, BOTH, "unknown rounding"),
    ("quantize", ("e4m3fn",), {"saturate": 1}, BOTH, "saturate must be True or False"),
    ("quantize", ("e4m3fn", "sr"), {"seed": -1}, BOTH, "seed must be an integer"),
    ("quantize_blocks", ("mxfp9",), {}, BOTH, "block format"),
    ("quantize_blocks", ("mxfp4",), {"scale_rule": "round"}, BOTH, "scale rule"),
    ("quantize_blocks", ("mxfp4",), {"scale_rule": "up"}, BOTH, "scale rule"),
    ("quantize_blocks", ("mxfp4",), {"block": 16}, BOTH, "does not match mxfp4"),
    ("quantize_blocks", ("nvfp4",), {"scale_rule": "floor"}, BOTH, "nvfp4 has one scale rule"),
    ("quantize_blocks", ("mxfp4",), {"rounding": "toward_zero"}, BOTH, "block formats round"),
    ("quantize_blocks", ("mxfp4",), {"rounding": "rtz"}, BOTH, "block formats round"),
    ("quantize_blocks", ("mxfp4",), {"axis": 2}, BOTH, "is not an axis"),
    ("quantize_blocks", ("nvfp4",), {"block": (16, 16)}, ((32,),), "16x16 blocks tile two axes"),
]


@pytest.mark.parametrize("name,args,kwargs,shapes,message", ERRORS)
def test_errors_are_the_cores(fw, name, args, kwargs, shapes, message):
    for shape in shapes:
        a = np.ones(shape, np.float32)
        with pytest.raises(PolyampError, match=message) as theirs:
            getattr(pa.numerics, name)(a, *args, **kwargs)
        with pytest.raises(PolyampError, match=message) as mine:
            getattr(pa, name)(fw.tensor(a), *args, **kwargs)
        assert str(mine.value) == str(theirs.value)


def test_non_float_tensors_are_refused(fw):
    ints = fw.ints(4)
    with pytest.raises(PolyampError, match=fw.refusal):
        pa.quantize(ints, "e4m3fn")
    with pytest.raises(PolyampError, match=fw.refusal):
        pa.quantize_blocks(ints, "mxfp4")


# -- torch only -------------------------------------------------------------------------------------------
@pytest.fixture
def torch_fw():
    return adapter("torch")


def test_torch_layouts_grad_and_inputs_untouched(torch_fw):
    torch = torch_fw.torch
    x = np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32)
    t = torch_fw.tensor(x).t()  # not contiguous: the stochastic index is the logical (C-order) position
    want = pa.quantize(x.T, "e5m2", "stochastic", seed=4)
    same_bits(torch_fw, pa.quantize(t, "e5m2", "stochastic", seed=4), want)
    x64 = torch_fw.tensor(edges64())
    pa.quantize(x64, "e5m2", "stochastic", seed=1), pa.quantize_blocks(x64, "nvfp4")
    assert torch.equal(x64.nan_to_num(), torch.from_numpy(edges64()).nan_to_num())  # the input is untouched
    g = torch.ones(3, requires_grad=True) * 1.3
    assert not pa.quantize(g, "bf16").requires_grad


def tile_sets():
    """Arrays of whole 32 x 32 tiles: ``block_data``'s specials, those rows scaled by 2^-100 and 2^60
    (inf in float32); NVFP4 ties (a global amax of 2688 makes s_global 1; blocks of amax 6, 9 and 6.375
    give s_block 1, 1.5 and the e4m3 tie 1.0625 -> 1, holding the e2m1 midpoints times s_block); raw
    float32 bit patterns; a bad block whose finite element is the tensor's largest (it alone sets
    s_global); amaxes whose s_global underflows to 2^-149 or nears float32's max; zeros and NaNs."""
    x = block_data((64, 96))
    mixed_rows = np.concatenate([x, x[:32] * 2.0**-100, x[:32] * 2.0**60], axis=0)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0, 4.0, 0.0, 1.0, 2.0, 0.1, 4.5, 5.5])
    ties = np.zeros((64, 64))
    for i, (s, top) in enumerate([(1.0, 6.0), (1.5, 9.0), (1.0, 6.375)] * 21):
        ties[i, :16] = np.where(np.arange(16) % 2, -1, 1) * mids * s
        ties[i, 16:32] = -mids[::-1] * s
        ties[i, 15] = top
    ties[63, 63] = 2688.0
    raw = random_float32(64 * 64, seed=3).reshape(64, 64)
    bad = np.ones((64, 64))
    bad[0, 0], bad[0, 1], bad[40, 3] = np.inf, 1e30, np.nan
    tiny = np.random.default_rng(4).standard_normal((32, 64)) * 1e-44
    huge = np.random.default_rng(5).standard_normal((32, 64)) * 1e38
    zeros = np.zeros((32, 32))
    zeros[::2] = -0.0
    return [mixed_rows, ties, raw, bad, tiny, huge, zeros, np.full((32, 32), np.nan)]


def tile_layouts(fw, fmt):
    """(make the tensor from a 2-D array, the numpy array it holds, axis, block): contiguous, transposed
    (``p.t()`` of a contiguous p), 3-d; blocks along either axis, and NVFP4's 16 x 16 tiles."""
    plain = (lambda a: fw.tensor(a), lambda a: a)
    flip = (lambda a: fw.tensor(a).t(), lambda a: a.T)
    cube = (lambda a: fw.tensor(a).reshape(2, -1, a.shape[1]), lambda a: a.reshape(2, -1, a.shape[1]))
    out = [(*plain, -1, None), (*plain, 0, None), (*flip, -1, None), (*flip, 0, None), (*cube, -1, None)]
    if fmt == "nvfp4":
        out += [(*plain, (0, 1), (16, 16)), (*flip, (1, 0), (16, 16)), (*cube, (-2, -1), (16, 16))]
    return out


@pytest.mark.parametrize(
    "fmt,rule,mode", [(*c, "nearest") for c in BLOCK_CASES] + [("nvfp4", None, "stochastic")]
)
@pytest.mark.parametrize("chunk", [None, 64 * 16])
def test_torch_whole_tiles_take_the_fast_path_and_match_the_core(torch_fw, fmt, rule, mode, chunk,
                                                                 monkeypatch):  # fmt: skip
    """x no wider than float32 in whole blocks of a (possibly transposed) contiguous tensor: ``_mx_plane``
    (nearest) and ``_nvfp4_plane`` match the core on every layout; a small chunk makes many passes (and
    stochastic rounding takes the torch-op passes, not the compiled one it takes without a chunk)."""
    from polyamp.torch import block_plane as bp

    if chunk:
        monkeypatch.setattr(bp, "_PLANE_CHUNK", chunk)
        monkeypatch.setattr(bp, "stochastic_tiles_kernel", lambda: None)
    taken = []
    for name in ("_mx_plane", "_nvfp4_plane"):
        original = getattr(bp, name)
        monkeypatch.setattr(bp, name, lambda *a, f=original: taken.append(1) or f(*a))
    seed = 2**64 - 7 if mode == "stochastic" else None
    calls = 0
    for data in tile_sets():
        for dtype in DTYPES:
            with np.errstate(over="ignore"):
                xx = data.astype(dtype)
            for make, view, axis, block in tile_layouts(torch_fw, fmt):
                want = pa.quantize_blocks(view(xx), fmt, axis, block, rule, mode, seed)
                same_bits(torch_fw, pa.quantize_blocks(make(xx), fmt, axis, block, rule, mode, seed), want)
                calls += 1
    assert len(taken) == calls


def test_torch_other_blocks_take_the_general_path(torch_fw, monkeypatch):
    from polyamp.torch import block_plane as bp

    taken = []
    for name in ("_mx_plane", "_nvfp4_plane"):
        monkeypatch.setattr(bp, name, lambda *a: taken.append(1))
    x = torch_fw.tensor(block_data((64, 96)).astype(np.float32))
    pa.quantize_blocks(x[:, :40], "mxfp8_e4m3")  # a partial block
    pa.quantize_blocks(x, "mxfp8_e4m3", rounding="stochastic", seed=1)
    pa.quantize_blocks(x.double(), "nvfp4")
    pa.quantize_blocks(x.reshape(2, 32, 96).permute(1, 0, 2), "nvfp4")  # neither contiguous nor a .t()
    pa.quantize_blocks(x[:40], "nvfp4", axis=0)
    assert taken == []


def test_torch_complex_tensors_are_refused(torch_fw):
    t = torch_fw.torch.ones(4, dtype=torch_fw.torch.complex64)
    with pytest.raises(PolyampError, match="expected a floating-point tensor, got dtype torch"):
        pa.quantize(t, "e4m3fn")
    with pytest.raises(PolyampError, match="expected a floating-point tensor"):
        pa.quantize_blocks(t, "mxfp4")


def test_torch_cuda_matches_core(torch_fw):
    torch = torch_fw.torch
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = edges()
    for mode, seed in (("nearest", None), ("toward_zero", None), ("stochastic", 2**64 - 12345)):
        out = pa.quantize(torch_fw.tensor(x).cuda(), "e4m3fn", mode, seed=seed)
        assert out.device.type == "cuda"
        same_bits(torch_fw, out, pa.quantize(x, "e4m3fn", mode, seed=seed))
    x = block_data().astype(np.float32)
    for fmt, rule in BLOCK_CASES:
        for mode in ("nearest", "stochastic"):
            out = pa.quantize_blocks(torch_fw.tensor(x).cuda(), fmt, -1, None, rule, mode, 3)
            same_bits(torch_fw, out, pa.quantize_blocks(x, fmt, -1, None, rule, mode, 3))


# -- TensorFlow only --------------------------------------------------------------------------------------
@pytest.fixture
def tf_fw():
    return adapter("tensorflow")


def test_tf_a_traced_seed_gives_the_cores_stream(tf_fw):
    from polyamp.tensorflow.quantize import key_of, quantize_keyed

    tf = tf_fw.tf
    x = sample(np.float32, n=300)
    f = tf.function(lambda v, s: quantize_keyed(v, FORMATS["e5m2"], 1, False, key_of(s)))
    for seed in (0, 1, 12345, 2**40 + 3):
        want = pa.quantize(x, "e5m2", "stochastic", seed=seed)
        same_bits(tf_fw, f(tf.constant(x), tf.constant(seed, tf.int64)), want)


def test_tf_variables_and_static_shapes(tf_fw):
    tf = tf_fw.tf
    x = sample(np.float32, n=604)
    same_bits(tf_fw, pa.quantize(tf.Variable(x), "e4m3fn"), pa.quantize(x, "e4m3fn"))
    f = tf.function(lambda v: pa.quantize(v, "e4m3fn"), input_signature=[tf.TensorSpec([None], tf.float32)])
    with pytest.raises(PolyampError, match="needs a static shape"):
        f.get_concrete_function()


# -- MXNet only -------------------------------------------------------------------------------------------
@pytest.fixture
def mx_fw():
    return adapter("mxnet")


def test_mxnet_bf16_signed_zeros_and_subnormals_keep_their_bits_in_and_out(mx_fw):
    """Regression: the bf16 input and result went through oneDNN's amp_cast, which on a CPU without
    AVX-512 turns -0 into +0 and flushes subnormals: quantize(bf16 x, 'bf16') must be x, bit for bit."""
    bits = np.array([0x8000, 0x0001, 0x8001, 0x007F, 0x3FC0, 0xFF80], np.uint16)  # -0, subnormals, 1.5, -inf
    x = mx_fw.tensor(bits.view(BF16))
    for out in (pa.quantize(x, "bf16"), pa.quantize(x, "bf16", rounding="stochastic", seed=3)):
        got = mx_fw.numpy(out)
        assert got.dtype == BF16 and got.view(np.uint16).ravel().tolist() == bits.tolist()
    same_bits(mx_fw, pa.quantize(x, "fp16"), pa.quantize(bits.view(BF16), "fp16"))  # a float32 result


def test_mxnet_amp_cast_bf16_inputs_keep_the_core_s_result_dtype(mx_fw):
    """A bf16 NDArray as MXNet's AMP makes it (``amp_cast``; -0 and subnormals as this CPU leaves them)."""
    mx = mx_fw.mx
    for fmt in ("e4m3fn", "e5m2", "bf16", "fp16", "e2m1fn"):
        b = mx.nd.amp_cast(mx.nd.array(mixed(500, seed=4)), dtype=mx_fw.bf16)
        want = pa.quantize(mx_fw.numpy(b), fmt, rounding="stochastic", seed=5)
        same_bits(mx_fw, pa.quantize(b, fmt, rounding="stochastic", seed=5), want)
