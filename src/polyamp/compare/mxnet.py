"""The compare workloads in MXNet Gluon (run by ``.venv-mxnet``'s interpreter), trained with
``polyamp.MixedPrecision``.

Each network is built from the numpy weights of ``workloads.py`` (a ``Dense`` weight is
``[out, in]``, so ``W[in, out]`` is stored transposed) and hybridized (imperative under a recipe: its
quantizers, not the graph, are the step's cost, and the imperative form is the one whose pieces the
memory probes can tell apart). The policy is MXNet's own
AMP (``contrib.amp``, process-wide: one case per process suits it); ``MixedPrecision`` calls
``amp.init`` before the network is built. fp16-mixed on CPU is reported as unsupported: MXNet's
float16 FullyConnected exists only with cuDNN; so are bf16-mixed and the recipes on a CPU without
AVX-512, where MXNet's oneDNN has no bf16 kernels (``MixedPrecision`` raises the UnsupportedError).
What backward keeps is read from the gradient graph MXNet builds for the hybridized network (an
executor's ``debug_str()``, its only view of it).
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np

from ..mixed_precision import MixedPrecision
from .protocol import Saved, TrainerBase
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
    """Copy the workload's arrays into the initialized network: its layers' and its own (CharLM's
    ``embed`` and ``pos``)."""
    for name, param in net._reg_params.items():
        param.set_data(mx.nd.array(weights[name]))
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


_NETWORKS = {"dense": MLP, "transformer": CharLM}
_BLOCK = "-" * 20  # separates the nodes in an executor's debug_str()
_CASTS = ("amp_cast", "amp_multicast")


def _graph_nodes(debug: str) -> dict[str, tuple[str, list[tuple[str, int]]]]:
    """An executor's ``debug_str()`` as {node: (op, [(input node, output index)])}; a variable's
    op is ``"Variable"``. This text is the only view MXNet gives of the gradient graph it builds."""
    nodes: dict[str, tuple[str, list[tuple[str, int]]]] = {}
    for chunk in debug.split(_BLOCK):
        for var in re.findall(r"^Variable:(\S+)", chunk, re.M):
            nodes[var] = ("Variable", [])
        head = re.search(r"^Op:([^,]+), Name=(\S+)", chunk, re.M)
        if head:
            args = re.findall(r"^\targ\[\d+\]=(\S+)\((\d+)\)", chunk, re.M)
            nodes[head.group(2)] = (head.group(1), [(n, int(k)) for n, k in args])
    return nodes


def _saved_in_graph(symbol, shapes: dict, params: set[str]) -> tuple[int, int, int]:
    """(activation bytes, weight-copy bytes, entries of unknown size) that the backward nodes of
    ``symbol``'s gradient graph read from its forward nodes. A cast to the dtype it already has
    is followed to its input (it shares the memory); a cast of a parameter to another dtype is a
    weight copy. Hidden outputs (LayerNorm's mean and std) have no shape MXNet reports."""
    exe = symbol.simple_bind(mx.cpu(), grad_req="write", **shapes)
    nodes = _graph_nodes(exe.debug_str())
    internals = symbol.get_internals()
    names = internals.list_outputs()
    _, out_shapes, _ = internals.infer_shape(**shapes)
    _, out_types, _ = internals.infer_type(**{k: np.float32 for k in shapes})
    entries = {name: (shape, np.dtype(dtype)) for name, shape, dtype in zip(names, out_shapes, out_types)}

    def info(node: str, k: int):
        for name in (node, f"{node}_output", f"{node}_output{k}"):
            if name in entries and (name != f"{node}_output" or k == 0):
                return entries[name]
        return None

    def source(node: str, k: int) -> tuple[str, int]:
        op, args = nodes[node]
        while op in _CASTS and info(node, k)[1] == info(*args[k if op == "amp_multicast" else 0])[1]:  # type: ignore[index]
            node, k = args[k if op == "amp_multicast" else 0]
            op, args = nodes[node]
        return node, k

    forward = {re.sub(r"_output\d*$", "", name) for name in names} | set(shapes)
    backward = set(nodes) - forward  # the gradient nodes, and the head gradient they start from
    saved = {source(n, k) for name in backward for n, k in nodes[name][1] if n in forward}
    activations = copies = unsized = 0
    for node, k in saved:
        op, args = nodes[node]
        if node in params:
            continue
        if info(node, k) is None:
            unsized += 1
            continue
        shape, dtype = info(node, k)
        size = int(np.prod(shape)) * dtype.itemsize
        if op == "amp_cast" and args[0][0] in params:
            copies += size
        else:
            activations += size
    return activations, copies, unsized


def _arrays(tree) -> list:
    """Every NDArray in a nest of tuples and lists (an optimizer's state)."""
    if isinstance(tree, mx.nd.NDArray):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for t in tree for a in _arrays(t)]
    return []


def _entry(a) -> tuple[int, str]:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize, np.dtype(a.dtype).name


