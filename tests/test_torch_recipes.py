"""Emulated fp8 / MX / NVFP4 training in PyTorch (``polyamp/torch/recipe.py``): keep lists, delayed-scaling
checkpoints, training, and the errors (the quantization and the three GEMMs against the numpy core:
test_recipes_frameworks.py)."""

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import polyamp as pa
from polyamp import PolyampError, recipes
from polyamp.numerics.hadamard import hadamard_tiles
from polyamp.recipe_layers import RecipeWarning
from polyamp.torch import recipe as tr

RECIPE_NAMES = list(recipes.RECIPES)


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


# -- NVFP4's random Hadamard transform on the weight-gradient operands ------------------------------
# (its tiles and GEMMs against the core: test_recipes_frameworks.py)
def test_hadamard_tiles_never_require_grad():
    w = torch.randn(4, 20, requires_grad=True)
    assert not hadamard_tiles(w).requires_grad


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
