"""The MXNet backend end to end (run in .venv-mxnet), against the real mxnet.contrib.amp.

MXNet's AMP is process-wide: this module sets up bf16-mixed once, before any network is built;
what needs another process state (float32, a network built first, amp.init called by hand) runs
in a fresh subprocess. What every front end must do (fault injection, skip agreement, resume, bad
input, every policy skipping) is tests/test_contract.py, which runs here too.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from frameworks import require

import polyamp as pa
from polyamp import NonFiniteError, PolyampError, UnsupportedError

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    mx = require("mxnet")
from mxnet import autograd, gluon  # noqa: E402
from mxnet.contrib import amp  # noqa: E402
from mxnet_caps import BF16_UNSUPPORTED, bf16_or_none, needs_bf16  # noqa: E402

MP = bf16_or_none("bf16-mixed")  # amp.init, before any network exists (None: this CPU computes no bf16)
ROOT = Path(__file__).parents[1]
L2 = gluon.loss.L2Loss()
pytestmark = [
    pytest.mark.filterwarnings("ignore:the loss scale fell below 1:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning"),  # inside mxnet
]


def build(seed=0, hybridize=True, ctx=None, grad_req="write", activation="relu"):
    """Dense(8->16, relu) -> Dense(1), weights from a numpy seed (the same in every process)."""
    rng = np.random.default_rng(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation=activation, in_units=8), gluon.nn.Dense(1, in_units=16))
    net.initialize(ctx=ctx or mx.cpu())
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)))
        p.grad_req = grad_req
    if hybridize:
        net.hybridize()
    return net


def batch(i, size=32):
    rng = np.random.default_rng(1000 + i)
    x = rng.standard_normal((size, 8)).astype(np.float32)
    return mx.nd.array(x), mx.nd.array(np.sin(x.sum(1, keepdims=True)))


def params_of(net):
    return [p.data().asnumpy().copy() for p in net.collect_params().values()]


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def backward(mp, net, trainer, x, y):
    with autograd.record():
        loss = L2(net(x), y)
        with mp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    return loss


def is_bf16(arr):
    return np.dtype(arr.dtype).names == ("bfloat16",)


def run_python(code, *args, python=sys.executable, env=None):
    out = subprocess.run([python, "-c", code, *map(str, args)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env={**os.environ, **(env or {})})  # fmt: skip
    return out


# -- the policy ------------------------------------------------------------------------------------
@needs_bf16
@pytest.mark.parametrize("hybridize", [False, True])
def test_dense_layers_run_in_bf16_and_the_loss_in_fp32(hybridize):
    net = build(hybridize=hybridize)
    x, y = batch(0)
    with MP.autocast():  # MXNet's AMP is already on for the process: this only checks it
        out = net(x)
    loss = L2(out, y)
    assert is_bf16(out) and np.dtype(loss.dtype) == np.float32
    assert net[0].weight.data().dtype == np.float32  # parameters stay float32
    assert MP.current_scale == 1.0 and isinstance(MP.loss_scale, pa.NoLossScale)


# -- against contrib.amp ------------------------------------------------------------------------
@needs_bf16
def test_bf16_steps_are_bit_identical_to_contrib_amp_on_the_same_overflow_pattern():
    """Native: amp.init_trainer + amp.scale_loss + trainer.step, contrib's LossScaler. polyamp: the
    mxnet preset. Same weights, data and injected overflows: same skips, scales and weights."""
    native, ours = build(), build()
    t_native = gluon.Trainer(
        native.collect_params(), "adam", {"learning_rate": 1e-2}, update_on_kvstore=False
    )
    amp.init_trainer(t_native)
    t_native._amp_loss_scaler._scale_seq_len = 4  # a short growth window, to exercise growth
    ls = dataclasses.replace(pa.DynamicLossScale.preset("mxnet"), growth_interval=4)
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=ls)
    t_ours = mp.trainer(gluon.Trainer(ours.collect_params(), "adam", {"learning_rate": 1e-2}))
    overflow = {2, 3, 9, 10, 11, 18}
    grew = False
    for step in range(30):
        x, y = batch(step)
        scale_used = t_native._amp_loss_scaler.loss_scale
        assert mp.current_scale == scale_used  # the scale this step's loss is multiplied by
        with autograd.record():
            loss = L2(native(x), y)
            with amp.scale_loss(loss, t_native) as scaled:
                autograd.backward(scaled)
        if step in overflow:
            native[0].weight.grad()[0, 0] = np.inf
        before = params_of(native)
        t_native.step(x.shape[0])
        native_stepped = not same(before, params_of(native))

        backward(mp, ours, t_ours, x, y)
        if step in overflow:
            ours[0].weight.grad()[0, 0] = np.inf
        result = mp.step(t_ours, x.shape[0])

        assert result.stepped == native_stepped == (step not in overflow)
        assert result.scale == t_native._amp_loss_scaler.loss_scale
        assert same(params_of(native), params_of(ours)), step
        grew = grew or result.scale > scale_used
    assert grew and mp.state.skipped == len(overflow)


def loss_scaler_run(flags, window=None, start=None):
    """Drive contrib.amp's real LossScaler.has_overflow with a finite or inf gradient."""
    param = gluon.Parameter("w", shape=(4,))
    param.initialize()
    scaler = amp.loss_scaler.LossScaler()
    if window:
        scaler._scale_seq_len = window
    if start:
        scaler._loss_scale = scaler._next_loss_scale = start
    scales = []
    for finite in flags:
        param.grad()[:] = 1.0 if finite else np.inf
        assert scaler.has_overflow([param]) == (not finite)
        scales.append(scaler.loss_scale)
    return scales


