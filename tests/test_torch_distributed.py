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


RECIPE_WORKER = Path(__file__).with_name("torch_dist_recipe_worker.py")


def _recipe_run(tmp_path, mode):
    out = tmp_path / mode
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(RECIPE_WORKER), mode, str(out), "5"]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def test_delayed_scaling_amaxes_are_reduced_across_ranks(tmp_path):
    """fp8-delayed all-reduces each amax (max) before it enters the history, as TE's reduce_amax: the
    ranks keep identical histories, and after the first step (both runs start from the same state) each
    history slot is the larger of the two ranks' own amaxes; with reduce_amax=False they drift apart."""
    runs = {mode: _recipe_run(tmp_path, mode) for mode in ("reduce", "local")}
    for proc, _ in runs.values():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    (r0, r1), (l0, l1) = ([torch.load(f"{out}.{rank}") for rank in (0, 1)] for _, out in runs.values())
    assert r0["states"] == r1["states"]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    assert l0["states"][-1]["delayed"] != l1["states"][-1]["delayed"]
    first = r0["states"][0]["delayed"]
    assert len(first) == 3 * 2  # (input, weight, grad) of two linear layers
    for key, entry in first.items():
        mine, theirs = l0["states"][0]["delayed"][key], l1["states"][0]["delayed"][key]
        # the history rolled once: this step's amax is its last slot
        assert entry["history"][-1] == max(mine["history"][-1], theirs["history"][-1]) > 0
        if key.endswith("|input"):
            assert mine["history"][-1] != theirs["history"][-1]
