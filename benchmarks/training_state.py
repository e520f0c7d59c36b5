"""Training state of the low-precision policies: bytes, step time against bf16-mixed, and what plain
bf16-true loses, side by side in one process (torch or JAX).

    python benchmarks/training_state.py --framework torch [--dims 1024,4096,4096,1024] [--repeats 5]
    python benchmarks/training_state.py --framework jax
    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4294967296 python ...  # heap malloc

The model is compare's ``mlp`` shape (an MLP, ReLU, batch 256, Adam/AdamW lr 1e-4 on a fixed linear
teacher). Bytes: parameters + gradients + float32 masters + optimizer state as stored (moments, Kahan
buffers, step counters), counted from the arrays. Time: median seconds per step over ``repeats``
rotated rounds after a warm-up (``_timing.run_paired``), and the median of the per-round ratios to
bf16-mixed. Loss: the mean squared error after ``--steps`` steps from the same start, per seed.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from _timing import run_paired

POLICIES = ("float32", "bf16-mixed", "bf16-true", "bf16-true:sr", "bf16-true:kahan",
            "bf16-true:sr,states=int8", "bf16-true:sr,states=fp8", "bf16-mixed:states=int8")  # fmt: skip


def data(dims, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((256, dims[0])).astype(np.float32)
    teacher = rng.standard_normal((dims[0], dims[-1])).astype(np.float32) / np.sqrt(dims[0])
    weights = [(rng.standard_normal((a, b)) * np.sqrt(2 / a)).astype(np.float32)
               for a, b in zip(dims, dims[1:])]  # fmt: skip
    return x, x @ teacher, weights


class TorchCase:
    def __init__(self, policy, dims, seed, lr):
        import torch

        import polyamp as pa

        self.torch = torch
        x, y, weights = data(dims, seed)
        layers = []
        for w in weights:
            lin = torch.nn.Linear(*w.shape)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w.T.copy()))
                lin.bias.zero_()
            layers += [lin, torch.nn.ReLU()]
        self.mp = pa.MixedPrecision(policy, framework="torch")
        self.model = self.mp.watch(torch.nn.Sequential(*layers[:-1]))
        self.opt = self.mp.optimizer(torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0))
        dtype = next(self.model.parameters()).dtype
        self.x, self.y = torch.from_numpy(x).to(dtype), torch.from_numpy(y)

    def step(self):
        with self.mp.autocast():
            loss = (self.model(self.x).float() - self.y).pow(2).mean()
        self.mp.backward(loss)
        self.mp.step(self.opt)
        self.opt.zero_grad(set_to_none=False)
        return float(loss.detach())

    def bytes(self):
        torch = self.torch
        params = list(self.model.parameters())
        p = sum(t.numel() * t.element_size() for t in params)
        g = sum(t.grad.numel() * t.grad.element_size() for t in params if t.grad is not None)
        if hasattr(self.opt, "state_bytes"):
            s = sum(self.opt.state_bytes().values())
        else:
            s = sum(v.numel() * v.element_size() for st in self.opt.state.values() for v in st.values()
                    if torch.is_tensor(v))  # fmt: skip
        return p + g + s


class JaxCase:
    def __init__(self, policy, dims, seed, lr):
        import jax
        import jax.numpy as jnp
        import optax

        import polyamp as pa

        self.jax, self.jnp, self.optax = jax, jnp, optax
        x, y, weights = data(dims, seed)
        pol = pa.Policy.parse(policy)
        pdt, cdt = jnp.dtype(pol.param_dtype), jnp.dtype(pol.compute_dtype)
        self.params = [{"w": jnp.asarray(w, pdt), "b": jnp.zeros(w.shape[1], pdt)} for w in weights]
        self.mp = pa.MixedPrecision(policy, framework="jax")
        self.tx = self.mp.optimizer(optax.adamw(lr, weight_decay=0.0))
        self.state = self.tx.init(self.params)
        self.x, self.y = jnp.asarray(x, cdt), jnp.asarray(y)

        def loss_fn(params, x, y):
            h = x
            for i, layer in enumerate(params):
                h = h @ layer["w"].astype(cdt) + layer["b"].astype(cdt)
                h = jax.nn.relu(h) if i < len(params) - 1 else h
            return jnp.mean((h.astype(jnp.float32) - y) ** 2)

        @jax.jit
        def step(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, state = self.tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        self._step = step

    def step(self):
        self.params, self.state, loss = self._step(self.params, self.state, self.x, self.y)
        return float(loss)

    def bytes(self):
        leaves = self.jax.tree.leaves
        p = sum(v.nbytes for v in leaves(self.params))
        return 2 * p + sum(v.nbytes for v in leaves(self.state) if hasattr(v, "nbytes"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=("torch", "jax"), default="torch")
    ap.add_argument("--dims", default="1024,4096,4096,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="steps of the loss comparison (0: none)")
    ap.add_argument("--loss-dims", default="64,256,256,16", help="the (smaller) MLP of the loss comparison")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)
    dims = tuple(int(d) for d in args.dims.split(","))
    make = TorchCase if args.framework == "torch" else JaxCase
    cases = {p: make(p, dims, 0, args.lr) for p in POLICIES}
    for c in cases.values():
        c.step()
    timed = run_paired({p: c.step for p, c in cases.items()}, args.repeats)
    base_bytes = cases["float32"].bytes()
    _, base_rounds = timed["bf16-mixed"]
    print(f"# {args.framework}, MLP {dims}, batch 256, AdamW; {args.repeats} rounds")
    print(f"{'policy':28s} {'state MB':>9s} {'vs fp32':>8s} {'step ms':>8s} {'vs bf16-mixed':>14s}")
    for p, c in cases.items():
        median, rounds = timed[p]
        ratio = statistics.median(a / b for a, b in zip(rounds, base_rounds))
        mb, share = c.bytes() / 2**20, c.bytes() / base_bytes
        print(f"{p:28s} {mb:9.1f} {share:8.3f} {median * 1e3:8.1f} {ratio:14.2f}")
    if args.steps == 0:
        return 0
    loss_dims = tuple(int(d) for d in args.loss_dims.split(","))
    print(f"\n# loss after {args.steps} steps, MLP {loss_dims}, lr {args.lr}, seeds 0..{args.seeds - 1}")
    for p in POLICIES:
        finals = []
        for seed in range(args.seeds):
            c = make(p, loss_dims, seed, args.lr)
            for _ in range(args.steps):
                loss = c.step()
            finals.append(loss)
        print(f"{p:28s} " + " ".join(f"{v:9.5f}" for v in finals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
