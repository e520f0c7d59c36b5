"""The ``polyamp compare`` report: every case against float32 of the same framework, workload and seed.

``summarize`` turns the runner's case records into rows with the comparisons; ``terminal_table`` renders
them for a terminal; ``write_report`` writes report.json, report.md and three PNG plots. matplotlib and
rich are imported only inside the functions that draw or render, never when this module is imported.
"""

from __future__ import annotations

import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

BASELINE_POLICY = "float32"
LOSS_TOLERANCE = 0.05
ACCURACY_TOLERANCE = 0.02
_EPS = 1e-9  # so that a difference exactly at the tolerance counts as within it despite float rounding

ROW_KEYS = (
    "framework",
    "framework_version",
    "versions",
    "workload",
    "policy",
    "seed",
    "status",
    "error",
    "steps",
    "steps_requested",
    "capped",
    "cap_reason",
    "warmup_steps",
    "timed_steps",
    "median_step_s",
    "peak_rss_mb",
    "wall_s",
    "final_loss",
    "eval_metric",
    "eval_value",
    "eval_higher_is_better",
    "skipped_steps",
    "final_scale",
    "uses_loss_scaling",
    "is_baseline",
    "baseline",
    "speedup",
    "speedup_ci95",
    "speedup_rounds",
    "pairing",
    "roofline_share",
    "roofline_peaks",
    "loadavg_1min",
    "loss_delta",
    "loss_compared_at_step",
    "eval_delta",
    "parity",
    "parity_basis",
    "parity_diff",
    "loss_tolerance",
    "accuracy_tolerance",
    "notes",
)

_WORKLOAD_ORDER = ("mlp", "charlm", "digits")


# --------------------------------------------------------------------------------------------- summary


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _median_step(case: dict) -> float | None:
    """The case's median step time: its ``median_step_s``, else the median of its ``step_times``."""
    m = case.get("median_step_s")
    if _finite(m):
        return float(m)
    times = [t for t in case.get("step_times") or [] if _finite(t)]
    return statistics.median(times) if times else None


def _key(case: dict) -> tuple:
    return (case.get("framework"), case.get("workload"))


def _same_seed(a: dict, b: dict) -> bool:
    """Equal seeds, or a seed not recorded on one side (the runner's error records carry none)."""
    return a.get("seed") is None or b.get("seed") is None or a.get("seed") == b.get("seed")


def _label(case: dict) -> str:
    return f"{case.get('framework')} {case.get('workload')} {case.get('policy')}"


def _eval_parts(case: dict) -> tuple[str | None, float | None, bool | None]:
    ev = case.get("eval")
    if not isinstance(ev, dict) or ev.get("value") is None:
        return None, None, None
    return ev.get("metric"), ev.get("value"), bool(ev.get("higher_is_better", False))


def _verdict(
    case_value: float, base_value: float, higher_is_better: bool, loss_tol: float, acc_tol: float
) -> tuple[str, float | None]:
    """``("ok"|"worse", diff)``: diff is the accuracy drop (absolute) or the relative loss increase."""
    if not _finite(base_value):
        return "n/a", None
    if not _finite(case_value):
        return "worse", None
    if higher_is_better:
        drop = base_value - case_value
        return ("ok" if drop <= acc_tol + _EPS else "worse"), drop
    rel = (case_value - base_value) / max(abs(base_value), 1e-12)
    return ("ok" if rel <= loss_tol + _EPS else "worse"), rel


