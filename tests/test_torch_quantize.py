"""``quantize`` / ``quantize_blocks`` on torch tensors (torch ops) agree bit for bit with the numpy core."""

import ml_dtypes
import numpy as np
import pytest
import torch
from test_rounding import bits_equal, edge_values, random_float32

import polyamp
from polyamp import BLOCK_FORMATS, PolyampError
from polyamp.numerics import FORMATS, blocks, rounding
from polyamp.numerics import quantize as np_quantize
from polyamp.numerics import quantize_blocks as np_quantize_blocks
from polyamp.torch import quantize as tq

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
            assert_same(tq.quantize(to_torch(x), name, mode, saturate, seed=SEEDS[mode]), core)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_every_16_bit_input_matches_core_with_its_result_dtype(dtype, mode):
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype)  # every code, NaNs and subnormals included
    for name in FORMATS:
        for saturate in (False, True):
            with np.errstate(invalid="ignore", over="ignore"):
                core = np_quantize(x, name, mode, saturate, seed=SEEDS[mode] and 99)
            assert_same(tq.quantize(to_torch(x), name, mode, saturate, seed=SEEDS[mode] and 99), core)


def test_stochastic_stream_is_the_cores():
    for seed in (0, 1, 2**63, 2**64 - 1):
        key = rounding._mix(seed)
        ours = tq._uniform53(key, 100_000, "cpu").numpy()
        assert np.array_equal(ours, rounding._uniform53(key, 100_000))


def test_stochastic_seeds():
    x = to_torch(np.full(20_000, 1.1, np.float32))
    a, b = tq.quantize(x, "e4m3fn", "sr", seed=1), tq.quantize(x, "e4m3fn", "sr", seed=2)
    assert not torch.equal(a, b) and torch.equal(a, tq.quantize(x, "e4m3fn", "sr", seed=1))
    fresh = tq.quantize(x, "e4m3fn", "stochastic")  # no seed: fresh entropy, still on the grid
    assert set(fresh.unique().tolist()) <= {1.0, 1.125} and abs(fresh.mean().item() - 1.1) < 0.01


def test_shapes_layouts_and_grad():
    x = np.random.default_rng(2).standard_normal((64, 48)).astype(np.float32)
    t = to_torch(x).t()  # not contiguous: the stochastic index is the logical (C-order) position
    assert_same(tq.quantize(t, "e5m2", "stochastic", seed=4), np_quantize(x.T, "e5m2", "stochastic", seed=4))
    x64 = torch.from_numpy(X64.copy())
    tq.quantize(x64, "e5m2", "stochastic", seed=1), tq.quantize_blocks(x64, "nvfp4")
    assert torch.equal(x64.nan_to_num(), torch.from_numpy(X64).nan_to_num())  # the input is untouched
    scalar = tq.quantize(torch.tensor(464.0, dtype=torch.float64), "e4m3fn")
    assert scalar.shape == () and scalar.item() == 448.0
    g = torch.ones(3, requires_grad=True) * 1.3
    assert not tq.quantize(g, "bf16").requires_grad
    assert tq.quantize(torch.empty(0, 3), "e4m3fn").shape == (0, 3)


def test_compiles_without_graph_breaks():
    """torch.compile traces both in one graph (TorchScript cannot: it has no aten::view(dtype))."""
    x = to_torch(block_data().astype(np.float32))
    for fn in (lambda t: tq.quantize(t, "e4m3fn", "stochastic", seed=3),
               lambda t: tq.quantize_blocks(t, "nvfp4", block=(16, 16), rounding="sr", seed=3),
               lambda t: tq.quantize_blocks(t, "mxfp8_e4m3", axis=0, scale_rule="even")):  # fmt: skip
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
            assert_same(tq.quantize_blocks(to_torch(xx), fmt, axis, block, rule, mode, seed), core)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
@pytest.mark.parametrize("rule", ["floor", "rceil", "ceil", "even"])
def test_whole_fp8_blocks_take_the_float32_path_and_match_the_core(fmt, rule, monkeypatch):
    """Whole blocks of fp8 elements, rounded to nearest, no wider than float32: torch's float8 casts."""
    taken = []
    original = tq._mx_float8
    monkeypatch.setattr(tq, "_mx_float8", lambda *a: taken.append(a[2]) or original(*a))
    x = block_data((37, 70))[:, :64]  # ties, NaN/inf/zero/tiny/huge rows; whole blocks along axis 1
    x = np.concatenate([x, x[:27] * 2.0**-100], axis=0)  # 64 rows: whole blocks along axis 0 too
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            xx = x.astype(dtype)
        for axis in (-1, 0):
            core = np_quantize_blocks(xx, fmt, axis, None, rule)
            assert_same(tq.quantize_blocks(to_torch(xx), fmt, axis, None, rule), core)
    assert taken == [1, 0] * 3
    tq.quantize_blocks(to_torch(x), fmt, -1, None, rule, "stochastic", 3)  # not this path
    tq.quantize_blocks(to_torch(x[:, :40]), fmt, -1, None, rule)  # a partial block: not this path
    assert len(taken) == 6


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_3d_partial_and_float64_extremes(fmt):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 20, 35)) * 10.0 ** rng.integers(-300, 300, (3, 20, 1))
    x[0, 0, :] = [1e308] * 35
    x[1, 1, :] = 5e-324
    block = (16, 16) if fmt == "nvfp4" else None
    for axis in ([(0, 2), (2, 1)] if fmt == "nvfp4" else [0, 1, 2]):
        core = np_quantize_blocks(x, fmt, axis, block)
        assert_same(tq.quantize_blocks(to_torch(x), fmt, axis, block), core)
    for x in (np.zeros((2, 16)), np.full((2, 16), np.nan), np.array([[np.inf] * 16, [1.0] * 16])):
        assert_same(tq.quantize_blocks(to_torch(x), fmt), np_quantize_blocks(x, fmt))


def test_nvfp4_global_scale_float32_quotient_rounds_as_the_exact_one():
    rng = np.random.default_rng(6)
    raw = rng.integers(1, 1 << 32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = 2688 * (1 + np.arange(1, 2000) * 2.0**-24)  # quotients next to float32 midpoints
    amax = np.concatenate([raw, near]).astype(np.float32)
    amax = np.abs(amax[np.isfinite(amax) & (amax != 0)])
    ours = [tq._nvfp4_global(torch.tensor([v], dtype=torch.float64), torch.float32).item() for v in amax]
    assert ours == [blocks._nvfp4_global(np.array([v], np.float64)) for v in amax]


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
        out = tq.quantize(to_torch(X, "cuda"), "e4m3fn", mode, seed=SEEDS[mode])
        assert out.device.type == "cuda"
        assert_same(out, core)
    x = block_data()
    for fmt, rule in BLOCK_CASES:
        for mode in ("nearest", "stochastic"):
            core = np_quantize_blocks(x.astype(np.float32), fmt, -1, None, rule, mode, 3)
            out = tq.quantize_blocks(to_torch(x.astype(np.float32), "cuda"), fmt, -1, None, rule, mode, 3)
            assert_same(out, core)
