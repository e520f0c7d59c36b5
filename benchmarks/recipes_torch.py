"""The emulated recipes' training step against bf16-mixed in PyTorch, side by side.

    python benchmarks/recipes_torch.py [--workloads mlp,charlm] [--recipes fp8-tensorwise,...] [--repeats 5]

The compare workloads' torch trainers (``polyamp.compare.torch.Trainer``: fused Adam, the workload's
batches), one per policy, stepping in rotating rounds in one process: median seconds per step after one
warm-up step each, and the median of the per-round ratios to bf16-mixed. The issue's budget: 3x.
"""

from __future__ import annotations

import argparse

import torch
from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)

from polyamp.compare.torch import Trainer
from polyamp.compare.workloads import get_workload
from polyamp.recipes import RECIPES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; recipe step / bf16-mixed step")
    print(f"{'workload':8s} {'recipe':34s} {'bf16 ms':>10s} {'recipe ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        measure(name, args.recipes.split(","), args.repeats)


def measure(name: str, recipes: list[str], repeats: int) -> None:
    wl = get_workload(name)
    trainers = {p: Trainer(wl, p) for p in ["bf16-mixed", *recipes]}
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
