"""``polyamp compare --converge``: the summary and parity test over seeds, the run loop's caps, and
tiny real runs (torch in-process and through the CLI, MXNet through its own environment)."""

import json
import stat
from types import SimpleNamespace

import pytest
from frameworks import mxnet_bf16_refused

from polyamp import PolyampError
from polyamp.cli import main
from polyamp.compare import converge, interpreters
from polyamp.compare.converge import CAPPED, Plan, Run, make_plan, train, work
from polyamp.compare.convergence import Stat, summarize


def _runs(policy, finals, reached_at=None, workload="digits", framework="torch", statuses=None):
    """Finished runs with these final metrics (a capped one: final None), one per seed."""
    reached_at = reached_at or [None] * len(finals)
    statuses = statuses or ["ok"] * len(finals)
    return [Run(framework, workload, policy, seed, status=status, steps_to_target=steps,
                final_metric=final if status == "ok" else None, curve=[(0, 0.1), (600, final)])
            for seed, (final, steps, status) in enumerate(zip(finals, reached_at, statuses))]  # fmt: skip


def _by_policy(runs):
    return {s.policy: s for s in summarize(runs)}


def test_stat_is_mean_and_sample_sd_over_the_values_given():
    s = Stat.of([150, 200, 150])
    assert (s.n, s.mean) == (3, pytest.approx(500 / 3)) and s.sd == pytest.approx(28.8675, rel=1e-5)
    assert Stat.of([0.9]) == Stat(1, 0.9, None) and Stat.of([]) == Stat(0, None, None)
    assert Stat.of([None, 2.0, 4.0]) == Stat(2, 3.0, pytest.approx(2**0.5))
    assert Stat.of([]).text() == "-" and Stat.of([2.0, 4.0]).text() == "3 ± 1.41"


def test_summary_counts_seeds_reached_and_steps_to_target_over_finished_runs():
    runs = _runs("float32", [0.96, 0.97, 0.98], [150, 200, 150])
    runs += _runs("bf16-mixed", [0.96, 0.97, 0.5], [200, 250, None])
    rows = _by_policy(runs)
    f32, bf16 = rows["float32"], rows["bf16-mixed"]
    assert (f32.seeds, f32.finished, f32.reached, f32.parity) == (3, 3, 3, None)
    assert f32.steps_to_target.mean == pytest.approx(500 / 3) and f32.final_metric.mean == pytest.approx(0.97)
    assert f32.final_metric.sd == pytest.approx(0.01)
    assert (bf16.reached, bf16.steps_to_target) == (2, Stat(2, 225.0, pytest.approx(35.3553, rel=1e-5)))


@pytest.mark.parametrize(
    "workload, f32, mixed, verdict",
    [
        ("digits", [0.96, 0.97, 0.98], [0.955, 0.95, 0.96], "parity"),  # gap 0.015 <= max(0.02, 0.02)
        ("digits", [0.96, 0.97, 0.98], [0.94, 0.95, 0.94], "behind"),  # gap 0.0267 > 0.02
        ("digits", [0.90, 0.96, 0.99], [0.90, 0.90, 0.90], "parity"),  # gap 0.05 <= 2 sd = 0.0917
        ("digits", [0.96, 0.96, 0.96], [0.94, 0.94, 0.94], "parity"),  # gap = tolerance: on the boundary
        ("digits", [0.96, 0.96, 0.96], [0.9399, 0.94, 0.94], "behind"),  # just past it
        ("digits", [0.96, 0.96, 0.96], [0.99, 0.99, 0.99], "parity"),  # better than float32: negative gap
        ("charlm", [2.0, 2.0, 2.0], [2.1, 2.1, 2.1], "parity"),  # +5 % relative = tolerance
        ("charlm", [2.0, 2.0, 2.0], [2.11, 2.11, 2.11], "behind"),  # +5.5 %
        ("charlm", [1.9, 2.0, 2.1], [2.2, 2.2, 2.2], "parity"),  # +10 % = 2 sd / mean
        ("charlm", [1.9, 2.0, 2.1], [2.21, 2.21, 2.21], "behind"),
    ],
)  # fmt: skip
def test_parity_is_the_mixed_mean_within_max_2sd_or_tolerance_of_float32s(workload, f32, mixed, verdict):
    reached = [100] * 3
    rows = _by_policy(_runs("float32", f32, reached, workload) + _runs("bf16-mixed", mixed, reached,
                                                                        workload))  # fmt: skip
    parity = rows["bf16-mixed"].parity
    assert parity.verdict == verdict, parity
    base = rows["float32"].final_metric
    sd = base.sd / (abs(base.mean) if workload == "charlm" else 1)  # in gap units
    assert parity.allowed == pytest.approx(max(2 * sd, 0.02 if workload == "digits" else 0.05))


