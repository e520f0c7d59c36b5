"""``polyamp.doctor(...)``, its Report, ``polyamp doctor`` and ``keep_fp32`` on real PyTorch."""

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from frameworks import require
from torch import nn

import polyamp as pa
from polyamp.cli import main
from polyamp.doctor import Report, diagnose


def mlp(scale_first: float = 1.0) -> nn.Sequential:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    with torch.no_grad():
        m[0].weight.mul_(scale_first)
    return m


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)


def test_doctor_is_callable_and_the_package_stays_importable():
    import polyamp.doctor as d

    m = mlp()
    report = pa.doctor(m, batch(), nn.functional.cross_entropy)
    assert isinstance(report, Report) and d.LogHistogram is pa.doctor.LogHistogram
    assert report.framework == "torch" and report.layers == ("0", "1", "2", "3", "4")
    assert report.formats == ("fp16", "bf16", "e4m3fn", "e5m2")
    kinds = {(r.layer, r.kind) for r in report.rows}
    assert ("0", "grad_output") in kinds and ("4", "weight") in kinds
    assert not any(k == "update_ratio" for _, k in kinds)  # no optimizer: no update observed


def test_a_well_scaled_model_fits_fp16_and_the_recommendation_applies_in_one_line():
    m = mlp()
    report = diagnose(m, batch(), nn.functional.cross_entropy, optimizer=torch.optim.Adam(m.parameters()),
                      device="cuda")  # where fp16 runs fast: the choice rests on the numerics  # fmt: skip
    assert report.policy == "fp16-mixed" and report.keep_fp32 == ()
    largest = max(r.amax for r in report.rows if r.kind in ("grad_output", "grad_weight"))
    s = report.initial_scale
    assert s * largest <= 0.5 * 65504 < 2 * s * largest or s == 2.0**24  # the largest 2^k with margin
    mp = pa.MixedPrecision(report.policy, loss_scale=report.loss_scale, keep_fp32=report.keep_fp32)
    assert mp.current_scale == s and isinstance(report.loss_scale, pa.DynamicLossScale)
    assert report.one_liner() in report.summary() and f"2.0**{int(math.log2(s))}" in report.one_liner()


def test_fp16_is_not_recommended_where_torch_warns_it_is_slow_and_the_report_says_why():
    m = mlp()
    on_cpu = diagnose(m, batch(), nn.functional.cross_entropy)  # the weights are on the CPU
    on_gpu = diagnose(m, batch(), nn.functional.cross_entropy, device="cuda:0")
    assert on_gpu.policy == "fp16-mixed" and on_gpu.recommendation.fp16_slow is None
    assert on_cpu.device == "cpu" and on_cpu.policy == "bf16-mixed" and on_cpu.loss_scale is None
    assert on_cpu.recommendation.checks["fp16-mixed"].feasible  # the numerics alone would pick fp16
    assert "torch warns at fp16 autocast on a CPU" in on_cpu.recommendation.reason
    assert "also fits: fp16-mixed" in on_cpu.summary() and "not chosen on cpu" in on_cpu.summary()
    assert on_cpu.one_liner() == "mp = polyamp.MixedPrecision('bf16-mixed')"
    with pytest.raises(pa.PolyampError, match="device must name where the training runs"):
        diagnose(m, batch(), nn.functional.cross_entropy, device=3)


class ZeroInitResidual(nn.Module):
    """A ResNet basic block whose last BatchNorm starts at weight 0 (timm's ``zero_init_last``): the
    block starts as the identity, and the gradients into its second convolution are all zero."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


RESNET = """
import torch
from torch import nn

