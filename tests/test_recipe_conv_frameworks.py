"""The recipes' quantized convolutions (``polyamp/<framework>/recipe_conv.py``) on every framework, each
check written once over the adapters of ``framework_conv.py``: the forward and both gradients are the
framework's own convolution and autograd at operands the numpy core quantized (blocks along the
channels, the output channels and the batch; NVFP4's 16x16 kernel tiles, stochastic gradients and
Hadamard tiles along the batch; delayed histories over two steps), bit for bit; bfloat16 products
summed in float32 (JAX); nothing quantized is the plain convolution; the batch Hadamard; blocks follow
the channel axis, not the memory layout. Each framework takes the cases it ran in its own file (JAX
compiles each new shape: one program per case); its layers, training and compilers stay there.
"""

import functools
from dataclasses import replace

import numpy as np
import pytest
from framework_conv import CONV_ADAPTERS, Geometry, conv_adapter
from framework_ops import same_bits

import polyamp as pa
from polyamp import recipes
from polyamp.numerics import hadamard_tiles

pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")  # mxnet


def pad(*pairs):
    return tuple((p, p) if isinstance(p, int) else p for p in pairs)


GEOMETRIES = {
    # torch's: stride 2; uneven kernel, dilation and two groups; Conv1d
    "t-conv2d": Geometry((6, 8, 9, 9), (16, 8, 3, 3), (2, 2), pad(1, 1), (1, 1)),
    "t-conv2d-groups": Geometry((5, 32, 6, 7), (34, 16, 3, 2), (1, 1), pad(1, 0), (1, 2), 2),
    "t-conv1d": Geometry((4, 40, 11), (24, 40, 3), (1,), pad(2), (1,)),
    # TensorFlow's: channels_last "same" with stride 2; channels_first two groups; a dilated Conv1D
    "tf-conv2d-stride2-same": Geometry(
        (12, 7, 7, 40), (36, 40, 3, 3), (2, 2), "same", (1, 1), channels_last=True
    ),  # fmt: skip
    "tf-conv2d-channels_first-groups2": Geometry((10, 64, 4, 4), (24, 32, 3, 3), (1, 1), "valid", (1, 1), 2),
    "tf-conv1d-dilated": Geometry((10, 9, 40), (36, 40, 3), (1,), "same", (2,), channels_last=True),
    # JAX's: flax's NHWC; NCHW with stride 2, uneven padding, dilation and two groups
    "jax-nhwc": Geometry((3, 6, 7, 40), (48, 40, 3, 3), (1, 1), "same", (1, 1), channels_last=True),
    "jax-nchw-groups": Geometry((5, 32, 9, 8), (40, 16, 3, 2), (2, 2), ((1, 2), (0, 1)), (1, 2), 2),
    # MXNet's: stride 2 with padding 1, two groups, Conv1D; partial blocks of 32
    "mx-2d": Geometry((20, 48, 7, 7), (32, 48, 3, 3), (2, 2), pad(1, 1), (1, 1)),
    "mx-groups": Geometry((6, 64, 5, 5), (32, 32, 3, 3), (1, 1), pad(1, 1), (1, 1), 2),
    "mx-1d": Geometry((5, 40, 11), (24, 40, 3), (2,), pad(1), (1,)),
}
TORCH_SPECS = ["fp8-tensorwise", "mxfp8:scale_rule=floor", "mxfp8", "nvfp4", "nvfp4:hadamard=true"]
# one per way a convolution's operands are quantized: one per-tensor scale, blocks along the channels and
# the batch, NVFP4's 2D kernel blocks and stochastic rounding, the Hadamard tiles along the batch
TF_SPECS = ["fp8-tensorwise", "mxfp8", "nvfp4", "nvfp4:hadamard=true"]
# each framework's cases, no more than its own file ran: the checks below that are new to a framework take
# the place of pairs its other cases cover (torch's MX on Conv1d: MXNet's; TensorFlow's MX in "same" with
# stride 2: its other geometries'; MXNet's MX over groups: its per-tensor and NVFP4 cases')
TORCH_COVERED = {("mxfp8", "t-conv1d"), ("mxfp8:scale_rule=floor", "t-conv1d")}
MX_BF16 = ("mxfp8:scale_rule=floor", "jax-nchw-groups", ("fp32", "bf16"))  # JAX: also bfloat16 products
CASES = {  # framework -> (spec, geometry, computes): the first compute is checked bit for bit
    "torch": [(s, g, ("fp32",)) for g in ("t-conv2d", "t-conv2d-groups", "t-conv1d") for s in TORCH_SPECS
              if (s, g) not in TORCH_COVERED],
    "tensorflow": [(s, "tf-conv2d-stride2-same", ("bf16",)) for s in TF_SPECS if s != "mxfp8"]
    + [("mxfp8", g, ("fp32",)) for g in ("tf-conv2d-channels_first-groups2", "tf-conv1d-dilated")],
    # NVFP4 rounds its gradients stochastically: JAX's are its stateful cases (test_jax_recipe_conv.py)
    "jax": [("fp8-tensorwise", "jax-nchw-groups", ("fp32",)), ("mxfp8", "jax-nhwc", ("fp32",)), MX_BF16],
    "mxnet": [("fp8-tensorwise", "mx-2d", ("fp32",)), ("fp8-tensorwise", "mx-groups", ("bf16",)),
              ("fp8-delayed", "mx-2d", ("fp32",)), ("fp8-delayed", "mx-1d", ("bf16",)),
              ("mxfp8:scale_rule=floor", "mx-2d", ("fp32",)), ("mxfp8", "mx-2d", ("bf16",)),
              ("mxfp8", "mx-1d", ("fp32",)),
              ("nvfp4", "mx-2d", ("fp32",)), ("nvfp4", "mx-groups", ("bf16",)), ("nvfp4", "mx-1d", ("fp32",)),
              ("nvfp4:hadamard=true", "mx-2d", ("fp32",)), ("nvfp4:hadamard=true", "mx-1d", ("bf16",))],
}  # fmt: skip


def fw_cases(cases):
    """(framework, spec, geometry, computes) parameters of ``cases``."""
    return [pytest.param(n, *c, id=f"{n}-{c[0]}-{c[1]}-{c[2][0]}") for n, cs in cases.items() for c in cs]


def conv_fw(name):
    """The adapter of ``name``, skipping where MXNet computes no bf16 on this CPU (mxnet_caps.py)."""
    fw = conv_adapter(name)
    if getattr(fw, "bf16_unsupported", None):
        pytest.skip(str(fw.bf16_unsupported))
    return fw


class Core:
    """The Quantizer's rule on numpy arrays with the numpy core, blocks along ``axis`` moved last (NVFP4's
    16x16 tiles: the kernel's (O, I) axes); ``counts`` as the framework numbers calls (stochastic
    rounding's seed): "all", "stochastic" (only those) or None (no seeds); one delayed history per operand."""

    def __init__(self, r, counts):
        self.r, self.counts, self.calls, self.ds = r, counts, 0, {}

    def __call__(self, t, operand, axis):
        r = self.r
        grad = operand == "grad"
        fmt = r.backward_format if grad else r.forward_format
        rounding = r.grad_rounding if grad else r.forward_rounding
        stochastic = rounding == "stochastic"
        assert self.counts or not stochastic
        self.calls += self.counts == "all" or (self.counts == "stochastic" and stochastic)
        seed = self.calls if stochastic else None
        if r.kind == "block":
            if r.weight_2d and operand == "weight":
                moved = np.moveaxis(t, (0, 1), (-2, -1))
                out = pa.quantize_blocks(moved, fmt, axis=(-2, -1), block=(16, 16), scale_rule=r.scale_rule,
                                         rounding=rounding, seed=seed)  # fmt: skip
                return np.moveaxis(np.asarray(out, np.float32), (-2, -1), (0, 1))
            out = pa.quantize_blocks(np.moveaxis(t, axis, -1), fmt, scale_rule=r.scale_rule,
                                     rounding=rounding, seed=seed)  # fmt: skip
            return np.moveaxis(np.asarray(out, np.float32), -1, axis)
        amax = float(np.abs(t).max())
        if r.kind == "delayed":
            ds = self.ds.setdefault(operand, recipes.DelayedScaling(fmt, r.history_len, r.amax_compute_algo,
                                                                     r.margin))  # fmt: skip
            out = recipes.quantize_tensorwise(t, fmt, ds.scale, rounding, seed)
            ds.update(amax)
            return np.asarray(out, np.float32)
        scale = recipes.current_scale(amax, fmt, r.margin, r.amax_epsilon)
        return np.asarray(recipes.quantize_tensorwise(t, fmt, scale, rounding, seed), np.float32)


def core_operands(q, geo, x, w, g):
    """The operands of the three convolutions (forward; input gradient; weight gradient), quantized by the
    core in the recipe's documented order (the gradient first in the weight gradient)."""
    r, c = q.r, geo.channel
    block = r.kind == "block"
    xq, wq = q(x, "input", c), q(w, "weight", 1)
    once = None if block else q(g, "grad", c)
    g_dx = q(g, "grad", c) if block else once
    w_dx = q(w, "weight", 0) if block and not r.weight_2d else wq
    g_dw, x_dw = (hadamard_tiles(g, 0), hadamard_tiles(x, 0)) if r.hadamard else (g, x)  # tiles of the batch
    g_dw = q(g_dw, "grad", 0) if block else once
    x_dw = q(x_dw, "input", 0) if block else xq
    return (xq, wq), (g_dx, w_dx), (g_dw, x_dw)


