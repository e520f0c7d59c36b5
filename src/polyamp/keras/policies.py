"""Which Keras dtype policy honours a polyamp policy, and the scope that sets it.

Inside ``mp.scope()`` layers take the Keras dtype policy of ``KERAS_POLICIES``; where the polyamp
policy keeps outputs in float32, the probability layers built inside it (``Softmax``;
``Activation`` with softmax, log_softmax or sigmoid) get a float32 policy unless given a dtype, as
the TensorFlow mixed-precision guide asks. The previous policy is restored on exit.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import keras

from ..errors import PolyampError
from ..policy import Policy

_F32, _BF16, _F16, _F64 = "float32", "bfloat16", "float16", "float64"
# (param, compute, output) -> (Keras dtype policy, whether probability layers stay float32)
KERAS_POLICIES = {
    (_F32, _F32, _F32): ("float32", False),
    (_F32, _BF16, _F32): ("mixed_bfloat16", True),
    (_F32, _F16, _F32): ("mixed_float16", True),
    (_BF16, _BF16, _BF16): ("bfloat16", False),
    (_F16, _F16, _F16): ("float16", False),
    (_F64, _F64, _F64): ("float64", False),
    (_F32, _BF16, _BF16): ("mixed_bfloat16", False),
    (_F32, _F16, _F16): ("mixed_float16", False),
    (_BF16, _BF16, _F32): ("bfloat16", True),
    (_F16, _F16, _F32): ("float16", True),
}
_PROBABILITIES = ("softmax", "log_softmax", "sigmoid")


def keras_policy(policy: Policy) -> tuple[str, bool]:
    """The Keras dtype policy name for a polyamp policy, and whether outputs stay float32."""
    key = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    if key not in KERAS_POLICIES:
        accepted = ", ".join(Policy(*k).name for k in KERAS_POLICIES)
        raise PolyampError(
            f"Keras cannot honour the policy {policy.name!r}: a Keras layer keeps its variables in "
            "float32 and computes in float16/bfloat16 ('mixed_*'), or does both in one dtype, and "
            f"its outputs are in the compute dtype or float32; accepted: {accepted}"
        )
    return KERAS_POLICIES[key]


def check_keras(front_end: str = "tensorflow") -> None:
    """PolyampError unless Keras runs on a backend of ``front_end`` ('tensorflow': TensorFlow; 'keras':
    JAX or torch), naming the front end that drives the backend it runs on."""
    backend = keras.backend.backend()
    if front_end == "tensorflow" and backend != "tensorflow":
        raise PolyampError(
            f"Keras runs on its {backend!r} backend here; polyamp's TensorFlow front end (its custom "
            "GradientTape loops, recipes and doctor) needs KERAS_BACKEND=tensorflow, set before importing "
            "keras. On this backend: MixedPrecision(..., framework='keras'), whose mp.scope(), "
            "mp.optimizer(...) and mp.callback() train under fit"
        )
    if front_end == "keras" and backend not in ("jax", "torch"):
        raise PolyampError(
            f"polyamp.keras drives Keras on its 'jax' and 'torch' backends; Keras runs on {backend!r} "
            "here: MixedPrecision(..., framework='tensorflow') (or framework='keras', which picks it)"
        )


# -- probability layers in float32 inside mp.scope() ---------------------------------------------
_scope = threading.local()  # Keras keeps its dtype policy per thread; so does this flag


def _keep_probabilities_float32(layer_class, is_probability):
    original = layer_class.__init__
    if getattr(original, "_polyamp", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(_scope, "float32_outputs", False) and kwargs.get("dtype") is None and is_probability(self):
            self.dtype_policy = "float32"

    __init__.__signature__ = inspect.signature(original)  # Keras records layer configs from it
    __init__._polyamp = True
    layer_class.__init__ = __init__


def _is_probability_activation(layer) -> bool:
    return getattr(layer.activation, "__name__", None) in _PROBABILITIES


@contextlib.contextmanager
def keras_scope(policy: Policy):
    """Layers built inside take the policy's Keras dtype policy; the previous one is restored."""
    name, float32_outputs = keras_policy(policy)
    _keep_probabilities_float32(keras.layers.Softmax, lambda layer: True)
    _keep_probabilities_float32(keras.layers.Activation, _is_probability_activation)
    previous_policy = keras.config.dtype_policy()
    previous_flag = getattr(_scope, "float32_outputs", False)
    keras.config.set_dtype_policy(name)
    _scope.float32_outputs = float32_outputs
    try:
        yield keras.config.dtype_policy()
    finally:
        keras.config.set_dtype_policy(previous_policy)
        _scope.float32_outputs = previous_flag