from test_doctor_api import ZeroInitResidual


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), ZeroInitResidual(8), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    return model, (x, y), nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1)
"""


def test_all_zero_gradients_of_a_zero_initialised_batchnorm_write_a_report(tmp_path, capsys):
    """Regression: a layer whose gradients are all zero made ``any_flush`` a numpy bool, and
    report.write (and ``polyamp doctor``) died on ``Object of type bool is not JSON serializable``."""
    (tmp_path / "resnet.py").write_text(RESNET)
    sys.path.insert(0, str(tmp_path))
    try:
        model, data, loss_fn, opt = __import__("resnet").make()
    finally:
        sys.path.pop(0)
        sys.modules.pop("resnet", None)
    report = diagnose(model, data, loss_fn, optimizer=opt)
    zero = next(r for r in report.rows if (r.layer, r.kind) == ("1.conv2", "grad_weight"))
    assert zero.amax == 0 and zero.zeros == zero.total  # the case that crashed
    assert type(zero.formats["fp16"]["any_flush"]) is bool
    data = json.loads(report.write(tmp_path / "api", plot=False)["json"].read_text())
    rows = {(r["layer"], r["kind"]) for r in data["rows"]}
    assert rows >= {("1.conv2", "grad_weight"), ("1.bn2", "output")}
    out = tmp_path / "cli"
    assert main(["doctor", f"{tmp_path / 'resnet.py'}:make", "--out", str(out), "--no-plot", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == json.loads((out / "report.json").read_text())["rows"]
    assert printed["device"] == "cpu" and printed["recommendation"]["policy"] == "bf16-mixed"


def test_report_json_takes_numpy_scalars_in_its_records(tmp_path):
    """The JSON writer turns numpy scalars (a front end's float32 extremes, a numpy bool) into Python's."""
    import dataclasses

    import numpy as np

    report = diagnose(mlp(), batch(), nn.functional.cross_entropy)
    row = report.rows[0]
    fp16 = {**row.formats["fp16"], "any_flush": np.bool_(True), "flush": np.float32(0.5)}
    fp16["bins"] = np.arange(2)
    odd = dataclasses.replace(row, amax=np.float32(2.5), formats={**row.formats, "fp16": fp16})
    path = dataclasses.replace(report, rows=(odd,)).write(tmp_path, plot=False)["json"]
    got = json.loads(path.read_text())["rows"][0]
    assert got["amax"] == 2.5 and got["formats"]["fp16"]["bins"] == [0, 1]
    assert (got["formats"]["fp16"]["any_flush"], got["formats"]["fp16"]["flush"]) == (True, 0.5)


def test_an_overflowing_layer_is_named_first_and_kept_in_fp32():
    m = mlp(scale_first=1e5)
    report = diagnose(m, batch(), nn.functional.cross_entropy, device="cuda")
    assert report.keep_fp32[0] == "0"
    assert report.worst(1)[0].layer == "0" and report.worst(1)[0].kind in ("output", "weight")
    first = report.recommendation.findings[0]
    assert (first.layer, first.problem) == ("0", "overflow")
    out = next(r for r in report.rows if (r.layer, r.kind) == ("0", "output"))
    assert out.formats["fp16"]["overflow"] > 0.1 and out.formats["bf16"]["overflow"] == 0


def test_a_model_non_finite_in_float32_is_reported_as_such():
    m = mlp()
    with torch.no_grad():
        m[3].bias[0] = math.inf
    report = diagnose(m, batch(), nn.functional.cross_entropy)
    assert report.policy == "float32" and report.nonfinite is not None
    assert report.nonfinite.layer == "3" and "non-finite in float32" in report.summary()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"formats": ("fp16", "fp17")}, "unknown format 'fp17'"),
        ({"formats": ()}, "formats is empty"),
        ({"steps": 0}, "steps must be a whole number >= 1"),
        ({"framework": "caffe"}, "framework"),
    ],
)
def test_bad_arguments_raise_one_clear_error(kwargs, match):
    with pytest.raises(pa.PolyampError, match=match):
        pa.doctor(mlp(), batch(), nn.functional.cross_entropy, **kwargs)


def test_bad_models_and_batches_raise_one_clear_error():
    with pytest.raises(pa.PolyampError, match="has no parameters"):
        pa.doctor(nn.ReLU(), batch(), nn.functional.cross_entropy)
    with pytest.raises(pa.PolyampError, match="expected a torch nn.Module, a Keras model"):
        pa.doctor(object(), batch())
    with pytest.raises(pa.PolyampError, match="expected torch tensors"):
        pa.doctor(mlp(), (batch()[0].numpy(), batch()[1].numpy()), nn.functional.cross_entropy)
    with pytest.raises(pa.PolyampError, match=r"input shapes \[\(64, 5\)\]"):
        pa.doctor(mlp(), (torch.randn(64, 5), batch()[1]), nn.functional.cross_entropy)


def test_write_gives_markdown_json_and_a_heat_map(tmp_path):
    m = mlp(scale_first=1e5)
    opt = torch.optim.SGD(m.parameters(), 1e-3)
    report = diagnose(m, batch(), nn.functional.cross_entropy, optimizer=opt, device="cuda")
    paths = report.write(tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["recommendation"]["policy"] == report.policy and data["apply"] == report.one_liner()
    assert {h["kind"] for h in data["histograms"]} >= {"output", "grad_output", "update_ratio"}
    md = paths["md"].read_text()
    assert "## Findings" in md and "![layers x log2 magnitude" in md and "| 0 | output |" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths["png"].stat().st_size > 20_000


# -- keep_fp32 ---------------------------------------------------------------------------------------------
def dtypes_of(model, run):
    seen = {}
    hooks = [mod.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o.dtype))
             for n, mod in model.named_modules() if n]  # fmt: skip
    run()
    for h in hooks:
        h.remove()
    return seen


def test_keep_fp32_runs_the_named_layers_in_float32_under_autocast():
    m, (x, y) = mlp(), batch()
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", keep_fp32=["3"])
    mp.watch(m)
    opt = torch.optim.SGD(m.parameters(), 0.1)

    def run():
        with mp.autocast():
            loss = nn.functional.cross_entropy(m(x).float(), y)
        mp.backward(loss)
        assert mp.step(opt).stepped

    seen = dtypes_of(m, run)
    assert seen["3"] == torch.float32 and seen["0"] == torch.bfloat16 and seen["4"] == torch.bfloat16
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    assert "keep_fp32=('3',)" in repr(mp)


def test_keep_fp32_of_a_parent_keeps_its_children_and_true_policies_keep_their_weights():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))
    before = m[1][1].weight.detach().clone()
    mp = pa.MixedPrecision("bf16-true", framework="torch", keep_fp32="1")
    mp.watch(m)
    assert m[0].weight.dtype == torch.bfloat16 and m[1][0].weight.dtype == torch.float32
    assert torch.equal(m[1][1].weight, before)  # untouched, not rounded through bf16
    with mp.autocast():
        seen = dtypes_of(m, lambda: m(torch.randn(2, 4)))
    assert seen == {"0": torch.bfloat16, "1.0": torch.float32, "1.1": torch.float32, "1": torch.float32}


def test_keep_fp32_errors():
    m = mlp()
    with pytest.raises(pa.PolyampError, match="'nope', which match no layer of the model; its layers: '0'"):
        pa.MixedPrecision("bf16-mixed", framework="torch", keep_fp32=["nope"]).watch(m)
    with pytest.raises(pa.PolyampError, match="keep_fp32 must be non-empty layer names"):
        pa.MixedPrecision("bf16-mixed", framework="torch", keep_fp32=["0", 3])
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", keep_fp32=["0"])
    with mp.autocast():
        loss = nn.functional.cross_entropy(m(batch()[0]).float(), batch()[1])
    mp.backward(loss)
    with pytest.raises(pa.PolyampError, match=r"call mp.watch\(model\) once before training"):
        mp.step(torch.optim.SGD(m.parameters(), 0.1))


def test_keep_fp32_is_a_no_op_under_float32_and_unwatching_restores_forward():
    m = mlp()
    mp = pa.MixedPrecision("float32", framework="torch", keep_fp32=["0"])
    mp.watch(m)
    assert "forward" not in vars(m[0])
    mp = pa.MixedPrecision("bf16-mixed", framework="torch", keep_fp32=["0"])
    mp.watch(m)
    assert "forward" in vars(m[0])
    for handle in mp._kept:
        handle.remove()
    assert "forward" not in vars(m[0])


# -- the command line --------------------------------------------------------------------------------------
def test_cli_on_a_workload(tmp_path, capsys):
    assert main(["doctor", "--workload", "mlp", "--quick", "--out", str(tmp_path), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "policy:" in out and "apply: mp = polyamp.MixedPrecision(" in out and "fp16 ovf/flush" in out
    assert (tmp_path / "report.md").exists() and not (tmp_path / "heatmap.png").exists()


def test_cli_on_a_users_file_with_json(tmp_path):
    (tmp_path / "model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
            x = torch.randn(32, 4)
            return {"model": model, "batch": (x, x.sum(1, keepdim=True)), "loss_fn": nn.functional.mse_loss,
                    "optimizer": torch.optim.SGD(model.parameters(), 0.1)}
    """))
    command = [sys.executable, "-m", "polyamp", "doctor", f"{tmp_path / 'model.py'}:make", "--json", "--out",
               str(tmp_path / "r")]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["framework"] == "torch" and [r["layer"] for r in data["rows"]][:2] == ["0", "0"]
    assert any(r["kind"] == "update_ratio" for r in data["rows"])


