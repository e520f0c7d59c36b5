"""What ``polyamp tune`` found: every trial with its outcome, the tuned configuration per policy, the final
side-by-side rounds, and the one-sentence reasons; JSON in and out, and a text table."""

from __future__ import annotations

import importlib
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compare.timing import bootstrap_ci
from ..errors import PolyampError
from .space import Candidate, Knob, _text

STATUSES = ("ok", "chosen", "no gain", "slower", "parity", "failed", "not tried", "reverted")


@dataclass
class Trial:
    """One configuration tried against ``baseline`` (the one it would replace; None for a policy's
    default, checked against the float32 reference). ``status``: ``ok`` (a policy default with parity),
    ``chosen``, ``no gain``, ``slower``, ``parity`` (loss beyond tolerance), ``failed``, ``not tried``,
    ``reverted`` (a tuned configuration the final rounds found slower than its default)."""

    candidate: Candidate
    baseline: Candidate | None
    status: str
    reason: str
    final_loss: float | None = None
    parity: float | None = None  # |loss - float32's| / |float32's| after the parity steps
    speedup: float | None = None  # paired, over the baseline
    ci95: tuple[float, float] | None = None
    rounds: int = 0
    step_s: float | None = None
    base_step_s: float | None = None
    times: list[float] = field(default_factory=list, repr=False)
    base_times: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"candidate": self.candidate.to_json(), "label": self.candidate.label,
                "baseline": None if self.baseline is None else self.baseline.label, "status": self.status,
                "reason": self.reason, "final_loss": self.final_loss, "parity": self.parity,
                "speedup": self.speedup, "ci95": None if self.ci95 is None else list(self.ci95),
                "rounds": self.rounds, "step_s": self.step_s, "base_step_s": self.base_step_s}  # fmt: skip


@dataclass
class Final:
    """One configuration in the final side-by-side rounds: its median step, its paired speed-up over the
    float32 default (None for that one, or when it failed: ``error``)."""

    key: str  # "bf16-mixed tuned"
    candidate: Candidate
    step_s: float | None
    speedup: float | None
    ci95: tuple[float, float] | None
    error: str | None
    times: list[float] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "candidate": self.candidate.to_json(), "label": self.candidate.label,
                "step_s": self.step_s, "speedup": self.speedup,
                "ci95": None if self.ci95 is None else list(self.ci95), "error": self.error}  # fmt: skip


