import json
import math
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
    assert "1.1015625" in out.stdout


# -- help, version, several and negative values ------------------------------------------------------
def test_help_names_every_command_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "commands:" in out
    listing = [line.split()[0] for line in out.split("commands:")[1].strip().splitlines()]
    # one line each, none wrapped
    assert listing == ["<command>", "formats", "cast", "compare", "doctor", "tune"]


def test_version(capsys):
    from polyamp import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"polyamp {__version__}"


@pytest.mark.parametrize(
    ("value", "rounded"),
    [("-inf", math.nan), ("-1e400", -448.0), ("-0x1p-9", -(2.0**-9)), ("-3", -3.0), ("-nan", math.nan)],
)  # fmt: skip
def test_cast_negative_values(capsys, value, rounded):
    code, out, err = run(capsys, "cast", value, "--to", "e4m3fn", "--rounding", "toward_zero", "--json")
    assert code == 0, err
    row = json.loads(out)[0]
    assert row["rounded"] == rounded or (math.isnan(rounded) and math.isnan(row["rounded"]))


def test_cast_several_values(capsys):
    code, out, _ = run(capsys, "cast", "1", "-inf", "2", "--to", "fp16,e4m3fn", "--saturate", "--json")
    rows = json.loads(out)
    assert code == 0
    assert [(r["input"], r["format"], r["rounded"]) for r in rows] == [
        (1.0, "fp16", 1.0), (1.0, "e4m3fn", 1.0), (-math.inf, "fp16", -65504.0),
        (-math.inf, "e4m3fn", -448.0), (2.0, "fp16", 2.0), (2.0, "e4m3fn", 2.0)]  # fmt: skip
    code, out, _ = run(capsys, "cast", "0.5", "-0.25", "--to", "e2m1fn")
    assert code == 0 and out.count("rounding=nearest") == 2 and "\n-0.25, rounding=nearest" in out


def test_cast_rounds_the_exact_decimal(capsys):
    """464 + 1e-20 is past e4m3fn's overflow tie (464 -> 448): NaN, though its float64 is 464."""
    code, out, _ = run(capsys, "cast", "464.00000000000000000001", "--to", "e4m3fn", "--json")
    row = json.loads(out)[0]
    assert code == 0 and math.isnan(row["rounded"]) and row["status"] == "overflow -> NaN"
    code, out, _ = run(capsys, "cast", "1e400", "--to", "e4m3fn", "--rounding", "toward_zero")
    assert code == 0 and "1e400 ~= inf" in out and "448" in out and "saturated" in out


def test_formats_one_notation_per_column(capsys):
    code, out, _ = run(capsys, "formats")
    header, _, *rows = out.splitlines()
    columns = list(zip(*(row.split() for row in rows)))
    names = header.replace("min normal", "min_normal").replace("min subnormal", "min_subnormal").split()
    for name in ("min_normal", "min_subnormal", "eps"):
        assert all(c.startswith("2^") or c == "-" for c in columns[names.index(name)]), name
    assert not any("^" in c for c in columns[names.index("max")])


# -- compare's options are checked before any case runs ----------------------------------------------
@pytest.mark.parametrize(
    ("option", "value"),
    [("--steps", "0"), ("--steps", "-2"), ("--steps", "1.5"), ("--steps", "many"), ("--budget", "-1"),
     ("--budget", "0"), ("--budget", "nan"), ("--budget", "inf"), ("--timeout", "0"), ("--timeout", "x")],
)  # fmt: skip
def test_compare_options_are_validated(capsys, tmp_path, option, value):
    # an unknown framework and a scratch folder: were the check to slip, nothing would run or be overwritten
    with pytest.raises(SystemExit) as exit_:
        main(["compare", option, value, "--frameworks", "none-such", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument {option}: got {value!r}; accepted:" in err


def test_bad_compare_option_exits_2_from_the_command_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "polyamp", "compare", "--steps", "0", "--frameworks",
                          "none-such", "--out", str(tmp_path)], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "got '0'; accepted: a whole number of steps >= 1" in out.stderr


HF_MAKE = """
import torch
import transformers


def make():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, None, torch.optim.AdamW(model.parameters(), 1e-3)
"""


def test_doctor_and_tune_load_a_file_whose_make_returns_a_transformers_model(tmp_path, capsys):
    """``FILE.py:make`` returning a Hugging Face GPT-2 (a dict batch, the loss from the model)."""
    from frameworks import require

    require("transformers")
    (tmp_path / "gpt2.py").write_text(HF_MAKE)
    target = f"{tmp_path / 'gpt2.py'}:make"
    doctor = ["doctor", target, "--no-plot", "--json", "--formats", "fp16,bf16", "--out", str(tmp_path / "d")]
    assert main(doctor) == 0
    report = json.loads(capsys.readouterr().out)
    layers = {r["layer"] for r in report["rows"]}
    assert report["framework"] == "torch" and report["model"] == target
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj", "lm_head"} <= layers
    assert main(["tune", target, "--budget", "3", "--parity-steps", "2", "--knobs", "attention", "--json",
                 "--out", str(tmp_path / "tune")]) == 0  # fmt: skip
    (tuned,) = json.loads(capsys.readouterr().out)
    assert tuned["knobs"]["attention"]["values"] == ["default", "math", "eager"]
    assert tuned["name"] == target and tuned["best"]["policy"] in ("float32", "bf16-mixed")
    assert (tmp_path / "tune" / "torch-gpt2.json").exists()
