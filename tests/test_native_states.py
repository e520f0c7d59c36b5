"""Migrating loss-scale checkpoints between polyamp and the native scalers (polyamp.native).

Each direction is checked by trajectory: run the native scaler (or polyamp) for some steps on a fixed
pattern of finite / overflowing steps, migrate, continue both, and compare the scales step by step.
torch and Keras are the real scalers; jmp is the real package where installed; DeepSpeed (too heavy to
install) is its documented update rule, restated below from its source.
"""

import dataclasses
import math
import os
import random
import types

import pytest
from frameworks import require

from polyamp.errors import PolyampError
from polyamp.native import KINDS, from_native, to_native
from polyamp.scaling import DynamicLossScale, LossScaleState, StaticLossScale

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

pytestmark = pytest.mark.filterwarnings("ignore:the loss scale fell below 1:RuntimeWarning")

# 25% overflows, growth every 3 clean steps: growths and backoffs both happen often
_rng = random.Random(11)
FLAGS = [_rng.random() >= 0.25 for _ in range(90)]
CUT = 31  # the migration point; chosen so that the growth counter is mid-interval there


def preset(name, **changes):
    return dataclasses.replace(DynamicLossScale.preset(name), **changes)


def polyamp_scales(config, state, flags):
    """Continue a polyamp loss scale from ``state``: the scale after each update, and the last state."""
    scales = []
    for finite in flags:
        state = config.update(state, finite)
        scales.append(state.scale)
    return scales, state


# -- torch.amp.GradScaler ------------------------------------------------------------------------


class TorchRun:
    """A real GradScaler on a tiny model; an inf is written into a gradient on overflow steps."""

    def __init__(self, scaler):
        self.torch = require("torch")
        self.scaler = scaler
        self.model = self.torch.nn.Linear(3, 2, bias=False)
        self.optimizer = self.torch.optim.SGD(self.model.parameters(), lr=0.0)
        self.x = self.torch.full((1, 3), 2.0**-8)

    def run(self, flags):
        scales = []
        for finite in flags:
            self.optimizer.zero_grad()
            self.scaler.scale(self.model(self.x).sum()).backward()
            if not finite:
                self.model.weight.grad[0, 1] = math.inf
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scales.append(self.scaler.get_scale())
        return scales


TORCH_SETTINGS = {"growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 3}


@pytest.mark.parametrize("source", ["scaler", "state_dict"])
def test_torch_gradscaler_migrates_to_polyamp_and_continues_the_same(source):
    torch = require("torch")
    native = TorchRun(torch.amp.GradScaler("cpu", **TORCH_SETTINGS))
    native.run(FLAGS[:CUT])
    saved = native.scaler.state_dict()
    config, state = from_native(native.scaler if source == "scaler" else saved)

    assert config == preset("torch", **TORCH_SETTINGS)
    assert state.scale == saved["scale"] and state.good_steps == saved["_growth_tracker"] > 0
    ours, _ = polyamp_scales(config, state, FLAGS[CUT:])
    expected = native.run(FLAGS[CUT:])
    assert ours == expected
    assert len(set(expected)) > 3  # the continuation grew and backed off


def test_polyamp_migrates_to_a_fresh_torch_gradscaler_and_continues_the_same():
    torch = require("torch")
    config = preset("torch", **TORCH_SETTINGS)
    _, state = polyamp_scales(config, config.init(), FLAGS[:CUT])
    assert state.good_steps > 0
    native = TorchRun(torch.amp.GradScaler("cpu"))  # default settings: load_state_dict adopts ours
    native.scaler.load_state_dict(to_native(config, state, "torch"))
    assert native.run(FLAGS[CUT:]) == polyamp_scales(config, state, FLAGS[CUT:])[0]


def test_torch_state_dict_round_trips_exactly():
    saved = {"scale": 1024.0, "growth_factor": 3.0, "backoff_factor": 0.125, "growth_interval": 7,
             "_growth_tracker": 5}  # fmt: skip
    assert to_native(*from_native(saved), "torch") == saved


# -- Keras 3 LossScaleOptimizer -----------------------------------------------------------------


@pytest.fixture(scope="module")
def keras():
    keras = require("keras")
    assert keras.backend.backend() == "tensorflow", "these tests drive the TF backend"
    return keras


class KerasRun:
    """A real LossScaleOptimizer applying finite or inf gradients to one variable."""

    def __init__(self, keras, optimizer):
        import numpy as np

        self.optimizer = optimizer
        self.variable = keras.Variable(np.zeros(3, np.float32))
        self.grads = {True: np.ones(3, np.float32), False: np.array([1.0, np.inf, 1.0], np.float32)}

    def run(self, flags):
        scales = []
        for finite in flags:
            self.optimizer.apply([self.grads[finite]], [self.variable])
            scales.append(float(self.optimizer.dynamic_scale.numpy()))
        return scales


def keras_optimizer(keras, **kwargs):
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), **kwargs)


