"""The recipes' algorithms on each framework's tensors agree bit for bit with the numpy core.

Every check is written once and run on each installed framework through its adapter
(``framework_recipes.py``): current scaling's scale of an amax, the tensorwise cast (at a given scale,
stochastically, at the tensor's own scale eagerly and compiled), each operand of each recipe, the forward
and both gradients of a quantized linear layer (the framework's own products of core-quantized operands),
the GEMMs a recipe leaves unquantized, and the Hadamard tiles of NVFP4's weight gradient. What only one
framework has (training, keep lists, state resume, compilers, seeds of a traced step, errors in its
idiom) stays in ``test_<framework>_recipes.py``.
"""

import math

import numpy as np
import pytest
from framework_ops import BF16, same_bits
from framework_recipes import ADAPTERS, recipe_adapter

import polyamp as pa
from polyamp import PolyampError, recipes
from polyamp.numerics import hadamard_tiles

FORMATS = ("e4m3fn", "e5m2")
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")  # mxnet


@pytest.fixture(params=list(ADAPTERS))
def fw(request):
    return recipe_adapter(request.param)


def mixed(n, seed) -> np.ndarray:
    """Random float32 values of 60 binades after +-0, +-inf, NaN, a subnormal and ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    x[:9] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42, 2.5, -0.75, 1.5]  # 2.5, 0.75, 1.5: ties
    return x


def wide(shape, seed) -> np.ndarray:
    """float32 normals, each slice along axis 0 scaled by its own power of two in [2^-12, 2^12)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, (shape[0],) + (1,) * (len(shape) - 1)))
    return x.astype(np.float32)


def core_operand(x, r, operand, axis, seed=None, scale=None):
    """The numpy core's quantization of ``x`` as the recipe's ``operand``, blocked along ``axis``."""
    fmt = r.backward_format if operand == "grad" else r.forward_format
    rounding = r.grad_rounding if operand == "grad" else r.forward_rounding
    if r.kind != "block":
        if scale is None:
            scale = recipes.current_scale(float(np.abs(x).max()), fmt, r.margin, r.amax_epsilon)
        return recipes.quantize_tensorwise(x, fmt, scale, rounding, seed)
    two_d = r.weight_2d and operand == "weight"
    return pa.quantize_blocks(x, fmt, axis=(-2, -1) if two_d else axis, block=(16, 16) if two_d else None,
                              scale_rule=r.scale_rule, rounding=rounding, seed=seed)  # fmt: skip


def stateless_only(fw, r):
    """Skip a recipe with state (delayed scales, stochastic seeds) where the layer has none to keep."""
    stochastic = "stochastic" in (r.forward_rounding, r.grad_rounding)
    if not fw.stateful_gemms and (r.kind == "delayed" or stochastic):
        pytest.skip("JAX's dot takes scales and seeds from its step: test_jax_recipes.py's "
                    "test_a_stateful_matmul_is_the_quantized_gemms_with_torchs_seeds")  # fmt: skip


# -- current scaling --------------------------------------------------------------------------------------
AMAXES = [0.0, 1e-45, 1e-40, 1e-30, 0.37, 3.5, 448.0, 6e37, 3e38, math.inf, math.nan]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("margin", "eps"), [(0, 0.0), (2, 0.0), (3, 0.0), (0, 1e-12), (3, 1e-12), (0, 1e-3)])
def test_current_scale_equals_the_core(fw, fmt, margin, eps):
    got = fw.current_scale(AMAXES, fmt, margin, eps)
    want = np.float32([recipes.current_scale(a, fmt, margin, eps) for a in AMAXES])
    assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), (got, want)


