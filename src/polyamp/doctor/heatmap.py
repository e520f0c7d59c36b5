"""The doctor's picture: layers x log2 magnitude, one panel per tensor kind, each format's ranges as bands.

A cell's colour is the share of that layer's tensor elements in that octave (log colour scale; zeros and
non-finite elements are not drawn). Above each panel one strip per format shows where a value lands when
cast: flushed to zero (grey), subnormal (yellow), normal (green), overflow (red). In the gradient panels
the strips of a loss-scaled format (fp16, e5m2) are drawn at the report's recommended loss scale S (a
gradient g is cast as S * g, so the ranges move down by log2 S). The update panel bins |update| / 2^b(w)
and marks each format's lost-update edge 2^-(M+1): an update left of it leaves its weight unchanged.
matplotlib is imported only here; without it ``heatmap`` returns None.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..numerics import get_format
from .histogram import B_MIN, N_BINS, SUB

PANELS = (("output", "forward output"), ("grad_output", "gradient w.r.t. output"), ("weight", "weight"),
          ("grad_weight", "weight gradient"))  # fmt: skip
BAND_COLORS = {"flush": "#bdbdbd", "subnormal": "#fdd835", "normal": "#66bb6a", "overflow": "#e53935"}
SCALED = ("fp16", "e5m2")


def octaves(counts: np.ndarray) -> np.ndarray:
    """Counts per octave b = B_MIN - 1 (below) .. B_MAX + 1 (above): SUB sub-bins summed."""
    inner = counts[1 : N_BINS - 1].reshape(-1, SUB).sum(axis=1)
    return np.concatenate([[counts[0]], inner, [counts[-1]]])


def bands(fmt_name: str, shift: float = 0.0) -> list[tuple[str, float, float]]:
    """(region, log2 lo, log2 hi) of a format's cast, moved by ``shift`` octaves."""
    f = get_format(fmt_name)
    sub_lo = math.log2(f.smallest_positive) if f.has_zero else math.log2(f.min_normal)
    normal, top = math.log2(f.min_normal), math.log2(f.max)
    edges = [("flush", -1e9, sub_lo - 1), ("subnormal", sub_lo - 1, normal), ("normal", normal, top),
             ("overflow", top, 1e9)]  # fmt: skip
    return [(name, lo + shift, hi + shift) for name, lo, hi in edges if hi > lo]


