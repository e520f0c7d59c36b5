"""The doctor's numpy core: the binning spec, predictions held against real casts, recommendations."""

import json
import math
import subprocess
import sys
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from polyamp import PolyampError
from polyamp.doctor import (
    N_BINS,
    LogHistogram,
    Observation,
    bin_index,
    lost_updates,
    predict,
    predict_scales,
    recommend,
    update_ratio_histogram,
)
from polyamp.doctor.histogram import B_MAX, B_MIN, HI, LO, SUB
from polyamp.doctor.recommend import LOSS_SCALE_MARGIN, MAX_LOSS_SCALE
from polyamp.numerics import FORMATS, get_format, quantize

CAST = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3fn": ml_dtypes.float8_e4m3fn,
        "e5m2": ml_dtypes.float8_e5m2}  # fmt: skip


def lognormal(rng, center, spread, n=100_000, dtype=np.float32):
    """Random signs, log2|x| ~ N(center, spread)."""
    return (np.exp2(rng.normal(center, spread, n)) * rng.choice([-1.0, 1.0], n)).astype(dtype)


def measured(x, fmt, scale=1.0):
    """Fractions and errors from actually rounding scale * x with quantize."""
    fmt = get_format(fmt)
    v = np.abs(x.astype(np.float64)) * scale
    with np.errstate(invalid="ignore"):
        q = np.abs(quantize(v, fmt))
    finite = np.isfinite(v)
    over = finite & ~np.isfinite(q)
    nz = finite & (v != 0)
    ok = nz & ~over
    err = q[ok] - v[ok]
    return {
        "overflow": over.mean(),
        "flush": (nz & (q == 0)).mean(),
        "subnormal": (ok & (q != 0) & (q < fmt.min_normal)).mean(),
        "rel_rms_error": math.sqrt(np.mean((err / v[ok]) ** 2)),
        "sqnr_db": 10 * math.log10(np.sum(v[ok] ** 2) / np.sum(err**2)),
        "flush_count": int((nz & (q == 0)).sum()),
    }


# -- the binning spec ---------------------------------------------------------------------------------
def brute_bin(a: float) -> int:
    """The bin by exact rational comparison with every edge the spec defines."""
    fa = Fraction(a)
    if fa < Fraction(2) ** B_MIN:
        return 0
    if fa >= Fraction(2) ** (B_MAX + 1):
        return N_BINS - 1
    b = B_MAX
    while Fraction(2) ** b > fa:
        b -= 1
    k = int((fa / Fraction(2) ** b - 1) * SUB)  # floor of a non-negative rational
    return SUB * (b - B_MIN) + k + 1


