"""``polyamp compare --tuned``: tuned rows of every framework in paired rounds, and its verdict."""

import json
import statistics
import subprocess
import sys

import pytest
from frameworks import require

from polyamp.compare import tuned
from polyamp.errors import PolyampError
from polyamp.timing import PolicyTimes
from polyamp.tune import allocator


def _rows_and_times():
    rows = [tuned.TunedRow("torch", "mlp", "float32", {"optimizer": "fused"}),
            tuned.TunedRow("torch", "mlp", "bf16-mixed", {"optimizer": "fused"}),
            tuned.TunedRow("jax", "mlp", "float32", {"donate": True}),
            tuned.TunedRow("jax", "mlp", "bf16-mixed", {"donate": True})]  # fmt: skip
    seconds = {0: [0.40, 0.42, 0.41, 0.44], 1: [0.20, 0.22, 0.19, 0.21], 2: [0.30, 0.33, 0.29, 0.31],
               3: [0.25, 0.24, 0.26, 0.27]}  # fmt: skip
    times = {k: PolicyTimes(warmup_s=1.0, times=v) for k, v in seconds.items()}
    for k, row in enumerate(rows):
        row.times, row.losses = seconds[k], [2.0, 1.5, 1.2 + 0.01 * k, 1.0 + 0.01 * k]
    rooflines = {"torch": {"gflops": {"float32": 100.0, "bfloat16": 300.0}, "size": {}},
                 "jax": {"gflops": {"float32": 150.0}, "size": {}}}  # fmt: skip
    return rows, times, rooflines, seconds


def test_every_row_is_paired_with_the_fastest_float32_row_of_any_framework():
    rows, times, rooflines, seconds = _rows_and_times()
    tuned._score(rows, times, rooflines, quick=True)
    assert tuned.baseline(rows) == 2  # jax float32: median 0.305 s beats torch's 0.415 s
    for k, row in enumerate(rows):
        want = statistics.median(b / c for b, c in zip(seconds[2], seconds[k]))
        assert row.speedup == pytest.approx(want) and row.rounds == 4
        assert row.median_s == pytest.approx(statistics.median(seconds[k]))
    # each bf16 row against its own framework's float32 row, and its loss at the same step beside it
    own = statistics.median(a / b for a, b in zip(seconds[0], seconds[1]))
    assert rows[1].own_float32 == pytest.approx(own)
    assert (rows[1].loss, rows[1].float32_loss) == (pytest.approx(1.01), pytest.approx(1.0))
    assert rows[3].roofline_share is None and rows[1].roofline_share == pytest.approx(rows[1].gflops / 300.0)
    v = tuned.verdict(rows)
    assert v["best_bf16"] == rows[1].label and v["best_float32"] == rows[2].label
    assert v["speedup"] == pytest.approx(rows[1].speedup) and v["met"] == (rows[1].speedup >= tuned.TARGET)
    assert "torch bf16-mixed optimizer=fused" in v["text"] and "target 1.6x" in v["text"]


def test_a_failed_row_is_kept_with_its_error_and_leaves_the_verdict():
    rows, times, rooflines, _ = _rows_and_times()
    rows[1].status, rows[1].error, rows[1].times = "failed", "RuntimeError: boom", []
    times[1] = PolicyTimes(status="failed", error="RuntimeError: boom")
    tuned._score(rows, times, rooflines, quick=True)
    assert rows[1].speedup is None and tuned.verdict(rows)["best_bf16"] == rows[3].label
    result = {"rows": [tuned.asdict(r) for r in rows], "rooflines": rooflines, "verdict": tuned.verdict(rows)}
    text = tuned.markdown({"workloads": {"mlp": result}})
    assert "| torch bf16-mixed optimizer=fused | failed: RuntimeError: boom" in text


