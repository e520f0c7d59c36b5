"""NVFP4's 16x16 random Hadamard transform in the numpy core: the sign vector, the matrix, the butterfly's
bits against a scalar re-implementation, orthogonality, padding, dtypes, errors."""

import doctest
import itertools
import warnings

import ml_dtypes
import numpy as np
import pytest

import polyamp.numerics
from polyamp import PolyampError
from polyamp.numerics import hadamard as hadamard_module
from polyamp.numerics.hadamard import SIGNS, hadamard_matrix, hadamard_tiles

U32 = 2.0**-24  # float32's unit roundoff


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    nan = np.isnan(a) & np.isnan(b)
    assert ((a == b) & (np.signbit(a) == np.signbit(b)) | nan).all(), (a, b)


def splitmix64_first(seed: int) -> int:
    """splitmix64's first output (Vigna, prng.di.unimi.it/splitmix64.c), in Python integers."""
    m = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def scalar_tiles(x: np.ndarray) -> np.ndarray:
    """The module docstring's steps one float32 scalar at a time, along the last axis of a 2-d array."""
    rows, n = x.shape
    width = -(-n // 16) * 16
    out = np.zeros((rows, width), np.float32)
    signs = [np.float32(s) for s in SIGNS]
    with np.errstate(over="ignore", invalid="ignore"):
        for r in range(rows):
            for start in range(0, width, 16):
                v = [np.float32(x[r, start + i]) if start + i < n else np.float32(0) for i in range(16)]
                v = [v[i] * signs[i] for i in range(16)]
                for h in (1, 2, 4, 8):
                    for base in range(0, 16, 2 * h):
                        for i in range(base, base + h):
                            v[i], v[i + h] = v[i] + v[i + h], v[i] - v[i + h]
                out[r, start : start + 16] = [vi * np.float32(0.25) for vi in v]
    return out


def test_signs_are_splitmix64_of_seed_0():
    z = splitmix64_first(0)
    assert z == 0xE220A8397B1DCDAF  # the published first output of splitmix64 seeded with 0
    assert SIGNS.tolist() == [-1.0 if (z >> i) & 1 else 1.0 for i in range(16)]
    assert SIGNS.dtype == np.float32 and not SIGNS.flags.writeable
    assert 0 < (SIGNS > 0).sum() < 16  # a real mix of signs


def test_matrix_is_sylvester_with_signs_and_orthogonal():
    h = hadamard_matrix()
    h16 = h * 4 / SIGNS[:, None].astype(np.float64)
    for i, j in itertools.product(range(16), repeat=2):
        assert h16[i, j] == (-1) ** bin(i & j).count("1")
    np.testing.assert_array_equal(h @ h.T, np.eye(16))  # entries +-1/4: every sum is exact
    np.testing.assert_array_equal(h.T @ h, np.eye(16))


@pytest.mark.parametrize("shape", [(1, 16), (3, 48), (5, 37), (2, 1), (4, 15), (2, 17), (7, 100)])
def test_butterfly_is_the_dense_product_up_to_rounding(shape):
    x = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32) * 3
    y = hadamard_tiles(x)
    width = -(-shape[1] // 16) * 16
    assert y.dtype == np.float32 and y.shape == (shape[0], width)
    xp = np.zeros((shape[0], width))
    xp[:, : shape[1]] = x
    tiles = xp.reshape(shape[0], -1, 16)
    dense = (tiles @ hadamard_matrix()).reshape(shape[0], width)
    # four float32 roundings of partial sums of the tile, times 1/4: at most ~u * sum |tile| each
    bound = 2 * U32 * np.repeat(np.abs(tiles).sum(-1), 16, axis=-1)
    assert (np.abs(y - dense) <= bound).all()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 33, 64, 77])
def test_wgrad_product_unchanged(n):
    rng = np.random.default_rng(n)
    g = rng.standard_normal((6, n)).astype(np.float32)
    x = rng.standard_normal((9, n)).astype(np.float32)
    got = hadamard_tiles(g).astype(np.float64) @ hadamard_tiles(x).astype(np.float64).T
    exact = g.astype(np.float64) @ x.astype(np.float64).T
    scale = np.abs(g).astype(np.float64) @ np.abs(x).astype(np.float64).T
    assert (np.abs(got - exact) <= 8 * U32 * scale).all()
    # and the inverse (H^T) takes the transform back to the zero-padded input
    back = (hadamard_tiles(x).astype(np.float64).reshape(9, -1, 16) @ hadamard_matrix().T).reshape(9, -1)
    np.testing.assert_allclose(back[:, :n], x, rtol=0, atol=4 * U32 * np.abs(x).max() * 4)
    np.testing.assert_allclose(back[:, n:], 0, atol=4 * U32 * np.abs(x).max() * 4)


