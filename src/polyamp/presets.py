"""The loss-scale presets: the ``DynamicLossScale`` fields that reproduce each library's own scale
trajectory (``DynamicLossScale.preset(name)``); every entry cites the code it reproduces."""

from __future__ import annotations

import math
from typing import Any

PRESETS = ("polyamp", "torch", "keras", "jmp", "deepspeed", "mxnet", "deepspeed-fp16")

_INF = math.inf
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    "polyamp": {},
    # pytorch/pytorch torch/amp/grad_scaler.py + _amp_update_scale_ kernel: fp32 scale tensor,
    # no floor, growth kept only if the fp32 result is finite.
    "torch": {
        "init_scale": 2.0**16,
        "growth_interval": 2000,
        "min_scale": 0.0,
        "max_scale": _INF,
        "scale_dtype": "float32",
    },
    # keras/src/optimizers/loss_scale_optimizer.py (Keras 3): fp32 variable, counter reset on
    # growth and overflow, no floor, growth not checked, so the scale can reach inf and stay;
    # the TensorFlow and JAX backends flush a subnormal scale to 0 (the torch backend does not).
    "keras": {
        "init_scale": 2.0**15,
        "growth_interval": 2000,
        "min_scale": 0.0,
        "max_scale": _INF,
        "allow_inf_scale": True,
        "scale_dtype": "float32-ftz",
    },
    # google-deepmind/jmp jmp/_src/loss_scale.py: DynamicLossScale(jnp.asarray(2.**15)) (fp32),
    # period 2000, factor 2, min_loss_scale 1 (so never subnormal), growth only to a finite value.
    "jmp": {
        "init_scale": 2.0**15,
        "growth_interval": 2000,
        "min_scale": 1.0,
        "max_scale": _INF,
        "scale_dtype": "float32",
    },
    # deepspeedai/DeepSpeed deepspeed/runtime/fp16/loss_scaler.py with the config defaults
    # (initial_scale_power 16, loss_scale_window 1000, hysteresis 2, min_loss_scale 1,
    # consecutive_hysteresis False), as the ZeRO optimizers run it: growth needs stable_interval =
    # iters since the last overflow - 1 to be a positive multiple of the window, so its first clean
    # step does not count (growth_delay 1); Python float, unchecked growth.
    "deepspeed": {
        "init_scale": 2.0**16,
        "growth_interval": 1000,
        "hysteresis": 2,
        "min_scale": 1.0,
        "max_scale": _INF,
        "growth_delay": 1,
        "allow_inf_scale": True,
    },
    # DeepSpeed's non-ZeRO FP16_Optimizer (deepspeed/runtime/fp16/fused_optimizer.py,
    # _update_scale): the same window, delay and floor, but no hysteresis; the ZeRO optimizers use
    # the loss_scaler.py rule above ("deepspeed"). Neither preset models DeepSpeed's default
    # raise_error_at_min_scale (an exception when an overflow meets the floor): polyamp's guard is
    # max_consecutive_skips.
    "deepspeed-fp16": {
        "init_scale": 2.0**16,
        "growth_interval": 1000,
        "min_scale": 1.0,
        "max_scale": _INF,
        "growth_delay": 1,
        "allow_inf_scale": True,
    },
    # apache/mxnet python/mxnet/contrib/amp/loss_scaler.py: halve (no floor), double after 2000
    # clean steps up to 2^24; has_overflow first sets loss_scale = _next_loss_scale and then
    # computes the next one, so each new scale takes effect one step late.
    "mxnet": {
        "init_scale": 2.0**16,
        "growth_interval": 2000,
        "min_scale": 0.0,
        "max_scale": 2.0**24,
        "one_step_lag": True,
    },
}
