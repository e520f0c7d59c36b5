"""The doctor's MXNet taps (polyamp.mxnet.doctor) and keep_fp32, against the numpy core, on real MXNet.

MXNet's AMP is process-wide: this module sets up bf16-mixed before any network exists (as
tests/test_mxnet.py does), so ``collect`` runs here in a process whose operators contrib.amp patched,
and must still observe a float32 step; the float32 references are computed under
``float32_operators()``.
"""

import ctypes
import gc
import math
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import PolyampError, UnsupportedError
from polyamp.doctor import KINDS, LogHistogram, Observation, update_ratio_histogram

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mx = require("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet.contrib.amp.amp import bfloat16  # noqa: E402
from mxnet_caps import bf16_or_none, needs_bf16  # noqa: E402

import polyamp.mxnet.binning as binning  # noqa: E402
from polyamp.doctor import binning_host  # noqa: E402
from polyamp.mxnet.doctor import collect, histogram, ratio_histogram  # noqa: E402
from polyamp.mxnet.keep import float32_operators, keep_float32  # noqa: E402

MP = bf16_or_none("bf16-mixed")  # amp.init, before any network exists (None: no bf16 here)
pytestmark = pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning")


def to_numpy(a):
    """An NDArray's values as numpy, bf16 as ml_dtypes.bfloat16 (both exact)."""
    if np.dtype(a.dtype).names == ("bfloat16",):
        return a.astype("float32").asnumpy().astype(ml_dtypes.bfloat16)
    return a.asnumpy()


def reference(a) -> LogHistogram:
    return LogHistogram.of(to_numpy(a))


def nd(values, dtype):
    """An NDArray of ``dtype`` (a name, or MXNet's bfloat16) from float64 values (rounded once)."""
    arr = np.asarray(values, np.float64)
    if dtype is bfloat16:
        return mx.nd.amp_cast(mx.nd.array(arr.astype(ml_dtypes.bfloat16).astype(np.float32)), dtype=bfloat16)
    return mx.nd.array(arr.astype(dtype), dtype=dtype)


def wide(n, dtype, seed):
    """Random magnitudes over most of the dtype's exponent range, both signs (float64 values)."""
    rng = np.random.default_rng(seed)
    info = ml_dtypes.finfo(ml_dtypes.bfloat16) if dtype is bfloat16 else np.finfo(dtype)
    lo, hi = math.log2(float(info.smallest_normal)) - 8, math.log2(float(info.max)) - 1
    return np.sign(rng.standard_normal(n)) * np.exp2(rng.uniform(lo, hi, n))


@pytest.fixture(params=["numpy", "mxnet"])
def path(request, monkeypatch):
    """Each binning path: numpy on host memory, or (no context counted as host memory, as on a GPU)
    MXNet's ops, copies and taps."""
    if request.param == "mxnet":
        monkeypatch.setattr(binning, "_HOST_DEVICES", frozenset())
    return request.param


# -- binning equals the numpy core -------------------------------------------------------------------
def test_float64_ratios_of_subnormals_and_beyond_float32_are_exact():
    u = np.array([5e-324, 1e-310, 1e-300, 1e300, 2.0, 3.0, 1e-30])
    w = np.array([1e-310, 1e-300, 1e-320, 1e-300, 1e-310, 4.0, 1e30])
    assert ratio_histogram(mx.nd.array(u, dtype="float64"), mx.nd.array(w, dtype="float64")) == \
        update_ratio_histogram(u, w)  # fmt: skip


def spy_host_reads(monkeypatch):
    """The sizes of the arrays read back to the host (every NDArray read goes through asnumpy)."""
    seen = []
    for cls in {mx.nd.NDArray, mx.np.ndarray}:
        original = cls.asnumpy

        def spy(self, *args, _original=original, **kwargs):
            seen.append(self.size)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "asnumpy", spy)
    return seen


def observe_relu_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(256, in_units=256, activation="relu"), gluon.nn.Dense(256, in_units=256))
    net.initialize()
    x, y = mx.nd.random.normal(shape=(256, 256)), mx.nd.random.normal(shape=(256, 256))
    x[0, 0] = 1e-40  # subnormals, zeros (relu) and inf take the other branches
    trainer = gluon.Trainer(net.collect_params(), "adam")
    collect(net, (x, y), gluon.loss.L2Loss(), optimizer=trainer)
    histogram(nd([0.0, 1e-41, math.inf] * 30000, "float32"))


def test_host_arrays_are_binned_where_they_lie(monkeypatch):
    """On the CPU numpy reads the NDArrays' own memory: not one array is copied to the host."""
    seen = spy_host_reads(monkeypatch)
    observe_relu_net()
    assert seen == []


def test_on_the_mxnet_path_only_counts_and_scalars_reach_the_host(monkeypatch):
    """MXNet's path (a GPU's) moves key counts (4096; 32768 for the rare float64 rebinning) and a few
    scalars."""
    monkeypatch.setattr(binning, "_HOST_DEVICES", frozenset())
    seen = spy_host_reads(monkeypatch)
    observe_relu_net()
    assert seen and max(seen) <= 32768 < 256 * 256