def summarize(
    cases: list[dict], loss_tolerance: float = LOSS_TOLERANCE, accuracy_tolerance: float = ACCURACY_TOLERANCE
) -> list[dict]:
    """One row per case (same order): its scalar fields plus the comparisons with its float32 baseline.

    The baseline is the successful float32 case of the same framework, workload and seed.
    ``speedup``: the worker's paired ratio (``paired``: the median over the rounds both ran of
    baseline step time / case step time, with ``speedup_ci95`` and ``speedup_rounds``; ``pairing``
    says how the policies shared the machine); for a record without one, baseline median step time /
    case median step time, ``pairing`` "unpaired". ``loss_delta`` = case train loss -
    baseline train loss at the last step both ran (so a capped run is compared where it stopped).
    ``eval_delta`` = case eval value - baseline eval value, only if both were evaluated after the same
    number of steps. ``parity`` is "ok"/"worse"/"n/a": judged on the eval metric when ``eval_delta`` exists,
    else on the train loss at the same step; a loss may be at most ``loss_tolerance`` (relative) above the
    baseline, an accuracy at most ``accuracy_tolerance`` (absolute) below it. Rows have the keys ROW_KEYS.
    """
    fp32 = [c for c in cases if c.get("policy") == BASELINE_POLICY]

    rows = []
    for case in cases:
        losses = list(case.get("losses") or [])
        scales = [s for s in case.get("scales") or [] if _finite(s)]
        metric, value, higher = _eval_parts(case)
        steps = case.get("steps")
        if steps is None and losses:
            steps = len(losses)
        is_baseline = case.get("policy") == BASELINE_POLICY
        row = {
            "framework": case.get("framework"),
            "framework_version": case.get("framework_version"),
            "versions": case.get("versions"),
            "workload": case.get("workload"),
            "policy": case.get("policy"),
            "seed": case.get("seed"),
            "status": case.get("status", "failed"),
            "error": case.get("error"),
            "steps": steps,
            "steps_requested": case.get("steps_requested"),
            "capped": bool(case.get("capped", False)),
            "cap_reason": case.get("cap_reason"),
            "warmup_steps": case.get("warmup_steps"),
            "timed_steps": len(case.get("step_times") or []),
            "median_step_s": _median_step(case),
            "peak_rss_mb": case.get("peak_rss_mb"),
            "wall_s": case.get("wall_s"),
            "final_loss": losses[-1] if losses else None,
            "eval_metric": metric,
            "eval_value": value,
            "eval_higher_is_better": higher,
            "skipped_steps": case.get("skipped_steps"),
            "final_scale": scales[-1] if scales else None,
            "uses_loss_scaling": any(s != 1 for s in scales),
            "is_baseline": is_baseline,
            "baseline": None,
            "speedup": None,
            "speedup_ci95": None,
            "speedup_rounds": None,
            "pairing": None,
            "roofline_share": case.get("roofline"),
            "roofline_peaks": case.get("roofline_peaks"),
            "loadavg_1min": case.get("loadavg_1min"),
            "loss_delta": None,
            "loss_compared_at_step": None,
            "eval_delta": None,
            "parity": "n/a",
            "parity_basis": None,
            "parity_diff": None,
            "loss_tolerance": loss_tolerance,
            "accuracy_tolerance": accuracy_tolerance,
            "notes": [],
        }
        rows.append(row)
        notes = row["notes"]
        candidates = [c for c in fp32 if _key(c) == _key(case) and _same_seed(c, case)]
        base = next((c for c in candidates if c.get("status") == "ok"), None)
        if base is None:
            why = f"float32 {candidates[0].get('status')}" if candidates else "float32 not run"
            notes.append(f"no float32 baseline ({why})")
            continue
        row["baseline"] = f"{base.get('framework')} {BASELINE_POLICY}"
        if row["status"] != "ok":
            continue
        if is_baseline and case is base:
            notes.append("is the float32 baseline")
        # speed-up
        case_med, base_med = row["median_step_s"], _median_step(base)
        paired = case.get("paired")
        if paired and not is_baseline:
            row["speedup"], row["speedup_ci95"] = paired["speedup"], paired.get("ci95")
            row["speedup_rounds"], row["pairing"] = paired.get("rounds"), paired.get("pairing")
        elif case_med and base_med:
            row["speedup"] = base_med / case_med
            row["pairing"] = None if is_baseline else UNPAIRED
        # train loss at the same step
        base_losses = list(base.get("losses") or [])
        n = min(len(losses), len(base_losses))
        if n:
            row["loss_delta"] = losses[n - 1] - base_losses[n - 1]
            row["loss_compared_at_step"] = n
            if n < len(losses):
                notes.append(f"float32 stopped after {n} steps, this case after {len(losses)}: "
                             f"train loss compared at step {n}")  # fmt: skip
        # eval after the same number of steps
        b_metric, b_value, _ = _eval_parts(base)
        if value is not None and b_value is not None and metric == b_metric:
            if steps == base.get("steps"):
                row["eval_delta"] = value - b_value
            else:
                base_steps = base.get("steps")
                notes.append(
                    f"{metric} after {steps} step(s) vs float32 after {base_steps} step(s): not compared"
                )
        # parity
        if is_baseline and case is base:
            continue
        if row["eval_delta"] is not None:
            row["parity"], row["parity_diff"] = _verdict(
                value, b_value, higher, loss_tolerance, accuracy_tolerance
            )
            row["parity_basis"] = metric
        elif row["loss_delta"] is not None:
            row["parity"], row["parity_diff"] = _verdict(
                losses[n - 1], base_losses[n - 1], False, loss_tolerance, accuracy_tolerance
            )
            row["parity_basis"] = f"train_loss@step{n}"
    return rows


# --------------------------------------------------------------------------------------------- formatting

UNPAIRED = "unpaired: ratio of medians taken at different times"
SMOKE_NOTE = (
    "Smoke check (--quick): tiny models and a few steps, each framework's cases sharing one process. "
    "Its timings, speed-ups and memory only show that every case runs; they are not findings. "
    "Run without --quick to measure."
)


def _num(v: float) -> str:
    return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.2g}"


def _is_slower(v: float | None, ci=None) -> bool:
    """Below 1x as printed, and, for a paired ratio, its whole 95 % interval too."""
    return v is not None and v < 1 and _num(v) != "1.00" and (not ci or ci[1] < 1)


def _fmt_speedup(row: dict, smoke: bool = False) -> str:
    """``1.71x [1.62-1.80] n=9``: the paired ratio, its 95 % interval and its rounds."""
    v = row.get("speedup")
    if row.get("is_baseline") and v is not None:
        return "baseline"
    if v is None:
        if row.get("status") == "ok" and row.get("baseline") is None:
            return "no fp32 baseline"
        return "n/a"
    slower = _is_slower(v, row.get("speedup_ci95")) and not smoke
    text = f"{_num(v)}x (slower)" if slower else f"{_num(v)}x"
    ci, rounds = row.get("speedup_ci95"), row.get("speedup_rounds")
    if ci:
        text += f" [{_num(ci[0])}-{_num(ci[1])}]"
    if rounds is not None:
        text += f" n={rounds}" + (" (warm-up)" if rounds == 0 else "")
    return text