def scales_of(ls, flags):
    """``state.scale`` after each ``ls.update``."""
    state, scales = ls.init(), []
    for finite in flags:
        state = ls.update(state, finite)
        scales.append(state.scale)
    return scales


def preset_run(flags, **changes):
    return scales_of(dataclasses.replace(pa.DynamicLossScale.preset("mxnet"), **changes), flags)


def test_mxnet_preset_equals_the_real_loss_scaler_at_its_defaults():
    rng = np.random.default_rng(3)
    flags = [False] * 3 + list(rng.random(900) > 0.01) + [True] * 2000 + [False] + [True] * 2100
    expected = loss_scaler_run(flags)
    assert preset_run(flags) == expected
    growths = [i for i in range(1, len(flags)) if expected[i] > expected[i - 1]]
    assert len(growths) == 2  # each 2000 clean steps after an overflow, one step late


def test_mxnet_preset_equals_the_real_loss_scaler_at_the_cap_and_below_one():
    flags = [True] * 20 + [False] + [True] * 9 + [False] * 3 + [True] * 7
    expected = loss_scaler_run(flags, window=3, start=2.0**22)
    assert preset_run(flags, growth_interval=3, init_scale=2.0**22) == expected
    assert max(expected) == 2.0**24  # capped at contrib.amp's 2^24
    flags = [False] * 20 + [True] * 4
    expected = loss_scaler_run(flags, window=3)
    assert preset_run(flags, growth_interval=3) == expected and min(expected) == 2.0**-4  # no floor


# -- loss-output ops (SoftmaxOutput, LinearRegressionOutput, ...) ---------------------------------
# contrib.amp makes these ops multiply their gradient by a process-wide loss scale when they run
# (they ignore the gradient flowing into their output, so scaling the loss cannot reach them).
LOSS_OUTPUT_STEP = """
import json, sys, warnings
warnings.simplefilter("ignore")
import numpy as np
mode = sys.argv[1]
if mode == "polyamp":
    import polyamp as pa
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet")
import mxnet as mx
from mxnet import autograd, gluon
from mxnet.contrib import amp
if mode == "native":
    amp.init(target_dtype="bfloat16")
result = {}
for op in ("SoftmaxOutput", "LinearRegressionOutput"):
    rng = np.random.default_rng(0)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)))
    x = mx.nd.array(rng.standard_normal((16, 4)).astype(np.float32))
    label = mx.nd.array(rng.integers(0, 3, 16) if op == "SoftmaxOutput" else rng.standard_normal((16, 3)))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, update_on_kvstore=False)
    if mode == "polyamp":
        trainer = mp.trainer(trainer)
    elif mode == "native":
        amp.init_trainer(trainer)
    with autograd.record():
        out = getattr(mx.nd, op)(net(x), label)
        if mode == "polyamp":
            with mp.scale_loss(out, trainer) as scaled:
                autograd.backward(scaled)
        elif mode == "native":
            with amp.scale_loss(out, trainer) as scaled:
                autograd.backward(scaled)
        else:
            out.backward()
    before = net.weight.data().asnumpy()
    mp.step(trainer, 16) if mode == "polyamp" else trainer.step(16)
    result[op] = [before.ravel().tolist(), net.weight.data().asnumpy().ravel().tolist()]
print(json.dumps(result))
"""


@needs_bf16
def test_loss_output_ops_take_one_sgd_step_like_native_contrib_amp_and_fp32():
    """bf16-mixed (no loss scale): the ops must not multiply by contrib.amp's 65536. Native
    contrib.amp scales by 2^16 and unscales exactly, so its weights are bit-identical."""

    def run(mode):
        out = run_python(LOSS_OUTPUT_STEP, mode)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    ours, native, fp32 = run("polyamp"), run("native"), run("fp32")
    for op in ours:
        assert ours[op] == native[op], op
        w0, w1 = (np.array(w) for w in ours[op])
        update = np.array(fp32[op][1]) - w0  # bf16 compute: 2^-8 relative on each gradient
        np.testing.assert_allclose(w1 - w0, update, rtol=0, atol=0.02 * np.abs(update).max(), err_msg=op)


# each op and a gluon.loss with the same gradient (its "twin")
TWINS = {
    "LinearRegressionOutput": gluon.loss.L2Loss(),  # (out - label) / outputs
    "SoftmaxOutput": gluon.loss.SoftmaxCrossEntropyLoss(),  # softmax(out) - onehot(label)
}


def loss_output_run(op, twin, steps=6, overflow=1):
    """Dense(4->3) trained with ``op`` (or its twin) under bf16-mixed and loss_scale='mxnet', an
    inf injected on step ``overflow``; the weights and the scale after each step."""
    rng = np.random.default_rng(5)
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(-0.5, 0.5, p.shape).astype(np.float32)))
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale="mxnet")
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2}))
    x = mx.nd.array(rng.standard_normal((16, 4)).astype(np.float32))
    label = mx.nd.array(rng.integers(0, 3, 16) if op == "SoftmaxOutput" else rng.standard_normal((16, 3)))
    weights, scales = [], []
    for step in range(steps):
        with autograd.record():
            out = net(x)
            loss = TWINS[op](out, label) if twin else getattr(mx.nd, op)(out, label)
            with mp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        if step == overflow:
            net.bias.grad()[1] = np.inf
        result = mp.step(trainer, 16)
        assert result.stepped == (step != overflow)
        weights.append(net.weight.data().asnumpy().copy())
        scales.append(result.scale)
    return weights, scales


