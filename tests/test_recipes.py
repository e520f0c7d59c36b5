"""Recipe arithmetic against TE's / torchao's formulas, written out here by hand."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from polyamp.errors import PolyampError
from polyamp.numerics import quantize
from polyamp.recipes import (
    RECIPES,
    DelayedScaling,
    current_scale,
    get_recipe,
    quantize_tensorwise,
    recipe_spec,
)

F32MAX = float(np.finfo(np.float32).max)


def bits(x) -> int:
    return int(np.asarray(x, dtype=np.float32).view(np.uint32))


def te_delayed(amaxes, n, algo="max", margin=0, fmax=448.0):
    """TE ``_default_sf_compute`` / ``_update_amax_history`` written with torch ops replaced by
    numpy float32: history[0] is the current slot, roll -1 then zero the slot."""
    hist = np.zeros(n, np.float32)
    scale = np.float32(1.0)
    out = []
    for a in amaxes:
        hist[0] = np.float32(a)
        amax = np.fmax.reduce(hist) if algo == "max" else hist[0]
        with np.errstate(divide="ignore", over="ignore"):
            sf = np.float32(fmax) / amax / np.float32(2.0**margin)
        sf = sf if (amax > 0 and np.isfinite(amax)) else scale
        scale = np.float32(F32MAX) if np.isinf(sf) else np.float32(sf)
        hist = np.roll(hist, -1)
        hist[0] = 0
        out.append(scale)
    return out


# ---- current scaling -------------------------------------------------------------------------


def test_hand_cases():
    assert current_scale(3.5, "e4m3fn") == 448 / 3.5 == 128
    assert current_scale(3.5, "e4m3fn", margin=1) == 64
    assert current_scale(3.5, "e5m2") == 57344 / 3.5 == 16384
    assert current_scale(1.0, "e4m3") == 448
    assert current_scale(np.float32(7.0), "e4m3fn").dtype == np.float32
    assert list(current_scale([1.0, 4.0, 0.0], "e4m3fn")) == [448, 112, 1.0]


def test_amax_zero_and_nonfinite_follow_te():
    assert current_scale(0.0, "e4m3fn") == 1.0  # TE compute_scale_from_amax: scale 1
    assert current_scale(math.inf, "e4m3fn") == 1.0
    assert current_scale(math.nan, "e4m3fn") == 1.0
    # torchao: finfo.max / clamp(amax.double(), 1e-12), then float32
    assert bits(current_scale(0.0, "e4m3fn", eps=1e-12)) == bits(np.float32(448.0 / 1e-12))
    # a float32 amax whose quotient overflows float32: TE uses float32's max
    assert current_scale(1e-45, "e4m3fn") == np.float32(F32MAX)


def test_te_and_torchao_agree_bitwise_on_random_float32_amaxes():
    rng = np.random.default_rng(0)
    amax = (rng.random(100_000) * 2.0 ** rng.integers(-60, 60, 100_000)).astype(np.float32)
    amax = amax[amax > 0]
    for fmt, fmax in (("e4m3fn", 448.0), ("e5m2", 57344.0)):
        ours = current_scale(amax, fmt)
        te = np.float32(fmax) / amax  # float32 division (__fdiv_rn)
        torchao = (fmax / np.maximum(amax.astype(np.float64), 1e-12)).astype(np.float32)
        assert np.array_equal(ours.view(np.uint32), te.view(np.uint32))
        big = amax >= 1e-12  # below, torchao's clamp differs from TE by design
        assert big.sum() > 50_000
        assert np.array_equal(ours[big].view(np.uint32), torchao[big].view(np.uint32))


# ---- delayed scaling -------------------------------------------------------------------------


def test_history_max_and_most_recent():
    ds = DelayedScaling("e4m3fn", history_len=4)
    assert ds.scale == 1.0
    assert [ds.update(a) for a in (1.0, 4.0, 2.0)] == [448.0, 112.0, 112.0]  # max of [1, 4, 2] = 4
    mr = DelayedScaling("e4m3fn", history_len=4, amax_compute_algo="most_recent")
    assert [mr.update(a) for a in (1.0, 4.0, 2.0)] == [448.0, 112.0, 224.0]
    assert DelayedScaling("e4m3fn", 4, margin=1).update(3.5) == 64.0


def test_history_rolls_over_more_steps_than_its_length():
    amaxes = [8.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    ds = DelayedScaling("e4m3fn", history_len=3)
    got = [float(ds.update(a)) for a in amaxes]
    # window of the last 3 amaxes: 8 drops out at step 4, 2 at step 7
    assert got == [56, 56, 56, 448, 224, 224, 224, 448, 448, 896, 896]
    assert [float(s) for s in te_delayed(amaxes, 3)] == got
    # history order as TE leaves it: [next slot 0, older .. newest]
    assert ds.history.tolist() == [0.0, 0.5, 0.5]


def test_zero_and_nonfinite_amax_keep_the_previous_scale():
    ds = DelayedScaling("e4m3fn", history_len=2, amax_compute_algo="most_recent")
    ds.update(2.0)
    assert ds.update(0.0) == 224.0 and ds.update(math.inf) == 224.0 and ds.update(math.nan) == 224.0
    mx = DelayedScaling("e4m3fn", history_len=2)
    mx.update(2.0)
    assert mx.update(math.nan) == 224.0  # NaN skipped by the max (fmaxf), 2.0 still in the window
    assert mx.update(math.inf) == 224.0  # inf in the window: keep the previous scale
    assert mx.update(1.0) == 224.0  # inf still in the window
    assert mx.update(1.0) == 448.0


def test_random_run_matches_te_formula_bitwise():
    rng = np.random.default_rng(1)
    amaxes = np.exp(rng.normal(0, 3, 300)).astype(np.float32)
    amaxes[[10, 50]] = 0.0
    for algo in ("max", "most_recent"):
        for margin in (0, 2):
            ds = DelayedScaling("e5m2", history_len=16, amax_compute_algo=algo, margin=margin)
            ours = [bits(ds.update(a)) for a in amaxes]
            assert ours == [bits(s) for s in te_delayed(amaxes, 16, algo, margin, 57344.0)]


RESUME = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from polyamp.recipes import DelayedScaling
    state = json.loads(sys.stdin.read())
    ds = DelayedScaling("e4m3fn", history_len=8, amax_compute_algo="max", margin=1)
    ds.load_state_dict(state)
    amaxes = np.random.default_rng(7).lognormal(0, 4, 60).astype(np.float32)[30:]
    print(json.dumps([int(np.float32(ds.update(a)).view(np.uint32)) for a in amaxes]))
    """
)


