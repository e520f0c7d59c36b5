"""torch: the step refuses what would silently train wrong, and says what it knows when it skips."""

import math
import warnings

import pytest
import torch
from torch import nn

import polyamp as pa
from polyamp import NonFiniteError, PolyampError


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def loss_of(model, mp=None):
    x, y = data()
    if mp is None:
        return nn.functional.mse_loss(model(x), y)
    with mp.autocast():
        return nn.functional.mse_loss(model(x).float(), y)


# -- sparse gradients --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.inf, math.nan, "coalesced overflow"])
def test_a_nonfinite_sparse_gradient_is_skipped_and_named(bad):
    """A dense parameter with an uncoalesced sparse gradient: GradScaler finds the inf and skips;
    so must polyamp (it crashed in torch.isfinite on a sparse tensor)."""
    dtype = torch.float16 if bad == "coalesced overflow" else torch.float32
    weight = nn.Parameter(torch.zeros(2, 3, dtype=dtype))
    values = [[64000.0] * 3, [64000.0] * 3] if bad == "coalesced overflow" else [[bad, 1.0, 1.0], [1.0] * 3]
    weight.grad = torch.sparse_coo_tensor([[0, 0]], torch.tensor(values, dtype=dtype), (2, 3))
    assert not weight.grad.is_coalesced()
    opt = torch.optim.SGD([weight], lr=1.0)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale=4.0)
    mp._backwards = 1  # as after mp.backward: the sparse gradient above stands for its result
    result = mp.step(opt)
    assert not result.stepped and result.nonfinite == ("param[0]",)
    assert torch.equal(weight.detach(), torch.zeros(2, 3, dtype=dtype))


def test_a_sparse_embedding_overflow_is_skipped_like_gradscaler():
    results = {}
    for who in ("polyamp", "gradscaler"):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)
        loss = emb(torch.tensor([1, 1, 2])).sum() * 3e34  # x 2^16 (the scale) overflows float32
        before = emb.weight.detach().clone()
        if who == "polyamp":
            mp = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale="torch")
            mp.watch(emb)
            mp.backward(loss)
            assert not emb.weight.grad.is_coalesced()
            r = mp.step(opt)
            results[who] = (r.stepped, r.scale, r.nonfinite)
        else:
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            results[who] = (not torch.equal(before, emb.weight.detach()), scaler.get_scale(), ("weight",))
        assert torch.equal(before, emb.weight.detach())
    assert results["polyamp"] == results["gradscaler"] == (False, 2.0**15, ("weight",))


# -- one step per backward -----------------------------------------------------------------------------
def test_a_second_step_after_one_backward_is_refused_and_changes_nothing():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    mp.backward(loss_of(model, mp))
    assert mp.step(opt).stepped
    before = [p.detach().clone() for p in model.parameters()]
    state = mp.state
    with pytest.raises(PolyampError, match="step\\(\\) was already called since the last backward"):
        mp.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and mp.state == state
    opt.zero_grad()
    mp.backward(loss_of(model, mp))
    assert mp.step(opt).stepped


@pytest.mark.parametrize("policy", ["bf16-mixed", "float32"])
def test_a_second_step_is_refused_without_loss_scaling_too(policy):
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = pa.MixedPrecision(policy, framework="torch")
    loss_of(model, mp).backward()  # a plain backward is fine where the scale is 1
    assert mp.step(opt).stepped
    with pytest.raises(PolyampError, match="already called"):
        mp.step(opt)
    loss_of(model, mp).backward()  # accumulates into the same tensors: new gradients
    assert mp.step(opt).stepped


def test_a_plain_backward_under_a_loss_scale_is_refused():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    loss_of(model, mp).backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(PolyampError, match=r"did not come from mp.backward\(loss\).*65536"):
        mp.step(opt)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    assert mp.state.steps == 0


# -- unscale_: user code between unscale and step ------------------------------------------------------
def test_unscale_then_custom_clipping_matches_gradscaler():
    ours, native = tiny_model(), tiny_model()
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.5)
    opt_n = torch.optim.SGD(native.parameters(), lr=0.5)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale="torch", device="cpu")
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(3):
        opt_o.zero_grad()
        opt_n.zero_grad()
        mp.backward(loss_of(ours))
        scaler.scale(loss_of(native)).backward()
        assert mp.unscale_(opt_o) is True
        scaler.unscale_(opt_n)
        for a, b in zip(ours.parameters(), native.parameters()):
            assert torch.equal(a.grad, b.grad)  # unscaled alike, readable by user code
        nn.utils.clip_grad_value_(ours.parameters(), 0.01)
        nn.utils.clip_grad_value_(native.parameters(), 0.01)
        assert mp.step(opt_o).stepped
        scaler.step(opt_n)
        scaler.update()
    for a, b in zip(ours.parameters(), native.parameters()):
        assert torch.equal(a, b)


def test_unscale_twice_is_refused_and_an_overflow_found_there_skips():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    mp.backward(loss_of(model))
    model[0].weight.grad[0, 0] = math.inf
    assert mp.unscale_(opt) is False
    scaled_once = model[2].weight.grad.clone()
    with pytest.raises(PolyampError, match="unscale_\\(\\) was already called"):
        mp.unscale_(opt)
    assert torch.equal(model[2].weight.grad, scaled_once)
    before = [p.detach().clone() for p in model.parameters()]
    result = mp.step(opt)
    assert not result.stepped and result.scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# -- "true" policies mean what they say ------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "dtype"), [("bf16-true", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                               ("fp16-true", torch.float16), ("half", torch.float16)])
