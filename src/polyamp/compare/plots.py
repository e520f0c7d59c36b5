"""The report's bar charts: training speed-up, inference latency, memory ratios, roofline shares.

Each chart has one panel per workload, a group of bars per framework and one bar per policy, in the
same colours everywhere (float32 black). A bar that cannot be drawn says why at its foot (the case's
status, "no fp32", "not measured"). Figures are ``matplotlib.figure.Figure`` on an Agg canvas: no
pyplot, no display, matplotlib imported only when a figure is drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import text as fmt
from .rows import BASELINE_POLICY, Row, finite, num

WORKLOAD_ORDER = ("mlp", "charlm", "digits")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
RC = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9, "xtick.labelsize": 9,
      "ytick.labelsize": 9, "figure.titlesize": 12}  # fmt: skip


def ordered(values, preferred=()) -> list:
    seen = list(dict.fromkeys(values))
    rank = {v: preferred.index(v) if v in preferred else len(preferred) for v in seen}
    return sorted(seen, key=lambda v: (rank[v], seen.index(v)))


def policy_colors(policies) -> dict:
    colors = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(p for p in policies if p != BASELINE_POLICY)}
    colors[BASELINE_POLICY] = "black"
    return colors


def new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def note_figure(title: str, note: str):
    """A small figure that says, centred, why there is nothing to draw."""
    fig = new_figure(8.0, 3.0)
    ax = fig.subplots()
    ax.set_axis_off()
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=12)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


@dataclass
class Bars:
    """What one bar chart shows: per row a value (None: say ``missing(row)`` instead), its interval
    and its label; ``base`` is where bars start (1 for ratios), ``log`` the y scale."""

    title: str
    ylabel: str
    value: Callable[[Row], float | None]
    label: Callable[[Row], str]
    missing: Callable[[Row], str]
    interval: Callable[[Row], list[float] | None] = lambda r: None
    base: float = 0.0
    log: bool = False
    lines: tuple[tuple[float, str], ...] = ()  # reference lines (y, label); the first drawn solid
    baseline_bars: bool = True  # whether float32 gets a bar
    capped: Callable[[Row], bool] = lambda r: r.capped  # drawn hatched


def bar_chart(rows: list[Row], *specs: Bars, title: str | None = None):
    """One row of panels per spec, one panel per workload, frameworks along x, a bar per policy."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = [r for r in rows if specs[0].baseline_bars or not r.is_baseline]
    if not rows:
        return note_figure(title or specs[0].title, "No case to draw.")
    workloads = ordered([r.workload for r in rows], WORKLOAD_ORDER)
    policies = ordered([r.policy for r in rows])
    colors = policy_colors(policies)
    panels = [(wl, ordered(r.framework for r in rows if r.workload == wl)) for wl in workloads]
    widths = [max(3.6, 0.5 * len(fws) * len(policies) + 1.6) for _, fws in panels]
    fig = new_figure(min(max(8.0, sum(widths) + 1.0), 18.0), 4.6 * len(specs) + 0.8)
    grid = fig.subplots(len(specs), len(panels), squeeze=False, gridspec_kw={"width_ratios": widths})
    for spec, axes in zip(specs, grid):
        _draw(axes, rows, spec, panels, policies, colors)
    handles = [Patch(color=colors[p], label=p) for p in policies]
    handles += [Line2D([], [], label=name, **_line_style(i)) for i, (_, name) in enumerate(specs[0].lines)]
    if any(spec.capped(r) for spec in specs for r in rows):
        handles.append(Patch(facecolor="0.6", hatch="//", edgecolor="white", label="capped run"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(title or specs[0].title)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1 - 0.55 / height))
    return fig


def _draw(axes, rows: list[Row], spec: Bars, panels, policies, colors) -> None:
    values = [v for r in rows if finite(v := spec.value(r)) and (v > 0 or not spec.log)]
    if spec.log:
        lo, hi = min(values + [spec.base or 1.0]) / 4, max(values + [spec.base or 1.0]) * 4
    else:
        lo, hi = 0.0, max(values + [1.0]) * 1.25
    width = 0.8 / len(policies)
    for ax, (wl, fws) in zip(axes, panels):
        if spec.log:
            ax.set_yscale("log")
        ax.set_ylim(lo, hi)
        for i, (y, _) in enumerate(spec.lines):
            ax.axhline(y, zorder=1, **_line_style(i))
        for i, fw in enumerate(fws):
            for j, pol in enumerate(policies):
                match = [r for r in rows if (r.workload, r.framework, r.policy) == (wl, fw, pol)]
                if match:
                    _bar(ax, match[0], spec, i - 0.4 + width * (j + 0.5), width, colors[pol], lo, hi,
                         rotate=len(policies) > 2)  # fmt: skip
        ax.set_xticks(range(len(fws)))
        ax.set_xticklabels(fws)
        ax.set_xlim(-0.6, len(fws) - 0.4)
        ax.set_title(wl)
        ax.grid(axis="y", color="0.88", lw=0.8, zorder=0)
        if spec.log:
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
    axes[0].set_ylabel(spec.ylabel)


