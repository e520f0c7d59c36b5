"""The user's model for ``polyamp doctor`` and ``polyamp tune``: ``FILE.py:make``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ..doctor.run import framework_of
from ..errors import PolyampError
from ..frameworks import canonical_framework


def load_target(target: str, framework: str | None):
    """``FILE.py:make`` loaded and called: ``(model, batch, loss_fn, optimizer, framework)``.

    ``make()`` returns ``(model, batch[, loss_fn[, optimizer]])`` or a dict of those keys with an
    optional ``framework``; the framework is otherwise ``framework`` or the model's own. The file's
    folder is on ``sys.path`` while it runs, so it may import its neighbours.
    """
    path, _, name = target.rpartition(":")
    if not path or not name.isidentifier():
        raise PolyampError(f"expected FILE.py:function, e.g. model.py:make; got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise PolyampError(f"no such file: {path!r}")
    spec = importlib.util.spec_from_file_location(f"_polyamp_target_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    make = getattr(module, name, None)
    if not callable(make):
        raise PolyampError(f"{path} has no function {name!r}")
    made = make()
    if isinstance(made, dict):
        unknown = set(made) - {"model", "batch", "loss_fn", "optimizer", "framework"}
        if unknown or "model" not in made or "batch" not in made:
            raise PolyampError(f"{name}() returned a dict with keys {sorted(made)}; expected model, "
                               "batch and optionally loss_fn, optimizer, framework")  # fmt: skip
        framework = framework or (canonical_framework(made["framework"]) if made.get("framework") else None)
        made = (made["model"], made["batch"], made.get("loss_fn"), made.get("optimizer"))
    if not isinstance(made, tuple) or len(made) not in (2, 3, 4):
        raise PolyampError(f"{name}() must return (model, batch, loss_fn[, optimizer]) or a dict of "
                           f"them, got {type(made).__name__}")  # fmt: skip
    model, batch, loss_fn, optimizer = (*made, None, None)[:4]
    if framework is None:
        framework = framework_of(model)
    return model, batch, loss_fn, optimizer, framework
