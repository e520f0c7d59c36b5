"""``polyamp compare --quick`` end to end: every installed framework, a real report."""

import json
import stat

import pytest

from polyamp.cli import main
from polyamp.compare import runner
from polyamp.compare.workloads import WORKLOADS, get_workload


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
    frameworks = runner.installed_frameworks()
    assert "torch" in frameworks
    code = main(["compare", "--quick", "--out", str(out), "--frameworks", ",".join(frameworks)])
    assert code == 0
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
        assert case["status"] == "ok", case.get("error")
        assert len(case["losses"]) == case["steps"] == len(case["scales"])
        assert case["median_step_s"] > 0 and case["peak_rss_mb"] > 50


def test_speedups_are_recomputable_from_step_times(quick_report):
    import statistics

    out, _ = quick_report
    report = json.loads((out / "report.json").read_text())
    cases = {(c["framework"], c["workload"], c["policy"]): c for c in report["cases"]}
    for row in (r for r in report["rows"] if r["status"] == "ok"):
        base = cases[(row["framework"], row["workload"], "float32")]
        case = cases[(row["framework"], row["workload"], row["policy"])]
        expected = statistics.median(base["step_times"]) / statistics.median(case["step_times"])
        assert row["speedup"] == pytest.approx(expected, rel=1e-9)
    assert (out / "report.md").read_text().count("|") > 20
    for name in ("speedup.png", "loss_curves.png", "loss_scale.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_crash_and_a_timeout_are_reported_and_the_run_finishes(tmp_path, monkeypatch):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'simulated interpreter crash' >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    real = runner.interpreter
    monkeypatch.setattr(runner, "interpreter", lambda f: str(broken) if f == "jax" else real(f))
    records = runner.run([("jax", "digits", "float32"), ("torch", "digits", "float32")], quick=True)
    assert records[0]["status"] == "failed" and "simulated interpreter crash" in records[0]["error"]
    assert records[1]["status"] == "ok"
    slow = runner.run([("torch", "mlp", "float32")], quick=True, timeout=0.5)
    assert slow[0]["status"] == "timeout" and "0.5 s" in slow[0]["error"]
    code = main(["compare", "--quick", "--frameworks", "torch,jax", "--workloads", "digits",
                 "--policies", "float32", "--out", str(tmp_path / "r")])  # fmt: skip
    assert code == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "simulated interpreter crash" in text and "failed" in text


def test_bad_compare_arguments(capsys):
    assert main(["compare", "--frameworks", "caffe"]) == 2
    assert "unknown framework 'caffe'" in capsys.readouterr().err
    assert main(["compare", "--workloads", "imagenet"]) == 2
    assert "unknown workload 'imagenet'" in capsys.readouterr().err
    assert main(["compare", "--policies", "fp12"]) == 2
    assert "'fp12'" in capsys.readouterr().err
