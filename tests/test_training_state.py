"""Low-precision training state: the policy grammar, the state codes (numpy), torch's LowPrecisionOptimizer
and JAX's low_precision transformation, held to torchao's and bitsandbytes' own tests where they have one."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import polyamp as pa
from polyamp import training_state as ts
from polyamp.numerics import state_codes, xp

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jnp = jax.numpy
nn = torch.nn

from polyamp.jax import low_precision  # noqa: E402
from polyamp.torch import LowPrecisionOptimizer  # noqa: E402


# -- the grammar -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, name, update, states", [
    ("bf16-true:sr", "bf16-true:sr", "sr", None),
    ("BF16-TRUE:update=kahan,states=INT8", "bf16-true:kahan,states=int8", "kahan", "int8"),
    ("bf16-mixed:states=fp8", "bf16-mixed:states=fp8", "nearest", "fp8"),
    ("fp16-true:sr,states=bf16", "fp16-true:sr,states=bf16", "sr", "bf16"),
])  # fmt: skip
def test_policy_options_parse_and_print(spec, name, update, states):
    p = pa.Policy.parse(spec)
    assert (p.name, p.state.update, p.state.states) == (name, update, states)
    assert pa.Policy.parse(p.name) == p and p.base_name == name.partition(":")[0]
    assert pa.Policy.parse("bf16-true").state is None


@pytest.mark.parametrize("spec, words", [
    ("float32:sr", ["'float32:sr'", "float32", "bfloat16 or float16"]),
    ("bf16-mixed:kahan", ["bf16-mixed:kahan", "float32"]),
    ("bf16-true:states=int4", ["int4", "did you mean 'int8'", "fp32, bf16, fp8, int8"]),
    ("bf16-true:stochastic", ["'stochastic'", "nearest, sr, kahan"]),
])  # fmt: skip
def test_bad_policy_options_name_what_is_accepted(spec, words):
    with pytest.raises(pa.PolyampError) as err:
        pa.Policy.parse(spec)
    assert all(w in str(err.value) for w in words), str(err.value)


# -- the codes, held to bitsandbytes' test_dynamic_blockwise_quantization (blocksize 256, CPU: 10 iterations)
def _round_trip(a, form, signed=True):
    return state_codes.decode(xp, state_codes.encode(xp, a, form, signed), form, a.shape, signed)


def test_int8_block_codes_meet_bitsandbytes_error_bounds():
    """bitsandbytes tests/test_functional.py (Test8BitBlockwiseQuantizeFunctional): randn with the default
    (signed) map: mean abs error < 0.011, mean relative < 0.018; rand with the signed map: < 0.0036 / 0.015;
    rand with the unsigned map: < 0.0023 / 0.012."""
    rng = np.random.default_rng(0)
    cases = [(lambda: rng.standard_normal((1024, 1024), dtype=np.float32), True, 0.011, 0.018),
             (lambda: rng.random((1024, 1024), dtype=np.float32), True, 0.0036, 0.015),
             (lambda: rng.random((1024, 1024), dtype=np.float32), False, 0.0023, 0.012)]  # fmt: skip
    for draw, signed, abs_bound, rel_bound in cases:
        abs_err, rel_err = [], []
        for _ in range(10):
            a = draw()
            d = np.abs(a - _round_trip(a, "int8", signed))
            abs_err.append(d.mean())
            rel_err.append((d / np.abs(a + 1e-8)).mean())
        assert np.mean(abs_err) < abs_bound and np.mean(rel_err) < rel_bound, (signed, abs_err, rel_err)


def test_int8_codes_are_the_nearest_table_entry_of_each_block():
    """torchao's test_quantize_8bit_with_qmap_correctness: the code is argmin |x / amax - table|."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal(3 * 256 + 17).astype(np.float32)
    a[256:512] = 0  # an all-zero block
    stored = state_codes.encode(xp, a, "int8")
    table = state_codes.dynamic_map(True)
    blocks = np.pad(a, (0, -a.size % 256)).reshape(-1, 256)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    normed = blocks / np.where(amax > 0, amax, 1)
    want = np.abs(normed[..., None] - table).argmin(-1)
    assert np.array_equal(stored["codes"], want.reshape(-1)[: a.size]) and stored["codes"].dtype == np.uint8
    assert np.array_equal(stored["scale"], amax)
    assert np.array_equal(_round_trip(a, "int8")[256:512], np.zeros(256, np.float32))
    assert table.size == 256 and np.all(np.diff(table) > 0) and table[0] == -table[-2] and table[-1] == 1
    for signed in (True, False):  # the look-up's claim at every midpoint and its float32 neighbours
        t = state_codes.dynamic_map(signed)
        mids = (t[:-1] + t[1:]) / np.float32(2)
        v = np.concatenate([mids, np.nextafter(mids, np.float32(2)), np.nextafter(mids, np.float32(-2)), t])
        base, mid = state_codes._nearest_lookup(signed)
        k = v.view(np.uint32) >> 16
        assert np.array_equal(base[k] + (v > mid[k]), np.searchsorted(mids, v, side="left"))


