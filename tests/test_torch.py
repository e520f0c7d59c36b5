"""The PyTorch backend end to end, against the real torch.autocast and torch.amp.GradScaler.

What every front end must do (fault injection, skip agreement, resume, bad input, every policy
skipping) is tests/test_contract.py; this file keeps what is this framework's own.
"""

import dataclasses
import math
import warnings

import pytest
import torch
from torch import nn

import polyamp as pa
from polyamp import NonFiniteError, PolyampError


def tiny_model(seed=0, width=16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 1))


def batches(n, seed=1, size=32):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(size, 8, generator=g)
        yield x, x.sum(dim=1, keepdim=True).sin()


def inject(model, kind):
    """Put inf, -inf or NaN into one gradient element of the first layer."""
    value = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[kind]
    model[0].weight.grad[0, 0] = value


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


# -- autocast --------------------------------------------------------------------------------------
def test_autocast_bf16_runs_matmuls_in_bf16_and_losses_in_fp32():
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", device="cpu")
    model = tiny_model()
    with mp.autocast():
        out = model(torch.randn(4, 8))
        loss = nn.functional.mse_loss(out, torch.zeros(4, 1))
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32


def test_float32_policy_does_not_autocast():
    mp = pa.MixedPrecision("float32", framework="torch")
    with mp.autocast():
        assert tiny_model()(torch.randn(2, 8)).dtype == torch.float32
    assert mp.loss_scale.init().scale == 1.0


def test_fp16_autocast_on_cpu_works_and_warns_that_it_is_slow():
    from polyamp.torch import ops as torch_backend

    torch_backend._warned.clear()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu")
    with pytest.warns(RuntimeWarning, match="slower than float32"), mp.autocast():
        assert tiny_model()(torch.randn(2, 8)).dtype == torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_cuda_autocast_without_cuda_is_a_clear_error():
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cuda")
    with pytest.raises(PolyampError, match="cannot autocast to float16 on 'cuda'"):
        mp.autocast()


# -- the step against GradScaler -----------------------------------------------------------------
def test_fp16_steps_are_bit_identical_to_autocast_plus_gradscaler():
    """Same model, data and overflow pattern: polyamp's torch preset and the real GradScaler."""
    native, ours = tiny_model(), tiny_model()
    opt_n = torch.optim.SGD(native.parameters(), lr=0.05, momentum=0.9)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=4)
    ls = dataclasses.replace(pa.DynamicLossScale.preset("torch"), growth_interval=4)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu", loss_scale=ls)
    overflow_steps = {3, 4, 10, 11, 12, 20}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on CPU is slow
        for step, (x, y) in enumerate(batches(30)):
            opt_n.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(native(x).float(), y)
            scaler.scale(loss).backward()
            if step in overflow_steps:
                inject(native, "inf")
            scaler.step(opt_n)
            scaler.update()

            opt_o.zero_grad()
            with mp.autocast():
                loss = nn.functional.mse_loss(ours(x).float(), y)
            mp.backward(loss)
            if step in overflow_steps:
                inject(ours, "inf")
            result = mp.step(opt_o)

            assert result.stepped == (step not in overflow_steps)
            assert result.scale == scaler.get_scale()
            for a, b in zip(native.parameters(), ours.parameters()):
                assert torch.equal(a, b), step


def test_clipping_reports_the_unscaled_norm_and_clips():
    model, reference = tiny_model(), tiny_model()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = next(batches(1))
    mp.backward(nn.functional.mse_loss(model(x), y))
    nn.functional.mse_loss(reference(x), y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    result = mp.step(opt, clip_grad_norm=1e-3)
    assert result.grad_norm == pytest.approx(float(expected), rel=1e-5)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(total) == pytest.approx(1e-3, rel=1e-4)


def test_sparse_gradients_are_unscaled_in_place():
    """An uncoalesced sparse embedding gradient (repeated indices) is unscaled where the optimizer
    reads it, as GradScaler does: the step equals the unscaled one."""
    ids = torch.tensor([1, 1, 2])
    steps = {}
    for scale in (1.0, 1024.0):
        emb = nn.Embedding(10, 4, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.arange(40.0).reshape(10, 4))
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        mp = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale=pa.StaticLossScale(scale))
        mp.backward(emb(ids).sum())
        assert not emb.weight.grad.is_coalesced()
        assert mp.step(opt).stepped
        steps[scale] = emb.weight.detach().clone()
    assert torch.equal(steps[1024.0], steps[1.0])
    assert torch.equal(steps[1.0][1], torch.arange(4.0, 8.0) - 1.0)  # 2 uses x lr 0.5


