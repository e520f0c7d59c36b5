"""The doctor's TensorFlow / Keras 3 taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the Keras idiom): ``model`` is a Keras model or layer, called as ``model(x, training=True)``;
``batch`` is what ``fit`` takes: ``(x, y)`` or ``(x, y, sample_weight)`` (a tuple or list; x a tensor, or a
tuple / list / dict of tensors), or ``x`` alone (a tensor or a dict); TensorFlow tensors only.
``loss_fn(y_true, y_pred)`` in Keras's order (a ``keras.losses.Loss`` or any callable; given
``sample_weight=`` when the batch has one); with ``x`` alone, ``y_true`` is ``x``. With ``loss_fn=None`` the
model's compiled loss (``model.compute_loss``: the compiled loss, ``add_loss`` and regularisation losses)
when it was compiled with one (or overrides ``compute_loss``, or adds losses), else the outputs must be the
scalar loss. ``optimizer``: a Keras optimizer (not a ``LossScaleOptimizer``: pass its inner optimizer).

Algorithm: the taps run eagerly (``tf.config.run_functions_eagerly`` is on for the forward pass and the
gradient, also for a model compiled with ``jit_compile``), in float32: every layer whose dtype policy
computes in another dtype than its variables' ("mixed_float16", "mixed_bfloat16") is set to its variable
dtype meanwhile, as torch's doctor turns autocast off. Snapshot (reads: TensorFlow copies a variable's
buffer only when it is written while a read of it is alive) the model's variables (with its seed
generators), its metrics' variables, the optimizer's variables (an optimizer not yet built is first built
for the model's trainable variables, as its first ``apply`` would, so what is put back is its initial
state), Keras's global seed generator (forgotten again if the step makes it) and Python's random state
(Keras seeds a SeedGenerator made without a seed from it). Then ``steps`` ordinary float32 steps with
taps:
- every leaf layer (``keep.named_layers``: layers without sub-layers) gets an instance ``call`` that
  records its floating outputs ("output"); one ``tape.gradient(loss, outputs + trainable variables)``
  gives the gradients w.r.t. them ("grad_output"; outputs the loss does not depend on have none);
- every trainable variable, grouped to the leaf layer that owns it (a variable owned directly by a layer
  with sub-layers is a layer of its own, "<layer>/<variable name>"): its value before the step ("weight")
  and its gradient ("grad_weight"; ``IndexedSlices`` made dense);
- with an ``optimizer``: ``optimizer.apply`` of the gradients that exist, and the update ``after -
  before`` of those variables binned relative to the weight ("update_ratio"). Without one, no updates.
Then (in a ``finally``, also when the loss or the model raises) everything is put back, bitwise: the
``call``s and dtype policies, the variables (the trainable ones only with an optimizer: nothing else
writes them), the optimizer's and the metrics' variables (a metric the compiled loss created during the
step is reset) and the random states. Not restorable: TensorFlow's legacy op-seeded random ops
(``tf.random.normal`` without a seed generator) and ``tf.random.Generator`` states.

Binning (``histogram``, ``ratio_histogram``) is one ``tf.function`` per dtype on the tensor's device; only
counts (at most ``N_BINS + 3``) and three scalars reach the host. TensorFlow has no frexp, and its CPU
kernels flush subnormal float inputs to zero, so everything is integer arithmetic on the bits. A float32
(fp16, bf16 widened exactly) is read as uint32 bits ``u``: ``u >> 19`` is ``4096 * sign + SUB * biased
exponent + k``, the spec's index less a constant for a normal float, and one ``bincount`` over it counts
all but zeros and subnormals (exponent 0: re-binned from ``float(|bits|)``, an exact integer conversion,
which also counts the zeros) and inf/NaN (the top keys). The extremes are ``max(max x, -min x)`` and ``min
|x|`` when every element is normal, else masked integer reductions of the magnitudes' bits. float64 takes
the same steps on int64 bits (its subnormals all fall below bin 1). An update ratio ``|u| / 2^b(w)`` of
normal float32 ``u``, ``w`` is ``d = a(u) - (a(w) & 0x7f800000) = (b(u) - b(w)) * 2^23 + mantissa(u)``:
``d >> 19`` is its index less a constant, and ``min d``, ``max d`` give the extremes exactly. Elements
with a zero, subnormal, inf or NaN ``u`` or ``w`` (and float64 tensors) take the same arithmetic on
float64 bits (int64; a subnormal normalised through ``float(mantissa)``), on those elements only; its
extremes come back as ``clip(E) * 2^52 + mantissa`` and ``np.ldexp`` rounds them as the core does. The
results equal ``LogHistogram.of(t.numpy())`` and ``update_ratio_histogram(u.numpy(), w.numpy())``
exactly.
"""

