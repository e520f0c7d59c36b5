"""One small training run per framework, driven the framework's own way, for the contract tests.

``tests/test_contract.py`` states what every front end must do (skip exactly the non-finite steps,
follow ``DynamicLossScale.update``, resume bit for bit, refuse bad input without side effects) once,
parametrised over these drivers. Each driver builds the same tiny network (Dense 8->16, tanh,
Dense 16->1, the same initial weights from numpy), its optimizer and a ``MixedPrecision``, and has
the same few methods:

- ``make(policy=None, *, seed=0, optimizer="sgd", lr=0.01, **mp_kwargs)``: a fresh run;
- ``step(inject=None)``: one training step, the framework's way, on batch ``t`` (its step
  counter); ``inject=(k, i, value)`` makes element ``i`` of the *scaled* gradient of parameter
  ``k`` (w1, b1, w2, b2) ``value`` (inf, -inf or NaN) before the step; returns ``(stepped,
  scale)``, and keeps the ``StepResult`` (None in JAX) as ``last``;
- ``backward(inject)`` then ``apply(clip)``: the two halves of ``step`` where the front end has
  them (torch, TensorFlow, MXNet);
- ``params()`` and ``snapshot()`` (parameters, then the optimizer's state) as numpy arrays;
  ``state()``: the loss-scale state on the host;
- ``state_dict()`` / ``load_state_dict(d)``: the whole checkpoint (model, optimizer,
  ``mp.state_dict()``, step counter) as picklable values.

``tensorflow`` runs the step inside ``tf.function``, ``tensorflow-eager`` eagerly; ``jax`` under
``jax.jit``; ``mxnet`` (in ``.venv-mxnet``) under bf16-mixed, the only mixed policy MXNet runs on
CPU. The framework is imported by ``make`` with ``frameworks.require`` semantics: where
``POLYAMP_TEST_FRAMEWORKS`` requests it, a failed import is a failure, otherwise a skip.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from frameworks import require

import polyamp as pa

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SIZES = (8 * 16, 16, 16, 1)  # the elements of each parameter: w1, b1, w2, b2


@functools.cache
def initial_weights(seed: int = 0) -> tuple:
    """(w1 (8, 16), b1, w2 (16, 1), b2) as float32, kernels laid out (in, out)."""
    rng = np.random.default_rng(seed)
    return (
        (rng.standard_normal((8, 16)) / 3).astype(np.float32),
        (rng.standard_normal(16) / 10).astype(np.float32),
        (rng.standard_normal((16, 1)) / 8).astype(np.float32),
        np.zeros(1, np.float32),
    )


@functools.lru_cache(maxsize=64)
def _batch(i: int, size: int) -> tuple:
    x = np.random.default_rng(1000 + i).standard_normal((size, 8)).astype(np.float32)
    return x, (np.sin(x.sum(1, keepdims=True)) / 2).astype(np.float32)


def batch(t: int, size: int = 8) -> tuple:
    """Step ``t``'s (x, y): 64 batches, cycled."""
    return _batch(t % 64, size)


def same(a: list, b: list) -> bool:
    """Bit-identical lists of arrays (NaN equal to NaN)."""
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b)
    )


def all_finite(arrays: list) -> bool:
    return all(np.isfinite(a).all() for a in arrays if np.issubdtype(a.dtype, np.floating))


def check_fault(inject: tuple | None) -> tuple | None:
    """``inject`` after checking that it names an element of a parameter."""
    if inject is not None:
        k, i, value = inject
        assert 0 <= k < len(SIZES) and 0 <= i < SIZES[k] and not math.isfinite(value), inject
    return inject


class Driver:
    """A run of the tiny network in one framework (see the module docstring)."""

    id = ""  # the test id
    framework = ""  # polyamp's name for the framework
    policies: tuple = ("float32", "bf16-mixed", "fp16-mixed")  # the policies it runs on CPU
    policy = "fp16-mixed"  # the loss-scaled policy of the contract runs
    traced = False  # the step runs compiled (tf.function, jit)
    names = True  # StepResult.nonfinite names the parameters (self.param_names)
    clips = True  # the step takes clip_grad_norm
    one_step_lag = True  # runs the 'mxnet' preset (its update needs the host)
    bad_loss_message = ""  # the error for an integer loss

    def __init__(self, policy: str, seed: int, optimizer: str, lr: float, mp_kwargs: dict):
        self.t = 0
        self.last = None
        self.param_names: list[str] = []
        self._build(policy, initial_weights(seed), optimizer, lr, mp_kwargs)

    @classmethod
    def make(cls, policy: str | None = None, *, seed: int = 0, optimizer: str = "sgd", lr: float = 0.01,
             **mp_kwargs) -> Driver:  # fmt: skip
        cls.load()
        return cls(policy or cls.policy, seed, optimizer, lr, mp_kwargs)

    @staticmethod
    def load() -> None:
        """Import the framework (a failure where the run requested it, else a skip)."""

    def step(self, inject: tuple | None = None, clip: float | None = None) -> tuple[bool, float]:
        self.backward(check_fault(inject))
        return self.apply(clip)

    def _done(self, result) -> tuple[bool, float]:
        self.last = result
        self.t += 1
        return bool(result.stepped), float(result.scale)

    def state(self) -> pa.LossScaleState:
        return self.mp.state

    def state_dict(self) -> dict:
        return {"model": self.params(), "optimizer": self._optimizer_state(), "mp": self.mp.state_dict(),
                "t": self.t}  # fmt: skip

    def load_state_dict(self, ckpt: dict) -> None:
        self.mp.load_state_dict(ckpt["mp"])
        self._load(ckpt["model"], ckpt["optimizer"])
        self.t = ckpt["t"]

    def snapshot(self) -> list:
        return self.params() + self._optimizer_arrays()