def test_gradient_accumulation_matches_one_large_batch():
    model, reference = tiny_model(), tiny_model()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = next(batches(1, size=64))
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        mp.backward(nn.functional.mse_loss(model(xs), ys) / 4)
    assert mp.step(opt).stepped
    nn.functional.mse_loss(reference(x), y).backward()
    opt_ref.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_several_optimizers_and_param_groups_step_or_skip_together():
    model = tiny_model()
    opt_a = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                             {"params": [model[2].weight], "lr": 0.01}])  # fmt: skip
    opt_b = torch.optim.Adam([model[2].bias], lr=0.1)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    mp.watch(model)
    x, y = next(batches(1))
    mp.backward(nn.functional.mse_loss(model(x), y))
    model[2].bias.grad[0] = math.inf
    before = params_of(model)
    result = mp.step([opt_a, opt_b])
    assert not result.stepped and result.nonfinite == ("2.bias",)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert result.scale == 2.0**15
    opt_a.zero_grad()
    opt_b.zero_grad()
    mp.backward(nn.functional.mse_loss(model(x), y))
    assert mp.step([opt_a, opt_b]).stepped
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_too_many_consecutive_skips_raise_naming_the_origin():
    model = tiny_model()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch",
                           loss_scale=pa.DynamicLossScale(max_consecutive_skips=5))  # fmt: skip
    mp.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = next(batches(1))
    for i in range(5):
        mp.backward(nn.functional.mse_loss(model(x), y))
        inject(model, "nan")
        if i < 4:
            assert not mp.step(opt).stepped
    with pytest.raises(NonFiniteError, match="0.weight"):
        mp.step(opt)


def test_debug_names_the_first_module_with_a_nonfinite_output():
    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x - x.max())  # log(0) = -inf at the maximum

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), Log(), nn.Linear(4, 1))
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", debug=True)
    mp.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mp.backward(model(torch.randn(2, 8)).sum())
    result = mp.step(opt)
    assert not result.stepped and result.origin == "forward output of 1"


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input_is_one_clear_error_and_changes_nothing():
    with pytest.raises(PolyampError, match="'fp17'"):
        pa.MixedPrecision("fp17")
    model = tiny_model()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(PolyampError, match="no parameter has a gradient"):
        mp.step(opt)
    empty = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    empty.param_groups[0]["params"] = []
    with pytest.raises(PolyampError, match="has no parameters"):
        mp.step(empty)
    mp.backward(model(torch.randn(2, 8)).sum())
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(PolyampError, match="batch_size=4 is for MXNet"):
        mp.step(opt, 4)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert mp.state == mp.loss_scale.init()


def test_objects_of_another_framework_are_refused():
    import jax.numpy as jnp

    mp = pa.MixedPrecision("bf16-mixed", framework="torch")
    with pytest.raises(PolyampError, match="drives torch, but loss is a jax object"):
        mp.backward(jnp.ones(()))
    with pytest.raises(PolyampError, match="must be a tensor/model/optimizer"):
        mp.watch(object())


# -- pickling --------------------------------------------------------------------------------------
def train_steps(model, mp, opt, data):
    """Losses and scales of one step per batch (a fresh model's exact trajectory)."""
    out = []
    for x, y in data:
        opt.zero_grad()
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        mp.backward(loss)
        out.append((loss.item(), mp.step(opt).scale))
    return out


def test_a_mixed_precision_pickles_after_a_step_and_trains_on_identically():
    import copy
    import pickle

    model = tiny_model()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu", loss_scale=2.0**15)
    opt = torch.optim.SGD(model.parameters(), 0.05)
    data = list(batches(5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on the CPU is slow
        train_steps(model, mp, opt, data[:2])
        twin_model, twin_opt, twin = pickle.loads(pickle.dumps((model, opt, mp)))  # the repro
        assert copy.deepcopy(mp).state == mp.state and twin.state == mp.state
        assert train_steps(twin_model, twin, twin_opt, data[2:]) == train_steps(model, mp, opt, data[2:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    with pytest.raises(PolyampError, match="already called since the last backward"):
        twin.step(twin_opt)  # the step guard is rebuilt by the first step after unpickling


def test_a_mixed_precision_is_not_pickled_between_unscale_and_step():
    import pickle

    model = tiny_model()
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", device="cpu")
    opt = torch.optim.SGD(model.parameters(), 0.05)
    x, y = next(batches(1))
    mp.backward(nn.functional.mse_loss(model(x), y))
    mp.unscale_(opt)
    with pytest.raises(PolyampError, match="between mp.unscale_.*and mp.step.*pickle it before unscale_"):
        pickle.dumps(mp)
    mp.step(opt)
    assert pickle.loads(pickle.dumps(mp)).state == mp.state


def test_a_recipe_pickles_with_its_histories_and_is_watched_again_after_unpickling():
    import pickle

    from polyamp.recipes import get_recipe

    model = tiny_model()
    mp = pa.MixedPrecision(get_recipe("fp8-delayed", keep=()), framework="torch", device="cpu")
    mp.watch(model)
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    data = list(batches(5))
    train_steps(model, mp, opt, data[:2])
    twin_model, twin_opt, twin = pickle.loads(pickle.dumps((model, opt, mp)))  # a watched model pickles too
    assert twin.state_dict() == mp.state_dict() and twin.recipe_layers == mp.recipe_layers
    with pytest.raises(PolyampError, match="call mp.watch.*after unpickling"):
        twin.autocast()  # the watch binds modules of this process: it does not travel
    twin.watch(twin_model)
    assert train_steps(twin_model, twin, twin_opt, data[2:]) == train_steps(model, mp, opt, data[2:])
    assert twin.state_dict() == mp.state_dict() and mp.state_dict()["recipe"]["state"]["calls"] > 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_scale_on_torch_points_at_the_torch_idiom():
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu")
    with pytest.raises(pa.PolyampError, match=r"In torch: mp.backward\(loss\) .* mp.current_scale reads"):
        mp.scale(torch.tensor(1.0))
