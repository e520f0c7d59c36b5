"""The doctor's backward-chain noise: the flush of a gradient computed by a low-precision backward pass."""

import math

import numpy as np
import pytest

from polyamp import PolyampError
from polyamp.doctor import LogHistogram, Observation, predict
from polyamp.doctor.chain import backward_noise, gradient_predictions
from polyamp.doctor.recommend import layer_table
from polyamp.doctor.report import build
from polyamp.numerics import get_format

FP16 = get_format("fp16")
T = 2.0**-25  # fp16 flushes |v| <= T


def tiny(rng, n=200_000, center=-26, spread=1.5):
    """Gradients around fp16's flush limit: log2|x| ~ N(center, spread), random signs."""
    return np.exp2(rng.normal(center, spread, n)) * rng.choice([-1.0, 1.0], n)


def test_no_noise_is_the_cast():
    x = tiny(np.random.default_rng(0)).astype(np.float32)
    h = LogHistogram.of(x)
    assert predict(h, "fp16", noise=0.0) == predict(h, "fp16")
    assert predict(h, "fp16", 8.0, 0.0) == predict(h, "fp16", 8.0)


@pytest.mark.parametrize("center, relative", [(-26, 0.05), (-25, 0.1), (-27, 0.3)])
def test_noisy_flush_matches_a_monte_carlo_of_the_rounding(center, relative):
    rng = np.random.default_rng(1)
    x = tiny(rng, center=center).astype(np.float32)
    h = LogHistogram.of(x)
    sigma = math.sqrt(relative * np.mean(x.astype(np.float64) ** 2))
    noisy = x.astype(np.float64) + rng.normal(0.0, sigma, x.size)
    observed = np.mean(noisy.astype(np.float16) == 0)
    p = predict(h, "fp16", noise=relative)
    cast = predict(h, "fp16")
    assert abs(p.flush - observed) < 0.005, (p.flush, observed)
    assert abs(cast.flush - observed) > 0.01  # the cast alone would miss it
    parts = p.flush + p.subnormal + p.normal + p.overflow + p.zeros + p.nonfinite
    assert parts == pytest.approx(1.0)
    assert p.subnormal - cast.subnormal == pytest.approx(cast.flush - p.flush)
    assert p.sqnr_db == cast.sqnr_db  # the rounding error stays the cast's


def test_underflow_noise_is_the_error_below_min_normal():
    rng = np.random.default_rng(2)
    x = tiny(rng).astype(np.float32)
    x64 = x.astype(np.float64)
    err = x.astype(np.float16).astype(np.float64) - x64
    low = np.abs(x64) < FP16.min_normal
    expected = np.sum(err[low] ** 2) / np.sum(x64**2)
    assert predict(LogHistogram.of(x), "fp16").underflow_noise == pytest.approx(expected, rel=0.05)
    normal = (np.abs(x64) * 2.0**20).astype(np.float32)  # every element normal in fp16
    assert predict(LogHistogram.of(normal), "fp16").underflow_noise == 0.0


def chain(rng, layers=4):
    obs = []
    for i in range(layers):
        for kind in ("output", "grad_output", "grad_weight"):
            center = -25 - i / 2 if kind != "output" else 0
            x = tiny(rng, 20_000, center).astype(np.float32)
            obs.append(Observation(f"l{i}", kind, LogHistogram.of(x)))
    return obs


def test_backward_noise_adds_up_from_the_last_layer():
    obs = chain(np.random.default_rng(3))
    table = layer_table(obs)
    noise = backward_noise(table, FP16, 1.0)
    rho = {la: predict(table[la]["grad_output"], FP16).underflow_noise for la in table}
    assert noise["l3", "grad_output"] == 0.0
    assert noise["l3", "grad_weight"] == pytest.approx(rho["l3"])
    assert noise["l1", "grad_output"] == pytest.approx(rho["l2"] + rho["l3"])
    assert noise["l0", "grad_weight"] == pytest.approx(sum(rho.values()))
    assert all(v == 0 for v in backward_noise(table, FP16, 2.0**30).values())  # nothing below min_normal


def test_reports_and_recommendations_use_the_noisy_flush():
    obs = chain(np.random.default_rng(4))
    table = layer_table(obs)
    preds = gradient_predictions(table, FP16, 1.0)
    noise = backward_noise(table, FP16, 1.0)
    assert preds["l0", "grad_output"].flush < predict(table["l0"]["grad_output"], FP16).flush
    report = build(obs, ("fp16", "bf16"), framework="jax", steps=1)
    row = next(r for r in report.rows if (r.layer, r.kind) == ("l0", "grad_output"))
    assert row.formats["fp16"]["flush"] == pytest.approx(preds["l0", "grad_output"].flush)
    at_noise = backward_noise(table, FP16, 2.0**4)["l0", "grad_output"]
    at = predict(table["l0"]["grad_output"], FP16, 2.0**4, at_noise)
    assert row.formats["fp16"]["at_scale"]["2^4"]["flush"] == pytest.approx(at.flush)
    assert noise["l0", "grad_output"] > 0
    sweep = {s["scale"]: s["flush"] for s in report.scale_sweep("fp16")}
    grads = list(preds.values())
    assert sweep[1.0] == pytest.approx(sum(p.flush * p.total for p in grads) / sum(p.total for p in grads))


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, "0.1"])
def test_bad_noise_is_refused(bad):
    h = LogHistogram.of(np.ones(4, np.float32))
    with pytest.raises(PolyampError, match="noise must be"):
        predict(h, "fp16", noise=bad)
