"""The trainer protocol: what ``worker.py`` and the report rely on from a framework trainer.

``Trainer`` is declared as a :class:`typing.Protocol`; the four framework trainers
(``compare/torch.py``, ``tensorflow.py``, ``jax.py``, ``mxnet.py``) subclass :class:`TrainerBase`,
which implements the framework-free part: evaluation (the workload's metric on the trainer's
``forward`` outputs) and the assembly of :class:`Memory` from the framework's probes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, runtime_checkable

import numpy as np

from ..step import StepResult
from .workloads import Workload


class Memory(TypedDict):
    """Bytes a training case holds, by kind; ``None`` where the framework does not expose it.

    ``parameters``, ``gradients``: as the framework stores them. ``master``: float32 copies kept
    besides the parameters (0 when the parameters are float32 themselves). ``optimizer``: the
    optimizer's state (None before its first step allocates it). ``activations``: distinct
    tensors one training forward pass saves for backward, other than the parameters and their
    low-precision copies, which are ``weight_copies``. ``workspace``: scratch a compiled step
    allocates (JAX only). ``inference_weights``: the weights as ``infer`` reads them.
    ``how``: how each entry was measured, or why it is None.
    """

    parameters: int
    gradients: int
    master: int | None
    optimizer: int | None
    activations: int | None
    weight_copies: int | None
    workspace: int | None
    inference_weights: int
    how: dict[str, str]


@dataclass(frozen=True)
class Saved:
    """What one training forward pass saves for backward, in bytes, and how it was measured."""

    activations: int | None
    weight_copies: int | None
    how: str


@runtime_checkable
class Trainer(Protocol):
    """One (workload, policy) training run, built from the workload's weights."""

    wl: Workload
    mp: Any  # the framework's polyamp.MixedPrecision: worker.py reads mp.current_scale
    last: StepResult | None  # what the latest step did (stepped or skipped, the scale); None before one

    @property
    def inference_form(self) -> str:
        """How ``infer`` runs the network, in words (its context, compute dtype, weights' dtype)."""

    def __init__(self, wl: Workload, policy: str) -> None: ...

    def step(self, i: int) -> float:
        """Train on ``wl.batch_at(i)``; the loss as a Python float."""

    def evaluate(self) -> float:
        """The workload's held-out metric of the current weights."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        """One batch's outputs as float32 numpy, computed as in training (no gradient)."""

    def infer(self, x: np.ndarray) -> np.ndarray:
        """One batch's outputs as float32 numpy, in the policy's idiomatic inference form."""

    def memory(self) -> Memory:
        """Bytes held by kind; call it after a step (optimizers allocate their state lazily)."""


class TrainerBase:
    """The framework-free part of every trainer. A subclass sets ``wl``, ``mp`` and ``last`` and
    implements ``step``, ``forward`` and the memory probes named below."""

    wl: Workload
    mp: Any
    last: StepResult | None = None

    def evaluate(self) -> float:
        return self.wl.evaluate(self.forward)

    def infer(self, x: np.ndarray) -> np.ndarray:
        """By default the training forward pass: the framework's policy already is its inference form."""
        return self.forward(x)

    # -- memory probes: each a list of (bytes, dtype name), or a count of bytes ---------------------
    def _parameters(self) -> list[tuple[int, str]]:
        raise NotImplementedError

    def _gradients(self) -> list[tuple[int, str]]:
        raise NotImplementedError

    def _optimizer_bytes(self) -> int | None:
        raise NotImplementedError

    def _saved(self) -> Saved:
        raise NotImplementedError

    def _inference_weights(self) -> list[tuple[int, str]]:
        """The weights ``infer`` reads; by default the parameters."""
        return self._parameters()

    def _workspace(self) -> tuple[int | None, str]:
        return None, "no compiled-step memory analysis in this framework"

    def memory(self) -> Memory:
        params = self._parameters()
        grads = self._gradients()
        dtypes = {dtype for _, dtype in params}
        if dtypes == {"float32"}:
            master, master_how = 0, "0: the parameters are float32, the master copy itself"
        elif dtypes == {self.mp.policy.param_dtype}:
            master, master_how = 0, ("0: a -true policy's optimizer steps the stored parameters (with "
                                     "training-state options, float32 scratch of one parameter at a time; "
                                     "Kahan buffers are optimizer state)")  # fmt: skip
        else:
            master, master_how = None, f"parameters are {', '.join(sorted(dtypes))}: no master copy probe"
        optimizer = self._optimizer_bytes()
        saved = self._saved()
        workspace, workspace_how = self._workspace()
        return Memory(
            parameters=sum(n for n, _ in params),
            gradients=sum(n for n, _ in grads),
            master=master,
            optimizer=optimizer,
            activations=saved.activations,
            weight_copies=saved.weight_copies,
            workspace=workspace,
            inference_weights=sum(n for n, _ in self._inference_weights()),
            how={
                "parameters": f"trainable parameters as stored ({', '.join(sorted(dtypes))})",
                "gradients": "one gradient per parameter, in the dtype the framework allocates",
                "master": master_how,
                "optimizer": "the optimizer's state arrays" if optimizer is not None
                else "not allocated yet: the optimizer creates its state at its first step",
                "activations": saved.how,
                "weight_copies": saved.how,
                "workspace": workspace_how,
                "inference_weights": "the weights infer() reads, as stored",
            },
        )  # fmt: skip
