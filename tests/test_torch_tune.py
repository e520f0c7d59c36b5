"""``polyamp.tune`` on PyTorch (``polyamp/torch/tune.py``): the knobs a model and optimizer offer, every
configuration starting from the same weights, the optimizer rebuilt with its hyper-parameters, a short
search's report, ``report.apply``, the command line, and bad input."""

import copy
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from frameworks import require
from torch import nn

import polyamp as pa
from polyamp import PolyampError
from polyamp.cli import main
from polyamp.torch import tune as tt
from polyamp.tune import Candidate, TuneReport
from polyamp.tune.report import STATUSES
from polyamp.tune.search import tune as search


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def batches(i):
    g = torch.Generator().manual_seed(i % 4)
    x = torch.randn(64, 32, generator=g)
    return x, x[:, :4].sin()


def test_the_knobs_follow_the_model_and_optimizer():
    model = mlp()
    knobs = tt.knobs(model, torch.optim.Adam(model.parameters()))
    assert knobs["optimizer"].values == ("as given", "foreach", "fused")
    assert knobs["compile"].values == (False, True) and "channels_last" not in knobs
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    rprop = tt.knobs(conv, torch.optim.Rprop(conv.parameters()))  # Rprop has foreach only
    assert rprop["optimizer"].values == ("as given", "foreach") and "channels_last" in rprop
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))  # one thread (as under pytest-xdist) has no threads knob
        n = torch.get_num_threads()
        assert tt.knobs(model, torch.optim.Adam(model.parameters()))["threads"].values == (n, n // 2)
    finally:
        torch.set_num_threads(threads)


def test_every_configuration_starts_from_the_same_weights_and_keeps_the_optimizer():
    model = mlp()
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-3},
                             {"params": list(model[2].parameters()) + list(model[4].parameters())}],
                            lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)  # fmt: skip
    before = copy.deepcopy(model.state_dict())
    t = tt.Tunable(model, batches, nn.functional.mse_loss, opt)
    steps = [t.build(Candidate.of("float32", {**dict(tt_defaults(t)), "optimizer": impl}))
             for impl in ("as given", "foreach", "fused")]  # fmt: skip
    losses = [[s.step(i) for i in range(3)] for s in steps]
    assert losses[0][0] == losses[1][0] == losses[2][0]  # the same weights and batch at step 0
    assert all(abs(a - b) < 1e-5 for a, b in zip(losses[0], losses[2]))  # fused Adam: the same arithmetic
    rebuilt = steps[2].optimizer
    assert [g["lr"] for g in rebuilt.param_groups] == [1e-3, 3e-3]
    for g in rebuilt.param_groups:
        assert g["betas"] == (0.8, 0.95) and g["weight_decay"] == 0.1 and g["fused"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model untouched
    for s in steps:
        s.close()


def tt_defaults(t):
    return {k: v.default for k, v in t.knobs.items()}


def test_a_short_search_reports_every_trial_and_applies_its_best():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    t = tt.Tunable(model, batches, nn.functional.mse_loss, opt, name="mlp")
    t.knobs = {k: v for k, v in t.knobs.items() if k != "compile"}  # compile: its own test below
    report = search(t, ("bf16-mixed",), budget_s=15, parity_steps=3)
    policies = ("float32", "bf16-mixed")
    expected = {(p, k, v) for p in policies for k, knob in t.knobs.items() for v in knob.values[1:]}
    tried = set()
    for trial in report.trials:
        assert trial.status in STATUSES
        if trial.status in ("ok", "chosen", "no gain", "slower") and trial.parity is not None:
            assert trial.parity <= 0.05
        changed = [(k, v) for k, v in trial.candidate.settings if v != t.knobs[k].default]
        tried.update((trial.candidate.policy, k, v) for k, v in changed)
    assert expected <= tried
    json.dumps(report.to_json())
    mp, fast_model, fast_opt = report.apply(model, opt)
    assert mp.policy.name == report.policy
    losses = []
    for i in range(20):
        x, y = batches(i)
        fast_opt.zero_grad()
        with mp.autocast():
            loss = nn.functional.mse_loss(fast_model(x).float(), y)
        mp.backward(loss)
        mp.step(fast_opt)
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_compile_keeps_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 4))
    t = tt.Tunable(model, batches, nn.functional.mse_loss, torch.optim.Adam(model.parameters(), 1e-2))
    plain, compiled = (t.build(Candidate.of("bf16-mixed", {**tt_defaults(t), "compile": c})) for c in (0, 1))
    a, b = [plain.step(i) for i in range(3)], [compiled.step(i) for i in range(3)]
    assert all(abs(x - y) <= 0.02 * abs(x) for x, y in zip(a, b))


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 4)

    def forward(self, x):  # x: [batch, 32] as 4 tokens of 8, in 2 heads of 4
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(x.shape[0], 4, 3, 2, 4).unbind(2))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).flatten(1))