# -- binning in numpy, on host memory ----------------------------------------------------------------
def test_chunks_with_zeros_infs_nans_and_subnormals_apart_combine_exactly():
    """numpy bins in chunks: one of zeros only, one of inf/NaN only, one with both amid normal
    values, one with subnormals, and a short last one holding the maximum."""
    n = binning_host.CHUNK
    x = np.random.default_rng(8).standard_normal(4 * n + 5).astype(np.float32)
    x[:n] = np.resize(np.array([0.0, -0.0], np.float32), n)
    x[n : 2 * n] = np.resize(np.array([np.inf, -np.inf, np.nan], np.float32), n)
    x[2 * n + 3], x[2 * n + 7], x[2 * n + 9] = 0.0, np.nan, -np.inf
    x[3 * n + 1], x[3 * n + 2] = 1e-45, -3e-39
    x[-1] = np.finfo(np.float32).max
    h = histogram(mx.nd.array(x))
    assert h == LogHistogram.of(x)
    assert h.zeros == n + 1 and h.nonfinite == n + 2
    assert h.amin_nonzero == float(np.float32(1e-45)) and h.amax == float(np.finfo(np.float32).max)


def test_slices_rows_and_reshapes_are_binned_from_their_own_memory():
    """Views into another array's memory (an offset into it): each binned as its own values."""
    big = mx.nd.array(wide(6 * 63, "float32", seed=9).reshape(6, 63).astype(np.float32))
    views = [big[2:5], big[3], big.reshape((7, 6, 9))[1:3], big[5:6]]
    assert [histogram(v) for v in views] == [reference(v) for v in views]
    assert histogram(big[0:3]) != histogram(big[2:5])


def test_an_array_is_read_after_mxnet_has_written_it():
    x = mx.nd.random.normal(shape=(256, 256))
    y = x
    for _ in range(8):  # queued: histogram waits for the last write
        y = mx.nd.dot(y, x) * 0.0625
    assert histogram(y) == reference(y)


def test_an_array_in_mkldnn_layout_is_written_out_by_mxnet(monkeypatch):
    """A convolution's output (MKL-DNN's blocked layout, in a build with it) has no plain view: MXNet's
    abs writes it out into numpy memory, which numpy bins."""
    calls = []
    magnitudes = binning._Scratch.magnitudes
    spy = lambda self, x: calls.append(1) or magnitudes(self, x)  # noqa: E731
    monkeypatch.setattr(binning._Scratch, "magnitudes", spy)
    x, w = mx.nd.random.normal(shape=(2, 3, 12, 12)), mx.nd.random.normal(shape=(8, 3, 3, 3))
    with float32_operators():  # not contrib.amp's bf16 convolution
        y = mx.nd.Convolution(x, w, kernel=(3, 3), num_filter=8, no_bias=True)
    assert y.dtype == np.float32 and histogram(y) == reference(y)
    assert bool(calls) == mx.runtime.Features().is_enabled("MKLDNN")


@pytest.mark.parametrize("before_in", ["ndarray", "numpy"])
def test_update_ratios_of_host_arrays_equal_the_numpy_core(path, before_in):
    """``_update`` (a step's update of a float32 weight): lost updates, zero weights, and the cases its
    fast path leaves to float64 (a tiny weight, a non-finite update, a ratio beyond float32)."""
    rng = np.random.default_rng(10)
    n = 2 * binning_host.CHUNK + 3
    w = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    after = (w + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3) * np.abs(w)).astype(np.float32)
    w[:40], after[20:60] = 0.0, w[20:60]  # zero weights (some updated), lost updates
    cases = {"fast": (after, w)}
    changes = [("tiny weight", 5000, 1e-35), ("inf update", 7, math.inf), ("huge ratio", 9, 3e38)]
    for name, i, value in changes:
        a, b = after.copy(), w.copy()
        (b if name == "tiny weight" else a)[i] = value
        cases[name] = (a, b)
    for name, (a, b) in cases.items():
        before = mx.nd.array(b) if before_in == "ndarray" else b.copy()
        got = binning._update(mx.nd.array(a), before, histogram(mx.nd.array(b)), binning._Scratch())
        with np.errstate(invalid="ignore", over="ignore"):
            assert got == update_ratio_histogram(a - b, b), name
    assert got.apart == 40 and got.zeros >= 20