def test_bin_formula_matches_brute_force():
    rng = np.random.default_rng(1)
    normal = np.exp2(rng.uniform(-126, 128, 400)).astype(np.float32)
    subnormal = rng.integers(1, 1 << 23, 200, dtype=np.uint32).view(np.float32)
    powers = np.ldexp(1.0, np.arange(-149, 128)).astype(np.float32)
    edges = (powers[:, None] * (1 + np.arange(SUB) / SUB)).astype(np.float32).ravel()
    below = np.nextafter(edges, np.float32(0))
    a32 = np.concatenate([normal, subnormal, powers, edges, below[below > 0], [np.finfo(np.float32).max]])
    got = bin_index(a32)
    assert [brute_bin(float(a)) for a in a32] == got.tolist()
    a64 = np.array([5e-324, 2.0**-150, 2.0**-149, 2.0**128 * 0.999, 2.0**128, 1e300])
    expected = [0, 0, 1, N_BINS - 2, N_BINS - 1, N_BINS - 1]
    assert bin_index(a64).tolist() == [brute_bin(a) for a in a64] == expected
    i = np.arange(1, N_BINS - 1)
    assert all(Fraction(LO[j]) == Fraction(2) ** (B_MIN + (j - 1) // SUB) * (1 + Fraction((j - 1) % SUB, SUB))
               for j in map(int, i[::37]))  # fmt: skip
    assert np.array_equal(HI[1:-2], LO[2:-1])


def test_bitcast_recipe_for_float32_matches_frexp():
    """The docstring's frexp-free recipe (TensorFlow) gives the same bins, subnormals included."""
    rng = np.random.default_rng(2)
    bits = rng.integers(1, 0x7F800000, 20_000, dtype=np.uint32)  # every positive finite float32
    a = bits.view(np.float32)
    small = a < np.float32(2.0**-126)
    with np.errstate(over="ignore"):
        u = np.where(small, a * np.float32(2.0**64), a).view(np.int32).astype(np.int64)
    b = (u >> 23) - 127 - np.where(small, 64, 0)
    k = (u >> 19) & 15
    assert np.array_equal(np.clip(SUB * (b - B_MIN) + k + 1, 0, N_BINS - 1), bin_index(a))


def test_histogram_of_counts_zeros_nonfinite_and_extremes():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.5, 3.0, 2.0**-149, -(2.0**-130)], np.float32)
    h = LogHistogram.of(x)
    assert (h.total, h.zeros, h.nonfinite, h.finite_nonzero) == (10, 2, 3, 5)
    assert h.amax == 3.0 and h.amin_nonzero == 2.0**-149
    assert h.counts[bin_index(np.float32([1.0, 1.5, 3.0]))].tolist() == [1, 1, 1]
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float64):
        y = np.array([0.0, np.nan, 1.0, -1.5, 3.0, 2.0**-14], dtype)
        assert LogHistogram.of(y) == LogHistogram.of(y.astype(np.float32))
    empty = LogHistogram.of(np.zeros(0, np.float32))
    assert (empty.total, empty.amax, empty.amin_nonzero) == (0, 0.0, None)


def test_merge_json_and_from_counts_round_trip():
    rng = np.random.default_rng(3)
    x, y = lognormal(rng, -3, 5, 5000), lognormal(rng, 2, 1, 3000)
    x[:7] = 0
    y[:3] = np.nan
    h = LogHistogram.of(x).merge(LogHistogram.of(y))
    assert h == LogHistogram.of(np.concatenate([x, y]))
    assert LogHistogram.from_json(json.dumps(h.to_json())) == h
    assert LogHistogram.from_json(h.to_json()) == h
    again = LogHistogram.from_counts(h.counts.astype(np.float32), h.zeros, h.nonfinite, h.amax)
    assert np.array_equal(again.counts, h.counts) and again.total == h.total and again.amin_nonzero is None


def test_update_ratio_histogram_bins_update_over_weight_binade():
    w = np.array([3.0, 3.0, 0.0, 1.0, np.inf, 5.0], np.float32)
    u = np.array([0.75, 0.0, 1.0, np.nan, 1.0, 2.0**-20], np.float32)
    h = update_ratio_histogram(u, w)
    assert (h.total, h.apart, h.zeros, h.nonfinite, h.finite_nonzero) == (6, 1, 1, 2, 2)
    # r = |u| / 2^b(w): 0.75 / 2 and 2^-20 / 4
    assert h.counts[bin_index(np.array([0.375, 2.0**-22]))].tolist() == [1, 1]
    assert h.amax == 0.375 and h.amin_nonzero == 2.0**-22


# -- predictions against real casts -------------------------------------------------------------------
DISTRIBUTIONS = [(-20, 4), (0, 3), (12, 3), (-5, 8), (5, 1), (-16, 2)]


