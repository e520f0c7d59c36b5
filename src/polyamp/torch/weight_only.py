"""Weight-only inference in torch: each ``nn.Linear`` of a trained model stored in a low form.

    record = polyamp.torch.quantize_weights(model, "int8")      # in place; or "bf16", "fp8", "nvfp4", ...
    record.quantized, record.kept, record.bytes_after / record.bytes_before
    torch.save(model.state_dict(), path)                        # the export: codes and scales as buffers

Every ``nn.Linear`` not named in ``keep`` becomes a ``LowWeightLinear``: its weight's arrays
(``polyamp.weight_forms``) as buffers, decoded to the input's dtype at each forward (emulated: torch has
no kernel that multiplies by these forms on every device), then ``F.linear``. The bias stays as it was.
To load an exported model: build it, call ``quantize_weights`` with the same form (it rebuilds the
buffers' shapes), then ``load_state_dict``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from .. import weight_forms
from ..errors import PolyampError
from ..weight_forms import WeightOnlyRecord
from . import xp


def _tensor(a: np.ndarray, device) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(a).to(device)


class LowWeightLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is stored in ``form`` and decoded at each call."""

    def __init__(self, linear: torch.nn.Linear, form: str):
        super().__init__()
        self.form, self.in_features, self.out_features = form, linear.in_features, linear.out_features
        w = linear.weight.detach()
        self._names = []
        for name, a in weight_forms.encode(w.float().cpu().numpy(), form, axis=-1).items():
            self.register_buffer(f"w_{name}", _tensor(a, w.device))
            self._names.append(name)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(),
                                                                       requires_grad=False)  # fmt: skip

    def weight_value(self, dtype=torch.float32) -> torch.Tensor:
        stored = {n: getattr(self, f"w_{n}") for n in self._names}
        w = weight_forms.decode(xp, stored, self.form, (self.out_features, self.in_features), axis=-1)
        return w.to(dtype)

    def forward(self, x):
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight_value(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, form={self.form!r}"


def quantize_weights(model: torch.nn.Module, form: str, keep=()) -> WeightOnlyRecord:
    """Store every ``nn.Linear`` of ``model`` (in place) in ``form``, except the modules named in ``keep``;
    other modules with weights are kept and recorded with the reason. A PolyampError when none is left to
    store low (the call would change nothing)."""
    form = weight_forms.check_form(form)
    if not isinstance(model, torch.nn.Module):
        raise PolyampError(f"quantize_weights takes a torch.nn.Module, got {type(model).__name__}")
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    names = {name for name, _ in model.named_modules()}
    unknown = [k for k in keep if k not in names]
    if unknown:
        raise PolyampError(f"keep names {unknown[0]!r}, which is not a module of the model; its modules "
                           f"include {sorted(n for n in names if n)[:8]}")  # fmt: skip
    record = WeightOnlyRecord(form)
    for name, module in list(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or isinstance(module, LowWeightLinear):
            continue
        record.bytes_before += weight.numel() * weight.element_size()
        if name in keep:
            record.kept[name] = "named in keep"
        elif not isinstance(module, torch.nn.Linear):
            record.kept[name] = f"a {type(module).__name__}: weight-only forms cover nn.Linear"
        else:
            low = LowWeightLinear(module, form)
            _replace(model, name, low)
            record.quantized[name] = form
            record.bytes_after += sum(getattr(low, f"w_{n}").nbytes for n in low._names)
            continue
        record.bytes_after += weight.numel() * weight.element_size()
    if not record.quantized:
        raise PolyampError(f"quantize_weights found no nn.Linear to store in {form!r} (kept: "
                           f"{record.kept or 'no module with a weight'})")  # fmt: skip
    return record


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)
