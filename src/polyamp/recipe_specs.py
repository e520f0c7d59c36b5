"""The recipes' settings: the :class:`Recipe` fields, the four presets, their checks and spelling.

:func:`get_recipe` builds a preset with overrides and checks every field against the recipe's kind;
:func:`parse_recipe` reads the ``name:field=value`` spelling that :func:`recipe_spec` writes;
:func:`refusal` says which front ends train with a recipe. ``polyamp.recipes`` holds the scale
arithmetic and is where these names are imported from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .errors import PolyampError, invalid
from .numerics import BLOCK_FORMATS, get_format
from .step import is_count, is_number

RECIPES = ("fp8-tensorwise", "fp8-delayed", "mxfp8", "nvfp4")
BUILT_ON = ("torch", "tensorflow", "jax", "mxnet")  # the front ends whose MixedPrecision trains with a recipe
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
KEEP_TOKENS = ("first", "last")
_ROUNDINGS = ("nearest", "stochastic")
_COMPUTE_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Recipe:
    """One training recipe: which matmul operands are quantized, to what, and how scaled.

    ``kind``: ``tensorwise`` | ``delayed`` (one float32 scale per tensor, scalar fp8 formats) or
    ``block`` (an MX / NVFP4 block format from ``polyamp.numerics.BLOCK_FORMATS``).
    ``forward_format``: inputs and weights (all three GEMMs use them in this format);
    ``backward_format``: the output gradient (input-gradient and weight-gradient GEMMs).
    ``quantize_forward`` / ``quantize_input_grad`` / ``quantize_weight_grad``: which GEMMs are
    quantized (TE's fprop / dgrad / wgrad); a GEMM that is not keeps its operands in
    ``compute_dtype``, in which every product is computed.
    ``keep``: layers left unquantized: ``"first"`` and ``"last"`` name the first and last matmul
    layer of the model (in call order), any other string is a layer-name pattern (``fnmatch``) for
    the front end; default ``("first", "last")``, as the published FP8 / FP4 recipes keep the
    embedding-side and output layers in bf16.
    ``forward_rounding`` / ``grad_rounding``: element rounding, ``nearest`` (ties to even) or
    ``stochastic``.
    ``margin``: scale divided by ``2^margin`` (tensorwise, delayed). ``amax_epsilon``: amax floor
    for current scaling (TE's default 0; torchao uses 1e-12). ``history_len`` /
    ``amax_compute_algo``: delayed scaling only (TE's defaults 1024 / ``max``). ``reduce_amax``
    (delayed): each amax is all-reduced (max) over the data-parallel ranks before it enters the history,
    so every rank keeps the same histories and scales (TE's default, True).
    ``scale_rule``: the MX scale rule (``rceil`` for mxfp8; NVFP4 has one rule, None).
    ``weight_2d``: NVFP4 weights in 16x16 blocks. ``hadamard``: NVFP4's 16x16 random Hadamard
    transform on the weight-gradient operands (off by default here; TE applies it by default).
    """

    name: str
    kind: str
    forward_format: str
    backward_format: str
    quantize_forward: bool = True
    quantize_input_grad: bool = True
    quantize_weight_grad: bool = True
    keep: tuple[str, ...] = KEEP_TOKENS
    compute_dtype: str = "bf16"
    forward_rounding: str = "nearest"
    grad_rounding: str = "nearest"
    margin: int = 0
    amax_epsilon: float = 0.0
    history_len: int | None = None
    amax_compute_algo: str | None = None
    reduce_amax: bool = True
    scale_rule: str | None = None
    weight_2d: bool = False
    hadamard: bool = False

    def __post_init__(self) -> None:
        _check_recipe(self)

    @property
    def gemms(self) -> tuple[str, ...]:
        """The quantized GEMMs, of ``forward``, ``input_grad``, ``weight_grad``."""
        flags = (self.quantize_forward, self.quantize_input_grad, self.quantize_weight_grad)
        return tuple(g for g, on in zip(("forward", "input_grad", "weight_grad"), flags) if on)

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain values (``keep`` as a list)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["keep"] = list(self.keep)
        return out


_PRESETS: dict[str, dict[str, Any]] = {
    "fp8-tensorwise": {"kind": "tensorwise", "forward_format": "e4m3fn", "backward_format": "e5m2"},
    "fp8-delayed": {"kind": "delayed", "forward_format": "e4m3fn", "backward_format": "e5m2",
                    "history_len": 1024, "amax_compute_algo": "max"},
    "mxfp8": {"kind": "block", "forward_format": "mxfp8_e4m3", "backward_format": "mxfp8_e4m3",
              "scale_rule": "rceil"},
    "nvfp4": {"kind": "block", "forward_format": "nvfp4", "backward_format": "nvfp4",
              "grad_rounding": "stochastic", "weight_2d": True},
}  # fmt: skip

# fields a recipe of that kind does not use: setting one to a non-default value is an error
_ONLY = {
    "margin": ("tensorwise", "delayed"),
    "amax_epsilon": ("tensorwise",),
    "history_len": ("delayed",),
    "amax_compute_algo": ("delayed",),
    "reduce_amax": ("delayed",),
    "scale_rule": ("block",),
    "weight_2d": ("nvfp4",),
    "hadamard": ("nvfp4",),
}
_DEFAULTS = {f.name: f.default for f in fields(Recipe)}


def get_recipe(name: str | Recipe, **overrides: Any) -> Recipe:
    """The recipe ``name`` (one of :data:`RECIPES`, or a :class:`Recipe`) with ``overrides``.

    >>> get_recipe("fp8-delayed", history_len=16).history_len
    16
    """
    if isinstance(name, Recipe):
        base = name
    else:
        key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
        if key not in _PRESETS:
            raise invalid("recipe", name, RECIPES)
        base = Recipe(name=key, **_PRESETS[key])
    names = [f.name for f in fields(Recipe) if f.name not in ("name", "kind")]
    for field in overrides:
        if field not in names:
            raise invalid(f"field of recipe {base.name!r}", field, names)
    return replace(base, **overrides) if overrides else base


def refusal(recipe: Recipe, framework: str) -> str | None:
    """Why ``framework``'s front end cannot train with ``recipe`` yet, or None when it can."""
    name = repr(recipe.name)
    if framework not in BUILT_ON:
        return (f"the {name} recipe trains in polyamp's {', '.join(BUILT_ON)} front ends so far, not in "
                f"{framework}'s; accepted there: the 16-bit policies (bf16-mixed, fp16-mixed, ...)")
    return None


def parse_recipe(spec: str) -> Recipe:
    """A recipe from its spelling: a name of :data:`RECIPES`, each override after a ``:`` as
    ``field=value`` (``"mxfp8:scale_rule=floor"``, ``"nvfp4:keep=:grad_rounding=nearest"``; no commas, so
    a spelling fits a comma-separated list). Values: ``true`` / ``false``, integers, numbers, words;
    ``keep`` lists its entries separated by ``|`` (empty: keep nothing). :func:`recipe_spec` writes it.
    """
    name, *items = spec.split(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in items)):
        field, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise PolyampError(f"recipe {spec!r}: {item!r} is not field=value (e.g. "
                               "'mxfp8:scale_rule=floor')")  # fmt: skip
        overrides[field] = _value(field, value)
    return get_recipe(name, **overrides)


def _value(field: str, text: str) -> Any:
    if field == "keep":
        return tuple(filter(None, (t.strip() for t in text.split("|"))))
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None if low == "none" else text


def recipe_spec(r: Recipe) -> str:
    """The shortest :func:`parse_recipe` spelling of ``r``: its name, then the fields that differ from
    the preset's, in field order."""
    base = get_recipe(r.name)
    changed = [f.name for f in fields(Recipe) if getattr(r, f.name) != getattr(base, f.name)]
    if not changed:
        return r.name

    def text(field: str) -> str:
        value = getattr(r, field)
        if field == "keep":
            return "|".join(value)
        return str(value).lower() if isinstance(value, bool) else str(value)

    return ":".join([r.name, *(f"{f}={text(f)}" for f in changed)])


def _check_recipe(r: Recipe) -> None:
    def bad(field: str, accepted: str) -> PolyampError:
        return PolyampError(f"recipe {r.name!r}: {field} must be {accepted}; received {getattr(r, field)!r}")

    if r.kind not in ("tensorwise", "delayed", "block"):
        raise bad("kind", "'tensorwise', 'delayed' or 'block'")
    family = "nvfp4" if r.kind == "block" and r.forward_format == "nvfp4" else r.kind
    for field, kinds in _ONLY.items():
        if family not in kinds and r.kind not in kinds and getattr(r, field) != _DEFAULTS[field]:
            raise PolyampError(f"recipe {r.name!r}: {field} applies only to {' / '.join(kinds)} recipes; "
                               f"received {field}={getattr(r, field)!r}")  # fmt: skip
    for field in ("forward_format", "backward_format"):
        value = getattr(r, field)
        if r.kind == "block":
            if value not in BLOCK_FORMATS:
                raise invalid(f"{field} for recipe {r.name!r} (a block format)", value, BLOCK_FORMATS)
        else:
            try:
                canonical = get_format(value).name if isinstance(value, str) else None
            except PolyampError as e:
                raise PolyampError(f"recipe {r.name!r}: {field}: {e}") from None
            if canonical is None:
                raise bad(field, "a format name")
            object.__setattr__(r, field, canonical)
    if r.kind == "block" and (r.forward_format == "nvfp4") != (r.backward_format == "nvfp4"):
        raise PolyampError(f"recipe {r.name!r}: forward_format and backward_format must both be nvfp4 or "
                           f"both MX; received {r.forward_format!r} and {r.backward_format!r}")  # fmt: skip
    for field in ("quantize_forward", "quantize_input_grad", "quantize_weight_grad", "weight_2d", "hadamard",
                  "reduce_amax"):
        if not isinstance(getattr(r, field), (bool, np.bool_)):
            raise bad(field, "True or False")
    keep = r.keep
    if (
        isinstance(keep, str)
        or not isinstance(keep, (tuple, list))
        or not all(isinstance(k, str) and k.strip() for k in keep)
    ):
        raise bad("keep", "a tuple of non-empty strings ('first', 'last' or layer-name patterns)")
    object.__setattr__(r, "keep", tuple(keep))
    if r.compute_dtype not in _COMPUTE_DTYPES:
        raise invalid(f"compute_dtype for recipe {r.name!r}", r.compute_dtype, _COMPUTE_DTYPES)
    for field in ("forward_rounding", "grad_rounding"):
        if getattr(r, field) not in _ROUNDINGS:
            raise invalid(f"{field} for recipe {r.name!r}", getattr(r, field), _ROUNDINGS)
    if not is_count(r.margin, 0):
        raise bad("margin", "an integer >= 0")
    if not (is_number(r.amax_epsilon) and 0 <= r.amax_epsilon < math.inf):
        raise bad("amax_epsilon", "a finite number >= 0")
    if r.kind == "delayed":
        if not is_count(r.history_len, 1):
            raise bad("history_len", "an integer >= 1")
        if r.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise invalid(f"amax_compute_algo for recipe {r.name!r}", r.amax_compute_algo, AMAX_COMPUTE_ALGOS)
    if r.kind == "block":
        rules = BLOCK_FORMATS[r.forward_format].rules
        if rules and r.scale_rule not in rules:
            raise invalid(f"scale_rule for recipe {r.name!r}", r.scale_rule, rules)
        if not rules and r.scale_rule is not None:
            raise bad("scale_rule", "None (NVFP4 has one scale rule)")
