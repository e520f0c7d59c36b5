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

import numpy as np
import torch

from .. import training_state as ts
from ..errors import PolyampError
from ..numerics import state_codes
from ..numerics.rounding import quantize
from ..numerics.stream import mix
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
        w = _widen(p.detach(), self._comp.get(i)) if p.dtype != torch.float32 else p.detach().clone()
        w.grad = _widen(p.grad) if p.grad.dtype != torch.float32 else p.grad
        state = dict(self.optimizer.state.pop(p, {}))
        for name, stored in self._low.get(i, {}).items():
            state[name] = _decode(stored, self.states, p, ts.signed_for(name))
        for name, v in state.items():
            if _is_moment(v, p) and v.dtype != torch.float32:
                state[name] = _widen(v)
        if state:
            self.optimizer.state[w] = state
        return w

    def _write_back(self, p: torch.Tensor, y: torch.Tensor, i: int) -> None:
        """``p`` from the stepped float32 ``y``; the moments stored again."""
        if p.dtype == torch.float32:
            p.copy_(y)
        elif self.update == "sr":
            p.copy_(_stochastic(y, p.dtype, ts.step_seed(self.seed, self.steps, len(self._params), i)))
        elif self.update == "kahan":
            self._comp[i] = _kahan(p, y)
        else:
            p.copy_(y)  # round to nearest even
        state = self.optimizer.state.pop(y, {})
        plain, low = {}, {}
        for name, v in state.items():
            if not _is_moment(v, p):
                plain[name] = v
            elif self.states is None:
                plain[name] = v.to(p.dtype)
            else:
                low[name] = _encode(v, self.states, ts.signed_for(name))
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


# -- the compiled CPU paths (``numerics/_state_kernel.py``: the same bits as the ops route) ----------------
def _compiled(t: torch.Tensor):
    return state_codes.compiled() if t.device.type == "cpu" else None


def _stochastic(y: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """float32 ``y`` rounded stochastically onto ``dtype``: ``quantize(y, fmt, "stochastic", seed)``."""
    kernel = _compiled(y)
    if kernel is None or dtype != torch.bfloat16:
        return quantize(y, _LOW[dtype], rounding="stochastic", seed=seed)
    y = y.contiguous()
    out = torch.empty(y.shape, dtype=torch.bfloat16)
    kernel.stochastic_bf16(_bits(y, np.uint32), _bits(out), np.uint64(mix(seed)))
    return out


def _bits(t: torch.Tensor, dtype=np.uint16) -> np.ndarray:
    """The flat numpy view of a contiguous CPU tensor's bits."""
    return t.view(torch.int16 if dtype == np.uint16 else torch.int32).numpy().view(dtype).reshape(-1)


def _widen(t: torch.Tensor, comp: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` (+ ``comp``) in float32: exact for one 16-bit tensor, float32's sum for two."""
    kernel = _compiled(t)
    if kernel is None or t.dtype != torch.bfloat16 or not t.is_contiguous():
        return t.float() if comp is None else t.float() + comp.float()
    out = torch.empty(t.shape, dtype=torch.float32)
    if comp is None:
        kernel.widen_bf16(_bits(t), _bits(out, np.uint32))
    else:
        kernel.widen_add_bf16(_bits(t), _bits(comp.contiguous()), out.numpy().reshape(-1))
    return out


def _kahan(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``p = nearest(y)`` in place; returns the compensation ``nearest(y - p)`` in ``p``'s dtype."""
    kernel = _compiled(p)
    if kernel is None or p.dtype != torch.bfloat16 or not p.is_contiguous():
        p.copy_(y)
        return (y - p.float()).to(p.dtype)
    comp = torch.empty_like(p)
    kernel.kahan_bf16(y.contiguous().numpy().reshape(-1), _bits(p), _bits(comp))
    return comp


def _encode(v: torch.Tensor, form: str, signed: bool) -> dict:
    if form != "int8" or _compiled(v) is None:
        return state_codes.encode(xp, v, form, signed)
    return {k: torch.from_numpy(a) for k, a in state_codes.encode_int8_compiled(v.numpy(), signed).items()}


def _decode(stored: dict, form: str, p: torch.Tensor, signed: bool) -> torch.Tensor:
    if form != "int8" or _compiled(stored["codes"]) is None:
        return state_codes.decode(xp, stored, form, tuple(p.shape), signed)
    codes = stored["codes"]
    flat = state_codes.decode_int8_compiled(codes.numpy(), stored["scale"].numpy(), signed)
    return torch.from_numpy(flat).reshape(p.shape)


def _first_wide(params) -> torch.dtype:
    return next(p.dtype for p in params if p.dtype not in _LOW)


def _is_moment(v: Any, p: torch.Tensor) -> bool:
    """A per-element state tensor of ``p`` (Adam's ``exp_avg``, SGD's ``momentum_buffer``): stored low."""
    return torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape
