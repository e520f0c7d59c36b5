"""The doctor's PyTorch taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the torch idiom): ``model`` is an ``nn.Module``; ``batch`` is a tensor (``model(batch)``, and the
loss is ``loss_fn(outputs, batch)``), a pair ``(inputs, targets)`` (``model(inputs)``, or ``model(*inputs)`` /
``model(**inputs)`` for a tuple / dict of inputs; the loss is ``loss_fn(outputs, targets)``, so
``nn.functional.mse_loss`` fits as is), or a dict (``model(**batch)``; ``loss_fn(outputs, batch)``). With
``loss_fn=None`` the outputs must be the scalar loss (or carry it as ``outputs["loss"]`` / ``outputs.loss``).

Algorithm: snapshot gradients, buffers, train/eval flags and the RNG; put the model in train mode, autocast
off; with an ``optimizer``, let it step working copies: each parameter it steps gets a copy of its value
as ``.data`` and each parameter's optimizer state a copy of its tensors (the originals stay untouched and
are put back); then ``steps`` ordinary float32 steps with taps:
- every leaf module (named by ``named_modules``): a forward hook bins each floating output ("output") and
  puts a tensor hook on it that bins the gradient w.r.t. it ("grad_output");
- every parameter, grouped to the leaf module that owns it (a parameter owned directly by a module with
  children is a layer of its own, named by ``named_parameters``): its value before the step ("weight") and
  its ``.grad`` after backward ("grad_weight");
- with an ``optimizer``: ``optimizer.step()``, then per parameter it steps its value before the step
  ("weight") and the update ``after - before`` binned relative to it ("update_ratio", the core's
  ``update_ratio_histogram``). Without one, no updates are observed.
Then (also when the loss or the model raises) everything is put back, bitwise. One ``Observation`` per
(layer, kind): layers in module order, kinds in ``KINDS`` order, steps and calls merged.

Binning: ``binning.py`` (on the device, exact; the last step's update goes into its gradients and working
values, which nothing reads any more).

Measured formats (``measure``: block formats and recipes, ``doctor/blocks.py``): each output, output
gradient, weight (at the start of each step) and weight gradient is cast on its device by
``polyamp.torch.quantize`` (``quantize_blocks``; tensorwise ``quantize(fp32(x * scale), saturate) /
scale``) and counted there (``measure_tensor``); the blocks' amaxes go to the host for the clip
thresholds (``blocks.plan``), so each tensor and target costs a host round trip. A recipe measures only
the operands its torch GEMMs quantize, on the modules the recipe can quantize (``_Meter``); a ``Conv1D``
weight ``(in, out)`` is measured transposed.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import numpy as np
import torch
from torch import nn

from ..doctor import blocks as _blocks
from ..doctor.recommend import KINDS, Observation
from ..doctor.taps import leaves as _leaves
from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..frameworks import detect
from . import binning as _binning
from . import xp
from .binning import Part, Scratch, binned, binned_many, merged, ratio_binned, ratio_bits, settle

_MASK, _INF = 0x7FFFFFFF, 0x7F800000


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None, measure=()) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its gradients and
    ``optimizer`` are left exactly as they were (module docstring). ``measure``: ``blocks.Target``s."""
    _check(model, batch, loss_fn, steps, optimizer)
    meter = _Meter(tuple(measure), model) if measure else None
    layers = _layers(model)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    opt_params = list({id(p): p for p in opt_params}.values())
    stepped = {id(p) for p in opt_params}
    params = list({id(p): p for p in [*model.parameters(), *opt_params]}.values())
    grads = [(p, p.grad) for p in params]
    buffers = [(name, b, b.detach().clone()) for name, b in model.named_buffers()]
    modes = [(m, m.training) for m in model.modules()]
    found: dict[tuple[str, str], list[Part]] = defaultdict(list)
    handles, scratch = [], Scratch()  # closed at the end
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=cuda))
            stack.enter_context(torch.enable_grad())
            for device_type in sorted({p.device.type for p in params}):
                stack.enter_context(torch.autocast(device_type, enabled=False))
            before, spare = {}, None  # each stepped parameter's value before this step (first: its own)
            if optimizer is not None:
                copies = _WorkingCopies(optimizer, opt_params, {id(g) for _, g in grads if g is not None})
                before, spare = stack.enter_context(copies), copies.spare
            model.train()
            handles = [m.register_forward_hook(_output_hook(name, found, scratch, meter))
                       for name, m, _ in layers if m is not None]  # fmt: skip
            if meter:
                handles += meter.input_hooks(model)
            for step in range(steps):
                for p in params:
                    p.grad = None
                unstepped = [(n, p) for n, _, ps in layers for p in ps if id(p) not in stepped]
                _bin_into(found, "weight", unstepped, scratch)  # a stepped one's is binned with its update
                if meter:
                    meter.produced.clear()
                    meter.add_all("weight", [(n, p) for n, _, ps in layers for p in ps])
                _loss(model, batch, loss_fn).backward()
                _bin_into(found, "grad_weight", [(n, p.grad) for n, _, ps in layers for p in ps
                                                 if p.grad is not None], scratch)  # fmt: skip
                if meter:
                    meter.add_all("grad_weight", [(n, p.grad, p) for n, _, ps in layers for p in ps
                                                  if p.grad is not None])  # fmt: skip
                if optimizer is None:
                    continue
                optimizer.step()
                last = step + 1 == steps  # then gradients and working values are spare memory
                now = [(n, p) for n, _, ps in layers for p in ps if id(p) in stepped]
                batched = _binning.updates_many([(p, before[id(p)]) for _, p in now])
                for (name, p), both in zip(now, batched):
                    weight, update = both or _update(p, before[id(p)], scratch, spare(p) if last else ())
                    found[name, "weight"].append(weight)
                    found[name, "update_ratio"].append(update)
                if step + 1 < steps:  # later steps start from a copy (the originals stay as they are)
                    before = {id(p): _copy(p) if step == 0 else before[id(p)].copy_(p.detach())
                              for p in opt_params}  # fmt: skip
    finally:
        scratch.__exit__()
        for h in handles:
            h.remove()
        if meter:
            meter.produced.clear()
        with torch.no_grad():
            for p, grad in grads:
                p.grad = grad
            current = dict(model.named_buffers())
            for name, b, value in buffers:
                if current.get(name) is not b:  # a module re-assigned its buffer: put the original back
                    owner, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(owner), attr, b)
                b.copy_(value)
        for m, training in modes:
            m.training = training
    keys = list(found)  # on an accelerator: everything read back at once
    flat = iter(settle([part for key in keys for part in found[key]]))
    found = {key: [next(flat) for _ in found[key]] for key in keys}
    parts = meter.parts if meter else {}
    return [Observation(name, kind, merged(found[name, kind]), _blocks.merged(parts, (name, kind)))
            for name, _, _ in layers for kind in KINDS if found.get((name, kind))]  # fmt: skip