@pytest.mark.parametrize("name", list(CAST))
@pytest.mark.parametrize("center,spread", DISTRIBUTIONS)
def test_predictions_match_real_casts(name, center, spread):
    rng = np.random.default_rng(abs(center) * 10 + spread)
    x = lognormal(rng, center, spread)
    p, m = predict(LogHistogram.of(x), name), measured(x, name)
    for key in ("overflow", "flush", "subnormal"):
        assert abs(getattr(p, key) - m[key]) <= 0.005, (key, getattr(p, key), m[key])
    assert p.flush * x.size == pytest.approx(m["flush_count"], abs=1e-6)  # the flush limit is a bin edge
    assert p.rel_rms_error == pytest.approx(m["rel_rms_error"], rel=0.1)
    if spread <= 3:  # wide spreads' SQNR rests on a handful of the largest elements
        assert abs(p.sqnr_db - m["sqnr_db"]) < 1.5
    with np.errstate(over="ignore", invalid="ignore"):
        c = np.abs(x.astype(CAST[name]).astype(np.float64))  # ml_dtypes / numpy's own cast agrees
    assert abs(p.overflow - (~np.isfinite(c)).mean()) <= 0.005
    assert abs(p.flush - ((c == 0) & (x != 0)).mean()) <= 0.005
    assert p.any_overflow == bool(m["overflow"] > 0) and p.any_flush == bool(m["flush"] > 0)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_single_values_at_every_threshold_classify_like_quantize(name):
    """A one-element histogram is a point mass: its outcome must be quantize's, ties included."""
    fmt = get_format(name)
    step = math.ldexp(1.0, fmt.emin - fmt.mbits)
    top = math.ldexp(1.0, fmt.emax - fmt.mbits)
    low = (fmt.smallest_positive / 2, fmt.min_normal - step / 2, fmt.min_normal)
    limits = (*low, fmt.max, fmt.max + top / 2)
    for t in limits:
        for v in (np.nextafter(t, 0), t, np.nextafter(t, np.inf)):
            p = predict(LogHistogram.of(np.array([v])), fmt)
            with np.errstate(invalid="ignore"):
                q = abs(float(quantize(v, fmt)))
            assert p.flush == (q == 0), (v, q)
            assert p.subnormal == (0 < q < fmt.min_normal), (v, q)
            if not fmt.saturates_always:
                assert p.overflow == (not math.isfinite(q)), (v, q)


def test_relative_error_of_a_flat_bin_is_exact():
    """Uniform values in one fp16 binade: relative RMS error ~ 2^-11 / sqrt(3) / mean magnitude."""
    x = np.linspace(1.0, 2.0, 200_001, endpoint=False)
    p, m = predict(LogHistogram.of(x), "fp16"), measured(x, "fp16")
    assert p.rel_rms_error == pytest.approx(m["rel_rms_error"], rel=0.01)
    assert p.sqnr_db == pytest.approx(m["sqnr_db"], abs=0.05)


def test_loss_scale_shift_equals_the_scaled_array():
    rng = np.random.default_rng(7)
    x = lognormal(rng, -22, 3)
    h = LogHistogram.of(x)
    scales = [2.0**k for k in (-3, 0, 4, 10, 16, 24)]
    for scale, p in zip(scales, predict_scales(h, "fp16", scales)):
        q = predict(LogHistogram.of(x.astype(np.float64) * scale), "fp16")
        for key in ("overflow", "flush", "subnormal", "normal", "rel_rms_error", "sqnr_db"):
            assert getattr(p, key) == pytest.approx(getattr(q, key), rel=1e-9, abs=1e-12), (scale, key)
        m = measured(x, "fp16", scale)
        assert abs(p.flush - m["flush"]) <= 0.005 and abs(p.overflow - m["overflow"]) <= 0.005
    for scale in (1000.0, 3.0e7):  # not a power of two: the bin edges move
        p, m = predict(h, "fp16", scale), measured(x, "fp16", scale)
        assert abs(p.flush - m["flush"]) <= 0.005 and abs(p.subnormal - m["subnormal"]) <= 0.005
        assert abs(p.overflow - m["overflow"]) <= 0.005


