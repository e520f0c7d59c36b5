"""From per-layer x tensor-kind histograms to a policy, a loss scale, layers to keep in fp32, master weights.

Rules (the thresholds are the named constants below, each with its reason):

1. Non-finite first: if any observed tensor holds inf/NaN in the fp32 run, the policy is "float32" and the
   report names the first one in the order a step creates them: weights (layer order), outputs (layer
   order), output gradients and weight gradients (reverse layer order: the backward pass), updates.
2. Each mixed policy is checked in its format (fp16-mixed: fp16 with a loss scale; bf16-mixed: bf16, no
   scale), in this order, per layer:
   - forward: an output or weight whose max exceeds OUTPUT_MARGIN * max finite -> keep that layer in fp32;
   - loss scale (fp16): the largest power of two S with S * (largest gradient) <= LOSS_SCALE_MARGIN * max,
     capped at MAX_LOSS_SCALE, over every output gradient and the weight gradients of layers not kept
     (a kept layer computes its weight gradient in fp32; its output gradient comes from the next layer);
   - a layer whose gradients (output and weight together) flush to zero beyond GRAD_UNDERFLOW_MAX at S,
     each predicted with the rounding noise of a backward pass in the format (``chain.py``);
   - updates: lost (``predict.lost_updates``) in weights stored in the policy's format; fp32 master
     weights are needed when the model-wide lost fraction or any layer's is past LOST_UPDATES_MAX (a
     mixed policy keeps them anyway: this says whether its "-true" form, low-precision weights, would
     train). Lost updates keep no layer in fp32: keep_fp32 changes where a layer computes, not where
     its weights are stored.
   A check is feasible when it keeps fewer than all layers and at most max(1, MAX_KEEP_FRACTION * layers).
3. The policy is fp16-mixed when feasible (3 more mantissa bits than bf16), else bf16-mixed when feasible
   (float32's range, no loss scale), else float32. Where the training's framework and device run fp16
   slower than float32 or not at all (``fp16_slow``: the facts its front end warns or refuses with) and
   bf16-mixed fits too, bf16-mixed is chosen, and the reason says why. (bf16 reaches lower than fp16 at
   any loss scale and overflows only where float32 does, so where fp16 fits, bf16 in practice fits too.)
4. For memory, bf16 weights and low moments (``state_advice``): per layer the weight update (``nearest``,
   ``sr``, ``kahan`` or float32 ``master`` weights) from its update ratios and the moments' form (``int8``
   or ``bf16``) from its weight gradients; ``Recommendation.low_precision`` is the policy of the strictest
   layer, e.g. ``bf16-true:sr,states=int8``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from ..errors import PolyampError, invalid
from ..numerics import FloatFormat, get_format
from . import state_advice
from .chain import gradient_predictions
from .histogram import LogHistogram
from .predict import lost_updates, predict
from .text import pow2

KINDS = ("output", "grad_output", "weight", "grad_weight", "update_ratio")
GRAD_KINDS = ("grad_output", "grad_weight")

LOSS_SCALE_MARGIN = 0.5  # later batches' gradients run larger; one halving is dynamic scaling's step
OUTPUT_MARGIN = 0.5  # an activation within 2x of the format's max overflows on a slightly larger input
MAX_LOSS_SCALE = 2.0**24  # above torch's 2^16 and Keras' 2^15 defaults; more means gradients fp16 cannot hold
DEFAULT_LOSS_SCALE = 2.0**16  # torch's GradScaler default, when no non-zero gradient was observed
GRAD_UNDERFLOW_MAX = 0.05  # a layer with over 5% of its gradient flushed to 0 learns from a thinned one
LOST_UPDATES_MAX = 0.05  # a step that cannot move over 5% of the weights drifts from (or stalls against) fp32
MAX_KEEP_FRACTION = 0.25  # over a quarter of the layers in fp32 leaves little to gain from mixed precision


# (framework, device type) -> why fp16-mixed is no choice there: the fact its front end acts on (torch
# warns at fp16 autocast on a CPU: torch/ops.py; MXNet refuses fp16-mixed on a CPU: mxnet/ops.py)
FP16_SLOW = {
    ("torch", "cpu"): "torch warns at fp16 autocast on a CPU: most CPUs have no float16 arithmetic, and "
    "torch's CPU float16 matmuls can then be much slower than float32 (docs/BENCHMARKS.md: 0.01x-0.3x)",
    ("mxnet", "cpu"): "MXNet cannot run fp16-mixed on a CPU (its float16 FullyConnected exists only in the "
    "cuDNN build; polyamp refuses it there)",
}


def fp16_slow(framework: str | None, device: str | None) -> str | None:
    """Why fp16-mixed is slow or refused for ``framework`` on ``device`` ("cpu", "cuda:0", ...), else
    None (no such fact: the choice rests on the numerics alone)."""
    kind = device.split(":")[0].strip().lower() if isinstance(device, str) else None
    kind = "cpu" if kind and kind.startswith("cpu") else kind  # MXNet's cpu_pinned, cpu_shared
    return FP16_SLOW.get((framework, kind))


@dataclass(frozen=True)
class Observation:
    """One tapped tensor: ``kind`` in KINDS; repeated (layer, kind) pairs are merged. ``measured``: the
    block-format / recipe statistics of its elements by label (``blocks.py``), when any were asked."""

    layer: str
    kind: str
    hist: LogHistogram
    measured: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.layer, str) or not self.layer:
            raise PolyampError(f"layer must be a non-empty string, got {self.layer!r}")
        if self.kind not in KINDS:
            raise invalid("tensor kind", self.kind, KINDS)
        if not isinstance(self.hist, LogHistogram):
            raise PolyampError(f"hist must be a LogHistogram, got {type(self.hist).__name__}")


@dataclass(frozen=True)
class Finding:
    """One problem: ``problem`` in overflow | underflow | lost_updates | nonfinite; ``line`` says it."""

    layer: str
    kind: str
    format: str
    problem: str
    fraction: float
    line: str


@dataclass(frozen=True)
class PolicyCheck:
    """One candidate policy checked against the observations."""

    policy: str
    format: str
    feasible: bool
    keep_fp32: dict[str, str]  # layer -> reason, in layer order
    loss_scale: float | None
    loss_scale_reason: str
    gradient_underflow: float | None  # model-wide fraction of gradient elements flushed at loss_scale
    master_weights: bool
    master_weights_reason: str
    findings: tuple[Finding, ...]
    weight_update: str | None = None  # state_advice.update_rule of the strictest layer (None: no update seen)
    weight_update_layers: dict[str, str] = field(default_factory=dict)
    weight_update_reason: str = ""
    states: str | None = None  # state_advice.states_form of the strictest layer (None: no gradient seen)
    states_reason: str = ""


@dataclass(frozen=True)
class Recommendation:
    """What to run; ``line()`` is the one-line summary, ``to_json()`` the whole record."""

    policy: str
    reason: str
    loss_scale: float | None = None
    loss_scale_reason: str = ""
    gradient_underflow: float | None = None
    keep_fp32: tuple[str, ...] = ()
    keep_fp32_reasons: dict[str, str] = field(default_factory=dict)
    master_weights: bool = True
    master_weights_reason: str = ""
    nonfinite: Finding | None = None
    findings: tuple[Finding, ...] = ()
    checks: dict[str, PolicyCheck] = field(default_factory=dict)
    fp16_slow: str | None = None  # why fp16-mixed was not chosen on this framework and device (rule 3)

    @property
    def low_precision(self) -> str | None:
        """The policy that stores weights and moments low (``bf16-true:sr,states=int8``, rule 4), or None
        when the weights need float32 masters or no update was observed."""
        check = self.checks.get("bf16-mixed")
        if check is None or check.weight_update in (None, "master"):
            return None
        options = [check.weight_update] if check.weight_update != "nearest" else []
        options += [f"states={check.states}"] if check.states else []
        return "bf16-true" + (":" + ",".join(options) if options else "")

    def line(self) -> str:
        return f"{self.policy}: {self.reason}"

    def to_json(self) -> dict:
        return {**asdict(self), "low_precision": self.low_precision}


def recommend(observations: Iterable[Observation], *, slow_fp16: str | None = None) -> Recommendation:
    """The recommendation for a model from its observations (module docstring for the rules);
    ``slow_fp16``: why fp16-mixed is slow or refused where the model will train (``fp16_slow``), if it is."""
    table = layer_table(observations)
    layers = list(table)
    bad = _first_nonfinite(table, layers)
    if bad is not None:
        return Recommendation(
            policy="float32",
            reason=f"the model is already non-finite in float32: {bad.line}; fix that "
            "first (no lower precision can help)",
            master_weights=False,
            master_weights_reason="float32 trains its weights directly",
            nonfinite=bad,
            findings=(bad,),
        )
    checks = {
        c.policy: c
        for c in (
            _check(table, "fp16-mixed", get_format("fp16"), True),
            _check(table, "bf16-mixed", get_format("bf16"), False),
        )
    }
    fp16, bf16 = checks["fp16-mixed"], checks["bf16-mixed"]
    n = len(layers)
    if fp16.feasible and bf16.feasible and slow_fp16:
        kept = f"{len(bf16.keep_fp32)} of {n} layers" if bf16.keep_fp32 else "no layer"
        reason = (f"fp16-mixed fits (loss scale {pow2(fp16.loss_scale)}) but is no choice here: "
                  f"{slow_fp16}; bf16 fits too, with float32's range and no loss scale, {kept} kept in "
                  "fp32")  # fmt: skip
        return _chosen(bf16, reason, checks, slow_fp16)
    if fp16.feasible:
        kept = (
            f"{len(fp16.keep_fp32)} of {n} layers kept in fp32" if fp16.keep_fp32 else "no layer kept in fp32"
        )
        chosen, reason = (
            fp16,
            (
                f"fits fp16 at loss scale {pow2(fp16.loss_scale)} ({_pct(fp16.gradient_underflow)} "
                f"of gradient elements flush to zero), {kept}"
                + (f"; bf16 does not fit, though fp16 is slow here: {slow_fp16}" if slow_fp16 else "")
            ),
        )
    elif bf16.feasible:
        chosen, reason = (
            bf16,
            f"fp16 would need {_why(fp16, n)}; bf16 has float32's range and needs no loss scale",
        )
    else:
        return Recommendation(
            policy="float32",
            reason=f"fp16 would need {_why(fp16, n)}; bf16 would need {_why(bf16, n)}",
            master_weights=False,
            master_weights_reason="float32 trains its weights directly",
            findings=fp16.findings + bf16.findings,
            checks=checks,
        )
    return _chosen(chosen, reason, checks)


def _chosen(chosen: PolicyCheck, reason: str, checks: dict[str, PolicyCheck], slow_fp16: str | None = None
            ) -> Recommendation:  # fmt: skip
    return Recommendation(
        policy=chosen.policy,
        reason=reason,
        loss_scale=chosen.loss_scale,
        loss_scale_reason=chosen.loss_scale_reason,
        gradient_underflow=chosen.gradient_underflow,
        keep_fp32=tuple(chosen.keep_fp32),
        keep_fp32_reasons=dict(chosen.keep_fp32),
        master_weights=chosen.master_weights,
        master_weights_reason=chosen.master_weights_reason,
        findings=chosen.findings,
        checks=checks,
        fp16_slow=slow_fp16,
    )


def layer_table(observations) -> dict[str, dict[str, LogHistogram]]:
    """layer -> kind -> histogram (repeated pairs merged), layers in the observations' order."""
    if isinstance(observations, Observation) or not isinstance(observations, Iterable):
        raise PolyampError(f"expected a sequence of Observation, got {type(observations).__name__}")
    table: dict[str, dict[str, LogHistogram]] = {}
    for ob in observations:
        if not isinstance(ob, Observation):
            raise PolyampError(f"expected Observation(layer, kind, hist), got {type(ob).__name__}")
        kinds = table.setdefault(ob.layer, {})
        kinds[ob.kind] = kinds[ob.kind].merge(ob.hist) if ob.kind in kinds else ob.hist
    if not table:
        raise PolyampError("no observations: expected at least one Observation(layer, kind, hist)")
    return table


