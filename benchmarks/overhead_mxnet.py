"""polyamp's MXNet step against native ``contrib.amp`` bf16: median step-time ratios.

    .venv-mxnet/bin/python benchmarks/overhead_mxnet.py [--repeats 7] [--models mlp,charlm]

The networks are the compare workloads (``polyamp.compare.mxnet``: MLP 1024-4096-4096-1024 on
batch 256; the 2-layer character transformer, d=256, on 32 x 64 tokens), every contender with its
own copy of the same weights, fed the same batch, Adam. bf16 AMP is process-wide in MXNet, so all
contenders share one ``amp.init(target_dtype="bfloat16")``; their steps alternate in one process
(native, polyamp, ...), each timed to ``mx.nd.waitall()`` (MXNet's engine is asynchronous),
and the medians follow one warm-up step each. Contenders:
- native: ``amp.init_trainer(trainer)``, ``amp.scale_loss``, ``trainer.step`` (contrib.amp's
  loss scaler, 2^16, with its ``multi_all_finite`` overflow check): what contrib.amp users run;
- polyamp: ``MixedPrecision("bf16-mixed")`` (no loss scale; every step guarded);
- polyamp, mxnet scaler: ``loss_scale="mxnet"``, the same dynamic loss scaling as native;
- native, no scaler: ``amp.init`` and a plain ``trainer.step``: no check at all, the floor.
Ratios are polyamp / native (< 1: polyamp faster); "ms after bwd" is the median of the step's
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
    if wl.name == "charlm":
        net.embed.set_data(mx.nd.array(wl.weights["embed"]))
        net.pos.set_data(mx.nd.array(wl.weights["pos"]))
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
    out = {}
    for name in ("native", "polyamp", "polyamp, mxnet scaler", "native, no scaler"):
        net, loss_fn = network(wl)
        trainer = gluon.Trainer(
            net.collect_params(), "adam", {"learning_rate": wl.lr}, update_on_kvstore=False
        )
        if name.startswith("native"):
            scaler = name == "native"
            if scaler:
                amp.init_trainer(trainer)
            out[name] = lambda t=trainer, f=loss_fn, s=scaler: native_step(t, f, s)
        else:
            mp = pa.MixedPrecision("bf16-mixed", framework="mxnet",
                                   loss_scale="mxnet" if "scaler" in name else None)  # fmt: skip
            trainer = mp.trainer(trainer)
            out[name] = lambda mp=mp, t=trainer, f=loss_fn: polyamp_step(mp, t, f)
    return out


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
        median = alternate({name: waited(fn, step_part[name]) for name, fn in steps.items()}, args.repeats)
        part = {name: statistics.median(ts[1:]) for name, ts in step_part.items()}  # [0]: warm-up
        for name, seconds in median.items():
            print(f"{model:8s} {name:24s} {seconds * 1e3:9.1f} {seconds / median['native']:10.3f} "
                  f"{seconds / median['native, no scaler']:13.3f} {part[name] * 1e3:15.1f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
