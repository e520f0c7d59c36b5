"""The classic PyTorch mixed-precision loop, written correctly with polyamp.

    python examples/torch_amp.py [--policy fp16-mixed|bf16-mixed|float32] [--steps 300]

The loop this replaces (a widely copied tutorial) reads:

    for data, target in dataloader:
        optimizer.zero_grad()
        with autocast():
            loss = criterion(model(data), target)
        scaler = GradScaler()            # <- a new scaler every step
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

A GradScaler made inside the loop never adapts: every step starts again from 2^16, so the halving
after an overflow and the doubling after 2000 clean steps are thrown away with the object. With
fp16 gradients that overflow at 2^16 every step is skipped, forever. It must be created once,
before the loop; polyamp's ``MixedPrecision`` plays that role, holds the scale state, checkpoints
it, and reports every skipped step. This script shows both on the same data.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

import polyamp as pa


def data(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(10, 1, generator=g)
    for _ in range(steps):
        x = torch.randn(64, 10, generator=g)
        yield x, x @ w + 0.1 * torch.randn(64, 1, generator=g)


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss()


def train_with_polyamp(policy: str, steps: int, overflow_every: int = 0) -> dict:
    model, optimizer, criterion = build()
    mp = pa.MixedPrecision(policy, framework="torch", device="cpu")  # once, before the loop
    mp.watch(model)
    skipped, losses = 0, []
    for step, (x, y) in enumerate(data(steps)):
        optimizer.zero_grad()
        with mp.autocast():
            loss = criterion(model(x).float(), y)
        mp.backward(loss)
        if overflow_every and step % overflow_every == 0:
            model[0].weight.grad[0, 0] = float("inf")  # what an fp16 overflow looks like
        result = mp.step(optimizer)
        skipped += not result.stepped
        losses.append(float(loss.detach()))
    return {"first_loss": losses[0], "last_loss": losses[-1], "skipped": skipped, "scale": mp.current_scale}


def scaler_inside_the_loop(steps: int, overflow_every: int) -> list[float]:
    """The tutorial's mistake, with the real GradScaler: the scale each step starts from."""
    model, optimizer, criterion = build()
    scales = []
    for step, (x, y) in enumerate(data(steps)):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = criterion(model(x).float(), y)
        scaler = torch.amp.GradScaler("cpu")
        scales.append(scaler.get_scale() if step else 2.0**16)
        scaler.scale(loss).backward()
        if overflow_every and step % overflow_every == 0:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
    return scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on CPU warns that it is slow

    scales = scaler_inside_the_loop(args.steps, overflow_every=10)
    print(f"GradScaler made inside the loop: scale at every step {sorted(set(scales))} "
          "(overflows every 10 steps never lower it)")  # fmt: skip
    result = train_with_polyamp(args.policy, args.steps, overflow_every=10)
    print(f"polyamp {args.policy}: loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}, "
          f"{result['skipped']} overflow steps skipped, final scale {result['scale']:g}")  # fmt: skip


if __name__ == "__main__":
    main()
