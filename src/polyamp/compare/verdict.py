"""The verdict: what a reader should take from a compare run, before any table.

Built from the rows only (no framework), in four parts:

- ``best``: per workload, each framework's fastest training configuration among those that ran
  at parity with its float32 (float32 itself included), ranked by median step time, with its
  inference latency, memory ratios and roofline share;
- ``best_vs_best``: per workload, the fastest mixed configuration anywhere against the fastest
  float32 anywhere, for training steps and for inference (different processes, so unpaired: a
  ratio of medians);
- ``compatibility``: framework x policy over the workloads: ``works``, ``works, slower on <workloads>``,
  ``slower than fp32`` (on every workload), ``outside tolerance``, ``unsupported``, ``failed`` or
  ``not installed``, each with a one-line reason
  drawn from the numbers (for a slow dtype, the framework's measured matmul peak of it);
- ``sentences``: plain statements generated from the same numbers, to quote.

A smoke check (``--quick``) gets no speed findings: its sentences say so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import text as fmt
from .rows import BASELINE_POLICY, Row, finite, num

NOT_INSTALLED = "not installed"
SLOW_PEAK = 0.8  # a dtype whose matmul peak is below this share of float32's explains a slow policy


@dataclass
class Best:
    """One framework's fastest configuration at parity on one workload."""

    rank: int
    framework: str
    policy: str
    step_ms: float
    speedup: float | None  # over the framework's own float32 (paired)
    speedup_ci95: list[float] | None
    speedup_rounds: int | None
    parity: str
    infer_policy: str | None  # the framework's fastest inference at parity
    infer_ms: float | None
    infer_speedup: float | None
    activations_ratio: float | None  # of ``policy`` over float32: saved for backward
    state_ratio: float | None  # parameters + gradients + master copies + optimizer state
    roofline_share: float | None


@dataclass
class Pair:
    """The fastest mixed configuration anywhere against the fastest float32 anywhere."""

    mixed: str | None  # "jax bf16-mixed"
    mixed_ms: float | None
    fp32: str | None
    fp32_ms: float | None

    @property
    def ratio(self) -> float | None:
        return self.fp32_ms / self.mixed_ms if self.mixed_ms and self.fp32_ms else None


@dataclass
class Compat:
    framework: str
    policy: str
    verdict: str
    reason: str


@dataclass
class Verdict:
    smoke: bool
    best: dict[str, list[Best]] = field(default_factory=dict)
    training: dict[str, Pair] = field(default_factory=dict)
    inference: dict[str, Pair] = field(default_factory=dict)
    compatibility: list[Compat] = field(default_factory=list)
    sentences: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        for kind in ("training", "inference"):
            for wl, pair in getattr(self, kind).items():
                out[kind][wl]["ratio"] = pair.ratio
        return out


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _best_for(rows: list[Row]) -> Best | None:
    """The fastest row at parity of one (framework, workload), with its fastest inference."""
    timed = [r for r in rows if r.at_parity and finite(r.median_step_s)]
    if not timed:
        return None
    top = min(timed, key=lambda r: r.median_step_s)
    inferred = [r for r in rows if r.ok and r.inference.status == "ok" and finite(r.inference.median_ms)
                and r.inference.parity != "worse"]  # fmt: skip
    fastest = min(inferred, key=lambda r: r.inference.median_ms, default=None)
    share = (top.roofline_share or {}).get("share")
    return Best(
        rank=0, framework=top.framework, policy=top.policy, step_ms=top.median_step_s * 1e3,
        speedup=None if top.is_baseline else top.speedup, speedup_ci95=top.speedup_ci95,
        speedup_rounds=top.speedup_rounds, parity=top.parity,
        infer_policy=fastest.policy if fastest else None,
        infer_ms=fastest.inference.median_ms if fastest else None,
        infer_speedup=(fastest.inference.speedup if fastest and not fastest.is_baseline else None),
        activations_ratio=top.memory.ratios.get("activations"), state_ratio=top.memory.ratios.get("state"),
        roofline_share=share,
    )  # fmt: skip