def spread(rng, shape, axes=(0, 1)):
    """Normal samples times powers of two per entry of the two ``axes``, so that blocking along either
    changes the block scales."""
    scales = 1.0
    for a in axes:
        s = [1] * len(shape)
        s[a] = shape[a]
        scales = scales * np.exp2(rng.integers(-4, 4, s))
    return (rng.standard_normal(shape) * scales).astype(np.float32)


def recipe(spec, compute):
    return replace(recipes.parse_recipe(spec), keep=(), compute_dtype=compute)


@functools.cache
def convolutions(name, spec, geometry, computes):
    """The recipe's convolution over ``fw.steps`` steps of one Quantizer: its state, and per step the
    operands and (y, dx, dW, db) in each of ``computes``."""
    fw, geo = conv_adapter(name), GEOMETRIES[geometry]
    q, rng = fw.quantizer(recipe(spec, computes[0])), np.random.default_rng(5)
    w = spread(rng, geo.w) * 0.2
    b = rng.standard_normal(geo.w[0]).astype(np.float32) if fw.has_bias else None
    steps = []
    for _ in range(fw.steps):
        x = spread(rng, geo.x, (0, geo.channel))
        x[(0,) + (slice(None),) * (geo.channel % x.ndim - 1) + (1,)] = 0.0  # a channel of zeros
        g, outs = fw.conv(q, geo, computes, x, w, b, lambda shape: spread(rng, shape, (0, geo.channel)))
        steps.append(((x, w, b, g), outs))
    return q, steps


@pytest.fixture(autouse=True, scope="module")
def _release_convolutions():
    """Drop the cached tensors (and MXNet's autograd functions they hold) before the interpreter exits."""
    yield
    convolutions.cache_clear()


@pytest.mark.parametrize(("name", "spec", "geometry", "computes"), fw_cases(CASES))
def test_forward_and_both_gradients_are_the_convolutions_at_core_quantized_operands(name, spec, geometry,
                                                                                    computes):  # fmt: skip
    """Bit for bit: the framework's own convolution and gradients of the same quantized operands, in the
    compute dtype; the bias gradient the output gradient's sum; over the adapter's steps, the call counts
    and delayed histories the core's."""
    fw, geo, compute = conv_fw(name), GEOMETRIES[geometry], computes[0]
    r = recipe(spec, compute)
    q, steps = convolutions(name, spec, geometry, computes)
    core = Core(r, fw.counts)
    for (x, w, b, g), outs in steps:
        y, dx, dw, db = outs[0]
        (xq, wq), (g_dx, w_dx), (g_dw, x_dw) = core_operands(core, geo, x, w, g)
        assert fw.fw.numpy(y).dtype == fw.output_dtype(compute)
        same_bits(fw.fw, y, fw.plain(geo, compute, xq, wq, b))
        same_bits(fw.fw, dx, fw.plain(geo, compute, x, w_dx, g=g_dx, wrt="x"))
        same_bits(fw.fw, dw, fw.plain(geo, compute, x_dw, w, g=g_dw, wrt="w"))
        if fw.has_bias:
            same_bits(fw.fw, db, fw.bias_grad(g))
        assert not np.array_equal(fw.fw.numpy(y), fw.plain(geo, compute, x, w, b))  # quantized
    if fw.calls(q) is not None:
        assert fw.calls(q) == core.calls
    if r.kind == "delayed":
        assert fw.histories(q) == {f"c|{op}": ds.state_dict() for op, ds in core.ds.items()}


BF16_PRODUCTS = {n: [c for c in cs if len(c[2]) > 1] for n, cs in CASES.items()}


@pytest.mark.parametrize(("name", "spec", "geometry", "computes"), fw_cases(BF16_PRODUCTS))
def test_bfloat16_products_accumulate_in_float32_in_all_three_convolutions(name, spec, geometry, computes):
    """MX e4m3 values are bfloat16 numbers, so bfloat16 products summed in float32 give the float32
    convolutions up to summation order; summed in bfloat16 they would be off by ~2^-8."""
    fw, geo = conv_fw(name), GEOMETRIES[geometry]
    _, (((x, w, b, g), outs),) = convolutions(name, spec, geometry, computes)
    (xq, wq), (g_dx, w_dx), (g_dw, x_dw) = core_operands(Core(recipe(spec, "fp32"), fw.counts), geo, x, w, g)
    wants = (fw.plain(geo, "fp32", xq, wq, b), fw.plain(geo, "fp32", x, w_dx, g=g_dx, wrt="x"),
             fw.plain(geo, "fp32", x_dw, w, g=g_dw, wrt="w"))  # fmt: skip
    for a, want in zip(outs[1], wants):
        a = fw.fw.numpy(a)
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))


