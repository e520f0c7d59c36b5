"""The loss-scale state machine: presets against the real torch GradScaler and Keras 3
LossScaleOptimizer, against the documented rules of jmp, DeepSpeed and MXNet, the guard, the
round trips and the validation."""

import dataclasses
import json
import math
import os
import pickle
import random
import warnings

import numpy as np
import pytest
from frameworks import require

from polyamp.errors import NonFiniteError, PolyampError
from polyamp.scaling import (
    PRESETS,
    DynamicLossScale,
    LossScaleState,
    NoLossScale,
    StaticLossScale,
    loss_scale_from_dict,
)

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

below_one = pytest.mark.filterwarnings("ignore:the loss scale fell below 1:RuntimeWarning")


def preset(name, **changes):
    return dataclasses.replace(DynamicLossScale.preset(name), **changes)


def trajectory(ls, flags):
    """``state.scale`` after each update."""
    state, scales = ls.init(), []
    for finite in flags:
        state = ls.update(state, finite)
        scales.append(state.scale)
    return scales


def random_flags(seed, n, p_overflow):
    rng = random.Random(seed)
    return [rng.random() >= p_overflow for _ in range(n)]


# Flag sequences for the real-framework comparisons: random mixes, a run of overflows long enough
# to halve the float32 scale to exactly 0, and enough clean steps to see growth.
SEQUENCES = {
    "mixed": random_flags(0, 300, 0.3),
    "rare-overflows": random_flags(1, 300, 0.05),
    "to-zero": random_flags(2, 60, 0.5) + [False] * 180 + [True] * 40,
}


# -- torch.amp.GradScaler ------------------------------------------------------------------------


def torch_scales(flags, **scaler_kwargs):
    """Drive a real GradScaler; inject inf into a gradient on the non-finite steps."""
    torch = require("torch")
    model = torch.nn.Linear(3, 2, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stepped = []
    optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    x = torch.full((1, 3), 2.0**-8)  # small, so gradients stay finite up to a scale of 2^127
    scales = []
    for finite in flags:
        before = len(stepped)
        optimizer.zero_grad()
        scaler.scale(model(x).sum()).backward()
        if not finite:
            model.weight.grad[0, 1] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        assert (len(stepped) > before) == finite  # torch saw the same flag
        scales.append(scaler.get_scale())
    return scales


@below_one
@pytest.mark.parametrize("interval", [3, 5])
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_torch_preset_matches_gradscaler(name, interval):
    flags = SEQUENCES[name]
    expected = torch_scales(flags, growth_interval=interval)
    assert trajectory(preset("torch", growth_interval=interval), flags) == expected
    assert any(b > a for a, b in zip(expected, expected[1:]))  # growth was exercised
    if name == "to-zero":
        assert expected[-1] == 0.0  # fp32 halving ends at exactly 0 and never recovers


def test_torch_preset_growth_stops_below_float32_overflow():
    flags = [True] * 12 + [False] + [True] * 12
    expected = torch_scales(flags, init_scale=2.0**125, growth_interval=2)
    assert trajectory(preset("torch", init_scale=2.0**125, growth_interval=2), flags) == expected
    assert max(expected) == 2.0**127


@below_one
def test_torch_preset_matches_gradscaler_at_the_default_interval():
    flags = [False] * 3 + random_flags(3, 900, 0.01) + [True] * 2000 + [False] + [True] * 2100
    expected = torch_scales(flags)
    assert trajectory(DynamicLossScale.preset("torch"), flags) == expected
    growths = [i for i in range(1, len(flags)) if expected[i] > expected[i - 1]]
    overflows = [i for i, finite in enumerate(flags) if not finite]
    assert growths == [overflows[-2] + 2000, overflows[-1] + 2000]  # the 2000th clean step


# -- Keras 3 LossScaleOptimizer (TensorFlow backend) --------------------------------------------


@pytest.fixture(scope="module")
def keras():
    keras = require("keras")

    assert keras.backend.backend() == "tensorflow", "these tests compare against the TF backend"
    return keras


def keras_scales(keras, flags, **optimizer_kwargs):
    """Drive a real LossScaleOptimizer with finite or inf gradients."""
    variable = keras.Variable(np.zeros(3, np.float32))
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), **optimizer_kwargs)
    finite_grad = np.ones(3, np.float32)
    inf_grad = np.array([1.0, np.inf, 1.0], np.float32)
    scales = []
    for finite in flags:
        before = int(optimizer.iterations.numpy())
        optimizer.apply([finite_grad if finite else inf_grad], [variable])
        assert (int(optimizer.iterations.numpy()) > before) == finite
        scales.append(float(optimizer.dynamic_scale.numpy()))
    return scales


