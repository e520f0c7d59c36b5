"""Run a docs page's example in this process and hold it to what it says it prints.

The page's one ```python block that starts with ``# framework: NAME`` ends with a ``print(...)`` whose
comment gives the first words printed (``# 65536.0 0 StepResult(stepped=True, ...)``: up to the word with
"..."); the example runs in a temporary directory."""

import contextlib
import io
import itertools
import os
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def run_example(page: str, framework: str, tmp_path) -> str:
    """Run ``docs/<page>``'s example and assert the first words of its last printed line are the ones
    its last ``print`` comment names; returns what it printed."""
    text = (DOCS / page).read_text(encoding="utf-8")
    (code,) = re.findall(rf"^```python\n# framework: {framework}\n(.*?)^```", text, re.M | re.S)
    words = re.findall(r"^print\(.*\)  # (.+)$", code, re.M)[-1].split()
    said = list(itertools.takewhile(lambda w: "..." not in w, words))  # "..." ends what is checked
    out, here = io.StringIO(), os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"docs/{page}", "exec"), {"__name__": "docs_example"})
    finally:
        os.chdir(here)
    printed = out.getvalue().splitlines()[-1].split()
    assert said and printed[: len(said)] == said, (printed, said)
    return out.getvalue()