def test_keras_loss_scale_optimizer_migrates_to_polyamp_and_continues_the_same(keras):
    native = KerasRun(keras, keras_optimizer(keras, initial_scale=2.0**10, dynamic_growth_steps=3))
    native.run(FLAGS[:CUT])
    config, state = from_native(native.optimizer)

    assert config == preset("keras", init_scale=2.0**10, growth_interval=3)
    assert state.good_steps == int(native.optimizer.step_counter.numpy()) > 0
    assert polyamp_scales(config, state, FLAGS[CUT:])[0] == native.run(FLAGS[CUT:])


def test_polyamp_migrates_to_a_keras_loss_scale_optimizer_and_continues_the_same(keras):
    config = preset("keras", growth_interval=3)
    _, state = polyamp_scales(config, config.init(), FLAGS[:CUT])
    assert state.good_steps > 0
    native = KerasRun(keras, keras_optimizer(keras, dynamic_growth_steps=3))
    native.optimizer.build([native.variable])
    to_native(config, state, "keras")(native.optimizer)
    assert native.run(FLAGS[CUT:]) == polyamp_scales(config, state, FLAGS[CUT:])[0]


def test_an_unbuilt_keras_optimizer_starts_at_its_initial_scale(keras):
    config, state = from_native(keras_optimizer(keras, initial_scale=512.0, dynamic_growth_steps=7))
    assert config == preset("keras", init_scale=512.0, growth_interval=7)
    assert state == config.init()


def test_keras_assign_refuses_what_would_not_continue_the_same(keras):
    config = preset("keras", growth_interval=3)
    assign = to_native(config, config.init(), "keras")
    with pytest.raises(PolyampError, match=r"dynamic_growth_steps=2000.*dynamic_growth_steps=3\)"):
        assign(keras_optimizer(keras))
    with pytest.raises(PolyampError, match=r"no variables yet; build it first"):
        assign(keras_optimizer(keras, dynamic_growth_steps=3))
    with pytest.raises(PolyampError, match=r"expected a keras.optimizers.LossScaleOptimizer; received SGD"):
        assign(keras.optimizers.SGD(0.1))


# -- jmp.DynamicLossScale -----------------------------------------------------------------------


def jmp_scales(loss_scale, flags):
    jnp = pytest.importorskip("jax.numpy")
    scales = []
    for finite in flags:
        loss_scale = loss_scale.adjust(jnp.asarray(finite))
        scales.append(float(loss_scale.loss_scale))
    return scales, loss_scale


