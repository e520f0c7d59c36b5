"""Emulated fp8 / MX / NVFP4 training in PyTorch (``polyamp/torch/recipe.py``): the quantization against
the numpy core bit for bit, the three GEMMs against a hand computation, keep lists, delayed-scaling
checkpoints, training, and the errors."""

import copy
import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import polyamp as pa
from polyamp import PolyampError, recipes
from polyamp.numerics import hadamard as core_hadamard
from polyamp.numerics.hadamard import hadamard_tiles
from polyamp.recipe_layers import RecipeWarning
from polyamp.torch import recipe as tr

RECIPE_NAMES = list(recipes.RECIPES)


def same(got: torch.Tensor, want) -> bool:
    """Bit for bit, NaN payloads aside (torch's float8 NaN widens to another float32 NaN than numpy's)."""
    a, b = got.detach().numpy().astype(np.float32), np.asarray(want, np.float32)
    nan = np.isnan(a)
    return a.shape == b.shape and np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes()


def specials(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    x[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-42])
    return x


def mlp(seed=0, width=48):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4))  # fmt: skip


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(64, 16, generator=g)
        yield x, x[:, :4].sin()


def train(model, mp, steps, lr=1e-2, start=0):
    opt = torch.optim.Adam(model.parameters(), lr)
    losses = []
    for x, y in list(batches(start + steps))[start:]:
        opt.zero_grad()
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        mp.step(opt)
        losses.append(loss.item())
    return losses, opt


# -- quantization, bit for bit against the numpy core ----------------------------------------------
@pytest.mark.parametrize("amax", [0.0, 1e-45, 1e-30, 0.37, 3.5, 448.0, 6e37, 3e38, math.inf, math.nan])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("margin, eps", [(0, 0.0), (2, 0.0), (0, 1e-12)])
def test_current_scale_equals_the_core(amax, fmt, margin, eps):
    got = tr.current_scale(torch.tensor(amax, dtype=torch.float32), fmt, margin, eps)
    want = recipes.current_scale(amax, fmt, margin, eps)
    assert got.dtype == torch.float32 and got.numpy().tobytes() == np.float32(want).tobytes()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_tensorwise_cast_equals_the_core(fmt):
    x = specials(20000, seed=2)
    for scale in (1.0, 0.5, 3.0, 2.0**-20, 1e30, 448.0 / 7.3):
        s = torch.tensor(scale, dtype=torch.float32)
        got = tr._tensorwise(x, fmt, s, "nearest", None)
        want = recipes.quantize_tensorwise(x.numpy(), fmt, scale)
        assert same(got, want), scale


def test_stochastic_tensorwise_equals_the_core():
    x = specials(5000, seed=3)
    got = tr._tensorwise(x, "e5m2", torch.tensor(8.0), "stochastic", 11)
    want = recipes.quantize_tensorwise(x.numpy(), "e5m2", 8.0, rounding="stochastic", seed=11)
    assert same(got, want)


@pytest.mark.parametrize("name", RECIPE_NAMES)
@pytest.mark.parametrize("operand", ["input", "weight", "grad"])
def test_each_operand_is_quantized_as_the_core_does(name, operand):
    """The Quantizer's output, for each recipe and operand, against the numpy core's functions."""
    r = recipes.get_recipe(name)
    q = tr.Quantizer(r)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 64, generator=g) * torch.exp2(torch.randint(-8, 8, (48, 1), generator=g).float())
    x[3, 5] = 0.0
    fmt = r.backward_format if operand == "grad" else r.forward_format
    rounding = r.grad_rounding if operand == "grad" else r.forward_rounding
    for axis in (-1, 0):
        got = q(x, "layer", operand, axis=axis)
        seed = q.calls if rounding == "stochastic" else None
        if r.kind == "block":
            two_d = r.weight_2d and operand == "weight"
            want = pa.quantize_blocks(x.numpy(), fmt, axis=(-2, -1) if two_d else axis,
                                      block=(16, 16) if two_d else None, scale_rule=r.scale_rule,
                                      rounding=rounding, seed=seed)  # fmt: skip
        else:
            ds = recipes.DelayedScaling(fmt) if r.kind == "delayed" else None
            scale = ds.scale if ds is not None else recipes.current_scale(float(x.abs().max()), fmt)
            if r.kind == "delayed" and axis == 0:  # the second call uses the scale the first one left
                ds.update(float(x.abs().max()))
                scale = ds.scale
            want = recipes.quantize_tensorwise(x.numpy(), fmt, scale, rounding=rounding, seed=seed)
        assert got.dtype == torch.float32
        assert same(got, want), (axis, operand)


