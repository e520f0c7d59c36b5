"""Loss scaling as a pure, framework-neutral state machine: a frozen config and a small state.

Backends only say whether this step's gradients are finite (agreed across ranks) and multiply by
``state.scale``; the algorithm lives here once::

    ls = DynamicLossScale.preset("torch")        # or DynamicLossScale(...), NoLossScale(), ...
    state = ls.init()
    for batch in data:
        ...                                      # backward of loss * state.scale, unscale, finite?
        state = ls.update(state, finite)         # the optimizer step is skipped when not finite
        ls.check(state, where=first_bad_layer)   # NonFiniteError after too many skips in a row

Configs and states round-trip through ``as_dict()`` / ``from_dict()`` and pickle, every field
included, so a checkpoint can hold both: ``ls.as_dict()`` with ``state.as_dict()``, restored by
``loss_scale_from_dict`` and ``LossScaleState.from_dict`` (``MixedPrecision.state_dict()`` holds
both). A state is one type everywhere: in JAX its fields are 0-d arrays (a pytree), in a
TensorFlow step they are read from ``tf.Variable``s; ``on_host()`` makes them Python numbers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .errors import NonFiniteError, PolyampError, invalid
from .presets import PRESET_CONFIGS as _PRESETS
from .presets import PRESETS
from .step import is_count, is_number

SCALE_DTYPES = ("float64", "float32", "float32-ftz")
_F32_TINY = 2.0**-126  # smallest normal float32


def _known_keys(cls: type, data: Mapping[str, Any], what: str, extra: tuple[str, ...] = ()) -> None:
    if not isinstance(data, Mapping):
        raise PolyampError(f"expected a dict of {what} fields; received {data!r}")
    names = [*extra, *(f.name for f in fields(cls))]
    unknown = [key for key in data if key not in names]
    if unknown:
        raise invalid(f"{what} field", unknown[0], names)


@dataclass(frozen=True)
class LossScaleState:
    """Where a loss scale stands; a value, never mutated.

    ``scale`` is the factor for the next step's loss. ``good_steps`` counts finite steps toward the
    next growth (since the last growth or overflow; it starts at ``-growth_delay``).
    ``hysteresis_left`` is how many more overflows are tolerated before backing off.
    ``skipped_in_a_row`` counts consecutive non-finite steps (for ``check``); ``steps`` and
    ``skipped`` count all updates and all skipped ones. ``next_scale`` is the scale already
    decided but not yet in effect (only for ``one_step_lag``; otherwise None).
    """

    scale: float
    good_steps: int = 0
    hysteresis_left: int = 1
    skipped_in_a_row: int = 0
    steps: int = 0
    skipped: int = 0
    next_scale: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain Python numbers."""
        return asdict(self.on_host())

    def on_host(self) -> LossScaleState:
        """This state with Python numbers as fields (from 0-d arrays or tensors of any framework)."""
        values = {k: int(getattr(self, k)) for k in COUNTERS}
        next_scale = None if self.next_scale is None else float(self.next_scale)
        return LossScaleState(scale=float(self.scale), next_scale=next_scale, **values)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LossScaleState:
        """The inverse of :meth:`as_dict`; missing counters take their defaults."""
        _known_keys(cls, data, "loss-scale state")
        if "scale" not in data:
            raise PolyampError(f"a loss-scale state needs 'scale'; received keys {sorted(data)}")
        for key, value in data.items():
            if key in ("scale", "next_scale"):
                ok = is_number(value) and value >= 0 or (key == "next_scale" and value is None)
                accepted = "a number >= 0 (inf allowed)" + (" or None" if key == "next_scale" else "")
            else:
                ok = is_count(value, _STATE_MINIMA[key])
                accepted = f"an integer >= {_STATE_MINIMA[key]}"
            if not ok:
                raise PolyampError(f"loss-scale state field {key!r} must be {accepted}; received {value!r}")
        values = {k: int(v) for k, v in data.items() if k not in ("scale", "next_scale")}
        next_scale = data.get("next_scale")
        return cls(
            scale=float(data["scale"]),
            next_scale=None if next_scale is None else float(next_scale),
            **values,
        )