@needs_bf16
@pytest.mark.parametrize("op", list(TWINS))
def test_loss_output_ops_follow_the_mxnet_scale_after_an_overflow(op):
    """loss_scale='mxnet' halves the scale one step after the overflow; the op must halve too."""
    with_op, op_scales = loss_output_run(op, twin=False)
    twin, twin_scales = loss_output_run(op, twin=True)
    assert op_scales == twin_scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15, 2.0**15]
    for step, (a, b) in enumerate(zip(with_op, twin)):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-3, err_msg=f"step {step}")


@needs_bf16
def test_a_loss_output_op_in_a_hybridized_block_is_refused_under_a_loss_scale():
    """In a hybridized block the op's grad_scale is fixed in the cached graph (contrib.amp does
    not scale it there at all): it cannot follow a loss scale, but runs unscaled without one."""

    class Regression(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            self.dense = gluon.nn.Dense(3, in_units=4)

        def hybrid_forward(self, F, x, label):
            return F.LinearRegressionOutput(self.dense(x), label)

    x, label = mx.nd.ones((2, 4)), mx.nd.zeros((2, 3))
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale="dynamic")
    net = Regression()
    net.initialize()
    net.hybridize()
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd"))
    with autograd.record(), pytest.raises(
        UnsupportedError, match=r"LinearRegressionOutput in a hybridized block.*scale 65536"
    ):
        net(x, label)
    plain = Regression()
    plain.initialize()
    plain.hybridize()
    trainer = MP.trainer(gluon.Trainer(plain.collect_params(), "sgd"))  # bf16-mixed: no loss scale
    with autograd.record():
        with MP.scale_loss(plain(x, label), trainer) as scaled:
            autograd.backward(scaled)
    assert MP.step(trainer, 2).stepped


@needs_bf16
def test_a_loss_output_op_run_under_another_mixed_precision_is_refused():
    """The ops read one process-wide scale when they run: the MixedPrecision used last's."""
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize()
    x, label = mx.nd.ones((2, 4)), mx.nd.zeros((2, 3))
    mine = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=64.0)
    trainer = mine.trainer(gluon.Trainer(net.collect_params(), "sgd"))
    other = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=8.0)  # used last: the ops follow it
    with autograd.record():
        out = mx.nd.LinearRegressionOutput(net(x), label)
        with pytest.raises(PolyampError, match=r"multiplied its gradient by 8 .* scales by 64"):
            mine.scale_loss(out, trainer)
    with autograd.record():  # mine.scale_loss made mine the one the ops follow
        out = mx.nd.LinearRegressionOutput(net(x), label)
        with mine.scale_loss(out, trainer) as scaled:
            autograd.backward(scaled)
    assert mine.step(trainer, 2).stepped
    assert other.current_scale == 8.0


class Affine(gluon.HybridBlock):
    """out = x * w + b, elementwise (no FullyConnected: runs in float32 under contrib.amp on any CPU)."""

    def __init__(self, units=3):
        super().__init__()
        self.w = self.params.get("w", shape=(1, units))
        self.b = self.params.get("b", shape=(1, units))

    def hybrid_forward(self, F, x, w, b):
        return F.broadcast_add(F.broadcast_mul(x, w), b)


def init_first_trainer(trainer):
    """``amp.init_trainer(trainer)`` as the process's first: contrib.amp's process-wide scaler, the one its
    loss-output ops read, goes to the first trainer only and keeps what that trainer's steps did to it, so
    a test that needs the ops to read its own trainer's scale resets it (at 2^16) and hands it over."""
    amp.amp._loss_scaler.__init__()
    amp.amp._amp_loss_scale_initialized = False
    amp.init_trainer(trainer)
    assert trainer._amp_loss_scaler is amp.amp._loss_scaler


def native_loss_output_run(op, twin, steps=3):
    """Affine(3) trained by a native contrib.amp trainer (amp.init_trainer, amp.scale_loss, trainer.step)
    with ``op`` (or its gluon.loss twin) in this process, where polyamp's MP exists; the weights after each
    step."""
    rng = np.random.default_rng(6)
    net = Affine()
    net.initialize()
    for p in net.collect_params().values():
        p.set_data(mx.nd.array(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5}, update_on_kvstore=False)
    init_first_trainer(trainer)
    x = mx.nd.array(rng.standard_normal((16, 3)).astype(np.float32))
    label = mx.nd.array(rng.integers(0, 3, 16) if op == "SoftmaxOutput" else rng.standard_normal((16, 3)))
    weights = []
    for _ in range(steps):
        with autograd.record():
            out = net(x)
            loss = TWINS[op](out, label) if twin else getattr(mx.nd, op)(out, label)
            with amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(16)
        weights.append(net.w.data().asnumpy().copy())
    return weights


