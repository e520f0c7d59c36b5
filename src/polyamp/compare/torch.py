"""The compare workloads in PyTorch, trained with ``polyamp.MixedPrecision``.

Each network is built from the numpy weights of ``workloads.py`` (a dense layer's ``W[in, out]``
is stored transposed, as ``nn.Linear`` wants it): the workload's ``architecture`` picks the
network, its ``loss_kind`` the loss. Adam is torch's fused CPU kernel. Evaluation is the
workload's, on ``forward``'s outputs.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from ..mixed_precision import MixedPrecision
from .protocol import Saved, TrainerBase
from .workloads import Workload


def _linear(weights: dict, name: str) -> nn.Linear:
    w, b = weights[name + ".w"], weights[name + ".b"]
    layer = nn.Linear(*w.shape)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w.T.copy()))
        layer.bias.copy_(torch.from_numpy(b))
    return layer


class MLP(nn.Module):
    def __init__(self, wl: Workload):
        super().__init__()
        n = len(wl.dims) - 1
        self.layers = nn.ModuleList(_linear(wl.weights, f"fc{i}") for i in range(n))
        self.act = {"gelu": nn.functional.gelu, "relu": torch.relu}[wl.activation]

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = self.act(layer(x))
        return self.layers[-1](x)


def _layer_norm(weights: dict, name: str, d: int) -> nn.LayerNorm:
    ln = nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(weights[name + ".g"]))
        ln.bias.copy_(torch.from_numpy(weights[name + ".b"]))
    return ln


class Block(nn.Module):
    def __init__(self, wl: Workload, i: int):
        super().__init__()
        p, d = f"block{i}.", wl.d_model
        self.heads = wl.heads
        self.ln1, self.ln2 = _layer_norm(wl.weights, p + "ln1", d), _layer_norm(wl.weights, p + "ln2", d)
        self.q, self.k, self.v, self.o = (_linear(wl.weights, p + n) for n in "qkvo")
        self.ff1, self.ff2 = _linear(wl.weights, p + "ff1"), _linear(wl.weights, p + "ff2")

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(nn.functional.gelu(self.ff1(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, wl: Workload):
        super().__init__()
        w = wl.weights
        self.embed = nn.Parameter(torch.from_numpy(w["embed"].copy()))
        self.pos = nn.Parameter(torch.from_numpy(w["pos"].copy()))
        self.blocks = nn.ModuleList(Block(wl, i) for i in range(wl.layers))
        self.lnf = _layer_norm(w, "lnf", wl.d_model)
        self.head = _linear(w, "head")

    def forward(self, ids):
        x = self.embed[ids] + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.lnf(x))


_LOSSES = {
    "mse": lambda out, y: nn.functional.mse_loss(out.float(), y),
    "cross_entropy": lambda out, y: nn.functional.cross_entropy(
        out.float().reshape(-1, out.shape[-1]), y.reshape(-1)
    ),
}
_NETWORKS = {"dense": MLP, "transformer": CharLM}
# ops through which a saved tensor is still a parameter: a cast (ToCopy) and views of it
_CAST_AND_VIEWS = {
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "ViewBackward0", "UnsafeViewBackward0",
    "PermuteBackward0", "ExpandBackward0", "AliasBackward0",
}  # fmt: skip


def _is_cast_of_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a cast of a leaf that requires grad (a parameter), possibly viewed."""
    fn, cast = t.grad_fn, False
    while fn is not None and type(fn).__name__ in _CAST_AND_VIEWS:
        cast |= type(fn).__name__ == "ToCopyBackward0"
        inputs = [f for f, _ in fn.next_functions if f is not None]
        fn = inputs[0] if len(inputs) == 1 else None
    return cast and fn is not None and type(fn).__name__ == "AccumulateGrad"


def _entry(t: torch.Tensor) -> tuple[int, str]:
    return t.numel() * t.element_size(), str(t.dtype).removeprefix("torch.")