def test_importing_the_taps_keeps_mxnets_dlpack_deleter_working(monkeypatch):
    """A capsule dropped unconsumed (as the host views' are) runs MXNet's deleter, which releases the
    array; it raised instead when the shared ctypes prototype was given argtypes."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    capsule = mx.nd.to_dlpack_for_read(mx.nd.ones(3))
    del capsule
    gc.collect()
    assert seen == [] and ctypes.pythonapi.PyCapsule_GetPointer.argtypes is None


def test_work_arrays_lie_in_their_lanes():
    for lane in range(4):
        a = binning._host_array(100_000, np.float32, lane, zeros=True)
        assert a.ctypes.data % 4096 == lane * 1024 and a.shape == (100_000,) and not a.any()


# -- collect: never changes the model or the trainer ------------------------------------------------
class Net(gluon.HybridBlock):
    """A parameter of its own and in leaves, a frozen layer, BatchNorm (running statistics), Dense+act."""

    def __init__(self):
        super().__init__()
        with self.name_scope():
            self.scale = self.params.get("scale", shape=(1,), init=mx.init.Constant(1.5))
            self.fc1 = gluon.nn.Dense(16, in_units=6)
            self.bn = gluon.nn.BatchNorm(in_channels=16)
            self.frozen = gluon.nn.Dense(16, in_units=16, activation="relu")
            self.fc2 = gluon.nn.Dense(3, in_units=16)
        self.frozen.collect_params().setattr("grad_req", "null")

    def hybrid_forward(self, F, x, scale):
        return self.fc2(self.frozen(self.bn(self.fc1(F.broadcast_mul(x, scale)))))


def bits(a):
    return (a if np.dtype(a.dtype).names is None else a.astype("float32")).asnumpy().tobytes()


def deep(v):
    if isinstance(v, mx.nd.NDArray):
        return ("array", id(v), v.dtype, v.shape, bits(v))
    if isinstance(v, dict):
        return {k: deep(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [deep(x) for x in v]
    return v


def snapshot(model, trainer):
    """Everything collect must leave as it found: values bitwise, identities, flags, graphs, trainer."""
    params = model.collect_params()
    state = {
        "params": {
            n: (id(p), p.grad_req, id(p.data()), bits(p.data()), p.data()._fresh_grad)
            for n, p in params.items()
        },  # fmt: skip
        "grads": {n: (id(p.grad()), bits(p.grad())) for n, p in params.items() if p.grad_req != "null"},
        "blocks": [
            (b.name, getattr(b, "_active", None), id(getattr(b, "_cached_op", None)), sorted(vars(b)))
            for b in _all_blocks(model)
        ],  # fmt: skip
    }
    if trainer is not None:
        opt = trainer._optimizer
        state["trainer"] = {k: deep(v) for k, v in vars(trainer).items() if k != "_optimizer"}
        state["optimizer"] = {k: deep(v) for k, v in vars(opt).items() if k != "param_dict"}
        state["scheduler"] = dict(vars(opt.lr_scheduler)) if opt.lr_scheduler is not None else None
        state["updaters"] = [{k: deep(v) for k, v in vars(u).items() if k != "optimizer"}
                             for u in trainer._updaters]  # fmt: skip
    return state


def _all_blocks(block):
    return [block] + [b for c in block._children.values() for b in _all_blocks(c)]


def trained_net(steps=3, hybridize=False, scheduler=False):
    mx.random.seed(0)
    model = Net()
    model.initialize(mx.init.Xavier())
    if hybridize:
        model.hybridize()
    rng = np.random.default_rng(1)
    x, y = mx.nd.array(rng.standard_normal((32, 6))), mx.nd.array(rng.standard_normal((32, 3)))
    opts = {"learning_rate": 1e-2}
    if scheduler:
        opts["lr_scheduler"] = mx.lr_scheduler.FactorScheduler(step=1, factor=0.5)
    trained = [p for p in model.collect_params().values() if p.grad_req != "null"]
    trainer = gluon.Trainer(trained, "adam", opts)
    loss_fn = gluon.loss.L2Loss()
    for _ in range(steps):
        with autograd.record():
            loss = loss_fn(model(x), y)
        loss.backward()
        trainer.step(32)
    with autograd.record():
        loss = loss_fn(model(x), y)
    loss.backward()  # leave gradients behind, as a user might
    return model, trainer, (x, y)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("with_trainer", [True, False])
@pytest.mark.parametrize("hybridize", [False, True])
def test_collect_leaves_model_trainer_and_rng_bitwise_unchanged(steps, with_trainer, hybridize):
    model, trainer, batch = trained_net(hybridize=hybridize, scheduler=True)
    assert trainer._updaters[0].states  # Adam has state: mean and variance per parameter
    trainer = trainer if with_trainer else None
    before = snapshot(model, trainer)
    patched = mx.nd.FullyConnected  # contrib.amp's bf16 wrapper: collect puts the original back for its step
    mx.random.seed(7)
    obs = collect(model, batch, gluon.loss.L2Loss(), steps=steps, optimizer=trainer)
    drawn = mx.nd.random.uniform(shape=(4,)).asnumpy()
    mx.random.seed(7)
    assert np.array_equal(drawn, mx.nd.random.uniform(shape=(4,)).asnumpy())  # no random number drawn
    assert snapshot(model, trainer) == before
    assert mx.nd.FullyConnected is patched
    kinds = {o.kind for o in obs}
    assert ("update_ratio" in kinds) == with_trainer


def test_collect_puts_everything_back_when_the_loss_raises():
    model, trainer, batch = trained_net(hybridize=True)
    before = snapshot(model, trainer)
    calls = []

    def failing(out, y):
        calls.append(1)
        if len(calls) == 2:  # the second step: after a real trainer step
            raise ZeroDivisionError("user loss failed")
        return gluon.loss.L2Loss()(out, y)

    with pytest.raises(ZeroDivisionError, match="user loss failed"):
        collect(model, batch, failing, steps=3, optimizer=trainer)
    assert snapshot(model, trainer) == before


def test_collect_with_a_fresh_trainer_leaves_it_without_state():
    net = gluon.nn.Dense(4, in_units=4)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "adam")
    grads = [bits(p.grad()) for p in net.collect_params().values()]
    collect(net, mx.nd.ones((8, 4)), lambda out, x: ((out - x) ** 2).mean(), optimizer=trainer)
    assert not trainer._updaters[0].states and trainer._optimizer.num_update == 0
    assert not trainer._kv_initialized and not trainer._optimizer._index_update_count
    assert grads == [bits(p.grad()) for p in net.collect_params().values()]


def training_bits(model, trainer):
    """The bits of every value, gradient and optimizer state."""
    params = list(model.collect_params().values())
    out = [bits(p.data()) for p in params] + [bits(p.grad()) for p in params if p.grad_req != "null"]
    for _, state in sorted(trainer._updaters[0].states.items()):
        out += [bits(s) for s in (state if isinstance(state, tuple) else (state,))]
    return out


@pytest.mark.parametrize("with_trainer", [True, False])
@pytest.mark.parametrize("hybridize", [False, True])
def test_training_after_collect_is_bitwise_the_training_of_a_twin_without_it(with_trainer, hybridize):
    """collect swaps working copies and fresh gradient buffers in and out: afterwards backward writes
    the parameters' own gradients and the trainer steps their own values and states, as in a twin
    that never saw collect."""
    runs = []
    for observed in (False, True):
        model, trainer, (x, y) = trained_net(hybridize=hybridize, scheduler=True)
        if observed:
            collect(model, (x, y), gluon.loss.L2Loss(), steps=2, optimizer=trainer if with_trainer else None)
        for _ in range(2):
            with autograd.record():
                loss = gluon.loss.L2Loss()(model(x), y)
            loss.backward()
            trainer.step(32)
        runs.append(training_bits(model, trainer))
    assert runs[0] == runs[1]


def test_the_mxnet_path_observes_the_same_and_changes_nothing(monkeypatch):
    """With no context counted as host memory (as on a GPU): MXNet's copies, taps and binning."""
    model, trainer, batch = trained_net(scheduler=True)
    on_host = collect(model, batch, gluon.loss.L2Loss(), steps=2, optimizer=trainer)
    before = snapshot(model, trainer)
    monkeypatch.setattr(binning, "_HOST_DEVICES", frozenset())
    with_mxnet = collect(model, batch, gluon.loss.L2Loss(), steps=2, optimizer=trainer)
    assert snapshot(model, trainer) == before
    assert [(o.layer, o.kind, o.hist) for o in with_mxnet] == [(o.layer, o.kind, o.hist) for o in on_host]


