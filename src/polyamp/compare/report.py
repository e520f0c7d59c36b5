"""The ``polyamp compare`` report: report.json, report.md and its plots, from the runner's records.

The rows (``rows.py``: every case against float32 of the same framework, workload and seed) are
built once; report.md opens with the verdict (``verdict.py``) and the speed-up figure, then the
settings, the training, inference and memory tables (``tables.py``), the notes, the roofline and
the other plots (``plots.py``, ``curves.py``). matplotlib and rich are imported only when a figure
is drawn or a table rendered, never when this module is imported.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import verdict as verdicts
from .rows import ROW_KEYS, UNPAIRED, Inference, MemoryUse, Row, display_order, summarize
from .tables import SMOKE_NOTE, caption, inference_table, memory_table, training_table
from .tables import terminal_table as _terminal_table

__all__ = ["ROW_KEYS", "PLOTS", "row_from_json", "summarize", "terminal_table", "write_report"]

# file name -> its title in report.md; the first follows the verdict
PLOTS = {
    "speedup.png": "Training speed-up over float32",
    "inference.png": "Inference latency per batch",
    "memory.png": "Memory that precision changes",
    "roofline.png": "Share of the matmul peak",
    "loss_curves.png": "Train loss",
    "loss_scale.png": "Loss scale",
}


def row_from_json(d: dict) -> Row:
    """A :class:`Row` from its report.json form."""
    fields = {k: v for k, v in d.items() if k in ROW_KEYS}
    fields["memory"] = MemoryUse(**(d.get("memory") or {}))
    fields["inference"] = Inference(**(d.get("inference") or {}))
    return Row(**fields)


def terminal_table(rows: list, color: bool = False, width: int | None = None, smoke: bool = False) -> str:
    """``tables.terminal_table`` of rows, as :class:`Row` or as report.json has them."""
    rows = [r if isinstance(r, Row) else row_from_json(r) for r in rows]
    return _terminal_table(rows, color=color, width=width, smoke=smoke)


def _figures(rows: list[Row], cases: list[dict], smoke: bool) -> dict:
    from . import curves, plots

    return {
        "speedup.png": lambda: plots.speedup_figure(rows, smoke),
        "inference.png": lambda: plots.inference_figure(rows, smoke),
        "memory.png": lambda: plots.memory_figure(rows),
        "roofline.png": lambda: plots.roofline_figure(rows),
        "loss_curves.png": lambda: curves.loss_figure(rows, cases),
        "loss_scale.png": lambda: curves.scale_figure(rows, cases),
    }


def _plot_all(rows: list[Row], cases: list[dict], out_dir: Path, smoke: bool) -> list[Path]:
    import matplotlib

    from .plots import RC

    paths = []
    with matplotlib.rc_context(RC):
        for name, draw in _figures(rows, cases, smoke).items():
            path = out_dir / name
            draw().savefig(path, dpi=120)
            paths.append(path)
    return paths


def _fmt_setting(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt_setting(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt_setting(v) for v in value) or "-"
    return "-" if value is None else str(value)


def _versions(rows: list[Row]) -> dict:
    """Every package version the cases recorded, each once."""
    out: dict = {}
    for r in rows:
        for package, version in r.versions.items():
            out.setdefault(package, version)
    return out


def _pairing_notes(rows: list[Row], cores: int | None) -> list[str]:
    """Which rows were not paired in one process, which rest on fewer than 5 rounds, and which were
    timed while the machine's load average exceeded its ``cores``."""
    from ..timing import LOCKSTEP

    out = []
    across = ("MXNet's AMP is process-wide, so each policy ran in its own process; the processes stepped "
              "in alternation, so the rounds still interleave in time, but what differs between two "
              "processes (memory placement, kernel choice) is not paired away")  # fmt: skip
    for kind, why in ((LOCKSTEP, across), (UNPAIRED, "no per-round pairing was recorded")):
        labels = [r.label for r in rows if r.pairing == kind]
        if labels:
            out.append(f"- **{kind}**: {', '.join(labels)}: {why}")
    for r in rows:
        pairing, rounds = r.pairing or "", r.speedup_rounds
        if pairing.startswith("unpaired") and pairing != UNPAIRED:
            out.append(f"- **{pairing}**: {r.label}: it spent its budget on its warm-up step, which is its "
                       "only time (over float32's median)")  # fmt: skip
        elif rounds is not None and 0 < rounds < 5:
            out.append(f"- **few rounds**: {r.label}: its speed-up rests on {rounds} round(s)")
    busy = [r for r in rows if cores and max(r.loadavg_1min or [0]) > cores]
    if busy:
        peak = max(max(r.loadavg_1min) for r in busy)
        out.append(f"- **busy machine**: {', '.join(r.label for r in busy)}: timed while the 1-minute load "
                   f"average (up to {peak:.1f}) exceeded the {cores} cores: other programs competed for "
                   "them")  # fmt: skip
    return out


