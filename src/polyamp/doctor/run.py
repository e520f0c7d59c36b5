"""``polyamp.doctor(model, batch, loss_fn=None, ...)``: tap one float32 step in the model's framework,
then predict and recommend in numpy (``report.build``).

The framework is ``framework`` when given, else the model's (a torch ``nn.Module``, a Keras model, an
MXNet Gluon block; for JAX the model is the params pytree and ``loss_fn(params, batch)`` is required).
Its front end's ``polyamp.<framework>.doctor.collect`` does the tapping and says what ``batch``,
``loss_fn`` and ``optimizer`` are in that framework's idiom; it leaves the model and optimizer as they were.
``device`` is where the training will run ("cpu", "cuda", ...; default: where the model's weights are,
``device_of``): the recommendation does not choose fp16-mixed where that framework runs it slowly or not
at all there (``recommend.fp16_slow``).
"""

from __future__ import annotations

import time

from ..errors import PolyampError
from ..frameworks import canonical_framework, detect, front_end_module
from ..numerics import get_format
from .blocks import Target, parse
from .report import Report, build

DEFAULT_FORMATS = ("fp16", "bf16", "e4m3fn", "e5m2")


def diagnose(model, batch, loss_fn=None, *, framework: str | None = None, steps: int = 1,
             formats=DEFAULT_FORMATS, optimizer=None, device: str | None = None) -> Report:  # fmt: skip
    """Observe ``steps`` float32 training steps of ``model`` on ``batch`` and report what each of
    ``formats`` would do to every layer's tensors, with a recommended policy (module docstring)."""
    formats = check_formats(formats)
    targets = measured_targets(formats)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PolyampError(f"steps must be a whole number >= 1, got {steps!r}")
    if device is not None and (not isinstance(device, str) or not device.strip()):
        raise PolyampError(f"device must name where the training runs, e.g. 'cpu' or 'cuda'; got {device!r}")
    name = canonical_framework(framework) if framework is not None else framework_of(model)
    device = device if device is not None else device_of(model)
    collect = front_end_module(name, "doctor").collect
    start = time.perf_counter()
    extra = {"measure": targets} if targets else {}  # scalar formats only: the taps as they were
    observations = collect(model, batch, loss_fn, steps=steps, optimizer=optimizer, **extra)
    seconds = time.perf_counter() - start
    return build(observations, formats, framework=name, steps=steps, seconds=seconds, device=device,
                 model=f"{type(model).__module__}.{type(model).__qualname__}")  # fmt: skip


def check_formats(formats) -> tuple[str, ...]:
    """The format names, each known, at least one: scalar formats (``get_format``, predicted) by their
    canonical names, block formats and recipes (``blocks.parse``, measured) by their labels."""
    if isinstance(formats, str):
        formats = tuple(f for f in formats.split(",") if f.strip())
    try:
        formats = tuple(formats)
    except TypeError:
        raise PolyampError(f"formats must be format names such as ('fp16', 'bf16'), got {formats!r}"
                           ) from None  # fmt: skip
    if not formats:
        raise PolyampError("formats is empty; name at least one, e.g. ('fp16', 'bf16', 'e4m3fn', 'e5m2')")
    return tuple(dict.fromkeys(_label(f) for f in formats))


def _label(name) -> str:
    target = parse(name)
    return get_format(name).name if target is None else target.label


def measured_targets(formats: tuple[str, ...]) -> tuple[Target, ...]:
    """The measured targets among ``check_formats``' labels, in order."""
    return tuple(t for t in map(parse, formats) if t is not None)


def device_of(model) -> str | None:
    """The device type of a model's first weight, read from the object (no framework import): a torch
    module's parameters, an MXNet block's parameter contexts, a JAX pytree's arrays; else None."""
    try:
        if callable(getattr(model, "parameters", None)) and not hasattr(model, "collect_params"):
            return next(iter(model.parameters())).device.type  # torch
        if callable(getattr(model, "collect_params", None)):  # MXNet Gluon
            return next(iter(model.collect_params().values())).list_ctx()[0].device_type
        leaf = model
        while isinstance(leaf, (dict, list, tuple)) and leaf:
            leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        if callable(getattr(leaf, "devices", None)):  # a jax.Array
            return next(iter(leaf.devices())).platform
    except (StopIteration, AttributeError, IndexError, RuntimeError):  # no weight (yet): unknown
        return None
    return None


def framework_of(model) -> str:
    """The framework of a model, or of the first array leaf of a params pytree (JAX)."""
    name = detect(model)
    leaf = model
    while name is None and isinstance(leaf, (dict, list, tuple)) and leaf:
        leaf = next(iter(leaf.values())) if isinstance(leaf, dict) else leaf[0]
        name = detect(leaf)
    if name is None:
        raise PolyampError(
            f"model: expected a torch nn.Module, a Keras model, an MXNet Gluon block or a JAX params pytree "
            f"(with loss_fn(params, batch)), got {type(model).__module__}.{type(model).__qualname__}"
        )
    return name
