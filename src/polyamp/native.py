"""Migrating loss-scale checkpoints between polyamp and the native scalers, in either direction.

``from_native(obj)`` reads what a native scaler saved and returns ``(config, state)``: the matching
:meth:`DynamicLossScale.preset` with the saved settings, and a :class:`LossScaleState` whose
``good_steps`` is the native growth counter, so that continuing gives the native scale trajectory.
``to_native(config, state, kind)`` writes the native form back::

    config, state = from_native(torch.amp.GradScaler("cpu").state_dict())   # or the scaler itself
    scaler.load_state_dict(to_native(config, state, "torch"))

Native state and polyamp state, field by field (``kind`` names both the target and the preset):

- ``"torch"``: ``GradScaler.state_dict()`` = {scale, growth_factor, backoff_factor,
  growth_interval, _growth_tracker}; ``_growth_tracker`` is ``good_steps``.
- ``"keras"``: a Keras 3 ``LossScaleOptimizer``: variables ``dynamic_scale`` and ``step_counter``
  (= ``good_steps``), attributes ``initial_scale`` and ``dynamic_growth_steps``; factors fixed at
  2 and 0.5. ``to_native`` returns ``assign(optimizer)``, which sets the two variables.
- ``"jmp"``: ``jmp.DynamicLossScale(loss_scale, counter, period, factor, min_loss_scale)``;
  ``counter`` is ``good_steps``; the backoff divides by ``factor``.
- ``"deepspeed"``: the attributes of DeepSpeed's ``DynamicLossScaler``, which the ZeRO optimizers
  save whole as ``state_dict()["loss_scaler"]``: cur_scale, cur_iter, last_overflow_iter,
  scale_factor, scale_window, min_scale, delayed_shift (hysteresis), cur_hysteresis
  (``hysteresis_left``), consecutive_hysteresis.
- ``"deepspeed-fp16"``: the scale keys of DeepSpeed's non-ZeRO ``FP16_Optimizer.state_dict()``:
  dynamic_loss_scale, cur_scale, cur_iter, last_overflow_iter, scale_factor, scale_window (no
  hysteresis; the floor is the DeepSpeed config's ``fp16.min_loss_scale``, default 1).

DeepSpeed counts no growth counter: it grows when ``cur_iter - last_overflow_iter - 1`` is a
positive multiple of the window, after the update of iteration ``cur_iter``. With ``k =
cur_iter - last_overflow_iter - 1`` clean steps since the last overflow (or the start),
``good_steps = -1`` if ``k == 0`` else ``(k - 1) % window`` (the presets' ``growth_delay`` of 1);
the reverse takes ``k = good_steps + 1`` and ``cur_iter = max(state.steps, k)``.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, Callable

from .errors import PolyampError, invalid
from .scaling import DynamicLossScale, LossScaleState

KINDS = ("torch", "keras", "jmp", "deepspeed", "deepspeed-fp16")

_TARGETS = {
    "torch": "torch.amp.GradScaler",
    "keras": "Keras LossScaleOptimizer",
    "jmp": "jmp.DynamicLossScale",
    "deepspeed": "DeepSpeed's DynamicLossScaler (ZeRO)",
    "deepspeed-fp16": "DeepSpeed's FP16_Optimizer",
}

# The saved keys of each dict layout.
# pytorch torch/amp/grad_scaler.py GradScaler.state_dict
_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
# deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.__init__ (pickled by the ZeRO optimizers:
# deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, state_dict()[LOSS_SCALER])
_ZERO_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window", "min_scale",
              "delayed_shift", "cur_hysteresis", "consecutive_hysteresis")  # fmt: skip
# deepspeed/runtime/fp16/fused_optimizer.py FP16_Optimizer.state_dict (unfused_optimizer.py alike)
_FP16_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
              "scale_window")  # fmt: skip
_LAYOUTS = {"torch": _TORCH_KEYS, "deepspeed": _ZERO_KEYS, "deepspeed-fp16": _FP16_KEYS}
_LAYOUT_NAMES = {
    "torch": "torch GradScaler.state_dict()",
    "deepspeed": "DeepSpeed DynamicLossScaler attributes (a ZeRO optimizer's state_dict()['loss_scaler'])",
    "deepspeed-fp16": "DeepSpeed FP16_Optimizer.state_dict()",
}
_DEEPSPEED_MIN_SCALE = 1.0  # DeepSpeed's fp16.min_loss_scale default (runtime/precision_config.py)

# What each native scaler can hold beyond its preset's fixed rule; a config that differs from the
# preset elsewhere is refused, except in init_scale (where a fresh run starts) and in the target's own
# arithmetic, which applies after migration (_ARITHMETIC).
_SETTINGS = {
    "torch": ("growth_factor", "backoff_factor", "growth_interval"),
    "keras": ("growth_interval",),
    "jmp": ("growth_factor", "backoff_factor", "growth_interval", "min_scale"),
    "deepspeed": ("growth_factor", "backoff_factor", "growth_interval", "min_scale", "hysteresis",
                  "consecutive_hysteresis"),  # fmt: skip
    "deepspeed-fp16": ("growth_factor", "backoff_factor", "growth_interval", "min_scale"),
}
_ARITHMETIC = ("init_scale", "scale_dtype", "allow_inf_scale", "max_consecutive_skips")
_DIVIDES = ("jmp", "deepspeed", "deepspeed-fp16")  # back off by dividing by the growth factor


# -- reading ---------------------------------------------------------------------------------------
def from_native(obj: Any) -> tuple[DynamicLossScale, LossScaleState]:
    """The polyamp config and state equivalent to a native loss scaler's saved state.

    ``obj``: a ``torch.amp.GradScaler`` or its ``state_dict()``; a Keras 3 ``LossScaleOptimizer``;
    a ``jmp.DynamicLossScale``; DeepSpeed's ``DynamicLossScaler`` (its attributes as a dict, the
    object, or a ZeRO optimizer's ``state_dict()`` holding it as ``'loss_scaler'``); a DeepSpeed
    ``FP16_Optimizer.state_dict()``. A dict is recognised by its keys. Settings the native state
    does not hold take the preset's values (``init_scale``, except Keras's ``initial_scale``;
    DeepSpeed FP16_Optimizer's floor, 1 unless the dict has ``'min_scale'``); counters it does
    not keep start at 0. Change any with ``dataclasses.replace``.
    """
    kind = _native_object(obj)
    if kind == "torch":
        obj = obj.state_dict()
    elif kind == "keras":
        return _from_keras(obj)
    elif kind == "jmp":
        return _from_jmp(obj)
    elif not isinstance(obj, Mapping) and "cur_scale" in getattr(obj, "__dict__", {}):
        obj = vars(obj)  # a DeepSpeed scaler object
    if not isinstance(obj, Mapping):
        raise PolyampError(f"from_native cannot read a {type(obj).__module__}.{type(obj).__name__}; "
                           f"accepted: {_accepted()}")  # fmt: skip
    if "loss_scaler" in obj:  # a ZeRO optimizer's state_dict
        return from_native(obj["loss_scaler"])
    data = dict(obj)
    kind = _layout(data)
    if kind == "torch":
        return _from_torch(data)
    return _from_deepspeed(data, kind)


def _native_object(obj: Any) -> str | None:
    """Which native scaler object ``obj`` is, looking only at frameworks already imported."""
    torch, keras, jmp = (sys.modules.get(name) for name in ("torch", "keras", "jmp"))
    if torch is not None and isinstance(obj, getattr(torch.amp, "GradScaler", ())):
        return "torch"
    if keras is not None and isinstance(obj, keras.optimizers.LossScaleOptimizer):
        if hasattr(obj, "mixed_precision"):  # polyamp's own optimizer, not a native scaler
            raise PolyampError("this is polyamp's own optimizer (mp.optimizer(...)): its loss-scale state "
                               "is optimizer.mixed_precision.state_dict()")  # fmt: skip
        return "keras"
    if jmp is not None and isinstance(obj, (jmp.StaticLossScale, jmp.NoOpLossScale)):
        raise PolyampError(f"a {type(obj).__name__} has no dynamic state to migrate; polyamp's equivalent "
                           "is StaticLossScale(scale) or NoLossScale()")  # fmt: skip
    if jmp is not None and isinstance(obj, jmp.DynamicLossScale):
        return "jmp"
    return None


def _accepted() -> str:
    layouts = "; ".join(f"{_LAYOUT_NAMES[k]} {{{', '.join(keys)}}}" for k, keys in _LAYOUTS.items())
    return (f"a torch.amp.GradScaler, a Keras LossScaleOptimizer, a jmp.DynamicLossScale, or a dict: "
            f"{layouts}")  # fmt: skip


def _layout(data: dict) -> str:
    """The layout whose keys ``data`` has, or PolyampError naming what it lacks."""
    if not data:
        raise PolyampError("from_native received an empty dict: a disabled torch GradScaler saves {}, so "
                           "there is no loss scale to migrate")  # fmt: skip
    if ("dynamic" in data and not data["dynamic"]) or data.get("dynamic_loss_scale") is False:
        raise PolyampError(
            f"this DeepSpeed state is a static loss scale (cur_scale={data.get('cur_scale')!r}); polyamp's "
            "equivalent is StaticLossScale(cur_scale), or NoLossScale() for 1"
        )
    if {"policy", "loss_scale", "state"} <= set(data):
        raise PolyampError(
            "this is polyamp's own MixedPrecision.state_dict(), not a native scaler's; load it with "
            "MixedPrecision.load_state_dict, or LossScaleState.from_dict(d['state'])"
        )
    for kind, keys in _LAYOUTS.items():
        if set(keys) <= set(data):
            return kind
    kind, keys = max(_LAYOUTS.items(), key=lambda item: len(set(item[1]) & set(data)))
    closest = ""
    if set(keys) & set(data):
        missing = [key for key in keys if key not in data]
        closest = f"it looks like a {_LAYOUT_NAMES[kind]} but lacks {missing}; "
    raise PolyampError(
        f"from_native cannot tell which loss scaler saved this dict (keys {sorted(map(str, data))}); "
        f"{closest}accepted: {_accepted()}"
    )


def _value(data: Mapping, key: str, where: str, kind: type = float, minimum: float = -math.inf) -> Any:
    """``data[key]`` as a float (not NaN) or an int, at least ``minimum``; else PolyampError."""
    value = data[key]
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok_type = numbers.Integral if kind is int else numbers.Real
        ok = isinstance(value, ok_type) and not isinstance(value, bool)
        ok = ok and not math.isnan(value) and value >= minimum
    if not ok:
        accepted = {bool: "True or False", int: "an integer", float: "a number"}[kind]
        accepted += f" >= {minimum:g}" if minimum > -math.inf else ""
        raise PolyampError(f"{where} field {key!r} must be {accepted}; received {value!r}")
    return kind(value)


def _config(kind: str, where: str, **settings: Any) -> DynamicLossScale:
    """The ``kind`` preset with the native settings; its start clamped into [min_scale, max_scale]."""
    base = DynamicLossScale.preset(kind)
    low = settings.get("min_scale", base.min_scale)
    settings.setdefault("init_scale", min(max(base.init_scale, low), base.max_scale))
    try:
        return replace(base, **settings)
    except PolyampError as error:
        raise PolyampError(f"{where}: {error}") from None


def _from_torch(data: dict) -> tuple[DynamicLossScale, LossScaleState]:
    where = _LAYOUT_NAMES["torch"]
    config = _config("torch", where, growth_factor=_value(data, "growth_factor", where),
                     backoff_factor=_value(data, "backoff_factor", where),
                     growth_interval=_value(data, "growth_interval", where, int))  # fmt: skip
    state = LossScaleState(scale=_value(data, "scale", where, minimum=0),
                           good_steps=_value(data, "_growth_tracker", where, int, minimum=0))  # fmt: skip
    return config, state


def _from_keras(optimizer: Any) -> tuple[DynamicLossScale, LossScaleState]:
    import numpy as np

    where = "Keras LossScaleOptimizer"
    settings = {"initial_scale": optimizer.initial_scale,
                "dynamic_growth_steps": optimizer.dynamic_growth_steps}  # fmt: skip
    config = _config("keras", where, init_scale=_value(settings, "initial_scale", where),
                     growth_interval=_value(settings, "dynamic_growth_steps", where, int))  # fmt: skip
    if not optimizer.built:  # no variables yet: it starts from initial_scale
        return config, config.init()
    saved = {"dynamic_scale": np.asarray(optimizer.dynamic_scale).item(),
             "step_counter": np.asarray(optimizer.step_counter).item()}  # fmt: skip
    state = LossScaleState(scale=_value(saved, "dynamic_scale", where, minimum=0),
                           good_steps=_value(saved, "step_counter", where, int, minimum=0))  # fmt: skip
    return config, state


def _from_jmp(loss_scale: Any) -> tuple[DynamicLossScale, LossScaleState]:
    import numpy as np

    where = "jmp.DynamicLossScale"
    saved = {name: np.asarray(getattr(loss_scale, name)).item()
             for name in ("loss_scale", "counter", "period", "factor", "min_loss_scale")}  # fmt: skip
    factor = _value(saved, "factor", where, minimum=1)
    config = _config("jmp", where, growth_factor=factor, backoff_factor=1 / factor,
                     growth_interval=_value(saved, "period", where, int),
                     min_scale=_value(saved, "min_loss_scale", where, minimum=0))  # fmt: skip
    state = LossScaleState(scale=_value(saved, "loss_scale", where, minimum=0),
                           good_steps=_value(saved, "counter", where, int, minimum=0))  # fmt: skip
    return config, state


def _from_deepspeed(data: dict, kind: str) -> tuple[DynamicLossScale, LossScaleState]:
    where = _LAYOUT_NAMES[kind]
    factor = _value(data, "scale_factor", where, minimum=1)
    window = _value(data, "scale_window", where, int, minimum=1)
    settings: dict[str, Any] = {"growth_factor": factor, "backoff_factor": 1 / factor,
                                "growth_interval": window}  # fmt: skip
    hysteresis_left = 1
    if kind == "deepspeed":
        settings["hysteresis"] = _value(data, "delayed_shift", where, int, minimum=1)
        settings["consecutive_hysteresis"] = _value(data, "consecutive_hysteresis", where, bool)
        hysteresis_left = _value(data, "cur_hysteresis", where, int, minimum=1)
    if kind == "deepspeed" or "min_scale" in data:
        settings["min_scale"] = _value(data, "min_scale", where, minimum=0)
    config = _config(kind, where, **settings)
    cur_iter = _value(data, "cur_iter", where, int, minimum=0)
    last_overflow = _value(data, "last_overflow_iter", where, int, minimum=-1)
    clean = cur_iter - last_overflow - 1  # clean steps since the last overflow (or the start)
    if clean < 0:
        raise PolyampError(f"{where}: last_overflow_iter={last_overflow} must be below cur_iter={cur_iter}")
    state = LossScaleState(scale=_value(data, "cur_scale", where, minimum=0),
                           good_steps=-1 if clean == 0 else (clean - 1) % window,
                           hysteresis_left=hysteresis_left, steps=cur_iter)  # fmt: skip
    return config, state


# -- writing ---------------------------------------------------------------------------------------
def to_native(config: DynamicLossScale, state: LossScaleState, kind: str) -> Any:
    """The native form of ``config`` and ``state`` for ``kind``, one of :data:`KINDS`.

    ``"torch"``: a dict for ``GradScaler.load_state_dict`` (which adopts its factors and
    interval). ``"keras"``: ``assign(optimizer)``, setting a built ``LossScaleOptimizer``'s
    ``dynamic_scale`` and ``step_counter`` (its ``dynamic_growth_steps`` must equal
    ``growth_interval``). ``"jmp"``: a ``jmp.DynamicLossScale``. ``"deepspeed"``: the
    ``DynamicLossScaler`` attributes, for ``vars(optimizer.loss_scaler).update(...)``.
    ``"deepspeed-fp16"``: the scale keys of ``FP16_Optimizer.state_dict()``, to merge into it.

    PolyampError when the target cannot express the config (a hysteresis, a floor or a cap it
    does not have, other factors, ...): continuing there would leave polyamp's trajectory. The
    target's own arithmetic (a float32 scale, unguarded growth to inf) applies after migration.
    """
    if kind not in KINDS:
        raise invalid("native loss-scale kind", kind, KINDS)
    if not isinstance(config, DynamicLossScale):
        raise PolyampError(
            "to_native needs a DynamicLossScale config (every native scaler here is dynamic); "
            f"received {type(config).__name__}"
        )
    if not isinstance(state, LossScaleState):
        raise PolyampError(f"to_native needs a LossScaleState; received {type(state).__name__}")
    _check_expressible(config, kind)
    if not (-config.growth_delay <= state.good_steps < config.growth_interval
            and 1 <= state.hysteresis_left <= config.hysteresis):  # fmt: skip
        raise PolyampError(
            f"this state does not belong to this config: good_steps={state.good_steps} must be in "
            f"[{-config.growth_delay}, {config.growth_interval}) and hysteresis_left="
            f"{state.hysteresis_left} in [1, {config.hysteresis}]"
        )
    return _WRITERS[kind](config, state)


def _check_expressible(config: DynamicLossScale, kind: str) -> None:
    fixed = DynamicLossScale.preset(kind)
    skip = (*_SETTINGS[kind], *_ARITHMETIC) + (("consecutive_hysteresis",) if config.hysteresis == 1 else ())
    wanted = {f.name: getattr(fixed, f.name) for f in fields(fixed)
              if f.name not in skip and getattr(config, f.name) != getattr(fixed, f.name)}  # fmt: skip
    if kind in _DIVIDES and config.backoff_factor != 1 / config.growth_factor:
        wanted["backoff_factor"] = 1 / config.growth_factor  # it divides by the growth factor
    if wanted:
        have = ", ".join(f"{name}={getattr(config, name)!r}" for name in wanted)
        fix = ", ".join(f"{name}={'math.inf' if v == math.inf else repr(v)}" for name, v in wanted.items())
        raise PolyampError(
            f"{_TARGETS[kind]} cannot express {have}: it has {fix}, so continuing there would leave this "
            f"trajectory. To accept that, convert dataclasses.replace(config, {fix}) first"
        )


def _to_torch(config: DynamicLossScale, state: LossScaleState) -> dict[str, Any]:
    return {"scale": state.scale, "growth_factor": config.growth_factor,
            "backoff_factor": config.backoff_factor, "growth_interval": config.growth_interval,
            "_growth_tracker": state.good_steps}  # fmt: skip


def _to_keras(config: DynamicLossScale, state: LossScaleState) -> Callable[[Any], None]:
    def assign(optimizer: Any) -> None:
        """Set ``optimizer``'s ``dynamic_scale`` and ``step_counter`` to the migrated state."""
        keras = sys.modules.get("keras")
        if keras is None or not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise PolyampError(
                f"expected a keras.optimizers.LossScaleOptimizer; received {type(optimizer).__name__}"
            )
        steps = config.growth_interval
        if optimizer.dynamic_growth_steps != steps:
            raise PolyampError(
                f"this LossScaleOptimizer has dynamic_growth_steps={optimizer.dynamic_growth_steps}; the "
                f"migrated scale grows every {steps} steps: create it with "
                f"LossScaleOptimizer(inner, dynamic_growth_steps={steps})"
            )
        if not optimizer.built:
            raise PolyampError("this LossScaleOptimizer has no variables yet; build it first: "
                               "optimizer.build(model.trainable_variables)")  # fmt: skip
        optimizer.dynamic_scale.assign(state.scale)
        optimizer.step_counter.assign(state.good_steps)

    return assign


