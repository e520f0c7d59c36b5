"""Run by tests/test_torch_distributed.py under torch.distributed.run (2 CPU ranks, gloo).

Trains the same model on each rank's own data with DDP (or FSDP2 with ``fsdp``); on the given
steps an overflow is injected on rank 0 only. Saves the step results and final parameters.

It leaves with ``os._exit(0)`` once the process group is destroyed: gloo's C++ threads can abort the
interpreter's own teardown ("terminate called without an active exception", seen once in CI on a
loaded machine; pytorch/pytorch#179291), which is not what this test is about.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import polyamp as pa

wrapper, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
OVERFLOW_ON_RANK0 = {2, 5, 6, 11}

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
if wrapper == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
else:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
mp = pa.MixedPrecision("fp16-mixed", framework="torch", device="cpu")
g = torch.Generator().manual_seed(100 + rank)
results, reasons = [], []
for step in range(steps):
    x = torch.randn(16, 8, generator=g)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin())
    mp.backward(loss)
    if rank == 0 and step in OVERFLOW_ON_RANK0:
        grad = next(model.parameters()).grad
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
    r = mp.step(opt)
    results.append((r.stepped, r.scale))
    reasons.append((r.nonfinite_ranks, r.nonfinite, r.origin))
params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
          for p in model.parameters()]  # fmt: skip
torch.save({"results": results, "reasons": reasons, "params": params}, f"{out}.{rank}")
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
