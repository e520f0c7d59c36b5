"""One small adapter per framework for the recipe algorithm tests written once (test_recipes_frameworks.py).

An adapter speaks only its framework's recipe vocabulary, on numpy inputs: ``current_scale`` of amaxes,
the tensorwise cast (at a given scale or the tensor's own, eagerly and where its recipe compiles it),
a ``quantizer`` of a recipe and one ``operand`` through it, ``linear``'s forward and both gradients
through the framework's autograd (logical layouts: x [..., K], w [K, N]; torch's and MXNet's weights are
[N, K]) and the products of core-quantized operands the layer's GEMMs must equal, and ``hadamard`` (the
core's ``hadamard_tiles`` on its tensors, and on those views or compiled functions its old tests took).
Tensors come back as the framework's own, for ``framework_ops.same_bits``. Conversion and the import
(a requested framework that cannot be imported fails, any other skips) are ``framework_ops.adapter``'s.

How a framework counts its quantize calls (the seeds of stochastic rounding) and lays out the weight
gradient's operands: ``counts_every_call`` (torch, MXNet: every call; TF: stochastic ones),
``weight_grad_first`` (the wgrad operand quantized first) and ``wgrad_transposed`` (g^T and x^T blocked
along their last axis, not g and x along axis 0: the same blocks, another stochastic stream).
"""

import numpy as np
from framework_ops import adapter

from polyamp.numerics import hadamard_tiles

F32 = np.float32


class _Counted:
    """The operand hooks of a front end whose ``Quantizer`` is called per operand and counts its calls
    (torch, MXNet); ``self.recipe`` is its recipe module."""

    def quantizer(self, r):
        return self.recipe.Quantizer(r)

    def operand(self, q, x, operand, axis):
        return q(self.t(x), "layer", operand, axis=axis)

    def calls(self, q):
        return q.calls

    def state_dict(self, q):
        return q.state_dict()


class Torch(_Counted):
    name = "torch"
    has_bias = True
    stateful_gemms = True
    counts_every_call, weight_grad_first, wgrad_transposed = True, "grad", True
    tensorwise_compiled = False  # its old tests compiled no tensorwise cast
    traces_each_shape = False
    flushes_subnormals = False

    def __init__(self):
        self.ops = adapter("torch")
        self.torch = self.ops.torch
        from polyamp.torch import recipe

        self.tr = self.recipe = recipe

    def t(self, a):
        return self.ops.tensor(np.asarray(a, F32))

    def current_scale(self, amaxes, fmt, margin, eps):
        """The scale of each amax, one 0-d tensor each, as numpy."""
        f32 = self.torch.float32
        scales = [self.tr.current_scale(self.torch.tensor(a, dtype=f32), fmt, margin, eps) for a in amaxes]
        return np.concatenate([np.ravel(self.ops.numpy(s)) for s in scales])

    def tensorwise(self, x, fmt, scale=None, rounding="nearest", seed=None, compiled=False):
        t = self.t(x)
        s = self.tr.current_scale(t.abs().amax(), fmt) if scale is None else self.t(scale)
        return self.tr._tensorwise(t, fmt, s, rounding, seed)

    def linear(self, r, x, w, b, g):
        """(y, dx, dw [K, N], db, calls) of ``_QuantizedLinear`` (weight [N, K]), products in float32."""
        xt, wt = self.t(x).requires_grad_(), self.t(w.T).requires_grad_()
        bt = None if b is None else self.t(b).requires_grad_()
        q = self.tr.Quantizer(r)
        y = self.tr._QuantizedLinear.apply(xt, wt, bt, q, "l", self.torch.float32)
        y.backward(self.t(g).reshape(y.shape))
        return y, xt.grad, wt.grad.t(), None if b is None else bt.grad, q.calls

    def y_of(self, xq, wq, b):  # as F.linear: x @ W^T + b, W [N, K]
        return (self.t(xq) @ self.t(wq.T).t() + self.t(b)).numpy()

    def dx_of(self, gq, w_op):
        return (self.t(gq) @ self.t(w_op.T)).numpy()

    def dw_of(self, x_op, g_op):  # dW [N, K] = g^T x, back in [K, N]
        return (self.t(g_op).t() @ self.t(x_op)).t().numpy()

    def db_of(self, g):
        return self.t(g).sum(0).numpy()

    def hadamard(self, x, axis):
        return [hadamard_tiles(x, axis=axis)]

    def views(self, x):
        """``x`` contiguous, as a transposed view and broadcast (strides hadamard_tiles must read)."""
        t = self.t(x)
        return [t, t.transpose(0, -1), t.unsqueeze(0).expand(2, *t.shape)]

    def bad_hadamard_inputs(self):
        torch = self.torch
        return [(torch.arange(16), r"received a torch.int64 tensor of shape \(16,\)"),
                (torch.ones(16, dtype=torch.complex64), r"received a torch.complex64 tensor")]  # fmt: skip


