"""The JAX backend's functional loss scaling: unscaled grads, the finite flag, the state pytree,
select_tree/step_if_finite, JAX's own bad input, and the example. What every front end must do
(skipping inside jit, fault injection, the scale trajectory, resume) is tests/test_contract.py."""

import dataclasses
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from frameworks import require

jax = require("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import NonFiniteError, PolyampError  # noqa: E402
from polyamp.jax import select_tree, step_if_finite  # noqa: E402

EXAMPLES = Path(__file__).parents[1] / "examples"


def loss_fn(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def init(seed=0):
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.standard_normal((8, 16)) / 3, jnp.float32), "b1": jnp.zeros(16),
            "w2": jnp.asarray(rng.standard_normal((16, 1)) / 4, jnp.float32)}  # fmt: skip


def batch(seed=1, n=32):
    x = np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x.sum(1, keepdims=True)))


def mp_for(policy="fp16-mixed", **kw):
    return pa.MixedPrecision(policy, framework="jax", **kw)


# -- grads, flag, state ----------------------------------------------------------------------------
def test_grads_are_unscaled_exactly():
    """float32 compute, scale 2^10: scaling by a power of two is exact, so the grads are jax.grad's."""
    p, (x, y) = init(), batch()
    mp = mp_for("float32", loss_scale=1024.0)
    (loss, grads), finite, state = jax.jit(mp.value_and_grad(loss_fn))(p, x, y, state=mp.init())
    ref_loss, ref = jax.jit(jax.value_and_grad(loss_fn))(p, x, y)
    assert bool(finite) and float(state.scale) == 1024.0 and int(state.steps) == 1
    assert float(loss) == float(ref_loss)
    for k in p:
        assert np.array_equal(grads[k], ref[k]), k


def test_loss_scaling_keeps_small_fp16_gradients_from_underflowing():
    """The backward matmuls run in float16: a 1e-8 cotangent flushes to zero without scaling."""
    p, (x, y) = init(), batch()

    def tiny(p, x, y):
        return 1e-7 * loss_fn(p, x, y)

    ref = jax.jit(jax.grad(tiny))(p, x, y)
    unscaled_mp = mp_for(loss_scale="none")
    lost, _, _ = jax.jit(unscaled_mp.grad(unscaled_mp.autocast(tiny)))(p, x, y, state=unscaled_mp.init())
    mp = mp_for()
    grads, finite, _ = jax.jit(mp.grad(mp.autocast(tiny)))(p, x, y, state=mp.init())
    assert not np.any(lost["w1"]) and bool(finite)
    for k in ("w1", "w2"):
        np.testing.assert_allclose(grads[k], ref[k], rtol=0, atol=0.02 * float(jnp.abs(ref[k]).max()))


def test_has_aux_and_argnums():
    p, (x, y) = init(), batch()
    mp = mp_for("bf16-mixed")

    def with_aux(p, x, y):
        return loss_fn(p, x, y), {"n": x.shape[0]}

    state = mp.init()
    (grads, aux), finite, _ = mp.grad(with_aux, has_aux=True)(p, x, y, state=state)
    assert aux == {"n": 32} and set(grads) == set(p) and bool(finite)
    ((loss, aux), grads2), _, _ = mp.value_and_grad(with_aux, has_aux=True)(p, x, y, state=state)
    assert float(loss) == pytest.approx(float(loss_fn(p, x, y))) and aux == {"n": 32}
    (gp, gx), _, _ = mp.grad(loss_fn, argnums=(0, 1))(p, x, y, state=state)
    assert gx.shape == x.shape and np.allclose(gp["w1"], grads["w1"])


