"""The report's rows: one typed :class:`Row` per case, built once from the runner's records.

Every comparison is against the successful float32 case of the same framework, workload and seed
(its *baseline*):

- ``speedup``: the worker's paired ratio (``paired``: the median over the rounds both ran of
  baseline step time / case step time, its bootstrap 95 % interval, its rounds; ``pairing`` says
  how the policies shared the machine); a record without one gets baseline median / case median,
  marked :data:`UNPAIRED`.
- ``loss_delta``: case train loss - baseline train loss at the last step both ran, so a capped run
  is compared where it stopped. ``eval_delta``: case - baseline held-out metric, only when both
  were evaluated after the same number of steps.
- ``parity``: ``"ok"``/``"worse"``/``"n/a"``, on the held-out metric when ``eval_delta`` exists
  (the workload's ``tolerance`` on its ``gap``), else on the train loss at the same step (at most
  :data:`LOSS_TOLERANCE` relative above the baseline's).
- :class:`MemoryUse`: the trainer's byte counts by kind and each one's mixed / float32 ratio;
  :class:`Inference`: forward-only latency per batch, paired against float32's like training,
  the metric through the inference path and the bytes of weights inference reads.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from .workloads import WORKLOADS, workload_class

BASELINE_POLICY = "float32"
LOSS_TOLERANCE = 0.05  # a train loss may be this much (relative) above float32's at the same step
UNPAIRED = "unpaired: ratio of medians taken at different times"
_EPS = 1e-9  # so that a difference exactly at the tolerance counts as within it despite float rounding


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def num(v: float) -> str:
    """A ratio as the report prints it: two decimals, or two significant digits below 0.1."""
    return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.2g}"


def is_slower(v: float | None, ci=None) -> bool:
    """Below 1x as printed, and, for a paired ratio, its whole 95 % interval too."""
    return v is not None and v < 1 and num(v) != "1.00" and (not ci or ci[1] < 1)


def _ratio(case: int | None, base: int | None) -> float | None:
    return case / base if finite(case) and finite(base) and base > 0 else None


@dataclass
class MemoryUse:
    """Bytes a case holds, by kind (``None``: the framework exposes no such figure, ``how`` says why),
    and each kind's ratio over float32's. ``saved`` = activations + weight copies (all a training
    forward keeps for backward); ``state`` = parameters + gradients + master copies + optimizer
    state; ``total`` = state + saved. ``peak_rss_mb`` is the process's peak, shared by every policy
    timed in that process."""

    parameters: int | None = None
    gradients: int | None = None
    master: int | None = None
    optimizer: int | None = None
    activations: int | None = None
    weight_copies: int | None = None
    workspace: int | None = None
    inference_weights: int | None = None
    peak_rss_mb: float | None = None
    how: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    ratios: dict[str, float | None] = field(default_factory=dict)

    RATIO_KINDS = ("activations", "saved", "state", "total", "workspace", "inference_weights")

    @property
    def saved(self) -> int | None:
        if self.activations is None:
            return None
        return self.activations + (self.weight_copies or 0)

    @property
    def state(self) -> int | None:
        parts = (self.parameters, self.gradients, self.master, self.optimizer)
        return None if any(p is None for p in parts) else sum(parts)

    @property
    def total(self) -> int | None:
        """The whole training state: ``state`` + ``saved`` (what one step holds besides scratch)."""
        state, saved = self.state, self.saved
        return None if state is None or saved is None else state + saved

    def value(self, kind: str) -> int | None:
        return getattr(self, kind)

    @classmethod
    def from_record(cls, case: dict) -> MemoryUse:
        mem = case.get("memory") or {}
        known = {f.name for f in fields(cls)} - {"how", "error", "ratios", "peak_rss_mb"}
        return cls(**{k: mem.get(k) for k in known}, peak_rss_mb=case.get("peak_rss_mb"),
                   how=dict(mem.get("how") or {}), error=case.get("memory_error"))  # fmt: skip


@dataclass
class Inference:
    """Forward-only latency per batch in the policy's idiomatic inference form, against float32's."""

    status: str | None = None  # None: not measured (training failed, or an older record)
    error: str | None = None
    how: str | None = None
    batch: int | None = None
    median_ms: float | None = None
    rounds: int = 0
    capped: bool = False
    cap_reason: str | None = None
    speedup: float | None = None
    speedup_ci95: list[float] | None = None
    speedup_rounds: int | None = None
    pairing: str | None = None
    metric: str | None = None
    value: float | None = None
    delta: float | None = None  # value - float32's inference value (same training steps only)
    parity: str = "n/a"
    weights_bytes: int | None = None
    weights_ratio: float | None = None

    @classmethod
    def from_record(cls, case: dict) -> Inference:
        inf = case.get("inference")
        if not isinstance(inf, dict):
            return cls()
        times = [t for t in inf.get("step_times") or [] if finite(t)]
        median = inf.get("median_ms")
        ev = inf.get("eval") or {}
        paired = inf.get("paired") or {}
        return cls(
            status=inf.get("status"), error=inf.get("error"), how=inf.get("how"), batch=inf.get("batch"),
            median_ms=median if finite(median) else (statistics.median(times) * 1e3 if times else None),
            rounds=len(times), capped=bool(inf.get("capped")), cap_reason=inf.get("cap_reason"),
            speedup=paired.get("speedup"), speedup_ci95=paired.get("ci95"),
            speedup_rounds=paired.get("rounds"), pairing=paired.get("pairing"), metric=ev.get("metric"),
            value=ev.get("value") if finite(ev.get("value")) else None,
            weights_bytes=inf.get("weights_bytes"),
        )  # fmt: skip


@dataclass
class Row:
    """One case of the report, with its comparisons against its float32 baseline."""

    framework: str
    workload: str
    policy: str
    seed: int | None = None
    status: str = "failed"
    error: str | None = None
    framework_version: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    baseline: str | None = None  # "torch float32" when the row has one
    # training steps and their timing
    steps: int | None = None
    steps_requested: int | None = None
    capped: bool = False
    cap_reason: str | None = None
    timed_steps: int = 0
    median_step_s: float | None = None
    wall_s: float | None = None
    loadavg_1min: list[float] | None = None
    speedup: float | None = None
    speedup_ci95: list[float] | None = None
    speedup_rounds: int | None = None
    pairing: str | None = None
    roofline_share: dict | None = None
    roofline_peaks: dict | None = None
    # numerics against float32
    final_loss: float | None = None
    loss_delta: float | None = None
    loss_compared_at_step: int | None = None
    eval_metric: str | None = None
    eval_value: float | None = None
    eval_higher_is_better: bool | None = None
    eval_delta: float | None = None
    eval_steps_differ: bool = False
    parity: str = "n/a"
    parity_basis: str | None = None
    parity_diff: float | None = None
    tolerance: float | None = None  # of parity_basis: absolute for an accuracy, relative for a loss
    skipped_steps: int | None = None
    final_scale: float | None = None
    uses_loss_scaling: bool = False
    memory: MemoryUse = field(default_factory=MemoryUse)
    inference: Inference = field(default_factory=Inference)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.framework} {self.workload} {self.policy}"

    @property
    def is_baseline(self) -> bool:
        return self.policy == BASELINE_POLICY

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def slower(self) -> bool:
        """Slower than float32: the speed-up and its whole interval below 1x."""
        return self.ok and not self.is_baseline and is_slower(self.speedup, self.speedup_ci95)

    @property
    def at_parity(self) -> bool:
        """Usable as a result: ran, and not outside the tolerance against float32."""
        return self.ok and self.parity != "worse" and (self.is_baseline or self.baseline is not None)


ROW_KEYS = tuple(f.name for f in fields(Row))


def _median_step(case: dict) -> float | None:
    """The case's median step time: its ``median_step_s``, else the median of its ``step_times``."""
    m = case.get("median_step_s")
    if finite(m):
        return float(m)
    times = [t for t in case.get("step_times") or [] if finite(t)]
    return statistics.median(times) if times else None


