"""A real model that ships with MXNet under polyamp (run in .venv-mxnet): Gluon's model-zoo ResNet-18 v1
(``vision.get_model("resnet18_v1", pretrained=False, classes=10)``, no download) at 2x3x32x32, and
MobileNet 0.25 for the recipes' layer record.

- bf16-mixed training against MXNet's own bf16 path (contrib.amp: ``amp.init_trainer``, ``amp.scale_loss``,
  ``trainer.step``) in this process, where contrib.amp casts for both;
- every recipe's ``mp.recipe_layers`` against the net's own Dense and Conv blocks, and mxfp8 training;
- checkpoint / resume of fp8-delayed training in a new process, bit for bit;
- ``polyamp.doctor``, its rows named by block path, its report written.

MXNet's AMP is process-wide: bf16-mixed is set up once, before any network is built."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from frameworks import require

import polyamp as pa

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mx = require("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet.contrib import amp  # noqa: E402
from mxnet.gluon.model_zoo import vision  # noqa: E402
from mxnet_caps import bf16_or_none, needs_bf16  # noqa: E402

MP = bf16_or_none("bf16-mixed")  # amp.init, before any network exists (None: no bf16 here)
LOSS = gluon.loss.SoftmaxCrossEntropyLoss()
RECIPES = ["fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4"]
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")

def resnet18(seed=0):
    """The zoo's ResNet-18 v1 with He-normal weights from a numpy seed (the same in every process)."""
    net = vision.get_model("resnet18_v1", pretrained=False, classes=10)
    net.initialize()
    net(mx.nd.ones((2, 3, 32, 32)))  # the output Dense's deferred shape
    rng = np.random.default_rng(seed)
    for p in net.collect_params().values():
        if len(p.shape) > 1:
            fan_in = int(np.prod(p.shape[1:]))
            p.set_data(mx.nd.array(rng.normal(0, (2 / fan_in) ** 0.5, p.shape).astype(np.float32)))
    return net


def batch(i):
    rng = np.random.default_rng(100 + i)
    return (mx.nd.array(rng.standard_normal((2, 3, 32, 32)).astype(np.float32)),
            mx.nd.array(rng.integers(0, 10, 2).astype(np.float32)))


def sgd(params):
    return gluon.Trainer(params, "sgd", {"learning_rate": 0.05, "momentum": 0.9}, update_on_kvstore=False)


def polyamp_step(mp, net, trainer, i):
    x, y = batch(i)
    with autograd.record():
        loss = LOSS(net(x), y)
        with mp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    mp.step(trainer, 2)
    return float(loss.mean().asscalar())


def matmul_blocks(net, path=""):
    """(path, block) of every Dense and Conv block below ``net``, depth-first by child name: the paths the
    doctor and keep_fp32 name layers by, walked here from Gluon's own ``_children``."""
    out = []
    for name, child in net._children.items():
        here = f"{path}.{name}" if path else name
        if isinstance(child, (gluon.nn.Dense, gluon.nn.Conv2D)):
            out.append((here, child))
        out.extend(matmul_blocks(child, here))
    return out