def test_state_survives_jit_tree_map_flattening_and_pickle_field_by_field():
    ls = pa.DynamicLossScale(init_scale=512.0, min_scale=4.0, max_scale=2.0**20, hysteresis=2,
                             growth_interval=7)  # fmt: skip
    mp = mp_for(loss_scale=ls)
    state = mp.update(mp.update(mp.init(), jnp.asarray(False)), jnp.asarray(True))
    copies = {
        "jit": jax.jit(lambda s: s)(state),
        "tree_map": jax.tree.map(lambda a: a, state),
        "unflatten": jax.tree.unflatten(*reversed(jax.tree.flatten(state))),
        "pickle": pickle.loads(pickle.dumps(state)),
        "device_get": jax.device_get(state),
    }
    for how, copy in copies.items():
        assert isinstance(copy, pa.LossScaleState), how  # one state type, on the host and in jit
        for field in dataclasses.fields(pa.LossScaleState):
            a, b = getattr(state, field.name), getattr(copy, field.name)
            if field.name == "next_scale":
                assert a is b is None, how
                continue
            assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b), (how, field.name)
    assert len(jax.tree.leaves(state)) == 6
    assert state.on_host() == pa.LossScaleState(scale=512.0, good_steps=1, hysteresis_left=1,
                                                 skipped_in_a_row=0, steps=2, skipped=1)  # fmt: skip


def test_sync_state_dict_and_init_round_trip():
    mp = mp_for(loss_scale=pa.DynamicLossScale(growth_interval=2))
    state = mp.update(mp.update(mp.init(), jnp.asarray(False)), jnp.asarray(True))
    assert mp.sync(state) == mp.state == state.on_host() and mp.current_scale == 2.0**15
    saved = pickle.loads(pickle.dumps(mp.state_dict()))
    other = mp_for(loss_scale=pa.DynamicLossScale(growth_interval=2))
    other.load_state_dict(saved)
    restored = other.init()  # init() is mp.state as a pytree: the restored one
    assert restored.on_host() == state.on_host()
    assert pa.LossScaleState.from_dict(state.as_dict()) == state.on_host()  # the same plain dict
    with pytest.raises(PolyampError, match="expected the loss-scale state from mp.init"):
        mp.sync(state.as_dict())


def test_too_many_consecutive_skips_raise_at_sync():
    mp = mp_for(loss_scale=pa.DynamicLossScale(max_consecutive_skips=3))
    state = mp.init()
    for _ in range(2):
        state = mp.update(state, jnp.asarray(False))
    mp.sync(state)
    with pytest.raises(NonFiniteError, match="3 consecutive steps were skipped"):
        mp.sync(mp.update(state, jnp.asarray(False)))


def test_select_tree_and_step_if_finite():
    a, b = {"x": jnp.ones(3), "n": jnp.arange(2)}, {"x": jnp.zeros(3), "n": jnp.arange(2) + 5}
    assert np.array_equal(select_tree(jnp.asarray(False), a, b)["n"], [5, 6])
    p, (x, y) = init(), batch()
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    grads = jax.grad(loss_fn)(p, x, y)
    opt_state = optimizer.init(p)
    kept, _ = step_if_finite(jnp.asarray(False), optimizer, grads, opt_state, p)
    stepped, _ = step_if_finite(jnp.asarray(True), optimizer, grads, opt_state, p)

    @jax.jit  # compiled as the branch is, so XLA fuses (and rounds) the update the same way
    def update(grads, opt_state, p):
        return optax.apply_updates(p, optimizer.update(grads, opt_state, p)[0])

    assert np.array_equal(kept["w1"], p["w1"])
    assert np.array_equal(stepped["w1"], update(grads, opt_state, p)["w1"])
    assert not np.array_equal(stepped["w1"], p["w1"])


