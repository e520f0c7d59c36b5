"""Paired timing in ``polyamp compare``: rounds, ratios, intervals, caps, roofline (a real quick run's:
``test_compare.py``).

The pairing logic is tested with a fake trainer (polyamp's own trainer protocol: ``step(i)``,
``evaluate()``, ``mp``, ``last``) on a virtual clock: each step advances it by the policy's base
time times the machine's speed factor at that moment, so the true speed ratio is known exactly
while the machine's speed varies.
"""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import numpy as np
import pytest

from polyamp import PolyampError
from polyamp.compare import report, verdict
from polyamp.compare.flops import train_step_flops
from polyamp.compare.pairing import INFER_MAX_CALLS, infer_budget_for, pair_group
from polyamp.compare.report import summarize, terminal_table, write_report
from polyamp.compare.roofline import share
from polyamp.compare.worker import PolicyRun
from polyamp.compare.workloads import get_workload
from polyamp.step import StepResult
from polyamp.timing import (
    IN_PROCESS,
    LOCKSTEP,
    WARMUP_ONLY,
    PolicyTimes,
    bootstrap_ci,
    paired_ratio,
    run_rounds,
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


HELDOUT = [(np.full((4, 2), k, np.float32), None) for k in range(3)]  # input k holds k: inputs_seen shows it


class FakeTrainer:
    """A policy whose step costs ``base_s * machine(t)`` seconds of the virtual clock, and whose
    ``infer`` costs ``infer_s * machine(t)``."""

    inference_form = "fake inference"

    def __init__(self, clock: Clock, base_s: float, machine, log: list | None = None, name: str = "",
                 fail_at: int | None = None, infer_s: float | None = None,
                 infer_error: Exception | None = None, memory_error: Exception | None = None):  # fmt: skip
        self.clock, self.base_s, self.machine = clock, base_s, machine
        self.mp = SimpleNamespace(current_scale=1.0)
        self.last = None
        self.log, self.name, self.fail_at = log, name, fail_at
        self.infer_s = base_s / 3 if infer_s is None else infer_s
        self.infer_error, self.memory_error = infer_error, memory_error
        self.wl = SimpleNamespace(heldout=lambda: HELDOUT,
                                  evaluate=lambda f: float(np.mean([f(x) for x, _ in HELDOUT])))  # fmt: skip
        self.inputs_seen: list[int] = []

    def infer(self, x: np.ndarray) -> np.ndarray:
        if self.infer_error is not None:
            raise self.infer_error
        self.inputs_seen.append(int(x[0, 0]))
        self.clock.now += self.infer_s * self.machine(self.clock.now)
        return np.full(2, 0.25, np.float32)

    def memory(self) -> dict:
        if self.memory_error is not None:
            raise self.memory_error
        weights = 500 if self.name == "bf16-mixed" else 1000
        return {"parameters": 1000, "inference_weights": weights, "how": {}}

    def step(self, i: int) -> float:
        if i == self.fail_at:
            raise RuntimeError(f"{self.name} diverged at step {i}")
        if self.log is not None:
            self.log.append((self.name, i))
        self.clock.now += self.base_s * self.machine(self.clock.now)
        self.last = StepResult(True, 1.0)
        return 2.0 / (i + 1)

    def evaluate(self) -> float:
        return 0.5


def drifting_machine(seed: int = 0):
    """The machine's slowdown at time t: a slow drift between 1x and 4x (other programs starting and
    stopping) times +-5 % of per-step noise."""
    rng = np.random.default_rng(seed)
    return lambda t: (2.5 + 1.5 * math.sin(t / 3.0)) * (1 + 0.05 * rng.uniform(-1, 1))


def fake_runs(clock, machine, bases: dict, **kwargs) -> dict:
    return {p: PolicyRun(FakeTrainer(clock, b, machine, name=p, **kwargs), ("loss", False), clock=clock)
            for p, b in bases.items()}  # fmt: skip


def test_the_paired_ratio_recovers_the_known_ratio_while_the_machine_speed_varies():
    bases = {"float32": 0.20, "bf16-mixed": 0.10, "fp16-mixed": 0.50}  # true speed-ups 2.0 and 0.4
    clock = Clock()
    fields = pair_group(fake_runs(clock, drifting_machine(), bases), steps=40, budget=math.inf)
    bf16, fp16 = fields["bf16-mixed"]["paired"], fields["fp16-mixed"]["paired"]
    assert bf16["speedup"] == pytest.approx(2.0, rel=0.03) and fp16["speedup"] == pytest.approx(0.4, rel=0.03)
    assert bf16["rounds"] == fp16["rounds"] == 39 and bf16["pairing"] == IN_PROCESS
    assert bf16["ci95"][0] <= bf16["speedup"] <= bf16["ci95"][1]
    assert 1.85 < bf16["ci95"][0] and bf16["ci95"][1] < 2.15  # only the 5 % step noise is left: no drift
    # the same machine, each policy timed on its own one after the other: the ratio of medians is off
    clock, machine = Clock(), drifting_machine()
    medians = {}
    for policy, base in bases.items():
        run = PolicyRun(FakeTrainer(clock, base, machine), ("loss", False), clock=clock)
        medians[policy] = statistics.median(run_rounds({policy: run.step}, 40, math.inf)[policy].times)
    unpaired = medians["float32"] / medians["bf16-mixed"]
    assert abs(unpaired / 2.0 - 1) > 0.15, unpaired


def test_rounds_rotate_the_order_after_one_warm_up_each():
    clock, log = Clock(), []
    runs = {p: PolicyRun(FakeTrainer(clock, 0.1, lambda t: 1.0, log, p), ("loss", False), clock=clock)
            for p in ("A", "B", "C")}  # fmt: skip
    times = run_rounds({p: r.step for p, r in runs.items()}, steps=4, budget=math.inf)
    assert log[:3] == [("A", 0), ("B", 0), ("C", 0)]  # the warm-ups
    orders = ["".join(name for name, _ in log[3 + 3 * r : 6 + 3 * r]) for r in range(3)]
    assert orders == ["BCA", "CAB", "ABC"] and [i for _, i in log[3:]] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(t.warmup_s == pytest.approx(0.1) and len(t.times) == 3 for t in times.values())


def test_a_capped_policy_leaves_the_rounds_but_never_caps_its_baseline():
    bases = {"float32": 0.2, "bf16-mixed": 0.1, "fp16-mixed": 20.0}  # fp16: 100x slower, as torch's on a CPU
    fields = pair_group(fake_runs(Clock(), lambda t: 1.0, bases), steps=12, budget=45.0)
    base, fp16 = fields["float32"], fields["fp16-mixed"]
    assert not base["capped"] and base["steps"] == 12 and len(base["step_times"]) == 11
    assert not fields["bf16-mixed"]["capped"] and fields["bf16-mixed"]["paired"]["rounds"] == 11
    assert fp16["capped"] and fp16["steps"] == 6  # past the budget at round 2, it goes on to 5 rounds
    assert fp16["cap_reason"] == ("stopped after 6 of 12 steps: the 45 s budget of a case spent (this step "
                                  "took 20.00 s)")  # fmt: skip
    assert fp16["paired"]["rounds"] == 5 and fp16["paired"]["speedup"] == pytest.approx(0.01)
    assert fp16["eval"]["value"] is None and base["eval"]["value"] == 0.5  # not evaluated at another step
    # before 5 rounds a policy may spend 3 budgets, no more: 20 + 20 s > 3 x 10 s
    fp16 = pair_group(fake_runs(Clock(), lambda t: 1.0, bases), steps=12, budget=10.0)["fp16-mixed"]
    assert fp16["steps"] == 2 and fp16["paired"]["rounds"] == 1
    assert "stopped after 2 of 12 steps: 3 budgets (30 s) before 5 rounds spent" in fp16["cap_reason"]
    # a warm-up step alone over 3 budgets: that step is its only time, labelled unpaired
    fields = pair_group(fake_runs(Clock(), lambda t: 1.0, bases), steps=12, budget=5.0)
    fp16 = fields["fp16-mixed"]
    assert fp16["steps"] == 1 and fp16["step_times"] == [20.0] and fp16["warmup_steps"] == 0
    assert fp16["paired"] == {"speedup": pytest.approx(0.01), "ci95": None, "rounds": 0,
                              "baseline": "float32", "pairing": WARMUP_ONLY}  # fmt: skip
    assert fields["float32"]["steps"] == 12 and not fields["float32"]["capped"]


def test_a_slow_baseline_is_capped_by_its_own_budget_and_the_ratio_rests_on_the_shared_rounds():
    fields = pair_group(fake_runs(Clock(), lambda t: 1.0, {"float32": 1.0, "bf16-mixed": 0.5}), steps=20,
                        budget=6.0)  # fmt: skip
    assert fields["float32"]["capped"] and fields["float32"]["steps"] == 7
    assert fields["bf16-mixed"]["steps"] == 13 and fields["bf16-mixed"]["capped"]
    assert fields["bf16-mixed"]["paired"]["rounds"] == 6  # float32's rounds


def test_a_smoke_check_does_not_count_the_warm_up_against_the_budget():
    bases = {"float32": 0.1, "bf16-mixed": 10.0}
    fields = pair_group(fake_runs(Clock(), lambda t: 1.0, bases), steps=4, budget=5.0, quick=True)
    assert fields["bf16-mixed"]["steps"] == 3 and fields["bf16-mixed"]["paired"]["rounds"] == 2  # 20 s > 15
    fields = pair_group(fake_runs(Clock(), lambda t: 1.0, bases), steps=4, budget=5.0)  # a measurement
    assert fields["bf16-mixed"]["steps"] == 2  # its warm-up counts: 10 + 10 s > 15


def test_a_policy_whose_step_raises_fails_alone():
    clock = Clock()
    runs = fake_runs(clock, lambda t: 1.0, {"float32": 0.2, "bf16-mixed": 0.1})
    runs["fp16-mixed"] = PolicyRun(FakeTrainer(clock, 0.1, lambda t: 1.0, name="fp16", fail_at=3),
                                   ("loss", False), clock=clock)  # fmt: skip
    fields = pair_group(runs, steps=8, budget=math.inf)
    assert fields["fp16-mixed"]["status"] == "failed" and fields["fp16-mixed"]["paired"] is None
    assert fields["fp16-mixed"]["error"] == "RuntimeError: fp16 diverged at step 3"
    assert "diverged at step 3" in fields["fp16-mixed"]["traceback"]
    assert fields["bf16-mixed"]["paired"]["rounds"] == 7 and fields["float32"]["steps"] == 8
    # a failed baseline: no ratio for anyone
    runs = fake_runs(Clock(), lambda t: 1.0, {"bf16-mixed": 0.1})
    runs["float32"] = PolicyRun(FakeTrainer(Clock(), 0.2, lambda t: 1.0, fail_at=0), ("loss", False))
    assert pair_group(runs, steps=4, budget=math.inf)["bf16-mixed"]["paired"] is None


def test_inference_calls_are_paired_like_training_steps_while_the_machine_speed_varies():
    train = {"float32": 0.2, "bf16-mixed": 0.1, "fp16-mixed": 0.5}
    infer = {"float32": 0.06, "bf16-mixed": 0.02, "fp16-mixed": 0.12}  # true inference speed-ups 3.0 and 0.5
    clock, machine = Clock(), drifting_machine(1)
    runs = {p: PolicyRun(FakeTrainer(clock, train[p], machine, name=p, infer_s=infer[p]), ("loss", False),
                         clock=clock) for p in train}  # fmt: skip
    fields = pair_group(runs, steps=80, budget=math.inf)
    bf16, fp16 = fields["bf16-mixed"]["inference"], fields["fp16-mixed"]["inference"]
    assert bf16["paired"]["speedup"] == pytest.approx(3.0, rel=0.03)
    assert fp16["paired"]["speedup"] == pytest.approx(0.5, rel=0.03)
    assert bf16["paired"]["rounds"] == INFER_MAX_CALLS - 1 and bf16["paired"]["pairing"] == IN_PROCESS
    assert 2.8 < bf16["paired"]["ci95"][0] and bf16["paired"]["ci95"][1] < 3.2
    assert fields["bf16-mixed"]["paired"]["speedup"] == pytest.approx(2.0, rel=0.03)  # training's own
    base = fields["float32"]["inference"]
    assert base["paired"] is None and base["status"] == "ok"
    assert len(base["step_times"]) == INFER_MAX_CALLS - 1
    assert base["median_ms"] == pytest.approx(1000 * statistics.median(base["step_times"]))
    assert (bf16["how"], bf16["batch"], bf16["weights_bytes"]) == ("fake inference", 4, 500)
    assert base["weights_bytes"] == 1000
    assert bf16["eval"] == {"metric": "loss", "value": 0.25, "higher_is_better": False}
    memory = fields["bf16-mixed"]
    assert memory["memory"]["parameters"] == 1000 and memory["memory_error"] is None
    # call k (0: the warm-up) runs on held-out input k, cycling; then the evaluation reads each once
    seen = runs["float32"].trainer.inputs_seen
    assert seen[:INFER_MAX_CALLS] == [k % 3 for k in range(INFER_MAX_CALLS)]
    assert seen[INFER_MAX_CALLS:] == [0, 1, 2]
    # a few training steps: no more inference calls than steps
    fields = pair_group(fake_runs(Clock(), lambda t: 1.0, train), steps=6, budget=math.inf)
    assert all(len(f["inference"]["step_times"]) == 5 for f in fields.values())


def test_inference_has_its_own_budget_and_a_capped_training_is_timed_but_not_evaluated():
    bases = {"float32": 0.2, "bf16-mixed": 20.0}  # bf16 training capped: 45 s budget
    infer = {"float32": 0.25, "bf16-mixed": 1.0}
    clock = Clock()
    runs = {p: PolicyRun(FakeTrainer(clock, bases[p], lambda t: 1.0, name=p, infer_s=infer[p]),
                         ("loss", False), clock=clock) for p in bases}  # fmt: skip
    fields = pair_group(runs, steps=40, budget=45.0, infer_budget=5.5)
    capped = fields["bf16-mixed"]
    assert capped["capped"] and capped["status"] == "ok"
    inference = capped["inference"]
    assert inference["status"] == "ok" and inference["eval"] is None  # stopped at another step than float32
    # its warm-up call (tracing, compiling) is not counted: 6 x 1 s > 5.5 s
    assert inference["capped"] and len(inference["step_times"]) == 6
    assert inference["cap_reason"] == ("stopped after 7 of 40 steps: the 5.5 s budget of a case spent (this "
                                       "step took 1.00 s)")  # fmt: skip
    assert inference["paired"]["speedup"] == pytest.approx(0.25) and inference["paired"]["rounds"] == 6
    assert fields["float32"]["inference"]["eval"]["value"] == 0.25
    assert len(fields["float32"]["inference"]["step_times"]) == 23  # 23 x 0.25 s > 5.5 s
    assert infer_budget_for(6.0) == 1.5 and infer_budget_for(1.0) == 0.5 and infer_budget_for(6.0, 2) == 2.0
    for bad in (0, -1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(PolyampError, match=f"infer_budget must be a finite number .*got {bad!r}"):
            infer_budget_for(6.0, bad)


class Unsupported(RuntimeError):
    unsupported = True


def test_a_failing_inference_or_memory_probe_never_fails_the_training_case():
    clock = Clock()

    def run(name, **kwargs):
        trainer = FakeTrainer(clock, 0.1, lambda t: 1.0, name=name, **kwargs)
        return PolicyRun(trainer, ("loss", False), clock=clock)

    runs = {"float32": run("float32", memory_error=MemoryError("probe exploded")),
            "bf16-mixed": run("bf16-mixed", infer_error=RuntimeError("no bf16 kernel")),
            "fp16-mixed": run("fp16-mixed", infer_error=Unsupported("float16 needs a GPU")),
            "fp8": run("fp8", fail_at=2)}  # fmt: skip
    fields = pair_group(runs, steps=6, budget=math.inf)
    base = fields["float32"]
    assert base["status"] == "ok" and base["memory"] is None
    assert base["memory_error"] == "MemoryError: probe exploded"
    assert base["inference"]["status"] == "ok" and base["inference"]["weights_bytes"] is None
    bf16 = fields["bf16-mixed"]
    assert bf16["status"] == "ok" and bf16["paired"]["rounds"] == 5 and bf16["eval"]["value"] == 0.5
    assert bf16["memory"]["parameters"] == 1000
    assert bf16["inference"]["status"] == "failed"
    assert bf16["inference"]["error"] == "RuntimeError: no bf16 kernel"
    assert bf16["inference"]["paired"] is None and bf16["inference"]["eval"] is None
    assert bf16["inference"]["how"] == "fake inference"  # what it tried, with why it failed
    fp16 = fields["fp16-mixed"]["inference"]
    assert fp16["status"] == "unsupported" and fp16["error"] == "Unsupported: float16 needs a GPU"
    assert fields["fp8"]["status"] == "failed" and fields["fp8"]["inference"] is None
    assert fields["fp8"]["memory"] is None and fields["fp8"]["memory_error"] is None


def test_the_bootstrap_interval_contains_the_median_and_narrows_with_less_noise():
    rng = np.random.default_rng(1)
    for noise in (0.02, 0.2):
        ratios = list(1.7 * np.exp(rng.normal(0, noise, 15)))
        lo, hi = bootstrap_ci(ratios)
        assert lo <= statistics.median(ratios) <= hi
        assert bootstrap_ci(ratios) == (lo, hi)  # a fixed seed: a report is reproducible
    assert bootstrap_ci([1.7] * 9) == (1.7, 1.7) and bootstrap_ci([2.0]) == (2.0, 2.0)
    narrow = bootstrap_ci(list(1.7 * np.exp(rng.normal(0, 0.02, 15))))
    wide = bootstrap_ci(list(1.7 * np.exp(rng.normal(0, 0.2, 15))))
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    ratio = paired_ratio(PolicyTimes(0.3, [0.2, 0.4, 0.2]), PolicyTimes(0.1, [0.1, 0.1]), "float32", LOCKSTEP)
    assert (ratio.speedup, ratio.rounds, ratio.pairing) == (3.0, 2, LOCKSTEP)  # rounds both ran: 2 and 4


def _paired_case(policy, speedup, rounds, ci, pairing=IN_PROCESS):
    case = {"framework": "torch", "workload": "mlp", "policy": policy, "status": "ok", "steps": rounds + 1,
            "steps_requested": rounds + 1, "losses": [1.0] * (rounds + 1), "scales": [1.0] * (rounds + 1),
            "step_times": [0.1] * rounds, "median_step_s": 0.1, "eval": None}  # fmt: skip
    if policy != "float32":
        case["paired"] = {"speedup": speedup, "ci95": ci, "rounds": rounds, "baseline": "float32",
                          "pairing": pairing}  # fmt: skip
    return case


def test_the_report_shows_the_paired_ratio_its_interval_and_rounds_and_names_unpaired_rows(tmp_path):
    cases = [_paired_case("float32", None, 9, None), _paired_case("bf16-mixed", 1.71, 9, [1.62, 1.80]),
             _paired_case("fp16-mixed", 0.5, 3, [0.45, 0.55], LOCKSTEP)]  # fmt: skip
    unpaired = _paired_case("bf16-mixed", None, 9, None)
    unpaired.update(framework="jax", median_step_s=0.05)
    del unpaired["paired"]  # a record from before pairing
    cases += [{**_paired_case("float32", None, 9, None), "framework": "jax"}, unpaired]
    rows = summarize(cases)
    assert (rows[1].speedup, rows[1].speedup_ci95, rows[1].speedup_rounds) == (1.71, [1.62, 1.80], 9)
    assert rows[4].speedup == pytest.approx(2.0) and rows[4].pairing.startswith("unpaired")
    text = " ".join(terminal_table(rows, width=190).split())
    assert "1.71x" in text and "[1.62-1.80] n=9" in text and "0.50x (slower)" in text  # may wrap
    cases[2]["loadavg_1min"] = [1.5, 3.2]  # timed while other programs loaded the 2 cores
    md = open(write_report(cases, {"machine": {"cores": 2}}, tmp_path)["markdown"], encoding="utf-8").read()
    assert "**busy machine**: torch mlp fp16-mixed: timed while the 1-minute load average (up to 3.2)" in md
    assert "| 1.71x [1.62-1.80] n=9 |" in md and "| **0.50x (slower) [0.45-0.55] n=3** |" in md
    assert f"**{LOCKSTEP}**: torch mlp fp16-mixed" in md
    assert "torch mlp fp16-mixed: its speed-up rests on 3" in md
    assert "**unpaired: ratio of medians taken at different times**: jax mlp bf16-mixed" in md
    # below 1x but with 1x inside its interval: not called slower
    unsure = summarize([cases[0], _paired_case("bf16-mixed", 0.98, 9, [0.92, 1.03])])[1]
    md = report._markdown([unsure], {}, verdict.build([unsure]), [], smoke=False)
    assert "| 0.98x [0.92-1.03] n=9 |" in md and "slower" not in md
    assert "training step 0.98x float32's speed: no clear difference (95 % CI 0.92-1.03" in md


def test_flops_per_step_and_the_roofline_share():
    wl = get_workload("mlp", quick=True)  # 64 -> 128 -> 128 -> 64 on a batch of 32
    forward = [2 * 32 * 64 * 128, 2 * 32 * 128 * 128, 2 * 32 * 128 * 64]
    assert train_step_flops(wl) == 3 * sum(forward) - forward[0]
    lm = get_workload("charlm")
    assert 3e9 < train_step_flops(lm) / 3 < 3 * train_step_flops(get_workload("mlp"))
    peaks = {"gflops": {"float32": 100.0, "bfloat16": 200.0}, "size": {"float32": 1024, "bfloat16": 1024}}
    s = share("bf16-mixed", 10**9, 0.05, peaks)
    assert (s.compute_dtype, s.achieved_gflops, s.share, s.matmul_n) == ("bfloat16", 20.0, 0.1, 1024)
    assert share("fp16-mixed", 10**9, 0.05, peaks).share is None  # no fp16 peak measured
    with pytest.raises(PolyampError, match="no FLOP count for a workload of kind 'resnet'"):
        train_step_flops(SimpleNamespace(name="resnet", architecture=None))
