"""Emulated fp8 / MX / NVFP4 convolutions in PyTorch (``polyamp/torch/recipe_conv.py``): NVFP4's
stochastic gradients against the core's stream, the keep list over convolutions, and training (the
forward, both gradients and the geometry arguments: ``test_recipe_conv_frameworks.py``)."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import polyamp as pa
from polyamp import recipes
from polyamp.torch import recipe as tr
from polyamp.torch import recipe_conv as tc

# input shape, weight shape, stride, padding, dilation, groups
CONV2D = ((6, 8, 9, 9), (16, 8, 3, 3), 2, 1, 1, 1)


def core(t: torch.Tensor, r, operand: str, axis: int, seed=None) -> torch.Tensor:
    """``t`` quantized by the numpy core as the block recipe's ``operand``, blocks along ``axis`` (moved
    last; NVFP4's weight in 16x16 tiles of its (O, I) axes)."""
    fmt = r.backward_format if operand == "grad" else r.forward_format
    rounding = "stochastic" if seed is not None else "nearest"
    a = t.detach().numpy()
    if r.weight_2d and operand == "weight":
        moved = np.moveaxis(a, (0, 1), (-2, -1))
        out = pa.quantize_blocks(moved, fmt, axis=(-2, -1), block=(16, 16))
        return torch.from_numpy(np.moveaxis(np.asarray(out, np.float32), (-2, -1), (0, 1)).copy())
    out = pa.quantize_blocks(
        np.moveaxis(a, axis, -1), fmt, scale_rule=r.scale_rule, rounding=rounding, seed=seed
    )
    return torch.from_numpy(np.moveaxis(np.asarray(out, np.float32), -1, axis).copy())


def operands(seed):
    g = torch.Generator().manual_seed(seed)
    xs, ws, *rest = CONV2D
    x = (torch.randn(xs, generator=g) * torch.exp2(torch.randint(-6, 6, xs[:2], generator=g).float())[
        (...,) + (None,) * (len(xs) - 2)]).requires_grad_()  # fmt: skip
    w = (torch.randn(ws, generator=g) / 4).requires_grad_()
    b = torch.randn(ws[0], generator=g).requires_grad_()
    return x, w, b, tuple(rest)


def run(r, x, w, b, rest):
    """Forward and backward through the recipe's conv (fp32 products), with the output gradient used."""
    stride, padding, dilation, groups = rest
    func = F.conv1d if x.dim() == 3 else F.conv2d
    args = (x, w, b, stride, padding, dilation, groups)
    y = tc.quantized_conv(func, args, {}, tr.Quantizer(r), "c", torch.float32)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9))
    y.backward(gy)
    return y, gy


def test_stochastic_gradients_follow_the_quantizer_counter():
    """NVFP4's stochastic gradient rounding: the seeds are the Quantizer's call numbers (x 1, W 2, g for
    the input gradient 3, g for the weight gradient 4, x 5: the linear layers' order, and JAX's),
    each against the core's stream."""
    r = replace(recipes.get_recipe("nvfp4", keep=()), compute_dtype="fp32")
    x, w, b, rest = operands(seed=3)
    y, gy = run(r, x, w, b, rest)
    dx = tc._INPUT_GRAD[2](x.shape, core(w, r, "weight", 1), core(gy, r, "grad", 1, seed=3), *rest)
    assert torch.equal(x.grad, dx)
    dw = tc._WEIGHT_GRAD[2](core(x, r, "input", 0), w.shape, core(gy, r, "grad", 0, seed=4), *rest)
    assert torch.equal(w.grad, dw)
    nearest = tc._WEIGHT_GRAD[2](core(x, r, "input", 0), w.shape, core(gy, r, "grad", 0), *rest)
    assert not torch.equal(w.grad, nearest)


def cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, stride=2, padding=1),
                         nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 16, 32), nn.ReLU(), nn.Linear(32, 4))  # fmt: skip


def quantized_layers(model, mp, x):
    """The layers whose conv / linear ran the recipe's quantized GEMMs, in call order."""
    seen = []
    originals = tc._QuantizedConv.apply, tr._QuantizedLinear.apply

    def conv_spy(*args):
        seen.append(args[5])
        return originals[0](*args)

    def linear_spy(*args):
        seen.append(args[4])
        return originals[1](*args)

    tc._QuantizedConv.apply, tr._QuantizedLinear.apply = conv_spy, linear_spy
    try:
        with mp.autocast():
            model(x)
    finally:
        tc._QuantizedConv.apply, tr._QuantizedLinear.apply = originals
    return seen


def test_keep_first_and_last_counts_convolutions():
    model = cnn()
    x = torch.randn(2, 3, 8, 8)
    mp = pa.MixedPrecision("mxfp8", framework="torch", device="cpu")
    mp.watch(model)
    assert quantized_layers(model, mp, x) == ["2", "4", "7"]  # the first conv "0" and the last linear kept
    everything = pa.MixedPrecision(recipes.get_recipe("nvfp4", keep=("2",)), framework="torch", device="cpu")
    everything.watch(model)
    assert quantized_layers(model, everything, x) == ["0", "4", "7", "9"]


def images(steps, seed=1):
    """Random images; targets their channel means and the mean product of two channels (x 8: unit
    variance)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(32, 3, 8, 8, generator=g)
        y = torch.cat([x.mean((2, 3)), (x[:, 0] * x[:, 1]).mean((1, 2))[:, None]], 1)
        out.append((x, 8 * y))
    return out


@pytest.mark.parametrize("name", ["mxfp8", "fp8-delayed", "nvfp4"])
def test_a_cnn_trains_with_quantized_convolutions(name):
    model, ref = cnn(), cnn()
    mp = pa.MixedPrecision(recipes.get_recipe(name, keep=()), framework="torch", device="cpu")
    mp.watch(model)
    bf16 = pa.MixedPrecision("bf16-mixed", framework="torch", device="cpu")
    losses = {}
    for m, p in ((model, mp), (ref, bf16)):
        opt = torch.optim.Adam(m.parameters(), 5e-3)
        for x, y in images(40):
            opt.zero_grad()
            with p.autocast():
                loss = F.mse_loss(m(x).float(), y)
            p.backward(loss)
            p.step(opt)
            losses.setdefault(p, []).append(loss.item())
    first, last, bf16_last = np.mean(losses[mp][:5]), np.mean(losses[mp][-5:]), np.mean(losses[bf16][-5:])
    assert last < 0.7 * first and last < 1.3 * bf16_last  # bf16-mixed: 1.14 -> 0.65 here
    assert not torch.equal(model[2].weight, ref[2].weight)
    if name == "fp8-delayed":  # each conv layer keeps its own amax histories
        histories = mp.state_dict()["recipe"]["state"]["delayed"]
        assert {"0|input", "2|weight", "4|grad"} <= set(histories)
