"""The Keras doctor's inputs: a batch converted as ``fit`` converts it, and the arguments checked."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..frameworks import detect
from ..keras.policies import check_keras


def as_tensors(batch):
    """``batch`` with its numpy arrays as TensorFlow tensors, floating ones not in Keras's floatx cast to it,
    as ``fit`` converts them (tuples, lists and dicts of them: a keras_hub model's ``{"token_ids",
    "padding_mask"}``); other leaves as they are (``check_input`` judges them)."""

    def convert(leaf):
        if not isinstance(leaf, np.ndarray):
            return leaf
        if leaf.dtype.kind == "f" and leaf.dtype != np.dtype(keras.config.floatx()):
            leaf = leaf.astype(keras.config.floatx())
        return tf.convert_to_tensor(leaf)

    return tf.nest.map_structure(convert, batch)


def check_input(model, batch, loss_fn, steps, optimizer) -> None:
    """One PolyampError for a doctor argument the Keras front end cannot take (after ``as_tensors``)."""
    check_keras()
    if not isinstance(model, keras.layers.Layer):
        raise PolyampError(f"model: expected a Keras model or layer (keras.Model, keras.layers.Layer), got "
                           f"{_type(model)}")  # fmt: skip
    if not model.built:
        raise PolyampError(f"model {_type(model)} is not built: call it once on a batch (or build it) first; "
                           "the doctor observes the variables it has and creates none")  # fmt: skip
    if not model.trainable_weights:
        which = "no variables" if not model.weights else "no trainable variables"
        raise PolyampError(f"model {_type(model)} has {which}; the doctor observes the weights it trains")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolyampError(f"steps must be a whole number >= 1, got {steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        hint = f"; for a loss by name use keras.losses.get({loss_fn!r})" if isinstance(loss_fn, str) else ""
        raise PolyampError("loss_fn must be callable(y_true, y_pred) (a keras.losses.Loss or a function) or "
                           f"None, got {_type(loss_fn)}{hint}")  # fmt: skip
    if optimizer is not None:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise PolyampError(
                f"optimizer: got a {type(optimizer).__name__}, which scales the loss; the "
                "doctor runs float32 steps: pass the optimizer it wraps (its inner_optimizer)"
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise PolyampError(
                f"optimizer: expected a keras.optimizers.Optimizer or None, got {_type(optimizer)}"
            )
    for leaf in tf.nest.flatten(batch):
        if leaf is not None and (not tf.is_tensor(leaf) or detect(leaf) not in (None, "tensorflow")):
            raise PolyampError(
                f"batch: expected TensorFlow tensors or numpy arrays (as fit takes them), got {_type(leaf)}; "
                "convert it (tf.convert_to_tensor, np.asarray) or pass a batch of the model's framework"
            )
    if isinstance(batch, (tuple, list)) and not 1 <= len(batch) <= 3:
        raise PolyampError(f"batch: expected x, (x, y) or (x, y, sample_weight) as Keras's fit takes them, "
                           f"got a {type(batch).__name__} of {len(batch)} items")  # fmt: skip
