"""The compare workloads, defined once in numpy: architecture, initial weights and data order.

Every framework module (``compare/torch.py``, ...) builds the same network from these arrays and
feeds it the same batches in the same order, so the runs differ only in framework and policy.

- ``mlp``: synthetic regression, matmul-heavy: batch 256, 1024 -> 4096 -> 4096 -> 1024, GELU, MSE
  against a fixed random teacher ``tanh(x @ T / sqrt(d))``.
- ``charlm``: a character transformer language model (pre-LN blocks, causal attention, learned
  positions) on the standard library's documentation topics (``pydoc_data``), last 10 % held out;
  reports the held-out cross-entropy.
- ``digits``: an MLP classifier on the 8x8 handwritten digits that scikit-learn ships; reports
  test accuracy.

All use Adam. Weight layout: a dense layer is ``(W[in, out], b[out])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from numbers import Integral

import numpy as np

from ..errors import PolyampError

WORKLOADS = ("mlp", "charlm", "digits")


@dataclass(frozen=True)
class Workload:
    """One workload at one size: hyper-parameters plus lazily generated weights and data."""

    name: str
    steps: int
    batch: int
    lr: float
    dims: tuple[int, ...] = ()  # mlp/digits: layer widths; charlm: unused
    activation: str = "gelu"  # between the dense layers of mlp/digits
    d_model: int = 0
    layers: int = 0
    heads: int = 0
    context: int = 0
    eval_batches: int = 8
    seed: int = 0

    # -- weights ---------------------------------------------------------------------------------
    def dense(self, rng, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        bound = 1.0 / np.sqrt(n_in)
        w = rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32)
        return w, np.zeros(n_out, np.float32)

    @cached_property
    def weights(self) -> dict[str, np.ndarray]:
        """Initial weights by name; identical for every framework and policy."""
        rng = np.random.default_rng(self.seed + 1)
        out: dict[str, np.ndarray] = {}
        if self.name in ("mlp", "digits"):
            for i, (a, b) in enumerate(zip(self.dims[:-1], self.dims[1:])):
                out[f"fc{i}.w"], out[f"fc{i}.b"] = self.dense(rng, a, b)
            return out
        d, v = self.d_model, len(self.vocab)
        out["embed"] = (rng.standard_normal((v, d)) * 0.02).astype(np.float32)
        out["pos"] = (rng.standard_normal((self.context, d)) * 0.02).astype(np.float32)
        for i in range(self.layers):
            p = f"block{i}."
            for ln in ("ln1", "ln2"):
                out[p + ln + ".g"], out[p + ln + ".b"] = np.ones(d, np.float32), np.zeros(d, np.float32)
            for name in ("q", "k", "v", "o"):
                out[p + name + ".w"], out[p + name + ".b"] = self.dense(rng, d, d)
            out[p + "ff1.w"], out[p + "ff1.b"] = self.dense(rng, d, 4 * d)
            out[p + "ff2.w"], out[p + "ff2.b"] = self.dense(rng, 4 * d, d)
        out["lnf.g"], out["lnf.b"] = np.ones(d, np.float32), np.zeros(d, np.float32)
        out["head.w"], out["head.b"] = self.dense(rng, d, v)
        return out

    # -- data --------------------------------------------------------------------------------------
    def batch_at(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The training batch for ``step``: (inputs, targets)."""
        if self.name == "mlp":
            pool = self._mlp_pool
            return pool[0][step % len(pool[0])], pool[1][step % len(pool[1])]
        if self.name == "digits":
            x, y = self._digits["train"]
            idx = self._digit_order[step % len(self._digit_order)]
            return x[idx], y[idx]
        starts = np.random.default_rng(self.seed + 2 + step).integers(
            0, len(self._train_ids) - self.context - 1, self.batch
        )
        return self._windows(self._train_ids, starts)

    def eval_batches_(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Fixed evaluation data: held-out text windows (charlm) or the test split (digits)."""
        if self.name == "digits":
            return [self._digits["test"]]
        if self.name == "mlp":
            return [self.batch_at(10_000)]
        rng = np.random.default_rng(self.seed + 3)
        ids = self._heldout_ids
        return [
            self._windows(ids, rng.integers(0, len(ids) - self.context - 1, self.batch))
            for _ in range(self.eval_batches)
        ]

    @cached_property
    def _mlp_pool(self):
        rng = np.random.default_rng(self.seed + 2)
        d_in, d_out = self.dims[0], self.dims[-1]
        teacher = rng.standard_normal((d_in, d_out)).astype(np.float32)
        x = rng.standard_normal((16, self.batch, d_in)).astype(np.float32)
        return x, np.tanh(x @ teacher / np.sqrt(d_in)).astype(np.float32)

    @cached_property
    def _digits(self):
        from sklearn.datasets import load_digits

        data = load_digits()
        x = (data.data / 16.0).astype(np.float32)
        y = data.target.astype(np.int64)
        order = np.random.default_rng(self.seed + 4).permutation(len(x))
        x, y = x[order], y[order]
        n_train = int(0.8 * len(x))
        return {"train": (x[:n_train], y[:n_train]), "test": (x[n_train:], y[n_train:])}

    @cached_property
    def _digit_order(self) -> list[np.ndarray]:
        n = len(self._digits["train"][0])
        rng = np.random.default_rng(self.seed + 5)
        perm = np.concatenate([rng.permutation(n) for _ in range(self.steps * self.batch // n + 1)])
        return [perm[i * self.batch : (i + 1) * self.batch] for i in range(len(perm) // self.batch)]

    # -- text --------------------------------------------------------------------------------------
    @cached_property
    def text(self) -> str:
        from pydoc_data.topics import topics

        raw = "\n".join(topics[k] for k in sorted(topics))
        return "".join(c if 32 <= ord(c) < 127 or c == "\n" else "?" for c in raw)

    @cached_property
    def vocab(self) -> str:
        return "".join(sorted(set(self.text)))

    @cached_property
    def _ids(self) -> np.ndarray:
        lookup = np.zeros(128, np.int64)
        lookup[[ord(c) for c in self.vocab]] = np.arange(len(self.vocab))
        return lookup[np.frombuffer(self.text.encode("ascii"), np.uint8)]

    @property
    def _train_ids(self) -> np.ndarray:
        return self._ids[: int(0.9 * len(self._ids))]

    @property
    def _heldout_ids(self) -> np.ndarray:
        return self._ids[int(0.9 * len(self._ids)) :]

    def _windows(self, ids: np.ndarray, starts: np.ndarray):
        idx = starts[:, None] + np.arange(self.context + 1)
        w = ids[idx]
        return w[:, :-1], w[:, 1:]

    @property
    def metric(self) -> tuple[str, bool]:
        """(name of the evaluation metric, whether higher is better)."""
        return {"mlp": ("eval_loss", False), "charlm": ("heldout_loss", False),
                "digits": ("accuracy", True)}[self.name]  # fmt: skip


_FULL = {
    "mlp": dict(steps=12, batch=256, lr=1e-4, dims=(1024, 4096, 4096, 1024)),
    "charlm": dict(steps=24, batch=32, lr=2e-3, d_model=256, layers=2, heads=4, context=64),
    "digits": dict(steps=150, batch=64, lr=1e-3, dims=(64, 256, 128, 10), activation="relu"),
}
# A smoke check: tiny sizes and four steps (one warm-up, three timed), so a case costs little more
# than building and compiling its step.
_QUICK = {
    "mlp": dict(steps=4, batch=32, lr=1e-3, dims=(64, 128, 128, 64)),
    "charlm": dict(steps=4, batch=8, lr=2e-3, d_model=32, layers=1, heads=2, context=16, eval_batches=2),
    "digits": dict(steps=4, batch=32, lr=1e-3, dims=(64, 32, 10), activation="relu"),
}


def check_steps(steps: object) -> None:
    """Refuse a step count that is not a whole number >= 1 (None means each workload's default)."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, Integral) or steps < 1):
        raise PolyampError(
            f"steps must be a whole number >= 1, or None for each workload's default; got {steps!r}"
        )


def get_workload(name: str, quick: bool = False, steps: int | None = None, seed: int = 0) -> Workload:
    """The workload ``name`` at full size (or ``quick``: tiny sizes for tests and smoke runs)."""
    if name not in WORKLOADS:
        raise PolyampError(f"unknown workload {name!r}; accepted: {', '.join(WORKLOADS)}")
    check_steps(steps)
    config = dict((_QUICK if quick else _FULL)[name])
    if steps is not None:
        config["steps"] = int(steps)
    return Workload(name=name, seed=seed, **config)