@below_one
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_keras_preset_matches_loss_scale_optimizer(keras, name):
    flags = SEQUENCES[name]
    expected = keras_scales(keras, flags, dynamic_growth_steps=3)
    assert trajectory(preset("keras", growth_interval=3), flags) == expected
    assert any(b > a for a, b in zip(expected, expected[1:]))
    if name == "to-zero":
        assert expected[-1] == 0.0


def test_keras_preset_grows_to_inf_and_stays(keras):
    flags = [True] * 8 + [False] + [True] * 4
    expected = keras_scales(keras, flags, initial_scale=2.0**126, dynamic_growth_steps=2)
    assert trajectory(preset("keras", init_scale=2.0**126, growth_interval=2), flags) == expected
    assert expected[3:] == [math.inf] * (len(flags) - 3)  # Keras 3 does not guard growth


@below_one
def test_keras_flushes_a_subnormal_scale_to_zero_where_torch_does_not():
    # From 2^15, halving reaches 2^-126 (the smallest normal float32) after 141 overflows; the
    # next result is subnormal: TensorFlow flushes it to 0, torch keeps halving to 2^-149.
    keras_run = trajectory(DynamicLossScale.preset("keras"), [False] * 142)
    torch_run = trajectory(preset("torch", init_scale=2.0**15), [False] * 165)
    assert keras_run[-2:] == [2.0**-126, 0.0]
    assert torch_run[140] == 2.0**-126 and torch_run[-2:] == [2.0**-149, 0.0]


# -- jmp, DeepSpeed, MXNet: independent re-statements of their documented rules ----------------


def jmp_rule(flags, scale=2.0**15, period=2000, factor=2.0, min_scale=1.0):
    """jmp/_src/loss_scale.py DynamicLossScale docstring: counter += 1 on finite steps; at
    counter == period: counter = 0, scale = first_finite(scale * factor, scale); on non-finite:
    counter = 0, scale = max(min_loss_scale, scale / factor). The scale is float32."""
    counter, out = 0, []
    with np.errstate(over="ignore"):
        for finite in flags:
            if finite:
                counter += 1
                if counter == period:
                    counter = 0
                    grown = np.float32(scale) * np.float32(factor)
                    scale = float(grown) if np.isfinite(grown) else scale
            else:
                counter = 0
                scale = max(min_scale, float(np.float32(scale) / np.float32(factor)))
            out.append(scale)
    return out


def deepspeed_rule(flags, scale=2.0**16, window=1000, min_scale=1.0, hysteresis=2, consecutive=False):
    """deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale: on overflow, halve
    (floored at min_scale) if cur_hysteresis == 1, else cur_hysteresis -= 1; last_overflow_iter =
    cur_iter. On a clean step: refill hysteresis if consecutive_hysteresis; double (and refill)
    when stable_interval = cur_iter - last_overflow_iter - 1 is a positive multiple of the
    window. cur_iter += 1 every step."""
    cur_iter, last_overflow, left, out = 0, -1, hysteresis, []
    with np.errstate(over="ignore"):
        for finite in flags:
            if not finite:
                if left == 1:
                    scale = max(scale / 2, min_scale)
                else:
                    left -= 1
                last_overflow = cur_iter
            else:
                if consecutive:
                    left = hysteresis
                stable = cur_iter - last_overflow - 1
                if stable > 0 and stable % window == 0:
                    left = hysteresis
                    scale *= 2
            cur_iter += 1
            out.append(scale)
    return out


def mxnet_rule(flags, window=2000, scale=2.0**16, max_scale=2.0**24):
    """python/mxnet/contrib/amp/loss_scaler.py LossScaler.has_overflow: first loss_scale =
    next_loss_scale; then on overflow next = loss_scale / 2 and unskipped = 0, else unskipped += 1;
    when unskipped == window: unskipped = 0, next = min(max, loss_scale * 2). The user-visible
    (and applied) scale is loss_scale."""
    current, upcoming, unskipped, out = scale, scale, 0, []
    for finite in flags:
        current = upcoming
        if finite:
            unskipped += 1
        else:
            upcoming, unskipped = current / 2, 0
        if unskipped == window:
            upcoming, unskipped = min(max_scale, current * 2), 0
        out.append(current)
    return out


