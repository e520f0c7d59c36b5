"""Where a torch training step's time goes: torch.profiler's self CPU time per operator, per step.

    python benchmarks/torch_step_profile.py [--workload mlp|charlm] [--policy bf16-mixed]
                                            [--optimizer fused|foreach|default] [--compile]
                                            [--allocator default|heap] [--steps 3]

The compare workload's network, batches and loss (``compare/torch.py::tune_inputs``), Adam in the
chosen implementation, the policy's ``MixedPrecision`` step (autocast, backward, step); three warm-up
steps, the median of eight timed steps, then ``--steps`` profiled steps: the top operators by self
CPU time, divided by the number of profiled steps. Run it with ``THP_MEM_ALLOC_ENABLE=1`` in the
environment to see what transparent huge pages change (torch reads it once per process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import profile

import polyamp as pa
from polyamp.compare.torch import tune_inputs
from polyamp.tune import allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--optimizer", default="fused", choices=("fused", "foreach", "default"))
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--allocator", default="default", choices=allocator.MODES, help="glibc malloc's mode")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=10)
    args = parser.parse_args()
    model, batch, loss_fn, optimizer = tune_inputs(args.workload)
    if args.optimizer != "default":
        optimizer = torch.optim.Adam(model.parameters(), lr=optimizer.defaults["lr"],
                                     **{args.optimizer: True})  # fmt: skip
    mp = pa.MixedPrecision(args.policy, framework="torch", device="cpu")
    if args.allocator != "default":
        allocator.use(args.allocator)
    forward = torch.compile(model) if args.compile else model

    def step(i: int) -> None:
        x, y = batch(i)
        optimizer.zero_grad(set_to_none=True)
        with mp.autocast():
            loss = loss_fn(forward(x), y)
        mp.backward(loss)
        mp.step(optimizer)

    for i in range(3):
        step(i)
    seconds = []
    for i in range(8):
        t0 = time.perf_counter()
        step(i)
        seconds.append(time.perf_counter() - t0)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "unset")
    compiled = " compiled" if args.compile else ""
    median = statistics.median(seconds) * 1e3
    print(f"{args.workload} {args.policy} Adam {args.optimizer}{compiled}, allocator {args.allocator}, "
          f"THP_MEM_ALLOC_ENABLE={thp}: median step {median:.1f} ms over 8")  # fmt: skip
    with profile() as prof:
        for i in range(args.steps):
            step(i)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / args.steps / 1e3
    print(f"profiled: {total:.1f} ms of self CPU time per step (profiler overhead included)")
    for e in events[: args.rows]:
        per_step = e.self_cpu_time_total / args.steps / 1e3
        print(f"  {per_step:7.1f} ms  {e.count // args.steps:3d} calls  {e.key[:70]}")


if __name__ == "__main__":
    main()