# -- PyTorch: mp.autocast, mp.backward, mp.step ----------------------------------------------------
class TorchDriver(Driver):
    id = framework = "torch"
    bad_loss_message = r"loss must be a floating-point torch tensor, got torch.int64"

    @staticmethod
    def load() -> None:
        require("torch")

    def _build(self, policy, weights, optimizer, lr, mp_kwargs):
        import torch
        from torch import nn

        self.torch = torch
        self.mp = pa.MixedPrecision(policy, framework="torch", device="cpu", **mp_kwargs)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        with torch.no_grad():
            for p, w in zip(self.model.parameters(), weights):
                p.copy_(torch.from_numpy(w.T.copy() if w.ndim == 2 else w))
        self.mp.watch(self.model)
        self.param_names = [name for name, _ in self.model.named_parameters()]
        make = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]
        self.opt = make(self.model.parameters(), lr=lr)

    def backward(self, inject=None) -> None:
        torch = self.torch
        x, y = (torch.from_numpy(a) for a in batch(self.t))
        self.opt.zero_grad()
        with self.mp.autocast():
            loss = torch.nn.functional.mse_loss(self.model(x).float(), y)
        self.mp.backward(loss)
        if inject is not None:
            k, i, value = inject
            list(self.model.parameters())[k].grad.view(-1)[i] = value

    def apply(self, clip=None):
        return self._done(self.mp.step(self.opt, clip_grad_norm=clip))

    def bad_loss(self) -> None:
        self.mp.backward(self.torch.tensor(3))

    def params(self) -> list:
        return [p.detach().numpy().copy() for p in self.model.parameters()]

    def _optimizer_state(self) -> dict:
        return copy.deepcopy(self.opt.state_dict())

    def _optimizer_arrays(self) -> list:
        state = self.opt.state_dict()["state"]
        return [np.asarray(v).copy() for k in sorted(state) for _, v in sorted(state[k].items())]

    def _load(self, model, optimizer) -> None:
        with self.torch.no_grad():
            for p, w in zip(self.model.parameters(), model):
                p.copy_(self.torch.from_numpy(w))
        self.opt.load_state_dict(optimizer)


