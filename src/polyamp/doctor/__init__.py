"""The doctor's numpy core: log2 histograms -> per-format predictions -> recommendations.

Framework front ends bin their tensors on device following ``histogram``'s spec and hand the counts to
``LogHistogram.from_counts``; nothing here imports a framework.
"""

from .histogram import N_BINS, LogHistogram, bin_index, update_ratio_histogram
from .predict import LostUpdates, Prediction, lost_updates, predict, predict_scales
from .recommend import KINDS, Finding, Observation, PolicyCheck, Recommendation, recommend

__all__ = [
    "KINDS",
    "N_BINS",
    "Finding",
    "LogHistogram",
    "LostUpdates",
    "Observation",
    "PolicyCheck",
    "Prediction",
    "Recommendation",
    "bin_index",
    "lost_updates",
    "predict",
    "predict_scales",
    "recommend",
    "update_ratio_histogram",
]
