"""What ``polyamp tune`` searches: a framework's knobs, and one configuration of them (a candidate).

A front end describes itself as a :class:`Tunable`: its knobs (name -> :class:`Knob`: the values to try,
the first one its default, and a sentence template for the report) and ``build(candidate)``, which
returns a fresh training step for one configuration, started from the same initial weights and stepping
through the same batches as every other candidate's. The search (``search.py``) never imports a
framework; it only calls ``build`` and the steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import PolyampError
from ..policy import Policy
from ..recipes import RECIPES

TUNE_POLICIES = ("float32", "bf16-mixed", "fp16-mixed")


@dataclass(frozen=True)
class Knob:
    """One setting that changes speed and not (beyond rounding) results: the values to try, the first
    the default; ``why`` says what a value does, with ``{value}`` in it (one sentence of the report)."""

    values: tuple[Any, ...]
    why: str
    policies: tuple[str, ...] | None = None  # the policies it can change (None: all)
    build_s: float = 0.0  # seconds a non-default value may add to a build, until one is measured (compile)

    @property
    def default(self) -> Any:
        return self.values[0]


@dataclass(frozen=True)
class Candidate:
    """One configuration: a policy and a value for every knob (``settings``, sorted by knob name)."""

    policy: str
    settings: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, policy: str, settings: Mapping[str, Any]) -> Candidate:
        return cls(policy, tuple(sorted(settings.items())))

    def get(self, knob: str) -> Any:
        return dict(self.settings)[knob]

    def with_(self, **changes: Any) -> Candidate:
        policy = changes.pop("policy", self.policy)
        return Candidate.of(policy, {**dict(self.settings), **changes})

    @property
    def label(self) -> str:
        """``bf16-mixed optimizer=fused threads=2``."""
        return " ".join([self.policy, *(f"{k}={_text(v)}" for k, v in self.settings)])

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "settings": dict(self.settings)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Candidate:
        """The candidate ``to_json`` gave."""
        if not isinstance(data, Mapping) or not isinstance(data.get("policy"), str) \
                or not isinstance(data.get("settings"), Mapping):  # fmt: skip
            raise PolyampError(f"a tune candidate is {{'policy': str, 'settings': dict}}; received {data!r}")
        return cls.of(data["policy"], data["settings"])


class Step(Protocol):
    """A built configuration: ``step(i)`` trains on batch ``i`` and returns the loss as a float (after
    the step's work has finished, so it can be timed); ``close()`` frees what it holds."""

    def step(self, i: int) -> float: ...

    def close(self) -> None: ...


class Tunable(Protocol):
    """What a front end gives the search (module docstring)."""

    framework: str
    name: str  # the model's name in the report (a workload, or FILE.py:make)
    knobs: Mapping[str, Knob]

    def build(self, candidate: Candidate) -> Step: ...


def defaults(knobs: Mapping[str, Knob]) -> dict[str, Any]:
    return {name: knob.default for name, knob in knobs.items()}


def check_policies(policies) -> tuple[str, ...]:
    """The policies to tune, float32 first (the parity reference and the baseline); PolyampError for a
    name ``Policy.parse`` does not know or that is not one of ``TUNE_POLICIES``."""
    names = [policies] if isinstance(policies, str) else list(policies)
    out = []
    for name in names:
        if not isinstance(name, str):
            accepted = ", ".join(TUNE_POLICIES)
            raise PolyampError(f"tune takes policy names; received {name!r}; accepted: {accepted}")
        canonical = name if name.split(":")[0] in RECIPES else Policy.parse(name).name
        if canonical not in TUNE_POLICIES:
            raise PolyampError(f"tune compares {', '.join(TUNE_POLICIES)} (recipes emulate formats, which "
                               f"cannot speed a step up); received {name!r}")  # fmt: skip
        out.append(canonical)
    return tuple(dict.fromkeys(["float32", *out]))


def _text(value: Any) -> str:
    return {True: "on", False: "off", None: "default"}.get(value, str(value)) if not isinstance(value, int) \
        or isinstance(value, bool) else str(value)  # fmt: skip