def test_fp8_codes_are_e4m3_nearest_even_of_each_block_at_amax_over_448():
    rng = np.random.default_rng(2)
    a = (rng.standard_normal(1000) * np.logspace(-6, 3, 1000)).astype(np.float32)
    stored = state_codes.encode(xp, a, "fp8")
    blocks = np.pad(a, (0, -a.size % 256)).reshape(-1, 256)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(448)
    want = np.minimum(np.abs(blocks / scale), 448) * np.sign(blocks)
    codes = stored["codes"].astype(np.float32)
    assert np.array_equal(codes, pa.quantize(want, "e4m3fn").astype(np.float32).reshape(-1)[: a.size])
    assert np.array_equal(stored["scale"], scale)
    assert state_codes.nbytes("fp8", a.size) == 1000 + 4 * 4
    assert np.abs(_round_trip(a, "fp8") - a).max() <= np.abs(a).max() * 2.0**-4


# -- torch ------------------------------------------------------------------------------------------------
def _torchao_scenario(update):
    """torchao test/test_low_bit_optim.py::test_optim_bf16_stochastic_round_correctness, transcribed: an
    fp32 AdamW(lr=1e-5) model under bf16 autocast and its bf16 copy stepped with SR; the losses of 5
    iterations on one batch agree (torch.testing.assert_close at bf16's tolerance)."""
    torch.manual_seed(2024)
    model1 = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 128))
    model2 = copy.deepcopy(model1).bfloat16()
    optim1 = torch.optim.AdamW(model1.parameters(), lr=1e-5)
    optim2 = LowPrecisionOptimizer(torch.optim.AdamW(model2.parameters(), lr=1e-5), update=update)
    x = torch.randn(4, 32)
    for idx in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss1 = model1(x)
        loss1 = loss1.sum()
        loss1.backward()
        optim1.step()
        optim1.zero_grad()
        loss2 = model2(x.bfloat16()).sum()
        loss2.backward()
        optim2.step()
        optim2.zero_grad()
        torch.testing.assert_close(loss1, loss2, msg=lambda msg, idx=idx: f"Iteration {idx}. {msg}")


def test_torch_sr_passes_torchaos_bf16_stochastic_round_correctness():
    _torchao_scenario("sr")


def test_torch_nearest_fails_torchaos_scenario_as_its_comment_says():
    """"when bf16_stochastic_round=False, the test will fail after 1 iteration"."""
    with pytest.raises(AssertionError, match="Iteration 1"):
        _torchao_scenario("nearest")


