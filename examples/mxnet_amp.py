"""The classic MXNet mixed-precision loop, written correctly with polyamp (run it in .venv-mxnet).

    .venv-mxnet/bin/python examples/mxnet_amp.py [--policy bf16-mixed|float32|fp16-mixed]
        [--steps 300] [--loss-scale mxnet] [--overflow-every 10]

The loop this replaces (a widely copied tutorial) reads:

    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(10, activation='relu', in_units=10))
    net.add(gluon.nn.Dense(1))
    loss_fn = gluon.loss.L2Loss()
    optimizer = gluon.optim.SGD(net.collect_params(), learning_rate=0.01)   # no such class
    mx.nd.contrib.set_default_fp16()                                        # no such function
    for data, target in dataloader:
        with mx.nd.autograd.record():                                       # mxnet.autograd
            loss = loss_fn(net(data), target)
        loss.backward()
        optimizer.step()                                                    # Trainer.step(batch_size)

Neither ``gluon.optim.SGD`` nor ``set_default_fp16`` exists. MXNet's AMP is
``mxnet.contrib.amp.init()``, which must run *before* the network is built (a network built and
hybridized before it keeps computing in float32), plus a ``gluon.Trainer`` created with
``update_on_kvstore=False``. On a CPU the mixed-precision path is bf16: MXNet's float16
FullyConnected exists only with cuDNN. ``MixedPrecision(..., framework="mxnet")`` calls
``amp.init`` and refuses when a network already exists; ``mp.step`` checks the gradients, skips a
step whose gradients are not finite and reports it.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import polyamp as pa


def data(steps: int, batch: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((10, 1)).astype(np.float32)
    for _ in range(steps):
        x = rng.standard_normal((batch, 10)).astype(np.float32)
        yield x, x @ w + np.float32(0.1) * rng.standard_normal((batch, 1)).astype(np.float32)


def train(policy: str, steps: int, loss_scale=None, overflow_every: int = 0) -> dict:
    import mxnet as mx
    from mxnet import autograd, gluon

    mp = pa.MixedPrecision(policy, framework="mxnet", loss_scale=loss_scale)  # amp.init: before the net
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(10, activation="relu", in_units=10))
    net.add(gluon.nn.Dense(1, in_units=10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    loss_fn = gluon.loss.L2Loss()
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01}))
    losses, skipped, dtype = [], 0, None
    for step, (x, y) in enumerate(data(steps)):
        x, y = mx.nd.array(x), mx.nd.array(y)
        with autograd.record():
            out = net(x)
            loss = loss_fn(out, y)
            with mp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        if overflow_every and step % overflow_every == 0:
            net[0].weight.grad()[0, 0] = np.inf  # what an fp16 overflow looks like
        result = mp.step(trainer, batch_size=x.shape[0])
        skipped += not result.stepped
        losses.append(float(loss.mean().asscalar()))
        dtype = "bfloat16" if np.dtype(out.dtype).names else np.dtype(out.dtype).name
    return {"first_loss": losses[0], "last_loss": losses[-1], "skipped": skipped,
            "scale": mp.current_scale, "dense_dtype": dtype}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--loss-scale", default=None, help="e.g. 'mxnet' (contrib.amp's scaler)")
    parser.add_argument("--overflow-every", type=int, default=0)
    args = parser.parse_args()
    try:
        r = train(args.policy, args.steps, args.loss_scale, args.overflow_every)
    except pa.UnsupportedError as err:
        print(f"{args.policy}: unsupported here: {err}")
        return 2
    print(f"polyamp {args.policy} on MXNet: Dense layers ran in {r['dense_dtype']}; loss "
          f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}, {r['skipped']} steps skipped, "
          f"final scale {r['scale']:g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
