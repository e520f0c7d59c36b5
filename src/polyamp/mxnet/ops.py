"""MXNet's eager primitives (Gluon, MXNet 1.9): contrib.amp casts the operators, polyamp scales and skips.

MXNet's AMP is process-wide: ``amp.init`` patches the operator functions of ``mx.nd`` and
``mx.sym``, so it must run before the network is built (a network hybridized before it keeps
computing in float32, silently). ``MixedPrecision(policy, framework="mxnet")`` calls it, and
refuses when Gluon blocks with parameters already exist. bf16 is the CPU path, on a CPU with AVX-512
(``capability.py`` probes it once; elsewhere an UnsupportedError); fp16 needs a GPU (MXNet's fp16
FullyConnected exists only in cuDNN).

The step: ``trainer.allreduce_grads()`` (so every device copy and worker holds the same sums),
one ``all_finite`` flag per device and one host sync, unscale in place, clip,
``trainer.update(batch_size)`` or skip. contrib.amp's own loss scaler is not used: the trainer
must not update on the kvstore, where no one could check or skip the update.

contrib.amp also makes the loss-output ops (``SoftmaxOutput``, ``LinearRegressionOutput``, ...)
multiply their gradient by one process-wide scale, read when the op runs; polyamp makes it, for each
call, the scale of the MixedPrecision used last, or contrib.amp's own when a native contrib.amp trainer
was used last (see ``_LossOutputs``).

float32 under contrib.amp (``keep_fp32``, the doctor) and the layers' names are ``keep.py``'s,
imported here before any ``amp.init``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..eager import EagerOps
from ..errors import PolyampError, UnsupportedError
from ..scaling import NoLossScale, StaticLossScale
from .capability import bf16_unsupported
from .keep import dtype_name, keep_float32

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp


PREPARED: weakref.WeakSet = weakref.WeakSet()  # the trainers mp.trainer() prepared
FLOAT_KINDS = ("float16", "float32", "float64", "bfloat16")
_amp_dtype: str | None = None  # the dtype polyamp initialised contrib.amp with in this process


def check_trainer(trainer) -> None:
    if not isinstance(trainer, gluon.Trainer):
        raise PolyampError(
            f"expected a mxnet.gluon.Trainer, got {type(trainer).__module__}.{type(trainer).__name__}"
        )
    if trainer not in PREPARED:
        raise PolyampError(
            "this gluon.Trainer was not prepared: use trainer = mp.trainer(gluon.Trainer(...))"
        )


def check_accumulation(trainer) -> None:
    if _amp_dtype is None:
        return
    added = [p.name for p in trainer._params if p.grad_req == "add"]
    if added:
        raise UnsupportedError(
            f"MXNet 1.9's {_amp_dtype} AMP drops gradients accumulated with grad_req='add' (they stay "
            f"0; parameters {', '.join(added[:3])}); keep grad_req='write' and use one larger batch, or "
            "accumulate under the float32 policy"
        )


def _live_networks() -> list[str]:
    """Names of the Gluon blocks alive in this process that own parameters."""
    gc.collect()
    # type(), not isinstance(): a weakref proxy to a dead object raises on __class__
    blocks = (obj for obj in gc.get_objects() if issubclass(type(obj), gluon.Block))
    return [block.name for block in blocks if len(block.params.keys())]


# why each "*-true" policy is refused (checked in tests/test_mxnet.py)
_NO_16BIT_PARAMETERS = {
    "bfloat16": "MXNet 1.9 cannot update bfloat16 parameters: its optimizer kernels (gluon.Trainer "
    "with sgd or adam, also with multi_precision=True) fail with 'Unknown type enum 12'",
    "float16": "float16 parameters need float16 FullyConnected, which exists only in the cuDNN (GPU) "
    "build, and polyamp's MXNet backend keeps float32 parameters (contrib.amp casts the operators)",
}


class _LossOutputs:
    """Make contrib.amp's loss-output ops multiply their gradient by the scale of the trainer they feed.

    These ops (``SoftmaxOutput``, ``LinearRegressionOutput``, ``LogisticRegressionOutput``,
    ``MAERegressionOutput``) ignore the gradient arriving at their output, so scaling the loss
    cannot reach them. ``amp.init`` wraps each ``mx.nd`` one to multiply ``grad_scale`` by
    contrib.amp's process-wide scaler (``amp.amp._loss_scaler``, 2^16 until the first trainer given to
    ``amp.init_trainer``, which owns it, moves it) when it runs. polyamp wraps them again and makes them
    follow whichever was used last: a ``MixedPrecision`` (created, given a trainer, or scaling a loss:
    its current scale, 1 without loss scaling, set on that scaler for the call only and put back after
    it), or contrib.amp (``amp.init_trainer`` or ``amp.scale_loss``, wrapped too: the scaler as
    contrib.amp leaves it). Each call records the scale and whose it was, so ``mp.scale_loss`` and
    ``amp.scale_loss`` can refuse a forward pass that ran under the other's scale (then follow the one
    refusing, so the forward pass can run again); ``mp.step`` unscales those gradients once, with the
    rest. In ``mx.sym`` (hybridized blocks) the op's ``grad_scale`` is fixed in the cached graph and
    contrib.amp does not scale it: under a MixedPrecision allowed only while the scale is 1 and cannot
    change.
    """

    def __init__(self):
        self._active = None  # weakref to the MixedPrecision whose scale the ops use
        self._native = False  # the ops follow contrib.amp's own scaler (a native trainer was used last)
        self.used: set[tuple[float, bool]] = set()  # (scale, native) of the ops since the last check

    def install(self, target_dtype: str) -> None:
        dtype = amp.amp.bfloat16 if target_dtype == "bfloat16" else target_dtype
        for name in amp.list_loss_output_functions(dtype):
            for module, wrap in ((mx.nd, self._imperative), (mx.sym, self._symbolic)):
                op = getattr(module, name, None)
                if op is not None:
                    setattr(module, name, functools.wraps(op)(wrap(op)))
        native = amp.amp.init_trainer, amp.amp.scale_loss  # the package re-exports them: wrap both names
        init_trainer, scale_loss = (functools.wraps(f)(wrap(f)) for f, wrap in
                                    zip(native, (self._init_trainer, self._scale_loss)))  # fmt: skip
        for module in (amp, amp.amp):
            module.init_trainer, module.scale_loss = init_trainer, scale_loss

    def activate(self, mp) -> None:
        self._active, self._native = weakref.ref(mp), False

    def _mp(self):
        return self._active() if self._active is not None and not self._native else None

    def _imperative(self, op):
        def run(*args, **kwargs):
            if self._native:
                if autograd.is_recording():
                    self.used.add((amp.amp._loss_scaler.loss_scale, True))
                return op(*args, **kwargs)
            mp = self._mp()
            scale = 1.0 if mp is None else mp.current_scale
            if autograd.is_recording():
                self.used.add((scale, False))
            scaler = amp.amp._loss_scaler  # what contrib.amp's wrapper multiplies grad_scale by
            saved, scaler._loss_scale = scaler._loss_scale, scale
            try:
                return op(*args, **kwargs)
            finally:
                scaler._loss_scale = saved  # contrib.amp's own trainer keeps its scale

        return run

    def _symbolic(self, op):
        def build(*args, **kwargs):
            mp = self._mp()
            if mp is not None and not (
                isinstance(mp.loss_scale, (NoLossScale, StaticLossScale)) and mp.current_scale == 1.0
            ):
                raise UnsupportedError(
                    f"{op.__name__} in a hybridized block (or a Symbol) cannot follow the loss scale "
                    f"(now scale {mp.current_scale:g}, {type(mp.loss_scale).__name__}): MXNet fixes its "
                    "grad_scale in the cached graph and contrib.amp does not scale it there. Call "
                    "it in a block that is not hybridized, compute the loss with gluon.loss (e.g. "
                    "SoftmaxCrossEntropyLoss, L2Loss), or train without loss scaling (loss_scale='none', "
                    "the default of bf16-mixed)"
                )
            if not self._native:
                self.used.add((1.0, False))
            return op(*args, **kwargs)

        return build

    def _init_trainer(self, init_trainer):
        def run(optimizer_or_trainer):
            if optimizer_or_trainer in PREPARED:
                raise PolyampError(
                    "amp.init_trainer got a trainer that mp.trainer() prepared: polyamp scales its loss "
                    "and skips its steps, and contrib.amp's loss scaler would do it again; drive it with "
                    "mp.scale_loss / mp.step only, or pass contrib.amp a trainer polyamp has not seen"
                )
            init_trainer(optimizer_or_trainer)
            self._native = True

        return run

    def _scale_loss(self, scale_loss):
        def run(loss, optimizer_or_trainer):
            scaler = getattr(optimizer_or_trainer, "_amp_loss_scaler", None)
            if scaler is not None:
                self.check_native(scaler.loss_scale)
            return scale_loss(loss, optimizer_or_trainer)

        return run

    def check(self, mp) -> None:
        """Make ``mp`` the one the ops follow; refuse if they ran with another scale since the last call."""
        native = sorted(s for s, by_amp in self.used if by_amp)
        other = sorted(s for s, by_amp in self.used if not by_amp and s != mp.current_scale)
        self.used.clear()
        self.activate(mp)
        if native:
            raise PolyampError(
                "a loss-output op (SoftmaxOutput, LinearRegressionOutput, ...) in this forward pass "
                f"multiplied its gradient by contrib.amp's loss scale {native[0]:g}, not this "
                f"MixedPrecision's {mp.current_scale:g}: MXNet reads one process-wide scale when the op "
                "runs, and a native contrib.amp trainer (amp.init_trainer / amp.scale_loss) was used "
                "last. The ops follow this MixedPrecision from now on: run the forward pass again"
            )
        if other:
            raise PolyampError(
                "a loss-output op (SoftmaxOutput, LinearRegressionOutput, ...) in this forward pass "
                f"multiplied its gradient by {', '.join(f'{s:g}' for s in other)} (the scale of the "
                "MixedPrecision used last: MXNet reads one process-wide scale when the op runs), but "
                f"this MixedPrecision scales by {mp.current_scale:g}; drive every trainer of the "
                "process with one MixedPrecision (mp.step([trainer1, trainer2]) steps them together)"
            )

    def check_native(self, scale: float) -> None:
        """``amp.scale_loss`` of a trainer whose loss scale is ``scale``: make contrib.amp's scaler the
        one the ops follow; refuse if they ran with a MixedPrecision's scale, or another scale."""
        ours = sorted(s for s, by_amp in self.used if not by_amp)
        other = sorted(s for s, by_amp in self.used if by_amp and s != scale)
        self.used.clear()
        self._native = True
        if ours:
            raise PolyampError(
                "a loss-output op (SoftmaxOutput, LinearRegressionOutput, ...) in this forward pass "
                f"multiplied its gradient by {ours[0]:g}, the scale of the polyamp MixedPrecision used "
                f"last, not this contrib.amp trainer's loss scale {scale:g}: MXNet reads one process-wide "
                "scale when the op runs. The ops follow contrib.amp's loss scaler from now on: run the "
                "forward pass again (or drive this trainer with the MixedPrecision: mp.trainer(...))"
            )
        if other:
            raise PolyampError(
                "a loss-output op (SoftmaxOutput, LinearRegressionOutput, ...) in this forward pass "
                f"multiplied its gradient by {other[0]:g}, contrib.amp's process-wide loss scale, but this "
                f"trainer's loss scaler is at {scale:g}: contrib.amp gives the scaler the ops read to the "
                "first trainer passed to amp.init_trainer only; compute the loss with gluon.loss (e.g. "
                "L2Loss, SoftmaxCrossEntropyLoss) for the other trainers"
            )