@needs_bf16
@pytest.mark.parametrize("op", list(TWINS))
def test_a_native_contrib_amp_trainer_beside_a_mixed_precision_unscales_loss_output_gradients_once(op):
    """Issue 29: polyamp's MP exists, a native contrib.amp trainer trains with a loss-output op. The op
    must multiply its gradient by contrib.amp's scale (2^16), which the trainer divides out, as its
    gluon.loss twin's is (it took polyamp's 1 instead: updates 2^16 too small)."""
    with_op, twin = native_loss_output_run(op, twin=False), native_loss_output_run(op, twin=True)
    for step, (a, b) in enumerate(zip(with_op, twin)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {step}")
    assert not np.allclose(with_op[-1], with_op[0])  # it trained


@needs_bf16
def test_polyamp_does_not_leave_its_scale_in_contrib_amps_loss_scaler():
    """A MixedPrecision's op call sets contrib.amp's process-wide scaler for that call only: a native
    trainer that owns the scaler keeps its own scale."""
    net = Affine()
    net.initialize(mx.init.One())  # out = x * 1 + 1 = 2 on ones
    mine = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=8.0)
    trainer = mine.trainer(gluon.Trainer(net.collect_params(), "sgd"))
    before = amp.amp._loss_scaler.loss_scale
    x, label = mx.nd.ones((2, 3)), mx.nd.zeros((2, 3))
    with autograd.record():
        out = mx.nd.LinearRegressionOutput(net(x), label)
        with mine.scale_loss(out, trainer) as scaled:
            autograd.backward(scaled)
    assert before != 8.0 and amp.amp._loss_scaler.loss_scale == before
    # dL/dw = sum over the batch of (out - label) * 8 / 3 outputs
    np.testing.assert_allclose(net.w.grad().asnumpy(), np.full((1, 3), 2 * 2 * 8.0 / 3), rtol=1e-6)


@needs_bf16
def test_native_and_polyamp_trainers_taking_turns_on_loss_output_ops_are_refused_then_follow():
    """The ops follow whichever was used last: a forward pass that ran under the other's scale is refused,
    at amp.scale_loss and at mp.scale_loss, and the ops follow the one refusing from then on."""
    x, label = mx.nd.ones((2, 3)), mx.nd.zeros((2, 3))
    native_net, polyamp_net = Affine(), Affine()
    native_net.initialize()
    polyamp_net.initialize()
    native = gluon.Trainer(native_net.collect_params(), "sgd", update_on_kvstore=False)
    init_first_trainer(native)
    mine = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=4.0)  # the ops follow it
    ours = mine.trainer(gluon.Trainer(polyamp_net.collect_params(), "sgd"))
    for attempt in range(2):
        with autograd.record():
            out = mx.nd.LinearRegressionOutput(native_net(x), label)
            if attempt == 0:
                with pytest.raises(PolyampError, match=r"by 4, the scale of the polyamp MixedPrecision.*"
                                                       r"run the forward pass again"):
                    amp.scale_loss(out, native)
                continue
            with amp.scale_loss(out, native) as scaled:
                autograd.backward(scaled)
    native.step(2)
    with autograd.record():  # contrib.amp was used last
        out = mx.nd.LinearRegressionOutput(polyamp_net(x), label)
        with pytest.raises(PolyampError, match=r"contrib.amp's loss scale 65536, not this MixedPrecision's"):
            mine.scale_loss(out, ours)
    with autograd.record():
        out = mx.nd.LinearRegressionOutput(polyamp_net(x), label)
        with mine.scale_loss(out, ours) as scaled:
            autograd.backward(scaled)
    assert mine.step(ours, 2).stepped
    with pytest.raises(PolyampError, match=r"amp.init_trainer got a trainer that mp.trainer\(\) prepared"):
        amp.init_trainer(ours)


@needs_bf16
def test_nan_loss_every_step_raises_after_max_consecutive_skips():
    net = build()
    mp = pa.MixedPrecision(
        "bf16-mixed", framework="mxnet", loss_scale=pa.NoLossScale(max_consecutive_skips=5)
    )
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    x, y = batch(0)
    x[0, 0] = np.nan
    for _ in range(4):
        backward(mp, net, trainer, x, y)
        assert not mp.step(trainer, 32).stepped
    backward(mp, net, trainer, x, y)
    with pytest.raises(NonFiniteError, match=r"5 consecutive steps.*dense\d+_weight"):
        mp.step(trainer, 32)


@needs_bf16
def test_the_guard_costs_no_more_than_the_scalers_check(tmp_path):
    """Counted by MXNet's profiler over one step each, beyond the unguarded step (guard=False):
    the guard queues one all_finite per gradient into one flag and syncs once; the loss scaler's
    check does the same plus one in-place unscale per gradient. No cast, copy or per-gradient sync."""
    x, y = batch(0)
    BOOKKEEPING = ("DeleteVariable", "WaitForVar")  # the engine freeing an array, waiting for one

    def extra_work(**kwargs):
        net = build()
        mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", **kwargs)
        trainer = mp.trainer(gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}))
        for profiled in (False, True):  # the first update creates Adam's state
            backward(mp, net, trainer, x, y)
            mx.nd.waitall()
            mx.profiler.set_state("run" if profiled else "stop")
            assert mp.step(trainer, 32).stepped
            mx.nd.waitall()
        mx.profiler.set_state("stop")
        stats = json.loads(mx.profiler.dumps(reset=True, format="json"))["Time"]
        syncs = stats["MXNET_C_API"].get("MXNDArraySyncCopyToCPU", {"Count": 0})["Count"]
        ops = {op: s["Count"] for op, s in stats["operator"].items() if op not in BOOKKEEPING}
        return Counter(ops), syncs

    mx.profiler.set_config(profile_imperative=True, profile_api=True, aggregate_stats=True,
                           filename=str(tmp_path / "profile.json"))  # fmt: skip
    unguarded, no_sync = extra_work(guard=False)
    guarded, guard_syncs = extra_work()
    scaled, scaler_syncs = extra_work(loss_scale="mxnet")
    grads = len(params_of(build()))  # one gradient per parameter, one device
    assert no_sync == 0 and guard_syncs == scaler_syncs == 1
    assert not unguarded - guarded and guarded - unguarded == Counter(all_finite=grads, _ones=1)
    assert scaled - unguarded == Counter(all_finite=grads, _ones=1, _mul_scalar=grads)


