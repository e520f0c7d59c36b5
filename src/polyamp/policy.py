"""Precision policies: which dtype parameters, computation and outputs use, in every spelling.

A :class:`Policy` is three dtypes. :meth:`Policy.parse` reads each ecosystem's name for one,
case-insensitively:

=================================================  ===========================================
spelling                                           policy (param, compute, output)
=================================================  ===========================================
``float32`` ``fp32`` ``full`` ``f32`` ``32``       float32 everywhere
``32-true`` ``no`` (Accelerate)
``bf16-mixed`` ``mixed_bfloat16`` ``bf16``         params and outputs float32, compute bfloat16
``fp16-mixed`` ``mixed_float16`` ``16-mixed``      params and outputs float32, compute float16
``16`` ``fp16``
``bf16-true`` ``bfloat16``                         bfloat16 everywhere
``fp16-true`` ``16-true`` ``float16`` ``f16``      float16 everywhere
``half``
``64-true`` ``64`` ``float64`` ``f64``             float64 everywhere
``p=f32,c=bf16,o=f32`` (jmp grammar)               as written, see below
``bf16-true:sr`` ``bf16-mixed:states=int8``        a policy with training-state options
=================================================  ===========================================

After a colon, training-state options (``polyamp.training_state``): how 16-bit weights take their
update (``sr``, ``kahan``, ``nearest``) and the optimizer moments' form (``states=fp32|bf16|fp8|int8``).

A bare dtype means that dtype everywhere (Keras, jmp), so ``float16`` is *true* fp16, while the
Lightning and Accelerate shorthands ``16``, ``fp16`` and ``bf16`` mean *mixed*, as they do there.

jmp grammar: comma-separated ``key=dtype`` with keys ``p|params|param``, ``c|compute``,
``o|output`` and dtypes ``full|f32|float32``, ``bf16|bfloat16``, ``f16|float16|half``,
``f64|float64``. As in jmp, unspecified params are float32, compute follows params and output
follows compute (``c=f16`` is ``p=f32,c=f16,o=f16``). jmp maps ``half`` to bfloat16 on TPU and
float16 elsewhere; a policy has no device, so here ``half`` is always float16.

>>> p = Policy.parse("mixed_bfloat16")
>>> p.param_dtype, p.compute_dtype, p.output_dtype, p.name
('float32', 'bfloat16', 'float32', 'bf16-mixed')
>>> str(Policy.parse("c=f16"))
'p=f32,c=f16,o=f16'
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PolyampError, invalid, suggestion
from .training_state import StateOptions

DTYPES = ("float32", "bfloat16", "float16", "float64")

# dtype spellings of the jmp grammar (and of the constructor) -> canonical name
_DTYPE_ALIASES = {
    "full": "float32",
    "f32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "f16": "float16",
    "float16": "float16",
    "half": "float16",
    "f64": "float64",
    "float64": "float64",
}
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
_KEYS = {
    "p": "param",
    "params": "param",
    "param": "param",
    "c": "compute",
    "compute": "compute",
    "o": "output",
    "output": "output",
}

_F32, _BF16, _F16, _F64 = DTYPES
# canonical name -> (param, compute, output); the first spelling of each group is its name
_NAMED = {
    ("float32", "fp32", "full", "f32", "32", "32-true", "no"): (_F32, _F32, _F32),
    ("bf16-mixed", "mixed_bfloat16", "bf16"): (_F32, _BF16, _F32),
    ("fp16-mixed", "mixed_float16", "16-mixed", "16", "fp16"): (_F32, _F16, _F32),
    ("bf16-true", "bfloat16"): (_BF16, _BF16, _BF16),
    ("fp16-true", "16-true", "float16", "f16", "half"): (_F16, _F16, _F16),
    ("64-true", "64", "float64", "f64"): (_F64, _F64, _F64),
}
_SPELLINGS = {spelling: dtypes for names, dtypes in _NAMED.items() for spelling in names}
_NAMES = {dtypes: names[0] for names, dtypes in _NAMED.items() if names[0] != "64-true"}

POLICY_NAMES = tuple(_SPELLINGS)
"""Every accepted named spelling (besides the jmp ``key=dtype`` grammar)."""

_GRAMMAR = (
    "or the jmp grammar 'p=f32,c=bf16,o=f32' (keys p|params|param, c|compute, o|output; "
    "dtypes full|f32|float32, bf16|bfloat16, f16|float16|half, f64|float64)"
)


def _dtype(value: object) -> str:
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in _DTYPE_ALIASES:
        raise invalid("dtype", value, _DTYPE_ALIASES)
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class Policy:
    """The dtypes of parameters, of computation and of outputs (aliases are canonicalised), and the
    training-state options (None: the framework's optimizer as it is)."""

    param_dtype: str
    compute_dtype: str
    output_dtype: str
    state: StateOptions | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _dtype(getattr(self, field)))
        if self.state is not None:
            self.state.check(self.param_dtype, self.name)

    @property
    def base_name(self) -> str:
        """The name without training-state options."""
        dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
        if dtypes in _NAMES:
            return _NAMES[dtypes]
        p, c, o = (_SHORT[d] for d in dtypes)
        return f"p={p},c={c},o={o}"

    @property
    def name(self) -> str:
        """``float32``, ``bf16-mixed``, ``fp16-mixed``, ``bf16-true``, ``fp16-true``, else jmp's; then
        ``:options`` when it has training-state options."""
        return self.base_name + (f":{self.state.spelling}" if self.state is not None else "")

    @property
    def needs_loss_scaling(self) -> bool:
        """True when gradients pass through float16 (compute or params): its range is narrow."""
        return _F16 in (self.param_dtype, self.compute_dtype)

    @property
    def is_mixed(self) -> bool:
        """True when computation runs in another dtype than the parameters are stored in."""
        return self.param_dtype != self.compute_dtype

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, spec: Policy | str | int) -> Policy:
        """A policy from any spelling in the module docstring; a Policy is returned as is."""
        if isinstance(spec, Policy):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = str(spec)  # Lightning accepts precision=16 / 32 / 64
        if not isinstance(spec, str):
            raise invalid("precision policy", spec, (*POLICY_NAMES, _GRAMMAR))
        key = spec.strip().lower()
        if ":" in key:
            base, _, options = key.partition(":")
            policy = cls.parse(base)
            state = StateOptions.parse(options, spec.strip())
            return cls(policy.param_dtype, policy.compute_dtype, policy.output_dtype, state)
        if key in _SPELLINGS:
            return cls(*_SPELLINGS[key])
        if "=" in key:
            return cls._parse_jmp(spec, key)
        hint = suggestion(spec, POLICY_NAMES)
        if hint:  # a near miss: the canonical names are enough next to the suggestion
            names = ", ".join(names[0] for names in _NAMED)
            raise PolyampError(f"unknown precision policy {spec!r}; {hint}accepted: {names}, their "
                               f"aliases (polyamp.policy.POLICY_NAMES), {_GRAMMAR}")  # fmt: skip
        raise invalid("precision policy", spec, (*POLICY_NAMES, _GRAMMAR))

    @classmethod
    def _parse_jmp(cls, spec: str, key: str) -> Policy:
        given: dict[str, str] = {}
        for part in key.split(","):
            name, _, value = (s.strip() for s in part.partition("="))
            if name not in _KEYS or value not in _DTYPE_ALIASES or _KEYS[name] in given:
                problem = "repeats a component" if _KEYS.get(name) in given else "is not key=dtype"
                raise PolyampError(
                    f"{part.strip()!r} in precision policy {spec!r} {problem}; expected at most "
                    "one key=dtype per component with keys p|params|param, c|compute, o|output "
                    f"and dtypes {'|'.join(_DTYPE_ALIASES)}, e.g. 'p=f32,c=bf16,o=f32'"
                )
            given[_KEYS[name]] = _DTYPE_ALIASES[value]
        param = given.get("param", _F32)
        compute = given.get("compute", param)
        return cls(param, compute, given.get("output", compute))