def _pair(rows: list[Row], seconds) -> Pair:
    """Fastest mixed vs fastest float32 among ``rows`` by ``seconds(row)`` (None: not measured)."""
    timed = [(seconds(r), r) for r in rows if finite(seconds(r))]
    mixed = min(((s, r) for s, r in timed if not r.is_baseline), default=None, key=lambda sr: sr[0])
    fp32 = min(((s, r) for s, r in timed if r.is_baseline), default=None, key=lambda sr: sr[0])
    return Pair(mixed=f"{mixed[1].framework} {mixed[1].policy}" if mixed else None,
                mixed_ms=mixed[0] * 1e3 if mixed else None,
                fp32=f"{fp32[1].framework} float32" if fp32 else None,
                fp32_ms=fp32[0] * 1e3 if fp32 else None)


def _train_seconds(r: Row) -> float | None:
    return r.median_step_s if r.at_parity else None


def _infer_seconds(r: Row) -> float | None:
    inf = r.inference
    usable = r.ok and inf.status == "ok" and inf.parity != "worse"
    return inf.median_ms / 1e3 if usable and finite(inf.median_ms) else None


def _peak_note(rows: list[Row], policy: str) -> str:
    """``torch's fp16 matmul peak here: 12 GFLOP/s against 800 for fp32``, when the peaks show why."""
    from .roofline import SHORT

    dtype = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(policy)
    peaks = next((r.roofline_peaks for r in rows if r.roofline_peaks), None)
    if not dtype or not peaks:
        return ""
    gf = peaks.get("gflops", {})
    if dtype in gf and "float32" in gf and gf[dtype] < SLOW_PEAK * gf["float32"]:
        return (f"; its {SHORT[dtype]} matmul peak here is {gf[dtype]:.0f} GFLOP/s against "
                f"{gf['float32']:.0f} for fp32")  # fmt: skip
    if dtype in peaks.get("errors", {}):
        return f"; its {SHORT[dtype]} matmul fails here: {fmt.one_line(peaks['errors'][dtype], 80)}"
    return ""


def _compat(framework: str, policy: str, rows: list[Row]) -> Compat:
    """One cell of the compatibility matrix: the worst outcome over the workloads, with its reason."""

    def where(rs, show) -> str:
        return ", ".join(f"{show(r)} on {r.workload}" for r in rs)

    def first_error(rs) -> str:
        lines = [line for line in str(rs[0].error or "no error text recorded").splitlines() if line.strip()]
        return fmt.one_line(lines[0], 120)

    statuses = (NOT_INSTALLED, "unsupported", "failed", "timeout")
    by_status = {s: [r for r in rows if r.status == s] for s in statuses}
    if by_status[NOT_INSTALLED]:
        return Compat(framework, policy, NOT_INSTALLED, first_error(by_status[NOT_INSTALLED]))
    if by_status["unsupported"]:
        return Compat(framework, policy, "unsupported", first_error(by_status["unsupported"]))
    if by_status["failed"] or by_status["timeout"]:
        bad = by_status["failed"] + by_status["timeout"]
        return Compat(framework, policy, "failed", f"{bad[0].workload}: {first_error(bad)}")
    worse = [r for r in rows if r.parity == "worse"]
    if worse:
        return Compat(framework, policy, "outside tolerance",
                      "against float32 on " + ", ".join(f"{r.workload} ({r.parity_basis})" for r in worse))
    slower = [r for r in rows if r.slower]
    faster = [r for r in rows if r.ok and finite(r.speedup) and not r.slower]
    if slower:
        reason = where(slower, lambda r: fmt.times(r.speedup))
        if not faster:
            return Compat(framework, policy, "slower than fp32", reason + _peak_note(rows, policy))
        reason += f" (but {where(faster, lambda r: fmt.times(r.speedup))})"
        return Compat(framework, policy, f"works, slower on {', '.join(r.workload for r in slower)}", reason)
    if faster:
        return Compat(framework, policy, "works", where(faster, lambda r: fmt.times(r.speedup)))
    return Compat(framework, policy, "works", "ran; no float32 timing to compare with")


def _change(v: float, ci, rounds: int | None) -> str:
    """``1.34x faster (95 % CI 1.33-1.38, 7 rounds)``; ``0.77x float32's speed: slower (...)``;
    ``0.98x float32's speed: no clear difference (...)`` when the interval holds 1."""
    detail = f" (95 % CI {fmt.interval(ci)}, {rounds} rounds)" if ci else ""
    if ci and ci[0] <= 1 <= ci[1]:
        return f"{num(v)}x float32's speed: no clear difference{detail}"
    return f"{num(v)}x faster{detail}" if v > 1 else f"{num(v)}x float32's speed: slower{detail}"