def test_state_resumed_bit_identically_in_a_new_process():
    amaxes = np.random.default_rng(7).lognormal(0, 4, 60).astype(np.float32)
    amaxes[5] = np.nan
    whole = DelayedScaling("e4m3fn", history_len=8, margin=1)
    expected = [bits(whole.update(a)) for a in amaxes][30:]
    first = DelayedScaling("e4m3fn", history_len=8, margin=1)
    for a in amaxes[:30]:
        first.update(a)
    state = json.dumps(first.state_dict())
    out = subprocess.run([sys.executable, "-c", RESUME], input=state, capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    assert json.loads(out.stdout) == expected
    again = DelayedScaling("e4m3fn", history_len=8, margin=1)
    again.load_state_dict(json.loads(state))
    assert again.state_dict() == first.state_dict()


def test_state_dict_is_plain():
    ds = DelayedScaling("e4m3", history_len=3)
    ds.update(np.float32(1.5))
    sd = ds.state_dict()
    assert sd == {"format": "e4m3fn", "history_len": 3, "amax_compute_algo": "max", "margin": 0,
                  "scale": float(np.float32(448 / 1.5)), "history": [0.0, 0.0, 1.5], "steps": 1}  # fmt: skip
    assert all(type(v) in (int, float, str, list) for v in sd.values())


# ---- quantize_tensorwise ---------------------------------------------------------------------


def test_quantize_tensorwise():
    x = np.array([3.5, -1.0, 0.01, 0.0, 1000.0], np.float32)
    s = current_scale(3.5, "e4m3fn")
    y = quantize_tensorwise(x, "e4m3fn", s)
    assert y.dtype == np.float32
    assert y[0] == 3.5 and y[1] == -1.0 and y[3] == 0.0
    assert y[4] == 448 / 128  # saturates at Fmax / scale
    assert y[2] == float(quantize(0.01 * 128, "e4m3fn")) / 128
    # the product is rounded to float32 first: 1 + 2^-4 + 2^-30 is a tie once in float32 -> even (1.0)
    x_tie = np.float64(1 + 2.0**-4 + 2.0**-30)
    assert quantize_tensorwise(x_tie, "e4m3fn", 1.0) == 1.0
    assert float(quantize(x_tie, "e4m3fn")) == 1.125
    assert np.isnan(quantize_tensorwise(np.array([np.nan]), "e5m2", 2.0)[0])  # NaN stays NaN
    a = quantize_tensorwise(np.linspace(-1, 1, 50), "e5m2", 1000.0, rounding="stochastic", seed=3)
    b = quantize_tensorwise(np.linspace(-1, 1, 50), "e5m2", 1000.0, rounding="stochastic", seed=3)
    assert np.array_equal(a, b)


# ---- recipes -------------------------------------------------------------------------------


def test_recipe_specs():
    tw, dl, mx, nv = (get_recipe(n) for n in RECIPES)
    assert (tw.forward_format, tw.backward_format, tw.kind) == ("e4m3fn", "e5m2", "tensorwise")
    assert (dl.history_len, dl.amax_compute_algo, dl.margin) == (1024, "max", 0)
    assert (mx.forward_format, mx.backward_format, mx.scale_rule) == ("mxfp8_e4m3", "mxfp8_e4m3", "rceil")
    assert (nv.grad_rounding, nv.forward_rounding, nv.weight_2d, nv.hadamard) == ("stochastic", "nearest",
                                                                                   True, False)  # fmt: skip
    assert all(r.keep == ("first", "last") and r.gemms == ("forward", "input_grad", "weight_grad")
               for r in (tw, dl, mx, nv))  # fmt: skip
    assert get_recipe("FP8_Delayed", history_len=16).history_len == 16
    assert dl.reduce_amax
    assert recipe_spec(get_recipe(dl, reduce_amax=False)) == "fp8-delayed:reduce_amax=false"
    assert get_recipe("mxfp8", quantize_weight_grad=False).gemms == ("forward", "input_grad")
    assert get_recipe("nvfp4", hadamard=True, keep=[]).keep == ()
    assert get_recipe("fp8-tensorwise", backward_format="e4m3").backward_format == "e4m3fn"
    assert get_recipe(tw, margin=2).margin == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        tw.margin = 3  # frozen
    ds = DelayedScaling.from_recipe("fp8-delayed", backward=True)
    assert (ds.format.name, ds.history_len) == ("e5m2", 1024)
    assert json.loads(json.dumps(nv.as_dict()))["keep"] == ["first", "last"]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: get_recipe("fp8"), "unknown recipe 'fp8'.*fp8-tensorwise, fp8-delayed, mxfp8, nvfp4"),
        (lambda: get_recipe("mxfp9"), "did you mean 'mxfp8'"),
        (lambda: get_recipe("mxfp8", block=16), "unknown field of recipe 'mxfp8' 'block'"),
        (lambda: get_recipe("fp8-delayed", history_len=0), "history_len must be an integer >= 1"),
        (lambda: get_recipe("fp8-delayed", amax_compute_algo="mean"), "unknown amax_compute_algo"),
        (lambda: get_recipe("fp8-tensorwise", history_len=8), "history_len applies only to delayed"),
        (lambda: get_recipe("mxfp8", margin=1), "margin applies only to tensorwise / delayed"),
        (lambda: get_recipe("mxfp8", hadamard=True), "hadamard applies only to nvfp4"),
        (lambda: get_recipe("mxfp8", weight_2d=True), "weight_2d applies only to nvfp4"),
        (lambda: get_recipe("fp8-tensorwise", reduce_amax=False), "reduce_amax applies only to delayed"),
        (lambda: get_recipe("fp8-delayed", reduce_amax="no"), "reduce_amax must be True or False"),
        (lambda: get_recipe("mxfp8", scale_rule="round"), "unknown scale_rule.*floor, rceil"),
        (lambda: get_recipe("nvfp4", scale_rule="rceil"), "scale_rule must be None"),
        (lambda: get_recipe("mxfp8", forward_format="e4m3fn"), "unknown forward_format.*mxfp8_e4m3"),
        (lambda: get_recipe("mxfp8", backward_format="nvfp4"), "both be nvfp4 or both MX"),
        (lambda: get_recipe("fp8-tensorwise", forward_format="e9m9"), "forward_format: unknown format"),
        (lambda: get_recipe("fp8-tensorwise", margin=-1), "margin must be an integer >= 0"),
        (lambda: get_recipe("fp8-tensorwise", amax_epsilon=-1.0), "amax_epsilon must be"),
        (lambda: get_recipe("nvfp4", keep="first"), "keep must be a tuple"),
        (lambda: get_recipe("nvfp4", quantize_forward=1), "quantize_forward must be True or False"),
        (lambda: get_recipe("nvfp4", grad_rounding="sr2"), "unknown grad_rounding"),
        (lambda: get_recipe("nvfp4", compute_dtype="fp16"), "unknown compute_dtype"),
        (lambda: current_scale(-1.0, "e4m3fn"), "amax must be a number >= 0"),
        (lambda: current_scale("x", "e4m3fn"), "amax must be a number"),
        (lambda: current_scale(1.0, "e4m3fn", margin=0.5), "margin must be an integer >= 0"),
        (lambda: current_scale(1.0, "e4m3fn", eps=math.nan), "eps must be"),
        (lambda: current_scale(1.0, "fp9"), "unknown format"),
        (lambda: quantize_tensorwise([1.0], "e4m3fn", 0.0), "scale must be a finite number > 0"),
        (lambda: quantize_tensorwise([1.0], "e4m3fn", math.inf), "scale must be"),
        (lambda: quantize_tensorwise([1.0], "e4m3fn", 1e300), "not a finite positive float32"),
        (lambda: quantize_tensorwise(["a"], "e4m3fn", 1.0), "x must be a float array"),
        (lambda: DelayedScaling(history_len=0), "history_len must be an integer >= 1"),
        (lambda: DelayedScaling(amax_compute_algo="avg"), "unknown amax_compute_algo 'avg'"),
        (lambda: DelayedScaling(margin=-2), "margin must be"),
        (lambda: DelayedScaling().update([1.0, 2.0]), "one number per tensor"),
        (lambda: DelayedScaling().update(-3.0), "amax must be a number >= 0"),
        (lambda: DelayedScaling.from_recipe("mxfp8"), "needs a delayed-scaling recipe"),
    ],
)
def test_errors(call, match):
    with pytest.raises(PolyampError, match=match):
        call()