from __future__ import annotations

import inspect
import math
import random
from collections import defaultdict

import keras
import numpy as np
import tensorflow as tf

from ..doctor.histogram import B_MIN, N_BINS, SUB, LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..errors import PolyampError
from ..frameworks import detect
from .keep import named_layers, sublayers
from .policies import check_keras

_MASK, _INF, _NORMAL = 0x7FFFFFFF, 0x7F800000, 0x00800000
_SHIFT = 23 - (SUB.bit_length() - 1)  # a >> _SHIFT = SUB * biased exponent + k (SUB a power of two)
_OFFSET = SUB * (-127 - B_MIN) + 1  # spec index - key, for a normal float32
_KEYS, _KEY_NORMAL, _KEY_INF = (_MASK >> _SHIFT) + 1, _NORMAL >> _SHIFT, _INF >> _SHIFT
_SUB_KEY = SUB * -B_MIN - _OFFSET  # spec index of a subnormal a: key(float(a)) - _SUB_KEY
_SUB_BINS = SUB * 23 + 1  # a subnormal's index is 1..SUB*23; bin 0 counts the zeros
# ratios: d >> _SHIFT lies in [-SUB * 253, SUB * 254) for normal u, w; its spec index is that + SUB * -B_MIN
# + 1. Shifted as uint32, a negative one comes out _RKEYS higher.
_RKEYS = 1 << (32 - _SHIFT)
_RATIO_INDEX = np.clip((np.arange(_RKEYS) + _RKEYS // 2) % _RKEYS - _RKEYS // 2 + SUB * -B_MIN + 1, 0,
                       N_BINS - 1).astype(np.int32)  # fmt: skip
# float64: exponent field 11 bits, mantissa 52
_MASK64, _INF64, _NORMAL64, _MANT64 = 2**63 - 1, 0x7FF << 52, 1 << 52, (1 << 52) - 1
_KEY64_OFFSET = SUB * (1023 + B_MIN) - 1  # spec index = (a >> 48) - this, for a normal float64
_E_CLIP = 1100  # |b(u) - b(w)| beyond this: 2^that over- or underflows float64 either way
_F64 = np.finfo(np.float64)


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its variables and
    ``optimizer`` are left exactly as they were (module docstring)."""
    _check(model, batch, loss_fn, steps, optimizer)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    layers = _layers(model)
    trainable = list({id(v): v for v in model.trainable_variables}.values())
    found: dict[tuple[str, str], list[LogHistogram]] = defaultdict(list)
    state = _Snapshot(model, optimizer)
    taps: list[tuple[keras.layers.Layer, object]] = []
    record: list[tuple[str, tf.Tensor]] = []
    try:
        state.float32_compute()
        if optimizer is not None:
            state.optimizer(trainable)
        taps = [(layer, _tap(layer, name, record)) for name, layer, _ in layers if layer is not None]
        before = {id(v): value for v, value in zip(state.variables, state.values)}
        for _ in range(steps):
            for name, _, vs in layers:
                found[name, "weight"] += [histogram(before[id(v)]) for v in vs]
            record.clear()
            grads = _step(model, x, y, sample_weight, loss_fn, record, trainable)
            for (name, out), grad in zip(record, grads):
                found[name, "output"].append(histogram(out))
                if grad is not None:
                    found[name, "grad_output"].append(histogram(grad))
            grad_of = {id(v): g for v, g in zip(trainable, grads[len(record) :]) if g is not None}
            for name, _, vs in layers:
                found[name, "grad_weight"] += [histogram(grad_of[id(v)]) for v in vs if id(v) in grad_of]
            record.clear()
            if optimizer is None:
                continue
            stepped = [v for v in trainable if id(v) in grad_of]
            optimizer.apply([grad_of[id(v)] for v in stepped], stepped)
            after = {id(v): tf.identity(v) for v in stepped}
            for name, _, vs in layers:
                found[name, "update_ratio"] += [ratio_histogram(after[id(v)] - before[id(v)], before[id(v)])
                                                for v in vs if id(v) in after]  # fmt: skip
            before.update(after)
    finally:
        record.clear()
        for layer, own in taps:
            if own is None:
                del layer.call
            else:
                layer.call = own
        state.restore()
    return [Observation(name, kind, found[name, kind][0].merge(*found[name, kind][1:]))
            for name, _, _ in layers for kind in KINDS if found.get((name, kind))]  # fmt: skip


def _step(model, x, y, sample_weight, loss_fn, record, trainable):
    """Forward, loss and one ``tape.gradient`` for the recorded outputs and the trainable variables."""
    eager = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    try:
        with tf.GradientTape() as tape:
            try:
                outputs = model(x, training=True)
            except (ValueError, TypeError, tf.errors.InvalidArgumentError) as err:
                if isinstance(err, PolyampError):
                    raise
                shapes = [tuple(t.shape) for t in tf.nest.flatten(x) if tf.is_tensor(t)]
                raise PolyampError(f"the model's forward failed on the batch (input shapes {shapes}): {err}"
                                   ) from err  # fmt: skip
            loss = _loss(model, x, y, sample_weight, outputs, loss_fn)
        grads = tape.gradient(loss, [t for _, t in record] + trainable,
                              unconnected_gradients=tf.UnconnectedGradients.NONE)  # fmt: skip
    finally:
        tf.config.run_functions_eagerly(eager)
    if all(g is None for g in grads[len(record) :]):
        raise PolyampError("the loss does not depend on any trainable variable of the model")
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _loss(model, x, y, sample_weight, outputs, loss_fn):
    if loss_fn is not None:
        source = "loss_fn(y_true, y_pred)"
        y_true = x if y is None else y
        if sample_weight is None:
            loss = loss_fn(y_true, outputs)
        else:
            loss = loss_fn(y_true, outputs, sample_weight=sample_weight)
    elif _compiled_loss(model):
        source = "model.compute_loss"
        kwargs = {"training": True} if "training" in inspect.signature(model.compute_loss).parameters else {}
        loss = model.compute_loss(x=x, y=y, y_pred=outputs, sample_weight=sample_weight, **kwargs)
    else:
        source, loss = "the model (loss_fn=None, not compiled with a loss)", outputs
    if not (tf.is_tensor(loss) and loss.dtype.is_floating and loss.shape.num_elements() == 1):
        what = f"shape {tuple(loss.shape)} {loss.dtype.name}" if tf.is_tensor(loss) else _type(loss)
        raise PolyampError(f"{source} must return a scalar floating-point loss tensor, got {what}")
    return loss


def _compiled_loss(model) -> bool:
    if not (isinstance(model, keras.Model) and getattr(model, "compiled", False)):
        return False
    overridden = type(model).compute_loss is not keras.Model.compute_loss
    return model.loss is not None or overridden or bool(model.losses)


def _tap(layer, name: str, record: list):
    """Give ``layer`` an instance ``call`` that records its floating outputs; returns the instance
    attribute it replaced (None: there was none)."""
    own = vars(layer).get("call")
    original = layer.call

    def call(*args, **kwargs):
        outputs = original(*args, **kwargs)
        if tf.executing_eagerly():
            record.extend((name, t) for t in tf.nest.flatten(outputs)
                          if tf.is_tensor(t) and t.dtype.is_floating)  # fmt: skip
        return outputs

    layer.call = call
    return own


class _Snapshot:
    """What ``collect`` puts back: variables, dtype policies, the optimizer, metrics, random states."""

    def __init__(self, model, optimizer):
        self.model, self.opt = model, optimizer
        self.variables = list({id(v): v for v in model.variables}.values())
        self.values = [tf.identity(v) for v in self.variables]
        self.trainable = {id(v) for v in model.trainable_variables}
        metrics = getattr(model, "metrics_variables", []) if isinstance(model, keras.Model) else []
        self.metrics = [(v, tf.identity(v)) for v in metrics]
        self.policies: list[tuple[keras.layers.Layer, object]] = []
        self.opt_values: list[tuple[object, tf.Tensor]] = []
        gen = _global_seed_generator()
        self.seed = (gen.state, tf.identity(gen.state)) if gen is not None else None
        self.py_random = random.getstate()  # Keras draws the seed of a SeedGenerator made without one from it

    def float32_compute(self) -> None:
        """Layers computing in another dtype than their variables' compute in their variables' meanwhile."""
        for layer in [self.model, *(layer for _, layer in named_layers(self.model))]:
            policy = layer.dtype_policy
            plain = not isinstance(policy, keras.dtype_policies.DTypePolicyMap)
            if plain and policy.quantization_mode is None and policy.compute_dtype != policy.variable_dtype:
                self.policies.append((layer, policy))
                layer.dtype_policy = policy.variable_dtype

    def optimizer(self, trainable: list) -> None:
        if not self.opt.built:  # as its first apply would; its initial state is what is put back
            self.opt.build(trainable)
        self.opt_values = [(v, tf.identity(v)) for v in self.opt.variables]

    def restore(self) -> None:
        for layer, policy in reversed(self.policies):
            layer.dtype_policy = policy
        writes = self.opt is not None
        for v, value in zip(self.variables, self.values):
            if writes or id(v) not in self.trainable:
                v.assign(value)
        for v, value in self.opt_values:
            v.assign(value)
        if isinstance(self.model, keras.Model):
            saved = {id(v) for v, _ in self.metrics}
            for metric in self.model.metrics:  # created by the compiled loss during the step
                if any(id(v) not in saved for v in metric.variables):
                    metric.reset_state()
        for v, value in self.metrics:
            v.assign(value)
        if self.seed is not None:
            self.seed[0].assign(self.seed[1])
        elif _global_seed_generator() is not None:  # made during the step: there was none
            _global_seed_generator(reset=True)
        random.setstate(self.py_random)


def _global_seed_generator(reset: bool = False):
    """Keras's global SeedGenerator (``keras.random.*`` with ``seed=None``), if one was made; ``reset``:
    forget it, as if none had been made."""
    from keras.src.backend.common import global_state

    if reset:
        global_state.set_global_attribute("global_seed_generator", None)
    return global_state.get_global_attribute("global_seed_generator")


def _layers(model) -> list[tuple[str, keras.layers.Layer | None, list]]:
    """(layer name, leaf layer or None, its trainable variables) in model order; each variable once."""
    named = named_layers(model)
    if named == [(model.name, model)]:  # a single layer
        return [(model.name, model, list({id(v): v for v in model.trainable_weights}.values()))]
    out, seen = [], set()
    for name, layer in [("", model), *named]:
        subs = sublayers(layer)
        below = {id(v) for sub in subs for v in sub.trainable_weights}
        mine = [v for v in layer.trainable_weights if id(v) not in below and id(v) not in seen]
        seen.update(id(v) for v in mine)
        if not subs:
            out.append((name, layer, mine))
        else:  # a variable of a layer with sub-layers is a layer of its own
            out += [(f"{name}/{_short(v)}" if name else _short(v), None, [v]) for v in mine]
    return out


def _short(v) -> str:
    name = v.name
    return name.rsplit("/", 1)[-1].split(":")[0]


def _check(model, batch, loss_fn, steps, optimizer) -> None:
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
                f"batch: expected TensorFlow tensors, got {_type(leaf)}; convert it (tf.convert_to_tensor) "
                "or pass a batch of the model's framework"
            )
    if isinstance(batch, (tuple, list)) and not 1 <= len(batch) <= 3:
        raise PolyampError(f"batch: expected x, (x, y) or (x, y, sample_weight) as Keras's fit takes them, "
                           f"got a {type(batch).__name__} of {len(batch)} items")  # fmt: skip


def _type(x) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


# -- binning ------------------------------------------------------------------------------------------
def histogram(t) -> LogHistogram:
    """The ``LogHistogram`` of a floating TensorFlow tensor (or variable), binned on its device."""
    x = tf.reshape(tf.convert_to_tensor(t), [-1])
    if not x.dtype.is_floating or x.dtype.is_complex:
        raise PolyampError(f"cannot bin a {x.dtype.name} tensor; accepted: floating-point dtypes (real)")
    if x.shape[0] == 0:
        return _empty()
    if x.dtype == tf.float64:
        return _decode64(*_HIST64(x))
    keys, sub, lo, hi = (r.numpy() for r in _HIST32(tf.cast(x, tf.float32)))
    counts = np.zeros(N_BINS, np.int64)
    counts[_KEY_NORMAL + _OFFSET : _KEY_INF + _OFFSET] = keys[_KEY_NORMAL:_KEY_INF]
    counts[1:_SUB_BINS] += sub[1:]
    lo, hi = int(lo), int(hi)
    return LogHistogram.from_counts(
        counts,
        zeros=int(sub[0]),
        nonfinite=int(keys[_KEY_INF:].sum()),
        amax=_float32(hi) if hi > 0 else 0.0,
        amin_nonzero=_float32(lo) if 0 < lo < _INF else None,
    )


def ratio_histogram(update, weight) -> LogHistogram:
    """``update_ratio_histogram(update, weight)`` of the core, binned on the tensors' device."""
    u = tf.reshape(tf.convert_to_tensor(update), [-1])
    w = tf.reshape(tf.convert_to_tensor(weight), [-1])
    if u.shape != w.shape:
        raise PolyampError(f"update shape {tuple(update.shape)} differs from weight's {tuple(weight.shape)}")
    for t in (u, w):
        if not t.dtype.is_floating or t.dtype.is_complex:
            raise PolyampError(f"cannot bin a {t.dtype.name} tensor; accepted: floating-point dtypes (real)")
    if u.shape[0] == 0:
        return _empty()
    if tf.float64 in (u.dtype, w.dtype):
        return _decode_general(*(r.numpy() for r in _RATIO64(_bits64(u), _bits64(w))))
    counts, dlo, dhi, general, glo, ghi = (r.numpy() for r in _RATIO32(tf.cast(u, tf.float32),
                                                                      tf.cast(w, tf.float32)))  # fmt: skip
    counts = counts.astype(np.int64)
    if counts.any():
        regular = LogHistogram.from_counts(counts, 0, 0, _ratio_value(int(dhi)), _ratio_value(int(dlo)))
    else:
        regular = _empty()
    if not general.any():
        return regular
    return regular.merge(_decode_general(general, glo, ghi))


def _empty() -> LogHistogram:
    return LogHistogram.from_counts(np.zeros(N_BINS, np.int64), 0, 0, 0.0)


def _float32(bits: int) -> float:
    return float(np.array(bits, np.int32).view(np.float32))


def _ratio_value(d: int) -> float:
    """|u| / 2^b(w) from d = (b(u) - b(w)) * 2^23 + mantissa(u): exact in float64."""
    return math.ldexp(1.0 + (d & 0x7FFFFF) / 2.0**23, d >> 23)


def _decode64(counts, lo, hi) -> LogHistogram:
    counts, lo, hi = counts.numpy().astype(np.int64), int(lo), int(hi)
    return LogHistogram.from_counts(
        counts[:N_BINS],
        zeros=int(counts[N_BINS]),
        nonfinite=int(counts[N_BINS + 1]),
        amax=float(np.array(hi, np.int64).view(np.float64)) if hi > 0 else 0.0,
        amin_nonzero=float(np.array(lo, np.int64).view(np.float64)) if 0 < lo < _INF64 else None,
    )


def _decode_general(counts, lo, hi) -> LogHistogram:
    """The float64 ratio path's counts (bins, nonfinite, apart, zeros) and the extremes' keys
    ``E * 2^52 + mantissa(u)`` (E = b(u) - b(w), clipped): ``np.ldexp`` rounds as the core does."""
    counts = np.asarray(counts).astype(np.int64)
    amax, amin = 0.0, None
    if counts[:N_BINS].any():
        with np.errstate(over="ignore", under="ignore"):
            rmax, rmin = (np.ldexp((1.0 + (int(k) & _MANT64) * 2.0**-52) / 2, (int(k) >> 52) + 1)
                          for k in (hi, lo))  # fmt: skip
        amax = float(min(rmax, _F64.max))
        amin = float(rmin) if rmin > 0 else None
    return LogHistogram.from_counts(counts[:N_BINS], zeros=int(counts[N_BINS + 2]),
                                    nonfinite=int(counts[N_BINS]), amax=amax, amin_nonzero=amin,
                                    apart=int(counts[N_BINS + 1]))  # fmt: skip


def _i64(v: int):
    return tf.constant(v, tf.int64)


def _shr(x, n: int):
    return tf.bitwise.right_shift(x, tf.constant(n, x.dtype))


def _and(x, mask: int):
    return tf.bitwise.bitwise_and(x, tf.constant(mask, x.dtype))


def _bits32(x):
    return _and(tf.bitcast(x, tf.int32), _MASK)


def _hist32(x):
    """Keys' counts (4096), subnormal and zero counts (``_SUB_BINS``), smallest non-zero and largest
    finite magnitude's bits (module docstring)."""
    both = tf.math.bincount(tf.bitcast(_shr(tf.bitcast(x, tf.uint32), _SHIFT), tf.int32),
                            minlength=2 * _KEYS, maxlength=2 * _KEYS)  # fmt: skip
    counts = both[:_KEYS] + both[_KEYS:]
    special = tf.reduce_sum(counts[:_KEY_NORMAL]) + tf.reduce_sum(counts[_KEY_INF:]) > 0

    def normal():  # every element normal and finite
        hi = tf.maximum(tf.reduce_max(x), -tf.reduce_min(x))
        lo = tf.reduce_min(tf.abs(x))
        return tf.zeros([_SUB_BINS], tf.int32), tf.bitcast(lo, tf.int32), tf.bitcast(hi, tf.int32)

    def other():
        a = _bits32(x)
        lo = tf.reduce_min(tf.where(a > 0, a, _MASK))
        hi = tf.reduce_max(tf.where(a < _INF, a, -1))
        tiny = tf.boolean_mask(a, a < _NORMAL)  # zeros and subnormals: a * 2^-149, a < 2^23 exact in float32
        key = _shr(tf.bitcast(tf.cast(tiny, tf.float32), tf.int32), _SHIFT) - _SUB_KEY
        sub = tf.math.bincount(tf.where(tiny > 0, key, 0), minlength=_SUB_BINS, maxlength=_SUB_BINS)
        return sub, lo, hi

    sub, lo, hi = tf.cond(special, other, normal)
    return counts, sub, lo, hi


def _hist64(x):
    """Bin counts, zeros and nonfinite (``N_BINS + 2``), smallest non-zero and largest finite bits."""
    a = _and(tf.bitcast(x, tf.int64), _MASK64)
    finite = a < _INF64
    idx = tf.clip_by_value(_shr(a, 48) - _KEY64_OFFSET, 0, N_BINS - 1)
    code = tf.where(a == 0, _i64(N_BINS), tf.where(finite, idx, _i64(N_BINS + 1)))
    counts = tf.math.bincount(code, minlength=N_BINS + 2, maxlength=N_BINS + 2)
    lo = tf.reduce_min(tf.where(a > 0, a, _i64(_MASK64)))
    hi = tf.reduce_max(tf.where(finite, a, _i64(-1)))
    return counts, lo, hi


def _ratio32(u, w):
    """Regular elements (normal u, w): bin counts (by ``d >> 19``), min and max d; the others:
    ``_ratio64``'s outputs for them (empty when none)."""
    au, ew = _bits32(u), _and(tf.bitcast(w, tf.int32), _INF)  # |u|'s bits, 2^b(w)'s bits
    d = au - ew
    keys = tf.bitcast(_shr(tf.bitcast(d, tf.uint32), _SHIFT), tf.int32)  # d >> 19 modulo 2^13
    regular = ((tf.reduce_min(au) >= _NORMAL) & (tf.reduce_max(au) < _INF)
               & (tf.reduce_min(ew) > 0) & (tf.reduce_max(ew) < _INF))  # fmt: skip

    def all_regular():
        counts = tf.math.bincount(keys, minlength=_RKEYS, maxlength=_RKEYS)
        return counts, tf.reduce_min(d), tf.reduce_max(d), tf.zeros([N_BINS + 3], tf.int64), _i64(0), _i64(0)

    def some_special():
        aw = _bits32(w)
        odd = (au < _NORMAL) | (au >= _INF) | (aw < _NORMAL) | (aw >= _INF)
        counts = tf.math.bincount(tf.where(odd, _RKEYS, keys), minlength=_RKEYS + 1, maxlength=_RKEYS + 1)
        lo = tf.reduce_min(tf.where(odd, tf.int32.max, d))
        hi = tf.reduce_max(tf.where(odd, tf.int32.min, d))
        return (counts[:_RKEYS], lo, hi,
                *_ratio64(_widen(tf.boolean_mask(au, odd)), _widen(tf.boolean_mask(aw, odd))))  # fmt: skip

    counts, *rest = tf.cond(regular, all_regular, some_special)
    return (tf.math.unsorted_segment_sum(counts, _RATIO_INDEX, N_BINS), *rest)  # keys to the spec's bins


def _widen(a):
    """float32 magnitude bits (int32) -> the same values' float64 bits (int64), exactly; subnormals
    through an integer-to-float conversion (TensorFlow's CPU kernels flush subnormal float inputs)."""
    a = tf.cast(a, tf.int64)
    e = _shr(a, 23)
    e = tf.where(e == 255, _i64(2047), e + (1023 - 127))
    wide = tf.bitwise.bitwise_or(e * (1 << 52), _and(a, 0x7FFFFF) * (1 << 29))
    tiny = tf.bitcast(tf.cast(a, tf.float64), tf.int64) - (149 << 52)  # a * 2^-149, a < 2^23
    return tf.where(a >= _NORMAL, wide, tf.where(a == 0, _i64(0), tiny))


def _ratio64(au, aw):
    """The ratio spec in int64 arithmetic on float64 magnitude bits: counts (bins, then nonfinite, apart,
    zeros) and min and max of ``clip(E) * 2^52 + mantissa(u)`` over the regular elements."""
    bad = (au >= _INF64) | (aw >= _INF64)
    apart = ~bad & (aw == 0)
    zero = ~bad & ~apart & (au == 0)
    regular = ~(bad | apart | zero)
    nu, nw = _normalised64(au), _normalised64(aw)
    e = _shr(nu, 52) - _shr(nw, 52)  # b(u) - b(w)
    idx = tf.clip_by_value(SUB * (e - B_MIN) + _and(_shr(nu, 48), SUB - 1) + 1, 0, N_BINS - 1)
    code = tf.where(apart, _i64(N_BINS + 1), tf.where(zero, _i64(N_BINS + 2), idx))
    counts = tf.math.bincount(tf.where(bad, _i64(N_BINS), code), minlength=N_BINS + 3, maxlength=N_BINS + 3,
                              dtype=tf.int64)  # fmt: skip
    key = tf.clip_by_value(e, -_E_CLIP, _E_CLIP) * (1 << 52) + _and(nu, _MANT64)
    lo = tf.reduce_min(tf.where(regular, key, _i64(tf.int64.max)))
    hi = tf.reduce_max(tf.where(regular, key, _i64(tf.int64.min)))
    return counts, lo, hi


def _normalised64(a):
    """float64 magnitude bits, a subnormal ``m * 2^-1074`` as ``float(m)``'s bits with the exponent
    lowered by 1074 (may go negative; exact)."""
    return tf.where(a < _NORMAL64, tf.bitcast(tf.cast(a, tf.float64), tf.int64) - (1074 << 52), a)


def _bits64(t):
    """A floating tensor's magnitudes as float64 bits (int64)."""
    if t.dtype == tf.float64:
        return _and(tf.bitcast(t, tf.int64), _MASK64)
    return _WIDEN(_bits32(tf.cast(t, tf.float32)))


_HIST32 = tf.function(_hist32, input_signature=[tf.TensorSpec([None], tf.float32)])
_HIST64 = tf.function(_hist64, input_signature=[tf.TensorSpec([None], tf.float64)])
_RATIO32 = tf.function(_ratio32, input_signature=[tf.TensorSpec([None], tf.float32)] * 2)
_RATIO64 = tf.function(_ratio64, input_signature=[tf.TensorSpec([None], tf.int64)] * 2)
_WIDEN = tf.function(_widen, input_signature=[tf.TensorSpec([None], tf.int32)])
