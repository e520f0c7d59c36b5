"""Keras layer names, as the doctor gives them, and ``keep_fp32``: the named layers compute in float32.

A layer's name is the chain of Keras layer names from the model down to it, joined by "/" as in Keras's
variable paths, the model's own name left out ("dense_1", "block/dense_3"; a model that is a single layer
is named by its own name). Sub-layers come in Keras's tracking order (the order a subclassed layer assigns
them; ``model.layers`` for Sequential and Functional models), depth first; a layer reachable twice keeps
its first name; a sibling that repeats a name gets "#2", "#3", ...

``keep_float32`` (``mp.watch(model)`` with ``keep_fp32``) sets each layer whose name ``kept`` matches (a
name keeps itself and every layer below it) to the "float32" Keras dtype policy: from then on it casts
its floating inputs to float32 and computes and returns float32, on its float32 variables (a "mixed_*"
policy keeps them so). The other layers cast its float32 output back to their compute dtype when they
take it; raw TensorFlow ops in a layer's own ``call`` do not, so a block that adds a kept sub-layer's
output to a 16-bit tensor must cast one of them.
"""

from __future__ import annotations

import keras

from ..errors import PolyampError
from ..mixed_precision import kept, unmatched_layers


def sublayers(layer) -> list:
    """The layers ``layer`` tracks directly, in tracking order (Keras keeps no public list of them for a
    plain ``Layer``)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def named_layers(model) -> list[tuple[str, keras.layers.Layer]]:
    """(name, layer) of every layer below ``model`` (the model itself when it has none), depth first."""
    children = [c for c in sublayers(model) if not isinstance(c, keras.layers.InputLayer)]
    if not children:
        return [(model.name, model)]
    out: list[tuple[str, keras.layers.Layer]] = []
    seen = {id(model)}

    def visit(prefix: str, layers: list) -> None:
        taken: dict[str, int] = {}
        for layer in layers:
            if id(layer) in seen or isinstance(layer, keras.layers.InputLayer):
                continue
            seen.add(id(layer))
            taken[layer.name] = taken.get(layer.name, 0) + 1
            name = layer.name if taken[layer.name] == 1 else f"{layer.name}#{taken[layer.name]}"
            path = f"{prefix}/{name}" if prefix else name
            out.append((path, layer))
            visit(path, sublayers(layer))

    visit("", children)
    return out


def keep_float32(model, keep_fp32: tuple[str, ...]) -> list[str]:
    """Set the ``keep_fp32`` layers of ``model`` (and those below them) to the "float32" dtype policy;
    PolyampError for a name that matches no layer, or a kept layer whose variables are not float32.
    Returns the names of the layers set."""
    if not isinstance(model, keras.layers.Layer):
        raise PolyampError(f"keep_fp32 applies to a Keras model or layer, got {type(model).__name__}")
    layers = named_layers(model)
    unmatched_layers(keep_fp32, [name for name, _ in layers])
    chosen = [(name, layer) for name, layer in layers if kept(name, keep_fp32)]
    for name, layer in chosen:
        narrow = sorted({str(v.dtype) for v in layer.weights if str(v.dtype) != "float32"})
        if narrow:
            raise PolyampError(
                f"keep_fp32: layer {name!r} holds {'/'.join(narrow)} variables (dtype policy "
                f"{layer.dtype_policy.name!r}), and a built Keras layer cannot compute in float32 on them; "
                "use a 'mixed' policy (bf16-mixed, fp16-mixed: float32 variables) or build that layer "
                "with dtype='float32'"
            )
    for _, layer in chosen:
        layer.dtype_policy = "float32"
    return [name for name, _ in chosen]
