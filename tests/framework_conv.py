"""One convolution adapter per framework, for the recipe convolution tests written once
(``test_recipe_conv_frameworks.py``).

A geometry is framework-neutral: the input's shape in its layout (channels first or last), the kernel as
(O, I / groups, k...), strides, padding ("same", "valid" or (low, high) pairs), dilation, groups. An
adapter knows its framework's vocabulary only: whether it can state a geometry, its recipe Quantizer and
quantized convolution, run forward and backward (``conv``), and its own plain convolution and autograd
(``plain``) that the tests evaluate at the operands the numpy core quantized. Kernels and their
gradients cross in the neutral (O, I, k...) layout; ``framework_ops.adapter`` converts tensors.
"""

import warnings
from dataclasses import dataclass

import numpy as np
from framework_ops import BF16, adapter


def _wanted(wrt, dx, dw):
    """The gradient ``wrt`` names ("x" or "w"), or both."""
    return {"x": dx, "w": dw}.get(wrt, (dx, dw))


@dataclass(frozen=True)
class Geometry:
    x: tuple  # (N, C, *spatial), or (N, *spatial, C) when channels_last; no N when unbatched
    w: tuple  # (O, I / groups, *kernel)
    stride: tuple
    padding: object  # "same", "valid" or ((low, high), ...) per spatial axis
    dilation: tuple
    groups: int = 1
    channels_last: bool = False
    batched: bool = True

    @property
    def nd(self):
        return len(self.w) - 2

    @property
    def channel(self):
        """The channel axis of x and of the output."""
        return -1 if self.channels_last else (1 if self.batched else 0)

    def symmetric(self):
        """The padding as one number per axis, or None where it is a string or uneven."""
        if isinstance(self.padding, str) or any(lo != hi for lo, hi in self.padding):
            return None
        return tuple(lo for lo, _ in self.padding)


class TorchConv:
    name = "torch"
    has_bias = True
    counts = "all"  # every quantization takes the next call number (stochastic rounding's seed)
    steps = 1

    def __init__(self):
        self.fw = fw = adapter("torch")
        self.torch = torch = fw.torch
        from torch.nn import functional as F

        from polyamp.torch import recipe as tr
        from polyamp.torch import recipe_conv as tc

        self.F, self.tr, self.tc = F, tr, tc
        self.dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}

    def supports(self, geo):
        return not geo.channels_last and (isinstance(geo.padding, str) or geo.symmetric() is not None)

    def _func(self, geo):
        return (self.F.conv1d, self.F.conv2d, self.F.conv3d)[geo.nd - 1]

    def _kwargs(self, geo):
        padding = geo.padding if isinstance(geo.padding, str) else geo.symmetric()
        return {"stride": geo.stride, "padding": padding, "dilation": geo.dilation, "groups": geo.groups}

    def quantizer(self, r):
        return self.tr.Quantizer(r)

    def calls(self, q):
        return q.calls

    def histories(self, q):
        """The delayed-scaling states, ``"layer|operand" -> state_dict``."""
        return q.state_dict()["delayed"]

    def conv(self, q, geo, computes, x, w, b, grad):
        """(g, [(y, dx, dw, db) for each compute]) of the recipe's convolution, ``g = grad(y.shape)``."""
        outs, g = [], None
        for compute in computes:
            xt, wt, bt = (None if t is None else self.fw.tensor(t).requires_grad_() for t in (x, w, b))
            y = self.tc.quantized_conv(self._func(geo), (xt, wt), {"bias": bt, **self._kwargs(geo)}, q, "c",
                                       self.dtypes[compute])  # fmt: skip
            g = grad(tuple(y.shape)) if g is None else g
            y.backward(self.fw.tensor(g).to(y.dtype))
            outs.append((y.detach(), xt.grad, wt.grad, None if bt is None else bt.grad))
        return g, outs

    def plain(self, geo, compute, x, w, b=None, g=None, wrt="xw"):
        """torch's own convolution of ``x`` and ``w`` (and bias ``b``) in ``compute``, or its gradients
        (autograd) for ``g`` with respect to ``wrt`` ("x", "w" or both); numpy float32."""
        c = self.dtypes[compute]
        xt, wt = (self.fw.tensor(t).to(c).requires_grad_(n in wrt) for n, t in (("x", x), ("w", w)))
        bt = None if b is None else self.fw.tensor(b).to(c)
        y = self._func(geo)(xt, wt, bt, **self._kwargs(geo))
        if g is None:
            return self.fw.numpy(y.float())
        y.backward(self.fw.tensor(g).to(c))
        return _wanted(wrt, *(None if t.grad is None else self.fw.numpy(t.grad.float()) for t in (xt, wt)))

    def bias_grad(self, g):
        g = self.fw.tensor(g)
        return self.fw.numpy(g.sum([0, *range(2, g.dim())]))

    def output_dtype(self, compute):
        return np.dtype(np.float32)

    def blocked(self, r, x, axis):
        """x quantized as the recipe's input by the front end, blocked along ``axis``."""
        q = self.tr.Quantizer(r)
        return self.tc._blocked(q, self.fw.tensor(x), "c", "input", axis, self.torch.float32)

    def hadamard(self, x):
        return self.fw.tensor(x)