def test_jmp_dynamic_loss_scale_migrates_both_ways_and_continues_the_same():
    jmp = pytest.importorskip("jmp")
    jnp = pytest.importorskip("jax.numpy")
    start = jmp.DynamicLossScale(jnp.asarray(2.0**15), period=3, factor=4,
                                 min_loss_scale=jnp.asarray(2.0, jnp.float32))  # fmt: skip
    _, native = jmp_scales(start, FLAGS[:CUT])
    config, state = from_native(native)
    assert config == preset("jmp", growth_factor=4.0, backoff_factor=0.25, growth_interval=3, min_scale=2.0)
    assert state.good_steps == int(native.counter) > 0
    ours, state = polyamp_scales(config, state, FLAGS[CUT:62])
    assert ours == jmp_scales(native, FLAGS[CUT:62])[0]

    back = to_native(config, state, "jmp")  # and from polyamp into jmp
    assert isinstance(back, jmp.DynamicLossScale) and int(back.counter) == state.good_steps > 0
    assert jmp_scales(back, FLAGS[62:])[0] == polyamp_scales(config, state, FLAGS[62:])[0]


def test_jmp_static_loss_scales_are_refused_with_their_polyamp_equivalent():
    jmp = pytest.importorskip("jmp")
    jnp = pytest.importorskip("jax.numpy")
    for static in (jmp.StaticLossScale(jnp.asarray(128.0)), jmp.NoOpLossScale()):
        name = type(static).__name__
        with pytest.raises(PolyampError, match=rf"a {name} has no dynamic state.*StaticLossScale"):
            from_native(static)


# -- DeepSpeed ----------------------------------------------------------------------------------
# DeepSpeed is not installed here; these restate deepspeedai/DeepSpeed
# deepspeed/runtime/fp16/loss_scaler.py (DynamicLossScaler: __init__'s attributes, which the ZeRO
# optimizers save whole as state_dict()["loss_scaler"], and update_scale) and
# deepspeed/runtime/fp16/fused_optimizer.py (FP16_Optimizer.state_dict's keys and _update_scale).


def zero_scaler(window=4, hysteresis=2, consecutive=False):
    """DynamicLossScaler's attributes after __init__ with the config defaults (less dtype)."""
    return {"cur_scale": 2.0**16, "cur_iter": 0, "last_overflow_iter": -1, "scale_factor": 2.0,
            "scale_window": window, "min_scale": 1, "delayed_shift": hysteresis,
            "cur_hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
            "raise_error_at_min_scale": True, "dynamic": True}  # fmt: skip


def zero_update(attrs, overflow):
    """DynamicLossScaler.update_scale on a copy of its attributes (the raise at min scale left out)."""
    a = dict(attrs)
    if overflow:
        if a["delayed_shift"] == 1 or a["cur_hysteresis"] == 1:
            a["cur_scale"] = max(a["cur_scale"] / a["scale_factor"], a["min_scale"])
        else:
            a["cur_hysteresis"] -= 1
        a["last_overflow_iter"] = a["cur_iter"]
    else:
        if a["consecutive_hysteresis"]:
            a["cur_hysteresis"] = a["delayed_shift"]
        stable_interval = a["cur_iter"] - a["last_overflow_iter"] - 1
        if stable_interval > 0 and stable_interval % a["scale_window"] == 0:
            if not a["consecutive_hysteresis"]:
                a["cur_hysteresis"] = a["delayed_shift"]
            a["cur_scale"] *= a["scale_factor"]
    a["cur_iter"] += 1
    return a


def fp16_optimizer(window=4):
    """The scale keys of FP16_Optimizer.state_dict() after construction (dynamic scaling)."""
    return {"dynamic_loss_scale": True, "cur_scale": 2.0**16, "cur_iter": 0, "last_overflow_iter": -1,
            "scale_factor": 2.0, "scale_window": window}  # fmt: skip


def fp16_update(state, skip, min_loss_scale=1):
    """FP16_Optimizer._update_scale on a copy of those keys; the floor comes from the config."""
    s = dict(state)
    if skip:
        s["cur_scale"] = max(s["cur_scale"] / s["scale_factor"], min_loss_scale)
        s["last_overflow_iter"] = s["cur_iter"]
    else:
        stable_interval = s["cur_iter"] - s["last_overflow_iter"] - 1
        if stable_interval > 0 and stable_interval % s["scale_window"] == 0:
            s["cur_scale"] *= s["scale_factor"]
    s["cur_iter"] += 1
    return s