@below_one
@pytest.mark.parametrize("seed", range(4))
def test_jmp_preset_follows_jmp(seed):
    flags = random_flags(seed, 400, 0.2) + [False] * 40 + [True] * 12
    assert trajectory(preset("jmp", growth_interval=4), flags) == jmp_rule(flags, period=4)
    flags = [True] * 2000 + [False] * 20 + [True] * 2000
    assert trajectory(DynamicLossScale.preset("jmp"), flags) == jmp_rule(flags)
    near_max = preset("jmp", init_scale=2.0**126, growth_interval=1)
    assert trajectory(near_max, [True] * 3) == jmp_rule([True] * 3, 2.0**126, 1) == [2.0**127] * 3


def test_jmp_preset_hand_trajectory():
    ls = preset("jmp", growth_interval=3)  # period 3 for brevity; floor min_loss_scale = 1
    flags = [False, True, True, True, False] + [False] * 16
    scales = trajectory(ls, flags)
    assert scales[:5] == [2.0**14, 2.0**14, 2.0**14, 2.0**15, 2.0**14]
    assert scales[-4:] == [2.0, 1.0, 1.0, 1.0]


@below_one
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_deepspeed_preset_follows_deepspeed(seed, consecutive):
    ls = preset("deepspeed", growth_interval=4, consecutive_hysteresis=consecutive)
    flags = random_flags(seed, 500, 0.15) + [False] * 30 + [True] * 20
    assert trajectory(ls, flags) == deepspeed_rule(flags, window=4, consecutive=consecutive)
    flags = [False] + [True] * 1500 + [False] * 3 + [True] * 2100
    expected = deepspeed_rule(flags, consecutive=consecutive)
    assert trajectory(preset("deepspeed", consecutive_hysteresis=consecutive), flags) == expected


def test_deepspeed_preset_hand_trajectory():
    ls = DynamicLossScale.preset("deepspeed")
    s = 2.0**16
    # hysteresis 2: the first overflow only uses up hysteresis, the next ones halve
    assert trajectory(ls, [False, False, False]) == [s, s / 2, s / 4]
    # the first growth after the start needs window + 1 = 1001 clean steps (stable_interval > 0)
    grown = trajectory(ls, [True] * 2001)
    assert grown[999] == s and grown[1000] == 2 * s and grown[1999] == 2 * s and grown[2000] == 4 * s
    # growth refills hysteresis (consecutive_hysteresis False): after it, one overflow is free
    state = ls.init()
    for finite in [False, False] + [True] * 1001 + [False]:
        state = ls.update(state, finite)
    assert state.scale == s and state.hysteresis_left == 1
    # floored at min_loss_scale = 1 (DeepSpeed would raise there; the guard is separate)
    assert trajectory(ls, [False] * 30)[-1] == 1.0
    # DeepSpeed before the stable_interval change grew at the window-th clean step
    assert trajectory(preset("deepspeed", growth_delay=0), [True] * 1000)[-1] == 2 * s


@pytest.mark.parametrize("seed", range(3))
def test_mxnet_preset_follows_mxnet(seed):
    flags = random_flags(seed, 500, 0.1) + [True] * 12
    ls = preset("mxnet", growth_interval=5)
    assert trajectory(ls, flags) == mxnet_rule(flags, window=5)
    capped = preset("mxnet", init_scale=2.0**23, growth_interval=2)
    assert trajectory(capped, [True] * 9) == mxnet_rule([True] * 9, 2, 2.0**23)


def test_mxnet_preset_hand_trajectory():
    ls = preset("mxnet", growth_interval=2)
    s = 2.0**16
    # each new scale takes effect one step late: after the first overflow loss_scale is still
    # 2^16; the growth decided at the 2nd clean step shows after the 3rd
    scales = trajectory(ls, [False, True, True, True, True, False, True])
    assert scales == [s, s / 2, s / 2, s, s, 2 * s, s]


# -- polyamp's defaults and DESIGN's claims -----------------------------------------------------


