"""polyamp.jax.update_if_finite: Flax NNX's ``nnx.Optimizer`` update gated by polyamp's finite flag, under
``nnx.jit``, on real flax and optax: a step whose gradients overflow leaves the weights, the optimizer
state and ``optimizer.step`` as they were; the finite steps equal ``optimizer.update`` (bit for bit under
bf16-mixed; to an ulp under a loss scale)."""

import math

import pytest
from docs_example import run_example
from frameworks import require

jax = require("jax")
optax = require("optax")
flax = require("flax")
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import polyamp as pa  # noqa: E402
from polyamp import PolyampError  # noqa: E402
from polyamp.jax import update_if_finite  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


def loss_fn(model, x, y, bad):
    return jnp.mean((model(x) - y) ** 2) * jnp.where(bad, jnp.inf, 1.0)


def batch(step):
    kx, ky = jax.random.split(jax.random.PRNGKey(step))
    return jax.random.normal(kx, (4, 8)), jax.random.normal(ky, (4, 1))


def leaves(*trees):
    return [x for t in trees for x in jax.tree.leaves(nnx.state(t))]


BAD = (1, 3)


@pytest.mark.parametrize("policy", ["bf16-mixed", "fp16-mixed"])
def test_an_overflow_is_skipped_and_finite_steps_are_optimizer_update(policy):
    scaling = {"loss_scale": pa.DynamicLossScale(init_scale=256.0)} if policy == "fp16-mixed" else {}
    mp = pa.MixedPrecision(policy, framework="jax", **scaling)  # 256: this MLP's fp16 gradients fit
    f = mp.autocast(loss_fn)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y, bad, state):
        (loss, grads), finite, state = mp.value_and_grad(f)(model, x, y, bad, state=state)
        update_if_finite(finite, optimizer, model, grads)
        return finite, state

    # the reference: the same steps through nnx.Optimizer.update, the overflowing ones left out by hand
    ref = MLP(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer, x, y, scale):
        grads = nnx.grad(lambda m: f(m, x, y, False) * scale)(model)
        optimizer.update(model, jax.tree.map(lambda g: g / scale, grads))

    state, scales, flags = mp.init(), [], []
    for i in range(5):
        before = leaves(model, optimizer)
        scale = state.scale
        finite, state = step(model, optimizer, *batch(i), i in BAD, state)
        flags.append(bool(finite))
        scales.append(float(state.scale))
        if i in BAD:  # nothing moved
            assert all(bool((a == b).all()) for a, b in zip(before, leaves(model, optimizer)))
        else:
            ref_step(ref, ref_opt, *batch(i), scale)
    assert flags == [i not in BAD for i in range(5)]
    assert int(optimizer.step[...]) == 3 == int(ref_opt.step[...])
    if policy == "bf16-mixed":
        assert all(bool((a == b).all()) for a, b in zip(leaves(model), leaves(ref)))
    else:  # to an ulp: XLA fuses the unscale into the update differently inside and outside the cond
        assert all(bool(jnp.allclose(a, b, rtol=1e-6, atol=0)) for a, b in zip(leaves(model), leaves(ref)))
    want = [1.0] * 5 if policy == "bf16-mixed" else [256.0, 128.0, 128.0, 64.0, 64.0]
    assert scales == want and int(mp.sync(state).skipped) == 2
    assert all(math.isfinite(float(x.max())) for x in leaves(model, optimizer) if x.dtype != jnp.uint32)


def test_nnx_grad_states_are_taken_too_and_bad_input_is_refused():
    model = MLP(nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(lambda m: loss_fn(m, *batch(0), False))(model)  # an nnx.State
    before = leaves(model)
    updates = update_if_finite(jnp.asarray(True), optimizer, model, grads)
    assert any(bool((a != b).any()) for a, b in zip(before, leaves(model))) and jax.tree.leaves(updates)
    with pytest.raises(PolyampError, match="takes an nnx.Optimizer, got GradientTransformationExtraArgs"):
        update_if_finite(jnp.asarray(True), optax.sgd(0.1), model, grads)
    with pytest.raises(PolyampError, match="0-d bool flag"):
        update_if_finite(jnp.ones(2, bool), optimizer, model, grads)


def test_the_docs_example_runs(tmp_path):
    """docs/flax-nnx.md's example, run here: what it prints is what the page says."""
    run_example("flax-nnx.md", "jax", tmp_path)
