"""report.md of a doctor run: the recommendation with its reasons, the heat map, the worst tensors, and
per layer what each format does (gradients of a loss-scaled format at the recommended scale)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .predict import SCALED_FORMATS
from .text import pct, pow2

if TYPE_CHECKING:
    from .report import Report


def markdown(report: Report, image: str | None) -> str:
    r = report.recommendation
    out = [f"# polyamp doctor — {report.framework}, `{report.model}`", ""]
    out += [f"{report.steps} float32 step{'s' * (report.steps > 1)} observed in {report.seconds:.2f} s; "
            f"{len(report.layers)} layers; formats: {', '.join(report.formats)}"
            f"{'; measured: ' + ', '.join(report.measured) if report.measured else ''}.", ""]  # fmt: skip
    out += ["## Recommendation", "", *[f"- {line}" for line in report.summary().splitlines()[:-1]], "",
            "```python", report.one_liner(), "```", ""]  # fmt: skip
    if r.nonfinite is not None:
        out += [f"**The model is non-finite in float32**: {r.nonfinite.line}. Fix that first.", ""]
    if r.findings:
        out += ["## Findings", "", "| layer | tensor | format | problem | share | why |",
                "|---|---|---|---|---:|---|"]  # fmt: skip
        out += [f"| {f.layer} | {f.kind} | {f.format} | {f.problem} | {pct(f.fraction)} | {f.line} |"
                for f in r.findings]  # fmt: skip
        out.append("")
    if image:
        out += ["## Heat map", "", f"![layers x log2 magnitude, with each format's ranges]({image})", "",
                "Rows: layers; columns: octaves of |x|; colour: share of the layer's elements. Strips "
                "above each panel: where a cast lands (grey flushed to zero, yellow subnormal, green "
                "normal, red overflow); gradient strips of loss-scaled formats are at the recommended "
                "scale.", ""]  # fmt: skip
    scale = report.initial_scale
    out += ["## Worst tensors", "", "```", report.table(), "```", ""]
    for fmt in [f for f in report.formats if f in SCALED_FORMATS]:
        sweep = report.scale_sweep(fmt)
        if sweep:
            out += [f"## All gradients in {fmt} against the loss scale", "",
                    "| loss scale | overflow | flush to 0 | subnormal |", "|---|---:|---:|---:|"]  # fmt: skip
            mark = " (recommended)" if fmt == "fp16" else " (fp16's recommended)"
            out += [f"| {pow2(s['scale'])}{mark * (s['scale'] == scale)} "
                    f"| {pct(s['overflow'])} | {pct(s['flush'])} | {pct(s['subnormal'])} |"
                    for s in sweep]  # fmt: skip
            out.append("")
    for fmt in report.formats:
        out += _format_table(report, fmt, scale)
    for label in report.measured:
        out += _measured_table(report, label)
    return "\n".join(out)


def _measured_table(report: Report, label: str) -> list[str]:
    out = [f"## {label} (measured: each tensor cast and counted, not predicted)", "",
           "| layer | tensor | max abs | underflow | clipped | in inf/NaN blocks | rel. MSE | SQNR dB |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in report.rows:
        m = row.measured.get(label)
        if m is None:
            continue
        mse = "-" if m["rel_mse"] is None else f"{m['rel_mse']:.2g}"
        db = "-" if m["sqnr_db"] is None else f"{m['sqnr_db']:.1f}"
        out.append(f"| {row.layer} | {row.kind} | {row.amax:.3g} | {pct(m['underflow'])} "
                   f"| {pct(m['clipped'])} | {pct(m['spoiled'])} | {mse} | {db} |")  # fmt: skip
    return [*out, ""]


def _format_table(report: Report, fmt: str, scale: float | None) -> list[str]:
    at = f" (gradients at loss scale {pow2(scale)})" if scale and fmt in ("fp16", "e5m2") else ""
    out = [f"## {fmt}{at}", "", "| layer | tensor | max abs | overflow | flush to 0 | subnormal "
           "| rel. RMS error | lost updates |", "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in report.rows:
        p = row.formats.get(fmt)
        if p is None:
            continue
        if row.kind == "update_ratio":
            out.append(f"| {row.layer} | update | | | | | | {pct(p['lost'])} |")
            continue
        q = p.get("at_recommended_scale") or p
        err = q["rel_rms_error"]
        out.append(f"| {row.layer} | {row.kind} | {row.amax:.3g} | {pct(q['overflow'])} "
                   f"| {pct(q['flush'])} | {pct(q['subnormal'])} | {err:.2g} | |")  # fmt: skip
    return [*out, ""]