@pytest.mark.parametrize(
    "argv, match",
    [
        (["doctor", "nofile.py:make"], "no such file"),
        (["doctor", "--workload", "mlp", "--formats", "fp99"], "unknown format"),
        (["doctor", "model.py"], "expected FILE.py:function"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


# -- the same API on the other frameworks ------------------------------------------------------------------
def test_jax_params_and_loss_give_a_report_whose_keep_fp32_applies_to_autocast():
    jax = require("jax")
    jnp = jax.numpy

    def loss(p, batch):
        x, y = batch
        with jax.named_scope("big"):
            h = x @ p["big"]
        with jax.named_scope("norm"):
            h = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-3)
        with jax.named_scope("head"):
            out = h @ p["head"]
        return jnp.mean((out - y) ** 2)

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    big = jax.random.uniform(k1, (8, 32), minval=-3e4, maxval=3e4)  # fits fp16; its products do not
    params = {"big": big, "head": jax.random.normal(k2, (32, 1)) / 6}
    batch = (jax.random.normal(k1, (64, 8)), jnp.zeros((64, 1)))
    report = pa.doctor(params, batch, loss)
    assert report.framework == "jax" and report.layers[:3] == ("big", "norm", "head")
    assert report.keep_fp32 == ("big",) and report.policy == "fp16-mixed"

    def fp16_dots(mp) -> int:
        jaxpr = jax.make_jaxpr(mp.autocast(loss))(params, batch).jaxpr
        subs = jax.extend.core.jaxprs_in_params
        eqns = [e for eqn in jaxpr.eqns for e in [eqn, *[s for j in subs(eqn.params) for s in j.eqns]]]
        return sum(e.primitive.name == "dot_general" and e.invars[0].aval.dtype == jnp.float16 for e in eqns)

    mp = pa.MixedPrecision(report.policy, framework="jax", keep_fp32=report.keep_fp32)
    assert bool(jnp.isfinite(jax.jit(mp.autocast(loss))(params, batch)))
    assert fp16_dots(mp) == 1 and fp16_dots(pa.MixedPrecision("fp16-mixed", framework="jax")) == 2


def test_keras_model_non_finite_in_float32_names_the_layer():
    keras = require("keras")
    tf = require("tensorflow")
    layers = [keras.Input((4,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(1, name="b")]
    model = keras.Sequential(layers)
    kernel = model.get_layer("b").kernel
    kernel.assign(tf.tensor_scatter_nd_update(kernel, [[0, 0]], [float("nan")]))
    x = tf.ones((16, 4))
    report = pa.doctor(model, (x, tf.zeros((16, 1))), keras.losses.MeanSquaredError())
    assert report.framework == "tensorflow" and report.policy == "float32"
    assert report.nonfinite.layer == "b" and report.nonfinite.kind == "weight"


def test_cli_runs_mxnet_in_its_own_environment(tmp_path):
    from polyamp.compare.interpreters import mxnet_python

    if mxnet_python() is None:
        pytest.skip("no .venv-mxnet (make venv-mxnet) and no POLYAMP_MXNET_PYTHON")
    command = [sys.executable, "-m", "polyamp", "doctor", "--workload", "mlp", "--quick", "--framework",
               "mxnet", "--json", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["framework"] == "mxnet" and {r["kind"] for r in data["rows"]} >= {"output", "update_ratio"}
    assert (tmp_path / "heatmap.png").exists()