# -- TensorFlow / Keras 3: mp.scope, mp.scale, mp.apply, inside tf.function -------------------------
class TensorFlowDriver(Driver):
    id = framework = "tensorflow"
    traced = True
    names = False  # inside tf.function a StepResult names nothing
    one_step_lag = False
    bad_loss_message = r"loss must be a floating-point TensorFlow tensor, got <dtype: 'int32'>"

    @staticmethod
    def load() -> None:
        require("tensorflow")
        require("keras")

    def _build(self, policy, weights, optimizer, lr, mp_kwargs):
        import keras
        import tensorflow as tf

        self.tf = tf
        self.mp = pa.MixedPrecision(policy, framework="tensorflow", **mp_kwargs)
        with self.mp.scope():
            self.model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                           keras.layers.Dense(1)])  # fmt: skip
        self.model.set_weights(list(weights))
        self.mp.watch(self.model)
        self.variables = self.model.trainable_variables
        self.param_names = [self.mp.parameter_name(v) for v in self.variables]
        self.opt = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam}[optimizer](lr)
        self.opt.build(self.variables)  # before the first trace (building inside it retraces)
        self._step = tf.function(self._whole_step) if self.traced else self._whole_step
        self._grads = tf.function(self._gradients) if self.traced else self._gradients
        self._pending = None

    def _gradients(self, x, y, which, position, value):
        tf = self.tf
        with tf.GradientTape() as tape:
            out = tf.cast(self.model(x, training=True), tf.float32)
            scaled = self.mp.scale(tf.reduce_mean(tf.square(out - y)))
        grads = tape.gradient(scaled, self.variables)
        return [g + tf.where((which == k) & (tf.reshape(tf.range(tf.size(g)), tf.shape(g)) == position),
                             tf.cast(value, g.dtype), tf.zeros((), g.dtype))
                for k, g in enumerate(grads)]  # fmt: skip

    def _whole_step(self, x, y, which, position, value):
        return self.mp.apply(self.opt, self._gradients(x, y, which, position, value), self.variables)

    def _inputs(self, inject):
        k, i, value = check_fault(inject) if inject is not None else (-1, -1, 0.0)
        return (*batch(self.t), np.int32(k), np.int32(i), np.float32(value))

    def step(self, inject=None, clip=None):
        if clip is not None:
            return super().step(inject, clip)
        return self._done(self._step(*self._inputs(inject)))

    def backward(self, inject=None) -> None:
        self._pending = self._grads(*self._inputs(inject))

    def apply(self, clip=None):
        def apply(*grads):
            return self.mp.apply(self.opt, list(grads), self.variables, clip_grad_norm=clip)

        result = (self.tf.function(apply) if self.traced else apply)(*self._pending)
        self._pending = None
        return self._done(result)

    def bad_loss(self) -> None:
        loss = lambda: self.mp.scale(self.tf.constant(3))  # noqa: E731
        (self.tf.function(loss) if self.traced else loss)()

    def params(self) -> list:
        return [v.numpy().copy() for v in self.variables]

    def _optimizer_state(self) -> dict:
        store: dict = {}
        self.opt.save_own_variables(store)
        return {k: np.array(v) for k, v in store.items()}

    def _optimizer_arrays(self) -> list:
        return [v.numpy().copy() for v in self.opt.variables]

    def _load(self, model, optimizer) -> None:
        for v, w in zip(self.variables, model):
            v.assign(w)
        self.opt.load_own_variables(optimizer)


class TensorFlowEagerDriver(TensorFlowDriver):
    """The same step, run eagerly (where the StepResult names the non-finite variables)."""

    id = "tensorflow-eager"
    traced = False
    names = True


# -- JAX: mp.autocast(fn), mp.value_and_grad, polyamp.jax.step_if_finite, under jax.jit --------------
class JaxDriver(Driver):
    id = framework = "jax"
    traced = True
    names = False  # functional: the finite flag only
    clips = False  # clipping is an optax transformation
    one_step_lag = False
    bad_loss_message = r"the loss function must return a floating scalar .* got int32 \(\)"

    @staticmethod
    def load() -> None:
        require("jax")
        importlib.import_module("optax")

    def _build(self, policy, weights, optimizer, lr, mp_kwargs):
        import jax
        import jax.numpy as jnp
        import optax

        from polyamp.jax import step_if_finite

        self.jax, self.jnp = jax, jnp
        self.mp = mp = pa.MixedPrecision(policy, framework="jax", **mp_kwargs)
        self.weights = [jnp.asarray(w) for w in weights]
        self.optimizer = {"sgd": optax.sgd, "adam": optax.adam}[optimizer](lr)
        self.opt_state = self.optimizer.init(self.weights)
        self.scale_state = mp.init()

        def loss_fn(p, x, y):
            w1, b1, w2, b2 = p
            return jnp.mean((jnp.tanh(x @ w1 + b1) @ w2 + b2 - y) ** 2)

        def poisoned(p, which, position, value):
            return [_poison()(w, jnp.where((which == k) & (jnp.arange(w.size) == position), value, 0.0)
                            .astype(w.dtype).reshape(w.shape)) for k, w in enumerate(p)]  # fmt: skip

        def loss_of(p, fault, x, y):
            return mp.autocast(loss_fn)(poisoned(p, *fault), x, y)

        value_and_grad = mp.value_and_grad(loss_of)
        opt = self.optimizer

        @jax.jit
        def step(params, opt_state, state, fault, x, y):
            (_, grads), finite, state = value_and_grad(params, fault, x, y, state=state)
            params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
            return params, opt_state, state, finite

        self._step = step

    def step(self, inject=None, clip=None):
        assert clip is None, "JAX clips with optax"
        k, i, value = check_fault(inject) if inject is not None else (-1, -1, 0.0)
        fault = (np.int32(k), np.int32(i), np.float32(value))
        self.weights, self.opt_state, self.scale_state, finite = self._step(
            self.weights, self.opt_state, self.scale_state, fault, *batch(self.t)
        )
        self.last = None
        self.t += 1
        return bool(finite), float(self.scale_state.scale)

    def bad_loss(self) -> None:
        jnp = self.jnp
        self.mp.grad(lambda p: jnp.sum(jnp.arange(3)))(self.weights, state=self.scale_state)

    def state(self) -> pa.LossScaleState:
        return self.mp.sync(self.scale_state)

    def state_dict(self) -> dict:
        self.mp.sync(self.scale_state)
        return super().state_dict()

    def load_state_dict(self, ckpt: dict) -> None:
        super().load_state_dict(ckpt)
        self.scale_state = self.mp.init()  # init() is mp.state as a pytree: the restored one

    def params(self) -> list:
        return [np.array(w) for w in self.weights]

    def _optimizer_state(self):
        return self.jax.device_get(self.opt_state)

    def _optimizer_arrays(self) -> list:
        return [np.array(leaf) for leaf in self.jax.tree.leaves(self.opt_state)]

    def _load(self, model, optimizer) -> None:
        self.weights = [self.jnp.asarray(w) for w in model]
        self.opt_state = self.jax.tree.map(self.jnp.asarray, optimizer)


