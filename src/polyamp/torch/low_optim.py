"""``LowPrecisionOptimizer``: a torch optimizer over bf16 / fp16 weights and low-precision moments.

    model = model.to(torch.bfloat16)
    opt = polyamp.torch.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters()), update="sr",
                                              states="int8")
    # or, from a policy: opt = mp.optimizer(torch.optim.AdamW(model.parameters()))  # "bf16-true:sr,..."

The wrapped optimizer is torch's own (Adam, AdamW, SGD, RMSprop, Adagrad, ...): for each parameter in
turn it steps float32 copies of the weight, its gradient and its decoded moments, and the result is
written back as ``polyamp.training_state`` states (``sr``, ``kahan`` or ``nearest``; moments in
``numerics.state_codes``' form). One parameter at a time, so the float32 working set is one tensor's.
``param_groups`` are the wrapped optimizer's (LR schedulers work on the wrapper or the optimizer).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import training_state as ts
from ..errors import PolyampError
from ..numerics import state_codes
from ..numerics.rounding import quantize
from . import xp

_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """``optimizer`` (a ``torch.optim.Optimizer``) with ``update`` rounding of 16-bit weights and moments
    stored as ``states`` (None: in the parameter's dtype, as torch's optimizers keep them).

    A ``torch.optim.Optimizer`` itself (LR schedulers take it) whose groups and state are the wrapped
    optimizer's; ``Optimizer.__init__`` is not run, as the wrapped optimizer owns them."""

    def __init__(self, optimizer: Any, update: str = "nearest", states: str | None = None, seed: int = 0):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PolyampError(f"LowPrecisionOptimizer wraps a torch.optim.Optimizer, got "
                               f"{type(optimizer).__name__}")  # fmt: skip
        if isinstance(optimizer, torch.optim.LBFGS):
            raise PolyampError("torch.optim.LBFGS keeps one history for all parameters (not per-parameter "
                               "moments) and re-evaluates a closure: LowPrecisionOptimizer takes optimizers "
                               "that step each parameter from its own state (Adam, AdamW, SGD, RMSprop, ...)")
        self.optimizer = optimizer
        self.update = ts.check_update(update)
        self.states = None if states is None else state_codes.check_form(states)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise PolyampError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self.steps = 0
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if self.update != "nearest":
            wide = [tuple(p.shape) for p in self._params if p.dtype not in _LOW]
            if wide:
                raise PolyampError(
                    f"update={self.update!r} rounds 16-bit weights, but {len(wide)} parameter(s) are not "
                    f"bfloat16/float16 (the first {wide[0]} is "
                    f"{str(_first_wide(self._params)).replace('torch.', '')}): "
                    "cast the model first (model.to(torch.bfloat16)) or use update='nearest'"
                )
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._low: dict[int, dict[str, dict]] = {}  # parameter index -> state name -> stored form
        self._comp: dict[int, torch.Tensor] = {}  # Kahan compensation, the weight's dtype

    # -- the optimizer's surface -------------------------------------------------------------------
    param_groups = property(lambda self: self.optimizer.param_groups)
    defaults = property(lambda self: self.optimizer.defaults)
    state = property(lambda self: self.optimizer.state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, group: dict) -> None:
        self.optimizer.add_param_group(group)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]

    def __repr__(self) -> str:
        return (f"LowPrecisionOptimizer({type(self.optimizer).__name__}, update={self.update!r}, "
                f"states={self.states!r})")  # fmt: skip

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step of the wrapped optimizer, parameter by parameter (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.optimizer.param_groups
        lists = [g["params"] for g in groups]
        index = {id(p): i for i, p in enumerate(self._params)}
        try:
            for g in groups:
                g["params"] = []
            for g, params in zip(groups, lists):
                for p in params:
                    if p.grad is not None:
                        g["params"] = [self._proxy(p, index[id(p)])]
                        self.optimizer.step()
                        self._write_back(p, g["params"][0], index[id(p)])
                g["params"] = []
        finally:
            for g, params in zip(groups, lists):
                g["params"] = params
        self.steps += 1
        return loss

    def _proxy(self, p: torch.Tensor, i: int) -> torch.Tensor:
        """The float32 tensor the wrapped optimizer steps for ``p``, with its gradient and decoded state."""
        w = p.detach().float() if p.dtype != torch.float32 else p.detach().clone()
        if i in self._comp:
            w += self._comp[i].float()
        w.grad = p.grad.float() if p.grad.dtype != torch.float32 else p.grad
        state = dict(self.optimizer.state.pop(p, {}))
        for name, stored in self._low.get(i, {}).items():
            state[name] = state_codes.decode(xp, stored, self.states, tuple(p.shape), ts.signed_for(name))
        for name, v in state.items():
            if _is_moment(v, p) and v.dtype != torch.float32:
                state[name] = v.float()
        if state:
            self.optimizer.state[w] = state
        return w

    def _write_back(self, p: torch.Tensor, y: torch.Tensor, i: int) -> None:
        """``p`` from the stepped float32 ``y``; the moments stored again."""
        if p.dtype == torch.float32:
            p.copy_(y)
        elif self.update == "sr":
            fmt = _LOW[p.dtype]
            p.copy_(quantize(y, fmt, rounding="stochastic",
                             seed=ts.step_seed(self.seed, self.steps, len(self._params), i)))  # fmt: skip
        else:
            p.copy_(y)  # round to nearest even
            if self.update == "kahan":
                self._comp[i] = (y - p.float()).to(p.dtype)
        state = self.optimizer.state.pop(y, {})
        plain, low = {}, {}
        for name, v in state.items():
            if not _is_moment(v, p):
                plain[name] = v
            elif self.states is None:
                plain[name] = v.to(p.dtype)
            else:
                low[name] = state_codes.encode(xp, v, self.states, ts.signed_for(name))
        self.optimizer.state[p] = plain
        if low:
            self._low[i] = low

    # -- checkpoint --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict`` and, under ``"polyamp"``, the stored moments, the Kahan
        buffers, the step count and the options (``torch.save`` keeps every tensor's bits)."""
        return {"optimizer": self.optimizer.state_dict(),
                "polyamp": {"update": self.update, "states": self.states, "seed": self.seed,
                            "steps": self.steps, "low": self._low, "compensation": self._comp}}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"optimizer", "polyamp"}:
            raise PolyampError("LowPrecisionOptimizer.load_state_dict takes what its state_dict() returned "
                               f"(keys 'optimizer', 'polyamp'), got {type(state).__name__}"
                               f"{' with keys ' + repr(sorted(state)) if isinstance(state, dict) else ''}")
        mine = state["polyamp"]
        if (mine["update"], mine["states"]) != (self.update, self.states):
            raise PolyampError(f"this checkpoint was written with update={mine['update']!r}, "
                               f"states={mine['states']!r}; this optimizer has update={self.update!r}, "
                               f"states={self.states!r}")  # fmt: skip
        self.optimizer.load_state_dict(state["optimizer"])
        device = {i: p.device for i, p in enumerate(self._params)}
        self._low = {int(i): {k: {n: t.to(device[int(i)]) for n, t in s.items()} for k, s in low.items()}
                     for i, low in mine["low"].items()}  # fmt: skip
        self._comp = {int(i): c.to(device[int(i)]) for i, c in mine["compensation"].items()}
        self.seed, self.steps = mine["seed"], mine["steps"]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the optimizer's state as stored: ``moments`` (and other per-parameter tensors) and
        ``compensation`` (Kahan)."""
        total = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))  # fmt: skip
        total += sum(t.numel() * t.element_size() for low in self._low.values() for s in low.values()
                     for t in s.values())  # fmt: skip
        comp = sum(c.numel() * c.element_size() for c in self._comp.values())
        return {"moments": total, "compensation": comp}


def _first_wide(params) -> torch.dtype:
    return next(p.dtype for p in params if p.dtype not in _LOW)


def _is_moment(v: Any, p: torch.Tensor) -> bool:
    """A per-element state tensor of ``p`` (Adam's ``exp_avg``, SGD's ``momentum_buffer``): stored low."""
    return torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape
