"""``polyamp.tune``: the fastest configuration that keeps the loss of float32, chosen by measurement.

``polyamp.tune(model, batch, loss_fn, optimizer, framework=None, policies=("bf16-mixed",), budget=120)``
(this package is callable; ``budget``: seconds, the CLI's ``--budget``, also spelled ``budget_s``) hands
the model to its framework's front end (``polyamp.<framework>.tune``), which says which knobs it has
and builds one training step per configuration; ``search.py`` tries them one knob at a time against
float32's loss and in paired timing rounds, and returns a ``TuneReport`` (``report.py``; a saved one
loads back with ``TuneReport.load``); ``search.tune(tunable, ...)`` runs it on any ``space.Tunable``.
MXNet takes its model as a maker string, ``polyamp.tune("file.py:make", kwargs)``: its AMP is
process-wide, so each policy builds the model in a process of its own (``polyamp/mxnet/tune.py``).
Nothing here imports a framework.
"""

import sys
import types

from ..errors import PolyampError
from ..frameworks import detect as _detect
from ..frameworks import front_end_module
from . import search
from .report import Final, Trial, TuneReport
from .space import TUNE_POLICIES, Candidate, Knob

__all__ = ["TUNE_POLICIES", "Candidate", "Final", "Knob", "Trial", "TuneReport", "run", "search"]
BUILT_ON = ("torch", "jax", "tensorflow", "mxnet")


def run(model, *args, framework: str | None = None, **kwargs) -> TuneReport:
    """``polyamp.tune(...)``: the model's front end's ``tune`` (module docstring)."""
    if "budget" in kwargs:
        if "budget_s" in kwargs:
            both = f"budget={kwargs['budget']!r} and budget_s={kwargs['budget_s']!r}"
            raise PolyampError(f"polyamp.tune got {both}: they are the same seconds; give one")
        kwargs["budget_s"] = kwargs.pop("budget")
    if isinstance(model, str) and framework is None:
        framework = "mxnet"  # a maker "module:function": MXNet's way (polyamp/mxnet/tune.py)
    if framework is None and callable(model) and _detect(model) is None:
        raise PolyampError("polyamp.tune got a function as its model (Keras's make_model): say which "
                           "framework builds it, e.g. framework='tensorflow'")  # fmt: skip
    if framework is None:
        from ..doctor.run import framework_of

        framework = framework_of(model)
    if framework not in BUILT_ON:
        raise PolyampError(f"polyamp.tune is built for {', '.join(BUILT_ON)} so far; received a {framework} "
                           "model")  # fmt: skip
    return front_end_module(framework, "tune").tune(model, *args, **kwargs)


class _CallableModule(types.ModuleType):
    """``polyamp.tune(...)`` calls ``run``; the package's names stay importable."""

    def __call__(self, *args, **kwargs) -> TuneReport:
        return run(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