# -- what collect observes --------------------------------------------------------------------------
def tiny():
    mx.random.seed(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, in_units=8), gluon.nn.GELU(), gluon.nn.Dense(4, in_units=32))
    net.initialize(mx.init.Xavier())
    return net


def mse(out, y):
    return ((out - y) ** 2).mean()


def merged(*arrays):
    hs = [reference(a) for a in arrays]
    return hs[0].merge(*hs[1:])


def test_observations_equal_the_numpy_core_on_the_same_tensors_in_layer_order():
    model = tiny()
    rng = np.random.default_rng(4)
    x, y = mx.nd.array(rng.standard_normal((16, 8))), mx.nd.array(rng.standard_normal((16, 4)))
    obs = collect(model, (x, y), mse)

    # the same step by hand, in float32, one block at a time: a copy of each block's input is a
    # variable, and its gradient is the head gradient of the block before
    with float32_operators():
        h = [x]
        for block in model._children.values():
            h.append(block(h[-1]))
        v = h[3].copy()
        v.attach_grad()
        with autograd.record():
            loss = mse(v, y)
        loss.backward()
        grad = {3: v.grad.copy()}  # d loss / d h[i]
        for i in (2, 1, 0):
            v = h[i].copy()
            v.attach_grad()
            with autograd.record():
                out = model[i](v)
            out.backward(grad[i + 1])
            grad[i] = v.grad.copy()
    d0, d2 = model[0], model[2]
    want = [
        ("0", "output", merged(h[1])), ("0", "grad_output", merged(grad[1])),
        ("0", "weight", merged(d0.weight.data(), d0.bias.data())),
        ("0", "grad_weight", merged(d0.weight.grad(), d0.bias.grad())),
        ("1", "output", merged(h[2])), ("1", "grad_output", merged(grad[2])),
        ("2", "output", merged(h[3])), ("2", "grad_output", merged(grad[3])),
        ("2", "weight", merged(d2.weight.data(), d2.bias.data())),
        ("2", "grad_weight", merged(d2.weight.grad(), d2.bias.grad())),
    ]  # fmt: skip
    assert [(o.layer, o.kind) for o in obs] == [(layer, kind) for layer, kind, _ in want]
    for o, (_, _, hist) in zip(obs, want):
        assert isinstance(o, Observation) and o.hist == hist, (o.layer, o.kind)