def test_polyamp_defaults():
    ls = DynamicLossScale.preset("polyamp")
    assert ls == DynamicLossScale()
    assert (ls.init_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval) == (
        2.0**16,
        2.0,
        0.5,
        2000,
    )
    assert (ls.hysteresis, ls.min_scale, ls.max_scale) == (1, 1.0, 2.0**24)
    assert min(trajectory(ls, [False] * 40)) == 1.0
    assert trajectory(DynamicLossScale(init_scale=2.0**24, growth_interval=1), [True] * 3) == [2.0**24] * 3


@below_one
def test_with_two_percent_overflows_torch_reaches_zero_and_polyamp_keeps_its_floor():
    flags = random_flags(0, 9000, 0.02)
    torch_run = trajectory(DynamicLossScale.preset("torch"), flags)
    polyamp_run = trajectory(DynamicLossScale(), flags)
    assert 0.0 in torch_run and torch_run[-1] == 0.0
    assert min(polyamp_run) >= 1.0 and max(polyamp_run) > 1.0


def test_hysteresis_and_consecutive_hysteresis():
    ls = DynamicLossScale(init_scale=64.0, hysteresis=3, growth_interval=100)
    assert trajectory(ls, [False] * 4) == [64.0, 64.0, 32.0, 16.0]
    refill = dataclasses.replace(ls, consecutive_hysteresis=True)
    assert trajectory(refill, [False, False, True] * 3) == [64.0] * 9
    assert trajectory(ls, [False, False, True] * 2) == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0]


def test_warns_once_when_the_scale_falls_below_one():
    ls = preset("torch", init_scale=2.0)
    state = ls.update(ls.init(), False)
    assert state.scale == 1.0
    with pytest.warns(RuntimeWarning, match="fell below 1"):
        state = ls.update(state, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            state = ls.update(state, False)
        trajectory(DynamicLossScale(), [False] * 30)  # the floor keeps polyamp's default quiet
    assert state.scale == 2.0**-6


def test_no_and_static_loss_scale_keep_the_scale_and_count_skips():
    for ls, scale in ((NoLossScale(), 1.0), (StaticLossScale(128.0), 128.0)):
        state = ls.init()
        for finite in [True, False, False, True, False]:
            state = ls.update(state, finite)
        assert state.scale == scale
        assert (state.steps, state.skipped, state.skipped_in_a_row, state.good_steps) == (
            5,
            3,
            1,
            0,
        )


def test_update_is_pure():
    ls = DynamicLossScale(growth_interval=2)
    state = ls.init()
    after = ls.update(state, False)
    assert state == ls.init() and ls.update(state, False) == after
    assert (after.scale, after.skipped_in_a_row, after.steps) == (2.0**15, 1, 1)


# -- the guard ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:a step was skipped")
@pytest.mark.parametrize("ls", [DynamicLossScale(max_consecutive_skips=3), NoLossScale(3)])
def test_guard_raises_after_n_consecutive_skips_and_not_before(ls):
    state = ls.init()
    for _ in range(2):
        state = ls.update(state, False)
        ls.check(state, where="decoder.out")
    state = ls.update(ls.update(state, True), False)  # a finite step resets the count
    ls.check(state)
    state = ls.update(state, False)
    ls.check(state)
    state = ls.update(state, False)
    with pytest.raises(NonFiniteError) as err:
        ls.check(state, where="decoder.out")
    message = str(err.value)
    assert "3 consecutive steps" in message and "'decoder.out'" in message
    assert f"loss scale {state.scale:g}" in message
    assert "learning rate" in message
    # the advice fits the run: "train in bf16" only where a loss scale is in use (fp16)
    assert ("train in bf16" in message) == (ls.kind != "none")
    assert isinstance(err.value, PolyampError)


def test_guard_without_where_and_disabled():
    ls = StaticLossScale(8.0, max_consecutive_skips=1)
    with pytest.raises(NonFiniteError, match="not known"):
        ls.check(ls.update(ls.init(), False))
    off = DynamicLossScale(max_consecutive_skips=None)
    state = off.init()
    for _ in range(500):
        state = off.update(state, False)
    off.check(state, where="x")
    assert state.skipped_in_a_row == 500 and state.scale == off.min_scale


# -- round trips --------------------------------------------------------------------------------


FULL_STATE = LossScaleState(
    scale=0.375,
    good_steps=-1,
    hysteresis_left=2,
    skipped_in_a_row=3,
    steps=77,
    skipped=9,
    next_scale=0.75,
)
CUSTOM = DynamicLossScale(
    init_scale=3.0,
    growth_factor=1.5,
    backoff_factor=0.25,
    growth_interval=7,
    hysteresis=3,
    min_scale=0.25,
    max_scale=1e6,
    max_consecutive_skips=None,
    consecutive_hysteresis=True,
    growth_delay=2,
    one_step_lag=True,
    allow_inf_scale=True,
    scale_dtype="float32-ftz",
)
CONFIGS = [CUSTOM, NoLossScale(7), StaticLossScale(0.5, max_consecutive_skips=None)] + [
    DynamicLossScale.preset(name) for name in PRESETS
]


def same_fields(a, b):
    assert type(a) is type(b)
    for field in dataclasses.fields(a):
        assert getattr(a, field.name) == getattr(b, field.name), field.name


def test_state_round_trips_every_field():
    data = FULL_STATE.as_dict()
    assert set(data) == {f.name for f in dataclasses.fields(LossScaleState)}
    for copy in (
        LossScaleState.from_dict(data),
        LossScaleState.from_dict(json.loads(json.dumps(data))),
        pickle.loads(pickle.dumps(FULL_STATE)),
        LossScaleState(**{k: np.asarray(v) for k, v in data.items() if v is not None}).on_host(),
    ):
        same_fields(copy, FULL_STATE)


def test_state_from_dict_fills_defaults_and_rejects_unknown_fields():
    assert LossScaleState.from_dict({"scale": 2}) == LossScaleState(scale=2.0)
    with pytest.raises(PolyampError, match="'growth_tracker'"):
        LossScaleState.from_dict({"scale": 2.0, "growth_tracker": 1})
    with pytest.raises(PolyampError, match="'scale'"):
        LossScaleState.from_dict({"good_steps": 1})


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.kind}")
def test_config_round_trips_every_field(config):
    data = config.as_dict()
    assert set(data) == {"kind"} | {f.name for f in dataclasses.fields(config)}
    for copy in (
        type(config).from_dict(data),
        loss_scale_from_dict(data),
        loss_scale_from_dict(json.loads(json.dumps(data))),
        pickle.loads(pickle.dumps(config)),
    ):
        same_fields(copy, config)
        assert copy == config