@pytest.mark.parametrize("name,center", [("bf16", -8), ("bf16", -10), ("bf16", -4), ("fp16", -11)])
def test_lost_updates_match_the_real_addition(name, center):
    rng = np.random.default_rng(11 - center)
    n = 100_000
    w = quantize(lognormal(rng, -4, 2, n, np.float64), name)  # weights stored in the format
    u = (np.abs(w) * np.exp2(rng.normal(center, 2, n)) * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    u[:500] = 0
    w[500:700] = 0
    lu = lost_updates(update_ratio_histogram(u, w), name)
    unchanged = quantize(w + u.astype(np.float64), name) == w
    real_lost = (unchanged & (u != 0) & (w != 0)).mean()
    assert abs(lu.lost - real_lost) <= 0.005, (lu.lost, real_lost)
    assert lu.zero_update == pytest.approx(((u == 0) & (w != 0)).mean())
    assert lu.zero_weight == pytest.approx((w == 0).mean())
    assert json.dumps(lu.to_json())


# -- recommendations ----------------------------------------------------------------------------------
def model(rng, n_layers=6, out=(0, 3), grad=(-12, 2), ratio=(-5, 1), special=None):
    obs = []
    for i in range(n_layers):
        name = f"layer{i}"
        kinds = {"output": out, "weight": (-3, 1), "grad_output": grad, "grad_weight": grad,
                 "update_ratio": ratio}  # fmt: skip
        for kind, (center, spread) in kinds.items():
            x = lognormal(rng, center, spread, 4000)
            if special:
                x = special(name, kind, x)
            if kind == "update_ratio":
                hist = update_ratio_histogram(x, np.ones_like(x))
            else:
                hist = LogHistogram.of(x)
            obs.append(Observation(name, kind, hist))
    return obs


def test_an_overflowing_output_names_that_layer():
    rng = np.random.default_rng(20)

    def huge(name, kind, x):
        return x * np.float32(1e6) if (name, kind) == ("layer3", "output") else x

    rec = recommend(model(rng, special=huge))
    assert rec.policy == "fp16-mixed" and rec.keep_fp32 == ("layer3",)
    assert rec.findings[0].layer == "layer3" and rec.findings[0].problem == "overflow"
    assert "overflows fp16" in rec.keep_fp32_reasons["layer3"]
    assert json.loads(json.dumps(rec.to_json()))["keep_fp32"] == ["layer3"]


def test_small_gradients_get_a_power_of_two_loss_scale_within_the_margin():
    rng = np.random.default_rng(21)
    obs = model(rng, grad=(-16, 1.5))
    rec = recommend(obs)
    gmax = max(o.hist.amax for o in obs if o.kind.startswith("grad"))
    s = rec.loss_scale
    assert rec.policy == "fp16-mixed" and math.frexp(s)[0] == 0.5
    assert gmax * s <= LOSS_SCALE_MARGIN * 65504 < gmax * s * 2
    grads = [o.hist for o in obs if o.kind.startswith("grad")]
    merged = grads[0].merge(*grads[1:])
    assert rec.gradient_underflow == pytest.approx(predict(merged, "fp16", s).flush)
    assert rec.checks["bf16-mixed"].loss_scale is None
    tiny = recommend(model(rng, grad=(-34, 1.5)))
    assert tiny.loss_scale == MAX_LOSS_SCALE and "capped" in tiny.loss_scale_reason


def test_gradients_beyond_fp16_range_choose_bf16():
    rng = np.random.default_rng(22)
    rec = recommend(model(rng, grad=(-20, 9)))
    assert rec.policy == "bf16-mixed" and rec.loss_scale is None
    assert not rec.checks["fp16-mixed"].feasible
    assert "fp16 would need" in rec.reason


def test_nonfinite_in_fp32_is_reported_with_the_first_layer():
    rng = np.random.default_rng(23)

    def broken(name, kind, x):
        if (name, kind) in (("layer2", "output"), ("layer4", "output"), ("layer5", "grad_output")):
            x[:3] = np.inf
        return x

    rec = recommend(model(rng, special=broken))
    assert rec.policy == "float32" and rec.nonfinite.layer == "layer2" and rec.nonfinite.kind == "output"
    assert "non-finite in float32" in rec.reason and rec.keep_fp32 == ()


def test_master_weights_follow_the_lost_update_fraction():
    rng = np.random.default_rng(24)
    small = recommend(model(rng, ratio=(-14, 1)))  # lost in bf16 (2^-8) and fp16 (2^-11)
    large = recommend(model(rng, ratio=(-4, 1)))
    assert small.master_weights and small.checks["bf16-mixed"].master_weights
    assert not large.master_weights and not large.checks["bf16-mixed"].master_weights
    assert "below half an ulp" in small.master_weights_reason


def test_where_fp16_is_slow_bf16_is_chosen_with_the_reason_and_the_prediction_is_plain_python():
    from polyamp.doctor.recommend import fp16_slow

    rng = np.random.default_rng(26)
    obs = model(rng, grad=(-16, 1.5))
    assert recommend(obs).policy == "fp16-mixed"  # the numerics alone
    why = fp16_slow("torch", "cpu")
    assert "torch warns" in why and fp16_slow("mxnet", "cpu_pinned") and fp16_slow("torch", "cuda:1") is None
    assert fp16_slow("jax", "cpu") is None and fp16_slow("torch", None) is None  # no such fact
    rec = recommend(obs, slow_fp16=why)
    assert rec.policy == "bf16-mixed" and rec.loss_scale is None and rec.fp16_slow == why
    assert rec.checks["fp16-mixed"].feasible and why in rec.reason and "fp16-mixed fits" in rec.reason
    assert json.loads(json.dumps(rec.to_json()))["fp16_slow"] == why
    zeros = LogHistogram.of(np.zeros(16, np.float32))  # all-zero gradients (a zero-initialised BN)
    p = predict(zeros, "fp16")
    assert type(p.any_flush) is bool and all(type(v) is float for v in (p.flush, p.overflow, p.normal))
    json.dumps(p.to_json(), allow_nan=False)


def test_repeated_observations_merge_and_layer_order_is_kept():
    rng = np.random.default_rng(25)
    big = LogHistogram.of(lognormal(rng, 20, 1, 100))
    obs = [Observation(f"l{i}", "output", LogHistogram.of(lognormal(rng, 0, 1, 100))) for i in range(8)]
    obs += [Observation("l6", "output", big), Observation("l1", "output", big)]
    rec = recommend(obs)
    assert rec.keep_fp32 == ("l1", "l6")


# -- bad input ----------------------------------------------------------------------------------------
def test_bad_input_raises_polyamp_error():
    h = LogHistogram.of(np.ones(4, np.float32))
    with pytest.raises(PolyampError, match="accepted: .*fp16"):
        predict(h, "fp17")
    for scale in (0, -2.0, math.nan, math.inf, True, "1"):
        with pytest.raises(PolyampError, match="scale"):
            predict(h, "fp16", scale)
    empty = LogHistogram.of(np.zeros(0, np.float32))
    with pytest.raises(PolyampError, match="empty"):
        predict(empty, "fp16")
    with pytest.raises(PolyampError, match="empty"):
        lost_updates(empty, "bf16")
    with pytest.raises(PolyampError, match="no observations"):
        recommend([])
    with pytest.raises(PolyampError, match="accepted: output"):
        Observation("l", "activation", h)
    with pytest.raises(PolyampError, match="dtype int64"):
        LogHistogram.of(np.arange(3))
    with pytest.raises(PolyampError, match="4434"):
        LogHistogram.from_counts(np.zeros(10, np.int64), 0, 0, 0.0)
    with pytest.raises(PolyampError, match="amax"):
        LogHistogram.from_counts(h.counts, 0, 0, 5.0)
    with pytest.raises(PolyampError, match="spec"):
        LogHistogram.from_json({**h.to_json(), "spec": {"sub": 8}})
    with pytest.raises(PolyampError, match="shape"):
        update_ratio_histogram(np.ones(3, np.float32), np.ones(4, np.float32))
    with pytest.raises(PolyampError, match="scales"):
        predict_scales(h, "fp16", 2.0)


def test_doctor_core_imports_no_framework():
    names = ("torch", "tensorflow", "jax", "mxnet", "keras")
    code = f"import sys, polyamp.doctor; print(','.join(m for m in {names!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
