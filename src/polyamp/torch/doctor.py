"""The doctor's PyTorch taps: ``collect(model, batch, loss_fn)`` -> ``list[Observation]``.

Convention (the torch idiom): ``model`` is an ``nn.Module``; ``batch`` is a tensor (``model(batch)``, and the
loss is ``loss_fn(outputs, batch)``), a pair ``(inputs, targets)`` (``model(inputs)``, or ``model(*inputs)`` /
``model(**inputs)`` for a tuple / dict of inputs; the loss is ``loss_fn(outputs, targets)``, so
``nn.functional.mse_loss`` fits as is), or a dict (``model(**batch)``; ``loss_fn(outputs, batch)``). With
``loss_fn=None`` the outputs must be the scalar loss (or carry it as ``outputs["loss"]`` / ``outputs.loss``).

Algorithm: snapshot parameters, gradients, buffers, train/eval flags, the RNG and ``optimizer.state_dict()``
(deep copy); put the model in train mode, autocast off; then ``steps`` ordinary float32 steps with taps:
- every leaf module (named by ``named_modules``): a forward hook bins each floating output ("output") and
  puts a tensor hook on it that bins the gradient w.r.t. it ("grad_output");
- every parameter, grouped to the leaf module that owns it (a parameter owned directly by a module with
  children is a layer of its own, named by ``named_parameters``): its value before the step ("weight") and
  its ``.grad`` after backward ("grad_weight");
- with an ``optimizer``: ``optimizer.step()``, and the update ``after - before`` of each parameter binned
  relative to its weight ("update_ratio", the core's ``update_ratio_histogram``). Without one, no updates
  are observed.
Then (in a ``finally``, also when the loss or the model raises) everything is put back, bitwise. One
``Observation`` per (layer, kind): layers in module order, kinds in ``KINDS`` order, steps and calls merged.

Binning (``histogram``) happens on the tensor's device; only the 4096 counts and four scalars reach the host.
A float32 (fp16, bf16 and fp8 are widened exactly) is read as int32 bits: ``a = bits & 0x7fffffff`` orders
magnitudes as integers, and for a normal float ``a >> 19`` is ``SUB * biased exponent + k``, the spec's
index less a constant; one ``bincount`` over it counts everything but zeros (``count_nonzero``), subnormals
(rare: re-binned from ``float(a)``) and inf/NaN (the top keys). ``aminmax(a)`` gives the extremes, or when
zeros or inf/NaN are present, ``min((a - 1) & 0x7fffffff) + 1`` and ``max((a - 0x7f800000) & 0x7fffffff)``.
An update ratio ``|u| / 2^b(w)`` of normal ``u``, ``w`` is the float whose bits are ``a(u) - (a(w) &
0x7f800000) + 0x3f800000``, binned as above; other elements (and float64) take ``torch.frexp``, in float64.
The result equals ``LogHistogram.of(t.cpu().numpy())`` (``update_ratio_histogram``) exactly; on CUDA each
tapped tensor costs a few small host reads (synchronisations).
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import numpy as np
import torch
from torch import nn

from ..doctor.histogram import B_MIN, N_BINS, SUB, LogHistogram
from ..doctor.recommend import KINDS, Observation
from ..doctor.taps import leaves as _leaves
from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..frameworks import detect

_MASK, _INF, _NORMAL, _ONE = 0x7FFFFFFF, 0x7F800000, 0x00800000, 0x3F800000
_SHIFT = 23 - (SUB.bit_length() - 1)  # a >> _SHIFT = SUB * biased exponent + k (SUB a power of two)
_OFFSET = SUB * (-127 - B_MIN) + 1  # spec index - key for a normal float32
_KEYS, _KEY_NORMAL, _KEY_INF = (_MASK >> _SHIFT) + 1, _NORMAL >> _SHIFT, _INF >> _SHIFT


def collect(model, batch, loss_fn=None, *, steps: int = 1, optimizer=None) -> list[Observation]:
    """Observe ``steps`` float32 training steps of ``model`` on ``batch``; the model, its gradients and
    ``optimizer`` are left exactly as they were (module docstring)."""
    _check(model, batch, loss_fn, steps, optimizer)
    layers = _layers(model)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    stepped = {id(p) for p in opt_params}
    params = list({id(p): p for p in [*model.parameters(), *opt_params]}.values())
    # without an optimizer nothing writes a parameter: gradients are put back, values need no copy
    saved = [(p, _copy(p) if optimizer is not None else None, p.grad) for p in params]
    buffers = [(name, b, b.detach().clone()) for name, b in model.named_buffers()]
    modes = [(m, m.training) for m in model.modules()]
    opt_state = _OptimizerSnapshot(optimizer) if optimizer is not None else None
    # what an LR scheduler reads to tell whether optimizer.step() ran; outside state_dict
    opt_called = vars(optimizer).get("_opt_called") if optimizer is not None else None
    found: dict[tuple[str, str], list[LogHistogram]] = defaultdict(list)
    handles, scratch = [], _Scratch()
    cuda = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=cuda))
            stack.enter_context(torch.enable_grad())
            for device_type in sorted({p.device.type for p in params}):
                stack.enter_context(torch.autocast(device_type, enabled=False))
            model.train()
            handles = [m.register_forward_hook(_output_hook(name, found, scratch))
                       for name, m, _ in layers if m is not None]  # fmt: skip
            before = {id(p): v for p, v, _ in saved}  # each parameter before this step
            for step in range(steps):
                for p in params:
                    p.grad = None
                for name, _, ps in layers:
                    found[name, "weight"] += [histogram(p, scratch) for p in ps]
                _loss(model, batch, loss_fn).backward()
                for name, _, ps in layers:
                    grads = [p.grad for p in ps if p.grad is not None]
                    found[name, "grad_weight"] += [histogram(g, scratch) for g in grads]
                if optimizer is None:
                    continue
                optimizer.step()
                for name, _, ps in layers:
                    ps = [p for p in ps if id(p) in stepped]
                    found[name, "update_ratio"] += [_update(p, before[id(p)], scratch) for p in ps]
                if step + 1 < steps:  # the snapshot stays as it is; later steps start from a copy
                    before = {id(p): _copy(p) if step == 0 else before[id(p)].copy_(p.detach())
                              for p in params}  # fmt: skip
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for p, value, grad in saved:
                if value is not None:
                    p.copy_(value)
                p.grad = grad
            current = dict(model.named_buffers())
            for name, b, value in buffers:
                if current.get(name) is not b:  # a module re-assigned its buffer: put the original back
                    owner, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(owner), attr, b)
                b.copy_(value)
        for m, training in modes:
            m.training = training
        if optimizer is not None:
            opt_state.restore()
            vars(optimizer).pop("_opt_called", None)
            if opt_called is not None:
                optimizer._opt_called = opt_called
    return [Observation(name, kind, found[name, kind][0].merge(*found[name, kind][1:]))
            for name, _, _ in layers for kind in KINDS if found.get((name, kind))]  # fmt: skip


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``; a large contiguous CPU tensor is copied into numpy-allocated memory, which the
    kernel backs with huge pages: ~3x faster to fill than a fresh torch allocation on this project's
    machine (benchmarks/host_copy_torch.py), the cost the snapshot is made of."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() < 1 << 20:
        return t.clone()
    raw = torch.from_numpy(np.empty(t.numel() * t.element_size(), np.uint8))
    return raw.view(t.dtype).view(t.shape).copy_(t)


class _OptimizerSnapshot:
    """An optimizer's per-parameter state (tensors cloned: ``deepcopy`` of a state dict copies them
    3x slower here) and its groups' hyper-parameters; ``restore`` puts both back, so that the state
    holds the clones and parameters without state before have none again."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.state = {p: {k: _copy(v) if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()}
                      for p, s in optimizer.state.items()}  # fmt: skip
        self.groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                       for g in optimizer.param_groups]  # fmt: skip

    def restore(self) -> None:
        state = self.optimizer.state
        for p in [p for p in state if p not in self.state]:
            del state[p]
        state.update(self.state)
        for group, saved in zip(self.optimizer.param_groups, self.groups):
            group.update(saved)