# -- the tensorwise cast ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensorwise_cast_at_a_given_scale_equals_the_core(fw, fmt):
    x = mixed(20000, seed=2)
    for scale in (1.0, 0.5, 3.0, 2.0**-20, 1e30, 448.0 / 7.3):
        same_bits(fw.ops, fw.tensorwise(x, fmt, scale), recipes.quantize_tensorwise(x, fmt, scale))


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_tensorwise_equals_the_core(fw, fmt):
    x = mixed(5000, seed=3)
    want = recipes.quantize_tensorwise(x, fmt, 8.0, rounding="stochastic", seed=11)
    same_bits(fw.ops, fw.tensorwise(x, fmt, 8.0, "stochastic", 11), want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_tensorwise_cast_at_the_tensors_own_scale_equals_the_core(fw, fmt, compiled):
    """The scale from the tensor's amax on the framework; compiled as the recipe runs it (TF: the
    Quantizer's graphs; JAX: jax.jit, where XLA would multiply by the scale's reciprocal)."""
    if compiled and not fw.tensorwise_compiled:
        pytest.skip(f"{fw.name}'s recipe compiles no tensorwise cast of its own")
    x = wide((32, 64) if fmt == "e4m3fn" else (32, 96), 1)  # the shapes of the GEMM tests' input and grad
    finite = x.copy()
    x[0, :6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42]
    for t in (x, finite, finite * 2.0**-100, np.zeros_like(x)):  # all subnormal: scaled up
        want = recipes.quantize_tensorwise(t, fmt, recipes.current_scale(float(np.max(np.abs(t))), fmt))
        same_bits(fw.ops, fw.tensorwise(t, fmt, compiled=compiled), want)


# -- each operand of each recipe --------------------------------------------------------------------------
OPERAND_SPECS = [*recipes.RECIPES, "mxfp8:scale_rule=floor", "nvfp4:grad_rounding=nearest",
                 "fp8-tensorwise:margin=2:compute_dtype=fp32"]  # fmt: skip
OPERANDS = ("input", "weight", "grad")
# what each variant of a recipe changes: a framework that traces each recipe checks it on that operand only
ONE_OPERAND = {"mxfp8:scale_rule=floor": "input", "nvfp4:grad_rounding=nearest": "grad",
               "fp8-tensorwise:margin=2:compute_dtype=fp32": "weight"}  # fmt: skip
ONE_OPERAND_ENOUGH = {(s, o) for s, kept in ONE_OPERAND.items() for o in OPERANDS if o != kept}
OPERAND_SHAPES = {"input": (32, 64), "weight": (64, 96), "grad": (32, 96)}  # the GEMM tests' operands


@pytest.mark.parametrize("operand", OPERANDS)
@pytest.mark.parametrize("spec", OPERAND_SPECS)
def test_each_operand_is_quantized_as_the_core_does(fw, spec, operand):
    """The operand picks the format and rounding (grad: the backward's) and NVFP4's 16x16 weight
    blocks; stochastic rounding seeds with the call counter; delayed scaling quantizes with the scale
    its history holds, then records this call's amax (the next call's x is 3x this one's)."""
    if fw.traces_each_shape and (spec, operand) in ONE_OPERAND_ENOUGH:
        pytest.skip(f"{fw.name} traces each recipe: {spec} changes only its {ONE_OPERAND[spec]}'s quantizer")
    r = recipes.parse_recipe(spec)
    x = wide(OPERAND_SHAPES[operand], 2)
    x[3, :40] = 0.0  # zero blocks
    x[4, 5] = 0.0
    q = fw.quantizer(r)
    history = recipes.DelayedScaling.from_recipe(r, operand == "grad") if r.kind == "delayed" else None
    stochastic = (r.grad_rounding if operand == "grad" else r.forward_rounding) == "stochastic"
    for axis in (-1, 0, -1):
        got = fw.operand(q, x, operand, axis)
        seed = fw.calls(q) if stochastic else None
        same_bits(
            fw.ops, got, core_operand(x, r, operand, axis, seed, None if history is None else history.scale)
        )
        if history is not None:
            history.update(float(np.abs(x).max()))
            x = x * 3
    if history is not None:
        assert fw.state_dict(q)["delayed"]["layer|" + operand] == history.state_dict()


# -- the three GEMMs of a quantized linear layer ----------------------------------------------------------
GEMM_SPECS = ["fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4", "nvfp4:grad_rounding=nearest",
              "nvfp4:hadamard=true", "nvfp4:grad_rounding=nearest:hadamard=true"]  # fmt: skip


def linear_calls(fw, r):
    """(seed of g for dx, seed of g for dW, the counter after) of ``linear``'s quantize calls, in
    ``recipe_gemms``' order and as ``fw`` counts them; a per-tensor g is quantized once, for both."""
    fwd, grad = r.forward_rounding, r.grad_rounding
    calls = [("x", fwd), ("w", fwd), ("g dx", grad)]
    if r.kind == "block":
        calls += [] if r.weight_2d else [("w dx", fwd)]
        wgrad = [("g dw", grad), ("x dw", fwd)]
        calls += wgrad if fw.weight_grad_first == "grad" else wgrad[::-1]
    counter, seeds = 0, {}
    for name, rounding in calls:
        counter += fw.counts_every_call or rounding == "stochastic"
        seeds[name] = counter if rounding == "stochastic" else None
    return seeds["g dx"], seeds.get("g dw", seeds["g dx"]), counter


def wgrad_operand(fw, t, r, operand, seed=None):
    """The core's weight-gradient operand of ``t`` [M, ...], blocked along M in ``fw``'s layout."""
    if fw.wgrad_transposed:
        return core_operand(t.T, r, operand, -1, seed).T
    return core_operand(t, r, operand, 0, seed)


@pytest.mark.parametrize("spec", GEMM_SPECS)
def test_forward_and_both_gradients_are_the_quantized_gemms(fw, spec):
    """y, dx, dw (and the bias' gradient) through the framework's autograd are its products of the
    core-quantized operands: per-tensor operands once (delayed: a fresh history's scale, 1), blocks for
    each GEMM along the dimension it sums over, Hadamard tiles along M for the weight gradient."""
    r = recipes.parse_recipe(spec)
    stateless_only(fw, r)
    x, w, g = wide((2, 16, 64), 3), wide((64, 96), 4) / 8, wide((32, 96), 5)
    b = np.random.default_rng(6).standard_normal(96).astype(np.float32) if fw.has_bias else None
    y, dx, dw, db, calls = fw.linear(r, x, w, b, g)
    seed_dx, seed_dw, counter = linear_calls(fw, r)
    block, x2 = r.kind == "block", x.reshape(32, 64)
    scale = 1.0 if r.kind == "delayed" else None
    xq, wq = core_operand(x2, r, "input", -1, scale=scale), core_operand(w, r, "weight", 0, scale=scale)
    same_bits(fw.ops, y, fw.y_of(xq, wq, b).reshape(2, 16, 96))
    g_dgrad = core_operand(g, r, "grad", -1, seed_dx, scale)
    w_dgrad = core_operand(w, r, "weight", 1) if block and not r.weight_2d else wq
    same_bits(fw.ops, dx, fw.dx_of(g_dgrad, w_dgrad).reshape(x.shape))
    x_w, g_w = (hadamard_tiles(x2, 0), hadamard_tiles(g, 0)) if r.hadamard else (x2, g)
    x_wgrad = wgrad_operand(fw, x_w, r, "input") if block else xq
    g_wgrad = wgrad_operand(fw, g_w, r, "grad", seed_dw) if block else g_dgrad
    same_bits(fw.ops, dw, fw.dw_of(x_wgrad, g_wgrad))
    if b is not None:
        same_bits(fw.ops, db, fw.db_of(g))
    assert calls == counter


@pytest.mark.parametrize("tokens", [(32,), (37,), (3, 7), (5,)])
def test_hadamard_wgrad_is_the_gemm_of_core_transformed_quantized_operands(fw, tokens):
    """M padded to a multiple of 16 in the tiles; the forward and the input gradient are plain NVFP4's."""
    if fw.traces_each_shape and tokens != (3, 7):  # 21 rows padded to 32, tokens of two axes
        pytest.skip(f"{fw.name} traces each shape: (3, 7) covers the padding, the GEMM test 32 rows")
    r = recipes.parse_recipe("nvfp4:grad_rounding=nearest:hadamard=true")
    x, w, g = wide((*tokens, 48), sum(tokens)), wide((48, 64), 1) / 8, wide((*tokens, 64), 2)
    y, dx, dw, _, _ = fw.linear(r, x, w, None, g)
    x2, g2 = x.reshape(-1, 48), g.reshape(-1, 64)
    gt, xt = (wgrad_operand(fw, hadamard_tiles(t, 0), r, op) for t, op in ((g2, "grad"), (x2, "input")))
    assert gt.shape[0] == xt.shape[0] == -(-x2.shape[0] // 16) * 16
    same_bits(fw.ops, dw, fw.dw_of(xt, gt))
    y0, dx0, dw0, _, _ = fw.linear(recipes.get_recipe(r, hadamard=False), x, w, None, g)
    same_bits(fw.ops, y, fw.ops.numpy(y0))
    same_bits(fw.ops, dx, fw.ops.numpy(dx0))
    assert not np.array_equal(fw.ops.numpy(dw), fw.ops.numpy(dw0))


@pytest.mark.parametrize(("spec", "dx_plain"), [
    ("fp8-tensorwise:quantize_input_grad=false:quantize_weight_grad=false", True),
    ("nvfp4:hadamard=true:quantize_weight_grad=false", False),  # no Hadamard tiles without a quantized dW
])  # fmt: skip
def test_unquantized_gemms_take_their_operands_as_they_are(fw, spec, dx_plain):
    r = recipes.parse_recipe(spec)
    stateless_only(fw, r)
    x, w, g = wide((20, 16), 7), wide((16, 8), 8), wide((20, 8), 9)
    _, dx, dw, _, _ = fw.linear(r, x, w, None, g)
    same_bits(fw.ops, dw, fw.dw_of(x, g))
    if dx_plain:
        same_bits(fw.ops, dx, fw.dx_of(g, w))


# -- NVFP4's Hadamard tiles -------------------------------------------------------------------------------
class Tiles:
    """``same_bits`` of Hadamard tiles, but a framework whose float32 kernels flush subnormals (TF, JAX
    on CPU) is compared only where the core's tiles hold none; ``done`` then xfails if it skipped any (a
    known difference of ``hadamard_tiles`` on those frameworks' tensors from the core's)."""

    def __init__(self, fw):
        self.fw, self.flushed = fw, 0

    def check(self, got, want):
        tiny = np.finfo(np.float32).tiny
        if self.fw.flushes_subnormals and ((want != 0) & (np.abs(want) < tiny)).any():
            self.flushed += 1
            return
        same_bits(self.fw.ops, got, want)

    def done(self):
        if self.flushed:
            pytest.xfail(f"{self.flushed} results hold float32 subnormals, which {self.fw.name} flushes")


HADAMARD_SHAPES = [(1, 16), (3, 37), (2, 1), (4, 15), (5, 17), (2, 64), (3, 100), (0, 20), (4, 0), (37, 5),
                   (3, 40), (40, 3), (2, 33, 7), (0, 4), (5,), (16,), (64, 96), (1, 1)]  # fmt: skip


@pytest.mark.parametrize("shape", HADAMARD_SHAPES, ids=str)
def test_hadamard_tiles_equal_the_cores(fw, shape):
    """Along every axis; torch also on a transposed view and a broadcast one, TF also in a tf.function of
    unknown dimensions, JAX under jax.jit."""
    if not fw.ops.has_scalars and 0 in shape:
        pytest.skip("MXNet has no zero-size NDArrays")
    n, tiles = math.prod(shape), Tiles(fw)
    x = mixed(max(n, 9), seed=sum(shape))[:n].reshape(shape)
    for t in fw.views(x):
        for axis in range(-t.ndim, t.ndim):
            for got in fw.hadamard(t, axis):
                tiles.check(got, hadamard_tiles(fw.ops.numpy(t), axis))
    tiles.done()


def test_hadamard_tiles_carry_specials_as_the_core_does(fw):
    """NaN and inf spoil their tile; sums past float32's range overflow to inf; -0.0 and partial tiles."""
    x = np.float32([1, np.inf, 3, np.nan, 0, -0.0, 3e38, 3e38, 2, 2, 2, 2, 2, 2, 2, 2, 3e38, 3e38, 3e38,
                    3e38, 1, -0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -0.0, 0.5, 0.25])  # fmt: skip
    tiles = Tiles(fw)
    for v in (x, -x, x[16:], np.full(16, -0.0, np.float32)):
        for got in fw.hadamard(fw.ops.tensor(v), -1):
            tiles.check(got, hadamard_tiles(v))
    tiles.done()


def test_hadamard_tiles_dtypes_and_ranges(fw):
    """Every float dtype in, float32 out; float32's subnormals, extremes and signed zeros."""
    x, tiles = np.random.default_rng(12).standard_normal((6, 70)) * 1e3, Tiles(fw)
    for dtype in (np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)):
        a = x.astype(dtype)
        with fw.ops.holding(dtype):
            for got in fw.hadamard(fw.ops.tensor(a), -1):
                tiles.check(got, hadamard_tiles(a.astype(np.float32)))
    tiny, big = 2.0**-149, float(np.finfo(np.float32).max)
    for fill in (tiny, -tiny, 2.0**-130, 2.0**120, big, 0.0, -0.0):
        a = np.full((2, 16), fill, np.float32) * np.tile(np.float32([1.0, -1.0]), 8)
        for got in fw.hadamard(fw.ops.tensor(a), -1):
            tiles.check(got, hadamard_tiles(a))
    tiles.done()


def test_hadamard_tiles_errors(fw):
    bad = [(fw.ops.ints(16), r"received a \w+\.int32 tensor of shape \(16,\)")]
    if fw.ops.has_scalars:
        bad.append((fw.ops.tensor(np.float32(1.0)), r"received a \w+\.float32 tensor of shape \(\)"))
    for t, match in bad + fw.bad_hadamard_inputs():
        with pytest.raises(PolyampError, match=match):
            hadamard_tiles(t)
    for axis in (2, -3, 1.0, True):
        with pytest.raises(PolyampError, match=r"not an axis of a 2-d array; accepted: integers in \["):
            hadamard_tiles(fw.ops.tensor(np.ones((2, 16), np.float32)), axis=axis)
