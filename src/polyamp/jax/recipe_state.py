"""The state a JAX recipe keeps between steps, as a pytree threaded through the jitted step.

Two recipes keep state (:func:`keeps_state`): delayed scaling (``fp8-delayed``: an amax history and a
scale per quantized operand) and stochastic rounding (a counter of quantize calls, from which each call's
seed comes). :class:`RecipeState` holds both as arrays:

    calls    uint32 0-d: quantize calls made so far (torch's ``Quantizer.calls``)
    delayed  {"layer|operand": {"scale": f32, "history": f32[history_len], "steps": int32}}

``layer`` is the matmul's ``jax.named_scope`` path (``path#1``, ``path#2`` for its second, third dense
matmul or convolution); ``operand`` is ``input``, ``weight`` or ``grad``. One step (:class:`Run`, active
while ``mp.value_and_grad`` evaluates the autocast function) numbers the quantized matmuls ``j = 0 ..
n-1`` in trace order (a convolution is one: it makes a dense matmul's quantize calls in the same order,
``recipe_conv.py``) and gives each quantize call the seed ``calls + position``, the positions torch's
``Quantizer`` counts for a stack of layers run forward in that order and backward in reverse: first
``input, weight`` of each matmul, then each matmul's backward calls, last matmul first (block recipes:
``grad`` along N, ``weight`` transposed unless 16x16, ``grad`` and ``input`` transposed; per-tensor
recipes: ``grad`` once); the step adds the ``T`` positions it used to ``calls``.

Amaxes leave the step through the gradient: each quantized matmul takes its three delayed scales as
inputs of its ``custom_vjp``, and its backward rule returns as their cotangents the amaxes of ``x``,
``w`` (recorded in the forward) and ``g``, so ``jax.value_and_grad`` with respect to the scales yields
every amax of the step; :func:`advance` then runs ``DelayedScaling.update`` on each entry (TE's order:
the scale used is the one from before this step's amax). An entry the state lacks is created by
``mp.init(f, *example_args)``, or else when the step that meets it first is traced (the state's structure
changes once, so a jitted step traces again at the next call). Outside a step (evaluation) the autocast
function runs the recipe without state (current scaling, nearest rounding) and refuses to be
differentiated. Limits: the autocast function runs once per step, and no quantized matmul of a stateful
recipe may sit inside ``scan``/``while``/``cond``/``checkpoint`` or a custom derivative (an error says so).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import PolyampError
from ..numerics import exact_int, get_format
from ..numerics.stream import GOLDEN, M1, M2
from ..recipes import DelayedScaling, Recipe
from .quantize import _add64, _mul64, _xor_shr

OPERANDS = ("input", "weight", "grad")


def keeps_state(recipe: Recipe | None) -> bool:
    """Whether ``recipe`` needs a :class:`RecipeState`: delayed scaling or stochastic rounding."""
    return recipe is not None and (recipe.kind == "delayed" or "stochastic" in
                                   (recipe.forward_rounding, recipe.grad_rounding))  # fmt: skip


@dataclass(frozen=True)
class RecipeState:
    """The recipe's state (module docstring): ``calls`` and the ``delayed`` entries, arrays."""

    calls: Any
    delayed: dict[str, dict[str, Any]]


jax.tree_util.register_dataclass(RecipeState, data_fields=["calls", "delayed"], meta_fields=[])


def calls_per_matmul(recipe: Recipe) -> tuple[int, int]:
    """Quantize calls of one matmul (or convolution) in the forward and in the backward pass (torch's
    ``Quantizer``)."""
    forward = 2 if recipe.quantize_forward else 0
    bq, wq = recipe.quantize_input_grad, recipe.quantize_weight_grad
    if recipe.kind == "block":
        backward = (2 - recipe.weight_2d if bq else 0) + (2 if wq else 0)
    else:
        backward = 1 if (bq or wq) else 0
    return forward, backward


def delayed_config(recipe: Recipe, operand: str) -> DelayedScaling:
    """A fresh core ``DelayedScaling`` for ``operand`` of a delayed recipe."""
    fmt = recipe.backward_format if operand == "grad" else recipe.forward_format
    return DelayedScaling(fmt, recipe.history_len, recipe.amax_compute_algo, recipe.margin)


# -- host <-> device -------------------------------------------------------------------------------
def from_host(host: dict[str, Any] | None) -> RecipeState:
    """The device state of a host state (``{"calls": int, "delayed": {key: DelayedScaling}}``)."""
    host = host or {"calls": 0, "delayed": {}}
    return RecipeState(jnp.asarray(np.uint32(host["calls"])),
                       {k: _entry(ds) for k, ds in host["delayed"].items()})  # fmt: skip


