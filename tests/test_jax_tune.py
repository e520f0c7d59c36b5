"""``polyamp.tune`` on JAX (``polyamp/jax/tune.py``): what each knob does to the step's matmuls, every
configuration starting from its own copy of the same weights, a short search's report, ``report.apply``,
the compare workloads as tune's inputs, and bad input."""

import json
import math

import numpy as np
import pytest
from frameworks import require

jax = require("jax")
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.extend import core as jcore  # noqa: E402

from polyamp import PolyampError  # noqa: E402
from polyamp.compare.jax import tune_inputs  # noqa: E402
from polyamp.jax import tune as jt  # noqa: E402
from polyamp.tune import Candidate  # noqa: E402
from polyamp.tune.report import STATUSES  # noqa: E402


def init(seed=0):  # numpy's generator: jax.random.normal would compile a program per shape
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.standard_normal((16, 32)) * 0.3, jnp.float32), "b1": jnp.zeros(32),
            "w2": jnp.asarray(rng.standard_normal((32, 4)) * 0.3, jnp.float32)}  # fmt: skip


BATCHES = [np.random.default_rng(100 + i).standard_normal((32, 16)).astype(np.float32) for i in range(4)]


def batches(i):
    x = jnp.asarray(BATCHES[i % 4])
    return x, jnp.sin(x[:, :4])


def loss_fn(p, b):
    x, y = b
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def defaults(t, **changes):
    return {**{k: v.default for k, v in t.knobs.items()}, **changes}


def dots(step, *args) -> list[tuple[tuple[str, ...], str]]:
    """(operand dtypes, result dtype) of every dot_general in the traced train step, sub-jaxprs included."""
    out, todo = [], [jax.make_jaxpr(step)(*args).jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            todo.extend(jcore.jaxprs_in_params(eqn.params))
            if eqn.primitive.name == "dot_general":
                out.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
    return out


def test_each_knob_changes_the_step_as_documented():
    t = jt.Tunable(init(), batches(0), loss_fn, optax.adam(1e-2))
    assert set(t.knobs) == {"accumulate", "backward", "donate"}
    assert all("{value}" in k.why for k in t.knobs.values())
    found = {}
    cases = [("bf16-mixed", {}), ("bf16-mixed", {"backward": False}), ("bf16-mixed", {"accumulate": False}),
             ("float32", {"accumulate": False})]  # fmt: skip
    for policy, change in cases:
        step = t.build(Candidate.of(policy, defaults(t, **change)))
        args = (step.params, step.opt_state, step.state, batches(0))
        found[policy, tuple(change)] = set(dots(step.train, *args))
        step.close()
    bf16, f32 = "bfloat16", "float32"
    assert found["bf16-mixed", ()] == {((bf16, bf16), f32)}  # forward and backward: bf16 in, f32 out
    assert ((f32, bf16), f32) in found["bf16-mixed", ("backward",)]  # JAX's transposes: f32 cotangents
    assert found["bf16-mixed", ("accumulate",)] == {((bf16, bf16), bf16)}  # plain casts: bf16 results
    assert found["float32", ("accumulate",)] == {((f32, f32), f32)}


def test_every_configuration_starts_from_the_same_weights_and_leaves_the_callers_alone():
    params, opt = init(), optax.adam(1e-2)
    opt_state = opt.init(params)
    before = jax.tree.map(np.asarray, params)
    t = jt.Tunable(params, batches, loss_fn, (opt, opt_state))
    settings = [{}, {"donate": True}, {"accumulate": False}]
    steps = [t.build(Candidate.of("float32", defaults(t, **s))) for s in settings]
    losses = [[s.step(i) for i in range(4)] for s in steps]
    assert losses[0] == losses[1] == losses[2]  # donation changes no arithmetic; float32 casts nothing
    assert losses[0][-1] < losses[0][0]
    # one program per distinct configuration: float32's accumulate=off is float32's default, compiled once
    assert steps[2].train is steps[0].train and steps[1].train is not steps[0].train
    assert t.build(Candidate.of("bf16-mixed", defaults(t))).train is not steps[0].train
    # the caller's params and optimizer state were copied, never donated
    assert all(np.array_equal(np.asarray(params[k]), before[k]) for k in params)
    assert int(opt_state[0].count) == 0
    for s in steps:
        s.close()


def test_a_short_search_reports_every_trial_and_applies_its_best():
    opt = optax.adam(1e-2)
    report = jt.tune(init(), batches, loss_fn, opt, budget_s=8, parity_steps=3, name="tiny")
    assert report.framework == "jax" and report.name == "tiny"
    assert report.policies == ("float32", "bf16-mixed")
    knobs = jt.knobs()
    expected = {(p, k, v) for p in report.policies for k, knob in knobs.items() for v in knob.values[1:]
                if knob.policies is None or p in knob.policies}  # fmt: skip
    assert ("float32", "accumulate", False) not in expected  # a knob that cannot change float32's step
    tried = set()
    for trial in report.trials:
        assert trial.status in STATUSES
        assert trial.candidate.policy in report.policies
        assert dict(trial.candidate.settings).keys() == knobs.keys()
        if trial.status in ("ok", "chosen"):
            assert trial.parity is not None and trial.parity <= report.rtol
        changed = [(k, v) for k, v in trial.candidate.settings if v != knobs[k].default]
        assert len(changed) <= len(knobs)
        tried.update((trial.candidate.policy, k, v) for k, v in changed)
    assert expected <= tried
    # the bf16 default is always checked against float32's loss
    default = Candidate.of("bf16-mixed", {k: v.default for k, v in knobs.items()})
    (bf16,) = [t for t in report.trials if t.candidate == default]
    assert bf16.status == "ok" and bf16.parity <= report.rtol
    assert math.isfinite(report.reference_loss)
    assert json.loads(json.dumps(report.to_json()))["framework"] == "jax"
    assert report.best.policy in report.policies and "best:" in report.text()

    mp, f, step = report.apply(loss_fn, opt)
    assert mp.policy.name == report.policy and callable(f)
    params, opt_state, state = init(), opt.init(init()), mp.init()
    losses = []
    for i in range(20):
        params, opt_state, state, loss = step(params, opt_state, state, batches(i))
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]