def test_parity_needs_as_many_seeds_reaching_the_target_as_float32():
    runs = _runs("float32", [0.96] * 3, [150] * 3) + _runs("fp16-mixed", [0.96] * 3, [150, 200, None])
    parity = _by_policy(runs)["fp16-mixed"].parity
    assert parity.verdict == "fewer reached" and "reached 2/3 vs float32 3/3" in parity.reason
    runs = _runs("float32", [0.96] * 3, [150, None, None]) + _runs("fp16-mixed", [0.90] * 3, [None] * 3)
    assert _by_policy(runs)["fp16-mixed"].parity.verdict == "behind, fewer reached"


def test_a_capped_run_is_not_counted():
    runs = _runs("float32", [0.96, 0.97, 0.98], [150] * 3)
    runs += _runs("bf16-mixed", [0.96, 0.96, 0.2], [150, 150, None], statuses=["ok", "ok", CAPPED])
    bf16 = _by_policy(runs)["bf16-mixed"]
    assert (bf16.seeds, bf16.finished, bf16.capped, bf16.reached) == (3, 2, 1, 2)
    assert bf16.final_metric == Stat(2, 0.96, 0.0)  # the capped run's 0.2 is not in it
    assert bf16.parity.verdict == "parity" and "on 2 of 3 seeds vs float32's 3 of 3" in bf16.parity.reason


def test_parity_is_undecided_without_finished_runs_and_tolerance_only_with_one_seed():
    runs = _runs("float32", [0.96] * 2, statuses=[CAPPED] * 2) + _runs("bf16-mixed", [0.96] * 2)
    assert _by_policy(runs)["bf16-mixed"].parity.verdict == "n/a"
    runs = _runs("float32", [0.96]) + _runs("fp16-mixed", [0.96], statuses=["unsupported"])
    parity = _by_policy(runs)["fp16-mixed"].parity
    assert parity.verdict == "n/a" and parity.reason == "no finished fp16-mixed run"
    runs = _runs("float32", [0.96], [100]) + _runs("bf16-mixed", [0.95], [100])
    parity = _by_policy(runs)["bf16-mixed"].parity
    assert parity.allowed == 0.02 and "one float32 seed: tolerance only" in parity.reason
    assert summarize(_runs("bf16-mixed", [0.9]))[0].parity.verdict == "n/a"  # no float32 at all


# -- the run loop, with a fake trainer (polyamp's own protocol) and a fake clock -------------------
class FakeTrainer:
    """Each step takes ``pace(i)`` seconds on ``clock``; the metric after n steps is ``n / 1000``;
    step 3 is skipped (non-finite gradients)."""

    clock = [0.0]
    pace = staticmethod(lambda i: 1.0)

    def __init__(self, wl, policy):
        self.done, self.last = 0, None

    def step(self, i):
        FakeTrainer.clock[0] += self.pace(i)
        self.done = i + 1
        self.last = SimpleNamespace(stepped=i != 3)
        return 1.0

    def evaluate(self):
        return self.done / 1000


def _train(pace, budget=1000.0, steps=600):
    FakeTrainer.clock[0], FakeTrainer.pace = 0.0, staticmethod(pace)
    plan = Plan(["torch"], ["digits"], ["float32"], 1, budget, steps=steps)
    run = Run("torch", "digits", "float32", 0, steps_requested=steps)
    return train(SimpleNamespace(Trainer=FakeTrainer), plan, run, clock=lambda: FakeTrainer.clock[0])


def test_a_run_evaluates_at_its_cadence_and_records_the_first_step_that_reached_the_target():
    run = _train(lambda i: 0.1)
    assert [s for s, _ in run.curve] == list(range(0, 601, 25)) and run.curve[-1] == (600, 0.6)
    assert run.steps_to_target is None and run.final_metric == 0.6  # never reached 0.95
    run = _train(lambda i: 0.1, steps=1000)  # more steps than the target's: every 25 still
    assert run.steps_to_target == 950 and run.final_metric == 1.0 and run.status == "ok"
    assert (run.steps_run, run.skipped_steps, run.wall_s) == (1000, 1, pytest.approx(100.0))


