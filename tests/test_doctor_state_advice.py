"""The doctor's rule 4: per layer the weight update (nearest / sr / kahan / master) and the moments' form,
from synthetic histograms at each boundary and from a real torch model trained with what it says."""

from __future__ import annotations

import numpy as np
import pytest

import polyamp as pa
from polyamp.doctor import state_advice
from polyamp.doctor.histogram import LogHistogram, update_ratio_histogram
from polyamp.doctor.recommend import Observation, recommend


def _ratios(log2_r: float, n: int = 1000) -> LogHistogram:
    """Updates of ratio 2^log2_r (times 1..1.06) to weights in the binade [1, 2)."""
    w = np.full(n, 1.5)
    return update_ratio_histogram(np.ldexp(np.linspace(1.0, 1.06, n), int(log2_r)), w)


@pytest.mark.parametrize("log2_r, rule", [(-6, "nearest"), (-8, "nearest"), (-9, "sr"), (-12, "sr"),
                                          (-13, "kahan"), (-16, "kahan"), (-17, "master"),
                                          (-30, "master")])  # fmt: skip
def test_update_rule_at_each_boundary_for_bf16(log2_r, rule):
    """bf16 (M = 7): lost below 2^-8; SR keeps 2^-12 and up; a bf16 Kahan buffer 2^-16 and up."""
    got, shares = state_advice.update_rule(_ratios(log2_r), 7, 0.05)
    assert got == rule, shares


def test_the_strictest_layer_sets_the_policy_and_the_moments_follow_the_gradients():
    rng = np.random.default_rng(0)
    smooth = LogHistogram.of(rng.standard_normal(20000))
    wide = LogHistogram.of(rng.standard_normal(20000) * np.logspace(-7, 0, 20000))  # 7 decades of |g|
    obs = [Observation("a", "update_ratio", _ratios(-6)), Observation("b", "update_ratio", _ratios(-10)),
           Observation("a", "grad_weight", smooth), Observation("b", "grad_weight", smooth)]  # fmt: skip
    rec = recommend(obs)
    check = rec.checks["bf16-mixed"]
    assert check.weight_update_layers == {"a": "nearest", "b": "sr"} and check.states == "int8"
    assert rec.low_precision == "bf16-true:sr,states=int8"
    assert "'b'" in check.weight_update_reason and "int8" in check.states_reason
    rec = recommend(obs[:2] + [Observation("b", "grad_weight", wide),
                               Observation("c", "update_ratio", _ratios(-14))])  # fmt: skip
    assert rec.low_precision == "bf16-true:kahan,states=bf16", rec.checks["bf16-mixed"].states_reason
    assert recommend(obs + [Observation("c", "update_ratio", _ratios(-20))]).low_precision is None
    assert recommend([Observation("a", "grad_weight", smooth)]).low_precision is None  # no update observed
    assert pa.Policy.parse(rec.low_precision).state.update == "kahan"


def test_a_real_torch_model_gets_sr_and_trains_with_it_where_plain_bf16_stalls():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16))
    x, teacher = torch.randn(256, 64), torch.randn(64, 16) / 8
    batch = (x, x @ teacher)
    report = pa.doctor.diagnose(model, batch, nn.functional.mse_loss, steps=2,
                                optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))  # fmt: skip
    low = report.recommendation.low_precision
    assert low is not None and pa.Policy.parse(low).state.update in ("sr", "kahan"), report.summary()
    assert f"for memory: mp = polyamp.MixedPrecision({low!r})" in report.summary()
    finals = {}
    for policy in ("float32", "bf16-true", low):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 16))
        mp = pa.MixedPrecision(policy, framework="torch")
        m = mp.watch(m)
        opt = mp.optimizer(torch.optim.AdamW(m.parameters(), lr=1e-4))
        dtype = next(m.parameters()).dtype
        for _ in range(150):
            with mp.autocast():
                loss = (m(x.to(dtype)).float() - batch[1]).pow(2).mean()
            mp.backward(loss)
            mp.step(opt)
            opt.zero_grad()
        finals[policy] = float(loss.detach())
    assert finals[low] < 1.05 * finals["float32"] < finals["bf16-true"], finals
