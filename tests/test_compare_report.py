"""The compare report: comparisons against float32, tolerance verdicts, tables, report files and plots."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest

from polyamp.compare import curves, plots, report
from polyamp.compare.report import ROW_KEYS, summarize, terminal_table, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VERSIONS = {"torch": "2.13.0", "jax": "0.4.38"}
EVALS = {"mlp": None, "charlm": ("heldout_loss", False), "digits": ("accuracy", True)}


def make_case(framework, workload, policy, *, step_s=0.1, steps=30, requested=None, loss0=2.0, rate=0.05,
              eval_value=None, status="ok", error=None, cap_reason=None, scale=None, seed=0):  # fmt: skip
    """A consistent synthetic record as the runner writes it: losses, step_times, scales and eval."""
    if status != "ok":
        return {
            "framework": framework,
            "workload": workload,
            "policy": policy,
            "status": status,
            "error": error,
        }
    requested = requested or steps
    losses = [loss0 * math.exp(-rate * k) for k in range(1, steps + 1)]
    step_times = [step_s * (1 + 0.02 * ((k * 7) % 5 - 2)) for k in range(max(steps - 1, 1))]
    if scale is None:
        scales = [1.0] * steps
    else:  # dynamic loss scale: halves at step 3, grows back every 10 steps
        scales = [scale / 2 * 2 ** (k // 10) if k >= 3 else scale for k in range(steps)]
    ev = None
    if EVALS[workload] is not None:
        metric, higher = EVALS[workload]
        value = eval_value if eval_value is not None else (0.9 if higher else losses[-1] * 1.1)
        ev = {"metric": metric, "value": value, "higher_is_better": higher}
    return {
        "framework": framework, "framework_version": VERSIONS.get(framework, "2.20"),
        "workload": workload, "policy": policy, "seed": seed, "status": "ok", "error": None,
        "steps": steps, "steps_requested": requested, "capped": steps < requested,
        "cap_reason": cap_reason, "warmup_steps": 1, "step_times": step_times,
        "median_step_s": statistics.median(step_times), "peak_rss_mb": 800.0 + 10 * len(policy),
        "losses": losses, "eval": ev, "skipped_steps": 2 if scale else 0, "scales": scales,
        "wall_s": 5.0 + steps * step_s,
    }  # fmt: skip


FP16_CAP = "one step took 10.0 s; budget 5 s"
FAILED_ERR = "RuntimeError: jax digits fp16 diverged with |grad| = inf at step 3"
TIMEOUT_ERR = "no result within the 300 s timeout of a case"


def synthetic_cases() -> list[dict]:
    cases = []
    for wl in ("mlp", "charlm", "digits"):
        cases.append(make_case("torch", wl, "float32", step_s=0.1, eval_value={"digits": 0.95}.get(wl)))
        cases.append(make_case("torch", wl, "bf16-mixed", step_s=0.05, loss0=2.02,
                               eval_value={"digits": 0.94}.get(wl)))  # fmt: skip
        cases.append(make_case("torch", wl, "fp16-mixed", step_s=10.0, steps=1, requested=30, loss0=2.01,
                               cap_reason=FP16_CAP, scale=65536.0))  # fmt: skip
        cases.append(make_case("jax", wl, "float32", step_s=0.08, eval_value={"digits": 0.96}.get(wl)))
        cases.append(make_case("jax", wl, "bf16-mixed", step_s=0.02, loss0=2.5,
                               eval_value={"digits": 0.90}.get(wl)))  # fmt: skip
    cases.append(make_case("jax", "mlp", "fp16-mixed", step_s=0.07, scale=32768.0))
    cases.append(make_case("jax", "digits", "fp16-mixed", status="failed", error=FAILED_ERR))
    cases.append(make_case("jax", "charlm", "fp16-mixed", status="timeout", error=TIMEOUT_ERR))
    cases.append(make_case("tensorflow", "mlp", "bf16-mixed", step_s=0.2))  # no float32 requested
    return cases


def find(rows, framework, workload, policy):
    """The row of a case, from summarize (a Row) or from report.json (a dict)."""

    def key(r):
        if isinstance(r, dict):
            return r["framework"], r["workload"], r["policy"]
        return r.framework, r.workload, r.policy

    (row,) = [r for r in rows if key(r) == (framework, workload, policy)]
    return row


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    settings = {
        "machine": {"cpu": "Test CPU 9000", "cores": 16},
        "versions": {"torch": "2.13.0"},
        "steps": 30,
    }
    paths = write_report(synthetic_cases(), settings, out)
    return out, paths


def test_rows_have_exactly_the_documented_keys_and_each_workloads_tolerance(written):
    rows = summarize(synthetic_cases(), tolerances={"digits": 0.03})
    assert len(rows) == len(synthetic_cases())
    doc = json.loads(open(written[1]["json"]).read())
    assert all(tuple(r) == ROW_KEYS for r in doc["rows"])
    assert find(rows, "torch", "digits", "bf16-mixed").tolerance == 0.03  # overridden
    assert find(rows, "torch", "charlm", "bf16-mixed").tolerance == 0.05  # CharLM's own
    assert find(rows, "torch", "mlp", "bf16-mixed").baseline == "torch float32"


def test_speedups_in_json_equal_the_ratio_of_medians_recomputed_from_step_times(written):
    _, paths = written
    doc = json.loads(open(paths["json"]).read())
    cases = {(c["framework"], c["workload"], c["policy"]): c for c in doc["cases"]}
    checked = 0
    for row in doc["rows"]:
        key = (row["framework"], row["workload"], row["policy"])
        base = cases.get((row["framework"], row["workload"], "float32"))
        if row["status"] != "ok" or base is None:
            assert row["speedup"] is None
            continue
        expected = statistics.median(base["step_times"]) / statistics.median(cases[key]["step_times"])
        assert row["speedup"] == pytest.approx(expected, rel=1e-12)
        checked += 1
    assert checked == 16
    assert find(doc["rows"], "torch", "mlp", "fp16-mixed")["speedup"] == pytest.approx(0.01, rel=0.05)
    assert find(doc["rows"], "torch", "mlp", "bf16-mixed")["speedup"] == pytest.approx(2.0, rel=0.05)
    assert find(doc["rows"], "torch", "digits", "bf16-mixed")["tolerance"] == 0.02


def test_capped_case_is_compared_with_the_baseline_loss_at_the_same_step():
    cases = synthetic_cases()
    rows = summarize(cases)
    row = find(rows, "torch", "charlm", "fp16-mixed")
    base = next(
        c for c in cases if (c["framework"], c["workload"], c["policy"]) == ("torch", "charlm", "float32")
    )
    assert row.steps == 1 and row.capped
    assert row.loss_compared_at_step == 1
    assert row.loss_delta == pytest.approx(2.01 * math.exp(-0.05) - base["losses"][0], rel=1e-12)
    assert row.loss_delta != pytest.approx(row.final_loss - base["losses"][-1])
    # held-out loss after 1 step vs after 30 steps is not a comparison: no delta, a note instead
    assert row.eval_delta is None
    assert any("not compared" in n for n in row.notes)
    assert row.parity_basis == "train_loss@step1" and row.parity == "ok"


def test_eval_delta_only_with_equal_step_counts():
    base = make_case("torch", "digits", "float32", eval_value=0.95)
    same = make_case("torch", "digits", "bf16-mixed", eval_value=0.94)
    fewer = make_case("torch", "digits", "fp16-mixed", steps=20, requested=30, eval_value=0.94)
    rows = summarize([base, same, fewer])
    assert rows[1].eval_delta == pytest.approx(-0.01)
    assert rows[2].eval_delta is None and rows[2].loss_delta is not None


def test_a_capped_baseline_is_compared_at_its_last_step():
    base = make_case("jax", "mlp", "float32", steps=5)
    case = make_case("jax", "mlp", "bf16-mixed", steps=8, loss0=2.05)
    row = summarize([base, case])[1]
    assert row.loss_compared_at_step == 5 and row.speedup is not None
    assert row.loss_delta == pytest.approx(case["losses"][4] - base["losses"][4], rel=1e-12)
    assert row.parity_basis == "train_loss@step5" and row.parity == "ok"  # 2.5 % above
    assert any("train loss compared at step 5" in n for n in row.notes)
    worse = summarize([base, make_case("jax", "mlp", "bf16-mixed", steps=8, loss0=2.2)])[1]
    assert worse.parity == "worse"


@pytest.mark.parametrize(
    ("base_value", "case_value", "loss_tol", "verdict"),
    [(2.0, 2.1, 0.05, "ok"), (2.0, 2.1002, 0.05, "worse"), (2.0, 1.5, 0.05, "ok"), (2.0, 2.1, 0.01, "worse")],
)
def test_loss_parity_at_the_relative_tolerance_boundary(base_value, case_value, loss_tol, verdict):
    base = make_case("torch", "charlm", "float32", eval_value=base_value)
    case = make_case("torch", "charlm", "bf16-mixed", eval_value=case_value)
    row = summarize([base, case], tolerances={"charlm": loss_tol})[1]
    assert (row.parity, row.parity_basis) == (verdict, "heldout_loss")
    assert row.parity_diff == pytest.approx((case_value - base_value) / base_value)


@pytest.mark.parametrize(("case_value", "verdict"), [(0.93, "ok"), (0.9299, "worse"), (0.99, "ok")])
def test_accuracy_parity_at_the_absolute_tolerance_boundary(case_value, verdict):
    base = make_case("torch", "digits", "float32", eval_value=0.95)
    case = make_case("torch", "digits", "bf16-mixed", eval_value=case_value)
    row = summarize([base, case])[1]
    assert (row.parity, row.parity_basis) == (verdict, "accuracy")


def test_train_loss_parity_when_there_is_no_eval():
    base = make_case("torch", "mlp", "float32", loss0=1.0, rate=0.0)
    ok = make_case("torch", "mlp", "bf16-mixed", loss0=1.05, rate=0.0)
    worse = make_case("torch", "mlp", "fp16-mixed", loss0=1.0501, rate=0.0)
    rows = summarize([base, ok, worse])
    assert [r.parity for r in rows] == ["n/a", "ok", "worse"]
    assert rows[1].parity_basis == "train_loss@step30"


def test_diverged_case_is_worse_and_the_json_stays_strict(tmp_path):
    base = make_case("torch", "mlp", "float32")
    diverged = make_case("torch", "mlp", "fp16-mixed", scale=1024.0)
    diverged["losses"][-1] = float("nan")
    diverged["step_times"][0] = float("inf")
    row = summarize([base, diverged])[1]
    assert row.parity == "worse" and math.isnan(row.loss_delta)

    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")

    doc = json.loads(
        open(write_report([base, diverged], {}, tmp_path)["json"]).read(), parse_constant=no_constants
    )
    assert doc["cases"][1]["losses"][-1] is None and doc["rows"][1]["loss_delta"] is None
    assert doc["cases"][1]["losses"][0] == pytest.approx(diverged["losses"][0])
    assert "outside tolerance" in open(tmp_path / "report.md", encoding="utf-8").read()


def test_missing_or_failed_baseline_gives_no_comparisons():
    rows = summarize(synthetic_cases())
    row = find(rows, "tensorflow", "mlp", "bf16-mixed")
    assert row.baseline is None and row.speedup is None and row.loss_delta is None
    assert row.parity == "n/a" and "no float32 baseline (float32 not run)" in row.notes
    failed_base = summarize(
        [
            make_case("jax", "mlp", "float32", status="failed", error="boom"),
            make_case("jax", "mlp", "bf16-mixed"),
        ]
    )
    assert (
        failed_base[1].speedup is None
        and "no float32 baseline (float32 failed)" in failed_base[1].notes
    )


def test_terminal_table_marks_slow_capped_failed_and_missing_baseline():
    rows = summarize(synthetic_cases())
    text = terminal_table(rows, width=190)
    assert "\x1b[" not in text
    lines = text.splitlines()
    fp16 = [i for i, line in enumerate(lines) if line.split()[:3] == ["torch", "mlp", "fp16-mixed"]]
    assert len(fp16) == 1
    cell = lines[fp16[0]] + lines[fp16[0] + 1]  # a cell may wrap onto a second line
    assert "1/30" in cell and "0.01x" in cell and "(capped)" in cell and "(slower)" in cell
    assert "2.00x" in text and "4.00x" in text
    words = " ".join(text.split())  # rich wraps long cells over several lines
    assert "failed:" in words and "RuntimeError:" in words and "diverged with" in words
    assert "timeout:" in words and "timeout of a case" in words
    assert "no fp32" in words and "baseline" in words
    assert max(len(line) for line in text.splitlines()) <= 190
    assert "Not shown at this terminal width" not in text  # every column fits in 190
    assert "\x1b[" in terminal_table(rows, color=True)


def test_terminal_table_without_rich(monkeypatch):
    _without_rich(monkeypatch)
    text = terminal_table(summarize(synthetic_cases()), width=200)
    lines = text.splitlines()
    assert lines[0].startswith("framework") and "speed-up vs fp32" in lines[0]
    assert "0.01x (slower)" in text and "1/30 (capped)" in text and "timeout: no result" in text


def _without_rich(monkeypatch):
    for name in ("rich", "rich.box", "rich.console", "rich.table", "rich.markup", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
@pytest.mark.parametrize("width", [80, 100])
def test_terminal_table_fits_the_terminal_width(width, rich, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(width))  # what shutil.get_terminal_size() reads first
    if not rich:
        _without_rich(monkeypatch)
    rows = summarize(synthetic_cases())
    text = terminal_table(rows)
    assert max(len(line) for line in text.splitlines()) <= width
    lines = text.splitlines()
    header = " ".join(lines[:3])
    for column in ("framework", "workload", "policy", "status", "speed-up", "parity"):
        assert column in header, column
    assert ("ms/step" in header) == (width == 100)
    for row in rows:  # every case keeps its row
        assert any(line.split()[:3] == [row.framework, row.workload, row.policy] for line in lines)
    words = " ".join(text.split())
    assert "failed: RuntimeError:" in words and "timeout: no result" in words
    assert "0.01x (slower)" in words
    left_out = words.split("Not shown at this terminal width: ", 1)[1]
    assert left_out.startswith("steps,") and "peak MB" in left_out
    assert left_out.endswith("(report.md has every column).")


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_a_smoke_check_is_labelled_so_in_the_table_the_markdown_and_the_json(rich, tmp_path, monkeypatch):
    if not rich:
        _without_rich(monkeypatch)
    rows = summarize(synthetic_cases())
    table = " ".join(terminal_table(rows, width=120, smoke=True).split())
    assert table.startswith("Smoke check (--quick):") and "they are not findings" in table
    assert "(slower)" not in table and "0.01x" in table  # a smoke check reports no finding
    paths = write_report(synthetic_cases(), {"quick": True}, tmp_path)
    doc = json.loads(open(paths["json"]).read())
    assert doc["timings"]["kind"] == "smoke check" and "not findings" in doc["timings"]["note"]
    md = open(paths["markdown"], encoding="utf-8").read()
    assert md.startswith("# polyamp compare report (smoke check)\n\n> **Smoke check (--quick):")
    assert "Smoke check (--quick): tiny models and a few steps; no speed verdict" in md
    assert doc["verdict"]["smoke"] is True and "no speed verdict" in doc["verdict"]["sentences"][0]
    assert "slower than float32" not in md and "(slower)" not in md


def test_a_measured_run_is_not_labelled_a_smoke_check(written):
    _, paths = written
    assert json.loads(open(paths["json"]).read())["timings"]["kind"] == "measurement"
    assert "Smoke check" not in open(paths["markdown"], encoding="utf-8").read()
    assert "Smoke check" not in terminal_table(summarize(synthetic_cases()), width=120)


def test_markdown_lists_each_package_version_once(tmp_path):
    cases = []
    for policy in ("float32", "bf16-mixed"):
        case = make_case("tensorflow", "mlp", policy)
        case.update(framework_version="2.21.0", versions={"tensorflow": "2.21.0", "keras": "3.15.1"})
        cases.append(case)
    cases.append(make_case("torch", "mlp", "float32"))  # a record without "versions"
    md = open(write_report(cases, {}, tmp_path)["markdown"], encoding="utf-8").read()
    line = next(x for x in md.splitlines() if "framework versions" in x)
    assert line.endswith(": tensorflow 2.21.0, keras 3.15.1, torch 2.13.0")


def test_markdown_lists_settings_capped_errors_and_what_comparisons_are_against(written):
    _, paths = written
    md = open(paths["markdown"], encoding="utf-8").read()
    assert md.startswith("# polyamp compare report")
    assert "Test CPU 9000" in md and "torch 2.13.0" in md and "jax 0.4.38" in md
    assert "| framework | workload | policy |" in md
    assert "**1/30 (capped)**" in md and "**0.01x (slower)**" in md
    notes = md.split("## Notes", 1)[1]
    assert f"torch mlp fp16-mixed ran 1 of 30 steps: {FP16_CAP}" in notes
    assert FAILED_ERR in notes and TIMEOUT_ERR in notes
    assert "against float32 of the same framework, workload and seed" in notes
    assert "a train loss may be at most 5% above fp32" in notes and "digits 0.02" in notes
    assert "tensorflow mlp bf16-mixed: no float32 baseline" in notes
    for name in report.PLOTS:
        assert f"]({name})" in md
    assert md.index("## Verdict") < md.index("](speedup.png)") < md.index("## Settings")


def test_plots_are_valid_pngs_of_plausible_size(written):
    import matplotlib.image

    out, paths = written
    assert [p.rsplit("/", 1)[-1] for p in paths["plots"]] == list(report.PLOTS)
    for path in paths["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE
        image = matplotlib.image.imread(path)
        height, width = image.shape[:2]
        assert 300 <= height <= 4000 and 500 <= width <= 4000
        assert image.std() > 0.01  # not a blank canvas


def test_plot_axes_scales_and_labels():
    import matplotlib

    rows = summarize(synthetic_cases())
    with matplotlib.rc_context(plots.RC):
        speed = plots.speedup_figure(rows)
        scale = curves.scale_figure(rows, synthetic_cases())
        none = curves.scale_figure(
            summarize([make_case("jax", "mlp", "float32")]), [make_case("jax", "mlp", "float32")]
        )
    assert [ax.get_title() for ax in speed.axes] == ["mlp", "charlm", "digits"]
    assert all(ax.get_yscale() == "log" for ax in speed.axes)
    assert "log scale" in speed.axes[0].get_ylabel()
    assert any(t.get_text() == "0.01x" for t in speed.axes[0].texts)
    assert [ax.get_title() for ax in scale.axes] == ["torch", "jax"]
    assert all(ax.get_yscale() == "log" and ax.get_ylabel() == "loss scale (log2)" for ax in scale.axes)
    assert "No case used loss scaling" in none.axes[0].texts[0].get_text()


def test_importing_the_report_module_imports_no_plotting_or_framework():
    code = (
        "import sys, tempfile\n"
        "import polyamp, polyamp.compare.report as r\n"
        "heavy = ('matplotlib', 'torch', 'tensorflow', 'jax', 'mxnet', 'rich')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
        "case = {'framework': 'torch', 'workload': 'mlp', 'policy': 'float32', 'status': 'ok', 'steps': 2,\n"
        "        'losses': [1.0, 0.5], 'step_times': [0.1], 'scales': [1.0, 1.0]}\n"
        "r.write_report([case], {}, tempfile.mkdtemp())\n"
        "print('matplotlib' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["", "True"]
