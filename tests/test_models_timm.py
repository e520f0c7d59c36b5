"""Real timm models under polyamp's PyTorch front end: ``resnet18`` and a 2-block ``vit_tiny_patch16_224``
at 32 x 32 pixels, built by ``timm.create_model`` (no weights, no downloads): bf16-mixed equals
native ``torch.autocast`` training, fp16-mixed trains with a loss scale, each recipe quantizes every
convolution and linear layer but the kept first and last (``mp.recipe_layers``), a checkpoint resumes in
a new process bit for bit, the doctor writes its report on a ResNet whose zero-initialised last
BatchNorms give all-zero gradients, and tune keeps its budget.

timm needs torchvision, which does not import beside torch's 2.13.0 CPU wheel of the main environment:
these tests run in ``.venv-timm`` (the Makefile: torch 2.14.1 with its torchvision 0.29.1)."""

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
from frameworks import require

torch = require("torch")
timm = require("timm")

import polyamp as pa  # noqa: E402

KINDS = ("resnet", "vit")
CLASSES, BATCH = 10, 2


def build(kind: str, seed: int = 0):
    """A timm model of ``kind``, randomly initialised (seeded), no dropout (timm's default)."""
    torch.manual_seed(seed)
    if kind == "resnet":
        return timm.create_model("resnet18", pretrained=False, num_classes=CLASSES)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_classes=CLASSES)  # fmt: skip