class _Meter:
    """The measured targets' statistics of each tapped tensor: ``parts[(layer, kind)][label]``.

    A block format measures every tapped tensor. A recipe (``recipe:...``) measures only the operands its
    torch GEMMs quantize, on the modules ``recipe.matmul_modules`` names quantizable (``nn.Linear``,
    ``nn.ConvNd``, transformers' ``Conv1D``, kept ones too): their ``weight`` parameters, the gradients of
    their outputs, and their inputs, filed as the output of the leaf module that produced them (an input no
    leaf module produced, such as the model's own input or a reshaped attention output, is not measured).
    A weight stored ``(in, out)`` (``Conv1D``) and its gradient are measured transposed, in the GEMM's
    ``(out, in)`` layout, for every target."""

    def __init__(self, targets: tuple, model: nn.Module):
        from .recipe import matmul_modules

        self.targets = targets
        self.parts: dict = defaultdict(lambda: defaultdict(list))
        gemms = [(n, m, how) for n, m, how in matmul_modules(model) if not how.startswith("unsupported")]
        self.gemms = {n: m for n, m, _ in gemms}
        self.weights = {id(m.weight) for _, m, _ in gemms if isinstance(getattr(m, "weight", None),
                                                                       torch.Tensor)}  # fmt: skip
        self.transposed = {id(m.weight) for _, m, how in gemms if how == "transposed"}
        self.produced: dict[int, tuple[str, torch.Tensor]] = {}  # id(a leaf's output) -> (leaf, output)

    def add(self, name: str, kind: str, t: torch.Tensor, recipes: bool = True, blocks: bool = True) -> None:
        for target in self.targets:
            recipe = target.label.startswith(_blocks.PREFIX)
            if kind in target.casts and (recipes if recipe else blocks):
                self.parts[name, kind][target.label].append(measure_tensor(t, target.casts[kind]))

    def add_all(self, kind: str, named: list) -> None:
        """``(layer, parameter)`` or ``(layer, gradient, parameter)`` entries of a weight kind."""
        for name, t, *param in named:
            p = param[0] if param else t
            self.add(name, kind, t.t() if id(p) in self.transposed else t, recipes=id(p) in self.weights)

    def output(self, name: str, t: torch.Tensor) -> None:
        """A leaf's output: measured by the block formats; remembered for the recipes (``input_hooks``)."""
        self.add(name, "output", t, recipes=False)
        if any(target.label.startswith(_blocks.PREFIX) for target in self.targets):
            self.produced[id(t)] = (name, t)

    def input_hooks(self, model: nn.Module) -> list:
        """Forward pre-hooks on the quantizable modules: each input a leaf produced is measured (once) by
        the recipes as that leaf's output."""

        def hook(module, args):
            x = args[0] if args else None
            known = self.produced.get(id(x)) if isinstance(x, torch.Tensor) else None
            if known is not None and known[1] is x:
                del self.produced[id(x)]
                self.add(known[0], "output", x, blocks=False)

        return [m.register_forward_pre_hook(hook) for m in self.gemms.values()]