# -- the three GEMMs against a hand computation -----------------------------------------------------
@pytest.mark.parametrize("name", ["fp8-tensorwise", "mxfp8", "nvfp4"])
def test_forward_and_both_gradients_are_the_quantized_gemms(name):
    r = recipes.get_recipe(name, keep=(), grad_rounding="nearest", compute_dtype="fp32")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 48, generator=g, requires_grad=True)
    w = torch.randn(64, 48, generator=g, requires_grad=True)
    b = torch.randn(64, generator=g, requires_grad=True)
    gy = torch.randn(32, 64, generator=g)
    y = tr._QuantizedLinear.apply(x, w, b, tr.Quantizer(r), "l", torch.float32)
    y.backward(gy)

    def q(t, fmt, axis=-1, two_d=False):
        if r.kind != "block":
            scale = recipes.current_scale(float(t.detach().abs().max()), fmt)
            return torch.from_numpy(recipes.quantize_tensorwise(t.detach().numpy(), fmt, scale))
        out = pa.quantize_blocks(t.detach().numpy(), fmt, axis=(-2, -1) if two_d else axis,
                                 block=(16, 16) if two_d else None, scale_rule=r.scale_rule)  # fmt: skip
        return torch.from_numpy(np.asarray(out, np.float32))

    f, bk, two_d = r.forward_format, r.backward_format, r.weight_2d
    wq = q(w, f, two_d=two_d)
    assert torch.equal(y, q(x, f) @ wq.t() + b)
    w_dgrad = wq if (two_d or r.kind != "block") else q(w, f, axis=0)
    assert torch.equal(x.grad, q(gy, bk) @ w_dgrad)
    x_wgrad = q(x, f) if r.kind != "block" else q(x, f, axis=0)
    g_wgrad = q(gy, bk) if r.kind != "block" else q(gy, bk, axis=0)
    assert torch.equal(w.grad, g_wgrad.t() @ x_wgrad)
    assert torch.equal(b.grad, gy.sum(0))


def test_unquantized_gemms_take_their_operands_as_they_are():
    r = recipes.get_recipe("fp8-tensorwise", keep=(), compute_dtype="fp32", quantize_input_grad=False,
                           quantize_weight_grad=False)  # fmt: skip
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, generator=g, requires_grad=True)
    gy = torch.randn(8, 4, generator=g)
    tr._QuantizedLinear.apply(x, w, None, tr.Quantizer(r), "l", torch.float32).backward(gy)
    assert torch.equal(x.grad, gy @ w.detach()) and torch.equal(w.grad, gy.t() @ x.detach())


# -- NVFP4's random Hadamard transform on the weight-gradient operands ------------------------------
HADAMARD_SHAPES = [(1, 16), (3, 37), (2, 1), (4, 15), (5, 17), (2, 64), (3, 100), (0, 20), (4, 0)]


@pytest.mark.parametrize("shape", HADAMARD_SHAPES)
def test_hadamard_tiles_equals_the_core(shape):
    n = math.prod(shape)
    x = specials(max(n, 6), seed=sum(shape))[:n].reshape(shape)
    for t in (x, x.t(), x.unsqueeze(0).expand(2, *shape)):  # contiguous, transposed view, broadcast
        for axis in range(-t.dim(), t.dim()):
            got = hadamard_tiles(t, axis=axis)
            want = core_hadamard.hadamard_tiles(t.numpy(), axis=axis)
            assert got.dtype == torch.float32 and same(got, want), (tuple(t.shape), axis)


