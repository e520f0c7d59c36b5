import json
import subprocess
import sys

import pytest

from polyamp.cli import main
from polyamp.numerics import FORMATS


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_formats_json_lists_every_format(capsys):
    code, out, _ = run(capsys, "formats", "--json")
    facts = {f["name"]: f for f in json.loads(out)}
    assert code == 0 and set(facts) == set(FORMATS)
    assert facts["e4m3fn"]["max"] == 448.0 and facts["fp16"]["min_subnormal"] == 2.0**-24


def test_formats_table(capsys):
    code, out, _ = run(capsys, "formats", "fp16", "e4m3")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 4
    assert lines[2].split()[:4] == ["fp16", "1/5/10", "15", "65504"]
    assert lines[3].split()[:4] == ["e4m3fn", "1/4/3", "7", "448"]


def test_cast_json(capsys):
    code, out, _ = run(capsys, "cast", "68.00000356923152", "--to", "e4m3fn,fp16,e2m1fn", "--json")
    rows = {r["format"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["e4m3fn"]["rounded"] == 72.0 and rows["e4m3fn"]["hex"] == "0x69"
    assert (rows["e4m3fn"]["below"], rows["e4m3fn"]["above"]) == (64.0, 72.0)
    assert rows["e4m3fn"]["bits"] == "0 1101 001"
    assert rows["fp16"]["rounded"] == 68.0 and rows["fp16"]["status"] == "rounded"
    assert rows["e2m1fn"]["rounded"] == 6.0 and rows["e2m1fn"]["status"] == "saturated"
    assert abs(rows["e4m3fn"]["relative_error"] - (72 - 68.00000356923152) / 68.00000356923152) < 1e-15


@pytest.mark.parametrize(
    ("value", "flags", "rounded", "status"),
    [("464", [], 448.0, "rounded"), ("465", [], None, "overflow -> NaN"),
     ("465", ["--saturate"], 448.0, "saturated"), ("1e-4", [], 0.0, "underflow -> 0"),
     ("0x1p-9", [], 2.0**-9, "exact"), ("0.0025", [], 2.0**-9, "subnormal")],
)  # fmt: skip
def test_cast_statuses(capsys, value, flags, rounded, status):
    code, out, _ = run(capsys, "cast", value, "--to", "e4m3fn", "--json", *flags)
    row = json.loads(out)[0]
    assert code == 0 and row["status"] == status
    assert row["rounded"] == rounded or (rounded is None and row["rounded"] != row["rounded"])


def test_cast_bad_input_is_one_clear_error(capsys):
    code, _, err = run(capsys, "cast", "abc")
    assert code == 2 and "cannot read 'abc'" in err and "hex float" in err
    code, _, err = run(capsys, "cast", "1", "--to", "fp9")
    assert code == 2 and "unknown format 'fp9'" in err and "e4m3fn" in err
    code, _, err = run(capsys, "cast", "1", "--rounding", "up")
    assert code == 2 and "unknown rounding 'up'" in err


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "polyamp", "cast", "1.1", "--to", "bf16"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert "1.10156" in out.stdout
