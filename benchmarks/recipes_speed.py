"""The emulated recipes' training step against bf16-mixed, side by side, in PyTorch or JAX.

    python benchmarks/recipes_speed.py [--framework torch|jax] [--workloads mlp,charlm]
                                       [--recipes fp8-tensorwise,...] [--repeats 5]

The compare workloads' trainers (``polyamp.compare.torch`` / ``.jax`` ``Trainer``: Adam, the workload's
batches; JAX's step jitted), one per policy, stepping in rotating rounds in one process: median seconds
per step after one warm-up step each, and the median of the per-round ratios to bf16-mixed. Default
recipes: every one the framework runs (JAX: nvfp4 with nearest rounding). The issue's budget: 3x.
"""

from __future__ import annotations

import argparse
import importlib

from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)

from polyamp.compare.workloads import get_workload

DEFAULTS = {"torch": "fp8-tensorwise,fp8-delayed,mxfp8,nvfp4",
            "jax": "fp8-tensorwise,mxfp8,nvfp4:grad_rounding=nearest"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", default="torch", choices=list(DEFAULTS))
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--recipes", default=None, help="comma-separated (default: every one it runs)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    framework = importlib.import_module(args.framework)
    trainer = importlib.import_module(f"polyamp.compare.{args.framework}").Trainer
    print(f"{args.framework} {framework.__version__}; recipe step / bf16-mixed step")
    print(f"{'workload':8s} {'recipe':34s} {'bf16 ms':>10s} {'recipe ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        measure(trainer, name, (args.recipes or DEFAULTS[args.framework]).split(","), args.repeats)


def measure(trainer, name: str, recipes: list[str], repeats: int) -> None:
    wl = get_workload(name)
    trainers = {p: trainer(wl, p) for p in ["bf16-mixed", *recipes]}
    counters = dict.fromkeys(trainers, 0)

    def stepper(policy):
        def step():
            trainers[policy].step(counters[policy] % wl.steps)
            counters[policy] += 1

        return step

    runs = run_paired({p: stepper(p) for p in trainers}, repeats)
    for policy in list(trainers)[1:]:
        print(ratio_row(name, policy, runs["bf16-mixed"], runs[policy]), flush=True)

if __name__ == "__main__":
    main()
