"""The doctor's PyTorch taps (polyamp.torch.doctor) against the numpy core, on real torch."""

import copy
import math
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from frameworks import require
from torch import nn

from polyamp import PolyampError
from polyamp.doctor import KINDS, N_BINS, LogHistogram, Observation, update_ratio_histogram
from polyamp.torch import binning as torch_binning
from polyamp.torch import binning_device
from polyamp.torch import doctor as torch_doctor
from polyamp.torch.binning import histogram, ratio_histogram
from polyamp.torch.doctor import collect


def reference(t: torch.Tensor) -> LogHistogram:
    a = t.detach().cpu()
    if a.dtype == torch.bfloat16:
        return LogHistogram.of(a.float().numpy().astype(ml_dtypes.bfloat16))
    return LogHistogram.of(a.numpy())


def special_values(dtype):
    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    values = [0.0, -0.0, math.inf, -math.inf, math.nan, big, -big, tiny, tiny / 2, tiny / 8, -tiny / 1024]
    if dtype in (torch.float32, torch.float64):
        values += [1e-45, -3e-44, 1.17e-38] if dtype == torch.float32 else [5e-324, 1e-310]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def wide(n, dtype, seed):
    """Random magnitudes over most of the dtype's exponent range, both signs."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    lo, hi = math.log2(info.smallest_normal) - 8, math.log2(info.max) - 1
    e = torch.empty(n, dtype=torch.float64).uniform_(lo, hi, generator=g)
    return (torch.randn(n, generator=g, dtype=torch.float64).sign() * torch.exp2(e)).to(dtype)


@pytest.fixture(params=["torch ops", "compiled", "device ops"])
def path(request, monkeypatch):
    """Bin CPU tensors with torch ops, with the compiled kernel (``doctor/_bin_kernel.py``) from one
    element on, or as an accelerator's tensors are (no host read until the end): the same results."""
    if request.param == "torch ops":
        monkeypatch.setattr(torch_binning, "_COMPILED_MIN", 1 << 62)
    elif request.param == "device ops":
        monkeypatch.setattr(binning_device, "on_accelerator", lambda x: True)
    else:
        if torch_binning._kernel_module() is None:
            if os.environ.get("POLYAMP_REQUIRE_NUMBA") == "1":
                pytest.fail("numba is installed by the Makefile but the binning kernel did not load")
            pytest.skip("numba is not installed in this environment")
        monkeypatch.setattr(torch_binning, "_COMPILED_MIN", 1)
    return request.param


# -- binning on the device equals the numpy core ---------------------------------------------------
def test_only_small_arrays_reach_the_host(monkeypatch, path):
    """The taps move counts and a few scalars, never a whole tensor (CPU here; the same calls on CUDA).
    The compiled kernel reads CPU tensors in place: the arrays it gets are views of torch's memory."""
    seen, arrays = [], []
    if path == "compiled":
        kernel = torch_binning._kernel_module()
        for name in ("values", "weight_and_ratio"):
            original = getattr(kernel, name)

            def recording(*args, _original=original):
                arrays.extend(args)
                return _original(*args)

            monkeypatch.setattr(kernel, name, recording)
    for name in ("cpu", "tolist", "item") if path != "torch ops" else ("cpu", "numpy", "tolist", "item"):
        original = getattr(torch.Tensor, name)

        def spy(self, *args, _original=original, **kwargs):
            seen.append(self.numel())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))  # 8192 weights a layer
    x = torch.randn(256, 64)
    x[0, 0] = 1e-40  # subnormals, zeros and inf take the other branches
    adam = torch.optim.Adam(model.parameters())
    collect(model, (x, torch.randn(256, 64)), nn.functional.mse_loss, optimizer=adam)
    if path == "device ops":  # one read of every binning's vector (LENGTH int64 each), at the end
        reads = [n for n in seen if n > 1]  # (Adam reads its step counts: one element each)
        assert len(reads) == 1 and reads[0] % (N_BINS + 5) == 0
        return
    histogram(torch.tensor([0.0, 1e-41, math.inf] * 5000))
    assert seen and max(seen) <= N_BINS < 64 * 128
    if path == "compiled":
        assert len(arrays) > 10 and not any(a.flags.owndata for a in arrays)