def _eval(case: dict) -> tuple[str | None, float | None, bool | None]:
    ev = case.get("eval")
    if not isinstance(ev, dict) or ev.get("value") is None:
        return None, None, None
    return ev.get("metric"), ev.get("value"), bool(ev.get("higher_is_better", False))


def _row(case: dict) -> Row:
    """The case's own fields, before any comparison."""
    losses = list(case.get("losses") or [])
    scales = [s for s in case.get("scales") or [] if finite(s)]
    metric, value, higher = _eval(case)
    steps = case.get("steps")
    versions = case.get("versions") or (
        {case["framework"]: case["framework_version"]} if case.get("framework_version") else {}
    )
    return Row(
        framework=str(case.get("framework")), workload=str(case.get("workload")),
        policy=str(case.get("policy")),
        seed=case.get("seed"), status=case.get("status", "failed"), error=case.get("error"),
        framework_version=case.get("framework_version"), versions=versions,
        steps=steps if steps is not None or not losses else len(losses),
        steps_requested=case.get("steps_requested"), capped=bool(case.get("capped", False)),
        cap_reason=case.get("cap_reason"), timed_steps=len(case.get("step_times") or []),
        median_step_s=_median_step(case), wall_s=case.get("wall_s"), loadavg_1min=case.get("loadavg_1min"),
        roofline_share=case.get("roofline"), roofline_peaks=case.get("roofline_peaks"),
        final_loss=losses[-1] if losses else None, eval_metric=metric, eval_value=value,
        eval_higher_is_better=higher, skipped_steps=case.get("skipped_steps"),
        final_scale=scales[-1] if scales else None, uses_loss_scaling=any(s != 1 for s in scales),
        memory=MemoryUse.from_record(case), inference=Inference.from_record(case),
    )  # fmt: skip


