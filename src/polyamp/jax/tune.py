"""``polyamp tune`` in JAX: the knobs that change a training step's speed, and the steps to time.

``tune(params, batch, loss_fn, optimizer)`` takes the doctor's convention (``polyamp/jax/doctor.py``: the
model is its ``params`` pytree, ``loss_fn(params, batch)`` returns the scalar loss, ``batch`` a pytree of
arrays or a callable ``i -> batch``, ``optimizer`` an optax ``GradientTransformation`` or a pair
``(optimizer, opt_state)``). Every candidate steps its own copy of the params and optimizer state, so all
start from the same weights and see the same batches; nothing passed in is changed or donated.

A candidate's step (``train_step``) is compare's (``polyamp/compare/jax.py``): ``mp = MixedPrecision(policy,
framework="jax")``, ``f = mp.autocast(loss_fn, rules=...)``, ``mp.value_and_grad(f)(params, batch,
state=state)`` and the optax update run only if the gradients are finite (``step_if_finite``), in one
``jax.jit``; the loss is read back as a float once every output of the step is ready.

Knobs (the first value is the default):
- ``accumulate``: on: polyamp's autocast, matmul and convolution operands in the compute dtype with
  float32 accumulation (a float32 result), reductions and exp/log in float32; off: plain casts, the
  floating leaves of ``params`` and ``batch`` cast whole to the compute dtype so that every op, dots
  included, computes and returns it (jmp's idiom). ``AutocastRules`` has no switch for this (an ``allow``
  primitive always accumulates in float32), so "off" does not go through ``mp.autocast``;
- ``backward``: ``AutocastRules.low_precision_backward``: the matmul gradients in the compute dtype with
  float32 accumulation too (on) or JAX's own transposes, float32 cotangents times compute-dtype operands;
- ``donate``: the params, optimizer state and loss-scale state donated to the jitted step (updated in
  place, as compare's Trainer does), off / on.

Not knobs: XLA's CPU thread count is fixed when the process creates its backend (``XLA_FLAGS``), so it
cannot change inside one process; and the step is always one ``jax.jit`` (jitting only the gradients and
running the optax update op by op measured 0.10-0.20x of its speed on the quick mlp and charlm).

Each distinct program is built and compiled once per ``Tunable``: under ``float32`` ``mp.autocast`` returns
the function unchanged, so ``accumulate`` and ``backward`` change nothing there, nor ``backward`` with
``accumulate`` off; such a configuration reuses its twin's jitted step (no second compilation), as do
the search's final rounds.

``apply(report, loss_fn, optimizer)`` returns ``Tuned(mp, loss, step)``: the best policy's
``MixedPrecision``, the function it differentiates (``mp.value_and_grad(loss)`` for a step of one's own)
and the jitted ``step(params, opt_state, state, batch) -> (params, opt_state, state, loss)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..doctor.taps import type_name as _type
from ..errors import PolyampError
from ..policy import Policy
from ..tune.search import tune as search
from ..tune.space import Candidate, Knob
from . import MixedPrecision
from .autocast import DEFAULT_RULES
from .tree import cast_tree, step_if_finite

_DONATED = (0, 1, 2)  # params, opt_state, the loss-scale state


_LOW = ("bf16-mixed", "fp16-mixed")  # the policies whose matmuls the first two knobs change


def knobs() -> dict[str, Knob]:
    """The knobs of a JAX training step (module docstring); they do not depend on the model."""
    return {
        "accumulate": Knob((True, False), "float32-accumulating dots {value} (off: params and batch cast "
                           "whole to the compute dtype, every op computing in it, jmp's idiom)", _LOW),
        "backward": Knob((True, False), "matmul gradients in the compute dtype with float32 accumulation "
                         "{value} (off: JAX's transposes, float32 cotangents times compute-dtype "
                         "operands)", _LOW),
        "donate": Knob((False, True), "buffer donation {value}: XLA updates the params, optimizer and "
                       "loss-scale state in place"),
    }  # fmt: skip


def make_step(mp: MixedPrecision, loss_fn: Callable, optimizer, settings: dict[str, Any]):
    """``(f, step)`` for one configuration: ``f`` the function differentiated, ``step(params, opt_state,
    state, batch) -> (params, opt_state, state, loss)`` (module docstring)."""
    compute = mp.policy.compute_dtype
    if settings.get("accumulate", True):
        rules = DEFAULT_RULES
        if not settings.get("backward", True):
            rules = replace(DEFAULT_RULES, low_precision_backward=False)
        f = mp.autocast(loss_fn, rules=rules)
    elif compute == "float32":
        f = loss_fn
    else:

        def f(params, batch):
            return loss_fn(cast_tree(params, compute), cast_tree(batch, compute))

    value_and_grad = mp.value_and_grad(f)

    def train_step(params, opt_state, state, batch):
        (loss, grads), finite, state = value_and_grad(params, batch, state=state)
        params, opt_state = step_if_finite(finite, optimizer, grads, opt_state, params)
        return params, opt_state, state, loss

    return f, jax.jit(train_step, donate_argnums=_DONATED if settings.get("donate") else ())


def _program_key(policy: str, settings: dict[str, Any]) -> tuple:
    """What tells two configurations' programs apart: the settings that change it under ``policy``."""
    s = dict(settings)
    if Policy.parse(policy).compute_dtype == "float32":  # mp.autocast returns the function as it is
        s.pop("accumulate", None)
        s.pop("backward", None)
    elif not s.get("accumulate", True):  # plain casts: no autocast rules
        s.pop("backward", None)
    return policy, tuple(sorted(s.items()))


