"""``polyamp tune`` in PyTorch: the knobs that change a training step's speed, and the steps to time.

``tune(model, batch, loss_fn, optimizer)`` takes the doctor's convention (``polyamp/torch/doctor.py``:
``batch`` a tensor, an ``(inputs, targets)`` pair or a dict, or a callable ``i -> batch``; ``loss_fn``
None when the model returns its loss) and an optimizer whose class and hyper-parameters every candidate
rebuilds on its own copy of the model, so all start from the same weights and see the same batches.

Knobs (the first value is the default):
- ``optimizer``: ``as given`` / ``foreach`` (one multi-tensor kernel per operation) / ``fused`` (one
  kernel per step; CPU and CUDA since torch 2.4) for optimizers that take those flags;
- ``compile``: ``torch.compile`` of the model (TorchInductor), off / on;
- ``threads``: intra-op threads, ``torch.get_num_threads()`` / half of them;
- ``channels_last``: for a model with 2-d convolutions, its memory format, off / on;
- ``attention``: for a model that calls ``scaled_dot_product_attention`` (or has an
  ``nn.MultiheadAttention``), torch's choice of kernel (``default``: flash attention on CPU) or its
  ``math`` one (matmuls and a softmax, ``torch.nn.attention.sdpa_kernel``). A Hugging Face model reaches
  its attention through ``config._attn_implementation`` (transformers' ``ALL_ATTENTION_FUNCTIONS``), which
  no source of its own names: for it the values are ``default`` (as configured), ``math`` (when
  configured ``sdpa``: its kernel as above) and transformers' other implementation of ``sdpa`` and
  ``eager`` (its own matmuls and softmax), set the transformers way (``set_attn_implementation``).

``apply(report, model, optimizer)`` returns ``(mp, model, optimizer)`` set up as the report's best.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..errors import PolyampError
from ..mixed_precision import MixedPrecision
from ..tune.search import tune as search
from ..tune.space import Candidate, Knob

_OPTIMIZER = "optimizer"
# what a first torch.compile of a training step adds to a build, until one is measured: it grows with the
# graph (on this 2-core CPU: tens of seconds for a 5-layer MLP, a minute or more for a 2-layer GPT-2)
COMPILE_S, COMPILE_S_PER_MODULE = 10.0, 1.5


def knobs(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Knob]:
    """The knobs that apply to this model and optimizer (module docstring)."""
    out: dict[str, Knob] = {}
    flags = inspect.signature(type(optimizer)).parameters
    impls = tuple(v for v in ("foreach", "fused") if v in flags)
    if impls:
        out[_OPTIMIZER] = Knob(("as given", *impls), "the optimizer runs its {value} implementation")
    out["compile"] = Knob((False, True), "torch.compile {value}: TorchInductor fuses the model's elementwise "
                          "work around its matmuls", build_s=COMPILE_S + COMPILE_S_PER_MODULE
                          * sum(1 for _ in model.modules()))  # fmt: skip
    n = torch.get_num_threads()
    if n > 1:
        out["threads"] = Knob((n, n // 2), "{value} intra-op threads")
    if any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
        out["channels_last"] = Knob((False, True), "channels-last memory format {value} for the convolutions")
    hf = _hf_model(model)
    if hf is not None:
        impl = hf.config._attn_implementation
        values = ("default", *(("math",) if impl == "sdpa" else ()), *(v for v in _HF_ATTENTION if v != impl))
        out["attention"] = Knob(values, f"transformers' attention {{value}} (default: as configured, {impl}; "
                                "math: sdpa on torch's math kernel; sdpa or eager: transformers' "
                                "implementation of that name)")  # fmt: skip
    elif _uses_attention(model):
        out["attention"] = Knob(("default", "math"), "scaled_dot_product_attention's {value} kernel")
    return out


_HF_ATTENTION = ("sdpa", "eager")  # transformers' implementations on every device (flash ones need CUDA)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost module whose ``config`` names a Hugging Face attention implementation (a
    ``PreTrainedModel``, or one inside the user's module), else None."""
    for m in model.modules():
        if isinstance(getattr(getattr(m, "config", None), "_attn_implementation", None), str):
            return m
    return None