def _first_nonfinite(table, layers) -> Finding | None:
    back = layers[::-1]
    for kind, order in (
        ("weight", layers),
        ("output", layers),
        ("grad_output", back),
        ("grad_weight", back),
        ("update_ratio", layers),
    ):
        for layer in order:
            h = table[layer].get(kind)
            if h is not None and h.nonfinite:
                line = f"layer {layer!r} {kind} has {h.nonfinite} non-finite of {h.total} elements"
                return Finding(layer, kind, "fp32", "nonfinite", h.nonfinite / h.total, line)
    return None


def _check(table, policy: str, fmt: FloatFormat, scaled: bool) -> PolicyCheck:
    layers, keep, findings = list(table), {}, []

    def flag(layer, kind, problem, fraction, line):
        findings.append(Finding(layer, kind, fmt.name, problem, fraction, line))
        keep.setdefault(layer, line)

    limit = OUTPUT_MARGIN * fmt.max
    for layer in layers:
        for kind in ("output", "weight"):
            h = table[layer].get(kind)
            if h is not None and h.total and h.amax > limit:
                p = predict(h, fmt)
                what = (
                    f"overflows {fmt.name} ({_pct(p.overflow)} of elements"
                    if p.any_overflow
                    else f"is within {1 / OUTPUT_MARGIN:g}x of {fmt.name}'s max ({fmt.max:g}"
                )
                flag(layer, kind, "overflow", p.overflow, f"{kind} {what}, max {h.amax:.3g})")
    grads = [
        h
        for layer in layers
        for kind, h in table[layer].items()
        if kind == "grad_output" or (kind == "grad_weight" and layer not in keep)
    ]
    scale, scale_reason = _loss_scale(max((h.amax for h in grads), default=0.0), fmt, scaled)
    preds = gradient_predictions(table, fmt, scale)
    for layer in layers:
        flush = _flushed([preds[layer, k] for k in GRAD_KINDS if (layer, k) in preds])
        if flush is not None and flush > GRAD_UNDERFLOW_MAX:
            flag(layer, "gradient", "underflow", flush,
                 f"gradients flush to zero in {fmt.name} at scale {pow2(scale)}: {_pct(flush)}")  # fmt: skip
    scaled_grads = [(layer, "grad_output") for layer in layers] + [(la, "grad_weight") for la in layers
                                                                     if la not in keep]  # fmt: skip
    underflow = _flushed([preds[key] for key in scaled_grads if key in preds])
    ratios = {
        layer: table[layer]["update_ratio"]
        for layer in layers
        if "update_ratio" in table[layer] and table[layer]["update_ratio"].total
    }
    master = True
    master_reason = "no update observed (pass optimizer= to observe one): keep them, the safe default"
    if ratios:
        lost = {layer: lost_updates(h, fmt).lost for layer, h in ratios.items()}
        first = next(iter(ratios.values()))
        overall = lost_updates(first.merge(*list(ratios.values())[1:]), fmt).lost
        many = [layer for layer, f in lost.items() if f > LOST_UPDATES_MAX]
        master = overall > LOST_UPDATES_MAX or bool(many)
        top = max(many, key=lost.__getitem__, default=None)
        worst = f"; worst {top!r}: {_pct(lost[top])}" if top else ""
        master_reason = (
            f"{_pct(overall)} of weight updates are below half an ulp in {fmt.name} "
            f"({len(many)} layers past {_pct(LOST_UPDATES_MAX)}{worst})"
        )
        for layer in many:
            line = f"updates lost in {fmt.name} weights: {_pct(lost[layer])}"
            findings.append(Finding(layer, "update_ratio", fmt.name, "lost_updates", lost[layer], line))
    advice = _state_advice(table, ratios, fmt)
    feasible = len(keep) < len(layers) and len(keep) <= max(1, MAX_KEEP_FRACTION * len(layers))
    order = {"overflow": 0, "underflow": 1, "lost_updates": 2}
    findings.sort(key=lambda f: order[f.problem])  # stable: layer order within a problem
    return PolicyCheck(
        policy,
        fmt.name,
        feasible,
        {la: keep[la] for la in layers if la in keep},
        scale if scaled else None,
        scale_reason,
        underflow,
        master,
        master_reason,
        tuple(findings),
        *advice,
    )