def _line_style(i: int) -> dict:
    """The first reference line (float32, or the peak) solid black, the others dashed grey."""
    return {"color": "black", "lw": 1.2, "ls": "-"} if i == 0 else {"color": "0.45", "lw": 0.9, "ls": "--"}


def _bar(ax, r: Row, spec: Bars, x: float, width: float, color: str, lo: float, hi: float,
         rotate: bool) -> None:  # fmt: skip
    v = spec.value(r)
    if not finite(v) or (spec.log and v <= 0):
        foot = lo * 1.3 if spec.log else hi * 0.02
        ax.text(x, foot, spec.missing(r), rotation=90, ha="center", va="bottom", fontsize=8, color="dimgray")
        return
    hatch = "//" if spec.capped(r) else None
    ax.bar(x, v - spec.base, bottom=spec.base, width=width * 0.9, color=color, hatch=hatch,
           edgecolor="white" if hatch else color, zorder=2)  # fmt: skip
    ci = spec.interval(r)
    if ci:
        ax.errorbar(x, v, yerr=[[max(v - ci[0], 0)], [max(ci[1] - v, 0)]], fmt="none", ecolor="black",
                    elinewidth=1, capsize=3, zorder=3)  # fmt: skip
    up = v >= spec.base
    ax.annotate(spec.label(r), (x, (ci[1] if up else ci[0]) if ci else v), xytext=(0, 3 if up else -3),
                textcoords="offset points", ha="center", va="bottom" if up else "top", fontsize=8,
                rotation=90 if rotate else 0)  # fmt: skip


def _why(r: Row) -> str:
    return r.status if not r.ok else "no fp32" if r.baseline is None else "not measured"


def _speedup_label(r: Row) -> str:
    rounds = "" if r.speedup_rounds is None else f" n={r.speedup_rounds}"
    return f"{num(r.speedup)}x{rounds}" + ("\nparity: worse" if r.parity == "worse" else "")


def speedup_figure(rows: list[Row], smoke: bool = False):
    title = ("Training speed-up over float32: a smoke check (--quick), not a measurement" if smoke else
             "Training speed-up over float32: median of the paired per-round ratios\n"
             "(bar: 95% interval, n = rounds; above the line = faster)")  # fmt: skip
    return bar_chart(rows, Bars(
        title=title, ylabel="speed-up over float32 of the same framework\n(log scale)",
        value=lambda r: r.speedup if r.ok else None, interval=lambda r: r.speedup_ci95,
        label=_speedup_label,
        missing=_why, base=1.0, log=True, lines=((1.0, "float32 = 1x"),), baseline_bars=False,
    ))  # fmt: skip


def inference_figure(rows: list[Row], smoke: bool = False):
    def label(r: Row) -> str:
        inf = r.inference
        ratio = "" if r.is_baseline or not finite(inf.speedup) else f" {num(inf.speedup)}x"
        return f"{inf.median_ms:.3g} ms{ratio}"

    def missing(r: Row) -> str:
        return r.inference.status or "not measured"

    title = "Inference latency per batch (forward only, the policy's inference form)" + (
        ": a smoke check" if smoke else "\nlabels: ms and speed-up over float32 (paired); lower = faster")
    return bar_chart(rows, Bars(
        title=title, ylabel="ms per batch (log scale)", log=True, label=label, missing=missing,
        value=lambda r: r.inference.median_ms if r.inference.status == "ok" else None,
        capped=lambda r: r.inference.capped,
    ))  # fmt: skip


def memory_figure(rows: list[Row]):
    """Three rows of panels: the whole training state, bytes saved for backward, then model state, each
    over float32's."""
    mixed = [r for r in rows if not r.is_baseline and r.ok]
    if not any(finite(r.memory.ratios.get("saved")) or finite(r.memory.ratios.get("state")) for r in mixed):
        why = "No memory ratio was measured\n(no float32 baseline, or no probe)."
        return note_figure("Memory over float32", why)
    specs = [Bars(title=f"{what} / float32's", ylabel=f"{kind}: {what}\n/ float32's", log=False,
                  value=lambda r, k=kind: r.memory.ratios.get(k),
                  label=lambda r, k=kind: fmt.times(r.memory.ratios.get(k)),
                  missing=lambda r: "n/a", lines=((1.0, "float32"), (0.5, "half")), base=0.0)
             for kind, what in (("total", "whole training state"), ("saved", "saved for backward"),
                                ("state", "params+grads+masters+optimizer"))]  # fmt: skip
    return bar_chart(mixed, *specs, title="Memory that precision changes, mixed / float32 "
                     "(top: the total; then saved for backward; bottom: model state; dashed: half)")


def roofline_figure(rows: list[Row]):
    def share(r: Row):
        s = (r.roofline_share or {}).get("share")
        return s * 100 if finite(s) else None

    if not any(share(r) is not None for r in rows):
        return note_figure("Share of the machine's matmul peak", "No roofline was measured (a --quick run?).")
    return bar_chart(rows, Bars(
        title="Achieved matmul GFLOP/s per step, as a share of the framework's measured peak for the "
              "compute dtype", ylabel="% of peak", log=False, value=share, label=lambda r: f"{share(r):.0f}%",
        missing=lambda r: "n/a" if r.ok else r.status, lines=((100.0, "peak"),),
    ))  # fmt: skip