@functools.cache
def _poison():
    """Identity whose gradient gets ``fault`` added: injects inf/NaN into the scaled gradient."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def poison(w, fault):
        return w

    poison.defvjp(lambda w, fault: (w, fault), lambda fault, ct: (ct + fault, jnp.zeros_like(fault)))
    return poison


# -- MXNet (Gluon, contrib.amp): mp.trainer, mp.scale_loss, mp.step(trainer, batch_size) -------------
class MXNetDriver(Driver):
    id = framework = "mxnet"
    policies = ("bf16-mixed",)  # fp16 needs cuDNN; float32 cannot share a process with bf16 AMP
    policy = "bf16-mixed"
    bad_loss_message = r"loss must be a floating-point mxnet NDArray, got int32"

    @staticmethod
    def load() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            require("mxnet")
        from mxnet_caps import BF16_UNSUPPORTED  # its one policy computes in bf16: a CPU capability

        if BF16_UNSUPPORTED:
            pytest.skip(BF16_UNSUPPORTED)

    def _build(self, policy, weights, optimizer, lr, mp_kwargs):
        import mxnet as mx
        from mxnet import autograd, gluon

        self.mx, self.autograd = mx, autograd
        # first: MXNet's AMP is process-wide and must be set up before any network exists
        self.mp = pa.MixedPrecision(policy, framework="mxnet", **mp_kwargs)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(16, activation="tanh", in_units=8), gluon.nn.Dense(1, in_units=16))
        net.initialize(ctx=mx.cpu())
        self.parameters = list(net.collect_params().values())
        for p, w in zip(self.parameters, weights):
            p.set_data(mx.nd.array(w.T if w.ndim == 2 else w))
        net.hybridize()
        self.net, self.loss = net, gluon.loss.L2Loss()
        self.trainer = self.mp.trainer(gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": lr}))
        self.param_names = [p.name for p in self.parameters]

    def backward(self, inject=None) -> None:
        x, y = (self.mx.nd.array(a) for a in batch(self.t))
        with self.autograd.record():
            loss = self.loss(self.net(x), y)
            with self.mp.scale_loss(loss, self.trainer) as scaled:
                self.autograd.backward(scaled)
        if inject is not None:
            k, i, value = inject
            self.parameters[k].grad().reshape((-1,))[i] = value

    def apply(self, clip=None):
        return self._done(self.mp.step(self.trainer, 8, clip_grad_norm=clip))

    def bad_loss(self) -> None:
        with self.autograd.record():
            self.mp.scale_loss(self.mx.nd.ones((2,), dtype="int32"), self.trainer)

    def params(self) -> list:
        return [p.data().asnumpy().copy() for p in self.parameters]

    def _optimizer_state(self) -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "states"
            self.trainer.save_states(str(path))
            return path.read_bytes()

    def _optimizer_arrays(self) -> list:
        updater = self.trainer._updaters[0]
        arrays = [np.array([self.trainer._optimizer.num_update])]
        for key in sorted(updater.states):
            arrays.extend(_mx_arrays(updater.states[key]))
        return arrays

    def _load(self, model, optimizer) -> None:
        for p, w in zip(self.parameters, model):
            p.set_data(self.mx.nd.array(w))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "states"
            path.write_bytes(optimizer)
            self.trainer.load_states(str(path))


def _mx_arrays(state) -> list:
    if state is None:
        return []
    if isinstance(state, (list, tuple)):
        return [a for s in state for a in _mx_arrays(s)]
    return [state.asnumpy().copy()]


DRIVERS = {d.id: d for d in (TorchDriver, TensorFlowDriver, TensorFlowEagerDriver, JaxDriver, MXNetDriver)}


def drivers(where=lambda driver: True) -> list:
    """``pytest.param(driver, id=driver.id)`` for each driver that ``where`` accepts; each one
    imports its framework in ``make`` (a failure where requested, else a skip)."""
    return [pytest.param(d, id=d.id) for d in DRIVERS.values() if where(d)]