def _state_advice(table, ratios: dict, fmt: FloatFormat) -> tuple:
    """Rule 4 (``state_advice``): the weight update and moments' form for 16-bit weights in ``fmt``."""
    rules = {layer: state_advice.update_rule(h, fmt.mbits, LOST_UPDATES_MAX) for layer, h in ratios.items()}
    rule = state_advice.strictest(r for r, _ in rules.values()) if rules else None
    rule_reason = ""
    if rule is not None:
        def severity(layer):
            r, shares = rules[layer]
            return state_advice.RULES.index(r), shares["lost"], shares["lost_sr"], shares["lost_kahan"]

        worst = max(rules, key=severity)
        rule_reason = (f"{rule}: the strictest layer {worst!r} loses {_pct(rules[worst][1]['lost'])} of its "
                       f"updates in {fmt.name} (below half an ulp), {_pct(rules[worst][1]['lost_sr'])} are "
                       f"below 2^-{state_advice.SR_BITS} of that, {_pct(rules[worst][1]['lost_kahan'])} "
                       f"below what a {fmt.name} Kahan buffer keeps")  # fmt: skip
    grads = {la: table[la]["grad_weight"] for la in table if "grad_weight" in table[la]}
    forms = {la: state_advice.states_form(h, LOST_UPDATES_MAX) for la, h in grads.items() if h.total}
    states, states_reason = None, ""
    if forms:
        worst = max(forms, key=lambda la: forms[la][1])
        states = "bf16" if any(f == "bf16" for f, _ in forms.values()) else "int8"
        states_reason = (f"{states}: in layer {worst!r} {_pct(forms[worst][1])} of the non-zero weight "
                         f"gradients square below what the 8-bit moment form keeps "
                         f"(|g| < {state_advice.INT8_FLOOR:g} x its max)")  # fmt: skip
    return rule, {la: r for la, (r, _) in rules.items()}, rule_reason, states, states_reason