class TensorFlowConv:
    name = "tensorflow"
    has_bias = False
    counts = "stochastic"  # only stochastic roundings take a call number
    steps = 1

    def __init__(self):
        self.fw = fw = adapter("tensorflow")
        self.tf = tf = fw.tf
        import keras

        from polyamp.tensorflow import recipe as tr
        from polyamp.tensorflow import recipe_conv as rc

        self.keras, self.tr, self.rc = keras, tr, rc
        self.dtypes = {"fp32": tf.float32, "bf16": tf.bfloat16}

    def supports(self, geo):
        return isinstance(geo.padding, str) and geo.batched

    def _options(self, geo):
        layout = "channels_last" if geo.channels_last else "channels_first"
        return geo.stride, geo.padding, geo.dilation, layout

    def _kernel(self, w):  # (O, I, k...) -> (k..., I, O)
        return np.ascontiguousarray(np.transpose(w, (*range(2, w.ndim), 1, 0)))

    def _canonical(self, k):  # (k..., I, O) -> (O, I, k...)
        n = len(k.shape)
        return self.tf.transpose(k, (n - 1, n - 2, *range(n - 2)))

    def quantizer(self, r):
        q = self.tr.Quantizer(r)
        for operand in ("input", "weight", "grad") if r.kind == "delayed" else ():
            q.add("c", operand)
        return q

    def calls(self, q):
        return 0 if q.calls is None else int(q.calls.numpy())

    def conv(self, q, geo, computes, x, w, b, grad):
        tf, outs, g = self.tf, [], None
        for compute in computes:
            fn = self.rc.conv(q, "c", self.dtypes[compute], self._options(geo))
            xt, wt = tf.constant(x), tf.Variable(self._kernel(w))
            with tf.GradientTape() as tape:
                tape.watch(xt)
                y = fn(xt, wt)
            g = grad(tuple(y.shape)) if g is None else g
            dx, dw = tape.gradient(y, [xt, wt], output_gradients=tf.constant(g))
            outs.append((y, dx, self._canonical(dw), None))
        return g, outs

    def plain(self, geo, compute, x, w, b=None, g=None, wrt="xw"):
        """``keras.ops.conv`` in ``compute`` (float32 out), or its tape gradients for ``g`` with respect to
        ``wrt``, eagerly."""
        tf, c = self.tf, self.dtypes[compute]
        strides, padding, dilation, data_format = self._options(geo)
        x, k = (tf.cast(tf.constant(np.asarray(t, np.float32)), c) for t in (x, self._kernel(w)))
        with tf.GradientTape() as tape:
            sources = [t for n, t in (("x", x), ("w", k)) if n in wrt]
            tape.watch(sources)
            y = self.keras.ops.conv(x, k, strides=list(strides), padding=padding,
                                    dilation_rate=list(dilation), data_format=data_format)  # fmt: skip
        if g is None:
            return self.fw.numpy(tf.cast(y, tf.float32))
        grads = iter(tape.gradient(y, sources, output_gradients=tf.cast(tf.constant(g), c)))
        dx = next(grads) if "x" in wrt else None
        dk = next(grads) if "w" in wrt else None
        return _wanted(wrt, *(None if t is None else self.fw.numpy(tf.cast(t, tf.float32))
                              for t in (dx, None if dk is None else self._canonical(dk))))  # fmt: skip

    def output_dtype(self, compute):
        return np.dtype(np.float32)

    def blocked(self, r, x, axis):
        return self.rc._blocked(self.tr.Quantizer(r), self.tf.constant(x), "c", "input", axis)

    def hadamard(self, x):
        return self.fw.tensor(x)


