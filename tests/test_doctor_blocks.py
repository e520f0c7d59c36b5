"""The doctor's measured formats (polyamp.doctor.blocks): the numpy reference on hand cases, the torch
and JAX device paths equal to it, and doctor runs with block formats and recipes in every framework.

Runs in .venv (torch, JAX, TensorFlow) and in .venv-mxnet (``POLYAMP_TEST_FRAMEWORKS=mxnet``): each
framework's tests import it inside the test (``require``), so the others skip.
"""

import json
import math
import os

import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import PolyampError
from polyamp.doctor import blocks as B
from polyamp.doctor.run import check_formats
from polyamp.numerics import BLOCK_FORMATS, quantize_blocks

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

MX = [n for n, f in BLOCK_FORMATS.items() if f.rules]
COUNTS = ("total", "nonfinite", "nonzero", "underflow", "clipped", "spoiled")


def cast(name: str, kind: str = "output") -> B.Cast:
    return B.parse(name).casts[kind]


def block_of(values, n=32) -> np.ndarray:
    x = np.zeros(n, np.float32)
    x[: len(values)] = values
    return x


def assert_same(got: B.Measured, want: B.Measured, rtol: float = 1e-12) -> None:
    assert [getattr(got, k) for k in COUNTS] == [getattr(want, k) for k in COUNTS]
    assert math.isclose(got.err, want.err, rel_tol=rtol, abs_tol=0)
    assert math.isclose(got.energy, want.energy, rel_tol=rtol, abs_tol=0)


# -- the numpy reference on hand cases --------------------------------------------------------------
def test_an_amax_between_448_and_512_clips_under_floor_and_not_under_rceil():
    # OCP MX v1.0 floor: k = floor(log2 480) - emax(e4m3) = 8 - 8 = 0, so 480 > Fmax * 2^0 = 448 saturates;
    # rceil: k = ceil(log2(480 / 448)) = 1, 480 / 2 = 240 is on the e4m3 grid
    x = block_of([480.0, 1.0])
    floor, rceil = B.measure(x, cast("mxfp8_e4m3")), B.measure(x, cast("mxfp8_e4m3:rceil"))
    assert (floor.nonzero, floor.clipped, floor.underflow) == (2, 1, 0)
    assert floor.err == (480.0 - 448.0) ** 2 and floor.energy == 480.0**2 + 1.0
    assert floor.to_json()["clipped"] == 0.5
    assert (rceil.clipped, rceil.err) == (0, 0.0) and rceil.sqnr_db == math.inf
    assert B.measure(x, cast("recipe:mxfp8")).clipped == 0  # the mxfp8 recipe's rule is rceil


@pytest.mark.parametrize("fmt", MX)
def test_rceil_never_clips_and_floor_clips_exactly_the_elements_above_fmax_times_the_scale(fmt):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 96)) * np.exp2(rng.uniform(-30, 30, (64, 1)))).astype(np.float32)
    assert B.measure(x, cast(f"{fmt}:rceil")).clipped == 0
    elem = BLOCK_FORMATS[fmt].element
    q = quantize_blocks(x, fmt).astype(np.float64)
    a = np.abs(x.astype(np.float64)).reshape(64, 3, 32)
    k = np.floor(np.log2(a.max(-1, keepdims=True))) - elem.emax  # OCP floor, no clamp needed here
    above = (a > float(elem.max) * np.exp2(k)).reshape(64, 96)
    m = B.measure(x, cast(fmt))
    assert m.clipped == above.sum() > 0
    assert (np.abs(q[above]) < np.abs(x[above])).all()


def test_an_all_zero_block_counts_nothing_and_has_no_mse():
    m = B.measure(np.zeros((2, 32), np.float32), cast("mxfp4"))
    assert (m.total, m.nonzero, m.underflow, m.clipped, m.spoiled) == (64, 0, 0, 0, 0)
    assert m.rel_mse is None and m.sqnr_db is None
    assert m.to_json()["underflow"] == 0.0


