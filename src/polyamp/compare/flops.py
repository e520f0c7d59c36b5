"""Model FLOPs of one training step, from a workload's shapes.

Only matrix products count, at 2 FLOPs per multiply-add. A forward pass costs F; its backward pass
computes two products per forward product (the gradient of the input and of the weight), so a
training step costs 3F, less the input gradient of a first layer whose input is data (mlp,
digits). Element-wise work (activations, LayerNorm, softmax, the loss, the optimizer) is left out,
and causal attention is counted as the full T x T products the frameworks compute.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import PolyampError
from .workloads import Workload


def dense_stack(wl: Workload) -> int:
    """mlp and digits: dense layers ``dims[0] -> dims[1] -> ...`` on a batch."""
    forward = [2 * wl.batch * a * b for a, b in zip(wl.dims[:-1], wl.dims[1:])]
    return 3 * sum(forward) - forward[0]  # the data needs no gradient


def transformer(wl: Workload) -> int:
    """charlm: per block q, k, v, o (d x d), scores and probabilities @ v (T x T per head, d in all),
    and the 4d-wide MLP; then the vocabulary head. The embedding is a lookup: no products."""
    tokens, d, t = wl.batch * wl.context, wl.d_model, wl.context
    block = 2 * tokens * (4 * d * d) + 2 * (2 * tokens * t * d) + 2 * tokens * (8 * d * d)
    forward = wl.layers * block + 2 * tokens * d * len(wl.vocab)
    return 3 * forward


# by the workload's architecture ("dense" or "transformer"), else by its name
FLOPS: dict[str, Callable[[Workload], int]] = {
    "dense": dense_stack,
    "transformer": transformer,
    "mlp": dense_stack,
    "digits": dense_stack,
    "charlm": transformer,
}


def train_step_flops(wl: Workload) -> int:
    """FLOPs of one training step of ``wl`` (see the module docstring)."""
    kind = getattr(wl, "architecture", None) or wl.name
    count = FLOPS.get(kind)
    if count is None:
        raise PolyampError(f"no FLOP count for a workload of kind {kind!r} ({wl.name!r}); known: "
                           f"{', '.join(FLOPS)}")  # fmt: skip
    return count(wl)
