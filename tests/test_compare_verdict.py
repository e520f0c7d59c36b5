"""The report's verdict, memory and inference sections, from synthetic records as the worker writes them."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from test_compare_report import find, make_case

from polyamp.compare import verdict as verdicts
from polyamp.compare.report import row_from_json, summarize, write_report

MiB = 2**20


def with_memory(case, activations, copies=0, parameters=64 * MiB, optimizer=128 * MiB, master=0):
    case["memory"] = {
        "parameters": parameters, "gradients": parameters, "master": master, "optimizer": optimizer,
        "activations": activations, "weight_copies": copies, "workspace": None,
        "inference_weights": parameters // (2 if copies else 1),
        "how": {"activations": "saved_tensors_hooks", "optimizer": "state arrays", "workspace": "n/a: none"},
    }  # fmt: skip
    case["memory_error"] = None
    return case


def with_inference(case, ms, speedup=None, value=None, status="ok", error=None):
    case["inference"] = {
        "status": status, "error": error, "how": "inference_mode under autocast", "batch": 256,
        "step_times": [ms / 1e3] * 7 if status == "ok" else [], "median_ms": ms if status == "ok" else None,
        "capped": False, "cap_reason": None,
        "paired": None if speedup is None else {
            "speedup": speedup, "ci95": [speedup * 0.9, speedup * 1.1], "rounds": 7, "baseline": "float32",
            "pairing": "rounds in one process"},
        "eval": None if value is None else {"metric": "accuracy", "value": value, "higher_is_better": True},
        "weights_bytes": case.get("memory", {}).get("inference_weights", 0),
    }  # fmt: skip
    return case


def paired(case, speedup, ci=None, rounds=9):
    case["paired"] = {"speedup": speedup, "ci95": ci or [speedup * 0.95, speedup * 1.05], "rounds": rounds,
                      "baseline": "float32", "pairing": "rounds in one process"}  # fmt: skip
    return case


def digits_cases():
    """torch: bf16 1.6x faster at parity, fp16 30x slower; jax: bf16 faster but outside tolerance,
    fp16 unsupported; tensorflow: float32 fastest anywhere, bf16 barely slower."""
    t32 = with_inference(
        with_memory(
            make_case("torch", "digits", "float32", step_s=0.010, eval_value=0.96), activations=40 * MiB
        ),
        ms=2.0,
        value=0.96,
    )
    t16b = paired(make_case("torch", "digits", "bf16-mixed", step_s=0.00625, eval_value=0.955), 1.6)
    t16b = with_inference(
        with_memory(t16b, activations=20 * MiB, copies=8 * MiB), ms=1.0, speedup=2.0, value=0.955
    )
    t16 = paired(make_case("torch", "digits", "fp16-mixed", step_s=0.3, eval_value=0.96), 1 / 30)
    t16 = with_inference(
        with_memory(t16, activations=20 * MiB, copies=8 * MiB), ms=30.0, speedup=1 / 15, value=0.96
    )
    j32 = with_memory(
        make_case("jax", "digits", "float32", step_s=0.012, eval_value=0.96), activations=40 * MiB
    )
    jb = paired(make_case("jax", "digits", "bf16-mixed", step_s=0.004, eval_value=0.90), 3.0)
    j16 = make_case("jax", "digits", "fp16-mixed", status="unsupported",
                    error="PolyampError: fp16 is not supported here\nsecond line")  # fmt: skip
    f32 = make_case("tensorflow", "digits", "float32", step_s=0.003, eval_value=0.96)
    fb = paired(
        make_case("tensorflow", "digits", "bf16-mixed", step_s=0.0031, eval_value=0.96), 0.98, [0.95, 1.01]
    )
    return [t32, t16b, t16, j32, jb, j16, f32, fb]


def test_each_framework_best_configuration_at_parity_is_ranked_by_step_time():
    v = verdicts.build(summarize(digits_cases()))
    bests = v.best["digits"]
    assert [(b.rank, b.framework, b.policy) for b in bests] == [
        (1, "tensorflow", "float32"),  # bf16 ran 0.98x: float32 stays tensorflow's fastest
        (2, "torch", "bf16-mixed"),
        (3, "jax", "float32"),  # jax bf16 is faster but outside tolerance: not a result
    ]
    torch = bests[1]
    assert torch.step_ms == pytest.approx(6.25) and torch.speedup == 1.6
    assert (torch.infer_policy, torch.infer_ms, torch.infer_speedup) == ("bf16-mixed", 1.0, 2.0)
    assert torch.activations_ratio == pytest.approx(0.5) and torch.state_ratio == pytest.approx(1.0)


def test_best_against_best_compares_the_fastest_mixed_with_the_fastest_float32_anywhere():
    v = verdicts.build(summarize(digits_cases()))
    pair = v.training["digits"]
    assert (pair.mixed, pair.fp32) == ("tensorflow bf16-mixed", "tensorflow float32")
    assert pair.ratio == pytest.approx(3.0 / 3.1)
    inference = v.inference["digits"]
    assert (inference.mixed, inference.fp32, inference.ratio) == ("torch bf16-mixed", "torch float32", 2.0)


def test_compatibility_matrix_says_works_slower_outside_tolerance_unsupported_with_reasons():
    v = verdicts.build(summarize(digits_cases()))
    cells = {(c.framework, c.policy): c for c in v.compatibility}
    assert set(cells) == {
        (f, p) for f in ("torch", "jax", "tensorflow") for p in ("bf16-mixed", "fp16-mixed")
    } - {("tensorflow", "fp16-mixed")}
    assert (cells["torch", "bf16-mixed"].verdict, cells["torch", "bf16-mixed"].reason) == (
        "works",
        "1.60x on digits",
    )
    assert cells["torch", "fp16-mixed"].verdict == "slower than fp32"
    assert cells["torch", "fp16-mixed"].reason.startswith("0.033x on digits")
    assert cells["jax", "bf16-mixed"].verdict == "outside tolerance"
    assert "digits (accuracy)" in cells["jax", "bf16-mixed"].reason
    assert cells["jax", "fp16-mixed"].verdict == "unsupported"
    assert cells["jax", "fp16-mixed"].reason == "PolyampError: fp16 is not supported here"
    assert cells["tensorflow", "bf16-mixed"].verdict == "works"  # 0.98x, but its interval reaches 1.01


def test_a_slow_dtype_is_explained_by_the_measured_matmul_peak():
    cases = digits_cases()
    for case in cases:
        if case["framework"] == "torch":
            case["roofline_peaks"] = {"gflops": {"float32": 800.0, "bfloat16": 2400.0, "float16": 9.0},
                                      "size": {}, "errors": {}}  # fmt: skip
    cells = {(c.framework, c.policy): c for c in verdicts.build(summarize(cases)).compatibility}
    assert cells["torch", "fp16-mixed"].reason.endswith(
        "its fp16 matmul peak here is 9 GFLOP/s against 800 for fp32"
    )
    assert "peak" not in cells["torch", "bf16-mixed"].reason  # bf16 is not slow: nothing to explain


def test_sentences_quote_the_numbers():
    sentences = verdicts.build(summarize(digits_cases())).sentences
    assert ("On this machine, bf16 on torch digits: training step 1.60x faster (95 % CI 1.52-1.68, "
            "9 rounds); inference 2.00x faster (95 % CI 1.80-2.20, 7 rounds); activations saved for "
            "backward 0.50x float32's; accuracy within 0.02 of float32's.") in sentences  # fmt: skip
    assert ("On this machine, bf16 on tensorflow digits: training step 0.98x float32's speed: no clear "
            "difference (95 % CI 0.95-1.01, 9 rounds); accuracy within 0.02 of float32's."
            ) in sentences  # fmt: skip
    assert any(
        s.startswith("On digits, the fastest training at parity is tensorflow bf16-mixed") for s in sentences
    )
    assert "fp16 on torch is slower than fp32: 0.033x on digits." in sentences
    assert any(s.startswith("fp16 on jax is unsupported: PolyampError") for s in sentences)
    assert not any("on jax digits" in s for s in sentences)  # outside tolerance: no speed claim


def test_a_smoke_check_gets_no_speed_verdict():
    v = verdicts.build(summarize(digits_cases()), smoke=True)
    assert len(v.sentences) == 1 and "no speed verdict" in v.sentences[0]
    assert "ranked" not in "\n".join(verdicts.markdown(v))


def test_memory_ratios_are_mixed_over_float32_by_kind():
    rows = summarize(digits_cases())
    bf16 = find(rows, "torch", "digits", "bf16-mixed").memory
    assert bf16.saved == 28 * MiB and bf16.state == 256 * MiB
    assert bf16.ratios == {"activations": 0.5, "saved": 0.7, "state": 1.0, "workspace": None,
                           "inference_weights": 0.5, "total": (256 + 28) / (256 + 40)}  # fmt: skip
    assert bf16.total == (256 + 28) * MiB
    assert find(rows, "jax", "digits", "bf16-mixed").memory.ratios["activations"] is None  # no probe recorded


def test_inference_is_compared_with_float32_inference():
    rows = summarize(digits_cases())
    inf = find(rows, "torch", "digits", "bf16-mixed").inference
    assert (inf.speedup, inf.rounds, inf.weights_ratio) == (2.0, 7, 0.5)
    assert inf.delta == pytest.approx(-0.005) and inf.parity == "ok"
    fp16 = find(rows, "torch", "digits", "fp16-mixed")
    assert fp16.inference.speedup == pytest.approx(1 / 15) and fp16.inference.parity == "ok"


def test_rows_survive_their_json_form():
    for row in summarize(digits_cases()):
        assert row_from_json(json.loads(json.dumps(asdict(row)))) == row


def test_report_opens_with_the_verdict_and_has_memory_and_inference_sections(tmp_path):
    paths = write_report(digits_cases(), {"machine": {"cores": 2}}, tmp_path)
    md = open(paths["markdown"], encoding="utf-8").read()
    assert (
        md.index("## Verdict")
        < md.index("### digits: each framework's fastest")
        < md.index("### Compatibility")
    )
    assert md.index("### Compatibility") < md.index("## Settings") < md.index("## Training")
    assert md.index("## Training") < md.index("## Inference") < md.index("## Memory") < md.index("## Notes")
    ranked = md.split("### digits: each framework's fastest", 1)[1].splitlines()
    assert ranked[5].startswith(
        "| 2 | torch | bf16-mixed | 6.25 | 1.60x [1.52-1.68] n=9 | bf16 1 ms (2.00x) | 0.50x"
    )
    memory = md.split("## Memory", 1)[1]
    assert (
        "| torch | digits | bf16-mixed | 20 | 8 | 64 | 64 | 0 | 128 | n/a | 284 | 0.96x | 0.70x | 0.50x | "
        "1.00x |" in memory
    )
    assert "- torch activations: saved_tensors_hooks" in memory
    inference = md.split("## Inference", 1)[1].split("## Memory")[0]
    assert (
        "| torch | digits | fp16-mixed | 30 | 0.067x [0.06-0.073] n=7 | accuracy=0.96 | +0 | ok |"
        in inference
    )
    doc = json.loads(open(paths["json"]).read())
    assert doc["verdict"]["training"]["digits"]["ratio"] == pytest.approx(3.0 / 3.1)
    assert [b["framework"] for b in doc["verdict"]["best"]["digits"]] == ["tensorflow", "torch", "jax"]


def test_every_plot_draws_memory_inference_and_roofline_data():
    import matplotlib

    from polyamp.compare import plots

    cases = digits_cases()
    cases[0]["roofline"] = {"compute_dtype": "float32", "flops_per_step": 10**9, "achieved_gflops": 200.0,
                            "peak_gflops": 800.0, "share": 0.25, "matmul_n": 1024}  # fmt: skip
    rows = summarize(cases)
    with matplotlib.rc_context(plots.RC):
        memory = plots.memory_figure(rows)
        inference = plots.inference_figure(rows)
        roofline = plots.roofline_figure(rows)
    assert len(memory.axes) == 3 and memory.axes[0].get_ylim()[0] == 0  # total, saved, state
    assert "0.96x" in [t.get_text() for t in memory.axes[0].texts]  # torch bf16: (256 + 28) / (256 + 40)
    labels = [t.get_text() for t in memory.axes[1].texts]
    assert "0.70x" in labels and "n/a" in labels  # torch bf16 saved; jax bf16 has no probe
    assert inference.axes[0].get_yscale() == "log"
    assert {"2 ms", "1 ms 2.00x", "30 ms 0.067x"} <= {t.get_text() for t in inference.axes[0].texts}
    assert "25%" in [t.get_text() for t in roofline.axes[0].texts]


def test_the_half_the_memory_claim_is_stated_from_the_measured_ratios():
    sentences = verdicts.build(summarize(digits_cases())).sentences
    assert (
        "Half the memory? Under bf16, the whole training state (parameters, gradients, masters, optimizer "
        "state and the activations saved for backward) is 0.96x of float32's; the activations saved for "
        "backward are torch 0.50x of float32's (over the workloads); with the low-precision weight copies "
        "saved beside them, 0.70x; parameters, "
        "gradients, float32 masters and optimizer state 1.00x." in sentences
    )


def test_a_peak_close_to_float32s_explains_nothing():
    rows = summarize(digits_cases())
    near = {"gflops": {"float32": 200.0, "float16": 190.0}, "errors": {}}
    far = {"gflops": {"float32": 200.0, "float16": 150.0}, "errors": {}}
    for peaks, explained in ((near, False), (far, True)):
        for row in rows:
            row.roofline_peaks = peaks
        assert ("matmul peak" in verdicts._peak_note(rows, "fp16-mixed")) is explained


def test_a_policy_faster_on_some_workloads_and_slower_on_others_works_with_a_caveat():
    cases = digits_cases()[:2]
    base = make_case("torch", "mlp", "float32", step_s=0.2)
    fast = paired(make_case("torch", "mlp", "bf16-mixed", step_s=0.1), 2.0)
    cases[1] = paired(cases[1], 0.8, [0.75, 0.85])  # digits bf16 now slower
    v = verdicts.build(summarize(cases + [base, fast]))
    (cell,) = [c for c in v.compatibility if c.policy == "bf16-mixed"]
    assert (cell.verdict, cell.reason) == ("works, slower on digits", "0.80x on digits (but 2.00x on mlp)")
    assert "bf16 on torch is slower than fp32 on some workloads: 0.80x on digits (but 2.00x on mlp)." in (
        v.sentences
    )


def test_the_default_runs_parity_is_labelled_a_smoke_check(tmp_path):
    md = open(write_report(digits_cases(), {}, tmp_path)["markdown"], encoding="utf-8").read()
    verdict = md.split("## Verdict", 1)[1].split("###", 1)[0]
    assert "Parity here is a smoke check (one seed, a few steps); `polyamp compare --converge`" in verdict
    assert "This parity is a smoke check (one seed, a few steps)" in md.split("## Notes", 1)[1]