@pytest.mark.parametrize(
    "shape", [(1, 16), (3, 32), (5, 37), (2, 1), (4, 15), (2, 17), (3, 0), (0, 20), (1, 130)]
)
def test_bits_match_the_scalar_steps(shape):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))).astype(np.float32)
    same_bits(hadamard_tiles(x), scalar_tiles(x))


def test_specials_match_the_scalar_steps():
    tiny = np.float32(2.0**-149)
    big = np.float32(np.finfo(np.float32).max)
    row = [0.0, -0.0, np.inf, 1.0, -np.inf, np.nan, tiny, -tiny, 2.0**-126, 3 * 2.0**-149, big, -big,
           1.5, -2.5, 2.0**100, 2.0**-100]  # fmt: skip
    x = np.array([row, row[::-1], [0.0] * 16, [-0.0] * 16, [tiny] * 16, [big] * 16, [np.nan] + [1.0] * 15,
                  [tiny, -tiny] * 8, [2.0**-130] * 16, [3.0, 3.0 + 2.0**-22] * 8], np.float32)  # fmt: skip
    y = hadamard_tiles(x)
    same_bits(y, scalar_tiles(x))
    assert np.isnan(y[0]).all() and np.isnan(y[6]).all()  # a NaN spoils its tile
    assert (y[2] == 0).all() and (y[3] == 0).all()
    assert not np.isfinite(y[5]).any()  # sums of max overflow, and inf - inf is NaN


def test_padding_tiles_and_axes():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 37)).astype(np.float32)
    y = hadamard_tiles(x)
    padded = np.concatenate([x, np.zeros((3, 4, 11), np.float32)], axis=-1)
    same_bits(y, hadamard_tiles(padded))
    same_bits(y[..., :16], hadamard_tiles(x[..., :16]))  # tiles are independent
    same_bits(y[..., 16:32], hadamard_tiles(x[..., 16:32]))
    for axis in (0, 1, -2, 2):
        want = np.moveaxis(hadamard_tiles(np.moveaxis(x, axis, -1)), -1, axis)
        same_bits(hadamard_tiles(x, axis=axis), want)
    same_bits(hadamard_tiles(x, axis=np.int64(1)), hadamard_tiles(x, axis=1))
    assert hadamard_tiles(x, axis=0).shape == (16, 4, 37)
    assert hadamard_tiles(np.zeros((2, 0), np.float32)).shape == (2, 0)
    same_bits(hadamard_tiles(np.asfortranarray(x[0])), y[0])  # layout does not matter
    same_bits(hadamard_tiles(x[0, :, ::-1]), hadamard_tiles(np.ascontiguousarray(x[0, :, ::-1])))


def test_input_dtypes():
    rng = np.random.default_rng(3)
    x64 = rng.standard_normal((4, 40)) * 1e3
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        x = x64.astype(dtype)
        same_bits(hadamard_tiles(x), hadamard_tiles(x.astype(np.float32)))  # float32 of it, then the steps
    same_bits(hadamard_tiles(x64.astype(">f4")), hadamard_tiles(x64.astype(np.float32)))
    assert x64.dtype == np.float64  # the input is not modified
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float64 beyond float32's range: inf, as a cast, without a warning
        assert np.isinf(hadamard_tiles(np.array([1e300, 1.0]))).all()


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.arange(16), r"expected a floating-point array, got dtype int64"),
        (np.ones(16, bool), r"expected a floating-point array, got dtype bool"),
        (np.ones(16, np.complex64), r"expected a floating-point array, got dtype complex64"),
        (np.array(["a"] * 16), r"expected a floating-point array, got dtype <U1"),
        (np.float32(1.0), r"1 or more dimensions, got float32 of shape \(\)"),
        (2.5, r"1 or more dimensions, got float 2.5"),
        ([1.0, 2.0], r"numpy float array of 1 or more dimensions, got list"),
        ("abc", r"1 or more dimensions, got str"),
    ],
)
def test_bad_input(bad, match):
    with pytest.raises(PolyampError, match=match):
        hadamard_tiles(bad)


@pytest.mark.parametrize("axis", [2, -3, 1.0, True, "0", None])
def test_bad_axis(axis):
    with pytest.raises(PolyampError, match=r"is not an axis of a 2-d array; accepted: integers in \[-2, 2\)"):
        hadamard_tiles(np.ones((2, 16), np.float32), axis=axis)


def test_framework_tensor_is_pointed_elsewhere():
    fake = type("Tensor", (), {"__module__": "torch"})()
    with pytest.raises(PolyampError, match=r"or a tensor of an imported framework, got a torch.Tensor"):
        hadamard_tiles(fake)


def test_public_surface_and_doctests():
    assert polyamp.numerics.hadamard_tiles is hadamard_tiles and "hadamard_tiles" in polyamp.numerics.__all__
    assert doctest.testmod(hadamard_module).failed == 0
