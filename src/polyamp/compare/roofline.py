"""The machine's matmul throughput per framework and dtype, and each case's achieved share of it.

``measure``: for float32, bfloat16 and float16, n x n products starting at n = 512 grow n by half
(a multiple of 64) while one product takes under ``target_s`` and n stays within 1536 (big enough
to be compute-bound for a fast dtype, small enough for a slow one such as torch's float16 on a CPU
without fp16 units), then ``repeats`` more products at the last n; the peak is the best 2 n^3 / t
of all these timed products (a peak: the machine can reach it, so a case's share is not inflated
by a probe that ran slow once).
Each product is forced to finish before its clock stops. A dtype the framework refuses is recorded
with its error.

``attach``: a case's achieved GFLOP/s is its model FLOPs per step (``flops.py``) over its median
step time, and its share is that over the peak of its policy's compute dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Roofline:
    """One framework's measured matmul peak per dtype (GFLOP/s), the size used, or the error."""

    framework: str
    gflops: dict[str, float] = field(default_factory=dict)
    size: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Share:
    """A case's achieved matmul throughput against the peak of its compute dtype."""

    compute_dtype: str
    flops_per_step: int
    achieved_gflops: float
    peak_gflops: float | None
    share: float | None
    matmul_n: int | None


def _torch(dtype: str, n: int) -> Callable[[], object]:
    import torch

    a, b = (torch.randn(n, n).to(getattr(torch, dtype)) for _ in range(2))
    return lambda: torch.matmul(a, b)  # CPU kernels return when done


def _tensorflow(dtype: str, n: int) -> Callable[[], object]:
    import tensorflow as tf

    a, b = (tf.cast(tf.random.normal((n, n)), dtype) for _ in range(2))
    return lambda: tf.matmul(a, b).numpy()


def _jax(dtype: str, n: int) -> Callable[[], object]:
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n)).astype(dtype) for i in range(2))
    product = jax.jit(jnp.matmul)
    return lambda: product(a, b).block_until_ready()


def _mxnet(dtype: str, n: int) -> Callable[[], object]:
    import mxnet as mx
    from mxnet.contrib import amp

    target = amp.amp.bfloat16 if dtype == "bfloat16" else dtype  # MXNet's bfloat16 is a numpy record type
    a, b = (mx.nd.amp_cast(mx.nd.random.normal(shape=(n, n)), dtype=target) for _ in range(2))
    # FullyConnected, the product of gluon's Dense: its bfloat16 kernel is oneDNN's (dot has none on CPU)
    return lambda: mx.nd.FullyConnected(a, b, no_bias=True, num_hidden=n).wait_to_read()


PRODUCTS = {"torch": _torch, "tensorflow": _tensorflow, "jax": _jax, "mxnet": _mxnet}


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(framework: str, quick: bool = False) -> Roofline:
    """The framework's matmul GFLOP/s per dtype (see the module docstring); ``quick`` is a smoke
    check: n from 128 to 256, 3 timed products."""
    target_s, n, n_max, repeats = (0.005, 128, 256, 3) if quick else (0.03, 512, 1536, 5)
    make = PRODUCTS[framework]
    out = Roofline(framework)
    for dtype in DTYPES:
        size = n
        try:
            fn = make(dtype, size)
            fn()  # a first call pays for allocation and dispatch
            rates = {}  # GFLOP/s of each timed product -> its n
            while True:
                seconds = _seconds(fn)
                rates[2 * size**3 / seconds / 1e9] = size
                if seconds >= target_s or size >= n_max:
                    break
                size = min(int(size * 1.5) // 64 * 64, n_max)
                fn = make(dtype, size)
                fn()
            for _ in range(repeats):
                rates[2 * size**3 / _seconds(fn) / 1e9] = size
        except Exception as err:  # the framework refuses this dtype here; MXNet's last line says why
            last = [line for line in str(err).splitlines() if line.strip()][-1:] or [""]
            out.errors[dtype] = " ".join(f"{type(err).__name__}: {last[0]}".split())[:300]
            continue
        out.gflops[dtype] = max(rates)
        out.size[dtype] = rates[max(rates)]
    return out


def share(policy: str, flops_per_step: int, median_step_s: float, roofline: dict | None) -> Share:
    """The case's achieved GFLOP/s and its share of ``roofline`` (a ``Roofline.to_json()``)."""
    from ..mixed_precision import policy_for

    dtype = policy_for(policy).compute_dtype
    achieved = flops_per_step / median_step_s / 1e9
    peak = (roofline or {}).get("gflops", {}).get(dtype)
    n = (roofline or {}).get("size", {}).get(dtype)
    return Share(dtype, flops_per_step, achieved, peak, achieved / peak if peak else None, n)


def markdown(rows: list) -> list[str]:
    """The report's roofline section from its rows: each framework's peaks, then each case's share."""
    peaks: dict = {}
    for r in rows:
        if r.roofline_peaks:
            peaks.setdefault(r.framework, r.roofline_peaks)
    if not peaks:
        return []
    out = ["## Roofline", "", "Matmul GFLOP/s measured once per framework at the start of the run "
           "(n x n products, the best of every timed one; n in parentheses). A case's share is its model "
           "FLOPs per step (matrix products only) over its median step time, over the peak of its compute "
           "dtype; above 100%, the case's products ran faster than that dtype's square product (another "
           "dtype or a faster kernel for their shapes).", ""]
    out += ["| framework | " + " | ".join(SHORT[d] for d in DTYPES) + " |", "|---" * (len(DTYPES) + 1) + "|"]
    for fw, peak in peaks.items():
        cells = [f"{peak['gflops'][d]:.0f} (n={peak['size'][d]})" if d in peak["gflops"]
                 else "n/a: " + peak["errors"].get(d, "not measured")[:80] for d in DTYPES]  # fmt: skip
        out.append(f"| {fw} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    out += ["", "| framework | workload | policy | GFLOP/step | achieved GFLOP/s | share of peak |",
            "|---|---|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        s = r.roofline_share
        if s:
            pct = f"{s['share']:.0%} of {SHORT[s['compute_dtype']]}" if s.get("share") is not None else "n/a"
            gflop = s["flops_per_step"] / 1e9
            out.append(f"| {r.framework} | {r.workload} | {r.policy} | {gflop:.3g} "
                       f"| {s['achieved_gflops']:.3g} | {pct} |")  # fmt: skip
    return out + [""]
