"""The compare workloads in MXNet Gluon (run by ``.venv-mxnet``'s interpreter), trained with
``polyamp.MixedPrecision``.

Each network is built from the numpy weights of ``workloads.py`` (a ``Dense`` weight is
``[out, in]``, so ``W[in, out]`` is stored transposed) and hybridized. The policy is MXNet's own
AMP (``contrib.amp``, process-wide: one case per process suits it); ``MixedPrecision`` calls
``amp.init`` before the network is built. fp16-mixed on CPU is reported as unsupported: MXNet's
float16 FullyConnected exists only with cuDNN.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from ..mixed_precision import MixedPrecision
from .workloads import Workload

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import autograd, gluon


def _dense(weights: dict, name: str, prefix: str) -> gluon.nn.Dense:
    w = weights[name + ".w"]
    return gluon.nn.Dense(w.shape[1], in_units=w.shape[0], flatten=False, prefix=prefix + "_")


def _weight_layers(block: gluon.Block, prefix: str = "") -> dict:
    """Every Dense and LayerNorm under ``block`` by its workload weight name (``block0.q``)."""
    out = {}
    for name, child in block._children.items():
        if isinstance(child, (gluon.nn.Dense, gluon.nn.LayerNorm)):
            out[prefix + name] = child
        else:
            out.update(_weight_layers(child, prefix + name + "."))
    return out


def _load(net: gluon.Block, weights: dict) -> None:
    """Copy the workload's arrays into the initialized network."""
    for name, layer in _weight_layers(net).items():
        if isinstance(layer, gluon.nn.Dense):
            layer.weight.set_data(mx.nd.array(weights[name + ".w"].T))
            layer.bias.set_data(mx.nd.array(weights[name + ".b"]))
        else:
            layer.gamma.set_data(mx.nd.array(weights[name + ".g"]))
            layer.beta.set_data(mx.nd.array(weights[name + ".b"]))


def _act(F, x, kind: str):
    return F.LeakyReLU(x, act_type="gelu") if kind == "gelu" else F.relu(x)


class MLP(gluon.HybridBlock):
    def __init__(self, wl: Workload):
        super().__init__(prefix="mlp_")
        self.activation = wl.activation
        with self.name_scope():
            self.fc = [_dense(wl.weights, f"fc{i}", f"fc{i}") for i in range(len(wl.dims) - 1)]
        for i, layer in enumerate(self.fc):
            self.register_child(layer, f"fc{i}")

    def hybrid_forward(self, F, x):
        for layer in self.fc[:-1]:
            x = _act(F, layer(x), self.activation)
        return self.fc[-1](x)


class Block(gluon.HybridBlock):
    """Pre-LN transformer block: causal self-attention with separate q/k/v/o, GELU MLP of 4*d."""

    def __init__(self, wl: Workload, i: int):
        super().__init__(prefix=f"block{i}_")
        p, d = f"block{i}.", wl.d_model
        self.heads = wl.heads
        self.scale = 1.0 / math.sqrt(d // wl.heads)
        with self.name_scope():
            for n in ("ln1", "ln2"):
                self.register_child(gluon.nn.LayerNorm(in_channels=d, prefix=n + "_"), n)
            for n in ("q", "k", "v", "o", "ff1", "ff2"):
                self.register_child(_dense(wl.weights, p + n, n), n)

    def _heads(self, F, x):  # (b, t, d) -> (b*h, t, d/h)
        return F.reshape(F.transpose(F.reshape(x, (0, 0, self.heads, -1)), (0, 2, 1, 3)), (-3, 0, 0))

    def hybrid_forward(self, F, x, mask):
        get = self._children.get
        h = get("ln1")(x)
        q, k, v = (self._heads(F, get(n)(h)) for n in "qkv")
        scores = F.broadcast_add(F.batch_dot(q, k, transpose_b=True) * self.scale, mask)
        a = F.batch_dot(F.softmax(scores, axis=-1), v)
        a = F.reshape(F.transpose(F.reshape(a, (-4, -1, self.heads, 0, 0)), (0, 2, 1, 3)), (0, 0, -3))
        x = x + get("o")(a)
        return x + get("ff2")(_act(F, get("ff1")(get("ln2")(x)), "gelu"))


class CharLM(gluon.HybridBlock):
    """Embedding plus learned positions, pre-LN blocks, final LayerNorm, dense head."""

    def __init__(self, wl: Workload):
        super().__init__(prefix="charlm_")
        w = wl.weights
        self.vocab, self.d = w["embed"].shape
        with self.name_scope():
            self.embed = self.params.get("embed", shape=w["embed"].shape)
            self.pos = self.params.get("pos", shape=w["pos"].shape)
            self.blocks = [Block(wl, i) for i in range(wl.layers)]
            for i, block in enumerate(self.blocks):
                self.register_child(block, f"block{i}")
            self.register_child(gluon.nn.LayerNorm(in_channels=self.d, prefix="lnf_"), "lnf")
            self.register_child(_dense(w, "head", "head"), "head")
        causal = np.triu(np.full((wl.context, wl.context), -np.inf, np.float32), k=1)
        self.mask = mx.nd.array(causal[None])

    def hybrid_forward(self, F, ids, mask, embed, pos):
        x = F.Embedding(ids, embed, input_dim=self.vocab, output_dim=self.d)
        x = F.broadcast_add(x, F.expand_dims(pos, 0))
        for block in self.blocks:
            x = block(x, mask)
        return self._children["head"](self._children["lnf"](x))


class Trainer:
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        mx.random.seed(wl.seed)
        self.wl = wl
        self.mp = MixedPrecision(policy, framework="mxnet", device="cpu")  # amp.init: before the net
        self.model = CharLM(wl) if wl.name == "charlm" else MLP(wl)
        self.model.initialize()
        _load(self.model, wl.weights)
        if wl.name == "charlm":
            self.model.embed.set_data(mx.nd.array(wl.weights["embed"]))
            self.model.pos.set_data(mx.nd.array(wl.weights["pos"]))
        self.model.hybridize(static_alloc=True, static_shape=True)
        self.mp.watch(self.model)
        params = self.model.collect_params()
        self.trainer = self.mp.trainer(gluon.Trainer(params, "adam", {"learning_rate": wl.lr}))
        self._ce = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)

    def _loss(self, x, y):
        if self.wl.name == "charlm":
            x = mx.nd.array(x, dtype="float32")  # Embedding takes float indices
            out = self.model(x, self.model.mask)
        else:
            out = self.model(mx.nd.array(x))
        out = mx.nd.amp_cast(out, dtype="float32")
        if self.wl.name == "mlp":
            return mx.nd.mean(mx.nd.square(out - mx.nd.array(y)))
        return mx.nd.mean(self._ce(out, mx.nd.array(y, dtype="float32")))

    def step(self, i: int) -> float:
        x, y = self.wl.batch_at(i)
        with autograd.record():
            loss = self._loss(x, y)
            with self.mp.scale_loss(loss, self.trainer) as scaled:
                autograd.backward(scaled)
        self.last = self.mp.step(self.trainer, batch_size=1)  # the loss is already a mean
        return float(loss.asscalar())

    def evaluate(self) -> float:
        batches = self.wl.eval_batches_()
        if self.wl.name == "digits":
            ((x, y),) = batches
            out = mx.nd.amp_cast(self.model(mx.nd.array(x)), dtype="float32")
            return float(np.mean(out.asnumpy().argmax(-1) == y))
        return float(np.mean([float(self._loss(x, y).asscalar()) for x, y in batches]))


def versions() -> dict[str, str]:
    return {"mxnet": mx.__version__}