LOSS_OUTPUTS = _LossOutputs()


def setup_amp(policy, device: str | None, label: str | None = None) -> None:
    """Initialise contrib.amp for the policy's compute dtype, once per process, before any network.

    float32 needs no AMP (and cannot have it once it is on); bf16 runs on a CPU whose oneDNN has bf16
    kernels (``capability.py``'s probe; an UnsupportedError naming ``label``, the policy or recipe,
    elsewhere); fp16 needs a GPU.
    """
    global _amp_dtype
    compute = policy.compute_dtype
    if policy.param_dtype in _NO_16BIT_PARAMETERS:
        raise UnsupportedError(
            f"policy {policy.name!r} keeps the parameters in {policy.param_dtype}: "
            f"{_NO_16BIT_PARAMETERS[policy.param_dtype]}; use 'bf16-mixed' (float32 parameters, bfloat16 "
            "compute through contrib.amp), or 'fp16-mixed' on a GPU"
        )
    if (policy.param_dtype, policy.output_dtype) != ("float32", "float32") or compute == "float64":
        raise UnsupportedError(
            f"the mxnet backend runs float32 parameters with float32 or mixed compute (contrib.amp); got "
            f"policy {policy.name!r}; accepted: 'float32', 'bf16-mixed', 'fp16-mixed' (GPU only)"
        )
    if compute == "float32":
        if _amp_dtype is not None or amp.amp._amp_initialized:
            raise PolyampError(
                "MXNet's AMP is process-wide and already runs this process in "
                f"{_amp_dtype or 'low precision'}; it cannot be turned off: run the float32 policy in a "
                "separate process"
            )
        return
    if compute == "float16" and (device == "cpu" or mx.context.num_gpus() == 0):
        cpu_path = "'float32' (this CPU computes no bfloat16 either)" if bf16_unsupported() else (
            "'bf16-mixed', MXNet's CPU mixed-precision path")
        raise UnsupportedError(
            "MXNet cannot run fp16-mixed on CPU: its float16 FullyConnected exists only in the cuDNN "
            "(GPU) build ('float16 fully connected layer is currently only supported by CuDNN'); "
            f"use {cpu_path}, or a GPU build of MXNet"
        )
    if compute == "bfloat16" and _amp_dtype is None and bf16_unsupported():
        raise UnsupportedError(f"{label or f'policy {policy.name!r}'} computes in bfloat16, and "
                               f"{bf16_unsupported()}")
    if _amp_dtype == compute:
        return
    if _amp_dtype is not None:
        raise PolyampError(
            f"MXNet's AMP is process-wide and already runs this process in {_amp_dtype}; policy "
            f"{policy.name!r} needs {compute}: use one mixed-precision dtype per process"
        )
    if amp.amp._amp_initialized:
        raise PolyampError(
            "contrib.amp was initialised outside polyamp (amp.init); remove that call: "
            f"MixedPrecision({policy.name!r}, framework='mxnet') calls amp.init itself"
        )
    networks = _live_networks()
    if networks:
        raise PolyampError(
            f"MXNet's AMP must be set up before the network is built, but {len(networks)} Gluon block(s) "
            f"with parameters already exist ({', '.join(networks[:3])}); a network built, and "
            "hybridized, before amp.init keeps computing in float32. Create "
            f"MixedPrecision({policy.name!r}, framework='mxnet') first, then build the network"
        )
    amp.init(target_dtype=compute)
    _amp_dtype = compute
    LOSS_OUTPUTS.install(compute)