def _to_jmp(config: DynamicLossScale, state: LossScaleState) -> Any:
    try:
        import jax.numpy as jnp
        import jmp
    except ImportError as error:
        raise PolyampError(f"to_native(..., 'jmp') needs jmp and jax installed ({error})") from None
    factor = config.growth_factor
    return jmp.DynamicLossScale(
        loss_scale=jnp.asarray(state.scale, jnp.float32),
        counter=jnp.asarray(state.good_steps, jnp.int32),
        period=config.growth_interval,
        factor=int(factor) if float(factor).is_integer() else factor,
        min_loss_scale=jnp.asarray(config.min_scale, jnp.float32),
    )


def _deepspeed_iters(state: LossScaleState) -> dict[str, int]:
    """cur_iter and last_overflow_iter with ``good_steps + 1`` clean steps since the last overflow."""
    clean = state.good_steps + 1
    cur_iter = max(state.steps, clean)
    return {"cur_iter": cur_iter, "last_overflow_iter": cur_iter - clean - 1}


def _to_deepspeed(config: DynamicLossScale, state: LossScaleState) -> dict[str, Any]:
    return {"cur_scale": state.scale, **_deepspeed_iters(state), "scale_factor": config.growth_factor,
            "scale_window": config.growth_interval, "min_scale": config.min_scale,
            "delayed_shift": config.hysteresis, "cur_hysteresis": state.hysteresis_left,
            "consecutive_hysteresis": config.consecutive_hysteresis, "dynamic": True}  # fmt: skip


def _to_deepspeed_fp16(config: DynamicLossScale, state: LossScaleState) -> dict[str, Any]:
    if config.min_scale != _DEEPSPEED_MIN_SCALE:
        raise PolyampError(
            "FP16_Optimizer.state_dict() holds no floor: DeepSpeed takes it from the config's "
            f"fp16.min_loss_scale (default 1); this config has min_scale={config.min_scale!r}. Set "
            "fp16.min_loss_scale to it and convert dataclasses.replace(config, min_scale=1.0)"
        )
    return {"dynamic_loss_scale": True, "cur_scale": state.scale, **_deepspeed_iters(state),
            "scale_factor": config.growth_factor, "scale_window": config.growth_interval}  # fmt: skip


_WRITERS = {"torch": _to_torch, "keras": _to_keras, "jmp": _to_jmp, "deepspeed": _to_deepspeed,
            "deepspeed-fp16": _to_deepspeed_fp16}  # fmt: skip