# the smallest value each counter of a valid state can hold (good_steps starts at -growth_delay)
_STATE_MINIMA = {"good_steps": -(2**31), "hysteresis_left": 1, "skipped_in_a_row": 0, "steps": 0,
                 "skipped": 0}  # fmt: skip


class _Host:
    """The array namespace of the update rule for plain Python numbers (the eager, host path)."""

    @staticmethod
    def where(cond, a, b):
        return a if cond else b

    minimum, maximum, isfinite = staticmethod(min), staticmethod(max), staticmethod(math.isfinite)


def _counters(state: dict, finite, xp) -> dict:
    """The counters every loss scale keeps, written once for every namespace (selects, no branch)."""
    return {
        "good_steps": xp.where(finite, state["good_steps"] + 1, 0),
        "skipped_in_a_row": xp.where(finite, 0, state["skipped_in_a_row"] + 1),
        "steps": state["steps"] + 1,
        "skipped": state["skipped"] + xp.where(finite, 0, 1),
    }


# the integer fields of LossScaleState that update_arrays carries next to the scale
COUNTERS = ("good_steps", "hysteresis_left", "skipped_in_a_row", "steps", "skipped")


def state_arrays(state: LossScaleState, xp) -> dict:
    """A state as 0-d arrays for :meth:`update_arrays`: float32 scale, int32 counters."""
    return {"scale": xp.asarray(state.scale, dtype=xp.float32),
            **{k: xp.asarray(getattr(state, k), dtype=xp.int32) for k in COUNTERS}}  # fmt: skip


def state_from_arrays(arrays: dict) -> LossScaleState:
    """The inverse of :func:`state_arrays` (host values)."""
    return LossScaleState(**arrays).on_host()


def _finite_flag(finite: object) -> bool:
    """``finite`` as a Python bool: a bool or a one-element boolean array/tensor, else PolyampError."""
    if isinstance(finite, (bool, np.bool_)):
        return bool(finite)
    shape = tuple(getattr(finite, "shape", ()) or ())
    dtype = str(getattr(finite, "dtype", type(finite).__name__))
    if "bool" not in dtype or int(np.prod(shape)) != 1:
        raise PolyampError(
            f"finite must be a bool (one flag for the whole step, agreed across ranks); received "
            f"{type(finite).__name__} of dtype {dtype} and shape {shape}"
        )
    return bool(finite)


def _check_state(state: object) -> None:
    if not isinstance(state, LossScaleState):
        raise PolyampError(
            f"expected a LossScaleState (from init() or a previous update()); received {type(state).__name__}"
        )


_GUARD_RULE = ("max_consecutive_skips", lambda v: v is None or is_count(v, 1), "None or >= 1")