def _steps(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.to(p.dtype)
        opt.step()


def test_torch_sr_write_back_is_polyamp_quantize_of_the_fp32_step_and_unbiased():
    """SGD(lr=1): ``y = w - g``; the new weight is quantize(y, 'bf16', 'stochastic', seed) with the seed
    ``seed + step * n + i``, and over many seeds its mean is y."""
    w0 = torch.tensor(np.linspace(1, 2, 4096, dtype=np.float32)).bfloat16()
    g = torch.full((4096,), 1e-3)
    means = []
    for seed in range(64):
        p = nn.Parameter(w0.clone())
        opt = LowPrecisionOptimizer(torch.optim.SGD([p], lr=1.0), update="sr", seed=seed)
        _steps(opt, [p], [[g]])
        y = w0.float() - g.bfloat16().float()
        want = pa.quantize(y, "bf16", rounding="stochastic", seed=ts.step_seed(seed, 0, 1, 0))
        assert torch.equal(p.detach().float(), want)
        means.append(p.detach().double())
    y = w0.double() - g.bfloat16().double()
    bias = (torch.stack(means) - y).mean()  # 262144 draws: its standard error is about 5e-6
    assert abs(float(bias)) < 5e-5 < 1e-3  # nearest keeps w0: a bias of g = 1e-3


def test_torch_kahan_tracks_fp32_adam_where_nearest_loses_every_update():
    torch.manual_seed(0)
    w0 = (torch.randn(2000).abs() + 0.5).bfloat16()  # half an ulp >= 2^-10: above every update of 1e-5
    grads = [[torch.randn(2000)] for _ in range(30)]
    ref = nn.Parameter(w0.float())
    _steps(torch.optim.Adam([ref], lr=1e-5), [ref], grads)
    out = {}
    for update in ("kahan", "nearest"):
        p = nn.Parameter(w0.clone())
        opt = LowPrecisionOptimizer(torch.optim.Adam([p], lr=1e-5), update=update)
        _steps(opt, [p], grads)
        comp = opt._comp[0].float() if update == "kahan" else 0
        out[update] = ((p.detach().float() + comp) - ref.detach()).abs().max()
        if update == "nearest":
            assert torch.equal(p.detach(), w0)  # 30 updates of 1e-5 each, all below half an ulp
    moved = (ref.detach() - w0.float()).abs().max()
    # Kahan's error is c's own bf16 rounding (2^-9 of c, |c| <= half an ulp); nearest's is every update
    assert out["kahan"] < moved / 20 and out["nearest"] > moved / 2, (out, float(moved))


@pytest.mark.parametrize("states", ["bf16", "fp8", "int8"])
def test_torch_low_states_train_and_take_their_bytes(states):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).bfloat16()
    opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), update="sr", states=states)
    x, w = torch.randn(512, 64), torch.randn(64, 1)
    y = (x @ w).bfloat16()
    losses = []
    for _ in range(60):
        loss = (model(x.bfloat16()) - y).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.25 * losses[0], losses[::10]
    n = sum(p.numel() for p in model.parameters())
    moments = sum(state_codes.nbytes(states, p.numel()) for p in model.parameters()) * 2
    steps = 4 * len(list(model.parameters()))  # Adam's float32 step counters
    assert opt.state_bytes() == {"moments": moments + steps, "compensation": 0}
    assert moments <= {"bf16": 4, "fp8": 2.2, "int8": 2.2}[states] * n
    kinds = {k: type(v) for low in opt._low.values() for k, v in low.items()}
    assert set(kinds) == {"exp_avg", "exp_avg_sq"}