# -- the rest of the step --------------------------------------------------------------------------
@needs_bf16
def test_clipping_reports_the_unscaled_norm_and_clips():
    net, reference = build(), build()
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale=1024.0)
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    x, y = batch(0)
    backward(mp, net, trainer, x, y)
    with autograd.record():
        L2(reference(x), y).backward()
    expected = np.sqrt(sum((p.grad().asnumpy() ** 2).sum() for p in reference.collect_params().values()))
    grads_before = [p.grad() for p in net.collect_params().values()]
    result = mp.step(trainer, 32, clip_grad_norm=1e-3)
    assert result.stepped and result.grad_norm == pytest.approx(expected, rel=1e-5)
    total = np.sqrt(sum((g.asnumpy() ** 2).sum() for g in grads_before))
    assert total == pytest.approx(1e-3, rel=1e-4)


@needs_bf16
def test_gradient_accumulation_is_refused_because_mxnet_bf16_amp_drops_it():
    """MXNet 1.9 with bf16 AMP leaves gradients at 0 when grad_req='add': polyamp says so."""
    net = build(grad_req="add")
    x, y = batch(0)
    with autograd.record():
        L2(net(x), y).backward()
    assert all(not p.grad().asnumpy().any() for p in net.collect_params().values())  # MXNet's bug
    with pytest.raises(
        UnsupportedError, match=r"drops gradients accumulated with grad_req='add'.*dense\d+_weight"
    ):
        MP.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    net = build()
    trainer = MP.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    net[1].bias.grad_req = "add"
    backward(MP, net, trainer, x, y)
    with pytest.raises(UnsupportedError, match=r"grad_req='add' \(they stay 0; parameters dense\d+_bias\)"):
        MP.step(trainer, 32)


@needs_bf16
def test_several_trainers_step_or_skip_together():
    net = build()
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet")
    first = mp.trainer(gluon.Trainer(net[0].collect_params(), "sgd", {"learning_rate": 0.1}))
    second = mp.trainer(gluon.Trainer(net[1].collect_params(), "adam", {"learning_rate": 0.1}))
    x, y = batch(0)
    backward(mp, net, first, x, y)
    net[1].bias.grad()[0] = np.inf
    before = params_of(net)
    result = mp.step([first, second], 32)
    assert not result.stepped and result.nonfinite == (net[1].bias.name,)
    assert same(before, params_of(net))
    backward(mp, net, first, x, y)
    assert mp.step([first, second], 32).stepped
    assert not any(np.array_equal(a, b) for a, b in zip(before, params_of(net)))


@needs_bf16
def test_two_devices_are_all_reduced_before_the_check_and_update_off_the_kvstore():
    """Two CPU contexts hold a copy each; the trainer's kvstore sums their gradients, so an inf in
    one copy skips the step on both, and a clean step equals one device on the whole batch."""
    ctx = [mx.cpu(0), mx.cpu(1)]
    net, single = build(ctx=ctx), build()
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet")
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    t_single = mp.trainer(gluon.Trainer(single.collect_params(), "sgd", {"learning_rate": 0.1}))
    x, y = batch(0)

    def copies():
        return [d.asnumpy() for p in net.collect_params().values() for d in p.list_data()]

    def backward_split():
        xs, ys = gluon.utils.split_and_load(x, ctx), gluon.utils.split_and_load(y, ctx)
        with autograd.record():
            losses = [L2(net(a), b) for a, b in zip(xs, ys)]
            with mp.scale_loss(losses, trainer) as scaled:
                autograd.backward(scaled)

    backward_split()
    net[0].weight.list_grad()[1][0, 0] = np.inf  # only the copy on cpu(1)
    before = copies()
    assert not mp.step(trainer, 32).stepped and same(before, copies())
    backward_split()
    assert mp.step(trainer, 32).stepped
    assert trainer._kvstore is not None and trainer._update_on_kvstore is False
    backward(mp, single, t_single, x, y)
    mp.step(t_single, 32)
    for p, q, w0 in zip(net.collect_params().values(), single.collect_params().values(), before[::2]):
        a, b = (d.asnumpy() for d in p.list_data())
        assert np.array_equal(a, b)
        # bf16 rounds each device's partial weight gradient (2^-9 relative) before the sum
        update, expected = a - w0, q.data().asnumpy() - w0
        np.testing.assert_allclose(update, expected, rtol=0, atol=0.02 * np.abs(expected).max())