def heatmap(report, path: str | Path) -> Path | None:
    """Draw the report's heat map into ``path`` (PNG); None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LogNorm
        from matplotlib.figure import Figure
    except ImportError:
        return None
    layers = list(report.layers)
    table = {(ob.layer, ob.kind): ob.hist for ob in report.observations}
    panels = [(k, t) for k, t in PANELS if any((la, k) for la in layers if (la, k) in table)]
    has_updates = any((la, "update_ratio") in table for la in layers)
    grid = {kind: _grid(table, layers, kind) for kind, _ in panels}
    lo, hi = _x_range([g for g in grid.values()], report.formats)
    ncols = len(panels) + has_updates
    height = 1.6 + 0.24 * len(layers) + 0.22 * len(report.formats)
    fig = Figure(figsize=(3.6 * ncols + 1.2, max(height, 3.5)), dpi=110)
    FigureCanvasAgg(fig)
    n_strips = len(report.formats)
    ratios = [0.22 * max(n_strips, 1), 0.24 * max(len(layers), 4)]
    axes = fig.subplots(2, ncols, squeeze=False, gridspec_kw={"height_ratios": ratios})
    norm = LogNorm(vmin=1e-4, vmax=1.0)
    image = None
    scale = report.initial_scale
    for col, (kind, title) in enumerate(panels):
        shift = -math.log2(scale) if (scale and kind.startswith("grad")) else 0.0
        _strips(axes[0, col], report.formats, lo, hi, shift, col == 0)
        scaled = [f for f in report.formats if f in SCALED]
        if shift and scaled:
            title += f"\n({', '.join(scaled)} strips at loss scale {_pow2(scale)})"
        axes[0, col].set_title(title, fontsize=9)
        image = _cells(axes[1, col], grid[kind], layers, lo, hi, norm)
        axes[1, col].set_xlabel("log2 |x|")
    if has_updates:
        col = len(panels)
        g = _grid(table, layers, "update_ratio")
        ulo, uhi = _x_range([g], ())
        ulo = min(ulo, -12)
        axes[0, col].set_axis_off()
        axes[0, col].set_title("update / 2^binade(weight)", fontsize=10)
        image = _cells(axes[1, col], g, layers, ulo, uhi, norm)
        for i, name in enumerate(report.formats):
            edge = -(get_format(name).mbits + 1)
            if ulo < edge < uhi:
                label = f"{name}: lost left of 2^{edge}"
                axes[1, col].axvline(edge, color=f"C{i}", lw=1.2, ls="--", label=label)
        axes[1, col].legend(loc="lower right", fontsize=7)
        axes[1, col].set_xlabel("log2 ratio")
    for col in range(ncols):
        axes[1, col].set_yticks(range(len(layers)))
        axes[1, col].set_yticklabels(layers if col == 0 else [], fontsize=8)
    if image is not None:
        cb = fig.colorbar(image, ax=axes[1, :].tolist(), fraction=0.02, pad=0.01)
        cb.set_label("share of the layer's elements")
    handles = [_patch(c, n) for n, c in BAND_COLORS.items()]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"polyamp doctor — {report.framework}, {report.model}: recommends {report.policy}",
                 x=0.01, ha="left", fontsize=11)  # fmt: skip
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path


def _grid(table, layers, kind) -> np.ndarray:
    """Per layer the share of its elements in each octave (NaN where the layer has no such tensor)."""
    rows = []
    for layer in layers:
        h = table.get((layer, kind))
        if h is None or not h.total:
            rows.append(np.full(N_BINS // SUB + 2, np.nan))
        else:
            rows.append(octaves(np.asarray(h.counts)) / h.total)
    return np.array(rows)


def _x_range(grids, formats) -> tuple[int, int]:
    """Octaves holding data, two either side, widened to fp16's range when it is a candidate."""
    used = [i for g in grids for i in np.nonzero(np.nan_to_num(g).sum(axis=0))[0]]
    lo = min(used, default=-B_MIN - 24) + B_MIN - 1 - 2
    hi = max(used, default=-B_MIN + 16) + B_MIN - 1 + 3
    if "fp16" in formats:
        lo, hi = min(lo, -26), max(hi, 17)
    return max(lo, B_MIN - 1), min(hi, 129)


def _cells(ax, grid, layers, lo, hi, norm):
    first = lo - (B_MIN - 1)
    data = grid[:, first : first + (hi - lo)]
    masked = np.ma.masked_where(~(data > 0), data)
    img = ax.imshow(masked, aspect="auto", cmap="magma_r", norm=norm, interpolation="nearest",
                    extent=(lo, hi, len(layers) - 0.5, -0.5))  # fmt: skip
    ax.set_facecolor("#f7f7f7")
    ax.grid(axis="x", color="white", lw=0.5)
    return img


def _strips(ax, formats, lo, hi, shift, labels) -> None:
    if not formats:  # only measured formats (blocks.py): no strip to draw
        ax.set_axis_off()
        return
    for row, name in enumerate(formats):
        s = shift if name in SCALED else 0.0
        for region, a, b in bands(name, s):
            a, b = max(a, lo), min(b, hi)
            if b > a:
                ax.barh(row, b - a, left=a, height=0.8, color=BAND_COLORS[region], edgecolor="none")
    ax.set_xlim(lo, hi)
    ax.set_ylim(len(formats) - 0.5, -0.5)
    ax.set_yticks(range(len(formats)))
    ax.set_yticklabels(formats if labels else [], fontsize=7)
    ax.tick_params(axis="x", labelbottom=False)


def _patch(color, label):
    from matplotlib.patches import Patch

    return Patch(color=color, label=label)


def _pow2(scale) -> str:
    m, e = math.frexp(scale)
    return f"2^{e - 1}" if m == 0.5 else f"{scale:g}"