def _fmt_steps(row: dict) -> str:
    steps = row.get("steps")
    if steps is None:
        return "-"
    if row.get("capped"):
        return f"{steps}/{row.get('steps_requested')} (capped)"
    return str(steps)


def _fmt_ms(row: dict) -> str:
    m = row.get("median_step_s")
    if m is None:
        return "-"
    ms = m * 1000
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _fmt_float(v: Any, fmt: str = ".4g", signed: bool = False) -> str:
    if v is None:
        return "-"
    if not _finite(v):
        return str(v)
    return format(v, ("+" if signed else "") + fmt)


def _fmt_loss_delta(row: dict) -> str:
    d = row.get("loss_delta")
    if d is None:
        return "-"
    s = _fmt_float(d, ".2g", signed=True)
    if row.get("steps_requested") and row.get("loss_compared_at_step") != row.get("steps_requested"):
        s += f" @step {row.get('loss_compared_at_step')}"
    return s


_SHORT_METRIC = {"heldout_loss": "heldout", "accuracy": "acc"}


def _fmt_eval(row: dict, short: bool = False) -> str:
    if row.get("eval_value") is None:
        return "-"
    metric = row.get("eval_metric")
    if short:
        metric = _SHORT_METRIC.get(metric, metric)
    return f"{metric}={_fmt_float(row['eval_value'], '.4g')}"


def _fmt_eval_delta(row: dict) -> str:
    if row.get("eval_delta") is not None:
        return _fmt_float(row["eval_delta"], ".3g", signed=True)
    if any("not compared" in n and "steps" in n for n in row.get("notes") or []):
        return "n/a (steps differ)"
    return "-"


def _fmt_status(row: dict, width: int | None = 48) -> str:
    status = row.get("status") or "?"
    if status == "ok":
        return "ok"
    err = " ".join(str(row.get("error") or "").split())
    text = f"{status}: {err}" if err else status
    if width and len(text) > width:
        text = text[: width - 1] + "…"
    return text


COLUMNS = (
    "framework",
    "workload",
    "policy",
    "steps",
    "ms/step",
    "speed-up vs fp32",
    "peak MB",
    "final loss",
    "Δloss vs fp32",
    "eval",
    "Δeval",
    "parity",
    "skipped",
    "final scale",
    "status / error",
)
STATUS = "status / error"
SPEEDUP = "speed-up vs fp32"


def _cells(row: dict, status_width: int | None = 48, short: bool = False, smoke: bool = False) -> dict:
    """The row's text in each of COLUMNS."""
    skipped = row.get("skipped_steps")
    return {
        "framework": str(row.get("framework")),
        "workload": str(row.get("workload")),
        "policy": str(row.get("policy")),
        "steps": _fmt_steps(row),
        "ms/step": _fmt_ms(row),
        SPEEDUP: _fmt_speedup(row, smoke),
        "peak MB": _fmt_float(row.get("peak_rss_mb"), ".0f"),
        "final loss": _fmt_float(row.get("final_loss")),
        "Δloss vs fp32": _fmt_loss_delta(row),
        "eval": _fmt_eval(row, short),
        "Δeval": _fmt_eval_delta(row),
        "parity": row.get("parity") or "n/a",
        "skipped": _fmt_float(skipped, "d") if isinstance(skipped, int) else "-",
        "final scale": _fmt_float(row.get("final_scale"), "g"),
        STATUS: _fmt_status(row, status_width),
    }


def _flagged(row: dict, smoke: bool = False) -> dict:
    """The cells a reader must not miss, by column, with their terminal style: a capped run, a slower
    speed-up (not in a smoke check), a parity outside tolerance, a case that did not run."""
    flags = {}
    if row.get("capped"):
        flags["steps"] = "bold yellow"
    if _is_slower(row.get("speedup"), row.get("speedup_ci95")) and not smoke:
        flags[SPEEDUP] = "bold red"
    if row.get("parity") == "worse":
        flags["parity"] = "bold red"
    if row.get("status") != "ok":
        flags[STATUS] = "bold red"
    return flags


def _display_order(rows: list[dict]) -> list[dict]:
    """Rows grouped by framework and workload (in first-seen order), float32 first within a group."""
    fw_order: dict = {}
    wl_order: dict = {}
    for r in rows:
        fw_order.setdefault(r.get("framework"), len(fw_order))
        wl_order.setdefault(r.get("workload"), len(wl_order))
    indexed = list(enumerate(rows))
    indexed.sort(
        key=lambda ir: (
            fw_order[ir[1].get("framework")],
            wl_order[ir[1].get("workload")],
            ir[1].get("policy") != BASELINE_POLICY,
            ir[0],
        )
    )
    return [r for _, r in indexed]


def _caption(rows: list[dict]) -> str:
    lt = rows[0].get("loss_tolerance", LOSS_TOLERANCE) if rows else LOSS_TOLERANCE
    at = rows[0].get("accuracy_tolerance", ACCURACY_TOLERANCE) if rows else ACCURACY_TOLERANCE
    return (
        "Every comparison is against float32 of the same framework, workload and seed: speed-up = median "
        "over the rounds both ran (the policies stepping in alternation) of fp32 step time / case step "
        "time, with its bootstrap 95% interval and n = rounds; Δloss = case train loss - fp32 train loss "
        "at the last step both ran; Δeval only when both were evaluated after the same number of steps. "
        f"Parity: a loss may be at most {lt:.0%} above fp32 (relative), an accuracy at most {at:g} "
        "below it (absolute)."
    )


