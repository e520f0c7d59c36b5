"""Memory and paired inference in real ``--quick`` compare groups, one per installed framework.

torch, TensorFlow and JAX run as ``python -m polyamp.compare.worker`` (one process per group);
MXNet, whose AMP is process-wide, through the lock-step path (``lockstep.run_lockstep``: one
``worker --serve`` process per policy) with its own interpreter.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from frameworks import mxnet_bf16_refused

from polyamp.compare import interpreters, runner
from polyamp.compare.lockstep import run_lockstep
from polyamp.compare.workloads import get_workload
from polyamp.timing import IN_PROCESS, LOCKSTEP

POLICIES = ("float32", "bf16-mixed", "fp16-mixed")
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
# the trainers that keep the weights infer() reads in the compute dtype
LOW_PRECISION_WEIGHTS = {"jax"}


def _records(framework: str, python: str, tmp_path) -> list[dict]:
    cases = [(framework, "mlp", p) for p in POLICIES]
    if framework == "mxnet":
        records: list = [None] * len(cases)

        def notify(k, record):
            if record is not None:
                records[k] = record

        run_lockstep(cases, python, ENV, tmp_path, quick=True, steps=None, budget=60.0, timeout=120.0,
                     notify=notify)  # fmt: skip
        return records
    out = tmp_path / "cases.jsonl"
    command = [python, "-m", "polyamp.compare.worker", "--quick", "--budget", "60", "--out", str(out)]
    for case in cases:
        command += ["--case", *case]
    subprocess.run(command, env=ENV, check=True, capture_output=True, timeout=180)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Each installed framework's group, started at once, two at a time (each one's own processes)."""
    slowest_first = ("tensorflow", "mxnet", "jax", "torch")
    installed = {f: interpreters.interpreter(f) for f in slowest_first}
    with ThreadPoolExecutor(2) as pool:
        yield {f: pool.submit(_records, f, python, tmp_path_factory.mktemp(f))
               for f, python in installed.items() if python is not None}  # fmt: skip


@pytest.mark.parametrize("framework", interpreters.FRAMEWORKS)
def test_every_trained_case_records_its_memory_and_paired_inference(framework, groups):
    if framework not in groups:
        pytest.skip(f"{framework} is not installed")
    records = {r["policy"]: r for r in groups[framework].result()}
    assert list(records) == list(POLICIES)
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


def test_the_inference_budget_reaches_the_worker_and_a_bad_one_is_refused_before_any_case(tmp_path):
    from polyamp.errors import PolyampError

    with pytest.raises(PolyampError, match="infer_budget must be a finite number of seconds > 0"):
        runner.run([("torch", "mlp", "float32")], quick=True, infer_budget=-1.0)
    cases = [("torch", "mlp", "float32"), ("torch", "mlp", "bf16-mixed")]
    # a budget spent by the first timed call: each policy makes its warm-up call and one more
    records = runner.run(cases, quick=True, infer_budget=1e-9)
    for record in records:
        inference = record["inference"]
        assert inference["status"] == "ok" and len(inference["step_times"]) == 1 and inference["capped"]
