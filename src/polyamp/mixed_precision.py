"""``MixedPrecision``: the entry point, and what every framework's front end shares.

``MixedPrecision(policy, framework=None, ...)`` returns the framework's own object
(``polyamp.torch.MixedPrecision``, ``polyamp.tensorflow.MixedPrecision``, ...; each a subclass of
this one), chosen by ``framework`` or, when it is not given, by the one framework imported. With
several frameworks imported (or none yet) it returns an unbound one that becomes the framework's
object at the first call that tells the framework: the first tensor, model or optimizer handed
over, or a framework's own idiom (``mp.scope()`` is Keras's, ``mp.init()`` JAX's).

This class holds what no framework changes: the policy, the loss scale and its state, the
checkpoint (``state_dict`` / ``load_state_dict``) and the argument checks.
"""

from __future__ import annotations

import warnings
from typing import Any

from .errors import PolyampError, UnsupportedError
from .frameworks import canonical_framework, detect, front_end, idiom_owner, imported_frameworks
from .native import from_native, to_native
from .policy import Policy
from .recipe_layers import RecipeLayers
from .recipes import RECIPES, Recipe, parse_recipe, recipe_spec, refusal
from .scaling import PRESETS, DynamicLossScale, LossScaleState, NoLossScale, StaticLossScale, check_loss_scale


def make_loss_scale(spec, policy: Policy):
    """None: dynamic (polyamp defaults) when the policy needs scaling, else none; a preset name;
    a number (static); or a loss-scale object."""
    if spec is None:
        return DynamicLossScale() if policy.needs_loss_scaling else NoLossScale()
    if isinstance(spec, str):
        if spec in ("none", "off"):
            return NoLossScale()
        return DynamicLossScale() if spec == "dynamic" else DynamicLossScale.preset(spec)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return StaticLossScale(float(spec))
    if any(hasattr(spec, member) for member in ("init", "update", "update_arrays")):
        return check_loss_scale(spec)
    raise PolyampError(
        f"unknown loss_scale {spec!r}; accepted: None, 'dynamic', 'none', a preset name "
        f"({', '.join(map(repr, PRESETS))}), a number, or a loss-scale object (polyamp.scaling.LossScale)"
    )


def recipe_of(policy: Any) -> Recipe | None:
    """The training recipe ``policy`` names (``polyamp.recipes.parse_recipe``'s spelling, or a ``Recipe``),
    else None."""
    if isinstance(policy, Recipe):
        return policy
    if isinstance(policy, str) and policy.partition(":")[0].strip().lower() in RECIPES:
        return parse_recipe(policy.strip())
    return None


def policy_for(spec: Any) -> Policy:
    """The policy of a policy spelling, or of a recipe: bf16-mixed (its compute dtype bf16) or float32."""
    recipe = recipe_of(spec)
    if recipe is None:
        return Policy.parse(spec)
    return Policy.parse("bf16-mixed" if recipe.compute_dtype == "bf16" else "float32")


def check_keep_fp32(names: Any) -> tuple[str, ...]:
    """``keep_fp32`` as a tuple of layer names: None, one name, or an iterable of non-empty names."""
    if names is None:
        return ()
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError:
        raise PolyampError(f"keep_fp32 must be layer names (strings), got {type(names).__name__}") from None
    bad = [n for n in names if not isinstance(n, str) or not n.strip(".,/ ")]
    if bad:
        raise PolyampError(f"keep_fp32 must be non-empty layer names (strings), got {bad[0]!r}")
    return tuple(dict.fromkeys(names))


def kept(layer: str, keep_fp32: tuple[str, ...]) -> str | None:
    """The ``keep_fp32`` entry that keeps ``layer``: equal to it, or its ancestor ("blocks.2" keeps
    "blocks.2.fc"; "/" separates JAX's named scopes); None when none does."""
    for name in keep_fp32:
        if layer == name or layer.startswith((name + ".", name + "/")):
            return name
    return None


