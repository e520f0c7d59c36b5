"""``quantize`` / ``quantize_blocks`` on torch tensors (torch ops) agree bit for bit with the numpy core."""

import ml_dtypes
import numpy as np
import pytest
import torch
from test_rounding import bits_equal, edge_values, random_float32

import polyamp
from polyamp import BLOCK_FORMATS, PolyampError
from polyamp.numerics import FORMATS, exact_float, stream
from polyamp.numerics import quantize as np_quantize
from polyamp.numerics import quantize_blocks as np_quantize_blocks
from polyamp.numerics import xp as numpy_ops
from polyamp.torch import block_plane as bp
from polyamp.torch import xp as torch_ops

MODES = ("nearest", "toward_zero", "stochastic")
SEEDS = {"nearest": None, "toward_zero": None, "stochastic": 2**64 - 12345}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def to_torch(a: np.ndarray, device="cpu") -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:  # numpy cannot hand bfloat16 to torch: go through the bits
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def assert_same(ours: torch.Tensor, core: np.ndarray):
    """Same dtype and shape; same bits, or both NaN (the core's contract: NaN sign/payload free)."""
    got = to_numpy(ours)
    assert got.dtype == core.dtype and got.shape == core.shape
    bad = ~bits_equal(got, core)
    assert not bad.any(), f"{bad.sum()} differ: {got[bad][:4]} vs core {core[bad][:4]}"


TINY32 = [2.0**-149, -(2.0**-149), 2.0**-127, 1.1754942e-38]  # float32 subnormals, e8m0's bottom
WIDE64 = [1e300, -1e-310, 5e-324, 68.00000356923152, 448.00000000000006, 464.0, 464.00000000000006, 3.5e38,
          np.nextafter(2.0**-10, 1)]  # fmt: skip
with np.errstate(over="ignore", invalid="ignore"):
    X = np.concatenate([random_float32(40_000, seed=1), *(edge_values(n) for n in FORMATS),
                        np.array(TINY32, np.float32)])  # fmt: skip
    X64 = np.concatenate([X.astype(np.float64), WIDE64])


# -- quantize ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("mode", MODES)
def test_quantize_matches_core_float32_and_float64(name, mode):
    for x in (X, X64):
        for saturate in (False, True):
            with np.errstate(invalid="ignore", over="ignore"):
                core = np_quantize(x, name, mode, saturate, seed=SEEDS[mode])
            assert_same(polyamp.quantize(to_torch(x), name, mode, saturate, seed=SEEDS[mode]), core)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_every_16_bit_input_matches_core_with_its_result_dtype(dtype, mode):
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)  # every code, NaNs and subnormals included
    for name in FORMATS:
        for saturate in (False, True):
            with np.errstate(invalid="ignore", over="ignore"):
                core = np_quantize(x, name, mode, saturate, seed=SEEDS[mode] and 99)
            assert_same(polyamp.quantize(to_torch(x), name, mode, saturate, seed=SEEDS[mode] and 99), core)


def test_stochastic_stream_is_the_cores():
    for seed in (0, 1, 2**63, 2**64 - 1):
        key = stream.mix(seed)
        ours = stream.uniform53(torch_ops, key, 100_000, torch.empty(0)).numpy()
        assert np.array_equal(ours, stream.uniform53(numpy_ops, key, 100_000, np.empty(0)))


def test_stochastic_seeds():
    x = to_torch(np.full(20_000, 1.1, np.float32))
    a, b = polyamp.quantize(x, "e4m3fn", "sr", seed=1), polyamp.quantize(x, "e4m3fn", "sr", seed=2)
    assert not torch.equal(a, b) and torch.equal(a, polyamp.quantize(x, "e4m3fn", "sr", seed=1))
    fresh = polyamp.quantize(x, "e4m3fn", "stochastic")  # no seed: fresh entropy, still on the grid
    assert set(fresh.unique().tolist()) <= {1.0, 1.125} and abs(fresh.mean().item() - 1.1) < 0.01


def test_shapes_layouts_and_grad():
    x = np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32)
    t = to_torch(x).t()  # not contiguous: the stochastic index is the logical (C-order) position
    core = np_quantize(x.T, "e5m2", "stochastic", seed=4)
    assert_same(polyamp.quantize(t, "e5m2", "stochastic", seed=4), core)
    x64 = torch.from_numpy(X64.copy())
    polyamp.quantize(x64, "e5m2", "stochastic", seed=1), polyamp.quantize_blocks(x64, "nvfp4")
    assert torch.equal(x64.nan_to_num(), torch.from_numpy(X64).nan_to_num())  # the input is untouched
    scalar = polyamp.quantize(torch.tensor(464.0, dtype=torch.float64), "e4m3fn")
    assert scalar.shape == () and scalar.item() == 448.0
    g = torch.ones(3, requires_grad=True) * 1.3
    assert not polyamp.quantize(g, "bf16").requires_grad
    assert polyamp.quantize(torch.empty(0, 3), "e4m3fn").shape == (0, 3)