def basis_words(basis: str) -> str:
    """``train_loss@step9`` -> ``train loss at step 9``; ``heldout_loss`` -> ``heldout loss``."""
    name, _, step = basis.partition("@step")
    return name.replace("_", " ") + (f" at step {step}" if step else "")


def _speed_sentence(r: Row) -> str:
    out = f"On this machine, {fmt.short(r.policy)} on {r.framework} {r.workload}: training step " \
          f"{_change(r.speedup, r.speedup_ci95, r.speedup_rounds)}"  # fmt: skip
    inf = r.inference
    if finite(inf.speedup):
        out += f"; inference {_change(inf.speedup, inf.speedup_ci95, inf.speedup_rounds)}"
    act = r.memory.ratios.get("activations")
    if finite(act):
        out += f"; activations saved for backward {num(act)}x float32's"
    if r.parity == "ok" and r.parity_basis:
        tol = f"{r.tolerance:.0%}" if "loss" in r.parity_basis else f"{r.tolerance:g}"
        out += f"; {basis_words(r.parity_basis)} within {tol} of float32's"
    return out + "."


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{num(lo)}x" if num(lo) == num(hi) else f"{num(lo)}-{num(hi)}x"


def _memory_sentences(rows: list[Row]) -> list[str]:
    """Per mixed policy: the range over frameworks and workloads of activations saved for backward
    and of model state, over float32's: the "half the memory" claim, confirmed or refuted."""
    out = []
    for policy in _ordered(r.policy for r in rows if not r.is_baseline):
        mine = [r for r in rows if r.policy == policy and r.ok]
        parts = []
        for fw in _ordered(r.framework for r in mine):
            acts = [r.memory.ratios["activations"] for r in mine
                    if r.framework == fw and finite(r.memory.ratios.get("activations"))]  # fmt: skip
            if acts:
                parts.append(f"{fw} {_span(acts)}")
        saved = [r.memory.ratios["saved"] for r in mine if finite(r.memory.ratios.get("saved"))]
        states = [r.memory.ratios["state"] for r in mine if finite(r.memory.ratios.get("state"))]
        totals = [r.memory.ratios["total"] for r in mine if finite(r.memory.ratios.get("total"))]
        if parts:
            whole = (f"the whole training state (parameters, gradients, masters, optimizer state and the "
                     f"activations saved for backward) is {_span(totals)} of float32's; "
                     if totals else "")  # fmt: skip
            line = (f"Half the memory? Under {fmt.short(policy)}, {whole}the activations saved for backward "
                    f"are {', '.join(parts)} of float32's (over the workloads)")  # fmt: skip
            if saved:
                line += f"; with the low-precision weight copies saved beside them, {_span(saved)}"
            if states:
                line += f"; parameters, gradients, float32 masters and optimizer state {_span(states)}"
            out.append(line + ".")
    return out


def _sentences(verdict: Verdict, rows: list[Row]) -> list[str]:
    if verdict.smoke:
        return ["Smoke check (--quick): tiny models and a few steps; no speed verdict. Run without --quick."]
    out = []
    for wl, pair in verdict.training.items():
        if pair.ratio is None:
            continue
        inf = verdict.inference.get(wl)
        line = (f"On {wl}, the fastest training at parity is {pair.mixed} at {pair.mixed_ms:.3g} ms per "
                f"step, {num(pair.ratio)}x the fastest float32 ({pair.fp32}, "
                f"{pair.fp32_ms:.3g} ms)")  # fmt: skip
        if inf and inf.ratio is not None:
            line += (f"; the fastest inference is {inf.mixed} at {inf.mixed_ms:.3g} ms per batch, "
                     f"{num(inf.ratio)}x the fastest float32 ({inf.fp32})")  # fmt: skip
        out.append(line + ".")
    for wl, bests in verdict.best.items():
        for b in bests:
            group = [r for r in rows if (r.framework, r.workload) == (b.framework, wl)]
            mixed = [r for r in group if not r.is_baseline and r.at_parity and finite(r.speedup)]
            top = max(mixed, key=lambda r: r.speedup, default=None)
            if top is not None:
                out.append(_speed_sentence(top))
    out += _memory_sentences(rows)
    for c in verdict.compatibility:
        if c.verdict.startswith("works, slower"):
            out.append(f"{fmt.short(c.policy)} on {c.framework} is slower than fp32 on some workloads: "
                       f"{c.reason}.")
        elif c.verdict in ("slower than fp32", "unsupported", "outside tolerance"):
            out.append(f"{fmt.short(c.policy)} on {c.framework} is {c.verdict}: {c.reason}.")
    return out