def _loaded(**change):
    ds = DelayedScaling("e4m3fn", history_len=3)
    ds.update(2.0)
    state = {**ds.state_dict(), **change}
    DelayedScaling("e4m3fn", history_len=3).load_state_dict(state)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"extra": 1}, "unknown DelayedScaling state field 'extra'"),
        ({"history_len": 4}, "saved with history_len=4"),
        ({"format": "e5m2"}, "saved with format='e5m2'"),
        ({"margin": 1}, "saved with margin=1"),
        ({"amax_compute_algo": "most_recent"}, "saved with amax_compute_algo"),
        ({"scale": 0.1}, "scale must be a finite float32 > 0"),
        ({"scale": -1.0}, "scale must be"),
        ({"history": [1.0, 2.0]}, "history must be a list of 3"),
        ({"history": [0.0, 0.1, 1.0]}, "history holds 0.1"),
        ({"history": [0.0, -1.0, 1.0]}, "history holds -1.0"),
        ({"steps": -1}, "steps must be an integer >= 0"),
    ],
)
def test_state_errors(change, match):
    with pytest.raises(PolyampError, match=match):
        _loaded(**change)


def test_state_errors_shape():
    ds = DelayedScaling()
    with pytest.raises(PolyampError, match="expected a dict"):
        ds.load_state_dict([1, 2])
    with pytest.raises(PolyampError, match="lacks"):
        ds.load_state_dict({"scale": 1.0})
    _loaded(history=[0.0, math.nan, math.inf])  # non-finite amaxes are valid history