def _set_hf_attention(model: torch.nn.Module, impl: str) -> None:
    """Switch a Hugging Face model's attention to ``impl`` (``set_attn_implementation`` where
    transformers has it, else the config attribute its layers read at each call)."""
    hf = _hf_model(model)
    if hf is None:
        raise PolyampError(f"attention={impl!r} is a Hugging Face attention implementation; this model "
                           "has no config._attn_implementation")  # fmt: skip
    if callable(getattr(hf, "set_attn_implementation", None)):
        hf.set_attn_implementation(impl)
    else:
        hf.config._attn_implementation = impl


def _uses_attention(model: torch.nn.Module) -> bool:
    """Whether a module is an ``nn.MultiheadAttention`` or its class's ``forward`` calls
    ``scaled_dot_product_attention`` (read from its source, where there is one)."""
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            return True
        try:
            if "scaled_dot_product_attention" in inspect.getsource(type(m).forward):
                return True
        except (OSError, TypeError):
            continue
    return False


def _attend(model: torch.nn.Module, kernel: str) -> None:
    """Run ``model``'s forward inside the ``attention`` knob's kernel choice. The choice wraps the forward
    itself (an instance attribute), so that ``torch.compile(model)`` traces it: a context entered around
    a compiled call is not seen by the compiled graph. The backward follows the kernel the forward ran.
    ``sdpa`` / ``eager``: a Hugging Face model's attention implementation, switched."""
    if kernel == "default":
        return
    if kernel in _HF_ATTENTION:
        _set_hf_attention(model, kernel)
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    inner = model.forward

    def forward(*args, **kwargs):
        with sdpa_kernel([SDPBackend.MATH]):
            return inner(*args, **kwargs)

    model.forward = forward


class Tunable:
    """The search's view of one torch model (``polyamp.tune.space.Tunable``)."""

    framework = "torch"

    def __init__(self, model, batch, loss_fn, optimizer, name: str = "model", device: str | None = None):
        if not isinstance(model, torch.nn.Module):
            raise PolyampError(f"tune takes a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PolyampError(f"tune rebuilds the optimizer per configuration: give a torch.optim.Optimizer "
                               f"of the model's parameters; received {type(optimizer).__name__}")  # fmt: skip
        self.name = name
        self.initial = copy.deepcopy(model).cpu().state_dict()
        self.model = model
        self.batch = batch if callable(batch) else (lambda i: batch)
        self.loss_fn = loss_fn
        owned = {id(p) for p in model.parameters()}
        if not all(id(p) in owned for p in _source_parameters(optimizer)):
            raise PolyampError("tune rebuilds the optimizer over a copy of the model: its parameters must be "
                               "the model's own (model.parameters())")  # fmt: skip
        self.optimizer = optimizer
        self.device = device or next((p.device.type for p in model.parameters()), "cpu")
        self.knobs = knobs(model, optimizer)

    def build(self, candidate: Candidate) -> _Step:
        return _Step(self, candidate)