def test_tiny_elements_flush_in_mxfp4_but_not_in_mxfp8():
    # amax 1 -> floor scale 2^(0 - emax): mxfp4 2^-2, so 2^-5 / 2^-2 = 0.125 < 0.25 (half of e2m1's
    # smallest subnormal 0.5) flushes; mxfp8_e4m3 2^-8, so 2^-5 / 2^-8 = 8, on the grid
    x = block_of([1.0, 2.0**-5, -(2.0**-5), 0.5])
    fp4, fp8 = B.measure(x, cast("mxfp4")), B.measure(x, cast("mxfp8_e4m3"))
    assert (fp4.nonzero, fp4.underflow, fp8.underflow) == (4, 2, 0)
    assert fp4.err == 2 * 2.0**-10 and fp8.err == 0.0


def test_a_block_holding_nan_or_inf_is_spoiled_and_left_out_of_the_mse():
    x = np.concatenate([block_of([np.nan, 3.0, -2.0]), block_of([np.inf, 1.0]), block_of([1.5, 2.0])])
    m = B.measure(x, cast("mxfp8_e4m3"))
    assert (m.total, m.nonfinite, m.nonzero, m.spoiled, m.underflow, m.clipped) == (96, 2, 5, 3, 0, 0)
    assert m.err == 0.0 and m.energy == 1.5**2 + 2.0**2
    n = B.measure(x.reshape(6, 16), cast("nvfp4"))  # 1x16 blocks: the same three blocks spoiled
    assert (n.nonfinite, n.spoiled) == (2, 3)


def test_tensorwise_scale_is_current_scaling_and_a_non_finite_tensor_gets_scale_1():
    x = np.array([1000.0, 1.0, -3.0], np.float32)
    m = B.measure(x, cast("recipe:fp8-tensorwise"))  # scale 448 / 1000: nothing clips
    assert (m.clipped, m.underflow) == (0, 0)
    bad = B.measure(np.append(x, np.inf).astype(np.float32), cast("recipe:fp8-tensorwise"))
    assert (bad.nonfinite, bad.nonzero, bad.clipped, bad.spoiled) == (1, 3, 1, 0)  # scale 1: 1000 > 448
    assert bad.err == (1000.0 - 448.0) ** 2
    g = B.measure(x, cast("recipe:fp8-tensorwise", "grad_output"))  # e5m2: Fmax 57344
    assert (g.clipped, g.underflow) == (0, 0)


def test_tensorwise_clip_bound_is_the_largest_float32_that_does_not_saturate():
    for scale in (448 / 1000.0, 0.7, 3.3e-3, 1.0, 57344 / 3.1e-5):
        s = np.float32(scale)
        t = B._tensorwise_bound("e4m3fn", scale)
        assert np.float32(t * s) <= 448 < np.float32(np.nextafter(t, np.float32(np.inf)) * s)


def test_nvfp4_block_whose_scale_rounds_to_zero_flushes_and_does_not_clip():
    # s_global = 2688 / 2688 = 1; the first block's s_block = 448, so 1 / 448 < 0.25 (half of e2m1's
    # smallest subnormal) flushes; the second's s_block = float8(1e-3 / 6) = 0 (below half of e4m3fn's
    # smallest subnormal 2^-9): all of it flushes
    x = np.concatenate([block_of([2688.0, 1.0], 16), np.full(16, 1e-3, np.float32)])
    m = B.measure(x, cast("nvfp4"))
    assert (m.nonzero, m.underflow, m.clipped, m.err) == (18, 17, 0, 1.0 + 16 * np.float32(1e-3) ** 2)


def test_measurements_add_up_over_tensors():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(70).astype(np.float32), rng.standard_normal((3, 40)).astype(np.float32)
    ma, mb = B.measure(a, cast("mxfp4")), B.measure(b, cast("mxfp4"))
    both = ma.merge(mb)
    assert both.total == 190 and both.underflow == ma.underflow + mb.underflow
    assert both.err == ma.err + mb.err


# -- spellings -----------------------------------------------------------------------------------------
def test_spellings_and_labels():
    assert B.parse("fp16") is None and B.parse("e4m3") is None  # scalar formats stay predicted
    assert B.parse("MXFP8-E4M3").label == "mxfp8_e4m3" and B.parse("mxfp8_e4m3:floor").label == "mxfp8_e4m3"
    assert B.parse("mxfp4:rceil").casts["grad_weight"].scale_rule == "rceil"
    assert B.parse("mxfp8").label == B.parse("recipe:mxfp8").label == "recipe:mxfp8"
    assert B.parse("fp8-tensorwise").label == "recipe:fp8-tensorwise"
    nv = B.parse("recipe:nvfp4")
    assert set(nv.casts) == {"output", "weight", "grad_output"}  # no recipe quantizes weight gradients
    assert nv.casts["weight"].block == (16, 16) and nv.casts["grad_output"].rounding == "stochastic"
    assert nv.casts["weight"].block_for(1) == (16,)
    assert B.parse("nvfp4").casts["weight"].block == (16,)  # the block format: 1x16 everywhere
    tw = B.parse("recipe:fp8-tensorwise").casts
    assert (tw["output"].format, tw["grad_output"].format) == ("e4m3fn", "e5m2")
    assert check_formats("bf16,mxfp8_e4m3,nvfp4,recipe:mxfp8:scale_rule=floor") == (
        "bf16", "mxfp8_e4m3", "nvfp4", "recipe:mxfp8:scale_rule=floor")  # fmt: skip


@pytest.mark.parametrize("name, match", [
    ("mxfp9", "mxfp8_e4m3.*recipe:fp8-tensorwise"),
    ("nvfp4:rceil", "nvfp4 has one scale rule"),
    ("mxfp4:round", "accepted: one of floor, rceil, ceil, even"),
    ("recipe:fp8-delayed", "earlier steps"),
    ("recipe:nope", "fp8-tensorwise"),
    ("mxfp8:scale_rule=up", "scale_rule"),
])  # fmt: skip
def test_bad_names_raise_one_error_naming_the_accepted_ones(name, match):
    with pytest.raises(PolyampError, match=match):
        check_formats(("bf16", name))


# -- the device paths equal the reference -----------------------------------------------------------
def cases():
    rng = np.random.default_rng(3)
    out = []
    for shape in [(3, 70), (5,), (33, 17), (2, 3, 40), (), (16, 32), (0, 4)]:
        x = np.asarray(rng.standard_normal(shape) * np.exp(rng.uniform(-25, 25, shape)), np.float32)
        if x.size > 8:
            x.flat[:6] = [0.0, 1e-42, -3e-39, np.inf, 1e30, -0.0]  # zero, subnormals, inf, huge
        out.append(x)
    out.append(np.concatenate([block_of([np.nan, 1.0]), block_of([480.0, 1e-3])]).reshape(2, 32))
    return out


TARGETS = ["mxfp8_e4m3", "mxfp8_e5m2:rceil", "mxfp6_e3m2", "mxfp6_e2m3:even", "mxfp4:ceil", "nvfp4",
           "recipe:fp8-tensorwise", "recipe:nvfp4", "recipe:mxfp8"]  # fmt: skip


def test_torch_path_equals_the_reference():
    torch = require("torch")
    from polyamp.torch.doctor import measure_tensor

    for x in cases():
        for name in TARGETS:
            for c in B.parse(name).casts.values():
                assert_same(measure_tensor(torch.from_numpy(np.array(x)), c), B.measure(x, c))
    x = np.array(np.random.default_rng(4).standard_normal((4, 48)), np.float32)  # float16 widened exactly
    half = torch.from_numpy(x).half()
    assert_same(measure_tensor(half, cast("mxfp4")), B.measure(half.float().numpy(), cast("mxfp4")))