def test_a_run_is_capped_when_its_pace_projects_past_its_budget_or_it_spends_it():
    run = _train(lambda i: 1.0, budget=300.0)  # projects 600 s after 5 steps past the first: > 1.5 x 300
    assert run.status == CAPPED and run.steps_run == converge.PROJECT_AFTER + 1 and run.final_metric is None
    assert run.cap_reason == "at step 6 of 600: its pace projects 600 s, over 1.5x its 300 s budget"
    run = _train(lambda i: 10.0 if i == 0 else 0.6, budget=300.0)  # a slow first step: projects 369 s
    assert run.status == CAPPED and run.steps_run == 485  # 10 + 0.6 * 484 > 300
    assert run.cap_reason == "at step 485 of 600: spent its 300 s budget"
    assert _train(lambda i: 0.5, budget=300.0).status == "ok"  # exactly 300 s: not over


def test_the_worker_appends_one_line_per_run_and_a_module_that_fails_to_import_fails_its_runs(tmp_path):
    plan = Plan(["torch"], ["digits"], ["float32"], 2, 100.0, steps=50)
    spec = {"plan": vars(plan), "runs": [vars(r) for r in plan.runs()]}
    work(spec, tmp_path / "ok.jsonl", load=lambda name: SimpleNamespace(Trainer=FakeTrainer))
    runs = [Run.from_json(json.loads(line)) for line in (tmp_path / "ok.jsonl").read_text().splitlines()]
    assert [(r.seed, r.status, r.steps_run, r.curve[-1]) for r in runs] == [(s, "ok", 50, (50, 0.05))
                                                                           for s in (0, 1)]  # fmt: skip

    def missing(name):
        raise ImportError(f"no {name}")

    work(spec, tmp_path / "bad.jsonl", load=missing)
    runs = [json.loads(line) for line in (tmp_path / "bad.jsonl").read_text().splitlines()]
    assert [(r["status"], r["error"]) for r in runs] == [("failed", "ImportError: no polyamp.compare.torch")
                                                         ] * 2  # fmt: skip


def test_the_seeds_of_a_capped_case_not_started_yet_are_not_run():
    plan = make_plan(["torch"], ["digits"], ["float32"], seeds=3, budget_s=0.001, quick=True)
    runs = converge.run_all(plan, jobs=1)
    assert [r.status for r in runs] == [CAPPED] * 3 and runs[0].steps_run == 1
    assert runs[0].cap_reason == "at step 1 of 40: spent its 0.001 s budget"
    assert runs[2].cap_reason == f"not run: seed 0 was capped {runs[0].cap_reason}" and runs[2].steps_run == 0


# -- real runs ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torch_digits(tmp_path_factory):
    out = tmp_path_factory.mktemp("converge")
    code = main(["compare", "--converge", "--quick", "--seeds", "2", "--frameworks", "torch",
                 "--workloads", "digits", "--out", str(out)])  # fmt: skip
    return code, out, json.loads((out / "convergence.json").read_text())


def test_a_tiny_converge_run_writes_the_json_the_markdown_and_the_figure(torch_digits):
    code, out, report = torch_digits
    assert code == 0
    assert set(report) == {"settings", "test", "runs", "summary"}
    assert report["settings"]["plan"]["seeds"] == 2 and report["settings"]["steps"] == {"digits": 40}
    runs = [Run.from_json(r) for r in report["runs"]]
    assert [(r.policy, r.seed) for r in runs] == [(p, s) for p in ("float32", "bf16-mixed", "fp16-mixed")
                                                  for s in (0, 1)]  # fmt: skip
    for run in runs:
        assert run.status == "ok" and run.steps_run == 40 and run.final_metric == run.curve[-1][1]
        assert [s for s, _ in run.curve] == [0, 10, 20, 30, 40] and 0 <= run.final_metric <= 1
        assert run.curve[-1][1] > run.curve[0][1]  # it learned
    assert runs[0].curve != runs[1].curve  # the seed changes weights, data order and split
    assert len({r.worker_pid for r in runs}) == 6  # one process per (framework, policy, seed)
    summary = {s["policy"]: s for s in report["summary"]}
    assert summary["float32"]["parity"] is None and summary["bf16-mixed"]["parity"]["verdict"] in (
        "parity", "behind")  # fmt: skip
    assert summary["float32"]["final_metric"]["n"] == 2 and summary["float32"]["metric"] == "accuracy"
    md = (out / "convergence.md").read_text()
    assert "## The parity test" in md and "max(2 sd, tolerance)" in md and "quick sizes" in md
    assert "| torch | digits | fp16-mixed | 2 of 2 |" in md and "![" in md
    assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_worker_trains_as_the_same_run_in_this_process(torch_digits):
    """The seed reaches the worker: seed 1's curve in this process is the CLI's."""
    import polyamp.compare.torch as module

    _, _, report = torch_digits
    plan = make_plan(["torch"], ["digits"], ["bf16-mixed"], seeds=2, quick=True)
    here = train(module, plan, plan.runs()[1])
    there = next(Run.from_json(r) for r in report["runs"] if (r["policy"], r["seed"]) == ("bf16-mixed", 1))
    assert [s for s, _ in here.curve] == [s for s, _ in there.curve]
    assert [v for _, v in here.curve] == pytest.approx([v for _, v in there.curve], rel=1e-6)