def test_compiles_without_graph_breaks():
    """torch.compile traces both in one graph (TorchScript cannot: it has no aten::view(dtype))."""
    x = to_torch(block_data().astype(np.float32))
    for fn in (lambda t: polyamp.quantize(t, "e4m3fn", "stochastic", seed=3),
               lambda t: polyamp.quantize_blocks(t, "nvfp4", block=(16, 16), rounding="sr", seed=3),
               lambda t: polyamp.quantize_blocks(t, "mxfp8_e4m3", axis=0, scale_rule="even")):  # fmt: skip
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x).nan_to_num(), fn(x).nan_to_num())


# -- quantize_blocks ---------------------------------------------------------------------------------
def block_data(shape=(37, 70), seed=0):
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


BLOCK_CASES = [(f, r) for f, b in BLOCK_FORMATS.items() for r in (b.rules or (None,))]


@pytest.mark.parametrize("fmt,rule", BLOCK_CASES)
@pytest.mark.parametrize("mode", ["nearest", "stochastic"])
def test_quantize_blocks_matches_core(fmt, rule, mode):
    x = block_data()
    axes = [(-1, None), (0, None), (1, None)]
    if fmt == "nvfp4":
        axes += [((0, 1), (16, 16)), ((1, 0), (16, 16)), (-1, (16, 16))]
    for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            xx = x.astype(dtype)
        for axis, block in axes:
            seed = 11 if mode == "stochastic" else None
            core = np_quantize_blocks(xx, fmt, axis, block, rule, mode, seed)
            assert_same(polyamp.quantize_blocks(to_torch(xx), fmt, axis, block, rule, mode, seed), core)


def tile_sets():
    """Arrays of whole 32 x 32 tiles: ``block_data``'s specials, those rows scaled by 2^-100 and 2^60
    (inf in float32); NVFP4 ties (a global amax of 2688 makes s_global 1; blocks of amax 6, 9 and 6.375
    give s_block 1, 1.5 and the e4m3 tie 1.0625 -> 1, holding the e2m1 midpoints times s_block); raw
    float32 bit patterns; a bad block whose finite element is the tensor's largest (it alone sets
    s_global); amaxes whose s_global underflows to 2^-149 or nears float32's max; zeros and NaNs."""
    x = block_data((64, 96))
    mixed = np.concatenate([x, x[:32] * 2.0**-100, x[:32] * 2.0**60], axis=0)
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
    return [mixed, ties, raw, bad, tiny, huge, zeros, np.full((32, 32), np.nan)]


def tile_layouts(fmt):
    """(make the tensor from a 2-D array, the numpy array it holds, axis, block): contiguous, transposed
    (``p.t()`` of a contiguous p), 3-d; blocks along either axis, and NVFP4's 16 x 16 tiles."""
    plain = (lambda a: to_torch(a), lambda a: a)
    flip = (lambda a: to_torch(a).t(), lambda a: a.T)
    cube = (lambda a: to_torch(a).reshape(2, -1, a.shape[1]), lambda a: a.reshape(2, -1, a.shape[1]))
    out = [(*plain, -1, None), (*plain, 0, None), (*flip, -1, None), (*flip, 0, None), (*cube, -1, None)]
    if fmt == "nvfp4":
        out += [(*plain, (0, 1), (16, 16)), (*flip, (1, 0), (16, 16)), (*cube, (-2, -1), (16, 16))]
    return out


@pytest.mark.parametrize(
    "fmt,rule,mode", [(*c, "nearest") for c in BLOCK_CASES] + [("nvfp4", None, "stochastic")]
)
@pytest.mark.parametrize("chunk", [None, 64 * 16])
def test_whole_tiles_take_the_fast_path_and_match_the_core(fmt, rule, mode, chunk, monkeypatch):
    """x no wider than float32 in whole blocks of a (possibly transposed) contiguous tensor: ``_mx_plane``
    (nearest) and ``_nvfp4_plane`` match the core on every layout; a small chunk makes many passes (and
    stochastic rounding takes the torch-op passes, not the compiled one it takes without a chunk)."""
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
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            with np.errstate(over="ignore"):
                xx = data.astype(dtype)
            for make, view, axis, block in tile_layouts(fmt):
                core = np_quantize_blocks(view(xx), fmt, axis, block, rule, mode, seed)
                assert_same(polyamp.quantize_blocks(make(xx), fmt, axis, block, rule, mode, seed), core)
                calls += 1
    assert len(taken) == calls