def test_a_report_without_a_bf16_configuration_is_refused_by_name():
    report = {"tuned": {"float32": {"policy": "float32", "settings": {}}}}
    with pytest.raises(PolyampError, match="torch mlp has no bf16-mixed configuration.*--policies"):
        tuned.rows_for({("torch", "mlp"): report}, ["torch"], "mlp")
    # every row comes once more in glibc malloc's heap mode, a process setting
    report["tuned"]["bf16-mixed"] = {"policy": "bf16-mixed", "settings": {"optimizer": "fused"}}
    rows = tuned.rows_for({("torch", "mlp"): report}, ["torch"], "mlp")
    assert [(r.policy, r.env) for r in rows] == [("float32", {}), ("bf16-mixed", {}),
                                                 ("float32", allocator.ENV), ("bf16-mixed", allocator.ENV)]


def test_a_heap_mode_row_is_paired_with_its_twin_and_its_own_float32_row():
    rows = [tuned.TunedRow("torch", "mlp", p, {}, env) for env in ({}, allocator.ENV)
            for p in ("float32", "bf16-mixed")]  # fmt: skip
    seconds = {0: [0.40, 0.42, 0.41], 1: [0.20, 0.22, 0.19], 2: [0.36, 0.40, 0.38], 3: [0.15, 0.17, 0.16]}
    for k, row in enumerate(rows):
        row.times, row.losses = seconds[k], [1.0, 0.9]
    times = {k: PolicyTimes(warmup_s=1.0, times=v) for k, v in seconds.items()}
    tuned._score(rows, times, {}, quick=True)
    assert rows[0].vs_as_started is None and rows[1].vs_as_started is None
    for heap, twin in ((2, 0), (3, 1)):
        want = statistics.median(a / b for a, b in zip(seconds[twin], seconds[heap]))
        assert rows[heap].vs_as_started == pytest.approx(want)
    own = statistics.median(a / b for a, b in zip(seconds[2], seconds[3]))  # heap bf16 over heap float32
    assert rows[3].own_float32 == pytest.approx(own) and tuned.baseline(rows) == 2
    text = tuned.markdown({"workloads": {"mlp": {"rows": [tuned.asdict(r) for r in rows], "rooflines": {},
                                                 "verdict": tuned.verdict(rows)}}})  # fmt: skip
    assert f"| {rows[3].label} |" in text and rows[3].label.endswith("malloc=heap")


@pytest.mark.parametrize("argv, message", [
    (["--policies", "fp16-mixed"], "takes no --policies"),
    (["--frameworks", "caffe"], "frameworks that polyamp tune is built for"),
])  # fmt: skip
def test_bad_options_are_refused_with_exit_2(tmp_path, argv, message):
    cmd = [sys.executable, "-m", "polyamp", "compare", "--tuned", str(tmp_path), "--quick", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr


def test_the_command_tunes_what_is_missing_and_steps_every_row_in_its_own_process(tmp_path):
    require("torch")
    folder, out = tmp_path / "reports", tmp_path / "out"
    cmd = [sys.executable, "-m", "polyamp", "compare", "--tuned", str(folder), "--quick", "--frameworks",
           "torch", "--workloads", "mlp", "--budget", "0.5", "--tune-budget", "8", "--steps", "6", "--out",
           str(out), "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (folder / "torch-mlp.json").exists()  # made by polyamp tune
    results = json.loads(done.stdout)
    assert json.loads((out / "tuned.json").read_text()) == results
    assert (out / "tuned.png").stat().st_size > 10_000 and "## mlp" in (out / "tuned.md").read_text()
    res = results["workloads"]["mlp"]
    assert [(r["policy"], r["env"]) for r in res["rows"]] == [
        ("float32", {}), ("bf16-mixed", {}), ("float32", allocator.ENV), ("bf16-mixed", allocator.ENV)]
    assert [r["vs_as_started"] is None for r in res["rows"]] == [True, True, False, False]
    for r in res["rows"]:
        assert r["status"] == "ok" and len(r["times"]) == 5 and r["rounds"] == 5
        assert abs(r["loss"] - r["float32_loss"]) <= 0.05 * abs(r["float32_loss"])
    assert res["rooflines"]["torch"]["gflops"]["bfloat16"] > 0
    verdict = res["verdict"]
    assert verdict["met"] == (verdict["speedup"] >= tuned.TARGET)
    assert verdict["best_float32"].startswith("torch float32")
    assert verdict["best_bf16"].startswith("torch bf16")