def params_of(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


# -- bf16-mixed against MXNet's own bf16 path ----------------------------------------------------------
@needs_bf16
def test_bf16_mixed_trains_resnet18_as_contrib_amps_bf16_does():
    """The same contrib.amp casts for both; contrib.amp scales the loss by 2^16 and divides it out (powers
    of two, exact unless a gradient under- or overflows), polyamp does not scale under bf16-mixed: the
    losses agree to 1e-3 relative, the weights to 1e-3 of their range."""
    ours, native = resnet18(), resnet18()
    trainer = MP.trainer(sgd(ours.collect_params()))
    theirs = sgd(native.collect_params())
    amp.init_trainer(theirs)
    ours_losses, native_losses = [], []
    for i in range(3):
        ours_losses.append(polyamp_step(MP, ours, trainer, i))
        x, y = batch(i)
        with autograd.record():
            loss = LOSS(native(x), y)
            with amp.scale_loss(loss, theirs) as scaled:
                autograd.backward(scaled)
        theirs.step(2)
        native_losses.append(float(loss.mean().asscalar()))
    np.testing.assert_allclose(ours_losses, native_losses, rtol=1e-3)
    assert ours_losses[0] != ours_losses[-1]  # it trained
    for a, b in zip(params_of(ours), params_of(native)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * max(np.abs(b).max(), 1e-6))


# -- recipes ---------------------------------------------------------------------------------------
@needs_bf16
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", ["resnet18_v1", "mobilenet0.25"])
def test_every_recipe_records_each_dense_and_conv_block_of_a_zoo_model(model, recipe):
    """mp.recipe_layers names every Dense and Conv2D of the net by its block path: all quantized but the
    first and the last (the default keep), counted from the net itself."""
    net = vision.get_model(model, pretrained=False, classes=10)
    net.initialize()
    blocks = [p for p, _ in matmul_blocks(net)]
    mp = pa.MixedPrecision(recipe, framework="mxnet")
    mp.watch(net)
    record = mp.recipe_layers
    assert record.quantized == blocks[1:-1] and len(blocks) > 20
    assert record.kept == {blocks[0]: "keep 'first'", blocks[-1]: "keep 'last'"}


@needs_bf16
def test_mxfp8_trains_resnet18_unlike_bf16_mixed():
    mixed, quantized = resnet18(), resnet18()
    mp = pa.MixedPrecision("mxfp8", framework="mxnet")
    mp.watch(quantized)
    assert len(mp.recipe_layers.quantized) == len(matmul_blocks(quantized)) - 2
    # the same model, within MXFP8's error: compared on the logits (about 5e4 in size at this He-normal
    # initialisation, so the cross entropy of the batch moves by ~10 % for a 0.1 % change of them)
    x, _ = batch(0)
    a, b = (net(x).asnumpy().astype(np.float64) for net in (mixed, quantized))
    assert 0 < np.linalg.norm(a - b) / np.linalg.norm(a) < 0.01
    losses = [polyamp_step(MP, mixed, MP.trainer(sgd(mixed.collect_params())), 0),
              polyamp_step(mp, quantized, mp.trainer(sgd(quantized.collect_params())), 0)]  # fmt: skip
    assert np.isfinite(losses).all()
    diff = [np.abs(a - b).max() for a, b in zip(params_of(mixed), params_of(quantized))]
    assert max(diff) > 0  # the quantized GEMMs changed the update


# -- checkpoint / resume in a new process ------------------------------------------------------------
RESUME = '''
import json, sys, warnings
warnings.simplefilter("ignore")
import numpy as np
import polyamp as pa
mp = pa.MixedPrecision("fp8-delayed", framework="mxnet")
from test_models_mxnet import params_of, polyamp_step, resnet18, sgd
folder = sys.argv[1]
net = resnet18(seed=1)  # other weights: the checkpoint's replace them
net.load_parameters(folder + "/net.params")
mp.watch(net)
trainer = mp.trainer(sgd(net.collect_params()))
trainer.load_states(folder + "/trainer.states")
mp.load_state_dict(json.load(open(folder + "/mp.json")))
polyamp_step(mp, net, trainer, 1)
np.savez(folder + "/resumed.npz", *params_of(net))
'''


@needs_bf16
def test_fp8_delayed_resnet18_resumes_bit_identically_in_a_new_process(tmp_path):
    """A step, a checkpoint (parameters with BatchNorm's running statistics, momentum, the recipe's amax
    histories), a second step; a new process resumes from the checkpoint and takes the second step."""
    net = resnet18()
    mp = pa.MixedPrecision("fp8-delayed", framework="mxnet")
    mp.watch(net)
    trainer = mp.trainer(sgd(net.collect_params()))
    polyamp_step(mp, net, trainer, 0)
    net.save_parameters(str(tmp_path / "net.params"))
    trainer.save_states(str(tmp_path / "trainer.states"))
    (tmp_path / "mp.json").write_text(json.dumps(mp.state_dict()))
    polyamp_step(mp, net, trainer, 1)
    out = subprocess.run([sys.executable, "-c", RESUME, str(tmp_path)], capture_output=True, text=True,
                         cwd=Path(__file__).parent)  # imports this module's model and step
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = np.load(tmp_path / "resumed.npz")
    mine = params_of(net)
    assert len(resumed.files) == len(mine)
    assert all(np.array_equal(resumed[f"arr_{i}"], p) for i, p in enumerate(mine))


# -- the doctor --------------------------------------------------------------------------------------
@needs_bf16
def test_the_doctor_names_resnet18s_rows_by_block_path_and_writes_its_report(tmp_path):
    net = resnet18()
    before = params_of(net)
    report = pa.doctor(net, batch(0), LOSS, formats=("bf16", "e4m3fn"))
    layers = {row.layer for row in report.rows}
    blocks = [p for p, _ in matmul_blocks(net)]
    assert set(blocks) <= layers  # every Dense and Conv2D has its rows, by the recipes' names
    mp = pa.MixedPrecision("mxfp8", framework="mxnet")
    mp.watch(net)
    assert set(mp.recipe_layers.quantized) | set(mp.recipe_layers.kept) <= layers
    assert {r.kind for r in report.rows if r.layer == "output"} >= {"output", "grad_output", "weight"}
    paths = report.write(tmp_path, plot=False)
    saved = json.loads(paths["json"].read_text())
    assert {row["layer"] for row in saved["rows"]} == layers
    assert all(np.array_equal(a, b) for a, b in zip(before, params_of(net)))  # the doctor left it as it was