def test_min_scale_survives_the_round_trip():
    config = dataclasses.replace(DynamicLossScale.preset("jmp"), min_scale=4.0)
    copy = loss_scale_from_dict(json.loads(json.dumps(config.as_dict())))
    assert copy.min_scale == 4.0 and trajectory(copy, [False] * 20)[-1] == 4.0


@below_one
@pytest.mark.parametrize("name", PRESETS)
def test_resuming_from_a_checkpoint_continues_the_same_trajectory(name):
    flags = random_flags(5, 400, 0.2)
    ls = preset(name, growth_interval=3)
    state = ls.init()
    for finite in flags[:200]:
        state = ls.update(state, finite)
    checkpoint = pickle.loads(pickle.dumps({"config": ls.as_dict(), "state": state.as_dict()}))
    resumed = loss_scale_from_dict(checkpoint["config"])
    state = LossScaleState.from_dict(checkpoint["state"])
    scales = []
    for finite in flags[200:]:
        state = resumed.update(state, finite)
        scales.append(state.scale)
    assert scales == trajectory(ls, flags)[200:]


def test_from_dict_errors():
    with pytest.raises(PolyampError, match="'bogus'"):
        DynamicLossScale.from_dict({"kind": "dynamic", "bogus": 1})
    with pytest.raises(PolyampError, match="'static'"):
        DynamicLossScale.from_dict(StaticLossScale(2.0).as_dict())
    with pytest.raises(PolyampError, match="'scaler'"):
        loss_scale_from_dict({"kind": "scaler"})
    for bad in (None, [("scale", 1.0)]):
        with pytest.raises(PolyampError, match="expected a dict"):
            LossScaleState.from_dict(bad)
        with pytest.raises(PolyampError, match="expected a dict"):
            DynamicLossScale.from_dict(bad)
        with pytest.raises(PolyampError, match="loss-scale kind"):
            loss_scale_from_dict(bad)


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("growth_factor", 1.0),
        ("growth_factor", 0.5),
        ("growth_factor", math.inf),
        ("growth_factor", "2"),
        ("backoff_factor", 0.0),
        ("backoff_factor", 1.0),
        ("backoff_factor", 1.5),
        ("growth_interval", 0),
        ("growth_interval", 2.5),
        ("growth_interval", True),
        ("hysteresis", 0),
        ("growth_delay", -1),
        ("init_scale", 0.0),
        ("init_scale", -1.0),
        ("init_scale", math.inf),
        ("init_scale", math.nan),
        ("init_scale", 2.0**30),
        ("min_scale", -1.0),
        ("min_scale", 2.0**25),
        ("max_scale", 0.5),
        ("max_consecutive_skips", 0),
        ("one_step_lag", 1),
        ("scale_dtype", "float16"),
    ],
)
def test_bad_config_is_rejected_with_the_received_value(field, value):
    with pytest.raises(PolyampError) as err:
        DynamicLossScale(**{field: value})
    message = str(err.value)
    if (field, value) == ("min_scale", 2.0**25):
        # reported on max_scale, the field that no longer fits, naming the min_scale received
        assert "max_scale must be" in message and f"min_scale={value!r}" in message
    else:
        assert f"{field} must be" in message and f"received {value!r}" in message