class JaxConv:
    name = "jax"
    has_bias = False
    counts = None  # no Run: a stateless convolution (its seeds are test_jax_recipe_conv.py's)
    steps = 1

    def __init__(self):
        self.fw = fw = adapter("jax")
        self.jax, self.jnp = fw.jax, fw.jnp
        from jax import lax

        from polyamp.jax import recipe_conv as jc

        self.lax, self.jc, self.programs = lax, jc, {}
        self.dtypes = {"fp32": self.jnp.float32, "bf16": self.jnp.bfloat16}

    def supports(self, geo):
        return geo.batched

    def numbers(self, geo):
        space = "DHW"[3 - geo.nd :]
        if geo.channels_last:
            return (f"N{space}C", f"{space}IO", f"N{space}C")
        return (f"NC{space}", f"OI{space}", f"NC{space}")

    def _kw(self, geo):
        padding = geo.padding.upper() if isinstance(geo.padding, str) else geo.padding
        return {"window_strides": geo.stride, "padding": padding, "rhs_dilation": geo.dilation,
                "feature_group_count": geo.groups, "dimension_numbers": self.numbers(geo)}  # fmt: skip

    def _kernel(self, geo, w):
        return np.ascontiguousarray(np.transpose(w, (*range(2, w.ndim), 1, 0))) if geo.channels_last else w

    def _canonical(self, geo, k):
        n = k.ndim
        return self.jnp.transpose(k, (n - 1, n - 2, *range(n - 2))) if geo.channels_last else k

    def _convolve(self, geo, a, b):
        return self.lax.conv_general_dilated(self.jnp.asarray(a), self.jnp.asarray(b), **self._kw(geo))

    def quantizer(self, r):
        return r

    def calls(self, q):
        return None

    def _program(self, r, geo, computes, shapes):
        """(y, dx, dW) of the recipe's convolution in each of ``computes``, in one compiled program made once
        (op by op, each of the quantizer's operations would compile alone)."""
        key = (r, geo, computes, shapes)
        if key not in self.programs:
            self.programs[key] = self._compiled(r, geo, computes, shapes)
        return self.programs[key]

    def _compiled(self, r, geo, computes, shapes):
        jax, F32 = self.jax, self.jnp.float32
        x, w = (jax.ShapeDtypeStruct(s, F32) for s in shapes)
        (eqn,) = jax.make_jaxpr(lambda a, b: self._convolve(geo, a, b))(x, w).jaxpr.eqns
        fns = [self.jc.conv(r, self.dtypes[c], F32, F32, eqn.params) for c in computes]

        @jax.jit
        def forward_and_back(x, w, g):
            return [(y, *vjp(g)) for y, vjp in (jax.vjp(fn, x, w) for fn in fns)]

        return forward_and_back

    def conv(self, q, geo, computes, x, w, b, grad):
        k = self._kernel(geo, w)
        y = self.jax.eval_shape(lambda a, b: self._convolve(geo, a, b), x, k)
        g = grad(tuple(y.shape))
        outs = self._program(q, geo, tuple(computes), (x.shape, k.shape))(*map(self.jnp.asarray, (x, k, g)))
        return g, [(y, dx, self._canonical(geo, dk), None) for y, dx, dk in outs]

    def plain(self, geo, compute, x, w, b=None, g=None, wrt="xw"):
        """``lax.conv_general_dilated`` (float32 products), or ``jax.vjp`` of it for ``g`` with respect to
        ``wrt``."""
        assert compute == "fp32"
        k = self._kernel(geo, w)
        if g is None:
            return np.asarray(self._convolve(geo, x, k))
        g, vjp = self.jnp.asarray(g), self.jax.vjp
        dx = (
            np.asarray(vjp(lambda a: self._convolve(geo, a, k), self.jnp.asarray(x))[1](g)[0])
            if "x" in wrt
            else None
        )
        dk = vjp(lambda b: self._convolve(geo, x, b), self.jnp.asarray(k))[1](g)[0] if "w" in wrt else None
        return _wanted(wrt, dx, None if dk is None else np.asarray(self._canonical(geo, dk)))

    def output_dtype(self, compute):
        return np.dtype(np.float32)


