"""The examples run and do what they say."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def run(script, *args):
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                         text=True, check=True, timeout=300)  # fmt: skip
    return out.stdout


def test_torch_example_trains_and_shows_the_in_loop_scaler_never_adapts():
    out = run("torch_amp.py", "--policy", "fp16-mixed", "--steps", "60")
    assert "scale at every step [65536.0]" in out
    first, last, skipped, scale = re.search(
        r"loss ([\d.]+) -> ([\d.]+), (\d+) overflow steps skipped, final scale ([\d.e+-]+)", out
    ).groups()
    assert float(last) < float(first) / 5
    # six injected overflows (steps 0, 10, ..., 50) plus any real fp16 overflow; each halves
    assert int(skipped) >= 6 and float(scale) == 2.0**16 / 2 ** int(skipped)
