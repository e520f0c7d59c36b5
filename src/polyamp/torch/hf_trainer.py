"""polyamp inside the Hugging Face ``Trainer``:
``polyamp.hf.Trainer(model, args, ..., precision="fp16-mixed")``.

The Trainer makes its own ``accelerate.Accelerator`` and relies on it for autocast, loss scaling, the
unscale before ``max_grad_norm`` clipping, skipped steps (the learning-rate scheduler does not step
after one) and the ``scaler.pt`` of its checkpoints. So the least invasive extension point is that
accelerator: this subclass overrides one documented method, ``create_accelerator_and_postprocess``,
to hand the accelerator it made to polyamp (``accelerate.attach``) before anything is prepared; the
training loop, ``training_step``, ``compute_loss`` and callbacks stay the Trainer's own. Accelerate's
mixed precision must be off (``TrainingArguments(fp16=False, bf16=False)``, the defaults): polyamp's
``precision`` takes its place. ``trainer.mp`` is the MixedPrecision; ``trainer.accelerator.scaler.last_step``
the last step's ``StepResult``.
"""

from __future__ import annotations

from typing import Any

import transformers

from ..errors import PolyampError
from . import given_or_made
from .accelerate import attach


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose precision is polyamp's ``precision`` (a policy or recipe name, or a
    torch ``MixedPrecision``; ``precision_options`` go to ``MixedPrecision``: ``loss_scale``,
    ``keep_fp32``, ``device``)."""

    def __init__(self, *args, precision: Any = "bf16-mixed", precision_options: dict | None = None, **kwargs):
        self.mp = given_or_made(precision, dict(precision_options or {}))
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        if self.args.fp16 or self.args.bf16:
            which = "fp16=True" if self.args.fp16 else "bf16=True"
            raise PolyampError(f"TrainingArguments({which}) turns on Accelerate's mixed precision; "
                               f"polyamp's precision={self.mp.policy.name!r} takes its place: leave fp16 "
                               "and bf16 False")  # fmt: skip
        super().create_accelerator_and_postprocess()
        attach(self.accelerator, self.mp)


__all__ = ["Trainer"]