def test_bad_static_scale_preset_and_guard():
    for scale in (0.0, -2.0, math.inf):
        with pytest.raises(PolyampError, match="scale must be a finite number > 0"):
            StaticLossScale(scale)
    with pytest.raises(PolyampError, match=r"'apex'.*polyamp, torch, keras, jmp, deepspeed, mxnet"):
        DynamicLossScale.preset("apex")
    with pytest.raises(PolyampError, match="max_consecutive_skips must be None or >= 1"):
        NoLossScale(max_consecutive_skips=-3)
    assert DynamicLossScale.preset("TORCH") == DynamicLossScale.preset("torch")


# -- the traced form (for jit / tf.function) -------------------------------------------------------
@pytest.mark.parametrize("name", ["polyamp", "torch", "keras", "jmp", "deepspeed"])
def test_update_arrays_equals_update(name):
    from polyamp.scaling import state_arrays, state_from_arrays

    ls = dataclasses.replace(DynamicLossScale.preset(name), growth_interval=3)
    rng = np.random.default_rng(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for p_finite in (0.3, 0.7, 0.95):
            state = ls.init()
            arrays = state_arrays(state, np)
            for finite in rng.random(600) < p_finite:
                state = ls.update(state, bool(finite))
                arrays = ls.update_arrays(arrays, np.asarray(finite), np)
                if state.scale > 2.0**127:  # float64-scaled presets outgrow a float32 scale
                    break
                assert dataclasses.replace(state_from_arrays(arrays), next_scale=None) == state


def test_update_arrays_runs_under_jax_jit():
    jax = require("jax")
    jnp = jax.numpy

    from polyamp.scaling import state_arrays, state_from_arrays

    ls = DynamicLossScale(growth_interval=2, hysteresis=2)
    step = jax.jit(lambda s, f: ls.update_arrays(s, f, jnp))
    state, arrays = ls.init(), state_arrays(ls.init(), jnp)
    for finite in [True, False, False, True, True, True, False, True, True]:
        state = ls.update(state, finite)
        arrays = step(arrays, jnp.asarray(finite))
        assert state_from_arrays(arrays) == state
    with pytest.raises(PolyampError, match="one_step_lag"):
        DynamicLossScale.preset("mxnet").update_arrays(arrays, jnp.asarray(True), jnp)


# -- issue 11: presets with overrides, DeepSpeed's two rules, validated states and flags -----------


def test_a_preset_takes_overrides_and_refuses_unknown_fields():
    ls = DynamicLossScale.preset("torch", growth_interval=10)
    assert ls == dataclasses.replace(DynamicLossScale.preset("torch"), growth_interval=10)
    with pytest.raises(PolyampError, match="did you mean 'growth_interval'"):
        DynamicLossScale.preset("torch", growth_intervall=10)
    with pytest.raises(PolyampError, match="growth_interval must be an integer >= 1; received 0"):
        DynamicLossScale.preset("jmp", growth_interval=0)


@below_one
@pytest.mark.parametrize("seed", range(3))
def test_deepspeed_fp16_preset_follows_the_non_zero_optimizer(seed):
    """DeepSpeed's FP16_Optimizer (fused_optimizer.py _update_scale) has no hysteresis: every
    overflow halves; growth as in the ZeRO rule (stable_interval a positive multiple of the window)."""
    ls = DynamicLossScale.preset("deepspeed-fp16", growth_interval=4)
    flags = random_flags(seed, 500, 0.15) + [False] * 30 + [True] * 20
    assert trajectory(ls, flags) == deepspeed_rule(flags, window=4, hysteresis=1)
    zero = DynamicLossScale.preset("deepspeed")
    assert trajectory(DynamicLossScale.preset("deepspeed-fp16"), [False]) == [2.0**15]
    assert trajectory(zero, [False]) == [2.0**16]  # ZeRO's hysteresis 2 forgives the first


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"scale": "big"}, "'scale' must be a number >= 0 .*received 'big'"),
        ({"scale": -1.0}, "'scale' must be a number >= 0 .*received -1.0"),
        ({"scale": math.nan}, "'scale' must be"),
        ({"scale": True}, "'scale' must be"),
        ({"scale": 1.0, "steps": -1}, "'steps' must be an integer >= 0; received -1"),
        ({"scale": 1.0, "good_steps": 1.5}, "'good_steps' must be an integer"),
        ({"scale": 1.0, "hysteresis_left": 0}, "'hysteresis_left' must be an integer >= 1"),
        ({"scale": 1.0, "next_scale": "x"}, "'next_scale' must be .* or None"),
    ],
)
def test_a_bad_saved_state_is_refused_naming_the_field(data, match):
    with pytest.raises(PolyampError, match=match):
        LossScaleState.from_dict(data)