@needs_bf16
def test_two_devices_are_all_reduced_once_per_step():
    """Without a loss scale a plain backward may feed mp.step; its gradients must be summed over
    the devices once, as after mp.scale_loss (a second all-reduce would double them)."""
    ctx = [mx.cpu(0), mx.cpu(1)]
    x, y = batch(0)
    xs, ys = gluon.utils.split_and_load(x, ctx), gluon.utils.split_and_load(y, ctx)
    summed = []
    for through_scale_loss in (True, False):
        net = build(ctx=ctx)
        trainer = MP.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.0}))
        with autograd.record():
            losses = [L2(net(a), b) for a, b in zip(xs, ys)]
            if through_scale_loss:
                with MP.scale_loss(losses, trainer) as scaled:
                    autograd.backward(scaled)
            else:
                autograd.backward(losses)
        assert MP.step(trainer, 32).stepped
        summed.append([g.asnumpy() for p in net.collect_params().values() for g in p.list_grad()])
    assert same(*summed)

@needs_bf16
def test_debug_names_the_first_layer_with_a_nonfinite_output():
    net = build(hybridize=False, activation="tanh")  # relu would turn the NaN into 0
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", debug=True)
    mp.watch(net)
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    x, y = batch(0)
    x[3, 2] = np.nan
    backward(mp, net, trainer, x, y)
    result = mp.step(trainer, 32)
    assert not result.stepped and result.origin.startswith(f"forward output of {net[0].name}")
    assert set(result.nonfinite) >= {net[0].weight.name, net[1].weight.name}


# -- bad input: one clear error each, nothing changed ----------------------------------------------
def test_fp16_on_cpu_is_unsupported_with_the_reason():
    """The CPU path it names is bf16-mixed where MXNet computes bf16 here, float32 where it does not."""
    instead = "'float32' \\(this CPU computes no bfloat16 either\\)" if BF16_UNSUPPORTED else "'bf16-mixed'"
    with pytest.raises(UnsupportedError, match=r"FullyConnected exists only in the cuDNN .*use " + instead):
        pa.MixedPrecision("fp16-mixed", framework="mxnet")
    with pytest.raises(UnsupportedError, match="cuDNN"):
        pa.MixedPrecision("fp16-mixed", framework="mxnet", device="cpu")


BF16_PROBE = """
import warnings
warnings.simplefilter("ignore")
import mxnet as mx
from mxnet import gluon
from mxnet.contrib import amp
amp.init(target_dtype="bfloat16")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(4, in_units=3), gluon.nn.Conv1D(2, 3, in_channels=1))
net.initialize()
print("dense", float(mx.nd.amp_cast(net[0](mx.nd.ones((2, 3))), dtype="float32").sum().asscalar()))
print("conv", float(mx.nd.amp_cast(net[1](mx.nd.ones((1, 1, 5))), dtype="float32").sum().asscalar()))
"""


def test_bf16_is_refused_exactly_where_the_probe_finds_mxnet_cannot_compute_it():
    """The probe's verdict (a tiny bf16 FullyConnected + Convolution in a child process) against a Gluon
    Dense and Conv1D under contrib.amp's bf16 in another one; where unsupported, bf16-mixed and a recipe
    are one UnsupportedError naming the reason and the way out, a float32-compute recipe is not."""
    from polyamp.mxnet.capability import bf16_unsupported

    assert bf16_unsupported() == BF16_UNSUPPORTED  # cached: one probe per process
    direct = run_python(BF16_PROBE)
    assert (direct.returncode == 0 and "conv" in direct.stdout) == (BF16_UNSUPPORTED is None), direct.stderr
    if BF16_UNSUPPORTED is None:
        assert MP is not None and MP.policy.compute_dtype == "bfloat16"
        assert pa.MixedPrecision("fp8-tensorwise", framework="mxnet").recipe.name == "fp8-tensorwise"
        return
    assert re.search("primitive descriptor|Unsupported type", direct.stderr), direct.stderr[-800:]
    words = (r"computes in bfloat16, and MXNet's oneDNN computes no bfloat16 on this CPU: MXNet 1.9.1's bf16 "
             r"FullyConnected and Convolution kernels need AVX-512 \(avx512_core, or avx512_bf16\), and this "
             r"CPU .*Use 'float32' \(recipes: compute_dtype='fp32'\), 'fp16-mixed' on a GPU with cuDNN")
    for spec, label in (("bf16-mixed", "policy 'bf16-mixed'"), ("fp8-tensorwise", "recipe 'fp8-tensorwise'"),
                        ("mxfp8:keep=", "recipe 'mxfp8:keep='")):  # fmt: skip
        with pytest.raises(UnsupportedError, match=re.escape(label) + " " + words):
            pa.MixedPrecision(spec, framework="mxnet")
    assert not amp.amp._amp_initialized  # nothing was set up
    fp32 = pa.MixedPrecision("mxfp8:compute_dtype=fp32", framework="mxnet")
    assert fp32.policy.compute_dtype == "float32" and not amp.amp._amp_initialized


TRUE_POLICY_REASONS = {
    "bfloat16": r"cannot update bfloat16 parameters: its optimizer kernels .* 'Unknown type enum 12'",
    "bf16-true": r"cannot update bfloat16 parameters",
    "float16": r"float16 parameters need float16 FullyConnected, which exists only in the cuDNN",
}


