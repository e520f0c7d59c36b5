"""The emulated recipes' training step of a small CNN against bf16-mixed, side by side, in PyTorch or JAX.

    python benchmarks/recipes_conv_speed.py [--framework torch|jax] [--recipes fp8-tensorwise,...]
                                            [--repeats 7] [--batch 64]

Five 3x3 convolutions (3 -> 32 -> 64 (stride 2) -> 64 -> 128 (stride 2) -> 128 channels, ReLU) on
32x32 images, global average pooling, a linear head of 10 classes, cross-entropy, Adam; the recipes
keep their default keep list (the first convolution and the head stay bf16-mixed), so four
convolutions run as quantized implicit GEMMs. One model per policy, stepping in rotating rounds in one
process: median seconds per step after a warm-up step each, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse

import numpy as np
from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)

import polyamp as pa

RECIPES = "fp8-tensorwise,fp8-delayed,mxfp8,nvfp4,nvfp4:grad_rounding=nearest,nvfp4:hadamard=true"
CHANNELS = [(3, 32, 1), (32, 64, 2), (64, 64, 1), (64, 128, 2), (128, 128, 1)]  # (in, out, stride)


def data(batch: int):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 3, 32, 32)).astype(np.float32)
    return x, rng.integers(0, 10, batch)


def torch_steppers(policies: list[str], batch: int) -> dict:
    import torch
    from torch import nn

    x, y = (torch.from_numpy(a) for a in data(batch))
    out = {}
    for policy in policies:
        torch.manual_seed(0)
        layers = []
        for cin, cout, stride in CHANNELS:
            layers += [nn.Conv2d(cin, cout, 3, stride, 1), nn.ReLU()]
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
        mp = pa.MixedPrecision(policy, framework="torch", device="cpu")
        mp.watch(model)
        opt = torch.optim.Adam(model.parameters(), 1e-3)

        def step(model=model, mp=mp, opt=opt):
            opt.zero_grad()
            with mp.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            mp.backward(loss)
            mp.step(opt)

        out[policy] = step
    return out


def jax_steppers(policies: list[str], batch: int) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    x, y = data(batch)
    x, y = jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(y)  # NHWC, HWIO as flax writes them
    rng = np.random.default_rng(1)
    params = {f"conv{i}": {"w": jnp.asarray(rng.standard_normal((3, 3, cin, cout)) / np.sqrt(9 * cin),
                                            jnp.float32), "b": jnp.zeros(cout)}
              for i, (cin, cout, _) in enumerate(CHANNELS)}  # fmt: skip
    params["head"] = {"w": jnp.asarray(rng.standard_normal((128, 10)) / np.sqrt(128), jnp.float32),
                      "b": jnp.zeros(10)}  # fmt: skip

    def loss_fn(p, x, y):
        h = x
        for i, (_, _, stride) in enumerate(CHANNELS):
            with jax.named_scope(f"conv{i}"):
                h = jax.lax.conv_general_dilated(h, p[f"conv{i}"]["w"], (stride, stride), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
                h = jax.nn.relu(h + p[f"conv{i}"]["b"])
        with jax.named_scope("head"):
            logits = h.mean((1, 2)) @ p["head"]["w"] + p["head"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    out = {}
    for policy in policies:
        mp = pa.MixedPrecision(policy, framework="jax")
        f = mp.autocast(loss_fn)
        opt = optax.adam(1e-3)
        state = {"params": params, "opt": opt.init(params), "mp": mp.init(f, params, x, y)}

        @jax.jit
        def update(s, mp=mp, f=f, opt=opt):
            (_, grads), _, mp_state = mp.value_and_grad(f)(s["params"], x, y, state=s["mp"])
            updates, opt_state = opt.update(grads, s["opt"], s["params"])
            return {"params": optax.apply_updates(s["params"], updates), "opt": opt_state, "mp": mp_state}

        def step(box={"state": state}, update=update):  # noqa: B006 (the step's own state, kept)
            box["state"] = update(box["state"])
            jax.block_until_ready(box["state"]["params"])

        out[policy] = step
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="torch", choices=["torch", "jax"])
    parser.add_argument("--recipes", default=RECIPES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    policies = ["bf16-mixed", *args.recipes.split(",")]
    build = torch_steppers if args.framework == "torch" else jax_steppers
    runs = run_paired(build(policies, args.batch), args.repeats)
    print(f"{args.framework}: CNN step, batch {args.batch}, recipe step / bf16-mixed step")
    print(f"{'workload':8s} {'recipe':34s} {'bf16 ms':>10s} {'recipe ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for policy in policies[1:]:
        print(ratio_row("cnn", policy, runs["bf16-mixed"], runs[policy]), flush=True)


if __name__ == "__main__":
    main()