# -- bad input -------------------------------------------------------------------------------------
def test_bad_input_is_one_clear_error():
    p, (x, y) = init(), batch()
    mp = mp_for()
    grad = mp.grad(loss_fn)
    with pytest.raises(PolyampError, match="expected the loss-scale state from mp.init"):
        grad(p, x, y)
    with pytest.raises(PolyampError, match="got dict"):
        grad(p, x, y, state={"scale": 1.0})
    with pytest.raises(PolyampError, match=r"floating scalar .* got float32 \(32, 1\)"):
        mp.grad(lambda p, x: x @ p["w1"] @ p["w2"])(p, x, state=mp.init())
    with pytest.raises(PolyampError, match="expects the loss function, got int"):
        mp.value_and_grad(3)
    with pytest.raises(PolyampError, match="JAX is functional: instead of mp.apply"):
        mp.apply(optax.adam(1e-3), p, p)
    with pytest.raises(PolyampError, match="JAX is functional: instead of mp.step"):
        mp.step(x)
    with pytest.raises(PolyampError, match="drives torch"):
        pa.MixedPrecision("bf16-mixed", framework="torch").init()
    assert mp.state == mp.loss_scale.init()


# -- the example -----------------------------------------------------------------------------------
def test_example_trains_skips_overflows_and_keeps_reductions_in_float32():
    out = subprocess.run([sys.executable, str(EXAMPLES / "jax_amp.py"), "--policy", "fp16-mixed",
                          "--steps", "60"], capture_output=True, text=True, check=True,
                         timeout=300).stdout  # fmt: skip
    naive = int(re.search(r"naive whole-tree float16 cast: (\d+) reductions", out).group(1))
    ours = re.search(r"polyamp autocast: (\d+) reductions/exp/log/rsqrt and (\d+) matmuls", out).groups()
    assert naive > 0 and ours == ("0", "3")
    first, last, skipped, scale = re.search(
        r"loss ([\d.]+) -> ([\d.]+), (\d+) overflow steps skipped, final scale ([\d.e+-]+)", out
    ).groups()
    assert float(last) < float(first) / 5
    # six injected overflows (steps 0, 10, ..., 50), each halves the scale
    assert int(skipped) == 6 and float(scale) == 2.0**16 / 2**6


# -- issue 11: select_tree's predicate, true policies, what sync reports -----------------------------
@pytest.mark.parametrize("pred", [jnp.ones([1], bool), jnp.asarray(1.0), jnp.ones([2], bool),
                                  np.array([True])])  # fmt: skip
def test_select_tree_refuses_a_predicate_that_is_not_a_0d_bool(pred):
    tree = {"a": jnp.zeros(3), "b": None}
    with pytest.raises(PolyampError, match="select_tree needs a 0-d bool predicate"):
        select_tree(pred, tree, tree)


def test_select_tree_selects_and_refuses_two_structures():
    a, b = {"w": jnp.ones(3), "n": None}, {"w": jnp.zeros(3), "n": None}
    assert np.array_equal(select_tree(jnp.asarray(True), a, b)["w"], a["w"])
    assert np.array_equal(jax.jit(select_tree)(jnp.asarray(False), a, b)["w"], b["w"])
    with pytest.raises(PolyampError, match="one structure"):
        select_tree(jnp.asarray(True), a, {"w": jnp.zeros(3)})


def test_a_true_policy_needs_parameters_in_its_dtype():
    from polyamp.jax import cast_tree

    mp = mp_for("bf16-true")
    p, (x, y) = init(), batch()
    grad = mp.grad(mp.autocast(loss_fn))
    with pytest.raises(PolyampError, match="keeps parameters in bfloat16, but argument 0 holds a"):
        grad(p, x, y, state=mp.init())
    low = cast_tree(p, "bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(low)} == {jnp.dtype(jnp.bfloat16)}
    grads, finite, _ = jax.jit(grad)(low, x, y, state=mp.init())
    assert bool(finite) and {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}


def test_sync_warns_at_the_first_skip_of_a_bf16_run_even_when_synced_late():
    mp = mp_for("bf16-mixed")
    state = mp.init()
    for finite in (True, False, False, True):
        state = mp.update(state, jnp.asarray(finite))
    with pytest.warns(RuntimeWarning, match="a step was skipped"):
        mp.sync(state)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mp.sync(mp.update(state, jnp.asarray(False)))  # later skips: counted, no warning