# -- the fast paths: large tensors, threads, a few special elements ---------------------------------
LARGE = 300_000  # 73 rows of _ROW and a tail; past _LARGE (set so below): int16 keys in lanes


@pytest.fixture(params=[1, 3], ids=["1 thread", "3 threads"])
def threads(request, monkeypatch):
    """The taps' view of torch's thread count, and chunks small enough that a LARGE tensor's bincount is
    split over that many."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: request.param)
    monkeypatch.setattr(torch_binning, "_SPLIT", LARGE // 4)
    return request.param


@pytest.fixture(autouse=True)
def large_from(monkeypatch):
    """LARGE tensors take the int16 path (``_LARGE``) while staying quick to test."""
    monkeypatch.setattr(torch_binning, "_LARGE", LARGE - 1000)


def sprinkle(x, values, where):
    x = x.clone()
    x[where] = torch.tensor(values, dtype=torch.float64).to(x.dtype).repeat(len(where))[: len(where)]
    return x


def test_split_bincount_of_int16_lanes_equals_one_plain_bincount(threads):
    g = torch.Generator().manual_seed(8)
    v = torch.randint(0, 2**31 - 1, (LARGE,), generator=g, dtype=torch.int32)
    v[:5000] = torch.randint(0, 2**19, (5000,), generator=g, dtype=torch.int32)  # key 0 in all lanes
    v[-7:] = torch.tensor([0, 1, 2**19 - 1, 2**19, 0x7F800000, 0x7FC00000, 2**31 - 1], dtype=torch.int32)
    with torch_binning.Scratch() as scratch:
        got = torch_binning._keys(v, scratch)
    assert torch.equal(got, torch.bincount(v >> 19, minlength=4096))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_large_tensors_bin_exactly_with_few_or_many_special_values(dtype, threads, path):
    x = wide(LARGE, dtype, seed=9)
    specials = special_values(dtype).tolist()
    few = [3, 70_000, 150_001, LARGE - 2]  # three rows and the tail
    for where in (few, list(range(0, LARGE, 89))):
        t = sprinkle(x, specials, where)
        assert histogram(t) == reference(t), (dtype, len(where))
        for value in (0.0, -0.0, math.inf, math.nan, 1e-45, 1e-40):  # one kind alone
            t = sprinkle(x, [value], where)
            assert histogram(t) == reference(t), (dtype, value, len(where))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_large_tensors_of_normal_values_bin_exactly_from_their_high_halves(dtype, threads, path):
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(LARGE, generator=g) * 0.02).to(dtype)
    tail = x.clone()
    tail[-1] = 1e-4 * float(x.abs().min())  # the least magnitude alone in the tail
    tail[7] = -float(x.abs().max()) * 3  # the largest negative
    same = torch.full((LARGE,), -0.37, dtype=dtype)  # the lowest key in every row
    for t in (x, tail, same, x.reshape(500, 600)[:, ::2]):
        assert histogram(t) == reference(t), (dtype, t.shape)
    few = [11, 200_000, LARGE - 1]
    for values in ([0.0], [-0.0, 0.0, 3.0], [1e-45], [0.0, 1e-45], [1e-40], [0.0] * 3 + [1e-40]):
        t = sprinkle(x, values, few)  # zeros in a few rows and the tail; subnormals (float32) beside them
        assert histogram(t) == reference(t), (dtype, values)


def test_extremes_leave_the_magnitude_bits_as_they_were():
    x = wide(LARGE, torch.float32, seed=10)
    cases = [([0.0], [5, LARGE - 1]), ([math.inf, 0.0], range(0, LARGE, 3)), ([0.0], range(LARGE))]
    for values, where in cases:  # a few in their rows, many, all
        t = sprinkle(x, values, list(where))
        a = t.view(torch.int32) & 0x7FFFFFFF
        kept = a.clone()
        with torch_binning.Scratch() as scratch:
            assert torch_binning.merged([torch_binning._hist_bits(a, scratch)]) == reference(t)
        assert torch.equal(a, kept)


def test_update_ratios_with_few_or_many_special_elements_equal_the_core(threads, path):
    g = torch.Generator().manual_seed(11)
    n = LARGE
    w = torch.randn(n, generator=g) * 0.05
    u = torch.randn(n, generator=g) * 1e-4
    cases = {0: (0.0, 1.0), 9: (1.0, 0.0), 4097: (math.nan, 1.0), 150_000: (1.0, math.inf),
             200_000: (1e-44, 1.0), 250_000: (1.0, 1e-41),
             n - 3: (3e38, 1e-37), n - 1: (1e-37, 3e38)}  # fmt: skip
    for step in (None, 997):  # a few (searched in their rows), then many (one mask)
        uu, ww = u.clone(), w.clone()
        for i, (ui, wi) in cases.items():
            where = slice(i, i + 1) if step is None else slice(i % step, n, step)
            uu[where], ww[where] = ui, wi
        got, want = ratio_histogram(uu, ww), update_ratio_histogram(uu.numpy(), ww.numpy())
        assert got == want, step
        assert got.apart >= 1 and got.nonfinite >= 2 and got.zeros >= 1
    uu, ww = u.clone(), w.clone()
    uu[7], uu[n - 5], ww[n - 5] = 3e38, 2e-38, 1e3  # ratios >= 2^128 and < 2^-126 of normal u and w
    got = ratio_histogram(uu, ww)
    assert got == update_ratio_histogram(uu.numpy(), ww.numpy())
    assert got.counts[-1] == 1 and got.amax > 2.0**128 and got.amin_nonzero < 2.0**-126


@pytest.mark.parametrize("spare", [False, True], ids=["scratch", "spare memory"])
def test_fused_weight_and_update_histograms_equal_the_core(spare, path):
    g = torch.Generator().manual_seed(12)
    before = torch.randn(512, 600, generator=g) * 0.05
    before[3, :7] = 0.0  # a few zero weights: apart
    after = before + torch.randn(512, 600, generator=g) * 1e-4
    after[100, 5:9] = before[100, 5:9]  # lost updates
    want = update_ratio_histogram((after - before).numpy(), before.numpy()), reference(before)
    kept = before.clone()
    spares = (torch.empty_like(before), after) if spare else ()  # the last gradient and working value
    with torch_binning.Scratch() as scratch:
        parts = torch_doctor._update(after, before, scratch, spares)
    update, weight = (torch_binning.merged([part]) for part in reversed(parts))
    assert (update, weight) == want and torch.equal(before, kept)
    assert update.apart == 7 and update.zeros >= 4


def test_the_compiled_weight_and_ratio_pass_equals_the_core_on_every_kind_of_element():
    """Zeros, subnormals, inf and NaN in the weight, in the step and in both; ratios past 2^128."""
    if torch_binning._kernel_module() is None:
        pytest.skip("numba is not installed in this environment")
    specials = special_values(torch.float32)
    for seed in range(3):
        before = wide(40_000, torch.float32, seed=20 + seed)
        step = wide(40_000, torch.float32, seed=30 + seed)
        before[::53] = specials.repeat(80)[: before[::53].numel()]
        step[::47] = specials.repeat(80)[: step[::47].numel()]
        after = before + step
        after[::101] = before[::101]  # lost updates
        weight, ratio = torch_binning.weight_and_ratio(after, before)
        want = update_ratio_histogram((after - before).numpy(), before.numpy())
        assert torch_binning.merged([ratio]) == want and torch_binning.merged([weight]) == reference(before)
        assert want.zeros and want.apart and want.nonfinite and want.counts[-1]


def test_a_stepped_parameter_that_never_moves_has_only_zero_updates(path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].bias[:3] = 0.0
    model[0].requires_grad_(False)  # no gradient: Adam leaves it as it is
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    obs = collect(model, torch.randn(4, 8), lambda out, x: out.pow(2).mean(), optimizer=adam)
    table = {(o.layer, o.kind): o.hist for o in obs}
    moved = table["0", "update_ratio"]
    zero = np.zeros(8 * 8 + 8, np.float32)
    weights = np.concatenate([model[0].weight.detach().numpy().ravel(), model[0].bias.detach().numpy()])
    assert moved == update_ratio_histogram(zero, weights)
    assert moved.zeros == 8 * 8 + 5 and moved.apart == 3


# -- collect: never changes the model or the optimizer ----------------------------------------------
class Net(nn.Module):
    """Parameters at the root and in leaves, a frozen layer, buffers (BatchNorm), dropout."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.25)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.frozen(self.drop(torch.relu(self.bn(self.fc1(x * self.scale))))))


def snapshot(model, optimizer):
    """Everything collect must leave as it found: values bitwise, identities, flags, RNG."""

    def bits(t):
        return t.detach().clone().reshape(-1).view(torch.uint8)

    def deep(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, tuple(v.shape), bits(v).tolist())
        if isinstance(v, dict):
            return {k: deep(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [deep(x) for x in v]
        return v

    return {
        "params": {n: (id(p), p.requires_grad, bits(p).tolist()) for n, p in model.named_parameters()},
        "grads": {n: (id(p.grad), deep(p.grad)) for n, p in model.named_parameters() if p.grad is not None},
        "no grads": sorted(n for n, p in model.named_parameters() if p.grad is None),
        "buffers": {n: (id(b), deep(b)) for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (len(m._forward_hooks), len(m._backward_hooks)) for n, m in model.named_modules()},
        "optimizer": deep(optimizer.state_dict()) if optimizer is not None else None,
        "rng": torch.get_rng_state().tolist(),
    }


def trained_net(steps=3):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    nn.functional.mse_loss(model(x), y).backward()  # leave gradients behind, as a user might
    model.bn.eval()  # a mixed train/eval state to put back
    return model, opt, (x, y)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("with_optimizer", [True, False])
def test_collect_leaves_model_optimizer_and_rng_bitwise_unchanged(steps, with_optimizer):
    model, opt, batch = trained_net()
    assert opt.state  # Adam has state: exp_avg, exp_avg_sq, step
    opt = opt if with_optimizer else None
    before = snapshot(model, opt)
    storage = [(p, p.data_ptr()) for p in model.parameters()]
    state = {id(p): dict(s) for p, s in opt.state.items()} if opt is not None else {}
    obs = collect(model, batch, nn.functional.mse_loss, steps=steps, optimizer=opt)
    assert snapshot(model, opt) == before
    # the optimizer stepped working copies: the parameters' storages and the state's tensors are the same
    assert all(p.data_ptr() == ptr for p, ptr in storage)
    assert all(opt.state[p][k] is v for p in model.parameters() for k, v in state.get(id(p), {}).items())
    kinds = {o.kind for o in obs}
    assert ("update_ratio" in kinds) == with_optimizer


def test_collect_puts_everything_back_when_the_loss_raises():
    model, opt, batch = trained_net()
    before = snapshot(model, opt)
    calls = []

    def failing(out, y):
        calls.append(1)
        if len(calls) == 2:  # the second step: after a real optimizer step
            raise ZeroDivisionError("user loss failed")
        return nn.functional.mse_loss(out, y)

    with pytest.raises(ZeroDivisionError, match="user loss failed"):
        collect(model, batch, failing, steps=3, optimizer=opt)
    assert snapshot(model, opt) == before


def test_collect_with_a_fresh_optimizer_leaves_it_without_state():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.Adam(model.parameters())
    collect(model, torch.randn(8, 4), lambda out, x: (out - x).pow(2).mean(), optimizer=opt)
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_an_lr_scheduler_still_sees_that_the_user_never_stepped_the_optimizer():
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    collect(model, torch.randn(8, 4), lambda out, x: (out - x).pow(2).mean(), optimizer=opt)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        scheduler.step()  # torch warns as it would have without collect: collect's step is not the user's


# -- what collect observes --------------------------------------------------------------------------
def tiny():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def test_observations_equal_the_numpy_core_on_the_same_tensors_in_module_order(path):
    model = tiny()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    obs = collect(model, (x, y), nn.functional.mse_loss)

    # the same step by hand
    ref = copy.deepcopy(model)
    h0 = ref[0](x)
    h1 = ref[1](h0)
    h2 = ref[2](h1)
    for h in (h0, h1, h2):
        h.retain_grad()
    nn.functional.mse_loss(h2, y).backward()

    def merged(*ts):
        hs = [reference(t) for t in ts]
        return hs[0].merge(*hs[1:])

    want = [
        ("0", "output", merged(h0)), ("0", "grad_output", merged(h0.grad)),
        ("0", "weight", merged(ref[0].weight, ref[0].bias)),
        ("0", "grad_weight", merged(ref[0].weight.grad, ref[0].bias.grad)),
        ("1", "output", merged(h1)), ("1", "grad_output", merged(h1.grad)),
        ("2", "output", merged(h2)), ("2", "grad_output", merged(h2.grad)),
        ("2", "weight", merged(ref[2].weight, ref[2].bias)),
        ("2", "grad_weight", merged(ref[2].weight.grad, ref[2].bias.grad)),
    ]  # fmt: skip
    assert [(o.layer, o.kind) for o in obs] == [(layer, kind) for layer, kind, _ in want]
    for o, (_, _, hist) in zip(obs, want):
        assert isinstance(o, Observation) and o.hist == hist, (o.layer, o.kind)


def test_steps_merge_into_one_observation_per_layer_and_kind():
    model = tiny()
    x = torch.randn(16, 8)
    obs = collect(model, (x, torch.zeros(16, 4)), nn.functional.mse_loss, steps=3,
                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # fmt: skip
    pairs = [(o.layer, o.kind) for o in obs]
    assert len(pairs) == len(set(pairs))
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["0", "output"].total == 3 * 16 * 32
    assert table["0", "weight"].total == table["0", "update_ratio"].total == 3 * (8 * 32 + 32)


def test_layer_names_follow_named_modules_and_named_parameters():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Parameter(torch.randn(10, 8))  # owned by a module with children
            self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.head = nn.Linear(8, 10, bias=False)
            self.tied = nn.Linear(10, 8, bias=False)
            self.tied.weight = self.head.weight  # shared: observed once, in head (named_parameters' owner)

        def forward(self, ids):
            return self.head(self.block(self.embed[ids]))

    model = Model()
    ids = torch.randint(0, 10, (4, 5))
    obs = collect(
        model, (ids, ids), lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    )
    layers = list(dict.fromkeys(o.layer for o in obs))
    assert layers == ["embed", "block.0", "block.1", "head"]
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert ("embed", "output") not in table and table["embed", "grad_weight"].zeros > 0  # rows not looked up
    assert table["head", "weight"].total == 80  # the tied weight once
    assert set(o.kind for o in obs) <= set(KINDS)

    single = nn.Linear(3, 1)
    names = {o.layer for o in collect(single, torch.randn(5, 3), lambda out, x: out.pow(2).mean())}
    assert names == {"Linear"}


def test_update_ratios_of_sgd_are_lr_times_grad_over_the_weight():
    model = tiny()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    table = {(o.layer, o.kind): o.hist for o in collect(model, (x, y), nn.functional.mse_loss, optimizer=sgd)}

    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()
    w0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for layer in ("0", "2"):
        names = [f"{layer}.weight", f"{layer}.bias"]
        applied = [update_ratio_histogram((ref.get_parameter(n).detach() - w0[n]).numpy(), w0[n].numpy())
                   for n in names]  # fmt: skip
        assert table[layer, "update_ratio"] == applied[0].merge(applied[1])  # exactly, the update as applied
        # and lr * grad / weight, up to the rounding of w - lr * g to the weight's ulp: a few elements move
        ideal = [update_ratio_histogram(np.float32(0.1) * ref.get_parameter(n).grad.numpy(), w0[n].numpy())
                 for n in names]  # fmt: skip
        ideal = ideal[0].merge(ideal[1])
        got = table[layer, "update_ratio"]
        assert got.total == ideal.total and got.apart == ideal.apart == 0
        assert np.abs(np.cumsum(got.counts) - np.cumsum(ideal.counts)).max() <= 0.01 * got.total
        assert math.isclose(got.amax, ideal.amax, rel_tol=1e-3)


def test_nonfinite_outputs_are_observed_not_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e38)
    obs = collect(model, torch.ones(2, 4), lambda out, x: out.mean())
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["0", "output"].nonfinite == 8 and table["1", "output"].nonfinite == 2


def test_batch_forms_and_a_loss_returned_by_the_model():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x, y=None):
            out = self.fc(x)
            return {"loss": (out - y).pow(2).mean(), "out": out} if y is not None else out

    model, x, y = WithLoss(), torch.randn(5, 3), torch.randn(5, 1)
    by_dict = collect(model, {"x": x, "y": y})  # model(**batch); the loss is the output's "loss"
    by_args = collect(model, ((x, y), None), lambda out, _: out["loss"])  # model(*inputs)
    assert [(o.layer, o.kind, o.hist) for o in by_dict] == [(o.layer, o.kind, o.hist) for o in by_args]
    assert len(collect(model, x, lambda out, batch: out.pow(2).mean())) == 4  # model(batch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_bin_the_same_as_on_cpu():
    x = wide(100000, torch.float32, seed=6)
    x[::101] = special_values(torch.float32).repeat(100)[: x[::101].numel()]
    assert histogram(x.cuda()) == reference(x)
    w = torch.randn(5000) * 0.1
    u = torch.randn(5000) * 1e-4
    u[::7] = 0
    assert ratio_histogram(u.cuda(), w.cuda()) == update_ratio_histogram(u.numpy(), w.numpy())
    model = tiny().cuda()
    obs = collect(model, torch.randn(8, 8, device="cuda"), lambda out, x: out.pow(2).mean(),
                  optimizer=torch.optim.Adam(model.parameters()))  # fmt: skip
    assert {o.kind for o in obs} == set(KINDS)


# -- bad input: one clear PolyampError each ---------------------------------------------------------
def mse(out, y):
    return nn.functional.mse_loss(out, y)


@pytest.mark.parametrize(
    "case, match",
    [
        (lambda m, b: collect(nn.ReLU(), b, mse), "no parameters"),
        (lambda m, b: collect(m.requires_grad_(False), b, mse), "no parameter that requires grad"),
        (lambda m, b: collect(m, b, mse, steps=0), "steps must be a whole number >= 1, got 0"),
        (lambda m, b: collect(m, b, mse, steps=1.0), "steps must be a whole number"),
        (lambda m, b: collect(m, b, mse, steps=True), "steps must be a whole number"),
        (lambda m, b: collect(m, (b[0].numpy(), b[1]), mse), "expected torch tensors, got numpy.ndarray"),
        (lambda m, b: collect(m, b[0].numpy(), mse), "expected torch tensors"),
        (lambda m, b: collect(m, (b[0], b[1], b[1]), mse), r"\(inputs, targets\) pair"),
        (lambda m, b: collect(m, (torch.randn(16, 5), b[1]), mse), r"forward failed.*\(16, 5\)"),
        (lambda m, b: collect(m, b, lambda out, y: (out - y) ** 2), r"scalar .*shape \(16, 4\)"),
        (lambda m, b: collect(m, b, lambda out, y: 1.0), "loss tensor, got builtins.float"),
        (lambda m, b: collect(m, b[0]), r"the model \(loss_fn=None\) must return a scalar"),
        (lambda m, b: collect(m, b, lambda out, y: out.detach().sum()), "does not depend"),
        (lambda m, b: collect(m, b, "mse"), "loss_fn must be callable"),
        (lambda m, b: collect(m, b, mse, optimizer=object()), "optimizer: expected a torch.optim.Optimizer"),
        (lambda m, b: collect(m.state_dict(), b, mse), "model: expected a torch.nn.Module"),
    ],
)
def test_bad_input_is_one_clear_error(case, match):
    model, batch = tiny(), (torch.randn(16, 8), torch.randn(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PolyampError, match=match):
        case(model, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_batch_of_another_framework_is_refused():
    tf = require("tensorflow")
    with pytest.raises(PolyampError, match="torch tensors, got tensorflow.python.framework.ops.EagerTensor"):
        collect(tiny(), (tf.zeros((2, 8)), torch.zeros(2, 4)), mse)
    jnp = require("jax").numpy
    with pytest.raises(PolyampError, match="expected torch tensors, got jax"):
        collect(tiny(), {"x": jnp.ones((2, 8))}, mse)


def test_fp8_tensors_are_widened_exactly():
    x = wide(3000, torch.float32, seed=7).clamp(-400, 400)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = x.to(dtype)
        assert histogram(t) == reference(t.float())
    with pytest.raises(PolyampError, match="cannot bin a torch.int32 tensor"):
        histogram(torch.ones(3, dtype=torch.int32))


def test_batched_binning_on_an_accelerator_equals_the_core_tensor_by_tensor():
    """``binning_device.values_many`` / ``ratio_many`` (one set of kernels for many tensors), run here on
    CPU tensors: each tensor's vector is its own histogram."""
    xs = [wide(1000, torch.float32, 1), special_values(torch.float32), torch.zeros(3),
          wide(4097, torch.float16, 2), torch.tensor([5e-42])]  # fmt: skip
    for x, part in zip(xs, binning_device.values_many(xs)):
        assert torch_binning.merged([part]) == reference(x)
    ws = [wide(500, torch.float32, 3), torch.tensor([0.0, 1.0, math.inf, 1e-41, 3e38, 2.0])]
    us = [wide(500, torch.float32, 4) * 1e-3, torch.tensor([1.0, 0.0, 1.0, 1e30, 1e-30, math.nan])]
    for u, w, part in zip(us, ws, binning_device.ratio_many(us, ws)):
        assert torch_binning.merged([part]) == update_ratio_histogram(u.numpy(), w.numpy())


def test_recipe_tables_measure_only_what_the_torch_recipe_quantizes():
    import polyamp as pa
    from polyamp.doctor import blocks as B

    conv1d = require("transformers").pytorch_utils.Conv1D
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), conv1d(24, 32), nn.GELU(), nn.Linear(24, 3))
    batch = (torch.randn(6, 8), torch.randn(6, 3))
    report = pa.doctor(model, batch, nn.functional.mse_loss, formats=("bf16", "recipe:mxfp8", "mxfp8_e4m3"))
    recipe = {(r.layer, r.kind) for r in report.rows if "recipe:mxfp8" in r.measured}
    # weights and output gradients of the three GEMM layers; the inputs a leaf produced (LayerNorm's output
    # into the Conv1D, GELU's into the last Linear); not LayerNorm's weight, not the model's input
    assert recipe == {*((n, k) for n in ("0", "2", "4") for k in ("weight", "grad_output")),
                      ("1", "output"), ("3", "output")}  # fmt: skip
    blocks = {(r.layer, r.kind) for r in report.rows if "mxfp8_e4m3" in r.measured}
    assert ("1", "weight") in blocks and ("0", "output") in blocks  # a block format measures every tensor
    row = next(r for r in report.rows if (r.layer, r.kind) == ("2", "weight"))
    cast = B.parse("recipe:mxfp8").casts["weight"]
    want = B.measure(model[2].weight.detach().numpy().T, cast).to_json()  # (in, out): in the GEMM's layout
    assert row.measured["recipe:mxfp8"] == pytest.approx(want)
    lin = next(r for r in report.rows if (r.layer, r.kind) == ("0", "weight"))
    assert lin.measured["recipe:mxfp8"]["total"] == model[0].weight.numel()  # the bias is not quantized
