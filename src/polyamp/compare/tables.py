"""The report's tables: the terminal table and report.md's training, memory and inference tables.

A cell a reader must not miss is flagged (``flags``): a capped run, a speed-up slower than float32
(never in a smoke check), a parity outside tolerance, a case that did not run. A narrow terminal
keeps the columns that come first in ``_PRIORITY`` and names those it leaves out; report.md has them all.
"""

from __future__ import annotations

import io
import textwrap

from . import text as fmt
from .rows import LOSS_TOLERANCE, Row, display_order

SMOKE_NOTE = (
    "Smoke check (--quick): tiny models and a few steps, each framework's cases sharing one process. "
    "Its timings, speed-ups and memory only show that every case runs; they are not findings. "
    "Run without --quick to measure."
)
STATUS = "status / error"
SPEEDUP = "speed-up vs fp32"
COLUMNS = ("framework", "workload", "policy", "steps", "ms/step", SPEEDUP, "peak MB", "final loss",
           "Δloss vs fp32", "eval", "Δeval", "parity", "skipped", "final scale", STATUS)  # fmt: skip
_PRIORITY = ("framework", "workload", "policy", STATUS, SPEEDUP, "parity", "ms/step", "skipped", "steps",
             "Δloss vs fp32", "final scale", "eval", "Δeval", "final loss", "peak MB")  # fmt: skip
_ALWAYS = 4  # framework, workload, policy, status: a row means nothing without them
_MAX_WIDTH = {"steps": 13, SPEEDUP: 15, "Δloss vs fp32": 17, "eval": 20, "Δeval": 18}
_MIN_STATUS = 16  # the status column wraps; it needs this much to stay readable
_GAP = 2  # characters between two columns
_RIGHT = ("ms/step", "peak MB", "final loss", "skipped", "final scale")
_SHORT_METRIC = {"heldout_loss": "heldout", "accuracy": "acc"}


def caption(rows: list[Row]) -> str:
    tolerances = {r.workload: r.tolerance for r in rows if r.eval_delta is not None and r.tolerance}
    eval_tol = "; ".join(f"{wl} {r_tol:g}" for wl, r_tol in tolerances.items())
    return (
        "Every comparison is against float32 of the same framework, workload and seed: speed-up = median "
        "over the rounds both ran (the policies stepping in alternation) of fp32 step time / case step "
        "time, with its bootstrap 95% interval and n = rounds; Δloss = case train loss - fp32 train loss "
        "at the last step both ran; Δeval only when both were evaluated after the same number of steps. "
        f"Parity: a train loss may be at most {LOSS_TOLERANCE:.0%} above fp32 (relative), a held-out loss "
        "at most its workload's tolerance above it (relative), an accuracy at most its tolerance below it "
        f"(absolute){' (' + eval_tol + ')' if eval_tol else ''}. This parity is a smoke check (one seed, "
        "a few steps); polyamp compare --converge decides it over seeds."
    )


def flags(row: Row, smoke: bool = False) -> dict[str, str]:
    """The cells a reader must not miss, by column, with their terminal style."""
    out = {}
    if row.capped:
        out["steps"] = "bold yellow"
    if row.slower and not smoke:
        out[SPEEDUP] = "bold red"
    if row.parity == "worse":
        out["parity"] = "bold red"
    if not row.ok:
        out[STATUS] = "bold red"
    return out


def _speedup(row: Row, smoke: bool) -> str:
    if row.is_baseline and row.speedup is not None:
        return "baseline"
    if row.speedup is None:
        return "no fp32 baseline" if row.ok and row.baseline is None else "n/a"
    return fmt.ratio(row.speedup, row.speedup_ci95, row.speedup_rounds, slower=row.slower and not smoke)


def _status(row: Row, width: int | None) -> str:
    if row.ok:
        return "ok"
    err = fmt.one_line(row.error)
    return fmt.one_line(f"{row.status}: {err}" if err else row.status, width)


def _eval(row: Row, short: bool) -> str:
    if row.eval_value is None:
        return "-"
    metric = _SHORT_METRIC.get(row.eval_metric, row.eval_metric) if short else row.eval_metric
    return f"{metric}={fmt.number(row.eval_value)}"