def test_bad_converge_options_are_refused_with_what_is_accepted(capsys):
    with pytest.raises(PolyampError, match=r"workload 'mlp' has no convergence target; --converge accepts: "
                       r"digits, charlm"):  # fmt: skip
        make_plan(["torch"], ["digits", "mlp"])
    with pytest.raises(PolyampError, match=r"--seeds must be a whole number >= 1; got 0"):
        make_plan(["torch"], seeds=0)
    with pytest.raises(PolyampError, match="unknown workload 'cifar'"):
        make_plan(["torch"], ["cifar"])
    assert main(["compare", "--seeds", "2", "--frameworks", "torch"]) == 2
    assert "--seeds applies to --converge only" in capsys.readouterr().err
    assert make_plan(["torch"]).workloads == ["digits", "charlm"]
    assert make_plan(["torch"], policies=["bf16-mixed", "float32"]).policies == ["float32", "bf16-mixed"]


def test_a_crashed_worker_costs_its_run_and_exits_1(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'simulated interpreter crash' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    real = interpreters.interpreter
    monkeypatch.setattr(interpreters, "interpreter", lambda f: str(broken) if f == "jax" else real(f))
    code = main(["compare", "--converge", "--quick", "--seeds", "2", "--frameworks", "jax", "--workloads",
                 "digits", "--policies", "float32", "--out", str(tmp_path / "out"), "--json"])  # fmt: skip
    assert code == 1
    printed = capsys.readouterr()
    assert "2 of 2 runs crashed" in printed.err
    assert "jax digits float32 seed 1: failed: exit code 3: simulated interpreter crash" in printed.err
    report = json.loads((tmp_path / "out" / "convergence.json").read_text())
    assert json.loads(printed.out) == report  # --json prints the file's JSON
    assert [r["status"] for r in report["runs"]] == ["failed", "failed"]  # the second in a new process


@pytest.mark.skipif("mxnet" not in interpreters.installed_frameworks(),
                    reason="no .venv-mxnet (make venv-mxnet)")
def test_a_tiny_converge_run_of_mxnet_runs_in_its_own_environment(tmp_path):
    out = tmp_path / "out"
    code = main(["compare", "--converge", "--quick", "--seeds", "2", "--frameworks", "mxnet", "--workloads",
                 "digits", "--out", str(out)])  # fmt: skip
    assert code == 0  # fp16-mixed is unsupported on CPU: reported, not a crash
    report = json.loads((out / "convergence.json").read_text())
    runs = [Run.from_json(r) for r in report["runs"]]
    refused = {r.policy for r in runs if mxnet_bf16_refused({"status": r.status, "error": r.error})}
    assert refused <= {"bf16-mixed"}  # a CPU without AVX-512: MXNet computes no bf16 (capability.py)
    assert {r.status for r in runs if r.policy not in ("fp16-mixed", *refused)} == {"ok"}
    assert all(r.status == "unsupported" and "cuDNN" in r.error for r in runs if r.policy == "fp16-mixed")
    assert len({r.worker_pid for r in runs}) == 6  # one per (policy, seed): AMP is process-wide
    assert all([s for s, _ in r.curve] == [0, 10, 20, 30, 40] for r in runs if r.status == "ok")
    summary = {s["policy"]: s for s in report["summary"]}
    assert summary["bf16-mixed"]["finished"] == (0 if refused else 2)
    assert summary["fp16-mixed"]["parity"]["verdict"] == "n/a"
    assert (out / "convergence.md").exists() and (out / "convergence.png").exists()