def _entry(ds: DelayedScaling) -> dict[str, Any]:
    return {"scale": jnp.asarray(ds.scale, jnp.float32), "history": jnp.asarray(ds.history, jnp.float32),
            "steps": jnp.asarray(ds.steps, jnp.int32)}  # fmt: skip


def to_host(recipe: Recipe, state: RecipeState) -> dict[str, Any]:
    """The host state of a device state (one device-to-host copy)."""
    state = jax.device_get(state)
    delayed = {}
    for key, e in state.delayed.items():
        ds = delayed[key] = delayed_config(recipe, key.rpartition("|")[2])
        ds.load_state_dict({**ds.state_dict(), "scale": float(e["scale"]), "steps": int(e["steps"]),
                            "history": [float(v) for v in np.asarray(e["history"], np.float32)]})  # fmt: skip
    return {"calls": int(state.calls), "delayed": delayed}


def host_state_dict(host: dict[str, Any] | None) -> dict[str, Any]:
    """``Quantizer.state_dict()``'s form of a host state (torch and JAX checkpoints share it)."""
    host = host or {"calls": 0, "delayed": {}}
    return {"calls": host["calls"], "delayed": {k: v.state_dict() for k, v in host["delayed"].items()}}


def load_host(recipe: Recipe, saved: Any) -> dict[str, Any]:
    """A host state from :func:`host_state_dict`'s dict, checked by the core (PolyampError if bad)."""
    fits = isinstance(saved, dict) and set(saved) == {"calls", "delayed"}
    if not (fits and isinstance(saved["delayed"], dict)):
        raise PolyampError(f"a recipe state must be {{'calls': int, 'delayed': {{...}}}}; received {saved!r}")
    calls = saved["calls"]
    if isinstance(calls, bool) or not isinstance(calls, int) or not 0 <= calls < 2**32:
        raise PolyampError(f"the recipe state's calls must be an integer in [0, 2^32); received {calls!r}")
    delayed = {}
    for key, value in saved["delayed"].items():
        operand = key.rpartition("|")[2] if isinstance(key, str) else None
        if recipe.kind != "delayed" or operand not in OPERANDS:
            raise PolyampError(f"the recipe state holds delayed-scaling entry {key!r}, which recipe "
                               f"{recipe.name!r} has no place for; accepted keys: 'layer|input', "
                               "'layer|weight', 'layer|grad' of a delayed recipe")  # fmt: skip
        ds = delayed[key] = delayed_config(recipe, operand)
        ds.load_state_dict(value)
    return {"calls": calls, "delayed": delayed}


# -- one step -----------------------------------------------------------------------------------------
class Run:
    """One step's trace-time bookkeeping: the state's arrays, the quantized matmuls met so far, the
    delayed entries the state lacks."""

    def __init__(self, recipe: Recipe, calls, scales: dict[str, Any]):
        self.recipe, self.calls, self.scales = recipe, calls, scales
        self.count = 0  # quantized matmuls met
        self.paths: dict[str, int] = {}
        self.used: list[str] = []  # delayed entries this step read
        self.missing: list[str] = []
        self.closed = False  # the forward traced whole: the backward positions are known

    def matmul(self, path: str) -> tuple[int, str]:
        """The next quantized matmul: its index and its layer key."""
        n = self.paths.get(path, 0)
        self.paths[path] = n + 1
        self.count += 1
        return self.count - 1, path if n == 0 else f"{path}#{n}"

    def scale(self, layer: str, operand: str):
        """The delayed scale of ``layer|operand`` (1.0 for a recipe that is not delayed)."""
        key = f"{layer}|{operand}"
        if self.recipe.kind != "delayed":
            return jnp.float32(1.0)
        if key in self.used:
            raise PolyampError(f"the delayed-scaling entry {key!r} was met twice in one step: under a recipe "
                               "that keeps state, call the autocast function once per step")  # fmt: skip
        self.used.append(key)
        if key not in self.scales:
            self.missing.append(key)
            return jnp.float32(1.0)
        return self.scales[key]

    def seed_position(self, j: int, call: int, backward: bool) -> int:
        """The position (1-based, from the step's ``calls``) of matmul ``j``'s ``call``-th quantize
        call of its forward or backward pass; backward positions need the forward traced whole."""
        forward, per = calls_per_matmul(self.recipe)
        if not backward:
            return forward * j + call + 1
        if not self.closed:
            raise PolyampError("a stateful recipe's backward pass was traced before its step's forward pass "
                               "ended (a gradient taken inside the loss function?); take it with "
                               "mp.value_and_grad")  # fmt: skip
        return forward * self.count + per * (self.count - 1 - j) + call + 1

    @property
    def total(self) -> int:
        """The positions this step used: ``T``."""
        return sum(calls_per_matmul(self.recipe)) * self.count


