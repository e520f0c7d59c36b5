"""Two CPU processes on gloo: an overflow on one rank makes every rank skip the same step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("torch_dist_worker.py")


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_ranks_agree_on_skipping(tmp_path, wrapper):
    out = tmp_path / "result"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), wrapper, str(out), "14"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (torch.load(f"{out}.{rank}") for rank in (0, 1))
    assert r0["results"] == r1["results"]
    skipped = [step for step, (stepped, _) in enumerate(r0["results"]) if not stepped]
    assert skipped == [2, 5, 6, 11]
    # every rank learns which rank overflowed; the fine rank says so instead of nothing
    for step in range(14):
        ranks, names, origin = r1["reasons"][step]
        assert ranks == r0["reasons"][step][0] == ((0,) if step in skipped else ())
        assert names == () and origin == ("the gradients of rank 0" if step in skipped else None)
        assert (r0["reasons"][step][1] != ()) == (step in skipped)
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()