def test_hybridized_and_imperative_models_give_the_same_observations():
    x, y = mx.nd.ones((8, 8)) * 0.3, mx.nd.ones((8, 4))
    plain = collect(tiny(), (x, y), mse, optimizer=None)
    net = tiny()
    net.hybridize(static_alloc=True)
    net(x)  # trace the graph; collect keeps it
    graph = net._cached_op
    hybrid = collect(net, (x, y), mse)
    assert [(o.layer, o.kind, o.hist) for o in plain] == [(o.layer, o.kind, o.hist) for o in hybrid]
    assert net._active and net._cached_op is graph


def test_steps_merge_into_one_observation_per_layer_and_kind():
    model = tiny()
    x = mx.nd.random.normal(shape=(16, 8))
    obs = collect(model, (x, mx.nd.zeros((16, 4))), mse, steps=3,
                  optimizer=gluon.Trainer(model.collect_params(), "sgd", {"learning_rate": 0.1}))  # fmt: skip
    pairs = [(o.layer, o.kind) for o in obs]
    assert len(pairs) == len(set(pairs))
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert table["0", "output"].total == 3 * 16 * 32
    assert table["0", "weight"].total == table["0", "update_ratio"].total == 3 * (8 * 32 + 32)


def test_layer_names_follow_the_paths_of_child_names():
    class Model(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.embed = self.params.get("embed", shape=(10, 8))  # owned by a block with children
                self.block = gluon.nn.HybridSequential()
                self.block.add(gluon.nn.Dense(8, in_units=8, flatten=False, activation="tanh"))
                self.block.add(gluon.nn.GELU())
                self.head = gluon.nn.Dense(10, in_units=8, flatten=False, use_bias=False)
                self.tied = gluon.nn.Dense(10, in_units=8, flatten=False, use_bias=False,
                                           params=self.head.params)  # fmt: skip

        def hybrid_forward(self, F, ids, embed):
            return self.head(self.block(F.Embedding(ids, embed, input_dim=10, output_dim=8)))

    model = Model()
    model.initialize()
    ids = mx.nd.array(np.random.default_rng(0).integers(0, 10, (4, 5)))

    def ce(out, y):
        return gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)(out, y).mean()

    obs = collect(model, (ids, ids), ce)
    layers = list(dict.fromkeys(o.layer for o in obs))
    assert layers == ["embed", "block.0", "block.1", "head"]  # Dense with its activation: one layer
    table = {(o.layer, o.kind): o.hist for o in obs}
    assert ("embed", "output") not in table and table["embed", "grad_weight"].zeros > 0  # rows not looked up
    assert table["head", "weight"].total == 80  # the tied weight once
    assert set(o.kind for o in obs) <= set(KINDS)

    single = gluon.nn.Dense(1, in_units=3)
    single.initialize()
    names = {o.layer for o in collect(single, mx.nd.ones((5, 3)), lambda out, x: (out**2).mean())}
    assert names == {"Dense"}


def test_update_ratios_of_sgd_are_the_applied_update_over_the_weight():
    model = tiny()
    rng = np.random.default_rng(5)
    x, y = mx.nd.array(rng.standard_normal((64, 8))), mx.nd.array(rng.standard_normal((64, 4)))
    sgd = gluon.Trainer(model.collect_params(), "sgd", {"learning_rate": 0.1})
    w0 = {n: p.data().asnumpy() for n, p in model.collect_params().items()}
    table = {(o.layer, o.kind): o.hist for o in collect(model, (x, y), mse, optimizer=sgd)}

    with float32_operators():  # the same step by hand
        with autograd.record():
            loss = mse(model(x), y)
        loss.backward()
        sgd.step(1)
    params = model.collect_params()
    for layer, block in (("0", model[0]), ("2", model[2])):
        names = [block.weight.name, block.bias.name]
        applied = [update_ratio_histogram(params[n].data().asnumpy() - w0[n], w0[n]) for n in names]
        assert table[layer, "update_ratio"] == applied[0].merge(applied[1])
        ideal = [update_ratio_histogram(np.float32(0.1) * params[n].grad().asnumpy(), w0[n]) for n in names]
        ideal = ideal[0].merge(ideal[1])
        got = table[layer, "update_ratio"]
        assert got.total == ideal.total and got.apart == ideal.apart == {"0": 32, "2": 4}[layer]  # biases
        assert np.abs(np.cumsum(got.counts) - np.cumsum(ideal.counts)).max() <= 0.01 * got.total


