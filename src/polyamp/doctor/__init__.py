"""``polyamp.doctor``: before a run, what each low-precision format would do to each layer's tensors.

``polyamp.doctor(model, batch, loss_fn=None, *, framework=None, steps=1, formats=("fp16", "bf16",
"e4m3fn", "e5m2"), optimizer=None)`` (this package is callable; ``run.diagnose``) returns a ``Report``.
The numpy core: log2 histograms -> per-format predictions -> recommendations. Framework front ends
(``polyamp.<framework>.doctor``) bin their tensors on device following ``histogram``'s spec and hand the
counts to ``LogHistogram.from_counts``; nothing here imports a framework. Block formats and recipes in
``formats`` (``mxfp8_e4m3``, ``nvfp4``, ``recipe:fp8-tensorwise``, ...) are measured instead: each
tapped tensor cast and counted (``blocks.py``), shown per row apart from the predictions.
"""

import sys
import types

from .histogram import N_BINS, LogHistogram, bin_index, update_ratio_histogram
from .predict import LostUpdates, Prediction, lost_updates, predict, predict_scales
from .recommend import KINDS, Finding, Observation, PolicyCheck, Recommendation, recommend
from .report import Report, Row
from .run import DEFAULT_FORMATS, diagnose

__all__ = [
    "DEFAULT_FORMATS",
    "KINDS",
    "N_BINS",
    "Finding",
    "LogHistogram",
    "LostUpdates",
    "Observation",
    "PolicyCheck",
    "Prediction",
    "Recommendation",
    "Report",
    "Row",
    "diagnose",
    "bin_index",
    "lost_updates",
    "predict",
    "predict_scales",
    "recommend",
    "update_ratio_histogram",
]


class _CallableModule(types.ModuleType):
    """``polyamp.doctor(...)`` calls ``diagnose``; the package's names stay importable."""

    def __call__(self, *args, **kwargs) -> Report:
        return diagnose(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
