"""polyamp's MXNet step against native ``contrib.amp`` bf16: median step-time ratios.

    .venv-mxnet/bin/python benchmarks/overhead_mxnet.py [--repeats 7] [--models mlp,charlm]

The networks are the compare workloads (``polyamp.compare.mxnet``: MLP 1024-4096-4096-1024 on
batch 256; the 2-layer character transformer, d=256, on 32 x 64 tokens), Adam. bf16 AMP is
process-wide in MXNet, so all contenders share one ``amp.init(target_dtype="bfloat16")``. They
also share ONE network, ``gluon.Trainer`` and Adam state, and take turns stepping it: Adam's update
streams the weight, gradient, mean and variance arrays together, and its speed depends on where
those four sit in memory (the same values copied elsewhere took 68-319 ms for the MLP's middle
layer), so with a network per contender its allocation, not its step, decided the ratios. Their
steps alternate in rounds (each round starting at the next contender), each timed to
``mx.nd.waitall()`` (MXNet's engine is asynchronous); the medians follow one warm-up step each.
Contenders:
- native: ``amp.init_trainer``'s loss scaler (2^16, ``multi_all_finite`` overflow check),
  ``amp.scale_loss``, ``trainer.step``: what contrib.amp users run; the scaler is attached to the
  shared trainer for this contender's steps only;
- polyamp: ``MixedPrecision("bf16-mixed")`` (no loss scale; every step guarded);
- polyamp, mxnet scaler: ``loss_scale="mxnet"``, the same dynamic loss scaling as native;
- native, no scaler: a plain ``trainer.step``: no check at all, the floor.
Ratios are contender / native (< 1: faster); "ms after bwd" is the median of the step's
optimizer part alone (check, unscale, update), timed from the finished backward pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from _timing import alternate  # benchmarks/_timing.py (this folder is on sys.path)

import polyamp as pa

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp

    from polyamp.compare import mxnet as workloads
    from polyamp.compare.workloads import get_workload


def network(wl):
    """A fresh copy of the workload's network and a loss function of one batch."""
    net = workloads.CharLM(wl) if wl.name == "charlm" else workloads.MLP(wl)
    net.initialize()
    workloads._load(net, wl.weights)
    net.hybridize(static_alloc=True, static_shape=True)
    x, y = wl.batch_at(0)
    ce = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)
    if wl.name == "charlm":
        x, y = mx.nd.array(x, dtype="float32"), mx.nd.array(y, dtype="float32")

        def loss():
            return mx.nd.mean(ce(mx.nd.amp_cast(net(x, net.mask), dtype="float32"), y))
    else:
        x, y = mx.nd.array(x), mx.nd.array(y)

        def loss():
            return mx.nd.mean(mx.nd.square(mx.nd.amp_cast(net(x), dtype="float32") - y))

    return net, loss


def native_step(trainer, loss_fn, scaler: bool) -> float:
    """One step; returns the seconds of its optimizer part (after the backward pass finished)."""
    with autograd.record():
        loss = loss_fn()
        if scaler:
            with amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        else:
            loss.backward()
    mx.nd.waitall()
    t0 = time.perf_counter()
    trainer.step(1)
    mx.nd.waitall()
    return time.perf_counter() - t0


def polyamp_step(mp, trainer, loss_fn) -> float:
    with autograd.record():
        loss = loss_fn()
        with mp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    mx.nd.waitall()
    t0 = time.perf_counter()
    mp.step(trainer, 1)
    mx.nd.waitall()
    return time.perf_counter() - t0


def contenders(wl):
    """The four contenders' steps, over one network, trainer and Adam state (module docstring)."""
    net, loss_fn = network(wl)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": wl.lr}, update_on_kvstore=False)
    guarded = pa.MixedPrecision("bf16-mixed", framework="mxnet")
    scaled = pa.MixedPrecision("bf16-mixed", framework="mxnet", loss_scale="mxnet")
    guarded.trainer(trainer)  # polyamp refuses a trainer that carries contrib.amp's scaler,
    scaled.trainer(trainer)
    amp.init_trainer(trainer)  # so the scaler is made here and attached only for native's steps
    scaler, trainer._amp_loss_scaler = trainer._amp_loss_scaler, None

    def native():
        trainer._amp_loss_scaler = scaler
        try:
            return native_step(trainer, loss_fn, scaler=True)
        finally:  # amp.scale_loss set the trainer's gradient rescale to 1/loss scale
            trainer._amp_loss_scaler, trainer._scale = None, trainer._amp_original_scale

    return {
        "native": native,
        "polyamp": lambda: polyamp_step(guarded, trainer, loss_fn),
        "polyamp, mxnet scaler": lambda: polyamp_step(scaled, trainer, loss_fn),
        "native, no scaler": lambda: native_step(trainer, loss_fn, scaler=False),
    }


def waited(step, parts: list):
    """``step`` whose returned time after backward is kept in ``parts`` and whose queued work is
    waited for: MXNet's engine is asynchronous, so a step's time must include it."""

    def call():
        parts.append(step())
        mx.nd.waitall()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default="mlp,charlm")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    pa.MixedPrecision("bf16-mixed", framework="mxnet")  # amp.init, before any network is built
    print(f"MXNet {mx.__version__}, bf16 AMP, Adam, median step time over {args.repeats} alternating repeats")
    print(f"{'model':8s} {'contender':24s} {'ms/step':>9s} {'vs native':>10s} {'vs no scaler':>13s} "
          f"{'ms after bwd':>15s}")  # fmt: skip
    for model in args.models.split(","):
        steps = contenders(get_workload(model))
        step_part = {name: [] for name in steps}
        median = alternate(
            {name: waited(fn, step_part[name]) for name, fn in steps.items()}, args.repeats, rotate=True
        )
        part = {name: statistics.median(ts[1:]) for name, ts in step_part.items()}  # [0]: warm-up
        for name, seconds in median.items():
            print(f"{model:8s} {name:24s} {seconds * 1e3:9.1f} {seconds / median['native']:10.3f} "
                  f"{seconds / median['native, no scaler']:13.3f} {part[name] * 1e3:15.1f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