@pytest.mark.parametrize("hybridize", [False, True])
def test_lost_updates_are_the_zeros_of_the_update_ratio(hybridize):
    model = tiny()
    if hybridize:
        model.hybridize()
    rng = np.random.default_rng(6)
    x, y = mx.nd.array(rng.standard_normal((64, 8))), mx.nd.array(rng.standard_normal((64, 4)))
    sgd = gluon.Trainer(model.collect_params(), "sgd", {"learning_rate": 3e-7})  # many below half an ulp
    w0 = {n: p.data().asnumpy() for n, p in model.collect_params().items()}
    table = {(o.layer, o.kind): o.hist for o in collect(model, (x, y), mse, optimizer=sgd)}
    with float32_operators():
        with autograd.record():
            loss = mse(model(x), y)
        loss.backward()
        sgd.step(1)
    params = model.collect_params()
    names = [model[0].weight.name, model[0].bias.name]
    applied = [update_ratio_histogram(params[n].data().asnumpy() - w0[n], w0[n]) for n in names]
    got = table["0", "update_ratio"]
    assert got == applied[0].merge(applied[1])
    assert got.zeros > 0 and got.finite_nonzero > 0 and got.apart == 32


def test_nonfinite_outputs_are_observed_not_refused():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=4), gluon.nn.Dense(1, in_units=4))
    net.initialize()
    net[0].weight.set_data(mx.nd.full((4, 4), 3e38))
    table = {(o.layer, o.kind): o.hist for o in collect(net, mx.nd.ones((2, 4)), lambda out, x: out.mean())}
    assert table["0", "output"].nonfinite == 8 and table["1", "output"].nonfinite == 2


