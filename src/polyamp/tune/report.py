"""What ``polyamp tune`` found: every trial with its outcome, the tuned configuration per policy, the final
side-by-side rounds, and the one-sentence reasons; JSON in and out (``save`` / ``load``: a saved report,
``polyamp tune --json``'s file, applies in a training script as the one it was saved from), and a text
table. A figure from one paired round has no interval (``None``; the text says ``n/a (1 round)``)."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PolyampError
from ..frameworks import front_end_module
from ..timing import bootstrap_ci
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
                "baseline": None if self.baseline is None else self.baseline.label,
                "baseline_candidate": None if self.baseline is None else self.baseline.to_json(),
                "status": self.status, "reason": self.reason, "final_loss": self.final_loss,
                "parity": self.parity, "speedup": self.speedup,
                "ci95": None if self.ci95 is None else list(self.ci95), "rounds": self.rounds,
                "step_s": self.step_s, "base_step_s": self.base_step_s, "times": self.times,
                "base_times": self.base_times}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any], knobs: Mapping[str, Knob] | None = None) -> Trial:
        """The trial ``to_json`` gave; ``knobs`` read the baseline from its label, for reports saved
        before the baseline's candidate was."""
        base = data.get("baseline_candidate")
        if base is not None:
            base = Candidate.from_json(base)
        elif data.get("baseline") is not None and knobs is not None:
            base = _from_label(data["baseline"], knobs)
        return cls(Candidate.from_json(data["candidate"]), base, data["status"], data["reason"],
                   data.get("final_loss"), data.get("parity"), data.get("speedup"), _pair(data.get("ci95")),
                   data.get("rounds", 0), data.get("step_s"), data.get("base_step_s"),
                   list(data.get("times", [])), list(data.get("base_times", [])))  # fmt: skip


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
    rounds: int = 0  # paired with the float32 default

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "candidate": self.candidate.to_json(), "label": self.candidate.label,
                "step_s": self.step_s, "speedup": self.speedup,
                "ci95": None if self.ci95 is None else list(self.ci95), "rounds": self.rounds,
                "error": self.error, "times": self.times}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Final:
        return cls(data["key"], Candidate.from_json(data["candidate"]), data.get("step_s"),
                   data.get("speedup"), _pair(data.get("ci95")), data.get("error"),
                   list(data.get("times", [])), data.get("rounds", 0))  # fmt: skip


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
    notes: list[str] = field(default_factory=list)  # what the budget did not allow, and what would

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

    def speedup(self, policy: str, over: str = "float32") -> tuple[float, tuple[float, float] | None] | None:
        """The tuned ``policy`` step's paired speed-up over the tuned ``over`` step, from the final rounds
        (median of per-round ratios, 95 % bootstrap interval; None from one round)."""
        ratios = self._ratios(policy, over)
        if not ratios:
            return None
        return statistics.median(ratios), bootstrap_ci(ratios) if len(ratios) >= 2 else None

    def _ratios(self, policy: str, over: str) -> list[float]:
        a, b = self._final(over), self._final(policy)
        if a is None or b is None:
            return []
        return [x / y for x, y in zip(a.times, b.times) if y > 0]

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
        return front_end_module(self.framework, "tune").apply(self, *args, **kwargs)

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
            "knobs": {k: {"values": list(v.values), "why": v.why, "build_s": v.build_s,
                          "policies": None if v.policies is None else list(v.policies)}
                      for k, v in self.knobs.items()},
            "best": None if best is None else best.to_json(),
            "tuned": {p: c.to_json() for p, c in self.tuned.items()},
            "speedup_over_tuned_float32": {p: None if v is None else {
                "speedup": v[0], "ci95": None if v[1] is None else list(v[1]),
                "rounds": len(self._ratios(p, "float32"))} for p, v in headline.items()},
            "final": [f.to_json() for f in self.final], "trials": [t.to_json() for t in self.trials],
            "reasons": self.reasons(), "budget_s": self.budget_s, "spent_s": self.spent_s,
            "parity_steps": self.parity_steps, "rtol": self.rtol, "min_gain": self.min_gain,
            "reference_loss": self.reference_loss, "notes": self.notes,
        }  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TuneReport:
        """The report ``to_json`` gave (a saved file's contents, or one item of ``polyamp tune --json``)."""
        missing = [k for k in _REQUIRED if not isinstance(data, Mapping) or k not in data]
        if missing:
            got = f"keys {sorted(data)}" if isinstance(data, Mapping) else type(data).__name__
            raise PolyampError(f"not a polyamp tune report: missing {', '.join(missing)} (received {got}); "
                               "expected what TuneReport.save or polyamp tune --json wrote")  # fmt: skip
        knobs = {k: Knob(tuple(v["values"]), v["why"], None if v.get("policies") is None
                         else tuple(v["policies"]), v.get("build_s", 0.0))
                 for k, v in data["knobs"].items()}  # fmt: skip
        return cls(framework=data["framework"], name=data["name"], policies=tuple(data["policies"]),
                   knobs=knobs, trials=[Trial.from_json(t, knobs) for t in data["trials"]],
                   tuned={p: Candidate.from_json(c) for p, c in data["tuned"].items()},
                   final=[Final.from_json(f) for f in data["final"]], budget_s=data["budget_s"],
                   spent_s=data["spent_s"], parity_steps=data["parity_steps"], rtol=data["rtol"],
                   min_gain=data["min_gain"], reference_loss=data["reference_loss"],
                   notes=list(data.get("notes", [])))  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> TuneReport:
        """A report ``save`` wrote (``polyamp tune``'s file in ``--out``): ``TuneReport.load(path)
        .apply(...)`` sets up what the saved report's ``apply`` would. ``polyamp tune --json`` prints a
        list: one report loads from it as is; of several, pass one item to ``from_json``."""
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise PolyampError(f"cannot read the tune report {str(path)!r}: {err.strerror}") from None
        except json.JSONDecodeError as err:
            raise PolyampError(f"{str(path)!r} is not JSON ({err.msg}, line {err.lineno}); expected a tune "
                               "report TuneReport.save wrote") from None  # fmt: skip
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        return cls.from_json(data)

    def text(self) -> str:
        """The report as a few lines and two tables (final rounds, then every trial)."""
        lines = [f"polyamp tune: {self.name} in {self.framework}, {seconds(self.spent_s)} s of a "
                 f"{seconds(self.budget_s)} s budget; parity: loss after {self.parity_steps} steps within "
                 f"{self.rtol:.0%} of float32's {self.reference_loss:.6g}", ""]  # fmt: skip
        lines.append(f"{'configuration':60s} {'step ms':>9s} {'vs float32 default':>19s}")
        for f in self.final:
            ms = "-" if f.step_s is None else f"{f.step_s * 1e3:9.1f}"
            sp = "-" if f.speedup is None else f"{f.speedup:.2f}x" + (" (1 round)" if f.rounds == 1 else "")
            sp = "1.00x" if f.key == "float32 default" else sp
            lines.append(f"{f.key + ': ' + f.candidate.label:60.60s} {ms:>9s} {sp:>19s}"
                         + (f"  ({f.error})" if f.error else ""))  # fmt: skip
        for policy in self.policies:
            if policy != "float32" and (s := self.speedup(policy)) is not None:
                lines.append(f"tuned {policy} / tuned float32: {s[0]:.2f}x (95 % interval "
                             f"{_interval_text(s[1], len(self._ratios(policy, 'float32')))})")  # fmt: skip
        try:
            lines.append(f"best: {self.best.label}")
        except PolyampError as err:
            lines.append(f"best: none ({err})")
        lines += ["", "why:"] + [f"  {r}" for r in self.reasons() or ["no setting beat its default here"]]
        lines += ["", "budget:", *[f"  {n}" for n in self.notes]] if self.notes else []
        lines += ["", f"{'trial':60s} {'status':10s} reason"]
        for t in self.trials:
            lines.append(f"{t.candidate.label:60.60s} {t.status:10s} {t.reason}")
        return "\n".join(lines)