def cells(row: Row, status_width: int | None = 48, short: bool = False, smoke: bool = False) -> dict:
    """The row's text in each of COLUMNS."""
    steps = "-" if row.steps is None else f"{row.steps}/{row.steps_requested} (capped)" if row.capped \
        else str(row.steps)  # fmt: skip
    loss_delta = "-"
    if row.loss_delta is not None:
        loss_delta = fmt.number(row.loss_delta, ".2g", signed=True)
        if row.steps_requested and row.loss_compared_at_step != row.steps_requested:
            loss_delta += f" @step {row.loss_compared_at_step}"
    eval_delta = fmt.number(row.eval_delta, ".3g", signed=True) if row.eval_delta is not None \
        else "n/a (steps differ)" if row.eval_steps_differ else "-"  # fmt: skip
    return {
        "framework": row.framework, "workload": row.workload, "policy": row.policy, "steps": steps,
        "ms/step": fmt.ms(row.median_step_s), SPEEDUP: _speedup(row, smoke),
        "peak MB": fmt.number(row.memory.peak_rss_mb, ".0f"), "final loss": fmt.number(row.final_loss),
        "Δloss vs fp32": loss_delta, "eval": _eval(row, short), "Δeval": eval_delta, "parity": row.parity,
        "skipped": str(row.skipped_steps) if isinstance(row.skipped_steps, int) else "-",
        "final scale": fmt.number(row.final_scale, "g"), STATUS: _status(row, status_width),
    }  # fmt: skip


def _header(name: str) -> str:
    return name.replace(" vs ", "\nvs ").replace("final ", "final\n").replace("peak ", "peak\n")


def _fit_columns(body: list[dict], width: int, wrap: bool = True) -> list[str]:
    """The columns to show in ``width`` characters, in COLUMNS order: taken in _PRIORITY order, each at
    its widest cell and header (with ``wrap``, as rich renders: headers over two lines, cells at most
    _MAX_WIDTH, the status column at _MIN_STATUS), leaving out one that does not fit."""

    def need(name: str) -> int:
        header = _header(name).splitlines() if wrap else [name]
        widest = max(len(t) for t in header + [c[name] for c in body])
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


def _plain_table(rows: list[Row], width: int, smoke: bool) -> str:
    """terminal_table without rich: the same columns, the status wrapped in what the others leave."""
    body = [cells(r, None, smoke=smoke) for r in display_order(rows)]
    shown = _fit_columns(body, width, wrap=False)
    widths = {n: max(len(c) for c in [n] + [b[n] for b in body]) for n in shown if n != STATUS}
    indent = " " * (sum(widths.values()) + _GAP * len(widths))  # where the status column starts
    widths[STATUS] = max(width - len(indent), _MIN_STATUS)

    def lines(c):
        status = textwrap.wrap(c[STATUS], widths[STATUS]) or [""]
        first = "  ".join(c[n].ljust(widths[n]) if n != STATUS else status[0] for n in shown)
        return [first.rstrip()] + [indent + more for more in status[1:]]

    out = [textwrap.fill(SMOKE_NOTE, width), ""] if smoke else []
    out += lines({n: n for n in shown}) + ["  ".join("-" * widths[n] for n in shown)]
    for c in body:
        out += lines(c)
    return "\n".join(out) + "\n" + textwrap.fill(caption(rows) + _left_out_note(shown), width) + "\n"


def terminal_table(rows: list[Row], color: bool = False, width: int | None = None,
                   smoke: bool = False) -> str:  # fmt: skip
    """The rows as a text table (rich if importable, else plain text) at most ``width`` columns wide
    (default: the terminal's); with ``color`` the string carries ANSI styles for the flagged cells."""
    import shutil

    width = width or shutil.get_terminal_size().columns
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return _plain_table(rows, width, smoke)
    ordered = display_order(rows)
    body = [cells(row, 90 if width >= 150 else 60, short=True, smoke=smoke) for row in ordered]
    shown = _fit_columns(body, width)
    table = Table(box=box.SIMPLE_HEAD, caption=caption(rows) + _left_out_note(shown), caption_justify="left",
                  pad_edge=False, show_edge=False, collapse_padding=True)  # fmt: skip
    for name in shown:
        table.add_column(_header(name), overflow="fold", justify="right" if name in _RIGHT else "left",
                         no_wrap=name not in _MAX_WIDTH and name != STATUS,
                         max_width=_MAX_WIDTH.get(name))  # fmt: skip
    prev = None
    for row, c in zip(ordered, body):
        if prev is not None and (row.framework, row.workload) != prev:
            table.add_section()
        prev = (row.framework, row.workload)
        styles = flags(row, smoke)
        if SPEEDUP not in styles and row.speedup is not None and row.speedup > 1 and not smoke:
            styles[SPEEDUP] = "green"
        if row.is_baseline:
            styles["policy"] = "bold"
        table.add_row(*[Text(c[name], style=styles.get(name, "")) for name in shown])
    console = Console(file=io.StringIO(), record=True, width=width, force_terminal=color,
                      color_system="standard" if color else None)  # fmt: skip
    if smoke:
        console.print(Text(SMOKE_NOTE, style="bold"), "")
    console.print(table)
    return "\n".join(line.rstrip() for line in console.export_text(styles=color).splitlines()) + "\n"


