"""Hugging Face Accelerate with polyamp's precision: ``polyamp.accelerate.Accelerator``; written in
``polyamp/torch/accelerate.py``. Importing this module imports torch and Accelerate; ``import polyamp``
does not."""

from .torch.accelerate import Accelerator, Scaler, attach

__all__ = ["Accelerator", "Scaler", "attach"]