# A narrow terminal keeps the columns that come first here; report.md always has them all.
_PRIORITY = (
    "framework",
    "workload",
    "policy",
    STATUS,
    SPEEDUP,
    "parity",
    "ms/step",
    "skipped",
    "steps",
    "Δloss vs fp32",
    "final scale",
    "eval",
    "Δeval",
    "final loss",
    "peak MB",
)
_ALWAYS = 4  # framework, workload, policy, status: a row means nothing without them
_MAX_WIDTH = {"steps": 13, SPEEDUP: 15, "Δloss vs fp32": 17, "eval": 20, "Δeval": 18}
_MIN_STATUS = 16  # the status column wraps; it needs this much to stay readable
_GAP = 2  # characters between two columns
_RIGHT = ("ms/step", "peak MB", "final loss", "skipped", "final scale")


def _header(name: str) -> str:
    return name.replace(" vs ", "\nvs ").replace("final ", "final\n").replace("peak ", "peak\n")


def _fit_columns(cells: list[dict], width: int, wrap: bool = True) -> list[str]:
    """The columns to show in ``width`` characters, in COLUMNS order.

    Columns are taken in _PRIORITY order, each at its widest cell and header (with ``wrap``, as rich
    renders: headers over two lines, cells at most _MAX_WIDTH; the status column counts _MIN_STATUS
    as it always wraps), and one that does not fit in what is left is left out.
    """

    def need(name: str) -> int:
        header = _header(name).splitlines() if wrap else [name]
        widest = max(len(t) for t in header + [c[name] for c in cells])
        if name == STATUS:
            return min(widest, _MIN_STATUS)
        return min(widest, _MAX_WIDTH.get(name, widest)) if wrap else widest

    chosen, used = [], -_GAP
    for i, name in enumerate(_PRIORITY):
        w = need(name) + _GAP
        if i < _ALWAYS or used + w <= width:
            chosen.append(name)
            used += w
    return [name for name in COLUMNS if name in chosen]


def _left_out_note(shown: list[str]) -> str:
    hidden = [name for name in COLUMNS if name not in shown]
    if not hidden:
        return ""
    return f" Not shown at this terminal width: {', '.join(hidden)} (report.md has every column)."


def _plain_table(rows: list[dict], width: int, smoke: bool) -> str:
    """terminal_table without rich: the same columns, the status wrapped in what the others leave."""
    import textwrap

    body = [_cells(r, None, smoke=smoke) for r in _display_order(rows)]
    shown = _fit_columns(body, width, wrap=False)
    widths = {n: max(len(c) for c in [n] + [b[n] for b in body]) for n in shown if n != STATUS}
    indent = " " * (sum(widths.values()) + _GAP * len(widths))  # where the status column starts
    widths[STATUS] = max(width - len(indent), _MIN_STATUS)

    def lines(cells):
        status = textwrap.wrap(cells[STATUS], widths[STATUS]) or [""]
        first = "  ".join(cells[n].ljust(widths[n]) if n != STATUS else status[0] for n in shown)
        return [first.rstrip()] + [indent + more for more in status[1:]]

    out = [textwrap.fill(SMOKE_NOTE, width), ""] if smoke else []
    out += lines({n: n for n in shown}) + ["  ".join("-" * widths[n] for n in shown)]
    for cells in body:
        out += lines(cells)
    return "\n".join(out) + "\n" + textwrap.fill(_caption(rows) + _left_out_note(shown), width) + "\n"


def terminal_table(
    rows: list[dict], color: bool = False, width: int | None = None, smoke: bool = False
) -> str:
    """The rows as a text table (rich if importable, else plain text) at most ``width`` columns wide.

    ``width`` defaults to the terminal's (``shutil.get_terminal_size()``); the columns that do not fit
    are left out by _PRIORITY and named under the table. Slower-than-float32 speed-ups read
    "(slower)", capped step counts "(capped)", and with ``color=True`` the string carries ANSI styles
    (slow, capped, worse and failed cells in red/yellow). ``smoke``: a ``--quick`` run, whose timings
    are labelled a smoke check and never flagged as slower.
    """
    import shutil

    width = width or shutil.get_terminal_size().columns
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return _plain_table(rows, width, smoke)

    ordered = _display_order(rows)
    status_width = 90 if width >= 150 else 60
    body = [_cells(row, status_width, short=True, smoke=smoke) for row in ordered]
    shown = _fit_columns(body, width)
    table = Table(
        box=box.SIMPLE_HEAD,
        caption=_caption(rows) + _left_out_note(shown),
        caption_justify="left",
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )
    for name in shown:
        table.add_column(_header(name), overflow="fold", justify="right" if name in _RIGHT else "left",
                         no_wrap=name not in _MAX_WIDTH and name != STATUS,
                         max_width=_MAX_WIDTH.get(name))  # fmt: skip
    prev = None
    for row, cells in zip(ordered, body):
        group = (row.get("framework"), row.get("workload"))
        if prev is not None and group != prev:
            table.add_section()
        prev = group
        styles = _flagged(row, smoke)
        speedup = row.get("speedup")
        if SPEEDUP not in styles and speedup is not None and speedup > 1 and not smoke:
            styles[SPEEDUP] = "green"
        if row.get("policy") == BASELINE_POLICY:
            styles["policy"] = "bold"
        table.add_row(*[Text(cells[name], style=styles.get(name, "")) for name in shown])
    console = Console(
        file=io.StringIO(),
        record=True,
        width=width,
        force_terminal=color,
        color_system="standard" if color else None,
    )
    if smoke:
        console.print(Text(SMOKE_NOTE, style="bold"), "")
    console.print(table)
    return "\n".join(line.rstrip() for line in console.export_text(styles=color).splitlines()) + "\n"