def test_hadamard_tiles_dtypes_and_ranges():
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 70, generator=g, dtype=torch.float64) * 1e3
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        t = x.to(dtype)
        assert same(hadamard_tiles(t), core_hadamard.hadamard_tiles(t.float().numpy()))
    tiny, big = 2.0**-149, float(np.finfo(np.float32).max)
    for fill in (tiny, -tiny, 2.0**-130, 2.0**120, big, 0.0, -0.0):
        t = torch.full((2, 16), fill) * torch.tensor([1.0, -1.0]).repeat(8)
        assert same(hadamard_tiles(t), core_hadamard.hadamard_tiles(t.numpy())), fill
    w = torch.randn(4, 20, requires_grad=True)
    assert not hadamard_tiles(w).requires_grad


@pytest.mark.parametrize(
    "bad, match",
    [
        (torch.arange(16), r"received a torch.int64 tensor of shape \(16,\)"),
        (torch.tensor(1.0), r"received a torch.float32 tensor of shape \(\)"),
        (torch.ones(16, dtype=torch.complex64), r"received a torch.complex64 tensor"),
    ],
)
def test_hadamard_tiles_errors(bad, match):
    with pytest.raises(PolyampError, match=match):
        hadamard_tiles(bad)
    for axis in (2, -3, 1.0, True):
        with pytest.raises(PolyampError, match=r"not an axis of a 2-d array; accepted: integers in \["):
            hadamard_tiles(torch.ones(2, 16), axis=axis)


@pytest.mark.parametrize("m", [16, 37, 64, 5])
def test_hadamard_leaves_the_wgrad_product_unchanged_without_quantization(m):
    """``H`` is orthogonal: the transformed operands' product is ``g^T x`` up to float32 rounding."""
    g = torch.Generator().manual_seed(m)
    gt, xt = torch.randn(24, m, generator=g), torch.randn(40, m, generator=g)
    got = (hadamard_tiles(gt).double() @ hadamard_tiles(xt).double().t()).numpy()
    want = (gt.double() @ xt.double().t()).numpy()
    bound = 8 * 2.0**-24 * (gt.double().abs() @ xt.double().abs().t()).numpy()
    assert (np.abs(got - want) <= bound).all()
    assert not np.array_equal(hadamard_tiles(gt)[:, :m].numpy(), gt.numpy())  # it did transform them