def test_what_each_front_end_refuses_is_said_in_one_place():
    from polyamp.recipes import refusal

    assert refusal(get_recipe("mxfp8"), "torch") is None and refusal(get_recipe("mxfp8"), "jax") is None
    assert refusal(get_recipe("fp8-delayed"), "torch") is None
    assert refusal(get_recipe("fp8-delayed"), "jax") is None and refusal(get_recipe("nvfp4"), "jax") is None
    assert refusal(get_recipe("nvfp4", grad_rounding="nearest"), "jax") is None
    assert refusal(get_recipe("nvfp4", hadamard=True), "torch") is None
    assert refusal(get_recipe("nvfp4", hadamard=True), "jax") is None
    assert refusal(get_recipe("nvfp4"), "tensorflow") is None
    assert refusal(get_recipe("fp8-delayed"), "tensorflow") is None
    for framework in ("tensorflow", "mxnet"):
        assert refusal(get_recipe("nvfp4", hadamard=True), framework) is None
    assert "not in paddle's" in refusal(get_recipe("nvfp4"), "paddle")


@pytest.mark.parametrize("spec", ["mxfp8", "mxfp8:scale_rule=floor", "nvfp4:keep=:grad_rounding=nearest",
                                  "fp8-delayed:history_len=16:amax_compute_algo=most_recent",
                                  "nvfp4:keep=first|blocks*", "fp8-tensorwise:compute_dtype=fp32:margin=2"])
def test_a_recipe_spelling_round_trips(spec):
    from polyamp.recipes import parse_recipe, recipe_spec

    r = parse_recipe(spec)
    assert recipe_spec(r) == spec and parse_recipe(recipe_spec(r)) == r
    assert "," not in recipe_spec(r)  # fits --policies' comma-separated list


def test_recipe_spelling_values_and_errors():
    from polyamp.recipes import parse_recipe

    assert parse_recipe("nvfp4:keep=").keep == ()
    assert parse_recipe("nvfp4:hadamard=true").hadamard is True
    assert parse_recipe("fp8-tensorwise:amax_epsilon=1e-12").amax_epsilon == 1e-12
    with pytest.raises(PolyampError, match="is not field=value"):
        parse_recipe("mxfp8:floor")
    with pytest.raises(PolyampError, match="field of recipe 'mxfp8'"):
        parse_recipe("mxfp8:rule=floor")
    with pytest.raises(PolyampError, match="scale_rule"):
        parse_recipe("mxfp8:scale_rule=round")
    with pytest.raises(PolyampError, match="unknown recipe"):
        parse_recipe("mxfp9")
