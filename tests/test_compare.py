"""``polyamp compare --quick`` end to end: every installed framework, a real report."""

import argparse
import json
import math
import stat
import statistics
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import pytest
from frameworks import mxnet_bf16_refused

from polyamp import PolyampError
from polyamp.cli import main
from polyamp.compare import interpreters, runner
from polyamp.compare.cli import compare
from polyamp.compare.flops import train_step_flops
from polyamp.compare.workloads import WORKLOADS, get_workload
from polyamp.timing import IN_PROCESS, LOCKSTEP

POLICIES = ("float32", "bf16-mixed", "fp16-mixed")
LOW_PRECISION_WEIGHTS = {"jax"}  # the trainers that keep the weights infer() reads in the compute dtype


def test_workloads_are_deterministic_and_shared():
    a, b = get_workload("charlm", quick=True), get_workload("charlm", quick=True)
    assert all((a.weights[k] == b.weights[k]).all() for k in a.weights)
    xa, ya = a.batch_at(3)
    xb, yb = b.batch_at(3)
    assert (xa == xb).all() and (ya == yb).all() and (xa[:, 1:] == ya[:, :-1]).all()
    digits = get_workload("digits")
    x, y = digits.batch_at(0)
    assert x.shape == (64, 64) and set(y) <= set(range(10)) and 0 <= x.min() and x.max() <= 1
    assert "def" in get_workload("charlm").text  # the standard library's documentation topics


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    frameworks = interpreters.installed_frameworks()
    assert "torch" in frameworks
    # a budget no quick case reaches: every case runs all its rounds (the tests below count them)
    code = main(
        ["compare", "--quick", "--budget", "60", "--out", str(out), "--frameworks", ",".join(frameworks)]
    )
    assert code == 0  # MXNet's fp16-mixed is unsupported on CPU: reported, not a crash
    return out, frameworks


def test_quick_compare_covers_every_installed_framework(quick_report):
    out, frameworks = quick_report
    report = json.loads((out / "report.json").read_text())
    cases = report["cases"]
    assert {(c["framework"], c["workload"]) for c in cases} == {(f, w) for f in frameworks for w in WORKLOADS}
    assert {c["policy"] for c in cases} == {"float32", "bf16-mixed", "fp16-mixed"}
    for case in cases:
        if (case["framework"], case["policy"]) == ("mxnet", "fp16-mixed"):  # needs cuDNN: reported, not run
            assert case["status"] == "unsupported" and "cuDNN" in case["error"], case
            continue
        if case["framework"] == "mxnet" and mxnet_bf16_refused(case):  # a CPU without AVX-512
            assert case["policy"] == "bf16-mixed", case
            continue
        assert case["status"] == "ok", case.get("error")
        assert len(case["losses"]) == case["steps"] == len(case["scales"])
        assert case["median_step_s"] > 0 and case["peak_rss_mb"] > 50


def test_quick_compare_shares_one_process_per_framework_and_is_labelled_a_smoke_check(quick_report):
    out, frameworks = quick_report
    report = json.loads((out / "report.json").read_text())
    pids = {}
    for case in report["cases"]:
        key = (case["framework"], case["policy"]) if case["framework"] == "mxnet" else case["framework"]
        pids.setdefault(key, set()).add(case["worker_pid"])
    assert all(len(p) == 1 for p in pids.values()), pids  # MXNet: one process per policy (AMP is global)
    assert len(set().union(*pids.values())) == len(pids)
    assert report["timings"]["kind"] == "smoke check" and report["settings"]["quick"] is True
    md = (out / "report.md").read_text()
    assert "> **Smoke check (--quick):" in md


def test_report_lists_each_framework_version_once(quick_report):
    out, frameworks = quick_report
    md = (out / "report.md").read_text()
    line = next(x for x in md.splitlines() if "framework versions" in x)
    if "tensorflow" in frameworks:
        tf, keras = metadata.version("tensorflow-cpu"), metadata.version("keras")
        assert f"tensorflow {tf}, keras {keras}" in line
    assert f"torch {metadata.version('torch')}" in line
    items = [item.split() for item in line.split(": ", 1)[1].split(", ")]
    assert all(len(item) == 2 for item in items), line  # "name version", each package once
    listed = [name for name, _ in items]
    assert len(listed) == len(set(listed)) and set(frameworks) <= set(listed), line