def build(rows: list[Row], smoke: bool = False) -> Verdict:
    """The verdict of ``rows`` (see the module docstring)."""
    verdict = Verdict(smoke=smoke)
    for wl in _ordered(r.workload for r in rows):
        of_wl = [r for r in rows if r.workload == wl]
        bests = [b for fw in _ordered(r.framework for r in of_wl)
                 if (b := _best_for([r for r in of_wl if r.framework == fw])) is not None]  # fmt: skip
        bests.sort(key=lambda b: b.step_ms)
        for i, b in enumerate(bests, 1):
            b.rank = i
        verdict.best[wl] = bests
        verdict.training[wl] = _pair(of_wl, _train_seconds)
        verdict.inference[wl] = _pair(of_wl, _infer_seconds)
    for fw in _ordered(r.framework for r in rows):
        for policy in _ordered(r.policy for r in rows if r.framework == fw):
            if policy != BASELINE_POLICY:
                group = [r for r in rows if (r.framework, r.policy) == (fw, policy)]
                verdict.compatibility.append(_compat(fw, policy, group))
    verdict.sentences = _sentences(verdict, rows)
    return verdict


def markdown(verdict: Verdict) -> list[str]:
    """The report's first section."""
    out = ["## Verdict", "", "Parity here is a smoke check (one seed, a few steps); "
           "`polyamp compare --converge` decides it over seeds, training to each workload's target.", ""]
    out += [f"- {s}" for s in verdict.sentences] + [""]
    if not verdict.smoke:
        for wl, bests in verdict.best.items():
            if not bests:
                continue
            out += [f"### {wl}: each framework's fastest configuration at parity, ranked", "",
                    "| rank | framework | policy | ms/step | speed-up vs own fp32 | fastest inference | "
                    "activations vs fp32 | state vs fp32 | share of peak |",
                    "|---:|---|---|---:|---|---|---:|---:|---:|"]  # fmt: skip
            for b in bests:
                infer = "-"
                if b.infer_ms:
                    gain = f" ({fmt.times(b.infer_speedup)})" if b.infer_speedup else ""
                    infer = f"{fmt.short(b.infer_policy)} {b.infer_ms:.3g} ms{gain}"
                share = f"{b.roofline_share:.0%}" if finite(b.roofline_share) else "-"
                speed = "baseline" if b.policy == BASELINE_POLICY else fmt.ratio(b.speedup, b.speedup_ci95,
                                                                                  b.speedup_rounds)
                out.append(f"| {b.rank} | {b.framework} | {b.policy} | {b.step_ms:.3g} | {speed} | {infer} | "
                           f"{fmt.times(b.activations_ratio)} | {fmt.times(b.state_ratio)} | {share} |")
            t, i = verdict.training[wl], verdict.inference[wl]
            if t.ratio is not None:
                out += ["", f"Best against best (unpaired: different processes): training {t.mixed} "
                        f"{t.mixed_ms:.3g} ms vs {t.fp32} {t.fp32_ms:.3g} ms = {num(t.ratio)}x"
                        + (f"; inference {i.mixed} {i.mixed_ms:.3g} ms vs {i.fp32} {i.fp32_ms:.3g} ms = "
                           f"{num(i.ratio)}x" if i.ratio is not None else "") + "."]  # fmt: skip
            out.append("")
    if verdict.compatibility:
        policies = _ordered(c.policy for c in verdict.compatibility)
        out += ["### Compatibility: framework x policy", "",
                "| framework | " + " | ".join(policies) + " |", "|---" * (len(policies) + 1) + "|"]
        for fw in _ordered(c.framework for c in verdict.compatibility):
            mine = [c for c in verdict.compatibility if c.framework == fw]
            cells = {c.policy: f"**{c.verdict}**: {c.reason}" for c in mine}
            out.append(f"| {fw} | " + " | ".join(fmt.md_cell(cells.get(p, "-")) for p in policies) + " |")
        out.append("")
    return out