@pytest.mark.parametrize("policy", list(TRUE_POLICY_REASONS))
def test_true_policies_are_refused_with_the_reason(policy):
    """'*-true' means 16-bit parameters, which MXNet 1.9 cannot train here."""
    with pytest.raises(UnsupportedError, match=r"policy '(bf|fp)16-true' keeps the parameters in \w+16: .*"
                       + TRUE_POLICY_REASONS[policy] + r".*use 'bf16-mixed'"):  # fmt: skip
        pa.MixedPrecision(policy, framework="mxnet")


@needs_bf16
def test_mxnet_cannot_update_bfloat16_parameters():
    """The reason bf16-true is refused (asserted, so that a fixed MXNet would show)."""
    bf16 = amp.amp.bfloat16
    for optimizer, options in [("sgd", {}), ("adam", {}), ("sgd", {"multi_precision": True})]:
        net = gluon.nn.Dense(2, in_units=2)
        net.initialize()
        net.cast(bf16)
        trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": 0.1, **options})
        with autograd.record():
            net(mx.nd.ones((4, 2)).astype(bf16)).sum().backward()
        with pytest.raises(mx.base.MXNetError, match="Unknown type enum 12"):
            trainer.step(4)
            mx.nd.waitall()


def test_a_trainer_updating_on_the_kvstore_is_refused():
    net = build()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=True)
    mp = MP or pa.MixedPrecision("float32", framework="mxnet")  # the check is the same under any policy
    with pytest.raises(
        PolyampError, match=r"update_on_kvstore=True.*gluon.Trainer\(\.\.\., update_on_kvstore=False\)"
    ):
        mp.trainer(trainer)
    assert not getattr(trainer, "_polyamp", False) and trainer._kvstore_params["update_on_kvstore"] is True


@needs_bf16
def test_trainer_misuse_is_refused():
    net = build()
    native = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, update_on_kvstore=False)
    amp.init_trainer(native)
    with pytest.raises(PolyampError, match="contrib.amp.init_trainer"):
        MP.trainer(native)
    with pytest.raises(PolyampError, match=r"takes a mxnet.gluon.Trainer, got mxnet.gluon.nn.basic_layers"):
        MP.trainer(net)
    raw = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    x, y = batch(0)
    with pytest.raises(PolyampError, match=r"not prepared: use trainer = mp.trainer"):
        backward(MP, net, raw, x, y)


@needs_bf16
def test_step_misuse_is_refused_and_changes_nothing():
    net = build()
    mp = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale="mxnet")
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}))
    x, y = batch(0)
    with pytest.raises(PolyampError, match="inside autograd.record"):
        mp.scale_loss(L2(net(x), y), trainer)
    backward(mp, net, trainer, x, y)
    grads = [p.grad().asnumpy() for p in net.collect_params().values()]
    before, state = params_of(net), mp.state
    for bad in (None, 0, -3, True):
        with pytest.raises(PolyampError, match=rf"positive number .*got batch_size={bad!r}"):
            mp.step(trainer, bad)
    assert mp.state == state and same(before, params_of(net))
    assert same(grads, [p.grad().asnumpy() for p in net.collect_params().values()])  # still scaled
    assert mp.step(trainer, 32).stepped
    with pytest.raises(PolyampError, match="no parameter has a new gradient"):
        mp.step(trainer, 32)
    with pytest.raises(PolyampError, match="process_group is not used by the mxnet backend"):
        grouped = pa.MixedPrecision("bf16-mixed", framework="mxnet", process_group=object())
        backward(grouped, net, grouped.trainer(gluon.Trainer(net.collect_params(), "sgd")), x, y)
        grouped.step(trainer, 32)


@needs_bf16
def test_float32_in_a_process_running_bf16_amp_is_refused():
    with pytest.raises(PolyampError, match="process-wide .* bfloat16; it cannot be turned off"):
        pa.MixedPrecision("float32", framework="mxnet")


FRESH = """
import sys, warnings
import numpy as np
import polyamp as pa
import mxnet as mx
from mxnet import gluon
from mxnet.contrib import amp
case = sys.argv[1]
def net():
    n = gluon.nn.HybridSequential()
    n.add(gluon.nn.Dense(4, in_units=3))
    n.initialize()
    n.hybridize()
    n(mx.nd.ones((2, 3)))
    return n
try:
    if case == "network-first":
        existing = net()
        pa.MixedPrecision("bf16-mixed", framework="mxnet")
    elif case == "amp-by-hand":
        amp.init(target_dtype="bfloat16")
        pa.MixedPrecision("bf16-mixed", framework="mxnet")
    elif case == "inferred-late":
        mp = pa.MixedPrecision("bf16-mixed")  # framework not named: found from the trainer, too late
        existing = net()
        mp.trainer(gluon.Trainer(existing.collect_params(), "sgd"))
    elif case == "float32":
        mp = pa.MixedPrecision("float32", framework="mxnet")
        existing = net()
        out = existing(mx.nd.ones((2, 3)))
        print("dtype", np.dtype(out.dtype).name, "amp", amp.amp._amp_initialized)
        pa.MixedPrecision("bf16-mixed", framework="mxnet")
except pa.PolyampError as err:
    print(type(err).__name__ + ":", err)
"""