class Trainer(TrainerBase):
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        mx.random.seed(wl.seed)
        self.wl = wl
        self.mp = MixedPrecision(policy, framework="mxnet", device="cpu")  # amp.init: before the net
        self.model = _NETWORKS[wl.architecture](wl)
        self.model.initialize()
        _load(self.model, wl.weights)
        if self.mp.recipe is None:  # a recipe's quantized Dense layers run imperatively
            self.model.hybridize(static_alloc=True, static_shape=True)
        self.mp.watch(self.model)
        params = self.model.collect_params()
        self.trainer = self.mp.trainer(gluon.Trainer(params, "adam", {"learning_rate": wl.lr}))
        self._ce = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)

    def _inputs(self, x: np.ndarray) -> list:
        """The network's inputs: ids as float32 (Embedding takes float indices), plus the
        transformer's causal mask."""
        return [mx.nd.array(x, dtype="float32")] + ([self.model.mask] if hasattr(self.model, "mask") else [])

    def _outputs(self, x: np.ndarray):
        return mx.nd.amp_cast(self.model(*self._inputs(x)), dtype="float32")

    def _loss(self, x, y):
        out = self._outputs(x)
        if self.wl.loss_kind == "mse":
            return mx.nd.mean(mx.nd.square(out - mx.nd.array(y)))
        return mx.nd.mean(self._ce(out, mx.nd.array(y, dtype="float32")))

    def doctor_inputs(self, i: int = 0) -> tuple:
        """``polyamp.doctor``'s (model, batch, loss_fn, optimizer) for step ``i``."""
        x, y = self.wl.batch_at(i)

        def loss_fn(out, target):
            if self.wl.loss_kind == "mse":
                return mx.nd.mean(mx.nd.square(out - target))
            return mx.nd.mean(self._ce(out, target))

        inputs = tuple(self._inputs(x))
        return self.model, (inputs, mx.nd.array(y, dtype="float32")), loss_fn, self.trainer

    def step(self, i: int) -> float:
        x, y = self.wl.batch_at(i)
        with autograd.record():
            loss = self._loss(x, y)
            with self.mp.scale_loss(loss, self.trainer) as scaled:
                autograd.backward(scaled)
        self.last = self.mp.step(self.trainer, batch_size=1)  # the loss is already a mean
        return float(loss.asscalar())

    @property
    def inference_form(self) -> str:
        dtype = self.mp.policy.compute_dtype
        if self.mp.recipe is not None:
            return (f"imperative Gluon network outside autograd.record: the {self.mp.recipe.name} recipe's "
                    f"quantized Dense GEMMs ({self.mp.recipe.compute_dtype} products), the rest under "
                    f"contrib.amp.init({dtype})")  # fmt: skip
        if dtype == "float32":
            return "hybridized Gluon network outside autograd.record, float32"
        return (f"hybridized Gluon network outside autograd.record under contrib.amp.init({dtype}): "
                "float32 weights, amp_cast per call")  # fmt: skip

    def forward(self, x: np.ndarray) -> np.ndarray:
        """The hybridized network under the process's AMP (also ``infer``: AMP is MXNet's inference form;
        ``amp.convert_hybrid_block`` of the trained network, tried here, kept float32 weights and ran
        no faster)."""
        return self._outputs(x).asnumpy()

    # -- memory probes ---------------------------------------------------------------------------
    def _parameters(self):
        return [_entry(p.data()) for p in self.model.collect_params().values()]

    def _gradients(self):
        return [_entry(p.grad()) for p in self.model.collect_params().values()]

    def _optimizer_bytes(self):
        states = [a for u in self.trainer._updaters for s in u.states.values() for a in _arrays(s)]
        return sum(_entry(a)[0] for a in states) if states else None

    def _saved(self) -> Saved:
        if self.mp.recipe is not None:
            return Saved(None, None, "a recipe's network runs imperatively: no gradient graph to read")
        if not getattr(self.model, "_cached_graph", None):
            self.forward(self.wl.batch_at(0)[0])  # hybridize traces the graph at the first call
        inputs, symbol = self.model._cached_graph
        arrays = self._inputs(self.wl.batch_at(0)[0])
        shapes = {s.name: a.shape for s, a in zip(inputs, arrays)}
        activations, copies, unsized = _saved_in_graph(symbol, shapes, set(self.model.collect_params()))
        how = ("forward entries the backward nodes of MXNet's gradient graph read (executor debug_str() of "
               "the hybridized network; the imperative loss outside it not counted), parameters excluded, "
               "their amp_cast copies counted as weight copies")  # fmt: skip
        if unsized:
            how += f"; {unsized} hidden outputs (LayerNorm's mean and std) have no shape: not counted"
        return Saved(activations, copies, how)


def tune_inputs(name: str, quick: bool = False) -> tuple:
    """A workload as ``polyamp.mxnet.tune``'s arguments: the maker ``tune_model`` and its keyword
    arguments (MXNet's AMP is process-wide, so each policy builds the network in its own process)."""
    return "polyamp.compare.mxnet:tune_model", {"name": name, "quick": quick}


def tune_model(name: str, quick: bool = False) -> tuple:
    """The workload's float32 network (not hybridized: choosing that is tune's job), its batches
    (cycled), its loss on the output cast to float32, and Adam with the workload's learning rate."""
    from .workloads import get_workload

    wl = get_workload(name, quick=quick)
    mx.random.seed(wl.seed)
    net = _NETWORKS[wl.architecture](wl)
    net.initialize()
    _load(net, wl.weights)
    extra = [net.mask] if hasattr(net, "mask") else []
    ce = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)

    def batch(i: int):
        x, y = wl.batch_at(i % wl.steps)
        return [mx.nd.array(x, dtype="float32"), *extra], mx.nd.array(y, dtype="float32")

    def loss_fn(out, target):
        out = mx.nd.amp_cast(out, dtype="float32")
        if wl.loss_kind == "mse":
            return mx.nd.mean(mx.nd.square(out - target))
        return mx.nd.mean(ce(out, target))

    return net, batch, loss_fn, ("adam", {"learning_rate": wl.lr})


def versions() -> dict[str, str]:
    return {"mxnet": mx.__version__}
