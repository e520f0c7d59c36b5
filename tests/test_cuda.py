"""The PyTorch front end on a CUDA device: fp16 autocast, loss scaling against the real
``torch.amp.GradScaler("cuda")``, the first-non-finite tracer, ``keep_fp32`` and the doctor's taps.

CI has no GPU, so these skip there (the CPU tests carry the weight); they ran on an H200 lent to
issue 14 (docs/BENCHMARKS.md, "GPU run").
"""

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from torch import nn  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp.torch.doctor import collect  # noqa: E402

CUDA = "cuda"


def tiny_model(seed=0, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 1)).to(CUDA)


def batches(n, seed=1, size=32):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(size, 8, generator=g)
        yield x.to(CUDA), x.sum(dim=1, keepdim=True).sin().to(CUDA)


def test_the_default_device_is_cuda_and_fp16_autocast_runs_matmuls_in_fp16():
    model, (x, _) = tiny_model(), next(batches(1))
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    with mp.autocast():
        out = model(x)
        loss = out.float().pow(2).mean()
    assert out.dtype == torch.float16 and out.device.type == "cuda"
    assert loss.dtype == torch.float32


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fp16_steps_are_bit_identical_to_autocast_plus_gradscaler_on_cuda(optimizer):
    """Same model, data and overflow pattern: polyamp's torch preset and GradScaler("cuda") (whose
    unscale and inf check are the fused CUDA kernels)."""
    native, ours = tiny_model(), tiny_model()

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-3)

    opt_n, opt_o = make(native.parameters()), make(ours.parameters())
    scaler = torch.amp.GradScaler(CUDA, growth_interval=4)
    ls = dataclasses.replace(pa.DynamicLossScale.preset("torch"), growth_interval=4)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device=CUDA, loss_scale=ls)
    overflow = {3: math.inf, 4: math.nan, 10: -math.inf, 11: math.inf, 12: math.inf, 20: math.nan}
    for step, (x, y) in enumerate(batches(30)):
        opt_n.zero_grad()
        with torch.autocast(CUDA, dtype=torch.float16):
            loss = nn.functional.mse_loss(native(x).float(), y)
        scaler.scale(loss).backward()
        if step in overflow:
            native[0].weight.grad[0, 0] = overflow[step]
        scaler.step(opt_n)
        scaler.update()

        opt_o.zero_grad()
        with mp.autocast():
            loss = nn.functional.mse_loss(ours(x).float(), y)
        mp.backward(loss)
        if step in overflow:
            ours[0].weight.grad[0, 0] = overflow[step]
        result = mp.step(opt_o)

        assert result.stepped == (step not in overflow)
        assert result.scale == scaler.get_scale()
        for a, b in zip(native.parameters(), ours.parameters()):
            assert torch.equal(a, b), step


def test_the_tracer_names_the_layer_whose_fp16_output_overflows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1)).to(CUDA)
    with torch.no_grad():
        model[1].weight.mul_(1e5)  # its fp16 output overflows; the LayerNorm would bring it back
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", debug=True)
    mp.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(batches(1))
    with mp.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)
    result = mp.step(opt)
    assert not result.stepped and result.origin == "forward output of 1"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_keep_fp32_runs_the_overflowing_layer_in_float32_and_the_step_succeeds():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1)).to(CUDA)
    with torch.no_grad():
        model[1].weight.mul_(1e5)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", keep_fp32=["1", "2"])
    mp.watch(model)
    seen = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, o.dtype))
             for n, m in model.named_children()]  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = next(batches(1))
    with mp.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)
    assert mp.step(opt).stepped
    for h in hooks:
        h.remove()
    assert seen["0"] == torch.float16 and seen["1"] == torch.float32 and seen["3"] == torch.float16


def test_the_doctor_on_cuda_leaves_model_and_optimizer_bitwise_as_they_were():
    model, (x, y) = tiny_model(), next(batches(1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.functional.mse_loss
    loss_fn(model(x), y).backward()
    opt.step()  # the optimizer has state
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    grads = [p.grad.clone() for p in model.parameters()]
    obs = collect(model, (x, y), loss_fn, steps=2, optimizer=opt)
    assert {o.kind for o in obs} >= {"output", "grad_output", "weight", "grad_weight", "update_ratio"}
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    after = {k: v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v)}
    assert all(torch.equal(state[k], after[k]) for k in state)


def test_the_doctors_report_applies_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 1)).to(CUDA)
    with torch.no_grad():
        model[1].weight.mul_(1e5)
    x, y = next(batches(1))
    report = pa.doctor(model, (x, y), nn.functional.mse_loss)
    assert "1" in report.keep_fp32
    mp = pa.MixedPrecision(report.policy, loss_scale=report.loss_scale, keep_fp32=report.keep_fp32,
                           framework="torch")  # fmt: skip
    mp.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with mp.autocast():
        loss = nn.functional.mse_loss(model(x).float(), y)
    mp.backward(loss)
    assert mp.step(opt).stepped


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4"])
def test_recipes_quantize_on_cuda_as_on_the_cpu_and_train(name):
    from polyamp.recipes import get_recipe
    from polyamp.torch.recipe import Quantizer

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float())
    on_cpu, on_gpu = Quantizer(get_recipe(name)), Quantizer(get_recipe(name))
    for operand in ("input", "weight", "grad"):
        for axis in (-1, 0):
            a, b = on_cpu(x, "l", operand, axis), on_gpu(x.to(CUDA), "l", operand, axis).cpu()
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    model = model.to(CUDA)
    mp = pa.MixedPrecision(name, framework="torch")
    mp.watch(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(40):
        opt.zero_grad()
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        assert mp.step(opt).stepped
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and sum(losses[-5:]) < sum(losses[:5])
