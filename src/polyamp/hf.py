"""The Hugging Face ``Trainer`` with polyamp's precision: ``polyamp.hf.Trainer``; written in
``polyamp/torch/hf_trainer.py``. Importing this module imports torch and transformers; ``import polyamp``
does not."""

from .torch.hf_trainer import Trainer

__all__ = ["Trainer"]
