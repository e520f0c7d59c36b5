"""What a recipe would quantize in a Gluon net, for the MXNet doctor's recipe tables (``doctor.py``).

Of each block a recipe can quantize (``recipe.matmul_blocks``, the keep list aside: ``nn.Dense`` and
channels-first convolutions), its ``weight`` (not the bias), the gradient of its output, and its input,
which is the "output" of the leaf layer that returned that array (an input computed by ops between
layers, or the net's own input, has no row). The inputs are seen by the doctor's forward wrapper
(``doctor._tapped``) of each such block, which notes its first argument in ``fed``.
"""

from __future__ import annotations

from ..doctor import blocks as _blocks
from .recipe import matmul_blocks


class RecipeTensors:
    """A ``blocks.Meter`` of the recipe targets fed only what those recipes quantize (module docstring)."""

    def __init__(self, model, targets: tuple, convert):
        self.meter = _blocks.Meter(targets, convert)
        self.blocks = {path: block for path, block, why in matmul_blocks(model) if why is None}
        self.fed: list = []  # this step's inputs of those blocks

    def gemm(self, name: str) -> bool:
        """Whether the layer ``name`` is a block a recipe quantizes."""
        return name in self.blocks

    def add(self, name: str, kind: str, x, fed_as=None) -> None:
        """``x`` of layer ``name`` measured if a recipe quantizes it; an output by the array the next
        layer received (``fed_as``, the doctor's tapped sum)."""
        block = self.blocks.get(name)
        if kind == "grad_output" and block is not None:
            self.meter.add(name, kind, x)
        elif kind == "weight" and block is not None and x is block.weight.data():
            self.meter.add(name, kind, x)
        elif kind == "output" and any(fed_as is f for f in self.fed):
            self.meter.add(name, kind, x)
