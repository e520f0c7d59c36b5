"""The compare workloads in TensorFlow/Keras 3, trained with ``polyamp.MixedPrecision``.

The networks are Keras layers built inside ``mp.scope()`` (so they take the policy's Keras dtype
policy) and loaded with the numpy weights of ``workloads.py`` (a Keras ``Dense`` kernel is
``W[in, out]`` as stored there). One train step is a ``tf.function``: forward, ``mp.scale``,
gradients, ``mp.apply`` with Keras's Adam (epsilon 1e-8, as torch's). LayerNorm epsilon and the
exact (erf) GELU match the torch module; attention probabilities are a ``Softmax`` layer, which
``mp.scope()`` keeps in float32 under the mixed policies; logits go to the loss in float32.
What backward keeps is read from the traced graph: the forward tensors its gradient ops consume.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from ..mixed_precision import MixedPrecision  # noqa: E402
from ..step import StepResult  # noqa: E402
from .protocol import Saved, TrainerBase  # noqa: E402
from .workloads import Workload  # noqa: E402


def _dense(weights: dict, name: str, activation=None) -> keras.layers.Dense:
    w, b = weights[name + ".w"], weights[name + ".b"]
    layer = keras.layers.Dense(w.shape[1], activation=activation)
    layer.build((None, w.shape[0]))
    layer.set_weights([w, b])
    return layer


def _layer_norm(weights: dict, name: str, d: int) -> keras.layers.LayerNormalization:
    ln = keras.layers.LayerNormalization(epsilon=1e-5)  # torch's default
    ln.build((None, d))
    ln.set_weights([weights[name + ".g"], weights[name + ".b"]])
    return ln


def mlp(wl: Workload) -> keras.Sequential:
    n = len(wl.dims) - 1
    return keras.Sequential(
        [keras.Input((wl.dims[0],))]
        + [_dense(wl.weights, f"fc{i}", wl.activation if i < n - 1 else None) for i in range(n)]
    )


class Block(keras.layers.Layer):
    """Pre-LN transformer block: causal multi-head attention and a GELU MLP of width 4d."""

    def __init__(self, wl: Workload, i: int):
        super().__init__()
        p, d = f"block{i}.", wl.d_model
        self.heads = wl.heads
        self.ln1, self.ln2 = _layer_norm(wl.weights, p + "ln1", d), _layer_norm(wl.weights, p + "ln2", d)
        self.q, self.k, self.v, self.o = (_dense(wl.weights, p + n) for n in "qkvo")
        self.ff1 = _dense(wl.weights, p + "ff1", "gelu")
        self.ff2 = _dense(wl.weights, p + "ff2")
        self.softmax = keras.layers.Softmax()

    def call(self, x):
        b, t, d = tf.shape(x)[0], tf.shape(x)[1], x.shape[-1]
        h = self.ln1(x)

        def heads(f):
            return tf.transpose(tf.reshape(f(h), (b, t, self.heads, d // self.heads)), (0, 2, 1, 3))

        q, k, v = heads(self.q), heads(self.k), heads(self.v)
        scores = tf.matmul(q, k, transpose_b=True) * tf.cast(1.0 / math.sqrt(d // self.heads), q.dtype)
        causal = tf.linalg.band_part(tf.ones((t, t), tf.bool), -1, 0)
        probs = tf.cast(self.softmax(scores, mask=causal), v.dtype)
        a = tf.reshape(tf.transpose(tf.matmul(probs, v), (0, 2, 1, 3)), (b, t, d))
        x = x + self.o(a)
        return x + self.ff2(self.ff1(self.ln2(x)))


class CharLM(keras.Model):
    def __init__(self, wl: Workload):
        super().__init__()
        w = wl.weights
        self.embed = keras.layers.Embedding(*w["embed"].shape)
        self.embed.build((None, None))
        self.embed.set_weights([w["embed"]])
        self.pos = self.add_weight(shape=w["pos"].shape, initializer=keras.initializers.Constant(w["pos"]),
                                   name="pos")  # fmt: skip
        self.blocks = [Block(wl, i) for i in range(wl.layers)]
        self.lnf = _layer_norm(w, "lnf", wl.d_model)
        self.head = _dense(w, "head")

    def call(self, ids):
        x = self.embed(ids) + tf.cast(self.pos[: tf.shape(ids)[1]], self.compute_dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.lnf(x))


def _mse(out, y):
    return tf.reduce_mean(tf.square(out - y))


def _cross_entropy(out, y):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))


_LOSSES = {"mse": _mse, "cross_entropy": _cross_entropy}
_NETWORKS = {"dense": mlp, "transformer": CharLM}
_PASS_THROUGH = {"Identity", "ReadVariableOp"}  # what lies between a variable and a cast of it


def _ancestors(tensors) -> set:
    """Every op the ``tensors`` depend on (data inputs), their own ops included."""
    seen, todo = set(), [t.op for t in tensors]
    while todo:
        op = todo.pop()
        if op not in seen:
            seen.add(op)
            todo.extend(t.op for t in op.inputs)
    return seen


def _saved_in_graph(loss, grads) -> tuple[int | None, int | None]:
    """(activation bytes, weight-copy bytes) that the backward ops of a traced step read from its
    forward ops: forward = the loss's ancestors, backward = the gradients' other ancestors."""
    forward = _ancestors([loss])
    backward = _ancestors(grads) - forward
    saved = {t.name: t for op in backward for t in op.inputs if t.op in forward}
    activations = copies = 0
    for t in saved.values():
        if t.op.type in ("ReadVariableOp", "Const") or t.dtype == tf.resource:
            continue  # a parameter, or a constant of the graph
        n = t.shape.num_elements()
        if n is None:
            return None, None
        size = n * t.dtype.size
        if t.op.type == "Cast" and t.op.inputs[0].op.type in _PASS_THROUGH:
            copies += size
        else:
            activations += size
    return activations, copies


def _entry(v) -> tuple[int, str]:
    return int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize, str(v.dtype)


class Trainer(TrainerBase):
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        keras.utils.set_random_seed(wl.seed)
        self.wl = wl
        self.mp = MixedPrecision(policy, framework="tensorflow")
        with self.mp.scope():
            self.model = _NETWORKS[wl.architecture](wl)
        self.model(wl.batch_at(0)[0][:1])  # builds every layer (the blocks' softmax layers too)
        if self.mp.recipe is not None:  # its Dense layers run the recipe's quantized GEMMs
            self.mp.watch(self.model)
        self.opt = keras.optimizers.Adam(wl.lr, epsilon=1e-8)
        self.opt.build(self.model.trainable_variables)
        self._train = tf.function(self._train_step)
        self._eval = tf.function(self._predict)

    def _loss(self, out, y):
        return _LOSSES[self.wl.loss_kind](tf.cast(out, tf.float32), y)

    def _train_step(self, x, y):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = self._loss(self.model(x, training=True), y)
            scaled = self.mp.scale(loss)
        result = self.mp.apply(self.opt, tape.gradient(scaled, variables), variables)
        return loss, result.stepped, result.scale

    def _predict(self, x):
        return tf.cast(self.model(x, training=False), tf.float32)

    def doctor_inputs(self, i: int = 0) -> tuple:
        """``polyamp.doctor``'s (model, batch, loss_fn in Keras's (y_true, y_pred) order, optimizer)."""
        x, y = (tf.convert_to_tensor(a) for a in self.wl.batch_at(i))
        return self.model, (x, y), lambda y_true, y_pred: self._loss(y_pred, y_true), self.opt

    def step(self, i: int) -> float:
        x, y = self.wl.batch_at(i)
        loss, stepped, scale = self._train(x, y)
        self.last = StepResult(bool(stepped), float(scale))
        return float(loss)

    @property
    def inference_form(self) -> str:
        return (f"model(x, training=False) in a tf.function under the Keras dtype policy "
                f"{self.model.dtype_policy.name}: float32 variables, cast per layer")  # fmt: skip

    def forward(self, x: np.ndarray) -> np.ndarray:
        """The model under the policy's Keras dtype policy, ``training=False`` (also ``infer``)."""
        return self._eval(x).numpy()

    # -- memory probes ---------------------------------------------------------------------------
    def _parameters(self):
        return [_entry(v) for v in self.model.trainable_variables]

    def _gradients(self):
        return self._parameters()  # tape.gradient returns each variable's gradient in its dtype

    def _optimizer_bytes(self):
        return sum(_entry(v)[0] for v in self.opt.variables)

    def _saved(self) -> Saved:
        def loss_and_grads(x, y):
            with tf.GradientTape() as tape:
                loss = self._loss(self.model(x, training=True), y)
            grads = tape.gradient(loss, self.model.trainable_variables)
            return loss, [tf.convert_to_tensor(g) for g in grads]

        graph = tf.function(loss_and_grads).get_concrete_function(*self.wl.batch_at(0)).graph
        loss, *grads = graph.outputs
        activations, copies = _saved_in_graph(loss, grads)
        return Saved(activations, copies, "tensors the backward ops of the traced step (tf.function "
                     "graph, before Grappler's rewrites) read from its forward ops; variable reads "
                     "excluded, their casts counted as weight copies")  # fmt: skip


def versions() -> dict[str, str]:
    return {"tensorflow": tf.__version__, "keras": keras.__version__}


def tune_inputs(name: str, quick: bool = False) -> tuple:
    """A workload as ``polyamp.tensorflow.tune``'s arguments: the function that builds its float32
    network with the workload's weights, its batches (cycled), its loss in Keras's ``(y_true, y_pred)``
    order, and Keras's Adam with the workload's learning rate and epsilon 1e-8, as the Trainer uses."""
    from .workloads import get_workload

    wl = get_workload(name, quick=quick)
    loss = _LOSSES[wl.loss_kind]

    def make_model() -> keras.Model:
        return _NETWORKS[wl.architecture](wl)

    def batch(i: int):
        return wl.batch_at(i % wl.steps)

    adam = keras.optimizers.Adam(wl.lr, epsilon=1e-8)
    return make_model, batch, (lambda y_true, y_pred: loss(y_pred, y_true)), adam
