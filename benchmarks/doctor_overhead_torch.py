"""What the doctor's PyTorch taps cost: a plain float32 training step against ``collect`` of one step.

    python benchmarks/doctor_overhead_torch.py [--workloads mlp,charlm] [--repeats 7] [--quick] [--device cpu]

The compare workloads' torch networks (``polyamp.compare.torch``: same weights, batch 0, fused Adam as
compare trains them). Cases, each against the plain step (zero_grad, forward, loss, backward, optimizer step):
- ``collect(..., optimizer=opt)``: one tapped step with update ratios, including the snapshot of parameters
  and optimizer state and their restore (what ``doctor`` pays per call of one step);
- ``collect(...)``: no optimizer, so no update ratios and no snapshot of parameters or optimizer state;
- ``collect(..., steps=4, optimizer=opt)`` divided by 4: a tapped step with the snapshot spread over 4 steps.
Contenders alternate in rotating rounds in one process; medians after one warm-up call each, and the median
of the per-round ratios. The issue's budget: 1.5x. ``--device cuda``: model and batch on a GPU, every
contender ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse

import torch
from _timing import ratio_row, run_paired  # benchmarks/_timing.py (this folder is on sys.path)
from torch import nn

from polyamp.compare import torch as compare_torch
from polyamp.compare.workloads import get_workload
from polyamp.torch.doctor import collect

NETWORKS = {"dense": compare_torch.MLP, "transformer": compare_torch.CharLM}


def loss_of(kind: str):
    if kind == "mse":
        return lambda out, y: nn.functional.mse_loss(out, y)
    return lambda out, y: nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def setup(name: str, quick: bool, device: str):
    wl = get_workload(name, quick=quick)
    torch.manual_seed(wl.seed)
    model = NETWORKS[wl.architecture](wl).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=wl.lr, fused=True)
    x, y = (torch.from_numpy(a).to(device) for a in wl.batch_at(0))
    return model, opt, (x, y), loss_of(wl.loss_kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,charlm")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (a smoke run)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    where = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {args.device} ({where}), float32, fused Adam")
    print(f"{'workload':8s} {'case':34s} {'plain ms':>10s} {'tapped ms':>11s} {'ratio':>7s} {'paired':>7s}")
    for name in args.workloads.split(","):
        measure(name, args.quick, args.repeats, args.device)


def measure(name: str, quick: bool, repeats: int, device: str) -> None:
    model, opt, batch, loss_fn = setup(name, quick, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def plain():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(batch[0]), batch[1]).backward()
        opt.step()

    def synced(fn):
        return lambda: (fn(), sync())

    runs = run_paired({
        "plain": synced(plain),
        "collect, with optimizer": synced(lambda: collect(model, batch, loss_fn, optimizer=opt)),
        "collect, no optimizer": synced(lambda: collect(model, batch, loss_fn)),
        "collect steps=4 optimizer, /4": synced(
            lambda: collect(model, batch, loss_fn, steps=4, optimizer=opt)),
    }, repeats)  # fmt: skip
    median, rounds = runs["collect steps=4 optimizer, /4"]
    runs["collect steps=4 optimizer, /4"] = (median / 4, [t / 4 for t in rounds])
    for case in list(runs)[1:]:
        print(ratio_row(name, case, runs["plain"], runs[case]), flush=True)


if __name__ == "__main__":
    main()