def _gap(workload: str, value: float, base: float, higher: bool) -> float:
    """``Workload.gap`` for a known workload; the same rule from ``higher`` for another."""
    if workload in WORKLOADS:
        return workload_class(workload).gap(value, base)
    if not finite(value):
        return math.inf
    return base - value if higher else (value - base) / max(abs(base), 1e-12)


def _judge(gap: float, tolerance: float) -> str:
    return "ok" if gap <= tolerance + _EPS else "worse"


def _tolerance(workload: str, tolerances: dict[str, float] | None) -> float:
    if tolerances and workload in tolerances:
        return tolerances[workload]
    return workload_class(workload).tolerance if workload in WORKLOADS else LOSS_TOLERANCE


def _compare(row: Row, case: dict, base: dict, base_row: Row, tolerances) -> None:
    """Fill ``row``'s comparisons with its baseline ``base`` (a successful float32 record)."""
    paired = case.get("paired")
    if paired and not row.is_baseline:
        row.speedup, row.speedup_ci95 = paired["speedup"], paired.get("ci95")
        row.speedup_rounds, row.pairing = paired.get("rounds"), paired.get("pairing")
    elif row.median_step_s and base_row.median_step_s:
        row.speedup = base_row.median_step_s / row.median_step_s
        row.pairing = None if row.is_baseline else UNPAIRED
    losses, base_losses = list(case.get("losses") or []), list(base.get("losses") or [])
    n = min(len(losses), len(base_losses))
    if n:
        row.loss_delta = _delta(losses[n - 1], base_losses[n - 1])
        row.loss_compared_at_step = n
        if n < len(losses):
            row.notes.append(f"float32 stopped after {n} steps, this case after {len(losses)}: "
                             f"train loss compared at step {n}")  # fmt: skip
    same_steps = row.steps == base_row.steps
    both = row.eval_value is not None and base_row.eval_value is not None
    if both and row.eval_metric == base_row.eval_metric:
        if same_steps:
            row.eval_delta = row.eval_value - base_row.eval_value
        else:
            row.eval_steps_differ = True
            row.notes.append(f"{row.eval_metric} after {row.steps} step(s) vs float32 after {base_row.steps} "
                             "step(s): not compared")  # fmt: skip
    _compare_memory(row.memory, base_row.memory)
    _compare_inference(row, base_row, same_steps, tolerances)
    if row.is_baseline:
        return
    if row.eval_delta is not None and finite(base_row.eval_value):
        row.tolerance = _tolerance(row.workload, tolerances)
        higher = bool(row.eval_higher_is_better)
        row.parity_diff = _gap(row.workload, row.eval_value, base_row.eval_value, higher)
        row.parity, row.parity_basis = _judge(row.parity_diff, row.tolerance), row.eval_metric
    elif n and finite(base_losses[n - 1]):
        row.tolerance = LOSS_TOLERANCE
        row.parity_diff = _gap("", losses[n - 1], base_losses[n - 1], False)
        row.parity, row.parity_basis = _judge(row.parity_diff, row.tolerance), f"train_loss@step{n}"
    if row.parity_diff is not None and not math.isfinite(row.parity_diff):
        row.parity_diff = None  # a non-finite value: "worse", with no finite gap to print