def _mlp_records(quick_report, framework):
    out, frameworks = quick_report
    if framework not in frameworks:
        pytest.skip(f"{framework} is not installed")
    cases = json.loads((out / "report.json").read_text())["cases"]
    mlp = {c["policy"]: c for c in cases if (c["framework"], c["workload"]) == (framework, "mlp")}
    return [mlp[p] for p in POLICIES]


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_quick_run_records_rounds_intervals_and_roofline_shares(quick_report, framework):
    records = _mlp_records(quick_report, framework)
    base, bf16, fp16 = records
    assert base["status"] == "ok" and base["paired"] is None and len(base["step_times"]) == 3
    if framework == "mxnet" and bf16["status"] == "unsupported":  # a CPU without AVX-512 (capability.py)
        assert mxnet_bf16_refused(bf16) and bf16.get("paired") is None
        pytest.skip(bf16["error"])
    paired = bf16["paired"]
    assert paired["rounds"] == 3 and paired["baseline"] == "float32"
    assert paired["pairing"] == (LOCKSTEP if framework == "mxnet" else IN_PROCESS)
    assert paired["ci95"][0] <= paired["speedup"] <= paired["ci95"][1]
    recomputed = statistics.median(b / c for b, c in zip(base["step_times"], bf16["step_times"]))
    assert paired["speedup"] == pytest.approx(recomputed, rel=1e-12)
    pids = {r["worker_pid"] for r in records}
    assert len(pids) == (3 if framework == "mxnet" else 1)  # MXNet: one process per policy, stepped in turn
    if framework == "mxnet":
        assert fp16["status"] == "unsupported" and "cuDNN" in fp16["error"]
        assert "float16" in base["roofline_peaks"]["errors"]
    else:
        assert fp16["paired"]["rounds"] == 3
    for record in (r for r in records if r["status"] == "ok"):
        assert record["group_policies"] == list(POLICIES)
        assert set(record["roofline_peaks"]["gflops"]) >= {"float32", "bfloat16"}
        roof = record["roofline"]
        assert roof["flops_per_step"] == train_step_flops(get_workload("mlp", quick=True))
        achieved = roof["flops_per_step"] / record["median_step_s"] / 1e9
        assert roof["achieved_gflops"] == pytest.approx(achieved)