def test_a_saved_state_accepts_numpy_numbers_inf_and_zero():
    state = LossScaleState.from_dict({"scale": np.float32(0.0), "steps": np.int64(3), "next_scale": math.inf})
    assert state == LossScaleState(scale=0.0, steps=3, next_scale=math.inf)


@pytest.mark.parametrize("ls", [DynamicLossScale(), NoLossScale(), StaticLossScale(4.0)])
@pytest.mark.parametrize("finite", [np.array([True, False]), "yes", 1.0, np.array([1])])
def test_update_refuses_a_flag_that_is_not_one_bool(ls, finite):
    with pytest.raises(PolyampError, match="finite must be a bool"):
        ls.update(ls.init(), finite)


def test_update_takes_one_element_bool_arrays_and_refuses_a_foreign_state():
    ls = DynamicLossScale()
    assert ls.update(ls.init(), np.array([False])).scale == 2.0**15
    assert ls.update(ls.init(), np.bool_(True)).good_steps == 1
    with pytest.raises(PolyampError, match="expected a LossScaleState .* received dict"):
        ls.update({"scale": 1.0}, True)


def test_update_arrays_with_factor_3_equals_update_for_float32_scales_only():
    """What update_arrays' docstring promises: equal for float32 scale dtypes; the default float64
    host scale differs once a scale needs more than float32's 24 bits."""
    from polyamp.scaling import state_arrays, state_from_arrays

    flags = random_flags(5, 400, 0.2)
    for dtype, equal in (("float32", True), ("float32-ftz", True), ("float64", False)):
        ls = DynamicLossScale(init_scale=3.0, growth_factor=3.0, growth_interval=2, min_scale=0.0,
                              max_scale=math.inf, scale_dtype=dtype)  # fmt: skip
        state, arrays, same = ls.init(), state_arrays(ls.init(), np), True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for finite in flags:
                state = ls.update(state, finite)
                arrays = ls.update_arrays(arrays, np.asarray(finite), np)
                same = same and state_from_arrays(arrays) == state
        assert same == equal, dtype


def test_a_custom_loss_scale_missing_a_member_is_refused_when_passed_in():
    import polyamp as pa
    from polyamp.scaling import LOSS_SCALE_MEMBERS, LossScale

    class Partial:  # the three members the step calls, not what checkpoints and traced steps use
        def init(self):
            return LossScaleState(scale=8.0)

        def update(self, state, finite):
            return state

        def check(self, state, where=None):
            pass

    with pytest.raises(PolyampError, match="Partial lacks kind, max_consecutive_skips, update_arrays, "
                                           "check_traceable, as_dict"):  # fmt: skip
        pa.MixedPrecision("fp16-mixed", loss_scale=Partial())

    @dataclasses.dataclass(frozen=True)
    class Halving(StaticLossScale):  # a subclass has every member
        scale: float = 8.0

    mp = pa.MixedPrecision("fp16-mixed", loss_scale=Halving())
    assert mp.current_scale == 8.0 and isinstance(mp.loss_scale, LossScale)
    assert all(hasattr(DynamicLossScale(), m) for m in LOSS_SCALE_MEMBERS)