def deepspeed_scales(state, flags, update):
    scales = []
    for finite in flags:
        state = update(state, not finite)
        scales.append(state["cur_scale"])
    return scales, state


DEEPSPEED = {
    "zero": (zero_scaler, zero_update, "deepspeed"),
    "fp16": (fp16_optimizer, fp16_update, "deepspeed-fp16"),
}


@pytest.mark.parametrize("layout", list(DEEPSPEED))
def test_deepspeed_fresh_state_is_the_preset_and_follows_it(layout):
    fresh, update, kind = DEEPSPEED[layout]
    config, state = from_native(fresh())
    assert config == preset(kind, growth_interval=4)
    assert state == config.init()  # growth_delay: good_steps starts at -1
    assert polyamp_scales(config, state, FLAGS)[0] == deepspeed_scales(fresh(), FLAGS, update)[0]


@pytest.mark.parametrize("cut", [CUT, 42, 43, 44, 45, 50])  # 42, 44: right after an overflow
@pytest.mark.parametrize("layout", list(DEEPSPEED))
def test_deepspeed_migrates_both_ways_and_continues_the_same(layout, cut):
    fresh, update, kind = DEEPSPEED[layout]
    _, saved = deepspeed_scales(fresh(), FLAGS[:cut], update)
    config, state = from_native(saved)
    assert state.steps == cut
    ours, state = polyamp_scales(config, state, FLAGS[cut:60])
    native, _ = deepspeed_scales(saved, FLAGS[cut:60], update)
    assert ours == native

    back = {**fresh(), **to_native(config, state, kind)}  # into a freshly built scaler / optimizer
    assert deepspeed_scales(back, FLAGS[60:], update)[0] == polyamp_scales(config, state, FLAGS[60:])[0]


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [1, 3])
def test_deepspeed_hysteresis_migrates_both_ways(hysteresis, consecutive):
    fresh = zero_scaler(window=3, hysteresis=hysteresis, consecutive=consecutive)
    flags = [False, True, False, True, True, True, True, False] + FLAGS
    _, saved = deepspeed_scales(fresh, flags[:CUT], zero_update)
    config, state = from_native(saved)
    assert config.hysteresis == hysteresis and state.hysteresis_left == saved["cur_hysteresis"]
    ours, state = polyamp_scales(config, state, flags[CUT:70])
    assert ours == deepspeed_scales(saved, flags[CUT:70], zero_update)[0]
    back = to_native(config, state, "deepspeed")
    assert deepspeed_scales(back, flags[70:], zero_update)[0] == polyamp_scales(config, state, flags[70:])[0]


def test_deepspeed_zero_checkpoint_holding_the_scaler_object():
    _, saved = deepspeed_scales(zero_scaler(), FLAGS[:CUT], zero_update)
    expected = from_native(saved)
    # what unpickling a ZeRO optimizer's state_dict gives: the scaler object under 'loss_scaler'
    assert from_native({"loss_scaler": types.SimpleNamespace(**saved), "partition_count": 1}) == expected
    assert from_native({"loss_scaler": saved}) == expected


@pytest.mark.parametrize("layout", list(DEEPSPEED))
def test_deepspeed_round_trips(layout):
    fresh, update, kind = DEEPSPEED[layout]
    for cut in (44, 40):  # 0 and 13 clean steps since the last overflow, with a window of 4
        _, saved = deepspeed_scales(fresh(), FLAGS[:cut], update)
        saved.pop("raise_error_at_min_scale", None)
        written = to_native(*from_native(saved), kind)
        assert from_native(written) == from_native(saved)
        if cut == 44:
            assert written == saved
        else:  # the clean-step count since the last overflow is kept modulo the window
            assert written == {**saved, "last_overflow_iter": cut - 1 - 1}
    assert from_native({**saved, "optimizer_state_dict": {}}) == from_native(saved)  # a whole state_dict


