"""The report's per-step curves: train loss and loss scale of every case, from the raw records."""

from __future__ import annotations

import math

from .plots import WORKLOAD_ORDER, new_figure, note_figure, ordered, policy_colors
from .rows import BASELINE_POLICY, Row, finite


def loss_figure(rows: list[Row], cases: list[dict]):
    """Train loss vs step, one panel per (framework, workload), one line per policy; float32 in black."""
    from matplotlib.lines import Line2D

    if not rows:
        return note_figure("Train loss per step", "No case ran.")
    frameworks = ordered([r.framework for r in rows])
    workloads = ordered([r.workload for r in rows], WORKLOAD_ORDER)
    colors = policy_colors(ordered([r.policy for r in rows]))
    fig = new_figure(max(6.0, 5.0 * len(workloads)), max(3.8, 3.8 * len(frameworks)))
    axes = fig.subplots(max(1, len(frameworks)), max(1, len(workloads)), squeeze=False)
    for i, fw in enumerate(frameworks):
        for j, wl in enumerate(workloads):
            ax = axes[i][j]
            ax.set_title(f"{fw} · {wl}")
            group = [(r, c) for r, c in zip(rows, cases) if (r.framework, r.workload) == (fw, wl)]
            group.sort(key=lambda rc: not rc[0].is_baseline)
            plotted: list[float] = []
            extra = []
            for r, c in group:
                losses = c.get("losses") or []
                pol = r.policy
                if r.status != "ok" or not losses:
                    extra.append(Line2D([], [], ls="none", marker="x", color="gray",
                                        label=f"{pol}: {r.status}"))  # fmt: skip
                    continue
                ys = [y if finite(y) else float("nan") for y in losses]
                xs = list(range(1, len(ys) + 1))
                plotted += [y for y in ys if finite(y)]
                base = pol == BASELINE_POLICY
                label = pol + (
                    f" (capped at {len(ys)}/{r.steps_requested})" if r.capped else ""
                )
                # float32 wide and underneath, so that a policy that tracks it exactly stays visible on top
                ax.plot(xs, ys, color=colors[pol], lw=2.8 if base else 1.4, zorder=2 if base else 3,
                        marker="o" if len(ys) <= 25 else None, ms=3, label=label)  # fmt: skip
                if r.capped:
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


def scale_figure(rows: list[Row], cases: list[dict]):
    """Loss scale vs step (log2 y) for every successful case whose scale is not constantly 1."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    used = [(r, c) for r, c in zip(rows, cases) if r.status == "ok" and r.uses_loss_scaling]
    if not used:
        return note_figure(
            "Loss scale per step", "No case used loss scaling\n(every loss scale was constantly 1)."
        )
    frameworks = ordered([r.framework for r, _ in used])
    colors = policy_colors(ordered([r.policy for r, _ in used]))
    styles = ["-", "--", ":", "-."]
    wl_style = {
        wl: styles[i % 4] for i, wl in enumerate(ordered([r.workload for r, _ in used], WORKLOAD_ORDER))
    }
    wl_marker = dict(zip(wl_style, "os^Dv<>"))
    ncols = min(3, len(frameworks))
    nrows = -(-len(frameworks) // ncols)
    fig = new_figure(max(6.5, 5.5 * ncols), 4.0 * nrows + 0.4)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    for ax in axes[len(frameworks) :]:
        ax.set_axis_off()
    last_step = max(len(c.get("scales") or []) for _, c in used)
    for ax, fw in zip(axes, frameworks):
        for r, c in used:
            if r.framework != fw:
                continue
            ys = [s if finite(s) and s > 0 else float("nan") for s in c.get("scales") or []]
            xs = list(range(1, len(ys) + 1))
            label = f"{r.workload} {r.policy}" + (" (capped)" if r.capped else "")
            marker = wl_marker[r.workload] if len(ys) <= 25 else None
            style = {"color": colors[r.policy], "ls": wl_style[r.workload], "lw": 1.6, "ms": 5}
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