class _LossScale:
    """What every loss scale shares: the skip guard and the dict round trip."""

    kind = ""
    max_consecutive_skips: int | None

    def _validate(self, *rules: tuple[str, Callable[[Any], bool], str]) -> None:
        """Raise PolyampError for the first field whose rule fails: (name, ok(value), accepted)."""
        for name, ok, accepted in (*rules, _GUARD_RULE):
            value = getattr(self, name)
            if not ok(value):
                raise PolyampError(f"{type(self).__name__} {name} must be {accepted}; received {value!r}")

    def check_traceable(self, form: str = "traced") -> None:
        """PolyampError when :meth:`update_arrays` cannot run this loss scale (only MXNet's
        ``one_step_lag``); ``form`` names the caller's traced form (``tf.function``, ``jit``)."""
        if getattr(self, "one_step_lag", False):
            raise PolyampError(f"the 'mxnet' loss-scale preset (one_step_lag) has no {form} form; use "
                               "another preset, e.g. 'polyamp' or 'torch'")  # fmt: skip

    def _rule(self, state: dict, finite, xp, const: Callable, fit: Callable) -> dict:
        """The new state's fields, written once for every array namespace ``xp`` (selects, no
        branch): here the counters only; the dynamic scale adds its rule. ``const`` makes a
        constant of the scale's type and ``fit`` rounds a new scale to it."""
        return {**state, **_counters(state, finite, xp)}

    def update(self, state: LossScaleState, finite: bool) -> LossScaleState:
        """The state after one step whose gradients were ``finite`` or not (pure; the rule runs
        on Python numbers)."""
        _check_state(state)
        new = self._rule(state.as_dict(), _finite_flag(finite), _Host, float, float)
        return LossScaleState(**new)

    def update_arrays(self, state: dict, finite, xp) -> dict:
        """:meth:`update`'s rule on arrays, for inside ``jit``/``tf.function``.

        ``state`` maps the fields of :class:`LossScaleState` (less ``next_scale``) to 0-d arrays
        (the scale as float32); ``finite`` is a 0-d bool array; ``xp`` is the array namespace
        (``numpy``, ``jax.numpy``, or one with ``where``, ``minimum``, ``maximum``, ``isfinite``,
        ``abs``, ``zeros_like`` and ``asarray``). The same rule as :meth:`update`, so the whole
        step stays in one compiled graph.
        """
        dtype = state["scale"].dtype
        return self._rule(state, finite, xp, lambda v: xp.asarray(v, dtype=dtype), self._fit(xp))

    def _fit(self, xp) -> Callable:
        """How a new array scale is rounded: float32 arithmetic already rounds; nothing more here."""
        return lambda x: x

    def check(self, state: LossScaleState, where: str | None = None, nonfinite: tuple[str, ...] = (),
              skipped_before: int | None = None) -> None:  # fmt: skip
        """Warn at the first skipped step of a run without loss scaling; raise NonFiniteError once
        ``max_consecutive_skips`` steps in a row were not finite.

        ``where`` names the layer that first produced a non-finite value, when known (``debug=True``
        with ``watch(model)``); ``nonfinite`` the parameters whose gradients were not finite;
        ``skipped_before`` the skip count at the previous check (default: ``state`` is one step
        after it).
        """
        if skipped_before is None:
            skipped_before = state.skipped - (state.skipped_in_a_row > 0)
        if self.kind == "none" and skipped_before == 0 < state.skipped:
            warnings.warn(_FIRST_SKIP.format(where=_known(where, nonfinite)), RuntimeWarning, stacklevel=3)
        limit = self.max_consecutive_skips
        if limit is None or state.skipped_in_a_row < limit:
            return
        scaled = self.kind != "none"
        raise NonFiniteError(
            f"{state.skipped_in_a_row} consecutive steps were skipped because the gradients were "
            f"not finite (loss scale {state.scale:g}, max_consecutive_skips={limit}); "
            f"{_known(where, nonfinite)}. Training is not progressing: lower the learning rate, "
            "check the data and the loss for NaN/inf (log(0), division by zero, a too small eps), "
            + ("keep that layer in float32, or train in bf16, which has float32's range and needs no "
               "loss scaling. " if scaled else
               "or keep that layer in float32 (with no loss scaling, a NaN/inf is not an overflow "
               "that a scale could fix). ")
            + "max_consecutive_skips=None turns this check off."
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        """The config as plain values, with ``kind`` for :func:`loss_scale_from_dict`."""
        return {"kind": self.kind, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        """The inverse of :meth:`as_dict`."""
        kind = data.get("kind", cls.kind) if isinstance(data, Mapping) else cls.kind
        if kind != cls.kind:
            raise invalid(f"kind for {cls.__name__}", kind, [cls.kind])
        _known_keys(cls, data, f"{cls.__name__} config", extra=("kind",))
        return cls(**{key: value for key, value in data.items() if key != "kind"})


@dataclass(frozen=True)
class NoLossScale(_LossScale):
    """No scaling (bf16, fp32): the scale stays 1; non-finite steps are counted and guarded."""

    max_consecutive_skips: int | None = 100
    kind = "none"

    def __post_init__(self) -> None:
        self._validate()

    def init(self) -> LossScaleState:
        return LossScaleState(scale=1.0)


@dataclass(frozen=True)
class StaticLossScale(_LossScale):
    """A fixed loss scale; non-finite steps are counted and guarded."""

    scale: float
    max_consecutive_skips: int | None = 100
    kind = "static"

    def __post_init__(self) -> None:
        self._validate(("scale", lambda v: is_number(v) and 0 < v < math.inf, "a finite number > 0"))

    def init(self) -> LossScaleState:
        return LossScaleState(scale=float(self.scale))


def _known(where: str | None, nonfinite: tuple[str, ...]) -> str:
    """What is known of where a non-finite value came from, as a clause."""
    if where:
        return f"the first non-finite value came from {where!r}"
    named = ""
    if nonfinite:
        shown = ", ".join(repr(n) for n in nonfinite[:5]) + (", ..." if len(nonfinite) > 5 else "")
        named = f"the gradients of {len(nonfinite)} parameter(s) were not finite ({shown}); "
    return (named + "the layer that first produced a non-finite value is not known (create the "
            "MixedPrecision with debug=True and call mp.watch(model) to find it)")  # fmt: skip


_FIRST_SKIP = (
    "a step was skipped because its gradients were not finite, in a run without loss scaling "
    "(bf16 or float32), where no overflow is expected: the NaN/inf comes from the model, the data "
    "or the learning rate; {where}. Later skips are counted without a warning "
    "(StepResult.stepped, state.skipped)."
)

BELOW_ONE_WARNING = (
    "the loss scale fell below 1: gradients are now scaled down, not up, and small ones flush to "
    "zero in float16. Scaling cannot fix real NaN/inf (from the data, the loss, a too high "
    "learning rate, a bf16-pretrained model run in fp16); min_scale=1 (polyamp's default) keeps "
    "a floor."
)


@dataclass(frozen=True)
class DynamicLossScale(_LossScale):
    """Dynamic loss scaling: back off on overflow, grow after a run of finite steps.

    The defaults are polyamp's (init 2^16, x2 every 2000 finite steps, x0.5 on overflow, floor 1,
    cap 2^24); :meth:`preset` gives the other libraries'. The fields after
    ``max_consecutive_skips`` reproduce their quirks: DeepSpeed's ``consecutive_hysteresis`` and
    ``growth_delay``, MXNet's ``one_step_lag``, Keras 3's ``allow_inf_scale``, and
    ``scale_dtype``: ``"float32"`` rounds the scale as a float32 tensor does, ``"float32-ftz"``
    also flushes a subnormal scale to 0 as TensorFlow and XLA kernels do.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    max_consecutive_skips: int | None = 100
    consecutive_hysteresis: bool = False
    growth_delay: int = 0
    one_step_lag: bool = False
    allow_inf_scale: bool = False
    scale_dtype: str = "float64"
    kind = "dynamic"

    def __post_init__(self) -> None:
        lo, hi = self.min_scale, self.max_scale
        flag = (lambda v: isinstance(v, bool), "True or False")
        self._validate(
            ("growth_factor", lambda v: is_number(v) and 1 < v < math.inf, "a finite number > 1"),
            ("backoff_factor", lambda v: is_number(v) and 0 < v < 1, "a number in (0, 1)"),
            ("growth_interval", lambda v: is_count(v, 1), "an integer >= 1"),
            ("hysteresis", lambda v: is_count(v, 1), "an integer >= 1"),
            ("growth_delay", lambda v: is_count(v, 0), "an integer >= 0"),
            ("min_scale", lambda v: is_number(v) and 0 <= v < math.inf, "a finite number >= 0"),
            (
                "max_scale",
                lambda v: is_number(v) and v > 0 and v >= lo,
                f"> 0 and >= min_scale={lo!r}",
            ),
            (
                "init_scale",
                lambda v: is_number(v) and 0 < v < math.inf and lo <= v <= hi,
                f"finite, > 0 and within [min_scale, max_scale] = [{lo!r}, {hi!r}]",
            ),
            ("consecutive_hysteresis", *flag),
            ("one_step_lag", *flag),
            ("allow_inf_scale", *flag),
            ("scale_dtype", lambda v: v in SCALE_DTYPES, " or ".join(map(repr, SCALE_DTYPES))),
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DynamicLossScale:
        """The config that reproduces a library's own scale trajectory; one of :data:`PRESETS`,
        with any field changed by ``overrides`` (``preset("torch", growth_interval=10)``)."""
        key = name.lower() if isinstance(name, str) else None
        if key not in _PRESETS:
            raise invalid("loss-scale preset", name, PRESETS)
        names = [f.name for f in fields(cls)]
        unknown = [k for k in overrides if k not in names]
        if unknown:
            raise invalid(f"field of preset({name!r})", unknown[0], names)
        return cls(**{**_PRESETS[key], **overrides})

    def _round(self, scale: float) -> float:
        if self.scale_dtype == "float64":
            return float(scale)
        with np.errstate(over="ignore"):
            rounded = float(np.float32(scale))
        if self.scale_dtype == "float32-ftz" and abs(rounded) < _F32_TINY:
            return 0.0
        return rounded

    def init(self) -> LossScaleState:
        scale = self._round(self.init_scale)
        return LossScaleState(
            scale=scale,
            good_steps=-self.growth_delay,
            hysteresis_left=self.hysteresis,
            next_scale=scale if self.one_step_lag else None,
        )

    def update(self, state: LossScaleState, finite: bool) -> LossScaleState:
        """The state after one step whose gradients were ``finite`` or not. Pure; never raises.

        finite: ``good_steps += 1`` (``hysteresis_left`` is refilled if
        ``consecutive_hysteresis``); once ``good_steps == growth_interval``: ``good_steps = 0``,
        ``hysteresis_left = hysteresis`` and ``scale = min(scale * growth_factor, max_scale)``,
        kept only if finite unless ``allow_inf_scale``.

        not finite (the step is skipped): ``good_steps = -growth_delay``; if
        ``hysteresis_left > 1`` it is decremented and the scale kept, otherwise
        ``scale = max(scale * backoff_factor, min_scale)`` (``hysteresis_left`` stays 1).

        With ``scale_dtype="float32"`` every new scale is rounded to float32 (``"float32-ftz"``:
        and a subnormal result flushed to 0, as TensorFlow and XLA CPU kernels do). With
        ``one_step_lag`` the rule runs on ``next_scale`` and ``scale`` becomes the previous
        ``next_scale``. A RuntimeWarning says when the scale falls below 1.
        """
        _check_state(state)
        finite = _finite_flag(finite)
        lagged = self.one_step_lag and state.next_scale is not None
        base = state.next_scale if lagged else state.scale
        new = self._rule({**state.as_dict(), "scale": base}, finite, _Host, float, self._round)
        scale, next_scale = (base, new["scale"]) if self.one_step_lag else (new["scale"], None)
        if scale < 1 <= state.scale:
            warnings.warn(BELOW_ONE_WARNING, RuntimeWarning, stacklevel=2)
        return LossScaleState(**{**new, "scale": scale, "next_scale": next_scale})

    def _rule(self, state: dict, finite, xp, const: Callable, fit: Callable) -> dict:
        """The rule of :meth:`update`, once, with selects (see ``_LossScale._rule``)."""
        scale, hyst = state["scale"], state["hysteresis_left"]
        good = xp.where(finite, state["good_steps"] + 1, -self.growth_delay)
        grows = good >= self.growth_interval  # only ever on a finite step: growth_delay >= 0
        grown = fit(xp.minimum(scale * const(self.growth_factor), const(self.max_scale)))
        if not self.allow_inf_scale:
            grown = xp.where(xp.isfinite(grown), grown, scale)
        shrunk = fit(xp.maximum(scale * const(self.backoff_factor), const(self.min_scale)))
        backs = xp.where(finite, False, hyst <= 1)
        kept = self.hysteresis if self.consecutive_hysteresis else hyst
        return {
            **state,
            **_counters(state, finite, xp),
            "scale": xp.where(grows, grown, xp.where(backs, shrunk, scale)),
            "good_steps": xp.where(grows, 0, good),
            "hysteresis_left": xp.where(grows, self.hysteresis,
                                        xp.where(finite, kept, xp.where(hyst > 1, hyst - 1, hyst))),
        }  # fmt: skip

    def _fit(self, xp) -> Callable:
        if self.scale_dtype != "float32-ftz":
            return lambda x: x
        return lambda x: xp.where(xp.abs(x) < _F32_TINY, xp.zeros_like(x), x)

    def update_arrays(self, state: dict, finite, xp) -> dict:
        """The rule of :meth:`update` on arrays (see ``_LossScale.update_arrays``).

        The scale is float32 here, which is what the torch, keras and jmp presets model anyway
        (``float32-ftz`` also flushes a subnormal scale to 0). What holds: the result equals
        :meth:`update`'s whenever ``scale_dtype`` is ``"float32"`` or ``"float32-ftz"``; with
        ``"float64"`` (polyamp's default, kept exact on the host) it equals it while every scale
        along the way is a float32 value, which holds for power-of-two factors and bounds (all
        presets) but not, e.g., for ``growth_factor=3`` once a scale needs more than 24 bits.
        ``one_step_lag`` (MXNet, an eager framework) has no traced form.
        """
        self.check_traceable()
        return super().update_arrays(state, finite, xp)


@runtime_checkable
class LossScale(Protocol):
    """What polyamp uses of a loss scale; ``NoLossScale``, ``StaticLossScale`` and
    ``DynamicLossScale`` implement it, and so must a custom one (checked by ``check_loss_scale``)."""

    kind: str
    max_consecutive_skips: int | None

    def init(self) -> LossScaleState: ...
    def update(self, state: LossScaleState, finite: bool) -> LossScaleState: ...
    def update_arrays(self, state: dict, finite: Any, xp: Any) -> dict: ...
    def check(self, state: LossScaleState, where: str | None = None, nonfinite: tuple[str, ...] = (),
              skipped_before: int | None = None) -> None: ...  # fmt: skip
    def check_traceable(self, form: str = "traced") -> None: ...
    def as_dict(self) -> dict[str, Any]: ...


LOSS_SCALE_MEMBERS = ("kind", "max_consecutive_skips", "init", "update", "update_arrays", "check",
                      "check_traceable", "as_dict")  # fmt: skip


def check_loss_scale(obj: Any) -> LossScale:
    """``obj`` when it has every member of :class:`LossScale`, else PolyampError naming the missing."""
    missing = [name for name in LOSS_SCALE_MEMBERS if not hasattr(obj, name)]
    if missing:
        raise PolyampError(
            f"a loss-scale object needs every member of polyamp.scaling.LossScale; "
            f"{type(obj).__name__} lacks {', '.join(missing)} (subclassing DynamicLossScale, "
            "StaticLossScale or NoLossScale provides them)"
        )
    return obj


_KINDS = {cls.kind: cls for cls in (NoLossScale, StaticLossScale, DynamicLossScale)}


def loss_scale_from_dict(data: dict[str, Any]) -> NoLossScale | StaticLossScale | DynamicLossScale:
    """Rebuild any loss-scale config from its ``as_dict()``, chosen by its ``kind``."""
    kind = data.get("kind") if isinstance(data, Mapping) else None
    if not isinstance(kind, str) or kind not in _KINDS:
        raise invalid("loss-scale kind", kind, _KINDS)
    return _KINDS[kind].from_dict(data)