class MXNetConv:
    name = "mxnet"
    has_bias = True
    counts = "all"
    steps = 2  # the second step: delayed scaling's histories, later stochastic-rounding seeds

    def __init__(self):
        self.fw = fw = adapter("mxnet")
        self.mx = fw.mx
        from mxnet_caps import BF16_UNSUPPORTED

        self.bf16_unsupported = BF16_UNSUPPORTED
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            from polyamp.mxnet import recipe as mr
            from polyamp.mxnet import recipe_conv as mc
        self.mr, self.mc = mr, mc

    def supports(self, geo):
        return not geo.channels_last and geo.batched and geo.symmetric() is not None

    def _kw(self, geo):
        return {"kernel": geo.w[2:], "stride": geo.stride, "pad": geo.symmetric(), "dilate": geo.dilation,
                "num_filter": geo.w[0], "num_group": geo.groups,
                "layout": ("NCW", "NCHW", "NCDHW")[geo.nd - 1]}  # fmt: skip

    def quantizer(self, r):
        return self.mr.Quantizer(r)

    def calls(self, q):
        return q.calls

    def histories(self, q):
        """The delayed-scaling states, ``"layer|operand" -> state_dict``."""
        return q.state_dict()["delayed"]

    def conv(self, q, geo, computes, x, w, b, grad):
        mx, outs, g = self.mx, [], None
        for compute in computes:
            X, W, *B = (mx.nd.array(t) for t in (x, w) + (() if b is None else (b,)))
            for t in (X, W, *B):
                t.attach_grad()
            with mx.autograd.record():
                y = self.mc.QuantizedConv(q, "c", compute, self._kw(geo))(W, *B, X)
            g = grad(tuple(y.shape)) if g is None else g
            y.backward(mx.nd.array(g))
            mx.nd.waitall()  # the backward, and its quantizer calls, run on MXNet's engine threads
            outs.append((y, X.grad, W.grad, B[0].grad if B else None))
        return g, outs

    def plain(self, geo, compute, x, w, b=None, g=None, wrt="xw"):
        """MXNet's Convolution of float32 operands (and bias ``b``) cast to ``compute``, or its autograd
        gradients (float32) for ``g`` with respect to ``wrt``."""
        mx = self.mx
        dtype = self.fw.bf16 if compute == "bf16" else "float32"
        leaves = [mx.nd.array(t) for t in (x, w) + (() if b is None else (b,))]
        for n, t in zip("xw", leaves):
            if n in wrt:
                t.attach_grad()
        with mx.autograd.record():
            y = self.mc._CONV(*(mx.nd.amp_cast(t, dtype=dtype) for t in leaves), no_bias=b is None,
                              **self._kw(geo))  # fmt: skip
        if g is None:
            return self.fw.numpy(y)
        y.backward(mx.nd.amp_cast(mx.nd.array(g), dtype=dtype))
        return _wanted(wrt, *(t.grad.asnumpy() if n in wrt else None for n, t in zip("xw", leaves)))

    def bias_grad(self, g):
        return self.mx.nd.sum(self.mx.nd.array(g), axis=1, exclude=True).asnumpy()

    def output_dtype(self, compute):
        return BF16 if compute == "bf16" else np.dtype(np.float32)

    def blocked(self, r, x, axis):
        return self.mc.along(self.mr.Quantizer(r), self.mx.nd.array(x), "c", "input", axis)

    def hadamard(self, x):
        return self.mx.nd.array(x)


CONV_ADAPTERS = {a.name: a for a in (TorchConv, TensorFlowConv, JaxConv, MXNetConv)}
_MADE = {}


def conv_adapter(name: str):
    """The convolution adapter of framework ``name``, made once per process (a requested framework that
    cannot be imported fails, any other is a skip: ``framework_ops.adapter``)."""
    if name not in _MADE:
        _MADE[name] = CONV_ADAPTERS[name]()
    return _MADE[name]