def _delta(a: Any, b: Any) -> float:
    a = a if finite(a) else math.nan
    return a - b if finite(b) else math.nan


def _compare_memory(mem: MemoryUse, base: MemoryUse) -> None:
    mem.ratios = {kind: _ratio(getattr(mem, kind), getattr(base, kind)) for kind in MemoryUse.RATIO_KINDS}


def _compare_inference(row: Row, base_row: Row, same_steps: bool, tolerances) -> None:
    inf, base = row.inference, base_row.inference
    inf.weights_ratio = _ratio(inf.weights_bytes, base.weights_bytes)
    if inf.speedup is None and not row.is_baseline and inf.median_ms and base.median_ms:
        inf.speedup, inf.pairing = base.median_ms / inf.median_ms, UNPAIRED
    if inf.value is not None and base.value is not None and same_steps and not row.is_baseline:
        inf.delta = inf.value - base.value
        higher = bool(row.eval_higher_is_better)
        gap = _gap(row.workload, inf.value, base.value, higher)
        inf.parity = _judge(gap, _tolerance(row.workload, tolerances))


def summarize(cases: list[dict], tolerances: dict[str, float] | None = None) -> list[Row]:
    """One :class:`Row` per case, in the same order, compared with its float32 baseline (see the
    module docstring). ``tolerances`` overrides a workload's parity tolerance by workload name."""
    rows = [_row(c) for c in cases]
    fp32 = [(c, r) for c, r in zip(cases, rows) if r.is_baseline]
    for case, row in zip(cases, rows):
        candidates = [(c, r) for c, r in fp32 if (r.framework, r.workload) == (row.framework, row.workload)
                      and (r.seed is None or row.seed is None or r.seed == row.seed)]  # fmt: skip
        base = next(((c, r) for c, r in candidates if r.ok), None)
        if base is None:
            why = f"float32 {candidates[0][1].status}" if candidates else "float32 not run"
            row.notes.append(f"no float32 baseline ({why})")
            continue
        row.baseline = f"{row.framework} {BASELINE_POLICY}"
        if row.ok:
            _compare(row, case, *base, tolerances)
    return rows


def display_order(rows: list[Row]) -> list[Row]:
    """Rows grouped by framework and workload (in first-seen order), float32 first within a group."""
    fw_order: dict = {}
    wl_order: dict = {}
    for r in rows:
        fw_order.setdefault(r.framework, len(fw_order))
        wl_order.setdefault(r.workload, len(wl_order))
    indexed = sorted(enumerate(rows), key=lambda ir: (fw_order[ir[1].framework], wl_order[ir[1].workload],
                                                       not ir[1].is_baseline, ir[0]))  # fmt: skip
    return [r for _, r in indexed]