@pytest.mark.parametrize("framework", interpreters.FRAMEWORKS)
def test_every_trained_case_records_its_memory_and_paired_inference(quick_report, framework):
    """torch, TensorFlow and JAX infer in their worker process; MXNet, whose AMP is process-wide,
    through the lock-step path (one ``worker --serve`` process per policy)."""
    records = dict(zip(POLICIES, _mlp_records(quick_report, framework)))
    wl = get_workload("mlp", quick=True)
    rows = len(wl.heldout()[0][0])
    for policy, record in records.items():
        if framework == "mxnet" and policy == "fp16-mixed":  # refused at build: nothing trained to infer with
            assert record["status"] == "unsupported" and "cuDNN" in record["error"]
            assert record["inference"] is None and record["memory"] is None
            continue
        if framework == "mxnet" and mxnet_bf16_refused(record):  # a CPU without AVX-512 (capability.py)
            assert policy == "bf16-mixed" and record["inference"] is None
            continue
        assert record["status"] == "ok", record.get("error")
        memory, inference = record["memory"], record["inference"]
        assert record["memory_error"] is None and memory["parameters"] > 0 and memory["gradients"] > 0
        assert memory["optimizer"] > 0  # after the training steps, the optimizer state exists
        assert inference["status"] == "ok", inference["error"]
        assert inference["batch"] == rows and inference["median_ms"] > 0
        assert len(inference["step_times"]) == wl.steps - 1  # one warm-up call, then a call per round
        assert inference["weights_bytes"] == memory["inference_weights"] > 0
        compute = {"float32": "float32", "bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[policy]
        assert compute in inference["how"], inference["how"]
        value = inference["eval"]["value"]
        assert math.isfinite(value) and inference["eval"]["metric"] == record["eval"]["metric"]
        # infer() is the trained network: its metric is the training forward pass's, up to rounding
        assert value == pytest.approx(record["eval"]["value"], rel=0.02)
    base = records["float32"]["inference"]
    assert base["paired"] is None
    if framework == "mxnet" and mxnet_bf16_refused(records["bf16-mixed"]):
        pytest.skip(records["bf16-mixed"]["error"])  # float32 checked above; no bf16 to pair with
    bf16 = records["bf16-mixed"]["inference"]
    paired = bf16["paired"]
    assert paired["rounds"] == wl.steps - 1 and paired["speedup"] > 0
    assert paired["pairing"] == (LOCKSTEP if framework == "mxnet" else IN_PROCESS)
    assert paired["ci95"][0] <= paired["speedup"] <= paired["ci95"][1]
    assert bf16["weights_bytes"] <= base["weights_bytes"]
    if framework in LOW_PRECISION_WEIGHTS:
        assert bf16["weights_bytes"] * 2 == base["weights_bytes"]


SHARED_VS_FRESH = [(f, "charlm", p) for p in ("float32", "bf16-mixed") for f in ("tensorflow", "torch")]


@pytest.fixture(scope="module")
def fresh_runs(quick_report):
    """Each case of SHARED_VS_FRESH run alone in a fresh process (two such runs side by side)."""
    _, frameworks = quick_report
    cases = [case for case in SHARED_VS_FRESH if case[0] in frameworks]
    with ThreadPoolExecutor(2) as pool:
        fresh = pool.map(lambda case: runner.run([case], quick=True, reuse=False, budget=120.0)[0], cases)
        return dict(zip(cases, fresh))


@pytest.mark.parametrize("policy", ["float32", "bf16-mixed"])
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_case_in_a_shared_process_trains_as_in_a_fresh_one(quick_report, fresh_runs, framework, policy):
    """charlm ran after mlp's cases in the quick run's process, its steps interleaved with the other
    policies' in rounds: no policy leaks into another."""
    out, frameworks = quick_report
    if framework not in frameworks:
        pytest.skip(f"{framework} is not installed")
    cases = json.loads((out / "report.json").read_text())["cases"]
    key = (framework, "charlm", policy)
    shared = next(c for c in cases if (c["framework"], c["workload"], c["policy"]) == key)
    assert shared["process_case"] > 0 and len(shared["group_policies"]) == 3
    fresh = fresh_runs[key]
    assert fresh["process_case"] == 0 and not fresh["capped"]
    n = len(shared["losses"])  # on a busy machine the shared one may have been capped after its warm-up
    assert fresh["losses"][:n] == pytest.approx(shared["losses"], rel=1e-6)
    if not shared["capped"]:
        assert fresh["eval"]["value"] == pytest.approx(shared["eval"]["value"], rel=1e-6)


def test_speedups_are_recomputable_from_step_times(quick_report):
    """A speed-up is the median over the rounds both ran of float32's step time / the case's (a
    case that spent its budget on its warm-up: float32's median / that one step)."""
    out, _ = quick_report
    report = json.loads((out / "report.json").read_text())
    cases = {(c["framework"], c["workload"], c["policy"]): c for c in report["cases"]}
    for row in (r for r in report["rows"] if r["status"] == "ok" and r["policy"] != "float32"):
        base = cases[(row["framework"], row["workload"], "float32")]["step_times"]
        case = cases[(row["framework"], row["workload"], row["policy"])]["step_times"]
        if row["speedup_rounds"]:
            assert row["speedup_rounds"] == min(len(base), len(case))
            expected = statistics.median(b / c for b, c in zip(base, case))
        else:
            expected = statistics.median(base) / case[0]
        assert row["speedup"] == pytest.approx(expected, rel=1e-9)
        across = row["framework"] == "mxnet"  # one process per policy, stepped in turn
        assert row["pairing"] == ("rounds across processes" if across else "rounds in one process")
    assert (out / "report.md").read_text().count("|") > 20
    for name in ("speedup.png", "loss_curves.png", "loss_scale.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _broken_python(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'simulated interpreter crash' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    return str(broken)


def test_a_crash_and_a_timeout_are_reported_and_the_run_finishes(tmp_path, monkeypatch, capsys):
    broken = _broken_python(tmp_path)
    real = interpreters.interpreter
    monkeypatch.setattr(interpreters, "interpreter", lambda f: broken if f == "jax" else real(f))
    slow = runner.run([("torch", "mlp", "float32")], quick=True, timeout=0.5)
    assert slow[0]["status"] == "timeout" and "0.5 s" in slow[0]["error"]
    code = main(["compare", "--quick", "--frameworks", "jax,torch", "--workloads", "digits",
                 "--policies", "float32", "--out", str(tmp_path / "r")])  # fmt: skip
    assert code == 1  # a case crashed
    crashed = capsys.readouterr().err.split("polyamp compare: 1 of 2 cases crashed:\n", 1)[1]
    assert crashed == "  jax digits float32: failed: exit code 3: simulated interpreter crash\n"
    records = {c["framework"]: c for c in json.loads((tmp_path / "r" / "report.json").read_text())["cases"]}
    assert records["jax"]["status"] == "failed" and "simulated interpreter crash" in records["jax"]["error"]
    assert records["torch"]["status"] == "ok"
    text = (tmp_path / "r" / "report.md").read_text()
    assert "simulated interpreter crash" in text and "failed" in text


def test_a_process_that_dies_costs_only_the_case_it_was_on(tmp_path, monkeypatch):
    """Cases sharing processes (MXNet: one per policy, stepped in lock-step): after a crash the runner
    starts a new process for the pair groups left; each case starts (with its pair group) before it
    ends, and the records come back in the order of the cases."""
    monkeypatch.setenv("POLYAMP_MXNET_PYTHON", _broken_python(tmp_path))
    cases = [("mxnet", "mlp", "float32"), ("mxnet", "digits", "float32"), ("mxnet", "mlp", "bf16-mixed")]
    seen = []

    def progress(i, case, record):
        seen.append((i, case, record is None))

    records = runner.run(cases, quick=True, jobs=1, progress=progress)
    assert [(r["framework"], r["workload"], r["policy"]) for r in records] == cases
    assert all(r["status"] == "failed" and "simulated interpreter crash" in r["error"] for r in records)
    mlp, digits = [(0, cases[0], True), (0, cases[2], True)], [(2, cases[1], True)]  # the pair groups
    assert seen == mlp + [(0, cases[0], False), (1, cases[2], False)] + digits + [(2, cases[1], False)]
    assert len({r["worker_pid"] for r in records}) == 3  # the crashed processes were not reused


def _args(**given):
    args = dict(frameworks="torch", workloads="digits", policies="float32", steps=None, quick=True,
                budget=6.0, timeout=300.0, out="unused", json=False)  # fmt: skip
    return argparse.Namespace(**{**args, **given})


@pytest.mark.parametrize(
    ("option", "value"),
    [("steps", 0), ("steps", -3), ("steps", 1.5), ("steps", True), ("budget", -1.0), ("budget", 0),
     ("budget", float("nan")), ("timeout", 0), ("timeout", -5.0), ("timeout", float("inf")),
     ("timeout", "10")],
)  # fmt: skip
def test_compare_refuses_options_no_case_could_run_with(option, value, tmp_path):
    with pytest.raises(PolyampError, match=f"{option} must be .*; got {value!r}"):
        compare(_args(**{option: value}, out=str(tmp_path)))
    assert not any(tmp_path.iterdir())  # refused before any case ran
    with pytest.raises(PolyampError, match=f"{option} must be"):
        runner.run([("torch", "digits", "float32")], quick=True, **{option: value})


def test_a_worker_refuses_steps_below_one_by_name():
    with pytest.raises(PolyampError, match="steps must be a whole number >= 1.*got 0"):
        get_workload("mlp", steps=0)
    assert get_workload("mlp", quick=True, steps=1).steps == 1


def test_bad_compare_arguments(capsys):
    assert main(["compare", "--frameworks", "caffe"]) == 2
    assert "unknown framework 'caffe'" in capsys.readouterr().err
    assert main(["compare", "--workloads", "imagenet"]) == 2
    assert "unknown workload 'imagenet'" in capsys.readouterr().err
    assert main(["compare", "--policies", "fp12"]) == 2
    assert "'fp12'" in capsys.readouterr().err


def test_mxnet_is_found_from_any_directory_or_reported_with_how_to_install(tmp_path, monkeypatch):
    """MXNet's interpreter: --mxnet-python / POLYAMP_MXNET_PYTHON, else the project's .venv-mxnet
    wherever compare runs from; without one, its cases are rows saying how to install it."""
    monkeypatch.delenv("POLYAMP_MXNET_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .venv-mxnet here
    expected = "mxnet" if interpreters.PROJECT_MXNET_PYTHON.exists() else None
    assert ("mxnet" in interpreters.installed_frameworks()) == (expected == "mxnet")
    monkeypatch.setattr(interpreters, "PROJECT_MXNET_PYTHON", tmp_path / "nowhere" / "python")
    assert "mxnet" not in interpreters.installed_frameworks()
    assert ("mxnet", "digits", "float32") in runner.plan(workloads=["digits"])  # not dropped
    with pytest.raises(PolyampError, match=r"mxnet is not installed here \(MXNet 1.9 needs numpy<1.24"):
        runner.plan(frameworks=["mxnet"])
    records = runner.run([("mxnet", "digits", "float32"), ("mxnet", "mlp", "float32")], quick=True)
    assert [r["status"] for r in records] == [interpreters.NOT_INSTALLED] * 2
    assert all("make venv-mxnet" in r["error"] and "--mxnet-python" in r["error"] for r in records)
    monkeypatch.setenv("POLYAMP_MXNET_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(PolyampError, match="MXNet interpreter .*missing.* does not exist"):
        interpreters.installed_frameworks()
    code = main(["compare", "--frameworks", "mxnet", "--mxnet-python", str(tmp_path / "missing"),
                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert code == 2


def test_recipes_are_compare_policies_on_every_framework():
    frameworks = ["torch", "tensorflow", "jax", "mxnet"]
    policies = ["bf16-mixed", "MXFP8", "nvfp4:keep=:grad_rounding=nearest", "fp8-delayed"]
    cases = runner.plan(frameworks=frameworks, workloads=["digits"], policies=policies)
    assert {c[2] for c in cases} == {"bf16-mixed", "mxfp8", *policies[2:]}
    assert {c[0] for c in cases} == set(frameworks) and len(cases) == 16
    hadamard = runner.plan(frameworks=frameworks, workloads=["digits"], policies=["nvfp4:hadamard=true"])
    assert hadamard == [(f, "digits", "nvfp4:hadamard=true") for f in frameworks]
