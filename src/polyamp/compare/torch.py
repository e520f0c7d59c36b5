"""The compare workloads in PyTorch, trained with ``polyamp.MixedPrecision``.

Each network is built from the numpy weights of ``workloads.py`` (a dense layer's ``W[in, out]``
is stored transposed, as ``nn.Linear`` wants it). Adam is torch's fused CPU kernel.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..mixed_precision import MixedPrecision
from .workloads import Workload


def _linear(weights: dict, name: str) -> nn.Linear:
    w, b = weights[name + ".w"], weights[name + ".b"]
    layer = nn.Linear(*w.shape)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w.T.copy()))
        layer.bias.copy_(torch.from_numpy(b))
    return layer


class MLP(nn.Module):
    def __init__(self, wl: Workload):
        super().__init__()
        n = len(wl.dims) - 1
        self.layers = nn.ModuleList(_linear(wl.weights, f"fc{i}") for i in range(n))
        self.act = {"gelu": nn.functional.gelu, "relu": torch.relu}[wl.activation]

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


def _layer_norm(weights: dict, name: str, d: int) -> nn.LayerNorm:
    ln = nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(weights[name + ".g"]))
        ln.bias.copy_(torch.from_numpy(weights[name + ".b"]))
    return ln


class Block(nn.Module):
    def __init__(self, wl: Workload, i: int):
        super().__init__()
        p, d = f"block{i}.", wl.d_model
        self.heads = wl.heads
        self.ln1, self.ln2 = _layer_norm(wl.weights, p + "ln1", d), _layer_norm(wl.weights, p + "ln2", d)
        self.q, self.k, self.v, self.o = (_linear(wl.weights, p + n) for n in "qkvo")
        self.ff1, self.ff2 = _linear(wl.weights, p + "ff1"), _linear(wl.weights, p + "ff2")

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(nn.functional.gelu(self.ff1(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, wl: Workload):
        super().__init__()
        w = wl.weights
        self.embed = nn.Parameter(torch.from_numpy(w["embed"].copy()))
        self.pos = nn.Parameter(torch.from_numpy(w["pos"].copy()))
        self.blocks = nn.ModuleList(Block(wl, i) for i in range(wl.layers))
        self.lnf = _layer_norm(w, "lnf", wl.d_model)
        self.head = _linear(w, "head")

    def forward(self, ids):
        x = self.embed[ids] + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.lnf(x))


class Trainer:
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        torch.manual_seed(wl.seed)
        self.wl = wl
        self.model = CharLM(wl) if wl.name == "charlm" else MLP(wl)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=wl.lr, fused=True)
        self.mp = MixedPrecision(policy, framework="torch", device="cpu")
        self.mp.watch(self.model)

    def _loss(self, x, y):
        with self.mp.autocast():
            out = self.model(torch.from_numpy(x))
            y = torch.from_numpy(y)
            if self.wl.name == "mlp":
                return nn.functional.mse_loss(out.float(), y)
            return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))

    def step(self, i: int) -> float:
        x, y = self.wl.batch_at(i)
        self.opt.zero_grad(set_to_none=True)
        loss = self._loss(x, y)
        self.mp.backward(loss)
        self.last = self.mp.step(self.opt)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self) -> float:
        batches = self.wl.eval_batches_()
        if self.wl.name == "digits":
            ((x, y),) = batches
            with self.mp.autocast():
                pred = self.model(torch.from_numpy(x)).float().argmax(-1).numpy()
            return float(np.mean(pred == y))
        losses = [float(self._loss(x, y)) for x, y in batches]
        return float(np.mean(losses))


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}