def batch(kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    size = 32  # ResNet: 16 x 16 left layer4 a 1 x 1 input, where torch 2.14.1's bf16 convolution backward on
    # an AVX-512 CPU gave layer4.0.conv1 a non-finite weight gradient now and then (native autocast alike)
    return torch.randn(BATCH, 3, size, size, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def train(kind: str, model, mp, opt, steps: int, start: int = 0) -> list[float]:
    """``steps`` steps of ``opt`` under ``mp`` (None: native bf16 ``torch.autocast``, ``loss.backward()``)."""
    losses = []
    for step in range(start, start + steps):
        x, y = batch(kind, step)
        opt.zero_grad()
        with mp.autocast() if mp is not None else torch.autocast("cpu", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if mp is None:
            loss.backward()
            opt.step()
        else:
            mp.backward(loss)
            assert mp.step(opt).stepped
        losses.append(loss.item())
    return losses


@functools.cache
def trained(kind: str, policy: str | None, steps: int = 2):
    """(losses, parameters, mp, model) of ``steps`` steps of a fresh model under ``policy`` (None: native)."""
    model = build(kind)
    mp = None
    if policy is not None:
        mp = pa.MixedPrecision(policy, framework="torch", device="cpu")
        mp.watch(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on the CPU is slow: polyamp says so
        losses = train(kind, model, mp, opt, steps)
    return losses, [p.detach().clone() for p in model.parameters()], mp, model


def matmul_names(model) -> list[str]:
    """The model's convolution and linear modules, in named_modules order."""
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_mixed_trains_bit_identically_to_native_autocast(kind):
    ours, params, mp, _ = trained(kind, "bf16-mixed")
    native, native_params, _, _ = trained(kind, None)
    assert ours == native and len(ours) == 2
    assert all(torch.equal(a, b) for a, b in zip(params, native_params))
    assert mp.current_scale == 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_fp16_mixed_trains_with_a_loss_scale(kind):
    """A step whose scaled gradients overflow fp16 is skipped and halves the scale until one steps (resnet18's
    weight gradients times 2^16 overflow fp16)."""
    model = build(kind)
    mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu")
    mp.watch(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    results = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on the CPU is slow: polyamp says so
        for step in range(8):
            x, y = batch(kind, step)
            opt.zero_grad()
            with mp.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            assert torch.isfinite(loss)
            mp.backward(loss)
            results.append(mp.step(opt))
            if results[-1].stepped:
                break
    assert results[-1].stepped and all(not r.stepped and r.nonfinite for r in results[:-1])
    assert mp.current_scale == 2.0**16 / 2 ** (len(results) - 1) and mp.state.skipped == len(results) - 1


@pytest.mark.parametrize("kind, recipe", [("resnet", "mxfp8"), ("vit", "mxfp8"), ("vit", "nvfp4")])
def test_recipes_quantize_every_conv_and_linear_but_the_kept_ones(kind, recipe):
    _, params, mp, model = trained(kind, recipe)
    names = matmul_names(model)
    record = mp.recipe_layers
    assert record.quantized == names[1:-1] and list(record.kept) == [names[0], names[-1]]
    assert record.kept[names[0]].startswith("keep 'first'")
    assert record.kept[names[-1]].startswith("keep 'last'")
    if kind == "resnet":  # the stem, 16 block convolutions, 3 downsample convolutions, the classifier
        assert len(names) == 21 and (names[0], names[-1]) == ("conv1", "fc")
    else:  # the patch embedding, qkv / proj / fc1 / fc2 of each block, the head
        assert len(names) == 10 and (names[0], names[-1]) == ("patch_embed.proj", "head")
    assert mp.state_dict()["recipe"]["state"]["calls"] > 0
    bf16 = trained(kind, "bf16-mixed")[1]
    assert not all(torch.equal(a, b) for a, b in zip(params, bf16))  # the recipe changed the training


_RESUME = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import polyamp as pa
from test_models_timm import build, train
saved = torch.load({path!r})
model = build("vit", seed=7)
model.load_state_dict(saved["model"])
mp = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
mp.watch(model)
mp.load_state_dict(saved["mp"])
opt = torch.optim.AdamW(model.parameters(), 1e-3)
opt.load_state_dict(saved["opt"])
losses = train("vit", model, mp, opt, 2, start=2)
weight = float(model.head.weight.detach().double().sum()).hex()
print(json.dumps({{"losses": [float(x).hex() for x in losses], "weight": weight,
                   "recipe": mp.state_dict()["recipe"]}}))
"""


def test_a_recipe_checkpoint_resumes_bit_identically_in_a_new_process(tmp_path):
    model = build("vit")
    mp = pa.MixedPrecision("fp8-delayed", framework="torch", device="cpu")
    mp.watch(model)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    train("vit", model, mp, opt, 2)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "mp": mp.state_dict()}, path)
    losses = train("vit", model, mp, opt, 2, start=2)
    script = _RESUME.format(tests=os.path.dirname(__file__), path=str(path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == [float(x).hex() for x in losses]
    assert resumed["weight"] == float(model.head.weight.detach().double().sum()).hex()
    assert resumed["recipe"] == json.loads(json.dumps(mp.state_dict()["recipe"]))


def test_the_doctor_on_resnet18_writes_its_report_and_recommends_bf16_on_a_cpu(tmp_path):
    model = build("resnet")
    assert not model.layer1[0].bn2.weight.any()  # timm's zero_init_last: all-zero gradients upstream
    x, y = batch("resnet", 0)
    report = pa.doctor(model, (x, y), torch.nn.functional.cross_entropy,
                       formats=("bf16", "fp16", "recipe:fp8-tensorwise"))  # fmt: skip
    names = matmul_names(model)
    weights = {r.layer for r in report.rows if r.kind == "weight"}
    assert set(names) <= weights and "layer1.0.bn2" in weights  # rows by module path
    measured = {(r.layer, r.kind) for r in report.rows if "recipe:fp8-tensorwise" in r.measured}
    assert {(n, "weight") for n in names} <= measured
    assert not any(layer.endswith(("bn1", "bn2")) and kind == "weight" for layer, kind in measured)
    assert report.policy == "bf16-mixed"  # fp16 is slow on a CPU: not recommended here
    paths = report.write(tmp_path, plot=False)  # numpy bools of the all-zero gradients crashed json.dump
    assert "layer1.0.conv1" in {row["layer"] for row in json.loads(paths["json"].read_text())["rows"]}


def test_tune_keeps_its_budget_on_a_vit():
    model = build("vit")
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    loss = torch.nn.functional.cross_entropy
    report = pa.tune(model, lambda i: batch("vit", i % 4), loss, opt, budget=10, parity_steps=2)
    assert report.budget_s == 10 and report.spent_s < 10 * 1.25
    assert report.best is not None and any(t.status in ("ok", "chosen") for t in report.trials)