@pytest.mark.parametrize("tokens", [(32,), (37,), (3, 7), (5,)])
def test_hadamard_wgrad_is_the_gemm_of_core_transformed_quantized_operands(tokens):
    r = recipes.get_recipe("nvfp4", keep=(), grad_rounding="nearest", compute_dtype="fp32", hadamard=True)
    g = torch.Generator().manual_seed(sum(tokens))
    x = torch.randn(*tokens, 48, generator=g, requires_grad=True)
    w = torch.randn(64, 48, generator=g, requires_grad=True)
    gy = torch.randn(*tokens, 64, generator=g)
    y = tr._QuantizedLinear.apply(x, w, None, tr.Quantizer(r), "l", torch.float32)
    y.backward(gy)

    def q(t: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(pa.quantize_blocks(t, "nvfp4"), np.float32))

    x2, g2 = x.detach().reshape(-1, 48).numpy(), gy.reshape(-1, 64).numpy()
    gt = q(core_hadamard.hadamard_tiles(g2.T))  # along M, padded to a multiple of 16
    xt = q(core_hadamard.hadamard_tiles(x2.T))
    assert gt.shape[1] == -(-x2.shape[0] // 16) * 16
    assert torch.equal(w.grad, gt @ xt.t())
    # the forward and the input gradient are those of plain nvfp4
    x0, w0 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    plain = recipes.get_recipe(r, hadamard=False)
    y0 = tr._QuantizedLinear.apply(x0, w0, None, tr.Quantizer(plain), "l", torch.float32)
    y0.backward(gy)
    assert torch.equal(y, y0) and torch.equal(x.grad, x0.grad) and not torch.equal(w.grad, w0.grad)


def test_hadamard_applies_only_where_the_wgrad_gemm_is_quantized():
    r = recipes.get_recipe("nvfp4", keep=(), compute_dtype="fp32", hadamard=True, quantize_weight_grad=False)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(20, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    gy = torch.randn(20, 8, generator=g)
    tr._QuantizedLinear.apply(x, w, None, tr.Quantizer(r), "l", torch.float32).backward(gy)
    assert torch.equal(w.grad, gy.t() @ x.detach())


def test_nvfp4_with_hadamard_trains_from_its_spelling():
    model = mlp()
    mp = pa.MixedPrecision("nvfp4:hadamard=true", framework="torch", device="cpu")
    assert mp.recipe.hadamard and recipes.refusal(mp.recipe, "torch") is None
    mp.watch(model)
    losses, _ = train(model, mp, 60)
    ref = mlp()
    plain = pa.MixedPrecision("nvfp4", framework="torch", device="cpu")
    plain.watch(ref)
    train(ref, plain, 60)
    assert np.mean(losses[-10:]) < 0.2 * losses[0]
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    saved = json.loads(json.dumps(mp.state_dict()))
    assert saved["recipe"]["name"] == "nvfp4:hadamard=true" and "hadamard=true" in repr(mp)
    with pytest.raises(PolyampError, match=r"saved with recipe 'nvfp4:hadamard=true', this run uses 'nvfp4'"):
        plain.load_state_dict(saved)  # the overrides are part of the recipe a checkpoint names
    plain.load_state_dict(plain.state_dict())


# -- MixedPrecision with a recipe --------------------------------------------------------------------
def layer_inputs(model, mp, x):
    """Per nn.Linear, whether the matmul it ran saw quantized operands (a recorded F.linear call)."""
    seen = []
    original = tr._QuantizedLinear.apply

    def spy(*args):
        seen.append(args[4])
        return original(*args)

    tr._QuantizedLinear.apply = spy
    try:
        with mp.autocast():
            model(x)
    finally:
        tr._QuantizedLinear.apply = original
    return seen


def test_the_first_and_last_linear_are_kept_by_default_and_patterns_keep_more():
    model = mlp()
    mp = pa.MixedPrecision("fp8-tensorwise", framework="torch", device="cpu")
    mp.watch(model)
    x = next(batches(1))[0]
    assert layer_inputs(model, mp, x) == ["2", "4"]
    custom = pa.MixedPrecision(recipes.get_recipe("mxfp8", keep=("first", "4")), framework="torch",
                               device="cpu")  # fmt: skip
    custom.watch(model)
    assert layer_inputs(model, custom, x) == ["2", "6"]
    everything = pa.MixedPrecision(recipes.get_recipe("nvfp4", keep=()), framework="torch", device="cpu")
    everything.watch(model)
    assert layer_inputs(model, everything, x) == ["0", "2", "4", "6"]


def test_functional_linears_inside_a_module_are_quantized_under_its_name():
    class Projection(nn.Module):  # its own weight, applied with F.linear
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32) / 6)

        def forward(self, x):
            return nn.functional.linear(x, self.w)

    model = nn.Sequential(nn.Linear(8, 32), Projection(), nn.Linear(32, 2))
    mp = pa.MixedPrecision("fp8-tensorwise", framework="torch", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its F.linear is found when it runs: no warning at watch
        mp.watch(model)
    assert mp.recipe_layers.quantized == [] and list(mp.recipe_layers.kept) == ["0", "2"]
    assert layer_inputs(model, mp, torch.randn(4, 8)) == ["1"]
    assert mp.recipe_layers.quantized == ["1"]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_each_recipe_trains_and_differs_from_bf16(name):
    model = mlp()
    mp = pa.MixedPrecision(name, framework="torch", device="cpu")
    mp.watch(model)
    losses, _ = train(model, mp, 60)
    ref = mlp()
    bf16 = pa.MixedPrecision("bf16-mixed", framework="torch", device="cpu")
    train(ref, bf16, 60)
    assert np.mean(losses[-10:]) < 0.2 * losses[0]
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert mp.recipe.name == name and repr(mp).startswith(f"MixedPrecision({name!r}")


def test_delayed_scaling_resumes_bit_identically_from_a_json_checkpoint():
    full_model = mlp()
    full = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
    full.watch(full_model)
    train(full_model, full, 12)

    model = mlp()
    first = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
    first.watch(model)
    _, opt = train(model, first, 6)
    saved = json.loads(json.dumps(first.state_dict()))
    assert saved["recipe"]["name"] == "fp8-delayed" and saved["recipe"]["state"]["delayed"]
    resumed = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
    resumed.watch(model)
    resumed.load_state_dict(saved)
    opt_state = copy.deepcopy(opt.state_dict())
    opt2 = torch.optim.Adam(model.parameters(), 1e-2)
    opt2.load_state_dict(opt_state)
    for x, y in list(batches(12))[6:]:
        opt2.zero_grad()
        with resumed.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        resumed.backward(loss)
        resumed.step(opt2)
    assert all(torch.equal(a, b) for a, b in zip(full_model.parameters(), model.parameters()))


# -- bad input ---------------------------------------------------------------------------------------
def test_recipe_errors():
    with pytest.raises(PolyampError, match="call mp.watch"):
        pa.MixedPrecision("fp8-tensorwise", framework="torch", device="cpu").autocast()
    with pytest.raises(PolyampError, match="matches no module"):
        pa.MixedPrecision(recipes.get_recipe("mxfp8", keep=("nope*",)), framework="torch").watch(mlp())
    with pytest.raises(PolyampError, match="precision policy"):
        pa.MixedPrecision("fp8-tensorwize", framework="torch")
    saved = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu").state_dict()
    with pytest.raises(PolyampError, match="recipe 'fp8-delayed'"):
        pa.MixedPrecision("bf16-mixed", framework="torch", device="cpu").load_state_dict(saved)


# -- transformers' Conv1D, the record of what a recipe quantizes --------------------------------------
def conv1d_twins():
    """An MLP with transformers' Conv1D (weight (in, out), ``torch.addmm``) in the middle, and the same
    network with an nn.Linear holding that weight transposed."""
    from frameworks import require

    conv1d = require("transformers").pytorch_utils.Conv1D
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 48), nn.GELU(), conv1d(40, 48), nn.GELU(), nn.Linear(40, 4))
    b = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 4))
    b.load_state_dict({k: v.t() if k == "2.weight" else v for k, v in a.state_dict().items()})
    return a, b


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_transformers_conv1d_trains_as_the_linear_of_its_transposed_weight(name):
    a, b = conv1d_twins()
    runs = []
    for model in (a, b):
        mp = pa.MixedPrecision(recipes.get_recipe(name, keep=()), framework="torch", device="cpu")
        mp.watch(model)
        assert mp.recipe_layers.quantized == ["0", "2", "4"] and not mp.recipe_layers.kept
        runs.append((train(model, mp, 3)[0], mp.state_dict()["recipe"]))
    assert runs[0] == runs[1] and runs[0][1]["state"]["calls"] > 0
    assert torch.equal(a[2].weight, b[2].weight.t()) and torch.equal(a[2].bias, b[2].bias)
    assert not torch.equal(a[2].weight, conv1d_twins()[0][2].weight)  # it trained


