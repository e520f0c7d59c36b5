"""The numbers in README.md and docs/*.md come from running them.

- Every ```python block that names no framework runs top to bottom in a fresh namespace, and each
  expression written as ``expr  # -> [dtype] expected  (free text)`` is checked: numbers exactly
  (nan matches nan), anything else against its repr or str, and the dtype when one is named. A
  block without such claims that uses names it never defines (``model``, ``data``) is an
  illustration, not a program, and is left alone.
- Every ```console block is a series of ``$ command`` lines, each followed by its output; the
  ``polyamp formats`` and ``polyamp cast`` ones are run and their output compared line for line
  (a line ``...`` stands for lines left out). Other commands (compare, make) need frameworks or
  minutes and are not run here.
"""

from __future__ import annotations

import ast
import builtins
import re
import shlex
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from polyamp.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
FRAMEWORK = re.compile(r"\b(torch|tensorflow|tf|keras|jax|jnp|optax|mxnet|mx|gluon|autograd)\b")
CLAIM = re.compile(r"#\s*->\s*(?:(?P<dtype>u?int\d+|float\d+|bfloat16|float8_\w+|bool)\s+)?"
                   r"(?P<value>\[[^\]]*\]|\([^)]*\)|\S+)")  # fmt: skip
NUMBER = re.compile(r"(?<![\w.])[-+]?(?:nan|inf|(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)(?![\w.])", re.I)
RUN = {"formats", "cast"}  # the polyamp commands a console block may show and this test runs


def blocks(language: str) -> list:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m[1] == language:
                where = f"{page.name}:{text[: m.start()].count(chr(10)) + 2}"
                found.append(pytest.param(where, m[2], id=where))
    return found


def runnable(code: str) -> bool:
    """Names no framework, and either makes claims or defines every name it uses."""
    if FRAMEWORK.search(code):
        return False
    names = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)]
    defined = {n.id for n in names if isinstance(n.ctx, ast.Store)} | set(dir(builtins))
    defined |= {(a.asname or a.name).split(".")[0] for n in ast.walk(ast.parse(code))
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}  # fmt: skip
    return bool(CLAIM.search(code)) or all(n.id in defined for n in names)


PYTHON = [b for b in blocks("python") if runnable(b.values[1])]
CONSOLE = blocks("console")


@pytest.mark.parametrize(("where", "code"), PYTHON)
def test_python_snippet_prints_what_it_claims(where, code):
    lines = code.splitlines()
    namespace: dict = {}
    for stmt in ast.parse(code).body:
        claim = CLAIM.search(lines[stmt.end_lineno - 1])
        line = f"{where.split(':')[0]}:{int(where.split(':')[1]) + stmt.lineno - 1}"
        if isinstance(stmt, ast.Expr):
            value = eval(compile(ast.Expression(stmt.value), line, "eval"), namespace)
            if claim:
                check_claim(value, claim, line)
        else:
            assert not claim, f"{line}: a '# ->' claim needs an expression, not a statement"
            exec(compile(ast.Module([stmt], type_ignores=[]), line, "exec"), namespace)


def check_claim(value, claim: re.Match, line: str) -> None:
    expected = claim["value"]
    if claim["dtype"]:
        dtype = getattr(ml_dtypes, claim["dtype"], None) or claim["dtype"]
        assert np.asarray(value).dtype == np.dtype(dtype), f"{line}: dtype {np.asarray(value).dtype}"
    if _is_numeric(value):
        got = np.asarray(value, dtype=np.float64).ravel()
        want = np.array([float(n) for n in NUMBER.findall(expected)])
        same = got.shape == want.shape and ((got == want) | (np.isnan(got) & np.isnan(want))).all()
        assert same, f"{line}: the README says {expected}, the code gives {got.tolist()}"
    else:
        assert expected in (repr(value), str(value)), f"{line}: the README says {expected}, got {value!r}"


def _is_numeric(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in value)
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "uif" or value.dtype == ml_dtypes.bfloat16
    return isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))


def commands(code: str) -> list[tuple[str, list[str]]]:
    """(command, its output lines) for each ``$ `` line of a console block."""
    runs: list[tuple[str, list[str]]] = []
    for text in code.splitlines():
        if text.startswith("$ "):
            runs.append((text[2:], []))
        elif runs:
            runs[-1][1].append(text.rstrip())
    return runs


@pytest.mark.parametrize(("where", "code"), CONSOLE)
def test_console_output_is_what_the_command_prints(where, code, capsys):
    for command, shown in commands(code):
        argv = shlex.split(command)
        if argv[0] != "polyamp" or argv[1] not in RUN:
            continue
        assert main(argv[1:]) == 0, f"{where}: {command} failed"
        printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
        while shown and not shown[-1]:
            shown.pop()
        if "..." not in shown:
            assert printed == shown, f"{where}: {command} prints\n" + "\n".join(printed)
            continue
        start = 0
        for chunk in "\n".join(shown).split("\n...\n"):
            part = chunk.strip("\n").splitlines()
            at = next((i for i in range(start, len(printed)) if printed[i : i + len(part)] == part), None)
            assert at is not None, f"{where}: {command} does not print\n" + "\n".join(part)
            start = at + len(part)


def test_readme_numbers_are_checked():
    """The README's numerics are among the checked snippets, so a wrong number there fails above."""
    readme = [p for p in PYTHON if p.values[0].startswith("README")]
    claims = sum(len(CLAIM.findall(p.values[1])) for p in readme)
    shown = [c for p in CONSOLE for c, _ in commands(p.values[1]) if shlex.split(c)[1:2][0] in RUN]
    assert claims >= 5 and {"formats", "cast"} <= {shlex.split(c)[1] for c in shown}