# --------------------------------------------------------------------------------------------- markdown


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _fmt_setting(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt_setting(v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt_setting(v) for v in value) or "-"
    return "-" if value is None else str(value)


def _versions(rows: list[dict]) -> dict:
    """Every package version the cases recorded, each once (a case without ``versions`` gives its
    framework's ``framework_version``)."""
    out: dict = {}
    for r in rows:
        versions = r.get("versions") or (
            {r["framework"]: r["framework_version"]} if r.get("framework_version") else {}
        )
        for package, version in versions.items():
            out.setdefault(package, version)
    return out


def _markdown(rows: list[dict], settings: dict, plots: list[Path], smoke: bool = False) -> str:
    out = ["# polyamp compare report" + (" (smoke check)" if smoke else ""), ""]
    out += ["## Settings", ""]
    for k, v in (settings or {}).items():
        out.append(f"- **{k}**: {_md_cell(_fmt_setting(v))}")
    versions = _versions(rows)
    if versions:
        out.append(
            "- **framework versions (from the cases)**: " + ", ".join(f"{k} {v}" for k, v in versions.items())
        )
    out += ["", "## Results", ""]
    if smoke:
        out += [f"> **{SMOKE_NOTE}**", ""]
    out += ["Each row is compared with float32 of the same framework, workload and seed.", ""]
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append(
        "|" + "|".join("---:" if c in ("ms/step", "peak MB", "final loss") else "---" for c in COLUMNS) + "|"
    )
    for row in _display_order(rows):
        cells = {name: _md_cell(text) for name, text in _cells(row, smoke=smoke).items()}
        for name in _flagged(row, smoke):
            cells[name] = f"**{cells[name]}**"
        out.append("| " + " | ".join(cells[name] for name in COLUMNS) + " |")

    out += ["", "## Notes", ""]
    out.append("- " + _caption(rows))
    ordered = _display_order(rows)
    for row in ordered:
        if row.get("capped"):
            out.append(
                f"- **capped**: {_label(row)} ran {row.get('steps')} of {row.get('steps_requested')} steps: "
                f"{row.get('cap_reason') or 'no reason recorded'}"
            )
    for row in ordered:
        if _is_slower(row.get("speedup"), row.get("speedup_ci95")) and not smoke:
            out.append(f"- **slower than float32**: {_label(row)} at {_fmt_speedup(row)} of float32's speed")
    for row in ordered:
        if row.get("parity") == "worse":
            diff = row.get("parity_diff")
            if diff is None:
                what = "non-finite value"
            elif row.get("parity_basis") == "accuracy" or (
                row.get("eval_higher_is_better") and row.get("parity_basis") == row.get("eval_metric")
            ):
                what = f"{diff:.3g} below float32, tolerance {row.get('accuracy_tolerance'):g}"
            else:
                what = f"{diff:+.1%} relative to float32, tolerance {row.get('loss_tolerance'):.0%}"
            out.append(f"- **outside tolerance**: {_label(row)} on {row.get('parity_basis')}: {what}")
    for row in ordered:
        if row.get("status") != "ok":
            err = str(row.get("error") or "no error text recorded")
            out += [f"- **{row.get('status')}**: {_label(row)}:", "", "  ```text"]
            out += ["  " + line for line in err.splitlines() or [""]]
            out += ["  ```", ""]
    out += _pairing_notes(ordered, ((settings or {}).get("machine") or {}).get("cores"))
    for row in ordered:
        for note in row.get("notes") or []:
            if note != "is the float32 baseline":
                out.append(f"- {_label(row)}: {note}")
    from .roofline import markdown as roofline_section

    out += [""] + roofline_section(ordered)
    out += ["## Plots", ""]
    titles = {
        "speedup.png": "Speed-up over float32",
        "loss_curves.png": "Train loss",
        "loss_scale.png": "Loss scale",
    }
    for p in plots:
        out += [f"### {titles.get(p.name, p.stem)}", "", f"![{titles.get(p.name, p.stem)}]({p.name})", ""]
    return "\n".join(out).rstrip() + "\n"


def _pairing_notes(rows: list[dict], cores: int | None = None) -> list[str]:
    """Which rows were not paired in one process, which rest on fewer than 5 rounds, and which were
    timed while the machine's load average exceeded its ``cores``."""
    from .timing import LOCKSTEP

    out = []
    across = ("MXNet's AMP is process-wide, so each policy ran in its own process; the processes stepped "
              "in alternation, so the rounds still interleave in time, but what differs between two "
              "processes (memory placement, kernel choice) is not paired away")
    for kind, why in ((LOCKSTEP, across), (UNPAIRED, "no per-round pairing was recorded")):
        labels = [_label(r) for r in rows if r.get("pairing") == kind]
        if labels:
            out.append(f"- **{kind}**: {', '.join(labels)}: {why}")
    for r in rows:
        pairing, rounds = r.get("pairing") or "", r.get("speedup_rounds")
        if pairing.startswith("unpaired") and pairing != UNPAIRED:
            out.append(f"- **{pairing}**: {_label(r)}: it spent its budget on its warm-up step, which is its "
                       "only time (over float32's median)")  # fmt: skip
        elif rounds is not None and 0 < rounds < 5:
            out.append(f"- **few rounds**: {_label(r)}: its speed-up rests on {rounds} round(s)")
    busy = [r for r in rows if cores and max(r.get("loadavg_1min") or [0]) > cores]
    if busy:
        peak = max(max(r["loadavg_1min"]) for r in busy)
        out.append(f"- **busy machine**: {', '.join(_label(r) for r in busy)}: timed while the 1-minute "
                   f"load average (up to {peak:.1f}) exceeded the {cores} cores: other programs competed "
                   "for them")  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------- plots


def _ordered(values, preferred=()) -> list:
    seen: list = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return sorted(
        seen, key=lambda v: (preferred.index(v) if v in preferred else len(preferred), seen.index(v))
    )


def _policy_colors(policies) -> dict:
    palette = [
        "#1f77b4",
        "#d62728",
        "#2ca02c",
        "#ff7f0e",
        "#9467bd",
        "#8c564b",
        "#e377c2",
        "#17becf",
        "#bcbd22",
    ]
    others = [p for p in policies if p != BASELINE_POLICY]
    colors = {p: palette[i % len(palette)] for i, p in enumerate(others)}
    colors[BASELINE_POLICY] = "black"
    return colors


_RC = {
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "figure.titlesize": 12,
}


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def _note_figure(title: str, note: str):
    """A small figure that says, centred, why there is nothing to draw."""
    fig = _new_figure(8.0, 3.0)
    ax = fig.subplots()
    ax.set_axis_off()
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=12)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _speedup_figure(rows: list[dict], smoke: bool = False):
    """Bars of speed-up over float32 per framework and policy, one panel per workload; log y axis."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = [r for r in rows if r.get("policy") != BASELINE_POLICY]
    if not rows:
        return _note_figure("Speed-up over float32", "No case other than float32 ran: nothing to compare.")
    workloads = _ordered([r["workload"] for r in rows], _WORKLOAD_ORDER)
    frameworks = _ordered([r["framework"] for r in rows])
    policies = _ordered([r["policy"] for r in rows])
    colors = _policy_colors(policies)
    values = [r["speedup"] for r in rows if _finite(r.get("speedup")) and r["speedup"] > 0]
    lo = min(values + [1.0]) / 5
    hi = max(values + [1.0]) * 5

    per_wl = {}
    for wl in workloads or ["(none)"]:
        fws = [f for f in frameworks if any(r["workload"] == wl and r["framework"] == f for r in rows)]
        pols = [p for p in policies if any(r["workload"] == wl and r["policy"] == p for r in rows)]
        per_wl[wl] = (fws, pols)
    nbars = [max(1, len(f) * len(p)) for f, p in per_wl.values()]
    widths = [max(3.6, 0.55 * n + 1.6) for n in nbars]
    if sum(widths) + 1.0 <= 16.0:  # side by side
        fig = _new_figure(max(8.0, sum(widths) + 1.0), 5.6)
        axes = fig.subplots(1, len(per_wl), sharey=True, squeeze=False, gridspec_kw={"width_ratios": widths})[
            0
        ]
        labelled = axes[:1]
    else:  # too many bars: one workload per row
        widths = [max(widths)] * len(widths)
        fig = _new_figure(widths[0] + 1.2, 4.0 * len(per_wl) + 1.0)
        axes = fig.subplots(len(per_wl), 1, sharey=True, squeeze=False)[:, 0]
        labelled = axes
    any_capped = any_rotated = False
    for ax, panel_w, (wl, (fws, pols)) in zip(axes, widths, per_wl.items()):
        ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        ax.axhline(1.0, color="black", lw=1.2, zorder=1)
        width = 0.8 / max(1, len(pols))
        bar_inches = panel_w * 0.85 * width / (len(fws) + 0.2)
        labels = [_bar_label(r) for r in rows if r["workload"] == wl and _finite(r.get("speedup"))]
        widest = max((len(line) for label in labels for line in label.splitlines()), default=0)
        rotate = bar_inches < 0.075 * widest  # about 0.075 in per character at 9 pt
        any_rotated |= rotate
        for i, fw in enumerate(fws):
            for j, pol in enumerate(pols):
                match = [r for r in rows if (r["workload"], r["framework"], r["policy"]) == (wl, fw, pol)]
                if not match:
                    continue
                r = match[0]
                x = i - 0.4 + width * (j + 0.5)
                v = r.get("speedup")
                if _finite(v) and v > 0:
                    hatch = "//" if r.get("capped") else None
                    any_capped |= bool(hatch)
                    ax.bar(x, v - 1.0, bottom=1.0, width=width * 0.9, color=colors[pol], hatch=hatch,
                           edgecolor="white" if hatch else colors[pol], zorder=2)  # fmt: skip
                    up = v >= 1
                    ci = r.get("speedup_ci95")
                    if ci:  # the 95 % interval of the paired ratio
                        ax.errorbar(x, v, yerr=[[max(v - ci[0], 0)], [max(ci[1] - v, 0)]], fmt="none",
                                    ecolor="black", elinewidth=1, capsize=3, zorder=3)  # fmt: skip
                    ax.annotate(
                        _bar_label(r).replace("\n", " ") if rotate else _bar_label(r),
                        (x, (ci[1] if up else ci[0]) if ci else v),
                        xytext=(0, 3 if up else -3),
                        textcoords="offset points",
                        ha="center",
                        va="bottom" if up else "top",
                        fontsize=9,
                        rotation=90 if rotate else 0,
                    )
                else:
                    why = (
                        r.get("status")
                        if r.get("status") != "ok"
                        else "no fp32"
                        if not r.get("baseline")
                        else "no timing"
                    )
                    ax.text(
                        x, lo * 1.3, why, rotation=90, ha="center", va="bottom", fontsize=9, color="dimgray"
                    )
        ax.set_xticks(range(len(fws)))
        ax.set_xticklabels(fws)
        ax.set_xlim(-0.6, len(fws) - 0.4)
        ax.set_title(wl)
        ax.grid(axis="y", which="major", color="0.85", lw=0.8, zorder=0)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: "float32 = 1x" if y == 1 else f"{y:g}x"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    if any_rotated:  # room for labels written along the bars (the axes share their y limits)
        axes[0].set_ylim(lo / 4, hi * 4)
    for ax in labelled:
        ax.set_ylabel("speed-up over float32 of the same framework\n(log scale)")
    handles = [Patch(color=colors[p], label=p) for p in policies]
    handles.append(Line2D([], [], color="black", lw=1.2, label="float32 (1x)"))
    if any_capped:
        handles.append(Patch(facecolor="0.6", hatch="//", edgecolor="white", label="capped run"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    if smoke:
        fig.suptitle("Speed-up over float32: a smoke check (--quick), not a measurement")
    else:
        fig.suptitle("Speed-up over float32: median of the paired per-round ratios\n(bar: 95% interval, "
                     "n = rounds; above the line = faster)")  # fmt: skip
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1 - 0.5 / height))  # room for the legend and the title
    return fig


def _bar_label(row: dict) -> str:
    rounds = row.get("speedup_rounds")
    return f"{_num(row['speedup'])}x" + (f"\nn={rounds}" if rounds is not None else "")


def _loss_figure(rows: list[dict], cases: list[dict]):
    """Train loss vs step, one panel per (framework, workload), one line per policy; float32 in black."""
    from matplotlib.lines import Line2D

    if not rows:
        return _note_figure("Train loss per step", "No case ran.")
    frameworks = _ordered([r["framework"] for r in rows])
    workloads = _ordered([r["workload"] for r in rows], _WORKLOAD_ORDER)
    colors = _policy_colors(_ordered([r["policy"] for r in rows]))
    fig = _new_figure(max(6.0, 5.0 * len(workloads)), max(3.8, 3.8 * len(frameworks)))
    axes = fig.subplots(max(1, len(frameworks)), max(1, len(workloads)), squeeze=False)
    for i, fw in enumerate(frameworks):
        for j, wl in enumerate(workloads):
            ax = axes[i][j]
            ax.set_title(f"{fw} · {wl}")
            group = [(r, c) for r, c in zip(rows, cases) if (r["framework"], r["workload"]) == (fw, wl)]
            group.sort(key=lambda rc: rc[0].get("policy") != BASELINE_POLICY)
            plotted: list[float] = []
            extra = []
            for r, c in group:
                losses = c.get("losses") or []
                pol = r.get("policy")
                if r.get("status") != "ok" or not losses:
                    extra.append(Line2D([], [], ls="none", marker="x", color="gray",
                                        label=f"{pol}: {r.get('status')}"))  # fmt: skip
                    continue
                ys = [y if _finite(y) else float("nan") for y in losses]
                xs = list(range(1, len(ys) + 1))
                plotted += [y for y in ys if _finite(y)]
                base = pol == BASELINE_POLICY
                label = pol + (
                    f" (capped at {len(ys)}/{r.get('steps_requested')})" if r.get("capped") else ""
                )
                # float32 wide and underneath, so that a policy that tracks it exactly stays visible on top
                ax.plot(xs, ys, color=colors[pol], lw=2.8 if base else 1.4, zorder=2 if base else 3,
                        marker="o" if len(ys) <= 25 else None, ms=3, label=label)  # fmt: skip
                if r.get("capped"):
                    ax.plot(
                        xs[-1], ys[-1], marker="X", ms=9, color=colors[pol], mec="black", zorder=4, ls="none"
                    )
            if plotted:
                if min(plotted) > 0 and max(plotted) / min(plotted) > 10:
                    ax.set_yscale("log")
                ax.set_xlabel("step")
                ax.set_ylabel("train loss" + (" (log scale)" if ax.get_yscale() == "log" else ""))
                handles, _ = ax.get_legend_handles_labels()
                ax.legend(handles=handles + extra, loc="best")
                ax.grid(color="0.9", lw=0.8)
            else:
                ax.set_axis_off()
                msg = "\n".join(h.get_label() for h in extra) if extra else "not run"
                ax.text(0.5, 0.5, msg, ha="center", va="center", transform=ax.transAxes, fontsize=10,
                        color="firebrick" if extra else "gray")  # fmt: skip
    fig.suptitle("Train loss per step (float32 in black; capped runs end at X)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return fig


def _scale_figure(rows: list[dict], cases: list[dict]):
    """Loss scale vs step (log2 y) for every successful case whose scale is not constantly 1."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    used = [(r, c) for r, c in zip(rows, cases) if r.get("status") == "ok" and r.get("uses_loss_scaling")]
    if not used:
        return _note_figure(
            "Loss scale per step", "No case used loss scaling\n(every loss scale was constantly 1)."
        )
    frameworks = _ordered([r["framework"] for r, _ in used])
    colors = _policy_colors(_ordered([r["policy"] for r, _ in used]))
    styles = ["-", "--", ":", "-."]
    wl_style = {
        wl: styles[i % 4] for i, wl in enumerate(_ordered([r["workload"] for r, _ in used], _WORKLOAD_ORDER))
    }
    wl_marker = dict(zip(wl_style, "os^Dv<>"))
    ncols = min(3, len(frameworks))
    nrows = -(-len(frameworks) // ncols)
    fig = _new_figure(max(6.5, 5.5 * ncols), 4.0 * nrows + 0.4)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax in axes[len(frameworks) :]:
        ax.set_axis_off()
    last_step = max(len(c.get("scales") or []) for _, c in used)
    for ax, fw in zip(axes, frameworks):
        for r, c in used:
            if r["framework"] != fw:
                continue
            ys = [s if _finite(s) and s > 0 else float("nan") for s in c.get("scales") or []]
            xs = list(range(1, len(ys) + 1))
            label = f"{r['workload']} {r['policy']}" + (" (capped)" if r.get("capped") else "")
            marker = wl_marker[r["workload"]] if len(ys) <= 25 else None
            style = {"color": colors[r["policy"]], "ls": wl_style[r["workload"]], "lw": 1.6, "ms": 5}
            ax.plot(xs, ys, marker=marker, label=label, **style)
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"$2^{{{math.log2(y):g}}}$" if y > 0 else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(
            0.5 - 0.02 * last_step, last_step * 1.02 + 0.5
        )  # the same steps everywhere: short runs look short
        ax.set_xlabel("step")
        ax.set_ylabel("loss scale (log2)")
        ax.set_title(fw)
        ax.grid(color="0.9", lw=0.8)
        ax.legend(loc="best")
    fig.suptitle("Loss scale per step (cases that used loss scaling)")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.2 / fig.get_figheight()))
    return fig