def _update(p: torch.Tensor, before: torch.Tensor, scratch: _Scratch) -> LogHistogram:
    """The ratio histogram of this step's update of ``p`` (``before``: its value before the step)."""
    if p.dtype != torch.float32 or not p.numel():
        return ratio_histogram(p.detach() - before, before, scratch)
    au = scratch(2, p)  # the update, then its magnitude's bits, in place
    torch.sub(p.detach(), before, out=au.view(torch.float32).view(p.shape))
    return _ratio_bits(au.bitwise_and_(_MASK), before.reshape(-1), scratch)


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


def _output_hook(name: str, found, scratch: _Scratch):
    def grad_hook(grad):
        found[name, "grad_output"].append(histogram(grad, scratch))

    def hook(module, inputs, output):
        for t in _leaves(output):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                found[name, "output"].append(histogram(t, scratch))
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


class _Scratch:
    """Flat int32 work buffers kept for one ``collect``: a fresh 64 MB tensor costs its page faults on
    every elementwise op (on this project's CPU, 4x the op itself); on the CPU they are numpy-allocated
    (huge pages, ``_copy``)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get((slot, like.device))
        if buf is None or buf.numel() < like.numel():
            buf = (torch.from_numpy(np.empty(like.numel(), np.int32)) if like.device.type == "cpu"
                   else torch.empty(like.numel(), dtype=torch.int32, device=like.device))  # fmt: skip
            self._bufs[slot, like.device] = buf
        return buf[: like.numel()]


def histogram(t: torch.Tensor, scratch: _Scratch | None = None) -> LogHistogram:
    """The ``LogHistogram`` of a floating tensor, binned on its device (module docstring)."""
    x = t.detach().reshape(-1)
    if x.dtype == torch.float64:
        return _ratio64(x, None)
    if not _narrow(x.dtype):
        raise PolyampError(f"cannot bin a {x.dtype} tensor; accepted: floating-point dtypes (real)")
    scratch = scratch or _Scratch()
    x = x.float()
    return _hist_bits(torch.bitwise_and(x.view(torch.int32), _MASK, out=scratch(0, x)), scratch)


def ratio_histogram(update: torch.Tensor, weight: torch.Tensor, scratch: _Scratch | None = None):
    """``update_ratio_histogram(update, weight)`` of the core, binned on the tensors' device."""
    u, w = update.detach().reshape(-1), weight.detach().reshape(-1)
    if u.shape != w.shape:
        raise PolyampError(f"update shape {tuple(update.shape)} differs from weight's {tuple(weight.shape)}")
    if not (_narrow(u.dtype) and _narrow(w.dtype)):
        return _ratio64(u.double(), w.double())
    if not u.numel():
        return _empty()
    scratch = scratch or _Scratch()
    u = u.float()
    return _ratio_bits(torch.bitwise_and(u.view(torch.int32), _MASK, out=scratch(2, u)), w.float(), scratch)