class TensorFlow:
    name = "tensorflow"
    has_bias = False
    stateful_gemms = True
    counts_every_call, weight_grad_first, wgrad_transposed = False, "input", False
    tensorwise_compiled = True  # fp8-tensorwise's Quantizer: its kernels' graphs (graph_call)
    traces_each_shape = True  # graph_call traces the recipe's kernels once per shape
    flushes_subnormals = True  # its float32 kernels, eager and traced (the integer casts do not)

    def __init__(self):
        self.ops = adapter("tensorflow")
        self.tf = self.ops.tf
        from polyamp.tensorflow import recipe
        from polyamp.tensorflow.quantize import key_of

        self.tr, self.key_of = recipe, key_of

    def t(self, a):
        return self.ops.tensor(np.asarray(a, F32))

    def current_scale(self, amaxes, fmt, margin, eps):
        """Of the amaxes' bit patterns, as the recipe keeps them, all at once (elementwise), as numpy."""
        bits = self.tf.cast(self.tf.bitcast(self.t(amaxes), self.tf.uint32), self.tf.uint64)
        return self.tr.current_scale(bits, fmt, margin, eps).numpy()

    def tensorwise(self, x, fmt, scale=None, rounding="nearest", seed=None, compiled=False):
        if compiled:  # scale None, nearest: as fp8-tensorwise quantizes its input (e4m3fn) or grad (e5m2)
            from polyamp import recipes

            q = self.tr.Quantizer(recipes.parse_recipe("fp8-tensorwise"))
            return q(self.t(x), "layer", "input" if fmt == "e4m3fn" else "grad")
        from polyamp.numerics.rounding import _MODE

        t = self.t(x)
        s = self.tr.current_scale(self.tr._amax_bits(t), fmt) if scale is None else self.t(scale)
        return self.tr.tensorwise(t, fmt, s, _MODE[rounding], self.key_of(seed or 0))

    def quantizer(self, r):
        return self.tr.Quantizer(r)

    def operand(self, q, x, operand, axis):
        return q(self.t(x), "layer", operand, axis)

    def calls(self, q):
        return int(q.calls.numpy())

    def state_dict(self, q):
        return q.state_dict()

    def linear(self, r, x, w, b, g):
        """(y, dx, dw, None, calls) of ``linear`` (float32 products) through a GradientTape."""
        q = self.tr.Quantizer(r)
        for operand in ("input", "weight", "grad") if r.kind == "delayed" else ():
            q.add("l", operand)
        xt, wt = self.t(x), self.tf.Variable(np.asarray(w, F32))
        with self.tf.GradientTape() as tape:
            tape.watch(xt)
            y = self.tr.linear(q, "l", self.tf.float32)(xt, wt)
        dx, dw = tape.gradient(y, [xt, wt], output_gradients=self.tf.reshape(self.t(g), y.shape))
        return y, dx, dw, None, int(q.calls.numpy())

    def mm(self, a, b):
        return self.tf.linalg.matmul(self.t(a), self.t(b)).numpy()

    def y_of(self, xq, wq, b):
        return self.mm(xq, wq)

    def dx_of(self, gq, w_op):
        return self.mm(gq, w_op.T)

    def dw_of(self, x_op, g_op):
        return self.mm(x_op.T, g_op)

    def hadamard(self, x, axis):
        """Eagerly and in a tf.function with every dimension unknown (the tiled axis' length too)."""
        spec = [self.tf.TensorSpec([None] * x.shape.rank, x.dtype)]
        return [
            hadamard_tiles(x, axis),
            self.tf.function(lambda v: hadamard_tiles(v, axis), input_signature=spec)(x),
        ]

    def views(self, x):
        return [self.t(x)]

    def bad_hadamard_inputs(self):
        return []