class _Step:
    """One configuration's model, optimizer and step (``polyamp.tune.space.Step``)."""

    def __init__(self, tunable: Tunable, candidate: Candidate):
        s = dict(candidate.settings)
        self.tunable = tunable
        model = copy.deepcopy(tunable.model)
        model.load_state_dict(tunable.initial)
        if s.get("channels_last"):
            model = model.to(memory_format=torch.channels_last)
        self.optimizer = rebuild(tunable.optimizer, model, s.get(_OPTIMIZER, "as given"), tunable.model)
        self.mp = MixedPrecision(candidate.policy, framework="torch", device=tunable.device)
        self.mp.watch(model)
        self.model = model
        _attend(model, s.get("attention", "default"))
        self.forward = torch.compile(model) if s.get("compile") else model
        self.threads = s.get("threads")

    def step(self, i: int) -> float:
        before = torch.get_num_threads()
        if self.threads is not None and self.threads != before:
            torch.set_num_threads(self.threads)
        try:
            x, y = _split(self.tunable.batch(i))
            self.optimizer.zero_grad(set_to_none=True)
            with self.mp.autocast():
                out = _call(self.forward, x)
                loss = _loss(self.tunable.loss_fn, out, y)
            self.mp.backward(loss)
            self.mp.step(self.optimizer)
            return float(loss.detach())
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def close(self) -> None:
        self.model = self.forward = self.optimizer = self.mp = None


def rebuild(optimizer: torch.optim.Optimizer, model: torch.nn.Module, impl: str,
            source: torch.nn.Module | None = None) -> torch.optim.Optimizer:  # fmt: skip
    """An optimizer of ``optimizer``'s class and hyper-parameters (per group) over ``model``'s parameters;
    ``source``: the model ``optimizer`` holds the parameters of (``model`` itself by default; a copy of it
    otherwise, whose parameters correspond in order); ``impl``: ``as given``, ``foreach``, ``fused``."""
    index = {id(p): i for i, p in enumerate((source or model).parameters())}
    params = list(model.parameters())
    groups = []
    for group in optimizer.param_groups:
        g = {k: v for k, v in group.items() if k != "params"}
        if impl != "as given":
            g.update(foreach=impl == "foreach", fused=impl == "fused")
        try:
            g["params"] = [params[index[id(p)]] for p in group["params"]]
        except KeyError as err:
            raise PolyampError("tune rebuilds the optimizer over a copy of the model: its parameters must be "
                               "the model's own (model.parameters())") from err  # fmt: skip
        groups.append(g)
    accepted = inspect.signature(type(optimizer)).parameters
    defaults = {k: v for k, v in groups[0].items() if k in accepted and k != "params"} if groups else {}
    return type(optimizer)(groups, **defaults)


def _source_parameters(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _split(batch) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, batch


def _call(model, x):
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, tuple):
        return model(*x)
    return model(x)


def _loss(loss_fn, out, y):
    if loss_fn is not None:
        return loss_fn(out, y)
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    return getattr(out, "loss", out)


def tune(model, batch, loss_fn, optimizer, *, policies=("bf16-mixed",), budget_s: float = 120.0,
         parity_steps: int = 6, rtol: float = 0.05, min_gain: float = 0.03, name: str = "model",
         progress: Callable | None = None):  # fmt: skip
    """``polyamp.tune`` for a torch model (module docstring; the search: ``polyamp/tune/search.py``)."""
    tunable = Tunable(model, batch, loss_fn, optimizer, name)
    return search(tunable, policies, budget_s, parity_steps, rtol, min_gain, progress)


def apply(report, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """``(mp, model, optimizer)`` configured as ``report.best``: the policy's ``MixedPrecision`` watching
    the model (compiled if chosen), the optimizer rebuilt in the chosen implementation, the thread count
    set for the process, and the chosen attention kernel around the model's forward (its backward
    follows the kernel the forward ran; a Hugging Face model's ``sdpa`` / ``eager`` implementation
    switched on the model itself)."""
    if report.framework != "torch":
        raise PolyampError(f"this report tuned {report.framework}, not torch")
    s = report.settings
    if s.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    optimizer = rebuild(optimizer, model, s.get(_OPTIMIZER, "as given"))
    if s.get("threads"):
        torch.set_num_threads(int(s["threads"]))
    mp = MixedPrecision(report.policy, framework="torch", device=next(model.parameters()).device.type)
    mp.watch(model)
    _attend(model, s.get("attention", "default"))
    return mp, (torch.compile(model) if s.get("compile") else model), optimizer