def test_torch_compiled_cpu_paths_equal_the_ops_route():
    """The numba kernels LowPrecisionOptimizer takes on the CPU give the ops route's values (NaN: NaN)."""
    from polyamp.torch import low_optim
    from polyamp.torch import xp as torch_xp

    rng = np.random.default_rng(3)
    y = np.concatenate([rng.standard_normal(70001) * 10.0 ** rng.uniform(-45, 38, 70001),
                        [0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.39e38, 1e-40, 3.39e38]])  # fmt: skip
    y = torch.tensor(y.astype(np.float32))

    def same(a, b):
        return bool(((a.float() == b.float()) | (a.float().isnan() & b.float().isnan())).all())

    assert state_codes.compiled() is not None  # POLYAMP_REQUIRE_NUMBA: the suite runs with numba
    for seed in (0, 9, 2**31 + 1):
        want = pa.quantize(y, "bf16", rounding="stochastic", seed=seed)
        assert same(low_optim._stochastic(y, torch.bfloat16, seed), want)
    w = nn.Parameter(torch.zeros(y.shape, dtype=torch.bfloat16))
    with torch.no_grad():
        comp = low_optim._kahan(w, y)
    assert same(w.detach(), y.to(torch.bfloat16)) and same(comp, (y - w.detach().float()).to(torch.bfloat16))
    assert same(low_optim._widen(w.detach()), w.detach().float())
    assert same(low_optim._widen(w.detach(), comp), w.detach().float() + comp.float())
    m = torch.tensor((rng.standard_normal(5000) * np.logspace(-9, 1, 5000)).astype(np.float32))
    for signed in (True, False):
        v = m if signed else m.abs()
        ops = state_codes.encode(torch_xp, v, "int8", signed)
        fast = low_optim._encode(v, "int8", signed)
        assert torch.equal(ops["codes"], fast["codes"]) and torch.equal(ops["scale"], fast["scale"])
        assert torch.equal(low_optim._decode(fast, "int8", v, signed),
                           state_codes.decode(torch_xp, ops, "int8", tuple(v.shape), signed))  # fmt: skip


CHECKPOINT = textwrap.dedent("""
    import sys, torch
    from polyamp.torch import LowPrecisionOptimizer

    def build(update, states):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)).bfloat16()
        opt = LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), update=update,
                                    states=states, seed=7)
        return model, opt

    def train(model, opt, n):
        for _ in range(n):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + opt.steps)).bfloat16()
            model(x).float().pow(2).mean().backward()
            opt.step(); opt.zero_grad()

    if __name__ == "__main__":  # load each checkpoint named on the command line, train on, compare
        for path in sys.argv[1:]:
            ck = torch.load(path)
            model, opt = build(ck["update"], ck["states"])
            model.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
            train(model, opt, 3)
            print(all(torch.equal(v, ck["after"][k]) for k, v in model.state_dict().items()))
""")