class Jax:
    name = "jax"
    has_bias = False
    stateful_gemms = False  # a stateless ``dot``; its stateful GEMMs take their seeds and scales from a step
    counts_every_call, weight_grad_first, wgrad_transposed = False, "grad", False  # (``dot`` counts none)
    tensorwise_compiled = True  # jax.jit, where XLA would multiply by the scale's reciprocal
    traces_each_shape = True  # framework_ops' compiles_each_shape
    flushes_subnormals = True  # XLA's float32 kernels on CPU (the integer casts do not)

    def __init__(self):
        self.ops = adapter("jax")
        self.jax, self.jnp = self.ops.jax, self.ops.jnp
        from polyamp.jax import recipe, recipe_operands, recipe_state
        from polyamp.jax.quantize import _key

        self.jr, self.jo, self.rs, self.key = recipe, recipe_operands, recipe_state, _key
        self._tensorwise = self.jax.jit(recipe_operands.tensorwise, static_argnames=("fmt", "rounding"))

    def t(self, a):
        return self.ops.tensor(np.asarray(a, F32))

    def current_scale(self, amaxes, fmt, margin, eps):
        """The scale of each amax, one 0-d array each, as numpy."""
        scales = [self.jo.current_scale(self.jnp.float32(a), fmt, margin, eps) for a in amaxes]
        return np.concatenate([np.ravel(self.ops.numpy(s)) for s in scales])

    def tensorwise(self, x, fmt, scale=None, rounding="nearest", seed=None, compiled=False):
        s = None if scale is None else self.jnp.float32(scale)
        f = self._tensorwise if compiled else self.jo.tensorwise
        return f(self.t(x), fmt=fmt, scale=s, rounding=rounding, key=self.key(seed))

    def quantizer(self, r):
        """What a JAX step keeps for ``quantize_operand``: the call counter and the delayed histories."""
        return {"recipe": r, "calls": 0, "delayed": {}}

    def operand(self, q, x, operand, axis):
        r, rs = q["recipe"], self.rs
        q["calls"] += 1
        t, key = self.t(x), self.key(q["calls"])
        if r.kind != "delayed":
            return self.jo.quantize_operand(t, r, operand, axis, key=key)
        entry = q["delayed"].get(operand) or rs._entry(rs.delayed_config(r, operand))
        out = self.jo.quantize_operand(t, r, operand, axis, scale=entry["scale"], key=key)
        q["delayed"][operand] = rs.update(r, operand, entry, self.jo.amax_of(t))
        return out

    def calls(self, q):
        return q["calls"]

    def state_dict(self, q):
        r = q["recipe"]
        state = self.rs.RecipeState(self.jnp.uint32(q["calls"]),
                                    {f"layer|{op}": e for op, e in q["delayed"].items()})  # fmt: skip
        return self.rs.host_state_dict(self.rs.to_host(r, state))

    def linear(self, r, x, w, b, g):
        """(y, dx, dw, None, 0) of ``dot`` (float32 products) through ``jax.vjp``."""
        f32 = self.jnp.float32
        y, vjp = self.jax.vjp(self.jr.dot(r, f32, f32, f32), self.t(x), self.t(w))
        dx, dw = vjp(self.t(g).reshape(y.shape))
        return y, dx, dw, None, 0

    def mm(self, a, b):
        a, b = self.t(a), self.t(b)
        dims = (((a.ndim - 1,), (0,)), ((), ()))
        return np.asarray(self.jax.lax.dot_general(a, b, dims, preferred_element_type=self.jnp.float32))

    def y_of(self, xq, wq, b):
        return self.mm(xq, wq)

    def dx_of(self, gq, w_op):
        return self.mm(gq, w_op.T)

    def dw_of(self, x_op, g_op):
        return self.mm(x_op.T, g_op)

    def hadamard(self, x, axis):
        return [self.jax.jit(hadamard_tiles, static_argnums=1)(x, axis)]

    def views(self, x):
        return [self.ops.tensor(x)]

    def bad_hadamard_inputs(self):
        return []