_ACTIVE: list[Run] = []


@contextlib.contextmanager
def running(run: Run):
    """``run`` is the active step while the autocast function is evaluated."""
    _ACTIVE.append(run)
    try:
        yield run
    finally:
        _ACTIVE.pop()
        run.closed = True


def active() -> Run | None:
    return _ACTIVE[-1] if _ACTIVE else None


def seed_key(calls, position: int):
    """The stream key ``_mix(calls + position)`` of ``polyamp.numerics.rounding`` as a (hi, lo) uint32
    pair, from a traced uint32 ``calls``: the key ``quantize`` makes from that seed on the host."""
    lo = calls.astype(jnp.uint32) + np.uint32(position)
    hi = (lo < np.uint32(position)).astype(jnp.uint32)  # the carry into bit 32
    z = _add64(hi, lo, np.uint32(GOLDEN >> 32), np.uint32(GOLDEN & 0xFFFFFFFF))
    z = _mul64(*_xor_shr(*z, 30), M1)
    z = _mul64(*_xor_shr(*z, 27), M2)
    return _xor_shr(*z, 31)


# -- after the step ---------------------------------------------------------------------------------------
def fill(recipe: Recipe, state: RecipeState, keys) -> RecipeState:
    """``state`` with fresh entries (scale 1, zero history) for ``keys``."""
    new = {k: _entry(delayed_config(recipe, k.rpartition("|")[2])) for k in keys}
    return RecipeState(state.calls, {**state.delayed, **new})


def advance(recipe: Recipe, state: RecipeState, run: Run, amaxes: dict[str, Any], axis_name=None):
    """The state after the step ``run``: each entry it used updated with its amax (all-reduced with
    ``lax.pmax`` over ``axis_name`` when the recipe reduces amaxes), ``calls`` advanced by the step's
    ``T``."""
    delayed = dict(state.delayed)
    for key in run.used:
        amax = amaxes[key]
        if axis_name is not None and recipe.reduce_amax:
            amax = lax.pmax(amax, axis_name)
        delayed[key] = update(recipe, key.rpartition("|")[2], delayed[key], amax)
    return RecipeState(state.calls + np.uint32(run.total), delayed)


def update(recipe: Recipe, operand: str, entry: dict[str, Any], amax) -> dict[str, Any]:
    """``DelayedScaling.update`` on arrays: ``amax`` into ``history[0]``, the scale from the max (NaN
    skipped) or the latest, kept where that amax is 0 or not finite, then the history rolled."""
    h = entry["history"].at[0].set(amax.astype(jnp.float32))
    used = jnp.nanmax(h) if recipe.amax_compute_algo == "max" else h[0]
    fmt = recipe.backward_format if operand == "grad" else recipe.forward_format
    scale = scale_from_amax(used, fmt, recipe.margin, 0.0, entry["scale"])
    return {"scale": scale, "history": jnp.roll(h, -1).at[0].set(0.0), "steps": entry["steps"] + 1}


def scale_from_amax(amax, fmt: str, margin: int, eps: float, fallback):
    """The core's ``recipes._scale`` of a float32 amax, as JAX ops: ``float32(Fmax 2^-margin /
    max(amax, eps))``, float32's max where that overflows, ``fallback`` where the amax is 0 or not finite.
    (One float32 division rounds as the core's float64 quotient cast to float32 does.)"""
    scaled_max = np.float32(float(get_format(fmt).max) * 2.0**-margin)
    # a subnormal amax is > 0 for the core too; read its bits, as XLA on the CPU flushes it to 0 (and
    # rewrites where(a < eps, eps, a) as a flushing max): its quotient is then inf, float32's max below
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    q = scaled_max / amax
    q = jnp.where(jnp.isinf(q), jnp.float32(np.finfo(np.float32).max), q)
    q = jnp.where(jnp.isfinite(amax) & (bits > 0), q, jnp.asarray(fallback, jnp.float32))
    if eps > 0:  # below eps (compared as bits: eps need not be a float32; -0 and negatives are below)
        threshold, q_eps = exact_int.eps_floor(float(scaled_max), eps)
        q = jnp.where((bits < threshold) & ~jnp.isnan(amax), jnp.float32(q_eps), q)
    return q
