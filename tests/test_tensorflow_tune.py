"""``polyamp tune`` in Keras 3 (``polyamp/tensorflow/tune.py``): a search on a tiny Dense model that reports
every knob value with parity held, JSON and text; candidates built equal (a clone of a built model too);
the compare workload's step equal to compare's Trainer's; ``apply`` that trains; a NaN reference and bad
input refused."""

import json

import numpy as np
import pytest
from frameworks import require

tf = require("tensorflow")
import keras  # noqa: E402

from polyamp import PolyampError  # noqa: E402
from polyamp.compare.tensorflow import tune_inputs  # noqa: E402
from polyamp.tensorflow import tune as tt  # noqa: E402
from polyamp.tune.report import STATUSES  # noqa: E402
from polyamp.tune.space import Candidate  # noqa: E402

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 16)).astype(np.float32)
Y = (X[:, :1] * 0.5 - X[:, 1:2]).astype(np.float32)


def make_model():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(1)])  # fmt: skip


def adam():
    return keras.optimizers.Adam(1e-2)


@pytest.fixture(scope="module")
def report():
    return tt.tune(make_model, (X, Y), keras.losses.MeanSquaredError(), adam(), budget_s=8, parity_steps=3)


def test_report_covers_every_knob_value_with_parity(report):
    assert report.framework == "tensorflow" and report.policies == ("float32", "bf16-mixed")
    assert set(report.knobs) == {"jit_compile"}
    for policy in report.policies:
        for knob, spec in report.knobs.items():
            tried = {t.candidate.get(knob) for t in report.trials if t.candidate.policy == policy}
            tried |= {f.candidate.get(knob) for f in report.final if f.candidate.policy == policy}
            assert tried == set(spec.values), (policy, knob, tried)
    assert all(t.status in STATUSES for t in report.trials)
    assert any(t.candidate.policy == "bf16-mixed" and t.baseline is None for t in report.trials)
    for t in report.trials:
        if t.status in ("ok", "chosen", "no gain", "slower") and t.parity is not None:
            assert t.parity <= report.rtol, t
        if t.status in ("ok", "chosen"):
            assert t.parity is not None and t.final_loss is not None
    assert np.isfinite(report.reference_loss) and report.final[0].key == "float32 default"
    assert report.best.policy in report.policies


def test_report_goes_to_json_and_text(report, tmp_path):
    data = json.loads(json.dumps(report.to_json()))
    assert data["framework"] == "tensorflow" and len(data["trials"]) == len(report.trials)
    assert data["best"]["policy"] == report.policy
    report.save(tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["name"] == "model"
    text = report.text()
    assert "polyamp tune: model in tensorflow" in text and "jit_compile" in text


def test_apply_gives_a_step_that_trains(report):
    mp, model, optimizer, jit = report.apply(make_model, adam())
    assert mp.policy.name == report.policy and jit == report.settings["jit_compile"]
    assert model.dtype_policy.name == {"float32": "float32", "bf16-mixed": "mixed_bfloat16"}[report.policy]
    assert optimizer.built and isinstance(optimizer, keras.optimizers.Adam)
    step = tf.function(tt.train_step(mp, model, optimizer, keras.losses.MeanSquaredError()), jit_compile=jit)
    losses = [float(step(X, Y)) for _ in range(30)]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]


