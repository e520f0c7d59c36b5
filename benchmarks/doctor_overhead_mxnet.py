"""What the doctor's MXNet taps cost: a plain float32 training step against ``collect`` of one step.

    python benchmarks/doctor_overhead_mxnet.py [--workloads mlp,charlm] [--repeats 7] [--quick]

The compare workloads' Gluon networks (``polyamp.compare.mxnet``: same weights, batch 0, hybridized, Adam
as compare trains them; no contrib.amp in this process). Cases, each against the plain step (forward and
mean loss under ``autograd.record``, backward, ``trainer.step(1)``, ``mx.nd.waitall()``):
- ``collect(..., optimizer=trainer)``: one tapped step with update ratios, including the working copies
  of parameters and optimizer states it runs on (what ``doctor`` pays per call of one step);
- ``collect(...)``: no trainer, so no update ratios and no copies of parameters or optimizer states;
- ``collect(..., steps=4, optimizer=trainer)`` divided by 4: a tapped step with the copies spread over 4.
``collect`` runs the hybridized network imperatively (each leaf block's forward is tapped), so part of its
cost is the lost hybridization. Contenders alternate in rotating rounds in one process; medians after one
warm-up call each, and the median of the per-round ratios. The issue's budget: 1.5x.
"""

from __future__ import annotations

import argparse
import os
import warnings

from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import autograd, gluon

from polyamp.compare import mxnet as compare_mxnet
from polyamp.compare.workloads import get_workload
from polyamp.mxnet.doctor import collect

NETWORKS = {"dense": compare_mxnet.MLP, "transformer": compare_mxnet.CharLM}


def loss_of(kind: str):
    if kind == "mse":
        return lambda out, y: mx.nd.mean(mx.nd.square(out - y))
    ce = gluon.loss.SoftmaxCrossEntropyLoss(axis=-1)
    return lambda out, y: mx.nd.mean(ce(out, y))


def setup(name: str, quick: bool):
    wl = get_workload(name, quick=quick)
    mx.random.seed(wl.seed)
    model = NETWORKS[wl.architecture](wl)
    model.initialize()
    compare_mxnet._load(model, wl.weights)
    model.hybridize(static_alloc=True, static_shape=True)
    trainer = gluon.Trainer(model.collect_params(), "adam", {"learning_rate": wl.lr})
    x, y = wl.batch_at(0)
    inputs = (mx.nd.array(x, dtype="float32"),) + ((model.mask,) if hasattr(model, "mask") else ())
    return model, trainer, (inputs, mx.nd.array(y, dtype="float32")), loss_of(wl.loss_kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (a smoke run)")
    args = parser.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS", "default")
    print(f"mxnet {mx.__version__}, OMP_NUM_THREADS={threads}, {os.cpu_count()} cpus, float32, Adam")
    print(f"{'workload':8s} {'case':34s} {'plain ms':>10s} {'tapped ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        measure(name, args.quick, args.repeats)


def measure(name: str, quick: bool, repeats: int) -> None:
    model, trainer, batch, loss_fn = setup(name, quick)

    def plain():
        with autograd.record():
            loss = loss_fn(model(*batch[0]), batch[1])
        loss.backward()
        trainer.step(1)
        mx.nd.waitall()

    def tapped(**kwargs):
        def run():
            collect(model, batch, loss_fn, **kwargs)
            mx.nd.waitall()  # the restore's copies are asynchronous

        return run

    runs = run_paired({
        "plain": plain,
        "collect, with optimizer": tapped(optimizer=trainer),
        "collect, no optimizer": tapped(),
        "collect steps=4 optimizer, /4": tapped(steps=4, optimizer=trainer),
    }, repeats)  # fmt: skip
    median, rounds = runs["collect steps=4 optimizer, /4"]
    runs["collect steps=4 optimizer, /4"] = (median / 4, [t / 4 for t in rounds])
    for case in list(runs)[1:]:
        print(ratio_row(name, case, runs["plain"], runs[case]), flush=True)


if __name__ == "__main__":
    main()
