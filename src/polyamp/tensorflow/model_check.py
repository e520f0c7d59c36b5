"""A Keras model left in float32 under a 16-bit policy, seen in the traced step's graph (no op in the
compute dtype): one warning per run. ``mp.watch(model)`` checks the layers' dtype policies instead
(``polyamp.keras.model_check``); an eager loop without ``watch`` has no graph to look at."""

from __future__ import annotations

import weakref

import tensorflow as tf

from ..keras.model_check import LOW_DTYPES, check_model_layers, warn_float32_model

_CHECKED: weakref.WeakSet = weakref.WeakSet()  # the MixedPrecisions already checked (once per run)
_NESTED_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def check_traced_loss(mp, loss) -> None:
    """Once per run, when the step is traced: warn when no op of the loss's graph has an output in
    the policy's 16-bit compute dtype (a model run inside a nested function is not looked into)."""
    compute = mp.policy.compute_dtype
    if compute not in LOW_DTYPES or mp in _CHECKED or tf.executing_eagerly() or not hasattr(loss, "graph"):
        return
    _CHECKED.add(mp)
    wanted = tf.as_dtype(compute)
    ops = loss.graph.get_operations()
    if not any(op.type in _NESTED_CALLS or any(t.dtype == wanted for t in op.outputs) for op in ops):
        warn_float32_model(mp.policy, f"no op of the traced step computes in {compute}")


__all__ = ["check_model_layers", "check_traced_loss"]