def _notes(rows: list[Row], settings: dict, smoke: bool) -> list[str]:
    ordered = display_order(rows)
    out = ["## Notes", "", "- " + caption(rows)]
    for r in ordered:
        if r.capped:
            out.append(f"- **capped**: {r.label} ran {r.steps} of {r.steps_requested} steps: "
                       f"{r.cap_reason or 'no reason recorded'}")  # fmt: skip
    if not smoke:
        out += [f"- **slower than float32**: {r.label} at {r.speedup:.2g}x of float32's speed"
                for r in ordered if r.slower]  # fmt: skip
    for r in ordered:
        if r.parity == "worse":
            if r.parity_diff is None:
                what = "non-finite value"
            elif r.eval_higher_is_better and r.parity_basis == r.eval_metric:
                what = f"{r.parity_diff:.3g} below float32, tolerance {r.tolerance:g}"
            else:
                what = f"{r.parity_diff:+.1%} relative to float32, tolerance {r.tolerance:.0%}"
            out.append(f"- **outside tolerance**: {r.label} on {r.parity_basis}: {what}")
    for r in ordered:
        if not r.ok:
            out += [f"- **{r.status}**: {r.label}:", "", "  ```text"]
            out += ["  " + line for line in str(r.error or "no error text recorded").splitlines() or [""]]
            out += ["  ```", ""]
    out += _pairing_notes(ordered, ((settings or {}).get("machine") or {}).get("cores"))
    out += [f"- {r.label}: {note}" for r in ordered for note in r.notes]
    return out + [""]


def _markdown(rows: list[Row], settings: dict, verdict: verdicts.Verdict, plots: list[Path],
              smoke: bool) -> str:  # fmt: skip
    from .roofline import markdown as roofline_section

    out = ["# polyamp compare report" + (" (smoke check)" if smoke else ""), ""]
    if smoke:
        out += [f"> **{SMOKE_NOTE}**", ""]
    out += verdicts.markdown(verdict)
    names = [p.name for p in plots]
    if names:
        out += [f"![{PLOTS.get(names[0], names[0])}]({names[0]})", ""]
    out += ["## Settings", ""] + [f"- **{k}**: {_fmt_setting(v)}" for k, v in (settings or {}).items()]
    versions = _versions(rows)
    if versions:
        listed = ", ".join(f"{k} {v}" for k, v in versions.items())
        out.append(f"- **framework versions (from the cases)**: {listed}")
    out += ["", "## Training", "", "Each row is compared with float32 of the same framework, workload and "
            "seed.", ""]  # fmt: skip
    out += training_table(rows, smoke) + [""]
    inference = inference_table(rows)
    if inference:
        out += ["## Inference", "", "Forward-only latency per batch in each policy's inference form (how), "
                "timed in interleaved rounds like training; the metric through that path after the same "
                "training.", ""] + inference  # fmt: skip
    memory = memory_table(rows)
    if memory:
        out += ["## Memory", "", "Bytes by kind as each framework exposes them, and mixed / float32 ratios.",
                ""] + memory  # fmt: skip
    out += _notes(rows, settings, smoke)
    out += roofline_section(display_order(rows))
    out += ["## Plots", ""]
    for name in names[1:]:
        title = PLOTS.get(name, name)
        out += [f"### {title}", "", f"![{title}]({name})", ""]
    return "\n".join(out).rstrip() + "\n"


def _jsonable(obj: Any) -> Any:
    """Plain JSON: non-finite floats become null, numpy scalars/arrays become Python values."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):
        return _jsonable(obj.tolist())
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def write_report(cases: list[dict], settings: dict, out_dir: str | Path,
                 tolerances: dict[str, float] | None = None) -> dict:  # fmt: skip
    """Write report.json, report.md and the PLOTS into ``out_dir``.

    report.json holds ``settings``, the ``verdict``, the raw ``cases`` (step times included, so
    speed-ups can be recomputed), the ``rows`` and what the ``timings`` are: a "smoke check" when
    ``settings["quick"]`` (then every output says so), else a "measurement"; non-finite numbers are
    written as null. ``tolerances`` overrides workloads' parity tolerances by name.
    Returns ``{"json": path, "markdown": path, "plots": [paths]}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(cases, tolerances)
    smoke = bool((settings or {}).get("quick"))
    verdict = verdicts.build(rows, smoke)
    plots = _plot_all(rows, cases, out, smoke)
    doc = {
        "settings": settings,
        "verdict": verdict.to_json(),
        "rows": [asdict(r) for r in rows],
        "cases": cases,
        "timings": {"kind": "smoke check", "note": SMOKE_NOTE} if smoke else {
            "kind": "measurement",
            "note": "paired: after one warm-up step each, the policies of a (framework, workload) step in "
            "interleaved rounds; a speed-up is the median of per-round ratios over float32, with a "
            "bootstrap 95% interval and its number of rounds",
        },
    }  # fmt: skip
    json_path = out / "report.json"
    json_path.write_text(json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(_markdown(rows, settings, verdict, plots, smoke), encoding="utf-8")
    return {"json": str(json_path), "markdown": str(md_path), "plots": [str(p) for p in plots]}
