"""Lightning precision plugins: ``polyamp.lightning.Precision`` (``Trainer``) and ``FabricPrecision``
(``Fabric``); written in ``polyamp/torch/lightning.py``. Importing this module imports torch and
Lightning; ``import polyamp`` does not."""

from .torch.lightning import FabricPrecision, Precision

__all__ = ["FabricPrecision", "Precision"]