def measure_tensor(t: torch.Tensor, cast: _blocks.Cast) -> _blocks.Measured:
    """``blocks.measure`` of a torch tensor, on its device (``blocks.measure_on`` over ``xp``, whose
    measurement ops cast with ``polyamp.torch.quantize``'s kernels)."""
    return _blocks.measure_on(xp, t, cast)


def _bin_into(found, kind: str, named: list, scratch: Scratch) -> None:
    """Bin each ``(layer, tensor)`` of ``named`` into ``found[layer, kind]`` (``binned_many``)."""
    for (name, _), part in zip(named, binned_many([t for _, t in named], scratch)):
        found[name, kind].append(part)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; a large contiguous CPU tensor is copied into numpy-allocated memory, which the
    kernel backs with huge pages: 2-3x faster to fill than a fresh torch allocation on this project's
    machine (benchmarks/host_copy_torch.py), the cost the working copies are made of."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < 1 << 20:
        return t.clone()
    raw = torch.from_numpy(np.empty(t.numel() * t.element_size(), np.uint8))
    return raw.view(t.dtype).view(t.shape).copy_(t)


class _WorkingCopies:
    """The optimizer steps copies: entering gives each parameter it steps a copy of its value as ``.data``
    and each parameter's state a copy (tensors copied, the rest deep-copied); exiting puts back the
    originals, which nothing wrote: the parameters' storages, the state's dicts and tensors, the groups'
    hyper-parameters, and what an LR scheduler reads to tell whether ``optimizer.step()`` ran. Entering
    returns ``{id(parameter): its original value}``: the value before the first step."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], users: set[int]):
        self.optimizer = optimizer
        self.data = [(p, p.data) for p in params]
        self.state = dict(optimizer.state)
        self.groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]  # fmt: skip
        self.opt_called = vars(optimizer).get("_opt_called")
        self.users = users  # ids of the gradients the user had: never spare
        self.working: dict[int, torch.Tensor] = {}

    def __enter__(self) -> dict[int, torch.Tensor]:
        try:
            for p, data in self.data:
                self.working[id(p)] = p.data = _copy(data)
            for p, s in self.state.items():
                self.optimizer.state[p] = {k: _copy(v) if torch.is_tensor(v) else copy.deepcopy(v)
                                           for k, v in s.items()}  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return {id(p): data for p, data in self.data}

    def spare(self, p: torch.Tensor) -> tuple:
        """After the last step: ``p``'s gradient and working value, which nothing reads any more (unless
        the gradient is one the user had, or the optimizer swapped ``p.data`` for a tensor of its own)."""
        grad = p.grad if id(p.grad) not in self.users else None
        working = self.working.get(id(p))
        return grad, working if working is not None and p.data.data_ptr() == working.data_ptr() else None

    def __exit__(self, *exc) -> None:
        for p, data in self.data:
            p.data = data
        state = self.optimizer.state
        state.clear()
        state.update(self.state)
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            group.update(saved)
        vars(self.optimizer).pop("_opt_called", None)
        if self.opt_called is not None:
            self.optimizer._opt_called = self.opt_called


def _update(p: torch.Tensor, before: torch.Tensor, scratch: Scratch, spare: tuple = ()):
    """The histograms of ``before`` (``p``'s value before this step) and of this step's update ratio: in
    one pass of the compiled kernel where it applies (``weight_and_ratio``); else the update and the
    weight's exponent bits go into ``spare`` tensors (memory nothing reads any more: the
    last step's gradient and working value) where they fit, else into scratch."""
    both = _binning.weight_and_ratio(p, before)
    if both is not None:
        return both
    w = before.reshape(-1)
    n = w.numel()
    weight = binned(w, scratch)
    if p.dtype != torch.float32 or not n:
        return weight, ratio_binned(p.detach() - before, before, scratch)
    free = [t.detach().view(-1) for t in spare if t is not None and t.dtype == torch.float32
            and t.layout == torch.strided and t.is_contiguous() and t.numel() == n
            and t.device == w.device]  # fmt: skip
    u = free.pop(0) if free else scratch("u", n, torch.int32, w.device).view(torch.float32)
    au = torch.sub(p.detach().reshape(-1), w, out=u).view(torch.int32).bitwise_and_(_MASK)
    e = free.pop(0).view(torch.int32) if free else scratch("a", n, torch.int32, w.device)
    return weight, ratio_bits(au, torch.bitwise_and(w.view(torch.int32), _INF, out=e), w, scratch, weight)


def _check(model, batch, loss_fn, steps, optimizer) -> None:
    if not isinstance(model, nn.Module):
        raise PolyampError(f"model: expected a torch.nn.Module, got {_type(model)}")
    if not any(p.requires_grad for p in model.parameters()):
        which = "no parameters" if not list(model.parameters()) else "no parameter that requires grad"
        raise PolyampError(f"model {_type(model)} has {which}; the doctor observes the weights it trains")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolyampError(f"steps must be a whole number >= 1, got {steps!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise PolyampError(f"loss_fn must be callable(outputs, targets) or None, got {_type(loss_fn)}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise PolyampError(f"optimizer: expected a torch.optim.Optimizer or None, got {_type(optimizer)}")
    for leaf in _leaves(batch):
        if isinstance(leaf, np.ndarray) or detect(leaf) not in (None, "torch"):
            raise PolyampError(
                f"batch: expected torch tensors, got {_type(leaf)}; convert "
                "it (torch.from_numpy, torch.as_tensor) or pass a batch of the model's framework"
            )
    if isinstance(batch, (tuple, list)) and len(batch) != 2:
        raise PolyampError(f"batch: expected a tensor, an (inputs, targets) pair or a dict, got a "
                           f"{type(batch).__name__} of {len(batch)} items")  # fmt: skip


def _layers(model: nn.Module) -> list[tuple[str, nn.Module | None, list[torch.Tensor]]]:
    """(layer name, leaf module or None, its parameters) in module order; each parameter once."""
    layers, seen = [], set()
    for name, m in model.named_modules():
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for _, p in own)
        if next(m.children(), None) is None:
            layers.append((name or type(m).__name__, m, [p for _, p in own]))
        else:
            layers += [(f"{name}.{n}" if name else n, None, [p]) for n, p in own]
    return layers


def _output_hook(name: str, found, scratch: Scratch, meter: _Meter | None):
    def grad_hook(grad):
        found[name, "grad_output"].append(binned(grad, scratch))
        if meter:
            meter.add(name, "grad_output", grad, recipes=name in meter.gemms)

    def hook(module, inputs, output):
        for t in _leaves(output):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                found[name, "output"].append(binned(t, scratch))
                if meter:
                    meter.output(name, t)
                if t.requires_grad:
                    t.register_hook(grad_hook)

    return hook


def _loss(model, batch, loss_fn) -> torch.Tensor:
    inputs, targets = batch if isinstance(batch, (tuple, list)) else (batch, batch)
    try:
        if isinstance(inputs, dict):
            outputs = model(**inputs)
        else:
            outputs = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
    except (RuntimeError, TypeError) as err:
        shapes = [tuple(t.shape) for t in _leaves(inputs) if isinstance(t, torch.Tensor)]
        raise PolyampError(f"the model's forward failed on the batch (input shapes {shapes}): {err}") from err
    if loss_fn is not None:
        loss = loss_fn(outputs, targets)
    elif isinstance(outputs, dict) and "loss" in outputs:
        loss = outputs["loss"]
    else:
        loss = getattr(outputs, "loss", outputs)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = f"shape {tuple(loss.shape)} {loss.dtype}" if isinstance(loss, torch.Tensor) else _type(loss)
        source = "loss_fn(outputs, targets)" if loss_fn is not None else "the model (loss_fn=None)"
        raise PolyampError(f"{source} must return a scalar floating-point loss tensor, got {what}")
    if not loss.requires_grad:
        raise PolyampError("the loss does not depend on any parameter that requires grad")
    return loss
