"""The inference budget of ``polyamp compare``. The memory and paired inference of every framework's
quick cases are checked on ``test_compare.py``'s quick report."""

import pytest

from polyamp.compare import runner
from polyamp.errors import PolyampError


def test_the_inference_budget_reaches_the_worker_and_a_bad_one_is_refused_before_any_case(tmp_path):
    with pytest.raises(PolyampError, match="infer_budget must be a finite number of seconds > 0"):
        runner.run([("torch", "mlp", "float32")], quick=True, infer_budget=-1.0)
    cases = [("torch", "mlp", "float32"), ("torch", "mlp", "bf16-mixed")]
    # a budget spent by the first timed call: each policy makes its warm-up call and one more
    records = runner.run(cases, quick=True, infer_budget=1e-9)
    for record in records:
        inference = record["inference"]
        assert inference["status"] == "ok" and len(inference["step_times"]) == 1 and inference["capped"]