def test_every_candidate_starts_from_the_first_builds_weights():
    tunable = tt.Tunable(make_model, lambda i: (X[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8]),
                         keras.losses.MeanSquaredError(), adam())  # fmt: skip
    f32 = tunable.build(Candidate.of("float32", {"jit_compile": False}))
    bf16 = tunable.build(Candidate.of("bf16-mixed", {"jit_compile": True}))
    for a, b, c in zip(tunable.initial, f32.model.get_weights(), bf16.model.get_weights(), strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert bf16.model.layers[0].compute_dtype == "bfloat16" and f32.model.layers[0].compute_dtype == "float32"
    a, b = f32.step(0), bf16.step(0)
    assert isinstance(a, float) and abs(a - b) <= 0.05 * abs(a)
    f32.close()
    bf16.close()


def test_a_closed_step_comes_back_at_its_initial_state():
    tunable = tt.Tunable(make_model, lambda i: (X[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8]),
                         keras.losses.MeanSquaredError(), adam())  # fmt: skip
    candidate = Candidate.of("fp16-mixed", {"jit_compile": False})  # with a loss-scale state
    step = tunable.build(candidate)
    first = [step.step(i) for i in range(4)]
    assert step.optimizer.iterations.numpy() > 0 and step.mp.state != step._initial[1]
    step.close()
    step.close()  # once in the pool
    again = tunable.build(candidate)
    assert again is step and tunable.build(candidate) is not step  # the pool had one
    for a, b in zip(tunable.initial, again.model.get_weights(), strict=True):
        assert np.array_equal(a, b)
    assert again.optimizer.iterations.numpy() == 0 and again.mp.state == again._initial[1]
    assert [again.step(i) for i in range(4)] == first  # bit for bit


def functional():
    """A functional model holding a Sequential (cloned recursively)."""
    x = keras.Input((16,))
    inner = keras.Sequential([keras.Input((32,)), keras.layers.Dense(32, activation="relu")])
    return keras.Model(x, keras.layers.Dense(1)(inner(keras.layers.Dense(32)(x))))


def leaves(model):
    out = []
    for layer in model.layers:
        out += leaves(layer) if hasattr(layer, "layers") else [layer] if layer.weights else []
    return out


@pytest.mark.parametrize("build", [make_model, functional])
def test_a_built_model_is_cloned_per_policy(build):
    built = build()
    tunable = tt.Tunable(built, (X, Y), keras.losses.MeanSquaredError(), adam())
    step = tunable.build(Candidate.of("bf16-mixed", {"jit_compile": False}))
    assert step.model is not built and len(leaves(step.model)) == len(leaves(built)) >= 2
    assert all(layer.compute_dtype == "bfloat16" for layer in leaves(step.model))
    for a, b in zip(built.get_weights(), step.model.get_weights(), strict=True):
        assert np.array_equal(a, b)
    want = float(keras.losses.MeanSquaredError()(Y, built(X)))
    assert abs(step.step(0) - want) <= 0.02 * want  # the first step's loss is the given weights' loss
    assert all(layer.compute_dtype == "float32" for layer in leaves(built))  # the user's model as it was


def test_the_workload_step_is_compares_trainers():
    from polyamp.compare.tensorflow import Trainer
    from polyamp.compare.workloads import get_workload

    make, batch, loss_fn, optimizer = tune_inputs("mlp", quick=True)
    assert isinstance(optimizer, keras.optimizers.Adam) and optimizer.get_config()["epsilon"] == 1e-8
    step = tt.Tunable(make, batch, loss_fn, optimizer, name="mlp").build(
        Candidate.of("float32", {"jit_compile": False}))  # fmt: skip
    trainer = Trainer(get_workload("mlp", quick=True), "float32")
    ours, theirs = [step.step(i) for i in range(3)], [trainer.step(i) for i in range(3)]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_a_nan_reference_is_refused():
    bad = X.copy()
    bad[0, 0] = np.nan  # a linear model: a graph's fused ReLU would turn the NaN into 0

    def linear():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])

    with pytest.raises(PolyampError, match="float32 reference"):
        tt.tune(linear, (bad, Y), keras.losses.MeanSquaredError(), adam(), budget_s=4, parity_steps=2)


@pytest.mark.parametrize(
    "args, match",
    [
        ((42, (X, Y), "loss", adam()), "make_model, a function of no arguments"),
        ((keras.layers.Dense(3), (X, Y), None, adam()), "wrap it in a keras.Model"),
        ((make_model, (X, Y), keras.losses.MeanSquaredError(), "adam"), "Keras 3 optimizer"),
        ((make_model, (X, Y), keras.losses.MeanSquaredError(), keras.optimizers.LossScaleOptimizer(adam())),
         "inner_optimizer"),
        ((make_model, (X, Y), 3.0, adam()), "loss_fn must be a Keras loss"),
        ((make_model, (X, Y, Y), keras.losses.MeanSquaredError(), adam()), "a tuple of 3 items"),
        ((lambda: "model", (X, Y), keras.losses.MeanSquaredError(), adam()), "returned builtins.str"),
    ],
)  # fmt: skip
def test_bad_input_is_refused(args, match):
    with pytest.raises(PolyampError, match=match):
        tt.tune(*args, budget_s=4, parity_steps=2)


def test_a_make_model_that_returns_one_model_is_refused():
    model = make_model()
    tunable = tt.Tunable(lambda: model, (X, Y), keras.losses.MeanSquaredError(), adam())
    with pytest.raises(PolyampError, match="same model object twice"):
        tunable.build(Candidate.of("float32", {"jit_compile": False}))


def test_a_report_of_another_framework_is_refused(report):
    import dataclasses

    with pytest.raises(PolyampError, match="tuned torch, not tensorflow"):
        tt.apply(dataclasses.replace(report, framework="torch"), make_model, adam())
