"""``polyamp doctor``: on a compare workload (``--workload charlm --framework jax``) or on a user's model
(``polyamp doctor path/to/file.py:make``, where ``make()`` returns ``(model, batch, loss_fn)``, optionally
with an optimizer fourth, or a dict with those keys and ``framework``), print the recommendation and the
worst tensors, and write report.md, report.json and heatmap.png into ``--out``.

A framework imported only in another interpreter (MXNet lives in ``.venv-mxnet``) runs there: the same
command in that Python, its output passed through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys

from ..doctor.run import DEFAULT_FORMATS, check_formats, diagnose
from ..errors import PolyampError
from ..frameworks import canonical_framework
from .target import load_target


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="before a run: what each format does to each layer; what to run",
                       epilog="exit status: 0 a report was written, 2 bad "
                       "input")  # fmt: skip
    p.add_argument("target", nargs="?", metavar="FILE.py:make", help="a Python file and a function in it "
                   "that returns (model, batch, loss_fn[, optimizer]) or a dict of them (default: "
                   "--workload)")  # fmt: skip
    p.add_argument("--workload", help="a compare workload: mlp, charlm or digits (default: charlm)")
    p.add_argument("--framework", help="torch, tensorflow, jax or mxnet (a workload's default: torch; "
                   "a file's: its model's)")  # fmt: skip
    p.add_argument("--steps", type=int, default=1, help="float32 steps observed (default 1)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="comma-separated: scalar formats "
                   "(predicted; fp16, bf16, e4m3fn, ...), block formats (measured; mxfp8_e4m3, "
                   "mxfp8_e4m3:rceil, nvfp4, ...) and recipes (measured; recipe:fp8-tensorwise, "
                   "recipe:mxfp8, recipe:nvfp4)")  # fmt: skip
    p.add_argument("--device", help="where the training will run (cpu, cuda, ...): fp16-mixed is not "
                   "recommended where the framework runs it slowly or refuses it (default: where the "
                   "model's weights are)")  # fmt: skip
    p.add_argument("--no-optimizer", action="store_true", help="observe no update (no lost-update check)")
    p.add_argument("--quick", action="store_true", help="the workload's tiny size (a smoke check)")
    p.add_argument("--top", type=int, default=12, help="rows of the worst-tensors table (default 12)")
    p.add_argument("--out", default="doctor-report", help="output folder (default: doctor-report)")
    p.add_argument("--no-plot", action="store_true", help="skip the heat map")
    p.add_argument("--json", action="store_true", help="print report.json instead of the tables")
    p.add_argument("--mxnet-python", metavar="PATH", help="the Python of MXNet's environment (default: "
                   "$POLYAMP_MXNET_PYTHON, else the project's .venv-mxnet)")  # fmt: skip


def doctor(args, argv: list[str]) -> int:
    formats = check_formats(args.formats)
    if args.steps < 1:
        raise PolyampError(f"--steps must be >= 1, got {args.steps}")
    framework = canonical_framework(args.framework) if args.framework else None
    if args.target and args.workload:
        raise PolyampError("give either FILE.py:make or --workload, not both")
    if framework == "mxnet" and importlib.util.find_spec("mxnet") is None:
        return _in_mxnet_python(args, argv)
    with _status(f"polyamp doctor: building {args.target or (args.workload or 'charlm')}", args.json):
        if args.target:
            model, batch, loss_fn, optimizer, framework = load_target(args.target, framework)
        else:
            name = args.workload or "charlm"
            model, batch, loss_fn, optimizer, framework = _workload(name, framework or "torch", args.quick)
    if args.no_optimizer:
        optimizer = None
    label = args.target or f"compare workload {args.workload or 'charlm'}{' (quick)' * args.quick}"
    with _status(f"polyamp doctor: observing {args.steps} float32 step(s) in {framework}", args.json):
        report = diagnose(model, batch, loss_fn, framework=framework, steps=args.steps, formats=formats,
                          optimizer=optimizer, device=args.device)  # fmt: skip
    report = dataclasses.replace(report, model=label)
    paths = report.write(args.out, plot=not args.no_plot)
    if args.json:
        print(paths["json"].read_text(), end="")
        return 0
    print(report.summary())
    print()
    print(report.table(args.top))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


def _workload(name: str, framework: str, quick: bool):
    """The compare workload's float32 model in ``framework`` (``Trainer.doctor_inputs``)."""
    from ..compare.workloads import get_workload

    wl = get_workload(name, quick=quick)
    try:
        trainer_module = importlib.import_module(f"polyamp.compare.{framework}")
    except ModuleNotFoundError as err:
        raise PolyampError(f"{framework} is not installed here ({err.name} is missing)") from err
    trainer = trainer_module.Trainer(wl, "float32")
    return (*trainer.doctor_inputs(), framework)


def _in_mxnet_python(args, argv: list[str]) -> int:
    from ..compare.interpreters import HOW_TO_INSTALL, mxnet_python

    if args.mxnet_python:
        os.environ["POLYAMP_MXNET_PYTHON"] = args.mxnet_python
    python = mxnet_python()
    if python is None:
        raise PolyampError(f"mxnet is not installed here ({HOW_TO_INSTALL['mxnet']})")
    return subprocess.call([str(python), "-m", "polyamp", *argv])


@contextlib.contextmanager
def _status(text: str, quiet: bool):
    """A spinner on stderr while a phase runs (rich when installed, else one line)."""
    try:
        from rich.console import Console
    except ImportError:
        if not quiet:
            print(f"{text} ...", file=sys.stderr, flush=True)
        yield
        return
    with Console(stderr=True).status(text):
        yield