def unmatched_layers(keep_fp32: tuple[str, ...], layers: list[str]) -> None:
    """PolyampError naming the ``keep_fp32`` entries that keep none of ``layers``."""
    missing = [k for k in keep_fp32 if not any(kept(layer, (k,)) for layer in layers)]
    if missing:
        more = f", ... ({len(layers)} in all)" if len(layers) > 20 else ""
        shown = ", ".join(map(repr, layers[:20])) + more
        raise PolyampError(f"keep_fp32 names {', '.join(map(repr, missing))}, which match no layer of "
                           f"the model; its layers: {shown}")  # fmt: skip


class WrongIdiomError(PolyampError, AttributeError):
    """A method of another framework's idiom was called (``mp.scope()`` on a torch run)."""


class MixedPrecision:
    """Mixed precision for one training run, in the framework's idiom.

    >>> mp = MixedPrecision("bf16-mixed")          # doctest: +SKIP
    >>> with mp.autocast():                         # doctest: +SKIP
    ...     loss = loss_fn(model(x), y)
    >>> mp.backward(loss)                           # doctest: +SKIP
    >>> result = mp.step(optimizer, clip_grad_norm=1.0)  # doctest: +SKIP

    ``framework`` names the framework ('torch', 'tensorflow', 'jax', 'mxnet' or an alias; 'keras' is the
    front end of the backend Keras runs on: tensorflow's, or ``polyamp.keras`` on JAX and torch);
    default: the only one imported, else the first one the object is handed.
    ``device`` is the autocast device ('cpu', 'cuda'; default: cuda when available, else cpu).
    ``process_group`` is the group whose ranks must agree on skipping (default: the world).
    ``guard=False`` turns the finite check off (only without loss scaling); ``debug=True``
    records where a NaN/inf first appears (after ``mp.watch(model)``).
    ``policy`` may also name a low-precision training recipe (``"fp8-tensorwise"``, ``"fp8-delayed"``,
    ``"mxfp8"``, ``"nvfp4"``, or a ``polyamp.recipes.Recipe``): the matmuls' operands are then
    quantized as the recipe says and everything computes in its compute dtype (every front
    end; torch, Keras and MXNet after ``mp.watch(model)``, JAX in ``mp.autocast(loss_fn)``; ``mp.recipe``
    holds it).
    ``keep_fp32`` names layers that compute in float32 under a 16-bit policy (``polyamp.doctor``'s
    recommendation): a name keeps the layer of that name and every layer below it ("blocks.2" keeps
    "blocks.2.fc"; see ``kept``). Torch, Keras and MXNet apply it at ``mp.watch(model)``, which
    fails on a name that matches no layer; JAX applies it in ``mp.autocast`` to the equations under
    that ``jax.named_scope``.
    """

    framework: str | None = None  # set by each front end

    def __new__(cls, policy: Any = "bf16-mixed", *args, framework: str | None = None, **kwargs):
        if cls is not MixedPrecision:
            return super().__new__(cls)
        if framework is None:
            imported = imported_frameworks()
            if len(imported) != 1:
                return super().__new__(_Unbound)
            framework = imported[0]
        return super().__new__(front_end(framework))

    def __init__(self, policy: str | Policy = "bf16-mixed", *, loss_scale=None,
                 framework: str | None = None, device: str | None = None, guard: bool = True,
                 debug: bool = False, process_group: Any = None, keep_fp32: Any = ()):  # fmt: skip
        if framework is not None and canonical_framework(framework) != self.framework:
            raise PolyampError(f"framework={framework!r}, but this is {type(self).__module__}'s "
                               f"MixedPrecision ({self.framework})")  # fmt: skip
        self.recipe = recipe_of(policy)
        if self.recipe is not None:  # the GEMMs' operands quantized; the rest computes as the policy
            self._check_recipe()
        self.policy = policy_for(policy)
        self._check_training_state()
        self.loss_scale = make_loss_scale(loss_scale, self.policy)
        for name, value in (("guard", guard), ("debug", debug)):
            if not isinstance(value, bool):
                raise PolyampError(f"{name} must be True or False; received {value!r}")
        if device is not None and not isinstance(device, str):
            raise PolyampError(f"device must be a string such as 'cpu' or 'cuda:0', or None; "
                               f"received {device!r}")  # fmt: skip
        if not guard and not isinstance(self.loss_scale, NoLossScale):
            raise PolyampError(
                "guard=False needs loss_scale='none': a loss scale needs the finite check to adapt"
            )
        self._state = self.loss_scale.init()
        self.device = device
        self.guard = guard
        self.debug = debug
        self.process_group = process_group
        self.keep_fp32 = check_keep_fp32(keep_fp32)
        self._setup()

    def _setup(self) -> None:
        """The front end's own set-up, after the shared fields (validates the device)."""

    def _check_recipe(self) -> None:
        """PolyampError when this front end does not train with the recipe (yet)."""
        why = None if self.framework is None else refusal(self.recipe, self.framework)
        if why is not None:
            raise PolyampError(why)

    takes_training_state = False  # whether mp.optimizer(...) applies a policy's training-state options

    def _check_training_state(self) -> None:
        """UnsupportedError when the policy has training-state options this front end does not apply."""
        if self.policy.state is None or self.framework is None or self.takes_training_state:
            return
        raise UnsupportedError(
            f"policy {self.policy.name!r} updates 16-bit weights and stores moments through polyamp's "
            f"optimizer wrappers, which exist for torch (LowPrecisionOptimizer) and JAX (low_precision) so "
            f"far, not for {self.framework}: use {self.policy.base_name!r} there (docs/training-state.md)"
        )

    def _check_mine(self, obj: Any, what: str) -> None:
        """PolyampError unless ``obj`` is an object of this front end's framework."""
        name = detect(obj)
        if name is None:
            raise PolyampError(
                f"{what} must be a tensor/model/optimizer of a supported framework, got "
                f"{type(obj).__module__}.{type(obj).__name__}"
            )
        if name != self.framework:
            raise PolyampError(
                f"this MixedPrecision drives {self.framework}, but {what} is a {name} object "
                f"({type(obj).__module__}.{type(obj).__name__}); use one MixedPrecision per framework"
            )

    # -- the loss-scale state ----------------------------------------------------------------------
    @property
    def state(self) -> LossScaleState:
        """The loss-scale state (a ``LossScaleState``)."""
        return self._state

    @state.setter
    def state(self, value: LossScaleState) -> None:
        self._state = value

    @property
    def current_scale(self) -> float:
        """The loss scale the next backward pass multiplies by."""
        return float(self.state.scale)

    @property
    def recipe_layers(self) -> RecipeLayers:
        """Which layers the recipe quantizes and which it keeps, and why (``RecipeLayers``): known
        after ``mp.watch(model)`` (torch, Keras, MXNet) or the first trace of ``mp.autocast(fn)`` (JAX)."""
        if self.recipe is None:
            raise PolyampError(f"mp.recipe_layers is a recipe's record; this MixedPrecision runs the "
                               f"policy {self.policy.name!r}")  # fmt: skip
        record = self.__dict__.get("_recipe_layers")
        if record is None:
            raise PolyampError("mp.recipe_layers is known after mp.watch(model) (torch, Keras, MXNet) or "
                               "after mp.autocast(fn) first traced fn (JAX)")  # fmt: skip
        return record

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self, native: str | None = None) -> Any:
        """Policy, loss-scale configuration and state, as plain Python values; with ``native``
        (``"torch"``, ``"keras"``, ``"jmp"``, ``"deepspeed"``, ``"deepspeed-fp16"``) the loss-scale
        state in that library's own form instead (``polyamp.native.to_native``)."""
        if native is not None:
            return to_native(self.loss_scale, self.state, native)
        out = {"policy": self.policy.name, "loss_scale": self.loss_scale.as_dict(),
               "state": self.state.as_dict()}  # fmt: skip
        recipe = self._recipe_state() if self.recipe is not None else None
        if recipe is not None:
            out["recipe"] = {"name": recipe_spec(self.recipe), "state": recipe}
        return out

    def load_state_dict(self, state: Any) -> None:
        """Restore the loss-scale state saved by ``state_dict``, or by a native scaler (a torch
        ``GradScaler`` or its state dict, a Keras ``LossScaleOptimizer``, a jmp
        ``DynamicLossScale``, a DeepSpeed scaler state; see ``polyamp.native``).

        This run's loss-scale settings are kept (``GradScaler`` adopts the saved ones instead);
        a RuntimeWarning names the settings that differ from the checkpoint's. A recipe's state
        (``"recipe"``) is checked before anything is restored and applied after the loss scale.
        """
        saved = self._saved_recipe(state)
        finish = self._recipe_loader(saved.get("state")) if saved is not None else None
        if isinstance(state, dict):
            state = {k: v for k, v in state.items() if k != "recipe"}
        self._load_loss_scale(state)
        if finish is not None:
            finish()

    def _recipe_state(self) -> dict | None:
        """The recipe's state for ``state_dict`` (``{"calls": n, "delayed": {...}}``); a front end with
        recipes overrides it."""
        return None

    def _recipe_loader(self, state: Any):
        """A callable that restores a checkpoint's recipe state (checked here, before the loss scale is
        restored, where the front end can)."""
        raise PolyampError(f"the checkpoint holds a recipe state, which polyamp.{self.framework} does not "
                           "restore")  # fmt: skip

    def _load_loss_scale(self, state: Any) -> None:
        if not (isinstance(state, dict) and "state" in state and "policy" in state):
            if not isinstance(self.loss_scale, DynamicLossScale):
                raise PolyampError(
                    f"a native loss-scaler checkpoint holds a dynamic loss scale, but this run has "
                    f"{type(self.loss_scale).__name__} (policy {self.policy.name!r}); expected a dict "
                    f"from MixedPrecision.state_dict(), got {type(state).__name__}"
                )
            config, new_state = from_native(state)
            _warn_if_config_differs(config.as_dict(), self.loss_scale)
            self.state = new_state
            return
        if Policy.parse(state["policy"]) != self.policy:
            raise PolyampError(
                f"the checkpoint was saved with policy {state['policy']!r}, this run uses "
                f"{self.policy.name!r}; create MixedPrecision({state['policy']!r}) to resume it"
            )
        new_state = LossScaleState.from_dict(state["state"])
        _warn_if_config_differs(state.get("loss_scale"), self.loss_scale)
        self.state = new_state

    # -- another framework's idiom -------------------------------------------------------------------
    def __getattr__(self, name: str):
        owner = idiom_owner(name)
        if owner is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        instead = {  # this framework's way to do what the other idiom's method does
            ("torch", "scale"): "mp.backward(loss) multiplies the loss by the scale and backpropagates it, "
                                "and mp.current_scale reads the scale",
            ("torch", "scale_loss"): "mp.backward(loss) multiplies the loss by the scale and backpropagates "
                                     "it, and mp.current_scale reads the scale",
            ("torch", "apply"): "mp.step(optimizer) unscales, checks and steps",
            ("torch", "update"): "mp.step(optimizer) unscales, checks, steps and updates the scale",
            ("keras", "scale"): "fit with mp.optimizer(...) scales the loss, checks and skips; a custom loop "
                                "on Keras's JAX backend is polyamp.jax's (model.stateless_call)",
            ("keras", "apply"): "fit with mp.optimizer(...) unscales, checks and skips; a custom loop on "
                                "Keras's JAX backend is polyamp.jax's (model.stateless_call)",
        }.get((self.framework, name))  # fmt: skip
        here = f" In {self.framework}: {instead}." if instead else ""
        raise WrongIdiomError(
            f"{name}() is the {owner} idiom; this MixedPrecision drives {self.framework}.{here} Use one "
            f"MixedPrecision per framework: MixedPrecision({self.policy.name!r}, framework={owner!r})"
        )

    def _saved_recipe(self, state: Any) -> dict | None:
        """A checkpoint's ``"recipe"`` entry (``{"name": recipe_spec, "state": ...}``, or None); a
        PolyampError when it was saved under another recipe (spelling, overrides included) than this run's."""
        saved = state.get("recipe") if isinstance(state, dict) else None
        ours = recipe_spec(self.recipe) if self.recipe is not None else None
        theirs = (saved or {}).get("name")
        if theirs != ours and isinstance(state, dict) and "policy" in state:
            raise PolyampError(f"the checkpoint was saved with recipe {theirs!r}, this run uses {ours!r}; "
                               "create MixedPrecision with the checkpoint's to resume it")  # fmt: skip
        return saved

    def __repr__(self) -> str:
        keep = f", keep_fp32={self.keep_fp32!r}" if self.keep_fp32 else ""
        name = recipe_spec(self.recipe) if self.recipe is not None else self.policy.name
        try:
            scale = f"{self.current_scale:g}"
        except PolyampError:  # a state only a traced graph holds (TensorFlow inside a tf.function)
            scale = "<traced>"
        return f"MixedPrecision({name!r}, framework={self.framework!r}, scale={scale}{keep})"