# --------------------------------------------------------------------------------------------- markdown


def _md_table(header: list[str], align: str, body: list[list[str]]) -> list[str]:
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    out = ["| " + " | ".join(header) + " |", rule]
    return out + ["| " + " | ".join(fmt.md_cell(c) for c in line) + " |" for line in body]


def training_table(rows: list[Row], smoke: bool) -> list[str]:
    body = []
    for row in display_order(rows):
        c = cells(row, smoke=smoke)
        for name in flags(row, smoke):
            c[name] = f"**{c[name]}**"
        body.append([c[name] for name in COLUMNS])
    align = "".join("r" if c in ("ms/step", "peak MB", "final loss") else "l" for c in COLUMNS)
    return _md_table(list(COLUMNS), align, body)


_MEMORY_KINDS = (("activations", "activations saved"), ("weight_copies", "weight copies saved"),
                 ("parameters", "parameters"), ("gradients", "gradients"), ("master", "master copies"),
                 ("optimizer", "optimizer state"), ("workspace", "compiled workspace"))  # fmt: skip


def memory_table(rows: list[Row]) -> list[str]:
    """MiB by kind, then the mixed/float32 ratios: saved for backward, model state, compiled workspace."""
    measured = [r for r in display_order(rows) if r.ok and r.memory.parameters is not None]
    if not measured:
        return []
    header = ["framework", "workload", "policy"] + [name + " MiB" for _, name in _MEMORY_KINDS]
    header += ["total MiB", "total vs fp32", "saved vs fp32", "activations vs fp32", "state vs fp32",
               "process peak MB (shared)"]  # fmt: skip
    body = []
    for r in measured:
        m = r.memory
        ratios = [fmt.mib(m.total)] + [fmt.times(m.ratios.get(k)) for k in ("total", "saved", "activations",
                                                                              "state")]  # fmt: skip
        body.append([r.framework, r.workload, r.policy] + [fmt.mib(m.value(k)) for k, _ in _MEMORY_KINDS]
                    + ratios + [fmt.number(m.peak_rss_mb, ".0f")])  # fmt: skip
    out = _md_table(header, "lll" + "r" * (len(header) - 3), body)
    hows = {}
    for r in measured:
        for kind, how in r.memory.how.items():
            hows.setdefault((r.framework, kind), how)
    notes = ["", "How each figure was measured (per framework):", ""]
    for fw in dict.fromkeys(r.framework for r in measured):
        for kind in ("activations", "optimizer", "workspace"):
            if (fw, kind) in hows:
                notes.append(f"- {fw} {kind}: {hows[(fw, kind)]}")
    notes += ["- *saved* = activations + weight copies (all that a training forward keeps for backward); "
              "*state* = parameters + gradients + master copies + optimizer state; *total* = state + saved, "
              "the whole training state; the process peak is "
              "the peak resident set of the process the case ran in, shared by the policies timed there."]
    errors = [f"- {r.label}: memory probe failed: {r.memory.error}" for r in measured if r.memory.error]
    return out + notes + errors + [""]


def inference_table(rows: list[Row]) -> list[str]:
    measured = [r for r in display_order(rows) if r.inference.status is not None]
    if not measured:
        return []
    header = ["framework", "workload", "policy", "ms/batch", "speed-up vs fp32", "metric", "Δ vs fp32",
              "parity", "weights MiB", "weights vs fp32", "how"]  # fmt: skip
    body = []
    for r in measured:
        inf = r.inference
        if inf.status != "ok":
            why = f"{inf.status}: {fmt.one_line(inf.error, 80)}"
            body.append([r.framework, r.workload, r.policy, "-", why, "-", "-", "-",
                         fmt.mib(inf.weights_bytes), "-", inf.how or "-"])  # fmt: skip
            continue
        speed = "baseline" if r.is_baseline else fmt.ratio(inf.speedup, inf.speedup_ci95, inf.speedup_rounds)
        metric = f"{inf.metric}={fmt.number(inf.value)}" if inf.value is not None else "-"
        body.append([r.framework, r.workload, r.policy, fmt.number(inf.median_ms, ".3g")
                     + (" (capped)" if inf.capped else ""), speed, metric,
                     fmt.number(inf.delta, ".3g", signed=True), inf.parity, fmt.mib(inf.weights_bytes),
                     fmt.times(inf.weights_ratio), inf.how or "-"])  # fmt: skip
    return _md_table(header, "lllrllllrrl", body) + [""]
