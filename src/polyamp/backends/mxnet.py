"""MXNet backend (Gluon, MXNet 1.9): contrib.amp casts the operators, polyamp scales and skips.

MXNet's AMP is process-wide: ``amp.init`` patches the operator functions of ``mx.nd`` and
``mx.sym``, so it must run before the network is built (a network hybridized before it keeps
computing in float32, silently). ``MixedPrecision(policy, framework="mxnet")`` calls it, and
refuses when Gluon blocks with parameters already exist. bf16 is the CPU path; fp16 needs a GPU
(MXNet's fp16 FullyConnected exists only in cuDNN).

The step: ``trainer.allreduce_grads()`` (so every device copy and worker holds the same sums),
one ``all_finite`` flag per device and one host sync, unscale in place, clip,
``trainer.update(batch_size)`` or skip. contrib.amp's own loss scaler is not used: the trainer
must not update on the kvstore, where no one could check or skip the update.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import PolyampError, UnsupportedError
from ._base import Backend

with warnings.catch_warnings():  # MXNet 1.9 touches numpy aliases deprecated since numpy 1.20
    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp

_FLOAT_KINDS = ("float16", "float32", "float64", "bfloat16")
_amp_dtype: str | None = None  # the dtype polyamp initialised contrib.amp with in this process


def _dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype).names == ("bfloat16",) else np.dtype(dtype).name


def _check_trainer(trainer) -> None:
    if not isinstance(trainer, gluon.Trainer):
        raise PolyampError(
            f"expected a mxnet.gluon.Trainer, got {type(trainer).__module__}.{type(trainer).__name__}"
        )
    if not getattr(trainer, "_polyamp", False):
        raise PolyampError(
            "this gluon.Trainer was not prepared: use trainer = mp.trainer(gluon.Trainer(...))"
        )


def _check_accumulation(trainer) -> None:
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


def setup_amp(policy, device: str | None) -> None:
    """Initialise contrib.amp for the policy's compute dtype, once per process, before any network.

    float32 needs no AMP (and cannot have it once it is on); bf16 runs on CPU; fp16 needs a GPU.
    """
    global _amp_dtype
    compute = policy.compute_dtype
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
        raise UnsupportedError(
            "MXNet cannot run fp16-mixed on CPU: its float16 FullyConnected exists only in the cuDNN "
            "(GPU) build ('float16 fully connected layer is currently only supported by CuDNN'); "
            "use 'bf16-mixed', MXNet's CPU mixed-precision path, or a GPU build of MXNet"
        )
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


class MXNetBackend(Backend):
    name = "mxnet"
    takes_batch_size = True

    def is_tensor(self, x: Any) -> bool:
        return isinstance(x, mx.nd.NDArray)

    def cast(self, x, dtype: str):
        return mx.nd.amp_cast(x, dtype=dtype) if _dtype_name(x.dtype) in _FLOAT_KINDS else x

    # -- policy ------------------------------------------------------------------------------------
    def attach(self, mp) -> None:
        setup_amp(mp.policy, mp.device)

    def autocast(self, policy, device: str | None):
        """MXNet's AMP is on for the whole process once set up: this only checks that it is."""
        setup_amp(policy, device)
        return contextlib.nullcontext()

    # -- the Gluon idiom ---------------------------------------------------------------------------
    def wrap_trainer(self, mp, trainer):
        """Check the trainer and make it update off the kvstore; returns the same trainer."""
        if not isinstance(trainer, gluon.Trainer):
            raise PolyampError(
                f"mp.trainer() takes a mxnet.gluon.Trainer, got "
                f"{type(trainer).__module__}.{type(trainer).__name__}"
            )
        setup_amp(mp.policy, mp.device)
        if getattr(trainer, "_amp_loss_scaler", None) is not None:
            raise PolyampError(
                "this trainer went through contrib.amp.init_trainer, whose loss scaler would scale and "
                "skip steps as well; polyamp scales the loss itself: pass a trainer that "
                "amp.init_trainer has not seen"
            )
        on_kvstore = (
            trainer._update_on_kvstore and trainer._kvstore is not None
            if trainer._kv_initialized
            else trainer._kvstore_params["update_on_kvstore"]
        )
        if on_kvstore:
            raise PolyampError(
                "the trainer updates the parameters on the kvstore (update_on_kvstore=True), where the "
                "gradients cannot be checked or the update skipped; create it with "
                "gluon.Trainer(..., update_on_kvstore=False)"
            )
        if not trainer._kv_initialized:
            trainer._kvstore_params["update_on_kvstore"] = False  # None would let MXNet choose True
        _check_accumulation(trainer)
        mp._names.update({id(p): p.name for p in trainer._params})
        trainer._polyamp = True
        return trainer

    def scale_loss_context(self, mp, loss, trainer):
        """A context yielding ``loss * scale`` (a list for a list of losses) to backpropagate."""
        _check_trainer(trainer)
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        for item in losses:
            if not isinstance(item, mx.nd.NDArray) or _dtype_name(item.dtype) not in _FLOAT_KINDS:
                raise PolyampError(
                    "loss must be a floating-point mxnet NDArray, got "
                    f"{_dtype_name(item.dtype) if hasattr(item, 'dtype') else type(item).__name__}"
                )
        if not autograd.is_recording():
            raise PolyampError(
                "mp.scale_loss(loss, trainer) must run inside autograd.record(), where the loss was computed"
            )
        scale = mp.current_scale
        scaled = [item if scale == 1.0 else item * scale for item in losses]
        return contextlib.nullcontext(scaled if isinstance(loss, (list, tuple)) else scaled[0])

    # -- the step ----------------------------------------------------------------------------------
    def gradients(self, optimizers: Sequence[Any]):
        grads, params, fresh = [], [], False
        for trainer in optimizers:
            _check_trainer(trainer)
            _check_accumulation(trainer)
            trainer.allreduce_grads()
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
        return grads, params

    def unscale_and_check(self, grads, inv_scale: float, group=None) -> bool:
        """``all_finite`` on each scaled gradient into one flag per device, then an in-place
        multiply by ``inv_scale``; one host sync. Workers agree because the check runs after the
        trainer's all-reduce. (contrib.amp's ``multi_all_finite`` is ~30x slower on CPU.)"""
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
        return all(bool(flag.asscalar()) for flag in flags)

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

    # -- measurement -------------------------------------------------------------------------------
    def synchronize(self) -> None:
        mx.nd.waitall()


def _by_context(arrays) -> dict:
    groups: dict = {}
    for a in arrays:
        groups.setdefault(a.context, []).append(a)
    return groups


def _finite(x) -> bool:
    if not isinstance(x, mx.nd.NDArray) or _dtype_name(x.dtype) not in _FLOAT_KINDS:
        return True
    return bool(np.isfinite(x.astype("float32").asnumpy()).all())


class _Detach:
    """A hook handle with ``remove()``, like torch's."""

    def __init__(self, handle):
        self._handle = handle

    def remove(self) -> None:
        self._handle.detach()


BACKEND = MXNetBackend()
