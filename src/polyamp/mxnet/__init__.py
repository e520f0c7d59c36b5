"""polyamp's MXNet front end: ``MixedPrecision`` in Gluon's idiom.

    mp = polyamp.MixedPrecision("bf16-mixed", framework="mxnet")  # sets up contrib.amp: first
    net = build_network()
    trainer = mp.trainer(gluon.Trainer(net.collect_params(), "adam", update_on_kvstore=False))
    with autograd.record():
        loss = loss_fn(net(x), y)
        with mp.scale_loss(loss, trainer) as scaled:
            autograd.backward(scaled)
    result = mp.step(trainer, batch_size)

The step is ``polyamp.eager``'s; ``ops.py`` holds MXNet's primitives and the process-wide
contrib.amp set-up (why it must come before the network is built: its module docstring).

``keep_fp32=("body.1", ...)`` (the layer names of ``polyamp.mxnet.doctor.collect``, i.e. paths of child
block names) is applied by ``mp.watch(net)``: each named HybridBlock, and every block below it, runs
its ``hybrid_forward`` with the operators contrib.amp replaced put back and its inputs cast to
float32, imperatively and hybridized alike (``keep.keep_float32``).

With a recipe (``MixedPrecision("fp8-tensorwise", framework="mxnet")``, ``"mxfp8:scale_rule=floor"``,
...), ``mp.watch(net)`` makes the ``nn.Dense`` and ``nn.Conv1D`` / ``Conv2D`` / ``Conv3D`` layers outside the
recipe's keep list run the recipe's quantized GEMMs (``recipe.py``, ``recipe_conv.py``; imperative Gluon);
the rest computes as bf16-mixed. ``mp.recipe_layers`` lists every matmul block (Dense, Conv, transposed
convolutions, RNN layers and cells) by its path, quantized or kept and why (``recipe.matmul_blocks``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..eager import EagerMixedPrecision
from ..errors import PolyampError
from ..recipes import recipe_spec
from .ops import (
    FLOAT_KINDS,
    LOSS_OUTPUTS,
    PREPARED,
    MXNetOps,
    autograd,
    check_accumulation,
    check_trainer,
    dtype_name,  # fmt: skip
    gluon,
    mx,
    setup_amp,
)


class MixedPrecision(EagerMixedPrecision):
    """Mixed precision for one MXNet Gluon training run (see ``polyamp.MixedPrecision``)."""

    framework = "mxnet"
    ops = MXNetOps()

    def __init__(self, *args: Any, framework: str | None = None, **kwargs: Any):
        super().__init__(*args, framework=framework, **kwargs)
        if framework is not None:  # named: set up contrib.amp now, before the network is built
            label = None if self.recipe is None else f"recipe {recipe_spec(self.recipe)!r}"
            setup_amp(self.policy, self.device, label)
            LOSS_OUTPUTS.activate(self)

    def _setup(self) -> None:
        super()._setup()
        self._quantizer = None
        self._recipe_handles: list[Any] | None = None  # RecipeDense / RecipeConv (None: unwatched)
        self._recipe_layers = None  # mp.watch's RecipeLayers (mp.recipe_layers)
        if self.recipe is not None:
            from .recipe import Quantizer

            self._quantizer = Quantizer(self.recipe)

    def watch(self, model: Any) -> Any:
        """``polyamp.MixedPrecision.watch``; with a recipe, also its quantized GEMMs in the net's Dense
        and Conv layers (``recipe.watch``; the keep list is checked before anything is installed), and
        ``mp.recipe_layers``: every matmul block of the net, quantized or kept with its reason (a
        ``RecipeWarning`` when none is quantized)."""
        if self._quantizer is None:
            return super().watch(model)
        from .recipe import unwind, watch

        self._check_mine(model, "model")
        watch(model, self._quantizer, self.recipe.compute_dtype, dry_run=True)
        for handle in self._recipe_handles or ():
            handle.remove()
        unwind(model)  # a recipe watched before gives way to this one (keep_fp32 wraps the originals)
        model = super().watch(model)
        self._recipe_handles, self._recipe_layers = watch(model, self._quantizer, self.recipe.compute_dtype)
        self._recipe_layers.warn_if_none("MXNet Gluon", "mp.watch")
        return model

    def _recipe_state(self) -> dict | None:
        """The recipe's delayed-scaling histories and stochastic-rounding counter."""
        return None if self._quantizer is None else self._quantizer.state_dict()

    def _recipe_loader(self, state: Any):
        return lambda: self._quantizer.load_state_dict(state)

    def trainer(self, trainer: Any):
        """Prepare a ``gluon.Trainer`` for loss scaling (it must not update on the kvstore);
        returns the same trainer."""
        if not isinstance(trainer, gluon.Trainer):
            raise PolyampError(
                f"mp.trainer() takes a mxnet.gluon.Trainer, got "
                f"{type(trainer).__module__}.{type(trainer).__name__}"
            )
        setup_amp(self.policy, self.device)
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
        check_accumulation(trainer)
        self._names.update({id(p): p.name for p in trainer._params})
        PREPARED.add(trainer)
        LOSS_OUTPUTS.activate(self)
        return trainer

    def scale_loss(self, loss: Any, trainer: Any):
        """Context manager yielding ``loss * scale`` (a list for a list of losses) to backpropagate."""
        self._check_mine(trainer, "trainer")
        check_trainer(trainer)
        if self._quantizer is not None and self._recipe_handles is None:
            raise PolyampError(
                f"the {self.recipe.name!r} recipe quantizes the Dense and Conv layers of a watched net: call "
                "mp.watch(net) once before training"
            )
        losses = list(loss) if isinstance(loss, (list, tuple)) else [loss]
        for item in losses:
            if not isinstance(item, mx.nd.NDArray) or dtype_name(item.dtype) not in FLOAT_KINDS:
                raise PolyampError(
                    "loss must be a floating-point mxnet NDArray, got "
                    f"{dtype_name(item.dtype) if hasattr(item, 'dtype') else type(item).__name__}"
                )
        if not autograd.is_recording():
            raise PolyampError(
                "mp.scale_loss(loss, trainer) must run inside autograd.record(), where the loss was computed"
            )
        LOSS_OUTPUTS.check(self)
        scale = self.current_scale
        scaled = [item if scale == 1.0 else item * scale for item in losses]
        self._backwards += 1
        return contextlib.nullcontext(scaled if isinstance(loss, (list, tuple)) else scaled[0])


__all__ = ["MixedPrecision", "MXNetOps"]