BEFORE_THE_NETWORK = r"MXNet's AMP must be set up before the network is built"
FRESH_CASES = {
    "network-first": BEFORE_THE_NETWORK + r", but 1 Gluon block\(s\).*Create MixedPrecision\('bf16-mixed', "
    r"framework='mxnet'\) first, then build the network",
    "amp-by-hand": r"initialised outside polyamp \(amp.init\); remove that call",
    "inferred-late": BEFORE_THE_NETWORK,
    "float32": r"dtype float32 amp False\nPolyampError: " + BEFORE_THE_NETWORK,
}


@needs_bf16
@pytest.mark.parametrize("case", list(FRESH_CASES))
def test_policy_set_after_the_network_exists_is_one_clear_error(case):
    out = run_python(FRESH, case)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(FRESH_CASES[case], out.stdout, re.S), out.stdout


# -- the example, the compare networks, the core under numpy 1.23 ---------------------------------
def run_example(*args):
    example = str(ROOT / "examples" / "mxnet_amp.py")
    return subprocess.run([sys.executable, example, *args], capture_output=True, text=True, timeout=300)


def test_the_example_refuses_fp16():
    fp16 = run_example("--policy", "fp16-mixed", "--steps", "3")
    assert fp16.returncode == 2 and "unsupported here" in fp16.stdout and "cuDNN" in fp16.stdout


@needs_bf16
def test_example_trains_skips_the_injected_overflows():
    out = run_example("--loss-scale", "mxnet", "--overflow-every", "10", "--steps", "200")
    assert out.returncode == 0, out.stderr[-2000:]
    match = re.search(
        r"ran in bfloat16; loss ([\d.]+) -> ([\d.]+), (\d+) steps skipped, final scale ([\d.e+-]+)",
        out.stdout,
    )
    assert match, out.stdout
    first, last, skipped, scale = match.groups()
    assert float(last) < float(first) / 5 and int(skipped) == 20
    assert float(scale) == 2.0**16 / 2**20  # contrib.amp's scaler halves without a floor


LOSSES = """
import importlib, json, sys
from polyamp.compare.workloads import get_workload
module = importlib.import_module("polyamp.compare." + sys.argv[1])
out = {}
for name in ("mlp", "charlm", "digits"):
    trainer = module.Trainer(get_workload(name, quick=True), sys.argv[2])
    out[name] = [trainer.step(i) for i in range(3)] + [trainer.evaluate()]
print(json.dumps(out))
"""
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"


def losses(python, framework, policy):
    out = run_python(LOSSES, framework, policy, python=python)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def float32_losses():
    """compare/mxnet.py's float32 losses and metric at quick sizes (a process of their own)."""
    return losses(sys.executable, "mxnet", "float32")


def test_compare_builds_the_same_networks_as_torch(float32_losses):
    """float32, quick sizes: the first three train losses and the metric match compare/torch.py."""
    if not MAIN_PYTHON.exists():
        pytest.skip("needs the main environment (.venv, with torch) to compare against")
    ours, theirs = float32_losses, losses(MAIN_PYTHON, "torch", "float32")
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-4)


@needs_bf16
def test_compare_trains_its_networks_in_bf16_close_to_float32(float32_losses):
    from polyamp.compare import mxnet as compare_mxnet  # bf16 AMP is already on in this process
    from polyamp.compare.workloads import get_workload

    ours = float32_losses
    for name in ours:
        trainer = compare_mxnet.Trainer(get_workload(name, quick=True), "bf16-mixed")
        bf16 = [trainer.step(i) for i in range(3)]
        assert trainer.last.stepped and trainer.mp.current_scale == 1.0
        np.testing.assert_allclose(bf16, ours[name][:3], rtol=2e-2)


NUMERICS = """
import hashlib, sys
import numpy as np
import polyamp as pa
rng = np.random.default_rng(0)
x = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-12, 12, 4000),
                    [0.0, -0.0, np.inf, -np.inf, np.nan, 68.00000356923152, 464.0, 1e-45, 65520.0]])
h = hashlib.sha256()
for fmt in sorted(pa.FORMATS):
    for rounding in ("nearest", "toward_zero", "stochastic"):
        for saturate in (False, True):
            for data in (x, x.astype(np.float32)):
                q = pa.quantize(data, fmt, rounding=rounding, saturate=saturate, seed=12345)
                h.update(np.ascontiguousarray(q).tobytes())
    codes = pa.encode(x[~np.isnan(x)], fmt, rounding="stochastic", saturate=True, seed=7)
    h.update(codes.tobytes() + pa.decode(codes, fmt).tobytes())
print(np.__version__, h.hexdigest())
"""


def test_core_numerics_are_bit_identical_under_numpy_1_23_and_numpy_2():
    """The numpy path (no numba here) against the main environment's numpy 2 with numba off."""
    if not MAIN_PYTHON.exists():
        pytest.skip("needs the main environment (.venv, numpy 2) to compare against")
    ours = run_python(NUMERICS)
    theirs = run_python(NUMERICS, python=MAIN_PYTHON, env={"POLYAMP_NO_NUMBA": "1"})
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr[-1500:] + theirs.stderr[-1500:]
    (v_ours, h_ours), (v_theirs, h_theirs) = ours.stdout.split(), theirs.stdout.split()
    assert v_ours.startswith("1.") and v_theirs.startswith("2.")
    assert h_ours == h_theirs
