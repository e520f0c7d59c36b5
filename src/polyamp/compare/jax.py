"""The compare workloads in JAX + optax, trained with polyamp's autocast and functional loss scaling.

The networks are pure functions of a params dict holding the numpy weights of ``workloads.py``
(dense ``W[in, out]``, ``b[out]``). One jitted step does
``mp.value_and_grad(mp.autocast(loss))`` and an optax Adam update run only if the gradients are
finite (a ``lax.cond`` on the device, no host round trip); every policy, float32 included, runs
this same code. ``infer`` runs the autocast network on the weights cast once to the compute dtype
(jmp's idiom); memory: the residuals of ``jax.vjp`` and the compiled step's ``memory_analysis()``.

Each layer runs in a ``jax.named_scope`` (metadata only: the compiled step is the same), so the
doctor (``polyamp.jax.doctor``) and ``keep_fp32`` see named layers: ``fc0``..``fc2`` (mlp);
``block0/ln1``, ``block0/attn/q``..``/o``, ``block0/attn`` (scores, softmax, weighted sum),
``block0/ln2``, ``block0/ff1``, ``block0/ff2``, ``block0`` (residuals, GELU), ``lnf``, ``head``
(charlm; its ``embed`` and ``pos`` are read outside any scope).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..jax import cast_tree, dequantize_weights, step_if_finite
from ..jax.recipe import without_state
from ..jax.recipe_state import keeps_state
from ..mixed_precision import MixedPrecision
from ..step import StepResult
from .protocol import Saved, TrainerBase
from .workloads import Workload


def _scope(name: str):
    """The named scope of the layer whose weights are ``name.*``: its last part (``block0.ff1`` ->
    ``ff1``, inside the block's own scope)."""
    return jax.named_scope(name.rpartition(".")[2])


def dense(p: dict, name: str, x, mm=jnp.matmul):
    with _scope(name):
        return mm(x, p[name + ".w"]) + p[name + ".b"]


def layer_norm(p: dict, name: str, x, eps: float = 1e-5):
    with _scope(name):
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
    """Causal multi-head self-attention with separate q/k/v/o dense layers (scope ``attn``)."""
    with jax.named_scope("attn"):
        return _attention(p, prefix, x, heads, mm)


def _attention(p: dict, prefix: str, x, heads: int, mm):
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
        with jax.named_scope(f"block{i}"):
            x = x + attention(p, pre, layer_norm(p, pre + "ln1", x), wl.heads, mm)
            h = jax.nn.gelu(dense(p, pre + "ff1", layer_norm(p, pre + "ln2", x), mm), approximate=False)
            x = x + dense(p, pre + "ff2", h, mm)
    return dense(p, "head", layer_norm(p, "lnf", x), mm)


_NETWORKS = {"dense": mlp, "transformer": charlm}


def forward(wl: Workload, p: dict, x, mm=jnp.matmul):
    """The workload's network; ``mm`` is the matrix product (a hand-written mixed-precision one
    in ``benchmarks/jax_autocast.py``)."""
    return _NETWORKS[wl.architecture](wl, p, x, mm)


def cross_entropy(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def mean_squared_error(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


_LOSSES = {"mse": mean_squared_error, "cross_entropy": cross_entropy}


def loss_fn(wl: Workload, p: dict, x, y, mm=jnp.matmul):
    return _LOSSES[wl.loss_kind](forward(wl, p, x, mm), y)


def _array(a: np.ndarray):
    """A numpy array as a JAX array; integers (token ids, class labels) as int32."""
    return jnp.asarray(a, jnp.int32) if np.issubdtype(a.dtype, np.integer) else jnp.asarray(a)


def inputs(wl: Workload, x, y):
    """A numpy batch as JAX arrays (token ids and labels as int32)."""
    return _array(x), _array(y)


def _entry(a) -> tuple[int, str]:
    return a.size * a.dtype.itemsize, str(a.dtype)


class Trainer(TrainerBase):
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        self.wl = wl
        self.mp = MixedPrecision(policy, framework="jax")
        self.params = {name: jnp.asarray(w, self.mp.policy.param_dtype) for name, w in wl.weights.items()}
        self.opt = self.mp.optimizer(optax.adam(wl.lr))  # low_precision's under a training-state policy
        self.opt_state = self.opt.init(self.params)
        self._loss = self.mp.autocast(functools.partial(loss_fn, wl))
        self.state = self.mp.init(self._loss, self.params, *inputs(wl, *wl.batch_at(0)))
        # a recipe keeping state (delayed, stochastic) differentiates only inside mp.value_and_grad: the
        # memory probes take its stateless twin, whose residuals and gradients have the same shapes
        twin = self.mp
        if keeps_state(self.mp.recipe):
            twin = MixedPrecision(without_state(self.mp.recipe), framework="jax")
        self._probe_loss = twin.autocast(functools.partial(loss_fn, wl))
        value_and_grad = self.mp.value_and_grad(self._loss)
        opt = self.opt

        def train_step(params, opt_state, state, x, y):
            (value, grads), finite, state = value_and_grad(params, x, y, state=state)
            params, opt_state = step_if_finite(finite, opt, grads, opt_state, params)
            return params, opt_state, state, value, finite

        # compiled here, with the first batch's shapes, so that the step budget times training;
        # params, optimizer and scale state are donated (updated in place), as in a training loop
        example = (self.params, self.opt_state, self.state, *inputs(wl, *wl.batch_at(0)))
        self._step = jax.jit(train_step, donate_argnums=(0, 1, 2)).lower(*example).compile()
        self._forward = jax.jit(self.mp.autocast(functools.partial(forward, wl)))
        self._forward_low = jax.jit(lambda low, x: self.mp.autocast(functools.partial(forward, wl))(
            dequantize_weights(low), x))  # fmt: skip
        self._low = self.mp.policy.compute_dtype if self.mp.policy.compute_dtype != "float32" else None
        self._cast = (None, None)  # (params the cast was made from, their cast to the compute dtype)

    def step(self, i: int) -> float:
        x, y = inputs(self.wl, *self.wl.batch_at(i))
        self.params, self.opt_state, self.state, loss, finite = self._step(
            self.params, self.opt_state, self.state, x, y
        )
        self.mp.sync(self.state)
        self.last = StepResult(bool(finite), self.mp.current_scale)
        return float(loss)

    def doctor_inputs(self, i: int = 0) -> tuple:
        """``polyamp.doctor``'s (params, batch, loss_fn(params, batch), (optimizer, opt_state))."""
        wl = self.wl
        batch = inputs(wl, *wl.batch_at(i))
        return self.params, batch, lambda p, b: loss_fn(wl, p, *b), (self.opt, self.opt_state)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._forward(self.params, _array(x)), np.float32)

    def _inference_params(self) -> dict:
        """The parameters cast once to the compute dtype (jmp's idiom), recast after each step; under a
        ``weights=`` option, stored in that weight-only form (decoded in the jitted forward)."""
        form = self.mp.policy.state.weights if self.mp.policy.state is not None else None
        if form is not None:
            if self._cast[0] is not self.params:
                from ..jax.weight_only import quantize_weights

                self._cast = (self.params, quantize_weights(self.params, form)[0])
            return self._cast[1]
        if self._low is None:
            return self.params
        if self._cast[0] is not self.params:
            self._cast = (self.params, jax.block_until_ready(cast_tree(self.params, self._low)))
        return self._cast[1]

    @property
    def inference_form(self) -> str:
        form = self.mp.policy.state.weights if self.mp.policy.state is not None else None
        if form is not None:
            return (f"jitted autocast forward on kernels stored {form} (polyamp.jax.quantize_weights; 1-D "
                    "leaves kept), decoded inside the jit")  # fmt: skip
        if self._low is None:
            return "jitted forward on the float32 weights"
        return f"jitted autocast forward on the weights cast once to {self._low} (jmp's idiom)"

    def infer(self, x: np.ndarray) -> np.ndarray:
        """The autocast network on weights stored in the compute dtype (float32 policy: as trained)."""
        params = self._inference_params()
        if self.mp.policy.state is not None and self.mp.policy.state.weights is not None:
            return np.asarray(self._forward_low(params, _array(x)), np.float32)
        return np.asarray(self._forward(params, _array(x)), np.float32)

    # -- memory probes ---------------------------------------------------------------------------
    def _parameters(self):
        return [_entry(a) for a in jax.tree.leaves(self.params)]

    def _gradients(self):
        x, y = inputs(self.wl, *self.wl.batch_at(0))
        grads = jax.eval_shape(jax.grad(self._probe_loss), self.params, x, y)
        return [_entry(a) for a in jax.tree.leaves(grads)]

    def _optimizer_bytes(self):
        return sum(_entry(a)[0] for a in jax.tree.leaves(self.opt_state))

    def _inference_weights(self):
        return [_entry(a) for a in jax.tree.leaves(self._inference_params())]

    def _workspace(self):
        stats = self._step.memory_analysis()
        return stats.temp_size_in_bytes, (
            "temp_size_in_bytes of the compiled train step's memory_analysis(): XLA's buffers for "
            "gradients, residuals and scratch after its buffer reuse"
        )

    def _saved(self) -> Saved:
        """The residuals of ``jax.vjp`` of the autocast loss on batch 0, each array counted once;
        a residual equal to a parameter is that parameter, one equal to its cast a weight copy. The
        vjp runs under ``jax.jit`` (its residuals are the jitted function's outputs): the same
        residuals as eager, without compiling every eager op (3.5 s vs 0.65 s on full charlm)."""
        x, y = inputs(self.wl, *self.wl.batch_at(0))
        vjp = jax.jit(lambda params: jax.vjp(lambda p: self._probe_loss(p, x, y), params)[1])(self.params)
        by_shape: dict[tuple, list] = {}
        for a in jax.tree.leaves(self.params):
            by_shape.setdefault(a.shape, []).append(a)
        activations = copies = 0
        for r in {id(r): r for r in jax.tree.leaves(vjp)}.values():
            same = [p for p in by_shape.get(r.shape, []) if bool(jnp.all(p.astype(r.dtype) == r))]
            if not same:
                activations += r.nbytes
            elif r.dtype != same[0].dtype:
                copies += r.nbytes
        how = "residuals of jax.vjp of the autocast loss (under jit), parameters excluded, their casts"
        return Saved(activations, copies, how + " counted as weight copies")


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "optax": optax.__version__}


def tune_inputs(name: str, quick: bool = False) -> tuple:
    """A workload as ``polyamp.jax.tune``'s arguments: its float32 weights, its batches (cycled), its
    loss ``loss_fn(params, (x, y))``, and ``optax.adam`` with the workload's learning rate."""
    from .workloads import get_workload

    wl = get_workload(name, quick=quick)
    params = {k: jnp.asarray(w) for k, w in wl.weights.items()}

    def batch(i: int):
        return inputs(wl, *wl.batch_at(i % wl.steps))

    def loss(p, b):
        return loss_fn(wl, p, *b)

    return params, batch, loss, optax.adam(wl.lr)