UNQUANTIZED = {  # torch's arguments as torch takes them, MXNet's groups
    "same-odd": Geometry((2, 3, 8, 7), (4, 3, 4, 3), (1, 1), "same", (1, 1)),  # odd total padding on one axis
    "same-dilated": Geometry((2, 3, 8, 7), (4, 3, 3, 3), (1, 1), "same", (2, 2)),
    "valid-unbatched": Geometry((3, 8, 7), (4, 3, 3, 3), (2, 1), "valid", (1, 1), batched=False),
    "conv1d-groups": Geometry((2, 6, 10), (4, 3, 2), (1,), pad(1), (1,), 2),
    "conv3d": Geometry((2, 2, 5, 4, 6), (3, 2, 2, 3, 2), (2, 2, 2), pad(0, 0, 0), (1, 1, 1)),
    "mx-groups": GEOMETRIES["mx-groups"],
}
UNQUANTIZED_ON = {"torch": [g for g in UNQUANTIZED if g != "mx-groups"], "mxnet": ["mx-groups"]}


@pytest.mark.parametrize(("name", "geometry"), [pytest.param(n, g, id=f"{n}-{g}") for n, gs in
                                                UNQUANTIZED_ON.items() for g in gs])  # fmt: skip
def test_unquantized_gemms_are_the_plain_convolution(name, geometry):
    """With the gradients unquantized, the geometry arguments (strings, unbatched inputs, groups, 3-D) give
    the framework's own gradients of the operands as they are, whether or not the forward is quantized;
    with nothing quantized, its own convolution too; bit for bit."""
    fw, geo = conv_fw(name), UNQUANTIZED[geometry]
    rng = np.random.default_rng(7)

    def normal(shape):
        return rng.standard_normal(shape).astype(np.float32)

    x, w = normal(geo.x), normal(geo.w)
    for forward in (False, True):
        r = recipes.get_recipe("mxfp8", keep=(), compute_dtype="fp32", quantize_forward=forward,
                               quantize_input_grad=False, quantize_weight_grad=False)  # fmt: skip
        g, ((y, dx, dw, _),) = fw.conv(fw.quantizer(r), geo, ("fp32",), x, w, None, normal)
        want_dx, want_dw = fw.plain(geo, "fp32", x, w, g=g)
        same_bits(fw.fw, dx, want_dx)
        same_bits(fw.fw, dw, want_dw)
        if forward:
            assert not np.array_equal(fw.fw.numpy(y), fw.plain(geo, "fp32", x, w))
        else:
            same_bits(fw.fw, y, fw.plain(geo, "fp32", x, w))


HADAMARD = {"torch": "mx-2d", "tensorflow": "tf-conv2d-stride2-same", "mxnet": "mx-2d"}  # JAX: its cases


@pytest.mark.parametrize("name", list(HADAMARD))
def test_the_batch_hadamard_is_the_core_s_and_leaves_the_weight_gradient_unchanged(name):
    """``dW = sum_n conv_weight(x_n, g_n)`` and ``H H^T = I``: the transformed (padded) batch gives the same
    float32 weight gradient up to rounding."""
    fw, geo = conv_fw(name), GEOMETRIES[HADAMARD[name]]
    rng = np.random.default_rng(6)
    x, w = rng.standard_normal(geo.x).astype(np.float32), rng.standard_normal(geo.w).astype(np.float32)
    g = rng.standard_normal(fw.plain(geo, "fp32", x, w).shape).astype(np.float32)
    hx = hadamard_tiles(fw.hadamard(x), axis=0)
    same_bits(fw.fw, hx, hadamard_tiles(x, axis=0))
    assert hx.shape[0] == -(-geo.x[0] // 16) * 16
    dw = fw.plain(geo, "fp32", x, w, g=g, wrt="w")
    dw_h = fw.plain(geo, "fp32", fw.fw.numpy(hx), w, g=hadamard_tiles(g, axis=0), wrt="w")
    np.testing.assert_allclose(dw_h, dw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [n for n, a in CONV_ADAPTERS.items() if n != "jax"])  # JAX: its NCHW cases
def test_blocks_follow_the_channels_not_the_memory_layout(name):
    """mxfp8 on a channels-first input blocks its channels, which differs from blocking its last (spatial)
    axis."""
    fw, r = conv_fw(name), recipes.parse_recipe("mxfp8")
    rng = np.random.default_rng(1)
    x = (spread(rng, (4, 64, 6, 6)) * np.exp2(rng.integers(-8, 8, (4, 64, 6, 6)))).astype(np.float32)
    got = fw.blocked(r, x, 1)
    same_bits(fw.fw, got, Core(r, None)(x, "input", 1))
    assert not np.array_equal(fw.fw.numpy(got), Core(r, None)(x, "input", -1))
