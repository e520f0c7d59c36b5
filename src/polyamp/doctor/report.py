"""A doctor run's result: the observations, the per-format predictions and the recommendation.

``Report`` is what ``polyamp.doctor(...)`` returns. Its recommendation applies in one line::

    mp = polyamp.MixedPrecision(report.policy, loss_scale=report.loss_scale, keep_fp32=report.keep_fp32)

``report.loss_scale`` is a ``DynamicLossScale`` starting at the recommended scale (fp16-mixed) or None.
Predictions per (layer, tensor kind, format): forward tensors at scale 1; gradients at scale 1 and, for a
format that takes a loss scale, at the recommended one and the usual starts 2^16 and 2^24; updates: the
share lost in weights stored in each format (``predict.lost_updates``). A gradient's flush is predicted
for a backward pass run in the format, with the rounding noise of the layers after it (``chain.py``).
Block formats and recipes (``Report.measured``) are measured, not predicted (``blocks.py``): per row,
``Row.measured[label]``; the recommendation does not use them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..numerics import get_format
from ..scaling import DynamicLossScale
from .chain import backward_noise, gradient_predictions
from .predict import SCALED_FORMATS, lost_updates, predict
from .recommend import GRAD_KINDS, KINDS, Finding, Observation, Recommendation, layer_table
from .text import pct, pow2, pow2_expr

# gradients of loss-scaled formats are also predicted at these scales (torch starts at 2^16, cap 2^24)
SWEEP = tuple(2.0**k for k in range(0, 25, 4))
@dataclass(frozen=True)
class Row:
    """Predictions for one tapped tensor (layer, kind) in each format."""

    layer: str
    kind: str
    total: int
    amax: float
    amin_nonzero: float | None
    zeros: int
    nonfinite: int
    formats: dict[str, dict] = field(default_factory=dict)  # format -> prediction(s)
    measured: dict[str, dict] = field(default_factory=dict)  # block format / recipe label -> Measured json

    def severity(self, fmt: str) -> float:
        """Fraction of elements the format damages: overflow + flush (or lost updates)."""
        p = self.formats.get(fmt, {})
        if self.kind == "update_ratio":
            return p.get("lost", 0.0)
        at = p.get("at_recommended_scale") or p
        return at.get("overflow", 0.0) + at.get("flush", 0.0)


@dataclass(frozen=True)
class Report:
    """What ``polyamp.doctor`` found (module docstring)."""

    framework: str
    formats: tuple[str, ...]
    steps: int
    observations: tuple[Observation, ...]
    recommendation: Recommendation
    rows: tuple[Row, ...]
    seconds: float = 0.0
    model: str = ""
    measured: tuple[str, ...] = ()  # labels of the measured block formats and recipes (blocks.py)
    device: str | None = None  # where the model trains, for the fp16 speed rule (recommend.fp16_slow)

    # -- the recommendation, ready to apply --------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.recommendation.policy

    @property
    def initial_scale(self) -> float | None:
        """The recommended initial loss scale (fp16-mixed), else None."""
        return self.recommendation.loss_scale if self.policy == "fp16-mixed" else None

    @property
    def loss_scale(self) -> DynamicLossScale | None:
        """Dynamic loss scaling from the recommended initial scale (fp16-mixed), else None."""
        s = self.initial_scale
        return None if s is None else DynamicLossScale(init_scale=s)

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        return self.recommendation.keep_fp32

    @property
    def master_weights(self) -> bool:
        return self.recommendation.master_weights

    @property
    def nonfinite(self) -> Finding | None:
        """The first non-finite tensor of the float32 run (the model is broken before any cast)."""
        return self.recommendation.nonfinite

    @property
    def layers(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(ob.layer for ob in self.observations))

    def mixed_precision(self, framework: str | None = None):
        """``polyamp.MixedPrecision`` set up as recommended."""
        from ..mixed_precision import MixedPrecision

        return MixedPrecision(self.policy, loss_scale=self.loss_scale, keep_fp32=self.keep_fp32,
                              framework=framework or self.framework)  # fmt: skip

    # -- reading it --------------------------------------------------------------------------------
    def worst(self, n: int = 10) -> list[Row]:
        """The ``n`` rows the candidate formats damage most: the recommendation's findings first,
        then by the largest damaged fraction in fp16 or bf16 (fp8 damages nearly everything)."""
        findings = self.recommendation.findings
        flagged = {(f.layer, k) for f in findings for k in (GRAD_KINDS if f.kind == "gradient" else [f.kind])}

        def key(row: Row):
            sixteen = max((row.severity(f) for f in ("fp16", "bf16") if f in row.formats), default=0.0)
            anything = max(map(row.severity, row.formats), default=0.0)
            return (row.layer, row.kind) not in flagged, -sixteen, -anything

        return sorted(self.rows, key=key)[:n]

    def scale_sweep(self, fmt: str = "fp16") -> list[dict]:
        """Every observed gradient together (each with its backward noise), predicted in ``fmt`` at each
        loss scale of SWEEP and the recommended one: [{"scale", "overflow", "flush", "subnormal"}]."""
        if not any(ob.kind in GRAD_KINDS and ob.hist.total for ob in self.observations):
            return []
        table, fmt = layer_table(self.observations), get_format(fmt)
        scales = sorted({*SWEEP, *([self.initial_scale] if self.initial_scale else [])})
        out = []
        for s in scales:
            preds = gradient_predictions(table, fmt, s).values()
            total = sum(p.total for p in preds)
            out.append({"scale": s, **{k: sum(getattr(p, k) * p.total for p in preds) / total
                                       for k in ("overflow", "flush", "subnormal")}})  # fmt: skip
        return out

    def summary(self) -> str:
        """The recommendation in a few lines, each with its reason."""
        r = self.recommendation
        lines = [f"policy: {r.policy} — {r.reason}"]
        if self.nonfinite is not None:
            return "\n".join(lines)
        if r.policy == "fp16-mixed":
            lines.append(f"initial loss scale: {pow2(r.loss_scale)} — {r.loss_scale_reason}")
        for layer, why in r.keep_fp32_reasons.items():
            lines.append(f"keep in fp32: {layer} — {why}")
        for check in r.checks.values():
            if check.policy != r.policy and check.feasible:
                pick = (f"not chosen on {self.device}, the policy line says why; training elsewhere: "
                        "pass device= (--device)") if check.policy == "fp16-mixed" and r.fp16_slow else \
                    "pick the one the hardware runs faster, docs/BENCHMARKS.md"  # fmt: skip
                kept = len(check.keep_fp32)
                lines.append(f"also fits: {check.policy} ({kept} layers kept in fp32; {pick})")
        for check in r.checks.values():
            need = "needed" if check.master_weights else "not needed"
            why = check.master_weights_reason
            plain = " (rounded to nearest; SR / Kahan below)" if check.weight_update not in (None, "master") \
                and check.master_weights else ""  # fmt: skip
            lines.append(f"fp32 master weights for {check.format} weights: {need}{plain} — {why}")
        lines.append(f"apply: {self.one_liner()}")
        bf16 = r.checks.get("bf16-mixed")
        if bf16 is not None and bf16.weight_update is not None:
            low = r.low_precision
            lines.append(f"bf16 weights: {bf16.weight_update_reason}")
            if bf16.states:
                lines.append(f"moments: {bf16.states_reason}")
            lines.append(f"for memory: mp = polyamp.MixedPrecision({low!r}); opt = mp.optimizer(opt)"
                         if low else "for memory: none (the weights need float32 masters)")
        return "\n".join(lines)

    def one_liner(self) -> str:
        """The Python line that applies the recommendation."""
        args = [repr(self.policy)]
        if self.initial_scale is not None:
            args.append(f"loss_scale=polyamp.DynamicLossScale(init_scale={pow2_expr(self.initial_scale)})")
        if self.keep_fp32:
            args.append(f"keep_fp32={self.keep_fp32!r}")
        return f"mp = polyamp.MixedPrecision({', '.join(args)})"

    def table(self, n: int = 12) -> str:
        """A fixed-width table of the worst rows: per format overflow % / flush % (lost % for updates);
        gradients of scaled formats at the recommended loss scale; per measured label underflow % /
        clipped %."""
        head = ["layer", "tensor", "max |x|", *[f"{f} ovf/flush" for f in self.formats],
                *[f"{m} measured unf/clip" for m in self.measured]]  # fmt: skip
        body = []
        for row in self.worst(n):
            cells = [row.layer, row.kind, f"{row.amax:.3g}"]
            for f in self.formats:
                p = row.formats.get(f, {})
                if row.kind == "update_ratio":
                    cells.append(f"lost {pct(p.get('lost'))}")
                else:
                    at = p.get("at_recommended_scale") or p
                    cells.append(f"{pct(at.get('overflow'))} / {pct(at.get('flush'))}")
            for m in self.measured:
                p = row.measured.get(m)
                cells.append(f"{pct(p['underflow'])} / {pct(p['clipped'])}" if p else "-")
            body.append(cells)
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] +
                         [fmt.format(*cells) for cells in body])  # fmt: skip

    def to_json(self) -> dict:
        return _jsonable({
            "framework": self.framework,
            "device": self.device,
            "model": self.model,
            "formats": list(self.formats),
            "measured_formats": list(self.measured),
            "steps": self.steps,
            "seconds": self.seconds,
            "apply": self.one_liner(),
            "gradients_vs_loss_scale": {f: self.scale_sweep(f) for f in self.formats if f in SCALED_FORMATS},
            "recommendation": self.recommendation.to_json(),
            "rows": [vars(r) for r in self.rows],
            "histograms": [
                {"layer": ob.layer, "kind": ob.kind, **ob.hist.to_json()} for ob in self.observations
            ],
        })

    def write(self, folder: str | Path = "doctor-report", *, plot: bool = True) -> dict[str, Path]:
        """Write report.json, report.md and (with ``plot`` and matplotlib) heatmap.png into ``folder``."""
        from .markdown import markdown

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "report.json", "md": out / "report.md"}
        paths["json"].write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n")
        image = None
        if plot:
            from .heatmap import heatmap

            image = heatmap(self, out / "heatmap.png")
            if image is not None:
                paths["png"] = image
        paths["md"].write_text(markdown(self, image.name if image else None))
        return paths

    def __str__(self) -> str:
        return f"{self.summary()}\n\n{self.table()}"


def build(observations, formats, *, framework: str, steps: int, seconds: float = 0.0, model: str = "",
          device: str | None = None) -> Report:  # fmt: skip
    """Predict every observation in every format and recommend (``recommend.recommend``, told whether
    fp16 is slow for ``framework`` on ``device``: ``recommend.fp16_slow``)."""
    from .recommend import fp16_slow, recommend

    observations = tuple(observations)
    rec = recommend(observations, slow_fp16=fp16_slow(framework, device))
    from .blocks import parse

    fmts = tuple(get_format(f).name for f in formats if parse(f) is None)
    measured = tuple(t.label for t in map(parse, formats) if t is not None)
    scale = rec.checks["fp16-mixed"].loss_scale if "fp16-mixed" in rec.checks else None
    table, cache = layer_table(observations), {}

    def noise(ob: Observation, fmt: str, s: float) -> float:
        """The backward noise of a gradient (``chain.py``); 0 for forward tensors."""
        if ob.kind not in GRAD_KINDS:
            return 0.0
        if (fmt, s) not in cache:
            cache[fmt, s] = backward_noise(table, get_format(fmt), s)
        return cache[fmt, s][ob.layer, ob.kind]

    rows = tuple(_row(ob, fmts, scale, noise) for ob in observations)
    return Report(framework, fmts, steps, observations, rec, rows, seconds, model, measured, device)


def _row(ob: Observation, formats: tuple[str, ...], scale: float | None, noise) -> Row:
    h = ob.hist
    preds: dict[str, dict] = {}
    for name in formats:
        if not h.total:
            continue
        if ob.kind == "update_ratio":
            preds[name] = lost_updates(h, name).to_json()
            continue
        p = predict(h, name, noise=noise(ob, name, 1.0)).to_json()
        if ob.kind in GRAD_KINDS:
            p["backward_noise"] = noise(ob, name, 1.0)  # R at scale 1 (chain.py)
        if ob.kind in GRAD_KINDS and name in SCALED_FORMATS:
            scales = sorted({*SWEEP, *([scale] if scale else [])})
            p["at_scale"] = {pow2(s): predict(h, name, s, noise(ob, name, s)).to_json() for s in scales}
            if scale:
                p["at_recommended_scale"] = p["at_scale"][pow2(scale)]
        preds[name] = p
    measured = {label: m.to_json() for label, m in ob.measured.items()}
    return Row(ob.layer, ob.kind, h.total, h.amax, h.amin_nonzero, h.zeros, h.nonfinite, preds, measured)


def _jsonable(x):
    """Plain JSON values: numpy scalars and arrays as Python numbers and lists, non-finite floats None."""
    if isinstance(x, np.ndarray):
        x = x.tolist()
    elif isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


__all__ = ["KINDS", "Report", "Row", "build"]