class Trainer(TrainerBase):
    """One (workload, policy) training run: ``step(i)`` returns the train loss of step ``i``."""

    def __init__(self, wl: Workload, policy: str):
        torch.manual_seed(wl.seed)
        self.wl = wl
        self.model = _NETWORKS[wl.architecture](wl)
        self.mp = MixedPrecision(policy, framework="torch", device="cpu")
        self.mp.watch(self.model)
        # a LowPrecisionOptimizer under a training-state policy (bf16-true:sr, states=int8, ...)
        self.opt = self.mp.optimizer(torch.optim.Adam(self.model.parameters(), lr=wl.lr, fused=True))
        self._steps = 0
        self._weight_only = None  # (steps, model with weight-only Linear layers, its record)

    def _loss(self, x, y):
        with self.mp.autocast():
            return _LOSSES[self.wl.loss_kind](self.model(torch.from_numpy(x)), torch.from_numpy(y))

    def step(self, i: int) -> float:
        x, y = self.wl.batch_at(i)
        self.opt.zero_grad(set_to_none=True)
        loss = self._loss(x, y)
        self.mp.backward(loss)
        self.last = self.mp.step(self.opt)
        self._steps += 1
        return float(loss.detach())

    def doctor_inputs(self, i: int = 0) -> tuple:
        """``polyamp.doctor``'s (model, batch, loss_fn, optimizer) for step ``i``."""
        x, y = self.wl.batch_at(i)
        return self.model, (torch.from_numpy(x), torch.from_numpy(y)), _LOSSES[self.wl.loss_kind], self.opt

    def forward(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad(), self.mp.autocast():
            return self.model(torch.from_numpy(x)).float().numpy()

    def _low_model(self):
        """The trained model with its ``nn.Linear`` weights in the policy's ``weights=`` form, or None."""
        form = self.mp.policy.state.weights if self.mp.policy.state is not None else None
        if form is None:
            return None
        if self._weight_only is None or self._weight_only[0] != self._steps:
            from ..torch.weight_only import quantize_weights

            model = copy.deepcopy(self.model)
            self._weight_only = (self._steps, model, quantize_weights(model, form))
        return self._weight_only[1]

    @property
    def inference_form(self) -> str:
        if self._low_model() is not None:
            _, _, record = self._weight_only
            return (f"torch.inference_mode under autocast({self.mp.policy.compute_dtype}): "
                    f"{len(record.quantized)} nn.Linear weights stored {record.form} "
                    f"(polyamp.torch.quantize_weights, {len(record.kept)} kept), decoded per call"
                    )  # fmt: skip
        dtype = self.mp.policy.compute_dtype
        if dtype == "float32":
            return "torch.inference_mode, float32"
        return f"torch.inference_mode under autocast({dtype}): float32 weights, cast per op"

    def infer(self, x: np.ndarray) -> np.ndarray:
        """``torch.inference_mode`` under the policy's autocast (float32 weights, cast per op)."""
        low = self._low_model()
        model = self.model if low is None else low
        with torch.inference_mode(), self.mp.autocast():
            return model(torch.from_numpy(x)).float().numpy()

    # -- memory probes ---------------------------------------------------------------------------
    def _parameters(self):
        return [_entry(p) for p in self.model.parameters()]

    def _gradients(self):
        return [_entry(p if p.grad is None else p.grad) for p in self.model.parameters()]

    def _inference_weights(self):
        model = self._low_model()
        if model is None:
            return self._parameters()
        return [_entry(t) for t in model.parameters()] + [_entry(b) for n, b in model.named_buffers()
                                                          if ".w_" in f".{n}"]  # fmt: skip

    def _optimizer_bytes(self):
        if hasattr(self.opt, "state_bytes"):  # stored codes and Kahan buffers as well as plain tensors
            return sum(self.opt.state_bytes().values()) if self.opt.steps else None
        tensors = [t for state in self.opt.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(_entry(t)[0] for t in tensors) if tensors else None

    def _saved(self) -> Saved:
        """One training forward of batch 0 under ``saved_tensors_hooks``; each storage counted once."""
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        found: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, is a cast of a parameter)

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                found[ptr] = (t.untyped_storage().nbytes(), _is_cast_of_parameter(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self._loss(*self.wl.batch_at(0))
        del loss
        return Saved(
            activations=sum(n for n, cast in found.values() if not cast),
            weight_copies=sum(n for n, cast in found.values() if cast),
            how="distinct storages packed by torch.autograd.graph.saved_tensors_hooks in one training "
            "forward; parameters excluded, their autocast copies counted as weight copies",
        )


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}


def tune_inputs(name: str, quick: bool = False, device: str = "cpu") -> tuple:
    """A workload as ``polyamp.torch.tune``'s arguments: its float32 network on ``device``, its batches
    (cycled, each copied there once, so that no step times a host-to-device copy), its loss, and
    torch's default Adam (not the fused one the Trainer uses: choosing it is tune's job)."""
    from .workloads import get_workload

    wl = get_workload(name, quick=quick)
    torch.manual_seed(wl.seed)
    model = _NETWORKS[wl.architecture](wl).to(device)
    cache: dict[int, tuple] = {}

    def batch(i: int):
        j = i % wl.steps
        if j not in cache:
            cache[j] = tuple(torch.from_numpy(a).to(device) for a in wl.batch_at(j))
        return cache[j]

    return model, batch, _LOSSES[wl.loss_kind], torch.optim.Adam(model.parameters(), lr=wl.lr)