def _narrow(dtype: torch.dtype) -> bool:
    """float32 and the narrower floats (fp16, bf16, fp8), which float32 holds exactly."""
    return dtype.is_floating_point and dtype.itemsize <= 4


def _ratio_bits(au: torch.Tensor, w: torch.Tensor, scratch: _Scratch) -> LogHistogram:
    """``ratio_histogram`` of the update whose magnitudes' bits are ``au`` (flat int32 >= 0, not empty).

    Elements with a zero, subnormal, inf or NaN u or w, or a ratio outside float32's normal range, take the
    float64 path; in s they are replaced by a regular element's ratio, whose bin then gives them back."""
    s = torch.bitwise_and(w.view(torch.int32), _INF, out=scratch(0, w))  # 2^b(w)'s bits (0: w subnormal)
    (ulo, uhi), (wlo, whi) = torch.stack([torch.stack(torch.aminmax(v)) for v in (au, s)]).tolist()
    special = _outside(au, ulo, uhi)
    if not _NORMAL <= wlo <= whi < _INF:
        special = _either(special, _outside(s, wlo, whi))
    s = torch.sub(au, s, out=s).add_(_ONE)  # the bits of |u| / 2^b(w), when u, w and the ratio are normal
    while True:  # at most twice: the regular elements' ratios may leave the normal range too
        idx = special.nonzero().squeeze(1) if special is not None else au.new_empty(0, dtype=torch.long)
        if idx.numel() == au.numel():
            return _ratio64(au.view(torch.float32).double(), w.double())
        if idx.numel():
            fill = int(s[int(torch.argmin(special[: idx.numel() + 1].to(torch.uint8)))])  # a regular one
            s.index_fill_(0, idx, fill)
        lo, hi = torch.stack(torch.aminmax(s)).tolist()
        extra = _outside(s, lo, hi)
        if extra is None:
            break
        special = _either(special, extra)
    regular = _hist_bits(s, scratch, [lo, hi])
    if not idx.numel():
        return regular
    counts = regular.counts.copy()
    counts[min((fill >> _SHIFT) + _OFFSET, N_BINS - 1)] -= idx.numel()
    rare = _ratio64(au[idx].view(torch.float32).double(), w[idx].double())
    return LogHistogram.from_counts(counts, 0, 0, regular.amax, regular.amin_nonzero).merge(rare)