def test_true_policies_cast_the_model_and_train_in_the_low_dtype(policy, dtype):
    model = tiny_model()
    mp = pa.MixedPrecision(policy, framework="torch", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on CPU is slow, and says so
        assert mp.watch(model) is model
        assert {p.dtype for p in model.parameters()} == {dtype}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        with mp.autocast():
            out = model(data()[0])  # float32 input, low-precision weights
        assert out.dtype == dtype
        mp.backward(nn.functional.mse_loss(out.float(), data()[1]))
        assert mp.step(opt).stepped
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_true_policy_refuses_float32_parameters():
    model = tiny_model()
    mp = pa.MixedPrecision("bf16-true", framework="torch")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.backward(loss_of(model))
    with pytest.raises(PolyampError, match=r"in bfloat16, but a \(16, 8\) parameter is float32"):
        mp.step(opt)
    assert mp.state.steps == 0


# -- what a skip says --------------------------------------------------------------------------------------
def test_without_debug_the_error_names_the_nonfinite_gradients_not_an_origin():
    model = tiny_model()
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", loss_scale=pa.NoLossScale(3))
    mp.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(3):
            opt.zero_grad()
            mp.backward(loss_of(model, mp))
            model[2].bias.grad[0] = math.nan
            if i < 2:
                result = mp.step(opt)
                assert result.origin is None and result.nonfinite == ("2.bias",)
        with pytest.raises(NonFiniteError) as err:
            mp.step(opt)
    message = str(err.value)
    assert "'2.bias'" in message and "'0.weight'" not in message and "debug=True" in message
    assert "train in bf16" not in message  # already bf16: that advice would not fit


def test_debug_without_watch_is_refused():
    model = tiny_model()
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", debug=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.backward(loss_of(model, mp))
    with pytest.raises(PolyampError, match="debug=True .* call mp.watch\\(model\\)"):
        mp.step(opt)


@pytest.mark.parametrize("policy", ["bf16-mixed", "float32"])
def test_the_first_skip_without_loss_scaling_warns_once(policy):
    model = tiny_model()
    mp = pa.MixedPrecision(policy, framework="torch")
    mp.watch(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            mp.backward(loss_of(model, mp))
            if step in (1, 2):
                model[0].weight.grad[0, 0] = math.inf
            mp.step(opt)
    skips = [w for w in caught if "a step was skipped" in str(w.message)]
    assert len(skips) == 1 and "'0.weight'" in str(skips[0].message) and "debug=True" in str(skips[0].message)


def test_an_fp16_skip_is_expected_and_does_not_warn():
    model = tiny_model()
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mp.backward(loss_of(model))
    model[0].weight.grad[0, 0] = math.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not mp.step(opt).stepped


# -- arguments and framework detection ------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"guard": "yes"}, "guard must be True or False; received 'yes'"),
    ({"debug": 1}, "debug must be True or False; received 1"),
    ({"device": 0}, "device must be a string"),
    ({"device": "tpu:9", "framework": "torch"}, "torch does not know the device 'tpu:9'"),
    ({"framework": "caffe"}, "unknown framework 'caffe'"),
])
def test_bad_constructor_arguments_are_refused(kwargs, match):
    with pytest.raises(PolyampError, match=match):
        pa.MixedPrecision("bf16-mixed", **kwargs)


@pytest.mark.parametrize("alias", ["pytorch", "PyTorch", "torch"])
def test_framework_aliases(alias):
    assert pa.MixedPrecision("bf16-mixed", framework=alias).framework == "torch"
    with pytest.raises(PolyampError, match="did you mean 'pytorch'"):
        pa.MixedPrecision("bf16-mixed", framework="pytroch")


def test_the_readme_snippet_works_with_tensorflow_and_jax_imported_too():
    """The framework is found from the objects handed over (and autocast() is torch's idiom)."""
    import jax  # noqa: F401
    import tensorflow  # noqa: F401

    model = tiny_model()
    mp = pa.MixedPrecision("bf16-mixed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mp.autocast():
        loss = loss_of(model)
    assert mp.framework == "torch"
    mp.backward(loss)
    assert mp.step(opt).stepped


# -- checkpoints ------------------------------------------------------------------------------------------
def test_loading_keeps_this_runs_settings_and_says_which_differ():
    seven = pa.DynamicLossScale(growth_interval=7)
    saved = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale=seven)
    saved.state = saved.loss_scale.update(saved.state, False)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch")
    with pytest.warns(RuntimeWarning, match="growth_interval=7 -> 2000"):
        mp.load_state_dict(saved.state_dict())
    assert mp.state == saved.state and mp.loss_scale.growth_interval == 2000
    same = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale=seven)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved.state_dict())


def test_a_gradscaler_checkpoint_loads_and_a_polyamp_one_goes_back():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 3})
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", loss_scale=pa.DynamicLossScale.preset(
        "torch", growth_interval=7))  # fmt: skip
    mp.load_state_dict(scaler.state_dict())
    assert (mp.current_scale, mp.state.good_steps) == (1024.0, 3)
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(mp.state_dict(native="torch"))
    assert back.get_scale() == 1024.0 and back.get_growth_interval() == 7
    with pytest.raises(PolyampError, match="holds a dynamic loss scale, but this run has NoLossScale"):
        pa.MixedPrecision("bf16-mixed", framework="torch").load_state_dict(scaler.state_dict())