def _plot_all(rows: list[dict], cases: list[dict], out_dir: Path, smoke: bool = False) -> list[Path]:
    import matplotlib

    paths = []
    with matplotlib.rc_context(_RC):
        for name, fig in (
            ("speedup.png", _speedup_figure(rows, smoke)),
            ("loss_curves.png", _loss_figure(rows, cases)),
            ("loss_scale.png", _scale_figure(rows, cases)),
        ):
            path = out_dir / name
            fig.savefig(path, dpi=120)
            paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------- report


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


def write_report(
    cases: list[dict],
    settings: dict,
    out_dir: str | Path,
    loss_tolerance: float = LOSS_TOLERANCE,
    accuracy_tolerance: float = ACCURACY_TOLERANCE,
) -> dict:
    """Write report.json, report.md, speedup.png, loss_curves.png and loss_scale.png into ``out_dir``.

    report.json holds ``settings``, the raw ``cases`` (step_times included, so speed-ups can be
    recomputed), the ``rows`` of ``summarize``, the ``tolerances`` and what the ``timings`` are: a
    "smoke check" when ``settings["quick"]`` (then every output says so), else a "measurement";
    non-finite numbers are written as null. Returns ``{"json": path, "markdown": path, "plots": [paths]}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(cases, loss_tolerance, accuracy_tolerance)
    smoke = bool((settings or {}).get("quick"))
    plots = _plot_all(rows, cases, out, smoke)
    doc = {
        "settings": settings,
        "cases": cases,
        "rows": rows,
        "tolerances": {
            "loss_relative": loss_tolerance,
            "accuracy_absolute": accuracy_tolerance,
            "baseline": f"{BASELINE_POLICY} of the same framework, workload and seed",
        },
        "timings": {"kind": "smoke check", "note": SMOKE_NOTE} if smoke else {
            "kind": "measurement",
            "note": "paired: after one warm-up step each, the policies of a (framework, workload) step in "
            "interleaved rounds; a speed-up is the median of per-round ratios over float32, with a "
            "bootstrap 95% interval and its number of rounds",
        },
    }
    json_path = out / "report.json"
    json_path.write_text(json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    md_path = out / "report.md"
    md_path.write_text(_markdown(rows, settings, plots, smoke), encoding="utf-8")
    return {"json": str(json_path), "markdown": str(md_path), "plots": [str(p) for p in plots]}
