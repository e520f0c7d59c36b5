"""The compare workloads in JAX + optax, trained with polyamp's autocast and functional loss scaling.

The networks are pure functions of a params dict holding the numpy weights of ``workloads.py``
(dense ``W[in, out]``, ``b[out]``). One jitted step does
``mp.value_and_grad(mp.autocast(loss))`` and an optax Adam update run only if the gradients are
finite (a ``lax.cond`` on the device, no host round trip); every policy, float32 included, runs
this same code.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..jax import step_if_finite
from ..mixed_precision import MixedPrecision
from ..step import StepResult
from .workloads import Workload


def dense(p: dict, name: str, x, mm=jnp.matmul):
    return mm(x, p[name + ".w"]) + p[name + ".b"]


def layer_norm(p: dict, name: str, x, eps: float = 1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p[name + ".g"] + p[name + ".b"]


def mlp(wl: Workload, p: dict, x, mm=jnp.matmul):
    act = {"gelu": functools.partial(jax.nn.gelu, approximate=False), "relu": jax.nn.relu}[wl.activation]
    n = len(wl.dims) - 1
    for i in range(n - 1):
        x = act(dense(p, f"fc{i}", x, mm))
    return dense(p, f"fc{n - 1}", x, mm)


def attention(p: dict, prefix: str, x, heads: int, mm=jnp.matmul):
    """Causal multi-head self-attention with separate q/k/v/o dense layers."""
    b, t, d = x.shape

    def split(name):
        return dense(p, prefix + name, x, mm).reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)

    q, k, v = split("q"), split("k"), split("v")
    scores = mm(q, k.transpose(0, 1, 3, 2)) / math.sqrt(d // heads)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    a = mm(jax.nn.softmax(scores, axis=-1), v)
    return dense(p, prefix + "o", a.transpose(0, 2, 1, 3).reshape(b, t, d), mm)


def charlm(wl: Workload, p: dict, ids, mm=jnp.matmul):
    """Pre-LN transformer: learned positions, causal attention, exact-GELU MLP of width 4d."""
    x = p["embed"][ids] + p["pos"][: ids.shape[1]]
    for i in range(wl.layers):
        pre = f"block{i}."
        x = x + attention(p, pre, layer_norm(p, pre + "ln1", x), wl.heads, mm)
        h = jax.nn.gelu(dense(p, pre + "ff1", layer_norm(p, pre + "ln2", x), mm), approximate=False)
        x = x + dense(p, pre + "ff2", h, mm)
    return dense(p, "head", layer_norm(p, "lnf", x), mm)


def forward(wl: Workload, p: dict, x, mm=jnp.matmul):
    """The workload's network; ``mm`` is the matrix product (a hand-written mixed-precision one
    in ``benchmarks/jax_autocast.py``)."""
    return charlm(wl, p, x, mm) if wl.name == "charlm" else mlp(wl, p, x, mm)


def cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def loss_fn(wl: Workload, p: dict, x, y, mm=jnp.matmul):
    out = forward(wl, p, x, mm)
    if wl.name == "mlp":
        return jnp.mean((out.astype(jnp.float32) - y) ** 2)
    return cross_entropy(out, y)


def inputs(wl: Workload, x, y):
    """A numpy batch as JAX arrays (token ids and labels as int32)."""
    if wl.name == "mlp":
        return jnp.asarray(x), jnp.asarray(y)
    if wl.name == "charlm":
        return jnp.asarray(x, jnp.int32), jnp.asarray(y, jnp.int32)
    return jnp.asarray(x), jnp.asarray(y, jnp.int32)


class Trainer:
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        self.wl = wl
        self.mp = MixedPrecision(policy, framework="jax")
        self.params = {name: jnp.asarray(w) for name, w in wl.weights.items()}
        self.opt = optax.adam(wl.lr)
        self.opt_state = self.opt.init(self.params)
        self.state = self.mp.init()
        loss = self.mp.autocast(functools.partial(loss_fn, wl))
        value_and_grad = self.mp.value_and_grad(loss)
        opt = self.opt

        def train_step(params, opt_state, state, x, y):
            (value, grads), finite, state = value_and_grad(params, x, y, state=state)
            params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
            return params, opt_state, state, value, finite

        # compiled here, with the first batch's shapes, so that the step budget times training;
        # params, optimizer and scale state are donated (updated in place), as in a training loop
        example = (self.params, self.opt_state, self.state, *inputs(wl, *wl.batch_at(0)))
        self._step = jax.jit(train_step, donate_argnums=(0, 1, 2)).lower(*example).compile()
        self._loss = jax.jit(loss)
        self._forward = jax.jit(self.mp.autocast(functools.partial(forward, wl)))

    def step(self, i: int) -> float:
        x, y = inputs(self.wl, *self.wl.batch_at(i))
        self.params, self.opt_state, self.state, loss, finite = self._step(
            self.params, self.opt_state, self.state, x, y
        )
        self.mp.sync(self.state)
        self.last = StepResult(bool(finite), self.mp.current_scale)
        return float(loss)

    def evaluate(self) -> float:
        batches = [inputs(self.wl, x, y) for x, y in self.wl.eval_batches_()]
        if self.wl.name == "digits":
            ((x, y),) = batches
            pred = np.asarray(self._forward(self.params, x)).argmax(-1)
            return float(np.mean(pred == np.asarray(y)))
        return float(np.mean([float(self._loss(self.params, x, y)) for x, y in batches]))


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "optax": optax.__version__}
