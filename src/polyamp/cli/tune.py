"""``polyamp tune``: the search on compare workloads or on a user's model (``FILE.py:make``, as the doctor
takes it), a progress bar on stderr, the report as text or JSON, one JSON file per model in ``--out``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from ..errors import PolyampError
from ..frameworks import canonical_framework, front_end_module
from ..tune import BUILT_ON
from ..tune.search import tune as search
from ..tune.space import check_policies
from .target import load_target


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="measured: the fastest settings at float32's loss",
                       epilog="exit status: 0 reports were written, 2 bad input")  # fmt: skip
    p.add_argument("target", nargs="?", metavar="FILE.py:make", help="a Python file and a function in it "
                   "that returns (model, batch, loss_fn, optimizer) or a dict of them (default: "
                   "--workloads)")  # fmt: skip
    p.add_argument("--workloads", default="mlp,charlm", help="compare workloads (default: mlp,charlm)")
    p.add_argument("--framework", default="torch", help=f"built for: {', '.join(BUILT_ON)} (default torch)")
    p.add_argument("--policies", default="bf16-mixed", help="comma-separated, besides float32 (default "
                   "bf16-mixed; fp16-mixed also)")  # fmt: skip
    p.add_argument("--knobs", help="comma-separated knobs to search (default: all the framework has; "
                   "e.g. leave out compile, whose first step compiles for tens of seconds)")  # fmt: skip
    p.add_argument("--budget", type=float, default=120.0, help="seconds per model (default 120)")
    p.add_argument("--parity-steps", type=int, default=6, help="steps before the loss check (default 6)")
    p.add_argument("--rtol", type=float, default=0.05, help="loss parity tolerance (default 0.05)")
    p.add_argument("--quick", action="store_true", help="the workloads' tiny sizes (a smoke check)")
    p.add_argument("--device", default=None, help="torch: where the compare workloads train, cpu or cuda "
                   "(default cpu; a FILE.py:make model stays where it is)")  # fmt: skip
    p.add_argument("--out", default="tune-report", help="output folder (default: tune-report)")
    p.add_argument("--json", action="store_true", help="print the reports as JSON instead of text")


def tune(args) -> int:
    framework = canonical_framework(args.framework)
    if framework not in BUILT_ON:
        raise PolyampError(f"polyamp tune is built for {', '.join(BUILT_ON)} so far; received --framework "
                           f"{args.framework}")  # fmt: skip
    if importlib.util.find_spec(framework) is None:
        from ..compare.interpreters import HOW_TO_INSTALL

        how = ("MXNet needs numpy<1.24, so it lives in its own environment (make venv-mxnet): run "
               ".venv-mxnet/bin/python -m polyamp tune --framework mxnet") if framework == "mxnet" \
            else HOW_TO_INSTALL[framework]  # fmt: skip
        raise PolyampError(f"{framework} is not installed in this Python ({sys.executable}): {how}")
    policies = check_policies([p for p in args.policies.split(",") if p])
    front = front_end_module(framework, "tune")
    if args.target and framework == "mxnet":  # built in a worker process per policy: passed as the maker
        models = {args.target: lambda: (args.target,)}
    elif args.target:
        model, batch, loss_fn, optimizer, found = load_target(args.target, framework)
        if optimizer is None:
            raise PolyampError(f"{args.target} gave no optimizer; tune rebuilds it per configuration")
        models = {args.target: lambda: (model, batch, loss_fn, optimizer)}
    else:
        names = [w for w in args.workloads.split(",") if w]
        if args.device and framework != "torch":
            raise PolyampError(f"--device applies to torch only; received --framework {args.framework}")
        extra = {"device": args.device} if args.device else {}
        inputs = importlib.import_module(f"polyamp.compare.{framework}").tune_inputs
        models = {w: (lambda w=w: inputs(w, args.quick, **extra)) for w in names}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for name, make in models.items():
        tunable = front.Tunable(*make(), name=name)
        if args.knobs is not None:
            tunable.knobs = _chosen(tunable.knobs, args.knobs)
        try:
            with _progress(f"tune {name}", args.json) as progress:
                report = search(tunable, policies, args.budget, args.parity_steps, args.rtol,
                                progress=progress)  # fmt: skip
        finally:
            getattr(tunable, "close", lambda: None)()  # MXNet's worker processes
        path = out / f"{framework}-{Path(name.split(':')[0]).stem}.json"
        report.save(path)
        reports.append(report)
        if not args.json:
            print(report.text())
            print(f"\nwrote {path}\n")
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    return 0


def _chosen(knobs: dict, names: str) -> dict:
    wanted = [n for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in knobs]
    if unknown:
        raise PolyampError(f"--knobs {', '.join(unknown)}: not a knob of this model; its knobs: "
                           f"{', '.join(knobs)}")  # fmt: skip
    return {n: knobs[n] for n in wanted}


@contextlib.contextmanager
def _progress(title: str, quiet: bool):
    """A progress bar on stderr (rich), told ``(text, done, total)`` by the search."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, disable=quiet, console=_stderr()) as bar:
        task = bar.add_task(title, total=None)

        def tell(text: str, done: int, total: int) -> None:
            bar.update(task, description=f"{title}: {text}"[:90], completed=done, total=total)

        yield tell


def _stderr():
    from rich.console import Console

    return Console(stderr=True, file=sys.stderr)