def test_torch_checkpoint_resumes_bit_identically_in_a_new_process(tmp_path):
    """(sr, int8) and (kahan, fp8): 3 steps, a checkpoint, 3 more steps here; a new process loads the
    checkpoint and its 3 steps give the same bits."""
    script = tmp_path / "ck.py"
    script.write_text(CHECKPOINT)
    space: dict = {}
    exec(compile(CHECKPOINT, str(script), "exec"), space)
    paths = []
    for update, states in (("sr", "int8"), ("kahan", "fp8")):
        model, opt = space["build"](update, states)
        space["train"](model, opt, 3)
        ck = {"update": update, "states": states, "model": copy.deepcopy(model.state_dict()),
              "opt": copy.deepcopy(opt.state_dict())}  # fmt: skip
        space["train"](model, opt, 3)
        paths.append(str(tmp_path / f"{update}.pt"))
        torch.save({**ck, "after": model.state_dict()}, paths[-1])
    out = subprocess.run([sys.executable, str(script), *paths], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr


def test_torch_bad_input_is_one_clear_error_each():
    p32 = nn.Parameter(torch.zeros(3))
    with pytest.raises(pa.PolyampError, match=r"update='sr' rounds 16-bit weights.*float32"):
        LowPrecisionOptimizer(torch.optim.SGD([p32], lr=0.1), update="sr")
    with pytest.raises(pa.PolyampError, match="unknown optimizer-state form 'int4'"):
        LowPrecisionOptimizer(torch.optim.SGD([p32], lr=0.1), states="int4")
    with pytest.raises(pa.PolyampError, match="LBFGS keeps one history"):
        LowPrecisionOptimizer(torch.optim.LBFGS([p32]), states="int8")
    with pytest.raises(pa.PolyampError, match="wraps a torch.optim.Optimizer"):
        LowPrecisionOptimizer([p32], states="int8")
    opt = LowPrecisionOptimizer(torch.optim.SGD([p32], lr=0.1), states="int8")
    other = LowPrecisionOptimizer(torch.optim.SGD([p32], lr=0.1), states="fp8")
    with pytest.raises(pa.PolyampError, match="written with update='nearest', states='int8'"):
        other.load_state_dict(opt.state_dict())
    mp = pa.MixedPrecision("bf16-true:sr", framework="torch")
    with pytest.raises(pa.PolyampError, match=r"mp.optimizer\(optimizer\)"):
        mp.step(torch.optim.SGD([nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], lr=0.1))


def test_torch_policy_trains_through_mp_step_and_skips_a_nonfinite_step():
    mp = pa.MixedPrecision("bf16-true:sr,states=int8", framework="torch")
    model = mp.watch(nn.Linear(8, 4))
    opt = mp.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert isinstance(opt, LowPrecisionOptimizer) and (opt.update, opt.states) == ("sr", "int8")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    x = torch.randn(16, 8)
    with mp.autocast():
        loss = model(x).float().pow(2).mean()
    mp.backward(loss)
    assert mp.step(opt).stepped and opt.steps == 1
    opt.zero_grad()
    sched.step()
    before = [p.detach().clone() for p in model.parameters()]
    mp.backward(model(x.bfloat16()).float().sum() * float("inf"))
    assert not mp.step(opt).stepped and opt.steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.param_groups[0]["lr"] == 5e-3


# -- JAX --------------------------------------------------------------------------------------------------
def _jax_run(update, states, grads, params, seed=0):
    tx = low_precision(optax.adam(1e-2), update=update, states=states, seed=seed)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in grads:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_jax_sr_is_polyamp_quantize_of_the_fp32_step_through_optax_apply_updates():
    """SGD(lr=1) under jit: the new bf16 leaf is quantize(w - g, 'bf16', 'stochastic', seed + step*n + i),
    the same bits as the core (and as torch's LowPrecisionOptimizer)."""
    w0 = {"a": jnp.linspace(1, 2, 3000).astype(jnp.bfloat16),
          "b": -jnp.linspace(1, 3, 70).astype(jnp.bfloat16)}
    g = {"a": jnp.full(3000, 1e-3, jnp.bfloat16), "b": jnp.full(70, 3e-3, jnp.bfloat16)}
    tx = low_precision(optax.sgd(1.0), update="sr", seed=11)
    state = tx.init(w0)
    params = w0
    for step in range(2):
        updates, state = jax.jit(tx.update)(g, state, params)
        new = optax.apply_updates(params, updates)
        for i, k in enumerate(sorted(params)):
            y = np.asarray(params[k].astype(jnp.float32)) - np.asarray(g[k].astype(jnp.float32))
            want = pa.quantize(y, "bf16", rounding="stochastic", seed=ts.step_seed(11, step, 2, i))
            got = np.asarray(new[k].astype(jnp.float32))
            assert new[k].dtype == jnp.bfloat16 and np.array_equal(got, want)
        params = new
    def as_torch(v):
        return torch.tensor(np.asarray(v.astype(jnp.float32)))

    tw = [nn.Parameter(as_torch(w0[k]).bfloat16()) for k in sorted(w0)]
    opt = LowPrecisionOptimizer(torch.optim.SGD(tw, lr=1.0), update="sr", seed=11)
    _steps(opt, tw, [[as_torch(g[k]) for k in sorted(g)]] * 2)
    for t, k in zip(tw, sorted(params)):
        assert np.array_equal(t.detach().float().numpy(), np.asarray(params[k].astype(jnp.float32)))


def test_jax_kahan_and_states_track_fp32_adam():
    rng = np.random.default_rng(0)
    w0 = {"w": jnp.asarray(rng.standard_normal((64, 300)), jnp.bfloat16)}
    grads = [{"w": jnp.asarray(rng.standard_normal((64, 300)), jnp.bfloat16)} for _ in range(20)]
    tx = optax.adam(1e-2)
    ref, s = {"w": w0["w"].astype(jnp.float32)}, tx.init({"w": w0["w"].astype(jnp.float32)})
    for g in grads:
        u, s = tx.update(jax.tree.map(lambda v: v.astype(jnp.float32), g), s, ref)
        ref = optax.apply_updates(ref, u)
    moved = float(jnp.abs(ref["w"] - w0["w"].astype(jnp.float32)).mean())
    for update, states, bound in [("kahan", None, 0.01), ("sr", "int8", 0.2), ("nearest", "fp8", 0.2)]:
        params, state = _jax_run(update, states, grads, w0)
        eff = params["w"].astype(jnp.float32)
        if update == "kahan":
            eff = eff + state.compensation["w"].astype(jnp.float32)
        err = float(jnp.abs(eff - ref["w"]).mean())  # mean over the leaf, as is the distance moved
        assert err < bound * moved, (update, states, err, moved)
        stored = [v for v in jax.tree.leaves(state.inner, is_leaf=lambda v: hasattr(v, "form"))
                  if hasattr(v, "form")]  # fmt: skip
        assert len(stored) == (2 if states else 0)
        assert all(v.arrays["codes"].dtype.itemsize == 1 for v in stored)
        if states == "int8":
            assert [v.signed for v in stored] == [True, False]  # mu, nu


def test_jax_bad_input_and_mp_optimizer():
    with pytest.raises(pa.PolyampError, match=r"update='sr' rounds 16-bit parameters.*float32"):
        low_precision(optax.sgd(0.1), update="sr").init({"w": jnp.zeros(3)})
    with pytest.raises(pa.PolyampError, match="unknown optimizer-state form"):
        low_precision(optax.sgd(0.1), states="q8")
    with pytest.raises(pa.PolyampError, match="wraps an optax.GradientTransformation"):
        low_precision(lambda g: g)
    tx = low_precision(optax.sgd(0.1), states="int8")
    with pytest.raises(pa.PolyampError, match="needs the parameters"):
        tx.update({"w": jnp.zeros(3)}, tx.init({"w": jnp.zeros(3)}))
    mp = pa.MixedPrecision("bf16-true:kahan,states=fp8", framework="jax")
    assert mp.optimizer(optax.sgd(0.1)) is not None
    assert pa.MixedPrecision("bf16-mixed", framework="jax").optimizer(tx) is tx


def test_front_ends_without_the_wrappers_refuse_training_state_options():
    pytest.importorskip("tensorflow")
    with pytest.raises(pa.UnsupportedError, match="not for tensorflow: use 'bf16-true' there"):
        pa.MixedPrecision("bf16-true:sr", framework="tensorflow")
    assert pa.MixedPrecision("bf16-true:sr", framework="jax").policy.state.update == "sr"


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_compare_trainers_take_the_policies_and_count_their_whole_state(framework):
    """compare's trainers under training-state policies: no master copy, the stored moments counted, the
    total (state + saved for backward) against float32's; and --policies keeps a policy's options."""
    import importlib

    from polyamp.compare.cli import _split_policies
    from polyamp.compare.rows import MemoryUse
    from polyamp.compare.workloads import get_workload

    assert _split_policies("float32,bf16-true:sr,states=int8,bf16-true:kahan,bf16-mixed") == [
        "float32", "bf16-true:sr,states=int8", "bf16-true:kahan", "bf16-mixed"]  # fmt: skip
    module = importlib.import_module(f"polyamp.compare.{framework}")
    totals = {}
    for policy in ("float32", "bf16-true:sr", "bf16-true:sr,states=int8"):
        trainer = module.Trainer(get_workload("mlp", quick=True), policy)
        losses = [trainer.step(i) for i in range(3)]
        assert all(np.isfinite(losses)) and trainer.last.stepped
        memory = trainer.memory()
        assert memory["master"] == 0, memory["how"]["master"]
        totals[policy] = MemoryUse(**{k: v for k, v in memory.items() if k != "how"}).total
        if policy.endswith("int8"):
            n = sum(w.size for w in get_workload("mlp", quick=True).weights.values())
            assert memory["optimizer"] < 2.2 * n + 64  # two 8-bit moments, block scales, step counters
    assert totals["bf16-true:sr,states=int8"] < totals["bf16-true:sr"] < 0.6 * totals["float32"], totals