# (target, kind) -> the cases() it is checked on in JAX, where each (case, cast) pair compiles programs
# of its own: every cast on an array holding inf, subnormals and -0 or on the NaN-block case, every case
# under two or more casts; floor's clipping of 480 (the last case); tensorwise scaling of a finite tensor
# and of one holding inf (scale 1); NVFP4's 16x16 weight tiles on a 1-d array (its 1x16 fallback: the
# 1x16 blocks there), a partial 2-d tiling and a batch of them
JAX_CASES = {("mxfp8_e4m3", "output"): (0, -1), ("mxfp4:rceil", "output"): (2,),
             ("nvfp4", "output"): (3, -1), ("recipe:fp8-tensorwise", "output"): (1, 2),
             ("recipe:fp8-tensorwise", "grad_output"): (3,), ("recipe:nvfp4", "weight"): (1, 2, 3),
             ("recipe:nvfp4", "grad_output"): (0, -1)}  # fmt: skip


def test_jax_path_equals_the_reference():
    jax = require("jax")
    from polyamp.jax.doctor import measure_tensor

    xs = cases()
    for (name, kind), which in JAX_CASES.items():
        c = B.parse(name).casts[kind]
        for i in which:
            assert_same(measure_tensor(jax.numpy.asarray(xs[i]), c), B.measure(xs[i], c), rtol=1e-9)


# -- doctor runs ---------------------------------------------------------------------------------------
FORMATS = ("bf16", "mxfp8_e4m3", "nvfp4", "recipe:fp8-tensorwise")


def check_report(report, weights: dict, recipe_weights: dict | None = None) -> None:
    """Measured labels and rows are there, and each layer's weight row is the reference's of its
    weights (``weights[layer]``, a list of arrays: their measurements merged); a recipe's label the
    reference's of ``recipe_weights[layer]`` where given (the tensors the recipe quantizes)."""
    assert report.formats == ("bf16",) and report.measured == FORMATS[1:]
    rows = {(r.layer, r.kind): r for r in report.rows}
    assert {layer for layer, kind in rows if kind == "weight"} == set(weights)
    for layer, ws in weights.items():
        row = rows[layer, "weight"]
        for label in FORMATS[1:]:
            c = B.parse(label).casts["weight"]
            of = recipe_weights[layer] if recipe_weights is not None and label.startswith("recipe:") else ws
            want = B.measure(of[0], c).merge(*[B.measure(w, c) for w in of[1:]]).to_json()
            got = row.measured[label]
            assert got.keys() == want.keys()
            for key, value in want.items():  # counts exact; sums in another order: to rounding
                assert got[key] == value if value is None or key in COUNTS else math.isclose(got[key], value)
    kinds = {r.kind for r in report.rows if r.measured}
    assert kinds == {"output", "grad_output", "weight", "grad_weight"}
    assert all(not r.measured for r in report.rows if r.kind == "update_ratio")
    assert all("recipe:fp8-tensorwise" not in r.measured for r in report.rows if r.kind == "grad_weight")