def test_a_nan_loss_leaves_no_reference():
    def nan_loss(p, b):
        return loss_fn(p, b) * jnp.nan

    with pytest.raises(PolyampError, match="float32 reference's loss after 3 steps is nan"):
        jt.tune(init(), batches, nan_loss, optax.sgd(0.1), budget_s=5, parity_steps=3)


def test_the_compare_workloads_are_tune_inputs():
    from polyamp.compare import jax as cj
    from polyamp.compare.workloads import get_workload

    params, batch, loss, opt = tune_inputs("mlp", quick=True)
    wl = get_workload("mlp", quick=True)
    assert set(params) == set(wl.weights) and isinstance(opt, optax.GradientTransformation)
    assert all(np.array_equal(np.asarray(params[k]), w) for k, w in wl.weights.items())
    x, y = batch(wl.steps + 1)  # batches cycle
    assert np.array_equal(np.asarray(x), wl.batch_at(1)[0])
    t = jt.Tunable(params, batch, loss, opt, name="mlp")
    step = t.build(Candidate.of("bf16-mixed", defaults(t)))
    trainer = cj.Trainer(wl, "bf16-mixed")
    ours, theirs = [step.step(i) for i in range(2)], [trainer.step(i) for i in range(2)]
    assert np.allclose(ours, theirs, rtol=1e-6)  # compare's own bf16 step on the same weights and batches


def test_bad_input_is_refused():
    params, opt = init(), optax.adam(1e-3)
    arrays = "expected a pytree of jax or numpy arrays"
    with pytest.raises(PolyampError, match=f"params: {arrays} .* got a leaf builtins.str"):
        jt.tune("weights", batches, loss_fn, opt)
    with pytest.raises(PolyampError, match="got a leaf builtins.int"):
        jt.Tunable({"w": [1, 2]}, batches, loss_fn, opt)
    with pytest.raises(PolyampError, match="no floating-point leaf"):
        jt.Tunable({"ids": jnp.arange(3)}, batches, loss_fn, opt)
    with pytest.raises(PolyampError, match="params: .* with no leaves"):
        jt.Tunable({}, batches, loss_fn, opt)
    with pytest.raises(PolyampError, match=f"batch: {arrays} .* got a leaf builtins.float"):
        jt.Tunable(params, lambda i: {"x": [[1.0]]}, loss_fn, opt)
    with pytest.raises(PolyampError, match="loss_fn must be callable"):
        jt.Tunable(params, batches, None, opt)
    for bad in (None, "adam", optax.adam):
        with pytest.raises(PolyampError, match="give an optax GradientTransformation .* received"):
            jt.tune(params, batches, loss_fn, bad)
    with pytest.raises(PolyampError, match="tune compares float32, bf16-mixed, fp16-mixed"):
        jt.tune(params, batches, loss_fn, opt, policies=("nvfp4",))