class MXNetOps(EagerOps):
    takes_batch_size = True

    def autocast(self, policy, device: str | None):
        """MXNet's AMP is on for the whole process once set up: this only checks that it is."""
        setup_amp(policy, device)
        return contextlib.nullcontext()

    # -- the step ----------------------------------------------------------------------------------
    def gradients(self, optimizers: Sequence[Any]):
        """The trainers' gradients, all-reduced over devices and workers (once per step: a second
        all-reduce of the same gradients would multiply them by the number of devices)."""
        grads, params, fresh = [], [], False
        for trainer in optimizers:
            check_trainer(trainer)
            check_accumulation(trainer)
            for p in trainer._params:
                if p.grad_req == "null":
                    continue
                fresh = fresh or any(d._fresh_grad for d in p.list_data())
                for g in p.list_grad():
                    grads.append(g)
                    params.append(p)
        if not fresh:
            raise PolyampError(
                "no parameter has a new gradient: backpropagate the scaled loss inside "
                "`with mp.scale_loss(loss, trainer) as scaled: autograd.backward(scaled)` before mp.step"
            )
        for trainer in optimizers:
            trainer.allreduce_grads()
        return grads, params

    def unscale_and_check(self, grads, inv_scale: float, group=None) -> tuple[bool, tuple[int, ...]]:
        """``all_finite`` on each scaled gradient into one flag per device, then an in-place
        multiply by ``inv_scale``; one host sync. Workers agree because the check runs after the
        trainer's all-reduce. (contrib.amp's ``multi_all_finite`` is much slower on CPU: docs/mxnet.md.)"""
        if group is not None:
            raise PolyampError(
                "process_group is not used by the mxnet backend: the trainer's kvstore all-reduces the "
                "gradients before the check, so every worker sees the same ones; pass process_group=None"
            )
        flags = []
        for ctx, arrays in _by_context(grads).items():
            flags.append(mx.nd.ones((1,), ctx=ctx))
            for g in arrays:
                mx.nd.all_finite(g, init_output=False, out=flags[-1])
        if inv_scale != 1.0:
            for g in grads:
                g *= inv_scale
        return all(bool(flag.asscalar()) for flag in flags), ()  # workers agree: see the docstring

    def clip(self, grads, params, max_norm: float) -> float:
        norms = [
            gluon.utils.clip_global_norm(arrays, max_norm, check_isfinite=False)
            for arrays in _by_context(grads).values()
        ]
        return float(norms[0].asscalar())

    def nonfinite(self, named_grads) -> tuple[str, ...]:
        bad = [name for name, g in named_grads if not np.isfinite(g.asnumpy()).all()]
        return tuple(dict.fromkeys(bad))  # one name per parameter, not per device copy

    def apply(self, optimizers, batch_size=None) -> None:
        for trainer in optimizers:
            trainer.update(batch_size)

    # -- names and debugging -----------------------------------------------------------------------
    def keep_float32(self, model, keep_fp32):
        return keep_float32(model, keep_fp32)

    def parameter_names(self, model) -> dict[int, str]:
        if not isinstance(model, gluon.Block):
            raise PolyampError(f"expected a mxnet.gluon.Block, got {type(model).__name__}")
        return {id(p): name for name, p in model.collect_params().items()}

    def watch_nonfinite(self, model, origin: list[str]) -> list[Any]:
        """Forward hooks on every block (MXNet has no gradient hooks); a hybridized block runs as
        one graph, so only its outermost output is seen."""

        def hook(block, inputs, output):
            outputs = output if isinstance(output, (list, tuple)) else [output]
            if not origin and not all(_finite(o) for o in outputs):
                origin.append(f"forward output of {block.name}")

        handles, stack = [], [model]
        while stack:
            block = stack.pop()
            handles.append(block.register_forward_hook(hook))
            stack.extend(block._children.values())
        return [_Detach(h) for h in handles]


def _by_context(arrays) -> dict:
    groups: dict = {}
    for a in arrays:
        groups.setdefault(a.context, []).append(a)
    return groups


def _finite(x) -> bool:
    if not isinstance(x, mx.nd.NDArray) or dtype_name(x.dtype) not in FLOAT_KINDS:
        return True
    return bool(np.isfinite(x.astype("float32").asnumpy()).all())


class _Detach:
    """A hook handle with ``remove()``, like torch's."""

    def __init__(self, handle):
        self._handle = handle

    def remove(self) -> None:
        self._handle.detach()