def test_other_blocks_take_the_general_path(monkeypatch):
    taken = []
    for name in ("_mx_plane", "_nvfp4_plane"):
        monkeypatch.setattr(bp, name, lambda *a: taken.append(1))
    x = to_torch(block_data((64, 96)).astype(np.float32))
    polyamp.quantize_blocks(x[:, :40], "mxfp8_e4m3")  # a partial block
    polyamp.quantize_blocks(x, "mxfp8_e4m3", rounding="stochastic", seed=1)
    polyamp.quantize_blocks(x.double(), "nvfp4")
    polyamp.quantize_blocks(x.reshape(2, 32, 96).permute(1, 0, 2), "nvfp4")  # neither contiguous nor a .t()
    polyamp.quantize_blocks(x[:40], "nvfp4", axis=0)
    assert taken == []


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_3d_partial_and_float64_extremes(fmt):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 20, 35)) * 10.0 ** rng.integers(-300, 300, (3, 20, 1))
    x[0, 0, :] = [1e308] * 35
    x[1, 1, :] = 5e-324
    block = (16, 16) if fmt == "nvfp4" else None
    for axis in [(0, 2), (2, 1)] if fmt == "nvfp4" else [0, 1, 2]:
        core = np_quantize_blocks(x, fmt, axis, block)
        assert_same(polyamp.quantize_blocks(to_torch(x), fmt, axis, block), core)
    for x in (np.zeros((2, 16)), np.full((2, 16), np.nan), np.array([[np.inf] * 16, [1.0] * 16])):
        assert_same(polyamp.quantize_blocks(to_torch(x), fmt), np_quantize_blocks(x, fmt))


def test_nvfp4_global_scale_float32_quotient_rounds_as_the_exact_one():
    rng = np.random.default_rng(6)
    raw = rng.integers(1, 1 << 32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = 2688 * (1 + np.arange(1, 2000) * 2.0**-24)  # quotients next to float32 midpoints
    amax = np.concatenate([raw, near]).astype(np.float32)
    amax = np.abs(amax[np.isfinite(amax) & (amax != 0)])
    ours = [exact_float.nvfp4_global_of(torch_ops, torch.tensor([v], dtype=torch.float64), False).item()
            for v in amax]
    assert ours == [exact_float.nvfp4_global_of(numpy_ops, np.array([v], np.float64), False).item()
                    for v in amax]
    assert ours == [exact_float.global_scale(float(v)) for v in amax]  # the exact quotient, rounded once


# -- dispatch and errors ---------------------------------------------------------------------------
def test_polyamp_dispatches_torch_tensors():
    x = torch.linspace(-500, 500, 64, dtype=torch.float32).reshape(2, 32)
    out = polyamp.quantize(x, "e4m3fn", saturate=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert_same(out, np_quantize(x.numpy(), "e4m3fn", saturate=True))
    out = polyamp.quantize_blocks(x.to(torch.bfloat16), "mxfp4", scale_rule="rceil")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    fake = type("Tensor", (), {"__module__": "torch"})()  # not a torch.Tensor: the core still refuses it
    with pytest.raises(PolyampError, match="takes numpy arrays"):
        polyamp.quantize_blocks(fake, "mxfp4")


ERRORS = [  # (function, positional args after x, keyword args)
    ("quantize", ("e9m9",), {}),
    ("quantize", ("e4m3fn", "up"), {}),
    ("quantize", ("e4m3fn",), {"saturate": 1}),
    ("quantize", ("e4m3fn", "sr"), {"seed": -1}),
    ("quantize_blocks", ("mxfp9",), {}),
    ("quantize_blocks", ("mxfp4",), {"scale_rule": "up"}),
    ("quantize_blocks", ("mxfp4",), {"block": 16}),
    ("quantize_blocks", ("mxfp4",), {"axis": 2}),
    ("quantize_blocks", ("nvfp4",), {"scale_rule": "floor"}),
    ("quantize_blocks", ("mxfp4",), {"rounding": "rtz"}),
    ("quantize_blocks", ("nvfp4",), {"block": (16, 16)}),
]


@pytest.mark.parametrize("name,args,kwargs", ERRORS)
def test_errors_are_the_cores(name, args, kwargs):
    a = np.ones(32, np.float32)
    with pytest.raises(PolyampError) as theirs:
        getattr(polyamp.numerics, name)(a, *args, **kwargs)
    with pytest.raises(PolyampError) as mine:
        getattr(polyamp, name)(torch.from_numpy(a), *args, **kwargs)
    assert str(mine.value) == str(theirs.value)


def test_non_float_tensors_are_refused():
    for t in (torch.ones(4, dtype=torch.int32), torch.ones(4, dtype=torch.complex64)):
        with pytest.raises(PolyampError, match="expected a floating-point tensor, got dtype torch"):
            polyamp.quantize(t, "e4m3fn")
        with pytest.raises(PolyampError, match="expected a floating-point tensor"):
            polyamp.quantize_blocks(t, "mxfp4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_core():
    for mode in MODES:
        core = np_quantize(X, "e4m3fn", mode, seed=SEEDS[mode])
        out = polyamp.quantize(to_torch(X, "cuda"), "e4m3fn", mode, seed=SEEDS[mode])
        assert out.device.type == "cuda"
        assert_same(out, core)
    x = block_data()
    for fmt, rule in BLOCK_CASES:
        for mode in ("nearest", "stochastic"):
            core = np_quantize_blocks(x.astype(np.float32), fmt, -1, None, rule, mode, 3)
            cuda = to_torch(x.astype(np.float32), "cuda")
            out = polyamp.quantize_blocks(cuda, fmt, -1, None, rule, mode, 3)
            assert_same(out, core)