def test_the_attention_knob_picks_the_kernel_and_keeps_the_loss():
    torch.manual_seed(0)
    model = _SelfAttention()
    assert "attention" not in tt.knobs(mlp(), torch.optim.Adam(mlp().parameters()))
    assert tt.knobs(model, torch.optim.Adam(model.parameters()))["attention"].values == ("default", "math")
    mha = nn.Sequential(nn.MultiheadAttention(8, 2))
    assert "attention" in tt.knobs(mha, torch.optim.Adam(mha.parameters()))
    t = tt.Tunable(model, batches, nn.functional.mse_loss, torch.optim.Adam(model.parameters(), 1e-2))
    losses = {}
    for kernel in ("default", "math"):
        step = t.build(Candidate.of("float32", {**tt_defaults(t), "attention": kernel}))
        losses[kernel] = [step.step(i) for i in range(3)]
    assert losses["math"] == pytest.approx(losses["default"], rel=1e-5)
    # apply wraps the forward: the math kernel runs (flash attention is refused inside it)
    report = SimpleNamespace(framework="torch", policy="float32", settings={"attention": "math"})
    _, applied, _ = tt.apply(report, model, torch.optim.Adam(model.parameters()))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # alone, flash attention would run here
        plain = model.__class__.forward(applied, batches(0)[0])
        wrapped = applied(batches(0)[0])
    assert torch.allclose(plain, wrapped, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # no CPU kernel: only the wrapper's math runs
            model.__class__.forward(applied, batches(0)[0])
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        applied(batches(0)[0])


def test_the_math_kernel_runs_inside_a_compiled_model():
    """The kernel choice is traced with the forward: a compiled bf16 step with ``math`` runs no flash
    attention (a context entered around a compiled call would leave flash attention in the graph). In
    float32, inductor's attention-fusion pass may rewrite the math pattern into flash attention again."""
    from torch.profiler import profile

    torch.manual_seed(0)
    model = _SelfAttention()
    t = tt.Tunable(model, batches, nn.functional.mse_loss, torch.optim.Adam(model.parameters(), 1e-2))
    ops = {}
    for kernel in ("default", "math"):
        step = t.build(Candidate.of("bf16-mixed", {**tt_defaults(t), "compile": True, "attention": kernel}))
        step.step(0)
        with profile() as prof:
            step.step(1)
        ops[kernel] = {e.key for e in prof.key_averages()}
    assert any("flash_attention" in op for op in ops["default"])
    assert not any("flash_attention" in op for op in ops["math"])


def tiny_gpt2():
    transformers = require("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)  # no dropout: the implementations' losses compare
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_a_hugging_face_model_gets_the_attention_knob_the_transformers_way():
    """Regression: GPT-2 reaches SDPA through ``config._attn_implementation`` (transformers'
    ``ALL_ATTENTION_FUNCTIONS``), which the source test missed: no attention knob."""
    model, batch = tiny_gpt2()
    assert model.config._attn_implementation == "sdpa" and not tt._uses_attention(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    knob = tt.knobs(model, opt)["attention"]
    assert knob.values == ("default", "math", "eager") and "as configured, sdpa" in knob.why
    t = tt.Tunable(model, batch, None, opt)
    losses, impls = {}, {}
    for value in knob.values:
        step = t.build(Candidate.of("float32", {**tt_defaults(t), "attention": value}))
        losses[value] = [step.step(i) for i in range(2)]
        impls[value] = step.model.config._attn_implementation
        step.close()
    assert impls == {"default": "sdpa", "math": "sdpa", "eager": "eager"}
    assert losses["eager"] == pytest.approx(losses["default"], rel=1e-4)
    assert losses["math"] == pytest.approx(losses["default"], rel=1e-4)
    assert model.config._attn_implementation == "sdpa"  # the user's model untouched by the search
    report = SimpleNamespace(framework="torch", policy="float32", settings={"attention": "eager"})
    tt.apply(report, model, opt)
    assert model.config._attn_implementation == "eager"  # apply sets it on the model


def test_a_saved_report_loads_back_and_applies_as_the_original(tmp_path):
    """Regression: TuneReport.save had no load, so polyamp tune's JSON could not be applied in a script."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    t = tt.Tunable(model, batches, nn.functional.mse_loss, opt, name="mlp")
    t.knobs = {k: v for k, v in t.knobs.items() if k in ("optimizer", "threads")}
    report = search(t, ("bf16-mixed",), budget_s=6, parity_steps=2)
    report.save(tmp_path / "tune.json")
    loaded = TuneReport.load(tmp_path / "tune.json")
    assert loaded == report and (loaded.policy, loaded.settings) == (report.policy, report.settings)
    threads, applied = torch.get_num_threads(), []
    try:
        for r in (report, loaded):
            m = copy.deepcopy(model)
            applied.append((*r.apply(m, torch.optim.Adam(m.parameters(), 1e-2)), torch.get_num_threads()))
    finally:
        torch.set_num_threads(threads)
    (mp_a, model_a, opt_a, n_a), (mp_b, model_b, opt_b, n_b) = applied
    assert mp_a.policy == mp_b.policy and n_a == n_b and type(model_a) is type(model_b)
    assert opt_a.defaults == opt_b.defaults and opt_a.defaults["lr"] == 1e-2


def test_tune_takes_budget_in_seconds_as_the_command_line_does():
    """Regression: polyamp.tune(..., budget=40) was a TypeError (the keyword was budget_s only)."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    report = pa.tune(model, batches, nn.functional.mse_loss, opt, budget=2, parity_steps=2)
    assert report.budget_s == 2 and report.spent_s < 2 * 1.25  # a first compile is not let run it over
    # every compiled candidate (one, or two where a second pass added a variant) left untried for the budget
    compiled = [t for t in report.trials if t.candidate.label.startswith("float32 compile=on")]
    assert compiled and all(t.status == "not tried" and "a budget of about" in t.reason for t in compiled)
    assert pa.tune(model, batches, nn.functional.mse_loss, opt, budget_s=1, parity_steps=2).budget_s == 1
    with pytest.raises(PolyampError, match="budget=2 and budget_s=3: they are the same seconds; give one"):
        pa.tune(model, batches, nn.functional.mse_loss, opt, budget=2, budget_s=3)


def test_tune_dispatches_and_refuses_bad_input():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(PolyampError, match="give a torch.optim.Optimizer of the model's parameters"):
        tt.Tunable(model, batches, nn.functional.mse_loss, None)
    with pytest.raises(PolyampError, match="tune takes a torch.nn.Module, got list"):
        tt.Tunable([1], batches, nn.functional.mse_loss, opt)
    other = mlp(1)
    with pytest.raises(PolyampError, match="its parameters must be the model's own"):
        tt.Tunable(model, batches, nn.functional.mse_loss, torch.optim.Adam(other.parameters()))
    with pytest.raises(PolyampError, match="tune compares float32, bf16-mixed, fp16-mixed"):
        pa.tune(model, batches, nn.functional.mse_loss, opt, policies=("nvfp4",))


def test_the_command_line_tunes_a_quick_workload(tmp_path, capsys):
    code = main(["tune", "--workloads", "mlp", "--quick", "--budget", "8", "--parity-steps", "3", "--json",
                 "--knobs", "optimizer", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    (data,) = json.loads(capsys.readouterr().out)
    assert data["framework"] == "torch" and data["name"] == "mlp"
    assert json.loads((tmp_path / "torch-mlp.json").read_text())["best"] == data["best"]
    assert {t["label"].split()[1] for t in data["trials"] if "optimizer=" in t["label"]} <= {
        "optimizer=foreach", "optimizer=fused", "optimizer=as"}  # fmt: skip
    assert main(["tune", "--workloads", "mlp", "--quick", "--knobs", "warp"]) == 2
    assert "--knobs warp: not a knob of this model; its knobs: optimizer, compile" in capsys.readouterr().err
    assert main(["tune", "--framework", "caffe"]) == 2
    assert "caffe" in capsys.readouterr().err
    if importlib.util.find_spec("mxnet") is None:  # .venv: MXNet lives in .venv-mxnet
        assert main(["tune", "--framework", "mxnet"]) == 2
        assert "mxnet is not installed in this Python" in capsys.readouterr().err