# -- what cannot be migrated --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "kind", "named"),
    [
        (DynamicLossScale(), "torch", r"min_scale=1.0, max_scale=16777216.0: it has min_scale=0.0, "
                                      r"max_scale=math.inf"),
        (preset("deepspeed"), "torch", r"hysteresis=2.*growth_delay=1"),
        (preset("deepspeed"), "deepspeed-fp16", r"hysteresis=2"),
        (preset("torch", growth_factor=3.0), "keras", r"growth_factor=3.0.*it has growth_factor=2.0"),
        (preset("jmp", backoff_factor=0.25), "jmp", r"backoff_factor=0.25.*backoff_factor=0.5"),
        (preset("mxnet"), "torch", r"max_scale=16777216.0, one_step_lag=True"),
        (preset("torch"), "deepspeed", r"growth_delay=0: it has growth_delay=1"),
        (preset("deepspeed-fp16", min_scale=0.5), "deepspeed-fp16", r"fp16.min_loss_scale"),
    ],
)
def test_to_native_refuses_what_the_target_cannot_express(config, kind, named):
    with pytest.raises(PolyampError, match=named):
        to_native(config, config.init(), kind)


def test_to_native_refuses_bad_arguments():
    config = preset("torch")
    accepted = ", ".join(KINDS)
    with pytest.raises(PolyampError, match=rf"unknown native loss-scale kind 'apex'; accepted: {accepted}$"):
        to_native(config, config.init(), "apex")
    with pytest.raises(PolyampError, match=r"needs a DynamicLossScale config.*received StaticLossScale"):
        to_native(StaticLossScale(8.0), LossScaleState(8.0), "torch")
    with pytest.raises(PolyampError, match=r"needs a LossScaleState; received dict"):
        to_native(config, {"scale": 1.0}, "torch")
    with pytest.raises(PolyampError, match=r"good_steps=2000 must be in \[0, 2000\)"):
        to_native(config, LossScaleState(1.0, good_steps=2000), "torch")


TORCH_DICT = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
              "_growth_tracker": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("saved", "named"),
    [
        ({}, r"empty dict: a disabled torch GradScaler saves \{\}"),
        ({"epoch": 3}, r"keys \['epoch'\]\); accepted: a torch.amp.GradScaler.*_growth_tracker.*delayed_"),
        ({"scale": 8.0, "growth_factor": 2.0}, r"looks like a torch GradScaler.*lacks \['backoff_factor', "),
        ({**TORCH_DICT, "scale": "big"}, r"GradScaler.state_dict\(\) field 'scale' must be a number >= 0; "
                                         r"received 'big'"),
        ({**TORCH_DICT, "_growth_tracker": 1.5}, r"'_growth_tracker' must be an integer >= 0; received 1.5"),
        ({**TORCH_DICT, "growth_factor": 1.0}, r"GradScaler.*growth_factor must be a finite number > 1"),
        ({"cur_scale": 4.0, "dynamic": False}, r"static loss scale \(cur_scale=4.0\).*StaticLossScale"),
        ({**fp16_optimizer(), "dynamic_loss_scale": False}, r"static loss scale"),
        ({**fp16_optimizer(), "last_overflow_iter": 0}, r"last_overflow_iter=0 must be below cur_iter=0"),
        ({"policy": "fp16-mixed", "loss_scale": {}, "state": {}}, r"polyamp's own MixedPrecision.state_dict"),
        (object(), r"cannot read a builtins.object; accepted: a torch.amp.GradScaler"),
    ],
)
def test_from_native_refuses_what_it_cannot_read(saved, named):
    with pytest.raises(PolyampError, match=named):
        from_native(saved)
