"""The emulated recipes' training step against bf16-mixed, side by side, in PyTorch, TensorFlow, JAX or MXNet.

    python benchmarks/recipes_speed.py [--framework torch|tensorflow|jax|mxnet] [--workloads mlp,charlm]
                                       [--recipes fp8-tensorwise,...] [--repeats 5]

MXNet (run with ``.venv-mxnet``'s interpreter): each recipe twice, its network imperative (as compare
runs it) and hybridized (``static_alloc``; the quantized GEMMs as a custom operator), beside the
hybridized bf16-mixed network.

The compare workloads' trainers (``polyamp.compare.<framework>`` ``Trainer``: Adam, the workload's
batches; JAX's step jitted, TensorFlow's a ``tf.function``), one per policy, stepping in rotating
rounds in one process: median seconds per step after one warm-up step each, and the median of the
per-round ratios to bf16-mixed. Default recipes: every one the framework runs. The issue's budget: 3x.

``--kernels``: instead, each block quantization one quantized linear of the workload runs per step (the
largest: mlp's 4096 x 4096, charlm's 256 -> 1024 over 2048 tokens; activations and gradients bf16 in
torch, float32 in JAX as the recipes pass them), timed side by side with that linear's bf16 GEMM.
"""

from __future__ import annotations

import argparse
import importlib

from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)

from polyamp.compare.workloads import get_workload

_ALL = "fp8-tensorwise,fp8-delayed,mxfp8,nvfp4,nvfp4:grad_rounding=nearest,nvfp4:hadamard=true"
DEFAULTS = {"torch": _ALL, "tensorflow": _ALL, "jax": _ALL, "mxnet": "fp8-tensorwise,mxfp8,nvfp4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="torch", choices=list(DEFAULTS))
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--recipes", default=None, help="comma-separated (default: every one it runs)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", action="store_true", help="time the block quantizations of one linear")
    args = parser.parse_args()
    if args.kernels and args.framework not in ("torch", "jax"):
        parser.error(f"--kernels times torch or jax; received --framework {args.framework}")
    framework = importlib.import_module(args.framework)
    trainer = importlib.import_module(f"polyamp.compare.{args.framework}").Trainer
    print(f"{args.framework} {framework.__version__}; recipe step / bf16-mixed step")
    print(f"{'workload':8s} {'recipe':34s} {'bf16 ms':>10s} {'recipe ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        if args.kernels:
            kernels(args.framework, name, args.repeats)
        else:
            measure(trainer, name, (args.recipes or DEFAULTS[args.framework]).split(","), args.repeats)


def measure(trainer, name: str, recipes: list[str], repeats: int) -> None:
    wl = get_workload(name)
    trainers = {p: trainer(wl, p) for p in ["bf16-mixed", *recipes]}
    if trainer.__module__.endswith("mxnet"):
        for recipe in recipes:
            trainers[f"{recipe} hybridized"] = t = trainer(wl, recipe)
            t.model.hybridize(static_alloc=True, static_shape=True)
    counters = dict.fromkeys(trainers, 0)

    def stepper(policy):
        def step():
            trainers[policy].step(counters[policy] % wl.steps)
            counters[policy] += 1

        return step

    runs = run_paired({p: stepper(p) for p in trainers}, repeats)
    for policy in list(trainers)[1:]:
        print(ratio_row(name, policy, runs["bf16-mixed"], runs[policy]), flush=True)


LINEAR = {"mlp": (256, 4096, 4096), "charlm": (2048, 256, 1024)}  # tokens M, inputs K, outputs N


def kernels(framework: str, name: str, repeats: int) -> None:
    """The block quantizations of one linear (``x`` [M, K], ``W`` [N, K], ``g`` [M, N]) beside its GEMM."""
    import numpy as np

    import polyamp

    m, k, n = LINEAR[name]
    rng = np.random.default_rng(0)
    x, w, g = (rng.standard_normal(s).astype(np.float32) for s in ((m, k), (n, k), (m, n)))
    if framework == "torch":
        import torch

        x, g, w = torch.from_numpy(x).bfloat16(), torch.from_numpy(g).bfloat16(), torch.from_numpy(w)
        xb, wb = x, w.bfloat16()

        def gemm():
            return xb @ wb.t()

        def run(t, fmt, **kw):
            return lambda: polyamp.quantize_blocks(t, fmt, **kw)
    else:
        import jax
        import jax.numpy as jnp

        x, w, g = jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        gemm_jit = jax.jit(lambda a, b: a @ b.T)

        def gemm():
            return gemm_jit(xb, wb).block_until_ready()

        def run(t, fmt, **kw):
            f = jax.jit(lambda v: polyamp.quantize_blocks(v, fmt, **kw))
            return lambda: f(t).block_until_ready()

    sr = dict(rounding="stochastic", seed=1) if framework == "torch" else {}
    cases = {"mxfp8 x": run(x, "mxfp8_e4m3", scale_rule="rceil"),
             "mxfp8 W": run(w, "mxfp8_e4m3", scale_rule="rceil"),
             "mxfp8 W^T": run(w.T, "mxfp8_e4m3", scale_rule="rceil"),
             "mxfp8 g": run(g, "mxfp8_e4m3", scale_rule="rceil"),
             "mxfp8 g^T": run(g.T, "mxfp8_e4m3", scale_rule="rceil"),
             "mxfp8 x^T": run(x.T, "mxfp8_e4m3", scale_rule="rceil"),
             "nvfp4 x": run(x, "nvfp4"), "nvfp4 W 16x16": run(w, "nvfp4", block=(16, 16)),
             "nvfp4 g": run(g, "nvfp4", **sr), "nvfp4 g^T": run(g.T, "nvfp4", **sr),
             "nvfp4 x^T": run(x.T, "nvfp4")}  # fmt: skip
    runs = run_paired({"gemm": gemm, **cases}, repeats)
    print(f"{name}: quantize_blocks / bf16 GEMM of the {m}x{k} @ {k}x{n} linear "
          f"(g: {'stochastic' if sr else 'nearest'})")  # fmt: skip
    for case in cases:
        print(ratio_row(name, case, runs["gemm"], runs[case]), flush=True)


if __name__ == "__main__":
    main()