def test_batch_forms_gluon_losses_and_a_loss_returned_by_the_model():
    class WithLoss(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.fc = gluon.nn.Dense(1, in_units=3)

        def hybrid_forward(self, F, x, y):
            return F.mean(F.square(self.fc(x) - y))

    model = WithLoss()
    model.initialize()
    x, y = mx.nd.random.normal(shape=(5, 3)), mx.nd.random.normal(shape=(5, 1))
    by_model = collect(model, ((x, y), None))  # model(*inputs); the outputs are the loss
    by_args = collect(model, ((x, y), None), lambda out, _: out)
    assert [(o.layer, o.kind, o.hist) for o in by_model] == [(o.layer, o.kind, o.hist) for o in by_args]
    fc = model.fc
    # a gluon.loss returns one value per sample: collect takes their mean, as mse does
    per_sample = collect(fc, (x, y), gluon.loss.L2Loss())
    halved = collect(fc, (x, y), lambda out, t: (((out - t) ** 2) / 2).mean())
    assert [(o.layer, o.kind, o.hist) for o in per_sample] == [(o.layer, o.kind, o.hist) for o in halved]
    assert len(collect(fc, x, lambda out, batch: (out**2).mean())) == 4  # model(batch), loss_fn(out, batch)


# -- bad input: one clear PolyampError each ---------------------------------------------------------
@pytest.mark.parametrize(
    "case, match",
    [
        (lambda m, b: collect(gluon.nn.Activation("relu"), b, mse), "has no parameters"),
        (lambda m, b: collect(frozen(m), b, mse), r"no parameter with a gradient \(all grad_req='null'\)"),
        (lambda m, b: collect(m, b, mse, steps=0), "steps must be a whole number >= 1, got 0"),
        (lambda m, b: collect(m, b, mse, steps=1.0), "steps must be a whole number"),
        (lambda m, b: collect(m, b, mse, steps=True), "steps must be a whole number"),
        (
            lambda m, b: collect(m, (b[0].asnumpy(), b[1]), mse),
            r"expected mxnet NDArrays, got numpy.ndarray; convert it with mx.nd.array",
        ),
        (lambda m, b: collect(m, b[0].asnumpy(), mse), "expected mxnet NDArrays"),
        (lambda m, b: collect(m, (b[0], b[1], b[1]), mse), r"\(inputs, targets\) pair, got a tuple of 3"),
        (lambda m, b: collect(m, (mx.nd.ones((16, 5)), b[1]), mse), r"forward failed.*\(16, 5\)"),
        (lambda m, b: collect(m, b, lambda out, y: (out - y) ** 2), r"one per sample .*shape \(16, 4\)"),
        (lambda m, b: collect(m, b, lambda out, y: 1.0), "loss NDArray, got builtins.float"),
        (lambda m, b: collect(m, b, lambda out, y: (out > 0).astype("int32").sum()), "got int32 NDArray"),
        (lambda m, b: collect(m, b[0]), r"the model \(loss_fn=None\) must return a scalar"),
        (lambda m, b: collect(m, b, lambda out, y: out.detach().sum()), "does not depend"),
        (lambda m, b: collect(m, b, "mse"), "loss_fn must be callable"),
        (lambda m, b: collect(m, b, mse, optimizer=object()), "optimizer: expected a mxnet.gluon.Trainer"),
        (lambda m, b: collect(m.collect_params(), b, mse), "model: expected a mxnet.gluon.Block"),
        (lambda m, b: collect(uninitialised(), b, mse), "not initialised"),
    ],
)
def test_bad_input_is_one_clear_error(case, match):
    model, batch = tiny(), (mx.nd.random.normal(shape=(16, 8)), mx.nd.random.normal(shape=(16, 4)))
    before = [bits(p.data()) for p in model.collect_params().values()]
    with pytest.raises(PolyampError, match=match):
        case(model, batch)
    assert before == [bits(p.data()) for p in model.collect_params().values()]


def frozen(model):
    model.collect_params().setattr("grad_req", "null")
    return model


def uninitialised():
    net = gluon.nn.Dense(4)  # in_units unknown: initialised at the first forward
    net.initialize()
    return net


@needs_bf16  # amp.init_trainer needs contrib.amp set up
def test_a_trainer_prepared_by_contrib_amp_or_on_a_kvstore_is_refused():
    net = tiny()
    native = gluon.Trainer(net.collect_params(), "sgd")
    mx.contrib.amp.init_trainer(native)
    with pytest.raises(PolyampError, match="contrib.amp.init_trainer"):
        collect(net, mx.nd.ones((2, 8)), lambda out, x: out.mean(), optimizer=native)
    on_kvstore = gluon.Trainer(net.collect_params(), "sgd", kvstore=mx.kv.create("local"))
    with pytest.raises(PolyampError, match=r"kvstore \(local\)"):
        collect(net, mx.nd.ones((2, 8)), lambda out, x: out.mean(), optimizer=on_kvstore)


# -- keep_fp32 under bf16-mixed ---------------------------------------------------------------------
def dense3(hybridize=False):
    mx.random.seed(9)
    net = gluon.nn.HybridSequential()
    net.add(*(gluon.nn.Dense(16, in_units=16) for _ in range(3)))
    net.initialize(mx.init.Xavier())
    if hybridize:
        net.hybridize()
    return net


def output_dtypes(net, x):
    seen = {}
    handles = [block.register_forward_hook(lambda b, _, out, name=name: seen.setdefault(name, out.dtype))
               for name, block in net._children.items()]  # fmt: skip
    net(x)
    for h in handles:
        h.detach()
    return {name: "bfloat16" if np.dtype(d).names else np.dtype(d).name for name, d in seen.items()}


@needs_bf16
def test_a_kept_layer_computes_in_float32_and_the_others_in_bf16():
    x = mx.nd.random.normal(shape=(4, 16))
    net = dense3()
    assert output_dtypes(net, x) == {"0": "bfloat16", "1": "bfloat16", "2": "bfloat16"}  # the default
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", keep_fp32=("1",))
    mp.watch(net)
    assert output_dtypes(net, x) == {"0": "bfloat16", "1": "float32", "2": "bfloat16"}
    # its computation is float32: MXNet's float32 Dense of its input widened, bit for bit
    h0, w, b = net[0](x), net[1].weight.data(), net[1].bias.data()
    with float32_operators():
        want = mx.nd.FullyConnected(h0.astype("float32"), w, b, num_hidden=16).asnumpy()
    assert np.array_equal(net[1](h0).asnumpy(), want)
    bf16 = mx.nd.FullyConnected(h0, w, b, num_hidden=16)  # what contrib.amp computes
    assert not np.array_equal(bf16.astype("float32").asnumpy(), want)
    # gradients flow through it to every layer
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd"))
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), mx.nd.ones((4, 16)))
        with mp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    assert all(float(mx.nd.abs(p.grad()).sum().asscalar()) > 0 for p in net.collect_params().values())
    assert mp.step(trainer, batch_size=4).stepped


@needs_bf16
def test_keep_fp32_in_a_hybridized_model_and_its_removal():
    x = mx.nd.random.normal(shape=(4, 16))
    net = dense3(hybridize=True)
    assert np.dtype(net(x).dtype).names == ("bfloat16",)  # the default, traced
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", keep_fp32=("2",))
    mp.watch(net)  # clears the traced graph: the next call traces the kept layer in float32
    assert net(x).dtype == np.float32
    again = dense3(hybridize=True)
    handles = keep_float32(again, ("2",))
    assert again(x).dtype == np.float32
    for handle in handles:
        handle.remove()
    assert np.dtype(again(x).dtype).names == ("bfloat16",) and "hybrid_forward" not in vars(again[2])