def seconds(x: float, up: bool = False) -> str:
    """Seconds to two significant figures below 10 and whole above (``up``: rounded up, a budget)."""
    if x >= 10:
        return str(math.ceil(x)) if up else f"{x:.0f}"
    if up:
        return f"{math.ceil(x * 10) / 10:.1f}" if x >= 1 else f"{math.ceil(x * 100) / 100:.2f}"
    return f"{x:.2g}"


_REQUIRED = ("framework", "name", "policies", "knobs", "trials", "tuned", "final", "budget_s", "spent_s",
             "parity_steps", "rtol", "min_gain", "reference_loss")


def _from_label(label: str, knobs: Mapping[str, Knob]) -> Candidate:
    """The candidate a ``Candidate.label`` names (``bf16-mixed optimizer=as given threads=2``): each
    ``knob=text`` read back as the knob value whose text it is."""
    policy, _, rest = label.partition(" ")
    names = "|".join(re.escape(k) for k in knobs)
    settings = {}
    for m in re.finditer(rf"(?:^| )({names})=(.*?)(?= (?:{names})=|$)", rest):
        values = {_text(v): v for v in knobs[m[1]].values}
        if m[2] not in values:
            raise PolyampError(f"tune report: {m[1]}={m[2]!r} in {label!r} is not a value of the knob "
                               f"{m[1]} ({', '.join(values)})")  # fmt: skip
        settings[m[1]] = values[m[2]]
    return Candidate.of(policy, settings)


def _pair(value) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))


def _interval_text(ci: tuple[float, float] | None, rounds: int) -> str:
    if ci is None:
        return "n/a (1 round)" if rounds <= 1 else "n/a"
    return f"{ci[0]:.2f}-{ci[1]:.2f}"