class MXNet(_Counted):
    name = "mxnet"
    has_bias = True
    stateful_gemms = True
    counts_every_call, weight_grad_first, wgrad_transposed = True, "grad", True
    tensorwise_compiled = False
    traces_each_shape = False
    flushes_subnormals = False

    def __init__(self):
        self.ops = adapter("mxnet")
        self.mx = self.ops.mx
        from polyamp.mxnet import quantize, recipe

        self.mq, self.mr = quantize, recipe
        self.recipe = recipe

    def t(self, a):
        return self.ops.tensor(np.asarray(a, F32))

    def current_scale(self, amaxes, fmt, margin, eps):
        """The scale of each amax, one array of shape (1,) each, as numpy."""
        amax = [self.mx.np.array(np.array([a], F32)) for a in amaxes]
        return np.concatenate([self.mq.current_scale(a, fmt, margin, eps).asnumpy() for a in amax])

    def tensorwise(self, x, fmt, scale=None, rounding="nearest", seed=None, compiled=False):
        t = self.t(x)
        s = self.mq.current_scale(self.mq.amax(t), fmt).as_nd_ndarray() if scale is None else scale
        return self.mq.quantize_tensorwise(t, fmt, s, rounding, seed)

    def linear(self, r, x, w, b, g):
        """(y, dx, dw [K, N], db, calls) of ``QuantizedDense`` (weight [N, K], x as Dense hands it: 2-D)."""
        k = w.shape[0]
        X, W = self.t(x.reshape(-1, k)), self.t(w.T)
        B = None if b is None else self.t(b)
        for t in (X, W, B) if B is not None else (X, W):
            t.attach_grad()
        q = self.mr.Quantizer(r)
        with self.mx.autograd.record():
            y = self.mr.QuantizedDense(q, "l", "fp32")(W, *([B] if B is not None else []), X)
        y.backward(self.t(g.reshape(y.shape)))
        self.mx.nd.waitall()  # the backward (and its quantize calls) runs on MXNet's engine
        out = y.reshape(x.shape[:-1] + (w.shape[1],))
        return out, X.grad.reshape(x.shape), W.grad.T, None if B is None else B.grad, q.calls

    def fc(self, a, b_t, bias=None):
        """a @ b_t^T (+ bias) by MXNet's float32 FullyConnected, the recipe's product in fp32."""
        args = [self.t(a), self.t(b_t)] + ([self.t(bias)] if bias is not None else [])
        return self.mr._FC(*args, no_bias=bias is None, num_hidden=b_t.shape[0]).asnumpy()

    def y_of(self, xq, wq, b):
        return self.fc(xq, wq.T, b)

    def dx_of(self, gq, w_op):
        return self.fc(gq, w_op)

    def dw_of(self, x_op, g_op):
        return self.fc(g_op.T, x_op.T).T

    def db_of(self, g):
        return self.mx.nd.sum(self.t(g), axis=0).asnumpy()

    def hadamard(self, x, axis):
        return [hadamard_tiles(x, axis=axis)]

    def views(self, x):
        return [self.ops.tensor(x)]

    def bad_hadamard_inputs(self):
        return []


ADAPTERS = {a.name: a for a in (Torch, TensorFlow, Jax, MXNet)}
_MADE = {}


def recipe_adapter(name: str):
    """The recipe adapter of framework ``name``, made once per process."""
    if name not in _MADE:
        _MADE[name] = ADAPTERS[name]()
    return _MADE[name]