def test_torch_doctor_measures_block_formats_and_writes_them(tmp_path):
    torch = require("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(8, 40), torch.randn(8, 3))
    report = pa.doctor(model, batch, torch.nn.functional.mse_loss, optimizer=opt, formats=FORMATS)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a recipe quantizes a Linear's weight, not its bias: its label measures the weight alone
    check_report(report, {n: [p.detach().numpy() for p in model[int(n)].parameters()] for n in ("0", "2")},
                 {n: [model[int(n)].weight.detach().numpy()] for n in ("0", "2")})
    scalar = pa.doctor(model, batch, torch.nn.functional.mse_loss, formats=("bf16",))
    assert scalar.measured == () and all(not r.measured for r in scalar.rows)
    assert all(not ob.measured for ob in scalar.observations)
    paths = report.write(tmp_path, plot=False)
    md = paths["md"].read_text()
    assert "## nvfp4 (measured" in md and "## recipe:fp8-tensorwise (measured" in md
    data = json.loads(paths["json"].read_text())
    assert data["measured_formats"] == list(FORMATS[1:])
    assert data["rows"][0]["measured"]["mxfp8_e4m3"]["measured"] is True
    assert "mxfp8_e4m3 measured unf/clip" in report.table()


def test_torch_doctor_two_steps_add_up():
    torch = require("torch")
    torch.manual_seed(1)
    model = torch.nn.Linear(20, 5)
    batch = (torch.randn(4, 20), torch.randn(4, 5))
    one = pa.doctor(model, batch, torch.nn.functional.mse_loss, formats=("bf16", "mxfp4"))
    two = pa.doctor(model, batch, torch.nn.functional.mse_loss, formats=("bf16", "mxfp4"), steps=2)
    a, b = (next(r.measured["mxfp4"] for r in rep.rows if r.kind == "weight") for rep in (one, two))
    assert b["total"] == 2 * a["total"] and b["underflow"] == a["underflow"]  # no optimizer: same weights


def test_cli_takes_block_formats(tmp_path, capsys):
    require("torch")
    from polyamp.cli import main

    argv = ["doctor", "--workload", "mlp", "--quick", "--out", str(tmp_path), "--no-plot", "--json",
            "--formats", "bf16,mxfp8_e4m3,nvfp4"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["formats"] == ["bf16"] and data["measured_formats"] == ["mxfp8_e4m3", "nvfp4"]
    assert any(r["measured"] for r in data["rows"])
    assert main([*argv[:-1], "bf16,mxfp9"]) == 2
    assert "recipe:fp8-tensorwise" in capsys.readouterr().err


def test_jax_doctor_measures_block_formats():
    jax = require("jax")
    optax = require("optax")
    jnp = jax.numpy

    def loss(p, batch):
        x, y = batch
        with jax.named_scope("fc0"):
            h = jnp.tanh(x @ p["w0"])
        with jax.named_scope("fc1"):
            out = h @ p["w1"]
        return jnp.mean((out - y) ** 2)

    # every tapped tensor 32x32, so each measured cast compiles once (the weights' GEMM layout is still
    # their transpose: measuring a kernel as it is would give other blocks)
    rng = np.random.default_rng(0)
    w0, w1, x = (jnp.asarray(rng.standard_normal((32, 32)), jnp.float32) for _ in range(3))
    params = {"w0": w0 / 5, "w1": w1 / 6}
    batch = (x, jnp.zeros((32, 32)))
    report = pa.doctor(params, batch, loss, optimizer=optax.sgd(0.1), formats=FORMATS)
    # kernels (in, out) are blocked along ``in``, the GEMM's reduction axis, as the recipes block them
    check_report(report, {"fc0": [np.asarray(params["w0"]).T], "fc1": [np.asarray(params["w1"]).T]})


def test_tensorflow_doctor_measures_block_formats():
    require("tensorflow")
    keras = require("keras")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((24,)), keras.layers.Dense(40, activation="tanh", name="a"),
                              keras.layers.Dense(3, name="b")])  # fmt: skip
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 24)).astype(np.float32), rng.standard_normal((8, 3)).astype(np.float32)
    import tensorflow as tf

    report = pa.doctor(model, (tf.constant(x), tf.constant(y)), keras.losses.MeanSquaredError(),
                       optimizer=keras.optimizers.SGD(0.1), formats=FORMATS)  # fmt: skip
    check_report(report, {la.name: [B.gemm_layout(v.numpy(), "weight") for v in la.trainable_variables]
                          for la in model.layers},
                 {la.name: [B.gemm_layout(la.kernel.numpy(), "weight")] for la in model.layers})  # fmt: skip


def test_mxnet_doctor_measures_block_formats():
    mx = require("mxnet")
    from mxnet import gluon

    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(40, in_units=24, activation="tanh"), gluon.nn.Dense(3, in_units=40))
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(0)
    x = mx.nd.array(rng.standard_normal((8, 24)).astype(np.float32))
    y = mx.nd.array(rng.standard_normal((8, 3)).astype(np.float32))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    report = pa.doctor(net, (x, y), gluon.loss.L2Loss(), optimizer=trainer, formats=FORMATS)
    names = [r.layer for r in report.rows if r.kind == "weight"]
    params = [[b.weight.data().asnumpy(), b.bias.data().asnumpy()] for b in (net[0], net[1])]
    check_report(report, dict(zip(names, params)), dict(zip(names, ([p[0]] for p in params))))