def _outside(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
    """Where the bits ``v`` (with extremes lo, hi) are not those of a normal float; None: nowhere."""
    if lo < _NORMAL:
        return (v < _NORMAL) | (v >= _INF) if hi >= _INF else v < _NORMAL
    return v >= _INF if hi >= _INF else None


def _either(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a.logical_or_(b)


def _empty(zeros: int = 0, apart: int = 0) -> LogHistogram:
    return LogHistogram.from_counts(np.zeros(N_BINS, np.int64), zeros, 0, 0.0, apart=apart)


def _float(bits: int) -> float:
    return float(np.array(bits, np.int32).view(np.float32))


def _hist_bits(a: torch.Tensor, scratch: _Scratch, extremes: list[int] | None = None) -> LogHistogram:
    """The histogram of the float32 magnitudes whose bits are ``a`` (flat int32 >= 0)."""
    n = a.numel()
    if not n:
        return _empty()
    lo, hi = torch.stack(torch.aminmax(a)).tolist() if extremes is None else extremes
    nonzero = int(torch.count_nonzero(a)) if lo == 0 else n
    tmp = scratch(1, a)
    if hi >= _INF:  # the largest finite magnitude: inf/NaN bits wrap below every finite one
        hi = int(torch.sub(a, _INF, out=tmp).bitwise_and_(_MASK).max()) - _NORMAL
    if lo == 0 and nonzero:  # the smallest non-zero magnitude: zero wraps above everything
        lo = int(torch.sub(a, 1, out=tmp).bitwise_and_(_MASK).min()) + 1
    counts = np.zeros(N_BINS, np.int64)
    if lo < _NORMAL and nonzero:  # subnormals: a * 2^-149 with a < 2^23, exactly float(a) * 2^-149
        sub = a[(a > 0) & (a < _NORMAL)].float().view(torch.int32)
        idx = (sub >> _SHIFT) + (_OFFSET - SUB * 149)
        counts += torch.bincount(idx.clamp(0, N_BINS - 1), minlength=N_BINS).cpu().numpy()
    keys = torch.bincount(torch.bitwise_right_shift(a, _SHIFT, out=tmp), minlength=_KEYS).cpu().numpy()
    np.add.at(counts, np.clip(np.arange(_KEY_NORMAL, _KEY_INF) + _OFFSET, 0, N_BINS - 1),
              keys[_KEY_NORMAL:_KEY_INF])  # fmt: skip
    return LogHistogram.from_counts(
        counts,
        zeros=n - nonzero,
        nonfinite=int(keys[_KEY_INF:].sum()),
        amax=_float(hi) if hi > 0 else 0.0,
        amin_nonzero=_float(lo) if 0 < lo < _INF else None,
    )


def _ratio64(u: torch.Tensor, w: torch.Tensor | None) -> LogHistogram:
    """float64 frexp path: the histogram of ``u`` (``w`` None) or of the update ratio ``|u| / 2^b(w)``."""
    u = u.abs()
    bad = ~torch.isfinite(u) if w is None else ~(torch.isfinite(u) & torch.isfinite(w.abs()))
    apart = torch.zeros_like(bad) if w is None else ~bad & (w == 0)
    zeros = ~bad & ~apart & (u == 0)
    sel = ~(bad | apart | zeros)
    mu, eu = torch.frexp(u[sel])
    shift = eu.long() - (1 if w is None else torch.frexp(w[sel])[1].long())  # b(u), or b(u) - b(w)
    idx = SUB * (shift - B_MIN) + torch.floor((2 * mu - 1) * SUB).long() + 1
    counts = torch.bincount(idx.clamp(0, N_BINS - 1), minlength=N_BINS)
    if w is None:
        r = u[sel]
    else:  # exact ldexp(mu, shift + 1): first into the normal range, then one rounding
        t = shift + 1
        extra = (-1022 - t).clamp(0, 1074)
        r = mu * torch.pow(2.0, (t + extra).double()) * torch.pow(2.0, (-extra).double())
        r = r.clamp(max=torch.finfo(torch.float64).max)
    empty = not r.numel()
    amax, amin, tiny = (0, 0, 1) if empty else torch.stack([r.max(), r.min(), (r == 0).any()]).tolist()
    return LogHistogram.from_counts(
        counts.cpu().numpy(),
        zeros=int(zeros.sum()),
        nonfinite=int(bad.sum()),
        amax=float(amax),
        amin_nonzero=None if tiny else float(amin),
        apart=int(apart.sum()),
    )
