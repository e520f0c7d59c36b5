"""Low-precision training state: how 16-bit weights take their update, and how optimizer moments are stored.

A policy may carry options after a colon (``Policy.parse``):

=====================================  ==========================================================
``bf16-true:sr``                       bf16 weights, each update rounded stochastically
``bf16-true:kahan``                    bf16 weights with a bf16 Kahan compensation buffer
``bf16-true:nearest``                  bf16 weights, updates rounded to nearest (plain bf16-true)
``bf16-mixed:states=int8``             fp32 weights, optimizer moments in 8-bit block-wise codes
``bf16-true:sr,states=fp8``            both; ``update=sr`` is the long spelling of ``sr``
``bf16-mixed:weights=int8``            trains as bf16-mixed; inference reads int8 weight-only forms
=====================================  ==========================================================

``states`` is one of ``numerics.state_codes.FORMS`` (``fp32``, ``bf16``, ``fp8``, ``int8``); without it the
moments are kept as the framework's optimizer makes them (the parameters' dtype). ``weights`` is one of
``weight_forms.FORMS``: the form inference stores the trained weights in (``quantize_weights``; compare's
inference rows). Options ``sr`` and ``kahan`` need 16-bit parameters (a ``-true`` policy), as there is
nothing to round on float32 weights.

The step, whatever the framework (``polyamp.torch.LowPrecisionOptimizer``, ``polyamp.jax.low_precision``):
the framework's own optimizer updates float32 copies of one parameter (``w + c`` under Kahan), its gradient
and its moments (decoded); then the result ``y`` is written back, the moments encoded again:

- ``nearest``: ``w = round_nearest(y)``.
- ``sr``: ``w = round_stochastic(y)`` (``E[w] = y``), drawn from the seed ``seed + step * n + i`` for the
  ``i``-th of ``n`` parameters at step ``step`` (``polyamp.quantize``'s stream: bit-identical in every
  framework, resumable from the step count).
- ``kahan``: ``w = round_nearest(y)``, ``c = round_nearest(y - w)`` (``c`` in the weight's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import weight_forms
from .errors import PolyampError, invalid
from .numerics import state_codes

UPDATES = ("nearest", "sr", "kahan")

# second moments are never negative: the unsigned 8-bit table (torch, Keras, optax and MXNet names)
UNSIGNED_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "nu", "velocity",
                             "velocities", "var", "n"})  # fmt: skip


@dataclass(frozen=True)
class StateOptions:
    """What follows the colon of ``bf16-true:sr,states=int8``: the weight update's rounding and the
    optimizer moments' form (None: as the optimizer makes them)."""

    update: str = "nearest"
    states: str | None = None
    weights: str | None = None  # the weight-only inference form

    @property
    def trains(self) -> bool:
        """Whether training goes through polyamp's optimizer wrappers (an update rule or a state form)."""
        return self.update != "nearest" or self.states is not None

    @property
    def spelling(self) -> str:
        parts = [self.update] if self.update != "nearest" else []
        parts += [f"states={self.states}"] if self.states else []
        parts += [f"weights={self.weights}"] if self.weights else []
        return ",".join(parts) or "nearest"

    @classmethod
    def parse(cls, text: str, policy_name: str) -> StateOptions:
        update, states, weights = "nearest", None, None
        for part in (p.strip().lower() for p in text.split(",")):
            key, eq, value = (s.strip() for s in part.partition("="))
            if not eq and key in UPDATES:
                key, value = "update", key
            if key == "update" and value in UPDATES:
                update = value
            elif key == "states":
                states = state_codes.check_form(value)
            elif key == "weights":
                weights = weight_forms.check_form(value)
            else:
                raise PolyampError(
                    f"{part!r} in policy {policy_name!r} is not a training-state option; accepted: "
                    f"{', '.join(UPDATES)} (or update=<one>), states={'|'.join(state_codes.FORMS)}, "
                    f"weights={'|'.join(weight_forms.FORMS)}"
                )
        return cls(update, states, weights)

    def check(self, param_dtype: str, policy_name: str) -> None:
        """An ``sr`` / ``kahan`` update needs 16-bit weights."""
        if self.update != "nearest" and param_dtype not in ("bfloat16", "float16"):
            raise PolyampError(
                f"policy {policy_name!r} rounds weight updates with {self.update!r}, but its parameters are "
                f"{param_dtype}: {self.update} applies to bfloat16 or float16 weights (e.g. 'bf16-true:"
                f"{self.update}'); for float32 weights use 'bf16-mixed' (optionally with states=...)"
            )


def step_seed(seed: int, step: int, count: int, index: int) -> int:
    """The stochastic-rounding seed of parameter ``index`` of ``count`` at ``step`` (mod 2^32)."""
    return (seed + step * count + index) % (1 << 32)


def check_update(update: object) -> str:
    if update not in UPDATES:
        raise invalid("weight update rounding", update, UPDATES)
    return update


def signed_for(name: str) -> bool:
    """Whether the state named ``name`` may be negative (the 8-bit form's table)."""
    return name not in UNSIGNED_STATES
