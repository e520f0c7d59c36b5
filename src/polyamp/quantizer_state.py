"""What an eager recipe quantizer keeps between calls (torch, MXNet): one ``DelayedScaling`` per (layer,
operand) and the count of quantize calls (stochastic rounding's seeds), as plain host values.

``state_dict()`` is ``{"calls": n, "delayed": {"layer|operand": DelayedScaling.state_dict()}}``, the form
every front end's checkpoint uses (JSON-able); ``load_state_dict`` checks every entry before it replaces
anything.
"""

from __future__ import annotations

from typing import Any

from .errors import PolyampError
from .recipes import DelayedScaling, Recipe


class QuantizerState:
    """A recipe's delayed-scaling histories and call counter, on the host."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.delayed: dict[tuple[str, str], DelayedScaling] = {}
        self.calls = 0

    def history(self, layer: str, operand: str) -> DelayedScaling:
        """The (layer, operand)'s history, created on first use."""
        ds = self.delayed.get((layer, operand))
        if ds is None:
            r = self.recipe
            fmt = r.backward_format if operand == "grad" else r.forward_format
            ds = DelayedScaling(fmt, r.history_len, r.amax_compute_algo, r.margin)
            self.delayed[layer, operand] = ds
        return ds

    def state_dict(self) -> dict[str, Any]:
        """The delayed-scaling states (``"layer|operand" -> DelayedScaling.state_dict()``), the counter."""
        return {"calls": self.calls,
                "delayed": {f"{k[0]}|{k[1]}": v.state_dict() for k, v in self.delayed.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"calls", "delayed"}:
            raise PolyampError(f"a recipe state must be Quantizer.state_dict()'s dict; received {state!r}")
        before = self.delayed, self.calls
        self.delayed, self.calls = {}, int(state["calls"])
        try:
            for key, value in state["delayed"].items():
                layer, _, operand = key.rpartition("|")
                self.history(layer, operand).load_state_dict(value)
        except BaseException:  # a bad entry leaves the state as it was
            self.delayed, self.calls = before
            raise