def _flushed(predictions) -> float | None:
    """The flushed share of the elements of several predictions together (None: no element)."""
    total = sum(p.total for p in predictions)
    return sum(p.flush * p.total for p in predictions) / total if total else None


def _loss_scale(amax: float, fmt: FloatFormat, scaled: bool) -> tuple[float, str]:
    """The largest power of two S with amax * S <= LOSS_SCALE_MARGIN * max, capped; 1 when unscaled."""
    if not scaled:
        return 1.0, f"{fmt.name} has float32's exponent range: no loss scale"
    if amax == 0:
        return DEFAULT_LOSS_SCALE, "no non-zero gradient observed: the default 2^16"
    limit, cap = LOSS_SCALE_MARGIN * fmt.max, int(math.log2(MAX_LOSS_SCALE))
    k = math.floor(math.log2(limit / amax))
    k += 1 if amax * math.ldexp(1.0, k + 1) <= limit else 0  # log2 may be off by one ulp
    k -= 1 if amax * math.ldexp(1.0, k) > limit else 0
    k = min(k, cap)
    capped = " (capped)" if k == cap else ""
    return math.ldexp(
        1.0, k
    ), f"largest gradient {amax:.3g} x 2^{k} <= {LOSS_SCALE_MARGIN:g} x {fmt.max:g}{capped}"


def _why(check: PolicyCheck, n: int) -> str:
    if not check.keep_fp32:
        return "nothing"
    layer, line = next(iter(check.keep_fp32.items()))
    return f"{len(check.keep_fp32)} of {n} layers in fp32 (first {layer!r}: {line})"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"