class Tunable:
    """The search's view of one JAX model (``polyamp.tune.space.Tunable``)."""

    framework = "jax"

    def __init__(self, params, batch, loss_fn, optimizer, name: str = "model"):
        _check_tree("params", params, "JAX's model is its params")
        if not any(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in jax.tree.leaves(params)):
            raise PolyampError(f"tune: params ({_type(params)}) has no floating-point leaf to train")
        if not callable(loss_fn):
            raise PolyampError(f"tune: loss_fn must be callable(params, batch) -> scalar loss, got "
                               f"{_type(loss_fn)}")  # fmt: skip
        self.optimizer, self.opt_state = _check_optimizer(optimizer)
        self.name = name
        self.params = jax.tree.map(jnp.asarray, params)
        self.batch = batch if callable(batch) else (lambda i: batch)
        _check_tree("batch", self.batch(0), "a pytree of arrays, or a callable i -> batch")
        self.loss_fn = loss_fn
        self.knobs = knobs()
        self._programs: dict[tuple, tuple] = {}  # _program_key(...) -> (mp, f, jitted step)

    def build(self, candidate: Candidate) -> _Step:
        return _Step(self, candidate)

    def program(self, candidate: Candidate) -> tuple:
        """``(mp, f, step)`` for ``candidate``, shared by the configurations of one program."""
        key = _program_key(candidate.policy, dict(candidate.settings))
        if key not in self._programs:
            mp = MixedPrecision(candidate.policy, framework="jax")
            self._programs[key] = (mp, *make_step(mp, self.loss_fn, self.optimizer, dict(candidate.settings)))
        return self._programs[key]


class _Step:
    """One configuration's params, optimizer state and jitted step (``polyamp.tune.space.Step``)."""

    def __init__(self, tunable: Tunable, candidate: Candidate):
        self.tunable = tunable
        self.mp, self.loss, self.train = tunable.program(candidate)
        # donated buffers are consumed: each configuration owns copies (also of an optimizer state that
        # holds the params themselves)
        self.params = _copy(tunable.params)
        state = tunable.opt_state if tunable.opt_state is not None else tunable.optimizer.init(self.params)
        self.opt_state = _copy(state)
        self.state = self.mp.init()

    def step(self, i: int) -> float:
        out = self.train(self.params, self.opt_state, self.state, self.tunable.batch(i))
        self.params, self.opt_state, self.state, loss = jax.block_until_ready(out)
        return float(loss)

    def close(self) -> None:
        self.params = self.opt_state = self.state = self.train = self.loss = self.mp = None


def _copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def _check_tree(what: str, tree, accepted: str) -> None:
    """PolyampError unless ``tree`` is a pytree whose leaves are jax or numpy arrays (at least one)."""
    try:
        leaves = jax.tree.leaves(tree)
    except Exception as err:  # a pytree node whose flatten fails
        raise PolyampError(f"tune: {what}: expected a pytree of arrays ({accepted}), got {_type(tree)}: "
                           f"{err}") from err  # fmt: skip
    if not leaves:
        raise PolyampError(f"tune: {what}: expected a pytree of arrays ({accepted}), got {_type(tree)} "
                           "with no leaves")  # fmt: skip
    for leaf in leaves:
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise PolyampError(f"tune: {what}: expected a pytree of jax or numpy arrays ({accepted}), got "
                               f"a leaf {_type(leaf)}")  # fmt: skip


def _check_optimizer(optimizer):
    """(the optax transformation, the given state or None)."""
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, None
    if (isinstance(optimizer, tuple) and len(optimizer) == 2
            and isinstance(optimizer[0], optax.GradientTransformation)):  # fmt: skip
        return optimizer[0], optimizer[1]
    raise PolyampError(f"tune rebuilds the optimizer state per configuration: give an optax "
                       f"GradientTransformation (e.g. optax.adam(1e-3)) or a pair (optimizer, opt_state); "
                       f"received {_type(optimizer)}")  # fmt: skip


def tune(params, batch, loss_fn, optimizer, *, policies=("bf16-mixed",), budget_s: float = 120.0,
         parity_steps: int = 6, rtol: float = 0.05, min_gain: float = 0.03, name: str = "model",
         progress: Callable | None = None):  # fmt: skip
    """``polyamp.tune`` for a JAX model (module docstring; the search: ``polyamp/tune/search.py``)."""
    tunable = Tunable(params, batch, loss_fn, optimizer, name)
    return search(tunable, policies, budget_s, parity_steps, rtol, min_gain, progress)


class Tuned(NamedTuple):
    """``apply``'s result: ``mp``, the function it differentiates, the jitted train step."""

    mp: MixedPrecision
    loss: Callable
    step: Callable


def apply(report, loss_fn: Callable, optimizer) -> Tuned:
    """``Tuned(mp, loss, step)`` configured as ``report.best``::

        mp, loss, step = report.apply(loss_fn, optimizer)
        opt_state, state = optimizer.init(params), mp.init()
        params, opt_state, state, value = step(params, opt_state, state, batch)   # per batch

    ``step`` donates its first three arguments where the report chose donation: keep only its outputs."""
    if report.framework != "jax":
        raise PolyampError(f"this report tuned {report.framework}, not jax")
    if not callable(loss_fn):
        raise PolyampError(f"apply: loss_fn must be callable(params, batch) -> scalar loss, got "
                           f"{_type(loss_fn)}")  # fmt: skip
    optimizer, _ = _check_optimizer(optimizer)
    mp = MixedPrecision(report.policy, framework="jax")
    f, step = make_step(mp, loss_fn, optimizer, report.settings)
    return Tuned(mp, f, step)