SHARED_METHODS = ("backward", "step", "watch", "autocast", "optimizer")
"""The methods every front end has (MXNet: all but ``optimizer``); the rest are one framework's idioms."""


class _Unbound(MixedPrecision):
    """A ``MixedPrecision`` made while several frameworks (or none) were imported: at the first
    call that tells the framework it becomes that framework's object (its class is swapped; the
    policy, loss scale and state set so far are kept)."""

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        owner = idiom_owner(name)
        if owner is None and name not in SHARED_METHODS:
            raise AttributeError(f"'MixedPrecision' object has no attribute {name!r}")

        def call(*args, **kwargs):  # binds when called, not when looked up (hasattr binds nothing)
            framework = owner or self._framework_of(name, args)
            return getattr(self._become(framework), name)(*args, **kwargs)

        return call

    def _framework_of(self, method: str, args: tuple) -> str:
        """The framework a shared method's call is for, from its first argument."""
        first = args[0] if args else None
        if type(first) in (list, tuple) and first:
            first = first[0]  # mp.step([opt1, opt2])
        name = detect(first) if first is not None else None
        if name is not None:
            return name
        if method == "autocast" and callable(first):
            return "jax"  # mp.autocast(fn) rewrites a JAX function
        eager = [f for f in imported_frameworks() if f in ("torch", "mxnet")]
        if method == "autocast" and first is None and len(eager) == 1:
            return eager[0]  # the context form is the torch and MXNet idiom
        if first is None:
            raise PolyampError(
                "cannot tell which framework this MixedPrecision drives "
                f"(imported: {', '.join(imported_frameworks()) or 'none'}); pass framework='torch' "
                "(or 'tensorflow', 'jax', 'mxnet'), or hand it a model first (mp.watch(model))"
            )
        raise PolyampError(
            f"{method}() must be handed a tensor/model/optimizer of a supported framework, got "
            f"{type(first).__module__}.{type(first).__name__}"
        )

    def _become(self, framework: str) -> MixedPrecision:
        cls = front_end(framework)
        state = self._state
        self.__class__ = cls
        if self.recipe is not None:
            self._check_recipe()
        self._check_training_state()
        self._setup()
        self.state = state  # a front end that keeps the state in framework variables adopts it
        return self

    def __repr__(self) -> str:
        return f"MixedPrecision({self.policy.name!r}, framework=None, scale={self.current_scale:g})"


def _warn_if_config_differs(saved: Any, loss_scale: Any) -> None:
    """Resuming keeps this run's loss-scale settings (GradScaler adopts the saved ones): say so
    when they differ from the checkpoint's."""
    ours = loss_scale.as_dict() if hasattr(loss_scale, "as_dict") else None
    if not isinstance(saved, dict) or not isinstance(ours, dict) or saved == ours:
        return
    changed = [f"{k}={saved.get(k)!r} -> {ours.get(k)!r}" for k in sorted(set(saved) | set(ours))
               if saved.get(k) != ours.get(k)]  # fmt: skip
    warnings.warn(
        "the checkpoint's loss-scale settings differ from this run's; the saved state (scale, "
        f"counters) is restored and this run's settings are kept: {', '.join(changed)}",
        RuntimeWarning,
        stacklevel=3,
    )
