"""Pairing the policies of one (framework, workload): their steps in rounds, then memory and inference.

``pair_group`` steps each policy's run (in this process, or one served by another) in the rounds of
``timing.run_rounds``, takes the speed-up of each over float32 from their shared rounds, then probes
the memory of those whose training is ok and pairs their inference calls the same way. The worker
(one process per group) and the lock-step driver (one process per MXNet policy) both call it.
"""

from __future__ import annotations

import math
import statistics
import traceback
from collections.abc import Callable
from numbers import Real

from ..errors import PolyampError
from ..timing import IN_PROCESS, CaseError, PolicyTimes, paired_ratios, run_rounds

BASELINE = "float32"
INFER_MAX_CALLS = 50  # inference calls per policy, its warm-up included; the budget usually stops it first
MIN_INFER_BUDGET = 0.5
# a record whose training did not succeed: nothing trained to measure
NOT_MEASURED = {"memory": None, "memory_error": None, "inference": None}


def infer_budget_for(budget: float, infer_budget: float | None = None) -> float:
    """The seconds of inference calls per policy: ``infer_budget``, else a quarter of the training
    ``budget`` and at least 0.5 s."""
    if infer_budget is None:
        return max(MIN_INFER_BUDGET, budget / 4)
    bad = isinstance(infer_budget, bool) or not isinstance(infer_budget, Real)
    if bad or not 0 < infer_budget < math.inf:
        raise PolyampError(f"infer_budget must be a finite number of seconds > 0, or None for a quarter "
                           f"of the training budget; got {infer_budget!r}")  # fmt: skip
    return float(infer_budget)


def error_fields(err: BaseException) -> dict:
    """A record's status, error and traceback for an exception being handled."""
    return {"status": "unsupported" if getattr(err, "unsupported", False) else "failed",
            "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)}  # fmt: skip


def timed_fields(times: PolicyTimes) -> dict:
    """A record's timing fields: ``step_times`` are the rounds (the warm-up when it was all)."""
    step_times = times.times or ([times.warmup_s] if times.warmup_s is not None else [])
    return {"status": times.status, "error": times.error, "capped": times.cap_reason is not None,
            "cap_reason": times.cap_reason, "warmup_steps": 1 if times.times else 0, "step_times": step_times,
            "median_step_s": statistics.median(step_times) if step_times else None}  # fmt: skip


def pair_group(runs: dict, steps: int, budget: float, quick: bool = False, pairing: str = IN_PROCESS,
               infer_budget: float | None = None) -> dict:  # fmt: skip
    """Step ``runs`` (policy -> :class:`PolicyRun`, or one seen from another process) in rounds, then
    probe the memory of and pair the inference calls of those whose training is ok; returns each
    policy's record fields, ``paired`` holding its ratio over float32 (or None)."""
    times = run_rounds({p: run.step for p, run in runs.items()}, steps, budget, count_warmup=not quick)
    ratios = paired_ratios(times, BASELINE, pairing)
    out = {}
    for policy, run in runs.items():
        fields = timed_fields(times[policy])
        if times[policy].status == "ok":
            try:
                fields.update(run.result(evaluate=not fields["capped"]))
            except CaseError as err:  # in the policy's own process
                fields.update(status=err.status, error=err.error, traceback=err.remote_traceback)
            except Exception as err:
                fields.update(error_fields(err))
        else:
            fields["traceback"] = times[policy].traceback
        ratio = ratios.get(policy)
        fields["paired"] = ratio.to_json() if ratio and fields["status"] == "ok" else None
        out[policy] = {**fields, **NOT_MEASURED}
    trained = {p: run for p, run in runs.items() if out[p]["status"] == "ok"}
    for policy, run in trained.items():
        try:
            out[policy].update(run.memory())
        except CaseError as err:  # the policy's process died or timed out
            out[policy]["memory_error"] = err.error
    calls = min(steps, INFER_MAX_CALLS)
    evaluate = {p: not out[p]["capped"] for p in trained}
    for policy, inference in infer_group(trained, calls, infer_budget_for(budget, infer_budget), pairing,
                                         evaluate).items():  # fmt: skip
        out[policy]["inference"] = inference
    return out


def _call(method: Callable[[], dict]) -> tuple[dict | None, str | None, str | None]:
    """``method()``, or (None, status, error) when it raised, here or in the policy's process."""
    try:
        return method(), None, None
    except CaseError as err:
        return None, err.status, err.error
    except Exception as err:
        fields = error_fields(err)
        return None, fields["status"], fields["error"]


def infer_group(runs: dict, calls: int, budget: float, pairing: str, evaluate: dict[str, bool]) -> dict:
    """Each policy's ``inference`` field: its ``infer`` calls paired in rounds with the others' (see the
    module docstring), its speed-up over float32's, its metric through ``infer`` when ``evaluate``."""
    info = {p: _call(run.inference_info) for p, run in runs.items()}
    ready = {p: run for p, run in runs.items() if info[p][0] is not None}
    times = run_rounds({p: run.infer for p, run in ready.items()}, calls, budget, count_warmup=False)
    ratios = paired_ratios(times, BASELINE, pairing)
    out = {}
    for policy in runs:
        got, status, error = info[policy]
        fields = {"status": status, "error": error, "how": None, "batch": None, "step_times": [],
                  "median_ms": None, "capped": False, "cap_reason": None, "paired": None, "eval": None,
                  "weights_bytes": None}  # fmt: skip
        if got is not None:
            t = times[policy]
            step_times = t.times or ([t.warmup_s] if t.warmup_s is not None else [])
            fields.update(got, status=t.status, error=t.error, step_times=step_times,
                          median_ms=1000 * statistics.median(step_times) if step_times else None,
                          capped=t.cap_reason is not None, cap_reason=t.cap_reason)  # fmt: skip
            if t.status == "ok":
                ratio = ratios.get(policy)
                fields["paired"] = ratio.to_json() if ratio else None
                if evaluate[policy]:
                    fields["eval"], status, error = _call(runs[policy].infer_eval)
                    if status is not None:
                        fields.update(status=status, error=error)
        out[policy] = fields
    return out


def pair_groups(cases: list) -> list[list[int]]:
    """Indices of consecutive cases with the same (framework, workload): the pair groups."""
    groups: list[list[int]] = []
    for i, case in enumerate(cases):
        if groups and tuple(cases[groups[-1][0]][:2]) == tuple(case[:2]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