def test_the_record_names_each_matmul_module_with_why_it_is_kept():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ConvTranspose2d(8, 8, 2), nn.Flatten(), nn.LazyLinear(16),
                          nn.Linear(16, 16), nn.Linear(16, 4))  # fmt: skip
    model.add_module("attn", nn.MultiheadAttention(16, 2))
    mp = pa.MixedPrecision("mxfp8:keep=first|last|4", framework="torch", device="cpu")
    mp.watch(model)
    record = mp.recipe_layers
    assert record.quantized == ["3"] and list(record.kept) == ["0", "1", "4", "5", "attn", "attn.out_proj"]
    assert record.kept["0"].startswith("keep 'first': the first matmul module in named_modules order")
    assert record.kept["5"].startswith("keep 'last'") and record.kept["4"] == "keep '4'"
    assert record.kept["1"].startswith("unsupported: ConvTranspose2d: transposed convolutions")
    assert record.kept["attn"].startswith("unsupported: MultiheadAttention: its in- and out-projections")
    assert "inside MultiheadAttention 'attn'" in record.kept["attn.out_proj"]
    assert record.as_dict()["quantized"] == ["3"] and "quantized  3" in str(record)


def test_a_recipe_that_quantizes_no_layer_warns_at_watch():
    with pytest.warns(RecipeWarning, match="quantizes no layer of this torch model"):
        pa.MixedPrecision("nvfp4", framework="torch", device="cpu").watch(nn.Sequential(nn.Linear(4, 4)))
