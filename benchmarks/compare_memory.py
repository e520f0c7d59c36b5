"""Activation memory that precision changes: bytes saved for backward, bf16 / float32, per framework.

    python benchmarks/compare_memory.py [--frameworks torch,jax,tensorflow] [--workloads mlp,charlm]
    .venv-mxnet/bin/python benchmarks/compare_memory.py --frameworks mxnet

Each (framework, workload, policy) trainer of ``polyamp compare`` takes one step at full size, then
``Trainer.memory()`` reports its probes (how each is measured: ``compare/protocol.py`` and the
framework's trainer). MXNet's AMP is process-wide, so each of its policies runs in a subprocess.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import warnings

from polyamp.compare.workloads import get_workload

MIB = 2.0**20


def measure(framework: str, workload: str, policy: str) -> dict:
    module = importlib.import_module(f"polyamp.compare.{framework}")
    trainer = module.Trainer(get_workload(workload), policy)
    trainer.step(0)
    return dict(trainer.memory())


def measure_in_subprocess(framework: str, workload: str, policy: str) -> dict:
    code = ("import json, sys, warnings\nwarnings.simplefilter('ignore')\n"
            f"sys.path.insert(0, {sys.path[0]!r})\nfrom compare_memory import measure\n"
            f"print(json.dumps(measure({framework!r}, {workload!r}, {policy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="torch,jax,tensorflow")
    parser.add_argument("--workloads", default="mlp,charlm")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(f"{'framework':10s} {'workload':8s} {'fp32 act MiB':>12s} {'bf16 act MiB':>12s} {'ratio':>6s} "
          f"{'bf16 weight copies MiB':>22s}")  # fmt: skip
    for framework in args.frameworks.split(","):
        run = measure_in_subprocess if framework == "mxnet" else measure
        for workload in args.workloads.split(","):
            fp32, bf16 = (run(framework, workload, p) for p in ("float32", "bf16-mixed"))
            a, b = fp32["activations"], bf16["activations"]
            copies = bf16.get("weight_copies")
            print(f"{framework:10s} {workload:8s} {a / MIB:12.1f} {b / MIB:12.1f} {b / a:6.3f} "
                  f"{(copies or 0) / MIB:22.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
