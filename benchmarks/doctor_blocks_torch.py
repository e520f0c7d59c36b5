"""What measured block formats add to a doctor call (PyTorch): ``formats=("bf16",)`` against the same with
block formats, on a compare workload's torch network.

    python benchmarks/doctor_blocks_torch.py [--workloads mlp] [--repeats 7] [--quick] [--device cpu]
        [--formats bf16,mxfp8_e4m3,nvfp4]

Each contender is one ``polyamp.doctor(model, batch, loss_fn, optimizer=opt, formats=...)`` call (one
step, with the optimizer: taps, predictions, recommendation). The baseline measures no block format, so
its taps are those of a doctor without measured formats (``collect`` gets no ``measure``). Every
measured tensor costs its casts on the device and one host round trip per tensor and target
(``polyamp.torch.doctor.measure_tensor``). Contenders alternate in rotating rounds in one process;
medians after one warm-up call each, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse

import torch
from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)
from doctor_overhead_torch import setup

import polyamp as pa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (a smoke run)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    parser.add_argument("--formats", default="bf16,mxfp8_e4m3,nvfp4", help="the measured contender's formats")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {args.device} ({where}), float32; doctor(formats=('bf16',)) against "
          f"doctor(formats={tuple(args.formats.split(','))})")  # fmt: skip
    print(f"{'workload':8s} {'case':34s} {'bf16 ms':>10s} {'blocks ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        model, opt, batch, loss_fn = setup(name, args.quick, args.device)
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def call(formats, model=model, batch=batch, loss_fn=loss_fn, opt=opt, sync=sync):
            return lambda: (pa.doctor(model, batch, loss_fn, optimizer=opt, formats=formats), sync())

        runs = run_paired({"bf16": call(("bf16",)), "blocks": call(args.formats)}, args.repeats)
        print(ratio_row(name, f"+ {args.formats}", runs["bf16"], runs["blocks"]), flush=True)


if __name__ == "__main__":
    main()
