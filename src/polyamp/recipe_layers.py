"""Which layers a recipe quantizes and which it keeps, and why: the public record each front end
fills at ``mp.watch(model)`` (torch, Keras, MXNet) or when ``mp.autocast(fn)`` traces (JAX), read as
``mp.recipe_layers``. A recipe that quantizes no layer warns (``RecipeWarning``): on a model whose
matmul layers the front end does not recognise, a recipe would otherwise train as bf16-mixed in silence.

Reasons a layer is kept, in the words of the record:
- ``keep 'first'`` / ``keep 'last'``: the recipe's keep list (the first / last matmul layer);
- ``keep 'pattern'``: a keep entry matched the layer's name;
- ``unsupported: ...``: a matmul the front end cannot quantize (its type and why, e.g. a transposed
  convolution); such a layer computes in the recipe's compute dtype.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


class RecipeWarning(UserWarning):
    """A recipe was applied to a model but quantizes none of its layers."""


@dataclass
class RecipeLayers:
    """``quantized``: layer names in the order the front end met them; ``kept``: name -> reason."""

    recipe: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, reason: str | None = None) -> None:
        """Record ``name`` as quantized (``reason`` None) or kept for ``reason``; a name recorded
        once keeps its first entry."""
        if name in self.kept or name in self.quantized:
            return
        if reason is None:
            self.quantized.append(name)
        else:
            self.kept[name] = reason

    def as_dict(self) -> dict:
        return {"recipe": self.recipe, "quantized": list(self.quantized), "kept": dict(self.kept)}

    def warn_if_none(self, framework: str, where: str) -> None:
        """A ``RecipeWarning`` when no layer is quantized, naming what was kept and why."""
        if self.quantized:
            return
        kept = "; ".join(f"{n}: {r}" for n, r in list(self.kept.items())[:8]) or "no matmul layer was found"
        warnings.warn(
            f"recipe {self.recipe!r} quantizes no layer of this {framework} model ({where}); it trains "
            f"as bf16-mixed. Kept: {kept}. Pass keep=... to the recipe (e.g. '{self.recipe}:keep=') "
            f"or see mp.recipe_layers", RecipeWarning, stacklevel=3)  # fmt: skip

    def __str__(self) -> str:
        lines = [f"recipe {self.recipe}: {len(self.quantized)} layers quantized, {len(self.kept)} kept"]
        lines += [f"  quantized  {n}" for n in self.quantized]
        lines += [f"  kept       {n}  ({r})" for n, r in self.kept.items()]
        return "\n".join(lines)
