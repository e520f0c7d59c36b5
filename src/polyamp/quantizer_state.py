"""An eager recipe quantizer (torch, MXNet): the operand rule, written once, and what it keeps between
calls: one ``DelayedScaling`` per (layer, operand) and the count of quantize calls (stochastic rounding's
seeds), as plain host values.

``state_dict()`` is ``{"calls": n, "delayed": {"layer|operand": DelayedScaling.state_dict()}}``, the form
every front end's checkpoint uses (JSON-able); ``load_state_dict`` checks every entry before it replaces
anything.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .errors import PolyampError
from .numerics import quantize_blocks
from .recipes import DelayedScaling, Recipe, current_scale_of


class QuantizerState:
    """A recipe's quantize-dequantize of one GEMM operand (``__call__``), its delayed-scaling histories
    and call counter, on the host.

    A front end's subclass supplies its ops module ``ops`` (``polyamp.<framework>.xp``) and the hooks of
    the per-tensor path: ``_operand(x)`` (``x`` as that path takes it; default ``x``), ``_amax(v)`` (max
    ``|v|`` as a float32 array, on ``v``'s device), ``_quantize_tensorwise(v, fmt, scale, rounding,
    seed)`` (``recipes.quantize_tensorwise``; ``scale`` a host float or a float32 array) and
    ``_reduced(amax)`` (the amax shared across data-parallel ranks; default ``amax``)."""

    ops: ModuleType

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.delayed: dict[tuple[str, str], DelayedScaling] = {}
        self.calls = 0

    def __call__(self, x, layer: str, operand: str, axis: int = -1):
        """``x`` quantized and dequantized as the recipe's ``operand`` ("input", "weight", "grad") of
        ``layer``, blocked along ``axis``; float32 out.

        Every call counts; stochastic rounding takes the count as its seed. Block recipes:
        ``polyamp.quantize_blocks`` (NVFP4 weights in 16x16 tiles of the last two axes). Delayed: the
        history's scale, then this call's amax (``_reduced``, read on the host) into the history (TE's
        order). Tensorwise: ``current_scale`` of this call's amax, on the device."""
        r = self.recipe
        grad = operand == "grad"
        fmt = r.backward_format if grad else r.forward_format
        rounding = r.grad_rounding if grad else r.forward_rounding
        self.calls += 1
        seed = self.calls if rounding == "stochastic" else None
        if r.kind == "block":
            block = (16, 16) if (r.weight_2d and operand == "weight") else None
            return quantize_blocks(x, fmt, axis=(-2, -1) if block else axis, block=block,
                                   scale_rule=r.scale_rule, rounding=rounding, seed=seed)  # fmt: skip
        v = self._operand(x)
        amax = self._amax(v)
        if r.kind == "delayed":
            ds = self.history(layer, operand)
            out = self._quantize_tensorwise(v, fmt, float(ds.scale), rounding, seed)
            ds.update(self.ops.item(self._reduced(amax)))
            return out
        scale = current_scale_of(self.ops, amax, fmt, r.margin, r.amax_epsilon)
        return self._quantize_tensorwise(v, fmt, scale, rounding, seed)

    def _operand(self, x):
        return x

    def _reduced(self, amax):
        return amax

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
