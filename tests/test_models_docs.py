"""docs/models.md's examples run: each ```python block that starts with ``# framework: NAME`` runs top to
bottom in a fresh interpreter of this test run (its own process: Keras reads KERAS_BACKEND at import),
where that framework and its model library are installed (``tests/frameworks.py``: a requested framework
that cannot be imported fails)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from frameworks import require

PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
FENCE = re.compile(r"^```python\n# framework: (?P<framework>\w+)\n(?P<code>.*?)^```", re.M | re.S)
LIBRARY = {"torch": "transformers", "tensorflow": "keras_hub", "jax": "flax", "mxnet": "mxnet"}


def examples() -> list:
    text = PAGE.read_text(encoding="utf-8")
    return [pytest.param(m["framework"], m["code"], id=f"models.md:{text[: m.start()].count(chr(10)) + 1}")
            for m in FENCE.finditer(text)]  # fmt: skip


def test_the_page_has_an_example_per_framework():
    assert sorted({framework for framework, _ in (p.values for p in examples())}) == sorted(LIBRARY)


@pytest.mark.parametrize(("framework", "code"), examples())
def test_example_runs(framework, code, tmp_path):
    require(framework)
    require(LIBRARY[framework])
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
