"""The doctor's predictions against real PyTorch runs: benchmarks/doctor_proofs_torch.py at its quick sizes.

Each check there trains as the doctor says (or against it) and returns its figures and claims; here each
claim must hold, and the figures behind it are asserted directly.
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
from frameworks import require

torch = require("torch")  # a failure where the run asked for torch, else a skip

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "doctor_proofs_torch.py"


@pytest.fixture(scope="module")
def proofs():
    spec = importlib.util.spec_from_file_location("doctor_proofs_torch", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def failed(result: dict) -> list[str]:
    return [claim for claim, ok in result["claims"].items() if not ok]


def test_overflowing_layer_is_flagged_traced_and_fixed_by_keep_fp32(proofs):
    result = proofs.overflow(quick=True)
    f = result["figures"]
    assert not failed(result), (failed(result), f)
    assert f["big_output_amax"] > 65504 and f["big_output_fp16_overflow"] > 0
    assert f["first_finding"][:3] == ["big", "output", "overflow"]
    assert f["policy"] == "fp16-mixed" and f["keep_fp32"] == ["big"]
    without = f["without_keep"]
    assert without["first_origin"] == "forward output of big"
    assert without["steps_run"] == without["skipped"] == proofs.MAX_SKIPS  # stopped by NonFiniteError
    assert "the first non-finite value came from 'forward output of big'" in without["error"]
    kept = f["with_keep"]
    assert kept["error"] is None and kept["steps"] == proofs.SIZES["overflow"][1][0]
    assert len(kept["skipped_steps"]) <= 2, kept  # a back-off or two while the scale settles, no more
    assert all("big" not in (o or "") for o in kept["origins"])  # kept in fp32, big never overflows again


def test_recommended_loss_scale_skips_fewer_steps_at_no_cost(proofs):
    result = proofs.loss_scale(quick=True)
    f = result["figures"]
    assert not failed(result), (failed(result), f)
    grad, scale = f["largest_gradient"], f["recommended_scale"]
    assert grad * 2.0**16 > 65504  # the premise: torch's default start overflows here
    assert grad * scale <= 65504 / 2 < grad * scale * 2  # the doctor's rule, a power of two
    assert math.log2(scale) == int(math.log2(scale))
    skips = f["skipped"]
    assert skips["recommended"] == 0 < skips["2^16"] < skips["2^24"], skips
    # a too-high start halves once per skipped step until it fits: the skips are the first steps
    for name in ("2^16", "2^24"):
        assert f["skipped_steps"][name] == list(range(skips[name]))
    assert f["noise"] > 0 and len(f["final_loss_seeds_recommended"]) == 3


def test_bf16_lost_updates_match_the_prediction_per_layer(proofs):
    result = proofs.lost_updates(quick=True)
    f = result["figures"]
    assert not failed(result), (failed(result), f)
    small, large = f["runs"][0], f["runs"][-1]
    assert small["lr"] < large["lr"]
    for run in f["runs"]:
        assert set(run["layers"]) == {"fc1", "fc2", "fc3", "fc4"}
        for layer, v in run["layers"].items():
            assert abs(v["observed"] - v["predicted"]) <= 0.02, (run["lr"], layer, v)
            # the float32 gradient applied to the bf16 weights, with updates float32 already lost counted
            # in: the doctor's model alone, nearly exact
            assert abs(v["fp32_g"] - v["predicted"] - v["fp32_zero"]) <= 0.005, (run["lr"], layer, v)
    assert small["predicted"] > 0.5 and large["predicted"] < 0.05  # lost updates fall with the lr
    assert small["master_weights"] is True and large["master_weights"] is False


def test_script_exits_0_and_prints_json(proofs, capsys):
    assert proofs.main(["--only", "lost_updates", "--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    claims = out["results"]["lost_updates"]["claims"]
    assert claims and all(claims.values())
    with pytest.raises(SystemExit):
        proofs.main(["--only", "nonsense"])