@needs_bf16
def test_keep_fp32_names_the_layers_collect_names():
    class Model(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.proj = self.params.get("proj", shape=(16, 16))  # the model's own: a layer of its own
                self.body = gluon.nn.HybridSequential()
                self.body.add(gluon.nn.Dense(16, in_units=16, activation="relu"))
                self.body.add(gluon.nn.Dense(16, in_units=16))

        def hybrid_forward(self, F, x, proj):
            return self.body(F.FullyConnected(x, proj, no_bias=True, num_hidden=16))

    net = Model()
    net.initialize()
    x = mx.nd.random.normal(shape=(4, 16))
    assert {o.layer for o in collect(net, x, lambda out, x: out.mean())} == {"proj", "body.0", "body.1"}
    seen = []
    net.body[0].register_forward_pre_hook(lambda b, inputs: seen.append(inputs[0].dtype))
    assert np.dtype(net(x).dtype).names == ("bfloat16",) and np.dtype(seen[-1]).names == ("bfloat16",)
    pa.MixedPrecision("bf16-mixed", framework="mxnet", keep_fp32=("proj", "body.1")).watch(net)
    out = net(x)
    assert seen[-1] == np.float32 and out.dtype == np.float32  # the owner's own op, and body.1
    with pytest.raises(PolyampError, match=r"keep_fp32 names 'body\.2', which match no layer.*'body\.0'"):
        pa.MixedPrecision("bf16-mixed", framework="mxnet", keep_fp32=("body.2",)).watch(Model())


def test_keep_fp32_under_the_float32_policy_changes_nothing():
    code = """
import warnings; warnings.simplefilter("ignore")
import mxnet as mx, polyamp as pa
from mxnet import gluon
mp = pa.MixedPrecision("float32", framework="mxnet", keep_fp32=("1",))
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(4, in_units=4), gluon.nn.Dense(4, in_units=4))
net.initialize()
mp.watch(net)
out = net(mx.nd.ones((2, 4)))
print(mx.contrib.amp.amp._amp_initialized, "hybrid_forward" in vars(net[1]), out.dtype.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "float32"]


def test_collect_after_contrib_amp_set_up_by_hand_is_one_clear_error():
    code = """
import warnings; warnings.simplefilter("ignore")
import mxnet as mx
from mxnet import gluon
from mxnet.contrib import amp
amp.init(target_dtype="bfloat16")  # before polyamp.mxnet: its float32 operators are gone
from polyamp.mxnet.doctor import collect
net = gluon.nn.Dense(2, in_units=2)
net.initialize()
try:
    collect(net, mx.nd.ones((2, 2)), lambda out, x: out.mean())
except ValueError as err:
    print(type(err).__name__, err)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("PolyampError contrib.amp.init ran before polyamp.mxnet was imported")


@needs_bf16
def test_keep_fp32_refuses_a_plain_block_it_cannot_cast():
    class Plain(gluon.Block):
        def __init__(self):
            super().__init__()
            with self.name_scope():
                self.w = self.params.get("w", shape=(4, 4))

        def forward(self, x):
            return mx.nd.dot(x, self.w.data())

    net = gluon.nn.Sequential()
    net.add(Plain())
    net.initialize()
    with pytest.raises(UnsupportedError, match="keep_fp32 names '0', a Plain .*make it a HybridBlock"):
        pa.MixedPrecision("bf16-mixed", framework="mxnet", keep_fp32=("0",)).watch(net)


def test_fp16_and_bf16_arrays_are_widened_exactly(path):
    x = np.clip(wide(3000, "float32", seed=7), -400, 400)
    for dtype in ("float16", bfloat16):
        a = nd(x, dtype)
        assert histogram(a) == reference(a)
    with pytest.raises(PolyampError, match="cannot bin a int32 NDArray"):
        histogram(mx.nd.ones((3,), dtype="int32"))


def test_a_recipe_measures_only_what_it_would_quantize():
    """recipe:mxfp8's rows: each Dense's weight (not its bias) and output gradient, and the outputs that
    are a Dense's input; a block format measures every tapped tensor."""
    from polyamp.doctor.blocks import measure, parse

    mx.random.seed(4)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(16, in_units=8), gluon.nn.LayerNorm(in_channels=16), gluon.nn.Activation("tanh"),
            gluon.nn.Dense(4, in_units=16))  # fmt: skip
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(0)
    batch = tuple(mx.nd.array(rng.standard_normal(s).astype(np.float32)) for s in ((6, 8), (6, 4)))
    obs = collect(net, batch, gluon.loss.L2Loss(), measure=(parse("recipe:mxfp8"), parse("mxfp8_e4m3")))
    recipe = {(o.layer, o.kind) for o in obs if "recipe:mxfp8" in o.measured}
    assert recipe == {("0", "weight"), ("0", "grad_output"), ("3", "weight"), ("3", "grad_output"),
                      ("2", "output")}  # fmt: skip
    assert {(o.layer, o.kind) for o in obs if "mxfp8_e4m3" in o.measured} == {
        (o.layer, o.kind) for o in obs if o.kind != "update_ratio"}
    head = next(o for o in obs if (o.layer, o.kind) == ("3", "weight"))
    want = measure(net[3].weight.data().asnumpy(), parse("recipe:mxfp8").casts["weight"]).to_json()
    assert head.measured["recipe:mxfp8"].to_json() == want  # (out, in): blocks along in; the bias not