@dataclass
class TuneReport:
    """``tune``'s result. ``best``: the fastest configuration of the final rounds (parity checked);
    ``policy`` / ``settings``: its policy and knob values, for ``MixedPrecision(report.policy)`` and the
    front end's ``apply``."""

    framework: str
    name: str
    policies: tuple[str, ...]
    knobs: Mapping[str, Knob]
    trials: list[Trial]
    tuned: dict[str, Candidate]
    final: list[Final]
    budget_s: float
    spent_s: float
    parity_steps: int
    rtol: float
    min_gain: float
    reference_loss: float

    @property
    def best(self) -> Candidate:
        """The fastest tuned configuration (per policy: ``tuned``) in the final rounds."""
        tuned = set(self.tuned.values())
        timed = [f for f in self.final if f.step_s is not None and f.error is None and f.candidate in tuned]
        if not timed:
            raise PolyampError(f"tune of {self.name} timed no configuration in its final rounds")
        return min(timed, key=lambda f: f.step_s).candidate

    @property
    def policy(self) -> str:
        return self.best.policy

    @property
    def settings(self) -> dict[str, Any]:
        return dict(self.best.settings)

    def speedup(self, policy: str, over: str = "float32") -> tuple[float, tuple[float, float]] | None:
        """The tuned ``policy`` step's paired speed-up over the tuned ``over`` step, from the final rounds
        (median of per-round ratios, 95 % bootstrap interval)."""
        a, b = self._final(over), self._final(policy)
        if a is None or b is None or not a.times or not b.times:
            return None
        ratios = [x / y for x, y in zip(a.times, b.times) if y > 0]
        return (statistics.median(ratios), bootstrap_ci(ratios)) if ratios else None

    def _final(self, policy: str) -> Final | None:
        """The final rounds' entry of ``policy``'s tuned configuration."""
        mine = self.tuned.get(policy)
        return next((f for f in self.final if f.error is None and f.candidate == mine), None)

    def apply(self, *args, **kwargs):
        """The best configuration applied in the framework's idiom (torch: ``report.apply(model,
        optimizer)`` -> ``(mp, model, optimizer)``; jax: ``report.apply(loss_fn, optimizer)`` -> ``(mp,
        loss, step)``; tensorflow: ``report.apply(make_model, optimizer)`` -> ``(mp, model, optimizer,
        jit_compile)``; mxnet: ``report.apply("file.py:make")`` -> ``(mp, net, step)``;
        ``polyamp.<framework>.tune.apply``)."""
        return importlib.import_module(f"polyamp.{self.framework}.tune").apply(self, *args, **kwargs)

    def reasons(self) -> list[str]:
        """One sentence per chosen setting in effect, with its measured gain; one per reverted policy."""
        out = []
        for t in self.trials:
            if t.status == "reverted":
                out.append(f"{t.candidate.policy}: {t.candidate.label} reverted: {t.reason}.")
            if t.status != "chosen":
                continue
            ((knob, value),) = [(k, v) for k, v in t.candidate.settings if dict(t.baseline.settings)[k] != v]
            if self.tuned[t.candidate.policy].get(knob) != value:  # replaced later, or reverted
                continue
            why = self.knobs[knob].why.format(value=_text(value)) if knob in self.knobs else f"{knob}={value}"
            lo, hi = t.ci95
            out.append(f"{t.candidate.policy}: {knob}={_text(value)}: {why}; measured {t.speedup:.2f}x "
                       f"(95 % interval {lo:.2f}-{hi:.2f}, {t.rounds} paired rounds).")  # fmt: skip
        return out

    def to_json(self) -> dict[str, Any]:
        best = self.best if any(f.step_s for f in self.final) else None
        headline = {p: self.speedup(p) for p in self.policies if p != "float32"}
        return {
            "framework": self.framework, "name": self.name, "policies": list(self.policies),
            "knobs": {k: {"values": list(v.values), "why": v.why} for k, v in self.knobs.items()},
            "best": None if best is None else best.to_json(),
            "tuned": {p: c.to_json() for p, c in self.tuned.items()},
            "speedup_over_tuned_float32": {p: None if v is None else {"speedup": v[0], "ci95": list(v[1])}
                                           for p, v in headline.items()},
            "final": [f.to_json() for f in self.final], "trials": [t.to_json() for t in self.trials],
            "reasons": self.reasons(), "budget_s": self.budget_s, "spent_s": self.spent_s,
            "parity_steps": self.parity_steps, "rtol": self.rtol, "min_gain": self.min_gain,
            "reference_loss": self.reference_loss,
        }  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def text(self) -> str:
        """The report as a few lines and two tables (final rounds, then every trial)."""
        lines = [f"polyamp tune: {self.name} in {self.framework}, {self.spent_s:.0f} s of a "
                 f"{self.budget_s:.0f} s budget; parity: loss after {self.parity_steps} steps within "
                 f"{self.rtol:.0%} of float32's {self.reference_loss:.6g}", ""]  # fmt: skip
        lines.append(f"{'configuration':60s} {'step ms':>9s} {'vs float32 default':>19s}")
        for f in self.final:
            ms = "-" if f.step_s is None else f"{f.step_s * 1e3:9.1f}"
            sp = "-" if f.speedup is None else f"{f.speedup:.2f}x"
            sp = "1.00x" if f.key == "float32 default" else sp
            lines.append(f"{f.key + ': ' + f.candidate.label:60.60s} {ms:>9s} {sp:>19s}"
                         + (f"  ({f.error})" if f.error else ""))  # fmt: skip
        for policy in self.policies:
            if policy != "float32" and (s := self.speedup(policy)) is not None:
                (lo, hi) = s[1]
                lines.append(f"tuned {policy} / tuned float32: {s[0]:.2f}x (95 % interval {lo:.2f}-{hi:.2f})")
        try:
            lines.append(f"best: {self.best.label}")
        except PolyampError as err:
            lines.append(f"best: none ({err})")
        lines += ["", "why:"] + [f"  {r}" for r in self.reasons() or ["no setting beat its default here"]]
        lines += ["", f"{'trial':60s} {'status':10s} reason"]
        for t in self.trials:
            lines.append(f"{t.candidate.label:60.60s} {t.status:10s} {t.reason}")
        return "\n".join(lines)
