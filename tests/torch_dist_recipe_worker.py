"""Run by tests/test_torch_distributed.py under torch.distributed.run (2 CPU ranks, gloo).

Trains one DDP model with ``fp8-delayed`` (``reduce_amax`` as given) on each rank's own data and saves
the recipe state after the first and the last step, and the final parameters. It leaves with
``os._exit(0)``, as ``torch_dist_worker.py`` does.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import polyamp as pa

reduce_amax, out, steps = sys.argv[1] == "reduce", sys.argv[2], int(sys.argv[3])

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
recipe = pa.recipes.get_recipe("fp8-delayed", keep=(), history_len=4, reduce_amax=reduce_amax)
mp = pa.MixedPrecision(recipe, framework="torch", device="cpu")
mp.watch(model)
g = torch.Generator().manual_seed(100 + rank)
states = []
for step in range(steps):
    x = torch.randn(16, 8, generator=g) * (1 + 3 * rank)  # rank 1's activations 4x larger
    opt.zero_grad()
    with mp.autocast():
        loss = nn.functional.mse_loss(model(x).float(), x[:, :4].sin())
    mp.backward(loss)
    mp.step(opt)
    if step in (0, steps - 1):
        states.append(mp.state_dict()["recipe"]["state"])
params = [p.detach().clone() for p in model.parameters()]
torch.save({"states": states, "params": params}, f"{out}.{rank}")
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
