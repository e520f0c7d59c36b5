"""PyTorch's eager primitives: torch.autocast, the fused unscale-and-check GradScaler uses, torch.distributed.

CUDA paths (autocast on "cuda", fp16 loss scaling, NCCL all-reduce) use the same calls as on CPU;
they are guarded by torch itself reporting the device as available.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..eager import EagerOps
from ..errors import PolyampError, UnsupportedError
from ..mixed_precision import kept, unmatched_layers

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}  # fmt: skip


@functools.cache
def _autocast_refusal(device: str, dtype) -> str | None:
    """Why torch would disable autocast to ``dtype`` on ``device`` (its warning), or None; probed once
    per pair, because torch.autocast only warns and runs disabled."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = torch.autocast(device, dtype=dtype)
    if ctx._enabled:
        return None
    return "; ".join(str(w.message).splitlines()[0] for w in caught) or "unsupported"


class TorchOps(EagerOps):

    def check_device(self, device: str | None) -> None:
        if device is None:
            return
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError) as err:
            raise PolyampError(
                f"torch does not know the device {device!r} ({str(err).splitlines()[0]}); accepted: "
                "'cpu', 'cuda', 'cuda:N' and the other torch device types"
            ) from None
        if not torch.amp.is_autocast_available(kind):
            raise PolyampError(f"torch has no autocast for device type {kind!r} (device {device!r})")

    def check_params(self, optimizers, policy) -> None:
        """Under a "true" policy, every parameter must be stored in the low dtype."""
        if policy.param_dtype == "float32":
            return
        want = _DTYPES[policy.param_dtype]
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.is_floating_point() and p.dtype != want:
                        raise PolyampError(
                            f"policy {policy.name!r} keeps parameters in {policy.param_dtype}, but a "
                            f"{tuple(p.shape)} parameter is {str(p.dtype).replace('torch.', '')}: call "
                            f"mp.watch(model) before creating the optimizer (it casts the model), or "
                            f"model.to({want})"
                        )

    def prepare_model(self, model, policy, keep_fp32=()):
        if not isinstance(model, torch.nn.Module):
            raise PolyampError(f"expected a torch.nn.Module, got {type(model).__name__}")
        if policy.param_dtype == "float32":
            return model
        dtype = _DTYPES[policy.param_dtype]
        for name, m in model.named_modules():
            if not kept(name, keep_fp32):
                for p in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                    if p.is_floating_point():  # as model.to(dtype): in place, the same Parameter
                        p.data = p.data.to(dtype)
        return model

    def keep_float32(self, model, keep_fp32):
        """Each outermost module under a ``keep_fp32`` name runs its forward with autocast off and
        its floating tensor inputs cast to float32 (an instance ``forward`` wrapping the class's)."""
        if not isinstance(model, torch.nn.Module):
            raise PolyampError(f"expected a torch.nn.Module, got {type(model).__name__}")
        modules = dict(model.named_modules())
        unmatched_layers(keep_fp32, [n for n in modules if n])
        handles: list[_Float32Forward] = []
        for name, m in modules.items():
            if name and kept(name, keep_fp32) and not any(kept(name, (h.name,)) for h in handles):
                handles.append(_Float32Forward(name, m))
        return handles

    def fingerprint(self, grads):
        return [(weakref.ref(g), g._version) for g in grads]

    def unchanged(self, grads, fingerprint) -> bool:
        if fingerprint is None or len(grads) != len(fingerprint):
            return False
        return all(ref() is g and g._version == v for g, (ref, v) in zip(grads, fingerprint))

    # -- autocast ----------------------------------------------------------------------------------
    def autocast(self, policy, device: str | None):
        device = device or default_device()
        dtype = _DTYPES[policy.compute_dtype]
        if dtype in (torch.float32, torch.float64):
            return torch.autocast(device, enabled=False)
        reason = _autocast_refusal(device, dtype)
        if reason is not None:
            raise UnsupportedError(
                f"torch cannot autocast to {policy.compute_dtype} on {device!r} here ({reason}); "
                "accepted: bf16 or fp16 on 'cpu', fp16 (and bf16 where supported) on 'cuda'"
            )
        if device == "cpu" and dtype == torch.float16:
            _warn_once(
                "fp16 autocast on CPU: most CPUs have no float16 arithmetic, and torch's CPU float16 "
                "matmuls can then be much slower than float32 (docs/BENCHMARKS.md); bf16-mixed is the "
                "CPU path"
            )
        return torch.autocast(device, dtype=dtype)

    # -- the step ----------------------------------------------------------------------------------
    def scale_loss(self, loss, scale: float):
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
            raise PolyampError(
                f"loss must be a floating-point torch tensor, got "
                f"{getattr(loss, 'dtype', type(loss).__name__)}"
            )
        if loss.numel() != 1:
            raise PolyampError(f"loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
        return loss if scale == 1.0 else loss * scale

    def gradients(self, optimizers: Sequence[Any]):
        grads, params = [], []
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise PolyampError(
                    f"expected a torch.optim.Optimizer, got {type(opt).__module__}.{type(opt).__name__}"
                )
            group_params = [p for group in opt.param_groups for p in group["params"]]
            if not group_params:
                raise PolyampError(f"{type(opt).__name__} has no parameters to update")
            for p in group_params:
                if p.grad is not None:
                    if p.grad.is_sparse and not p.grad.is_coalesced():
                        p.grad = p.grad.coalesce()  # unscaled in place through its values below
                    grads.append(p.grad)
                    params.append(p)
        if not grads:
            raise PolyampError("no parameter has a gradient: call mp.backward(loss) before mp.step")
        return grads, params

    def unscale_and_check(self, grads, inv_scale: float, group=None) -> tuple[bool, tuple[int, ...]]:
        found = {}
        by_device: dict[tuple, list] = {}
        inv = {}
        for g in grads:
            if g.is_sparse:
                g = g._values()  # coalesced by gradients(): a view of the gradient's own values
            elif hasattr(g, "to_local"):  # a DTensor (FSDP2): check this rank's shard, so that the
                g = g.to_local()  # all-reduce below can say which rank overflowed
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), tensors in by_device.items():
            if device not in found:
                found[device] = torch.zeros(1, dtype=torch.float32, device=device)
                # float64 reciprocal first, as GradScaler does, so that unscaling matches it bit for bit
                inv[device] = torch.full((1,), inv_scale, dtype=torch.float64, device=device).float()
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found[device], inv[device])
        flags = list(found.values())
        flag = flags[0] if len(flags) == 1 else sum(f.to(flags[0].device) for f in flags)
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return float(flag.item()) == 0.0, ()
        # one slot per rank, so that every rank learns which ones overflowed: still one all-reduce
        slots = torch.zeros(dist.get_world_size(group), dtype=torch.float32, device=flag.device)
        slots[dist.get_rank(group)] = flag[0]
        dist.all_reduce(slots, dist.ReduceOp.MAX, group=group)
        bad = tuple(int(r) for r in torch.nonzero(slots).flatten().tolist())
        return not bad, bad

    def clip(self, grads, params, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def nonfinite(self, named_grads) -> tuple[str, ...]:
        return tuple(name for name, g in named_grads
                     if not bool(torch.isfinite(g._values() if g.is_sparse else g).all()))  # fmt: skip

    def apply(self, optimizers, batch_size=None) -> None:
        for opt in optimizers:
            opt.step()

    # -- names and debugging -----------------------------------------------------------------------
    def parameter_names(self, model) -> dict[int, str]:
        return {id(p): name for name, p in model.named_parameters()}

    def watch_nonfinite(self, model, origin: list[str]) -> list[Any]:
        """Forward hooks on every module and gradient hooks on every parameter; each check
        synchronises, so this is for debugging runs only."""

        def forward_hook(name):
            def hook(module, inputs, output):
                if not origin and not _all_finite(output):
                    origin.append(f"forward output of {name or type(module).__name__}")

            return hook

        def grad_hook(name):
            def hook(grad):
                if not origin and not bool(torch.isfinite(grad).all()):
                    origin.append(f"gradient of {name}")

            return hook

        handles = [m.register_forward_hook(forward_hook(n)) for n, m in model.named_modules()]
        handles += [p.register_hook(grad_hook(n)) for n, p in model.named_parameters()
                    if p.requires_grad]  # fmt: skip
        return handles


class _Float32Forward:
    """``module.forward`` in float32: autocast off on the inputs' device types, floating inputs cast."""

    def __init__(self, name: str, module: torch.nn.Module):
        self.name, self.module = name, module
        original = module.forward  # the bound class method (or an instance one already there)
        had_own = "forward" in vars(module)

        def forward(*args, **kwargs):
            args, kwargs = _to_float32((args, kwargs))
            devices = {"cpu"} | {t.device.type for t in _tensors((args, kwargs))}
            with contextlib.ExitStack() as stack:
                for device in sorted(devices):
                    stack.enter_context(torch.autocast(device, enabled=False))
                return original(*args, **kwargs)

        self._restore = (lambda: setattr(module, "forward", original)) if had_own else (
            lambda: vars(module).pop("forward", None))  # fmt: skip
        module.forward = forward

    def remove(self) -> None:
        self._restore()


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _to_float32(x):
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() and x.dtype != torch.float64 else x
    if isinstance(x, (tuple, list)) and type(x) in (tuple, list):
        return type(x)(_to_float32(v) for v in x)
    if isinstance(x, dict) and type(x) is dict:
        return {k: _to_float32(v) for k, v in x.items()}
    return x


def _all_finite(output) -> bool:
    if isinstance(output, torch.Tensor):
        return not output.is_floating_point() or bool(torch.isfinite(output).all())
    if isinstance(output, (list, tuple)):
        return all(_all_finite(o) for o in output)
    if isinstance(output, dict):
        return all(_all_finite(o) for o in output.values())
    return True


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def default_device() -> str:
    """Where autocast runs when no device is given: cuda when available, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"
