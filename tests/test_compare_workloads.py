"""The compare workloads (one class each, owning loss, metric and target) and the trainer protocol,
checked on the real frameworks at quick sizes.

MXNet runs under ``.venv-mxnet``: ``POLYAMP_TEST_FRAMEWORKS=mxnet .venv-mxnet/bin/python -m pytest
tests/test_compare_workloads.py``. Its AMP is process-wide (float32 cannot follow bf16 in one
process), so each (framework, policy) is probed in a subprocess of this interpreter.
"""

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from frameworks import require

from polyamp import PolyampError
from polyamp.compare.protocol import Trainer, TrainerBase
from polyamp.compare.workloads import WORKLOADS, CharLM, Digits, Target, cross_entropy, get_workload

FRAMEWORKS = ("torch", "tensorflow", "jax", "mxnet")
POLICIES = ("float32", "bf16-mixed")
# float32, quick sizes: the metric after 4 steps (digits: 40), as each trainer computed it in its
# own framework before the workloads owned evaluation (measured with the previous commit, e7d7686)
BEFORE = {
    "torch": {"mlp": 0.38630566000938416, "charlm": 3.876107931137085, "digits": 0.4388888888888889},
    "jax": {"mlp": 0.3863058090209961, "charlm": 3.876109480857849, "digits": 0.4388888888888889},
    "tensorflow": {"mlp": 0.3863222897052765, "charlm": 3.8781445026397705, "digits": 0.4388888888888889},
    "mxnet": {"mlp": 0.386322021484375, "charlm": 3.8761082887649536, "digits": 0.4388888888888889},
}

PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_compare_workloads import probe
print("PROBE " + json.dumps(probe(sys.argv[2], sys.argv[3])))
"""


def _workload(name: str):
    return get_workload(name, quick=True, steps=40 if name == "digits" else None)


def probe(framework: str, policy: str) -> dict:
    """Train each workload's quick trainer, then read everything the protocol offers."""
    import importlib

    module = importlib.import_module(f"polyamp.compare.{framework}")
    out = {}
    for name in WORKLOADS:
        wl = _workload(name)
        trainer = module.Trainer(wl, policy)
        losses = [trainer.step(i) for i in range(wl.steps)]
        x = wl.heldout()[0][0]
        out[name] = {
            "protocol": isinstance(trainer, Trainer) and isinstance(trainer, TrainerBase),
            "stepped": trainer.last.stepped,
            "loss": losses[-1],
            "metric": trainer.evaluate(),
            "forward": trainer.forward(x).tolist(),
            "infer": trainer.infer(x).tolist(),
            "memory": trainer.memory(),
        }
    return out


@cache
def results(framework: str, policy: str) -> dict:
    if framework != "mxnet":
        return probe(framework, policy)
    tests = str(Path(__file__).parent)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "-c", PROBE, tests, framework, policy], capture_output=True,
                         text=True, timeout=600, env=env)  # fmt: skip
    refusal = [x for x in run.stderr.splitlines() if "computes no bfloat16 on this CPU" in x]
    if run.returncode != 0 and refusal:  # a hardware capability (polyamp/mxnet/capability.py), as CUDA
        pytest.skip(refusal[-1])
    assert run.returncode == 0, run.stderr[-3000:]
    line = [x for x in run.stdout.splitlines() if x.startswith("PROBE ")][-1]
    return json.loads(line.removeprefix("PROBE "))


@pytest.fixture(params=FRAMEWORKS)
def framework(request):
    require(request.param)
    return request.param


# -- the workloads ---------------------------------------------------------------------------------
def test_each_workload_is_a_class_owning_its_meaning():
    kinds = {name: type(get_workload(name, quick=True)) for name in WORKLOADS}
    assert [k.__name__ for k in kinds.values()] == ["MLP", "CharLM", "Digits"]
    table = {n: (k.architecture, k.loss_kind, k.metric_name, k.higher_is_better) for n, k in kinds.items()}
    assert table == {
        "mlp": ("dense", "mse", "eval_loss", False),
        "charlm": ("transformer", "cross_entropy", "heldout_loss", False),
        "digits": ("dense", "cross_entropy", "accuracy", True),
    }
    assert get_workload("digits").metric == ("accuracy", True)  # what worker.py records
    assert get_workload("charlm", steps=7, seed=3).steps == 7 and get_workload("charlm", seed=3).seed == 3
    a, b = get_workload("digits", seed=0), get_workload("digits", seed=1)
    assert not np.array_equal(a.weights["fc0.w"], b.weights["fc0.w"])


def test_the_metric_is_computed_from_outputs():
    digits = get_workload("digits", quick=True)
    ((x, y),) = digits.heldout()
    labels = {row.tobytes(): label for row, label in zip(x, y)}
    one_hot = np.eye(10, dtype=np.float32)
    assert digits.evaluate(lambda batch: one_hot[[labels[r.tobytes()] for r in batch]]) == 1.0
    assert digits.evaluate(lambda batch: one_hot[np.zeros(len(batch), int)]) == np.mean(y == 0)

    lm = get_workload("charlm", quick=True)
    v = len(lm.vocab)
    uniform = lm.evaluate(lambda ids: np.zeros((*ids.shape, v), np.float32))
    assert uniform == pytest.approx(np.log(v), rel=1e-12)
    nxt = {x.tobytes(): y for x, y in lm.heldout()}
    assert lm.evaluate(lambda ids: 30 * np.eye(v, dtype=np.float32)[nxt[ids.tobytes()]]) < 1e-10
    assert len(lm.heldout()) == lm.eval_batches == 2


def test_numpy_cross_entropy_matches_torch():
    torch = require("torch")
    rng = np.random.default_rng(0)
    logits, labels = rng.standard_normal((4, 7, 11)).astype(np.float32) * 5, rng.integers(0, 11, (4, 7))
    ours = cross_entropy(logits, labels)
    theirs = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits).reshape(-1, 11), torch.from_numpy(labels).reshape(-1)
    )
    assert ours == pytest.approx(float(theirs), rel=1e-6)


def test_convergence_targets():
    assert get_workload("mlp").target is None
    assert Digits.target == Target(0.95, 600) and CharLM.target.value > 0
    digits, lm = get_workload("digits"), get_workload("charlm")
    assert digits.reached(0.95) and not digits.reached(0.9) and not digits.reached(float("nan"))
    assert lm.reached(lm.target.value - 0.01) and not lm.reached(lm.target.value + 0.01)
    with pytest.raises(PolyampError, match=r"'mlp' has no convergence target; those that do: charlm, digits"):
        get_workload("mlp").reached(0.1)


def test_digits_target_is_reached_by_float32_within_its_step_cap_but_not_at_once():
    require("torch")
    from polyamp.compare.torch import Trainer as TorchTrainer

    wl = get_workload("digits", steps=Digits.target.max_steps)
    trainer, history = TorchTrainer(wl, "float32"), []
    for i in range(wl.steps):
        trainer.step(i)
        if (i + 1) % 25 == 0:
            history.append(trainer.evaluate())
            if wl.reached(history[-1]):
                break
    assert not wl.reached(history[0]) and wl.reached(history[-1]), history


# -- the trainers --------------------------------------------------------------------------------
def test_a_trainer_lacking_a_member_is_not_a_trainer():
    class Partial:
        wl = mp = last = None
        inference_form = "test"

        def __init__(self, wl, policy): ...
        def step(self, i): return 0.0  # fmt: skip

        def evaluate(self): return 0.0  # fmt: skip

        def forward(self, x): return x  # fmt: skip

        def infer(self, x): return x  # fmt: skip

    assert not isinstance(Partial(None, "float32"), Trainer)
    Partial.memory = lambda self: {}
    assert isinstance(Partial(None, "float32"), Trainer)


def test_every_framework_trainer_implements_the_protocol_and_evaluates_as_before(framework):
    got = results(framework, "float32")
    for name in WORKLOADS:
        assert got[name]["protocol"] and got[name]["stepped"], name
        assert got[name]["metric"] == pytest.approx(BEFORE[framework][name], rel=1e-4), name
        assert np.array_equal(got[name]["forward"], got[name]["infer"])  # float32: one form


def test_memory_by_kind_is_measured(framework):
    """Bytes by kind at quick sizes: exact where the model fixes them, bounds where the framework
    decides (which tensors backward keeps). Prints the mlp's activation ratio bf16/float32."""
    for name in WORKLOADS:
        weights = _workload(name).weights
        n_params = sum(w.size for w in weights.values())
        later_kernels = sum(w.size for k, w in weights.items() if k.endswith(".w") and k != "fc0.w")
        mem = {policy: results(framework, policy)[name]["memory"] for policy in POLICIES}
        for policy, m in mem.items():
            assert m["parameters"] == m["gradients"] == 4 * n_params, (name, policy)  # float32 parameters
            assert m["master"] == 0
            # Adam's two moments, plus step counters (torch: one per parameter)
            assert 8 * n_params <= m["optimizer"] <= 8 * n_params + 8 * len(weights) + 16
            assert m["workspace"] is None or m["workspace"] > 0
            assert (m["workspace"] is None) == (framework != "jax"), m["how"]["workspace"]
            assert set(m["how"]) == set(m) - {"how"}
        fp32, bf16 = mem["float32"], mem["bf16-mixed"]
        assert fp32["weight_copies"] == 0 and fp32["inference_weights"] == 4 * n_params
        # the bfloat16 copies of (at least) every kernel whose layer input needs a gradient
        assert 2 * later_kernels <= bf16["weight_copies"] <= 2 * n_params, (name, bf16["weight_copies"])
        assert bf16["inference_weights"] == (2 if framework == "jax" else 4) * n_params
        if name == "mlp":
            wl = _workload("mlp")
            # backward needs every dense layer's input: the batch and each hidden layer's output
            assert fp32["activations"] >= 4 * wl.batch * (wl.dims[0] + sum(wl.dims[1:-1]))
            ratio = bf16["activations"] / fp32["activations"]
            print(f"{framework} mlp (quick) activations bf16/float32 = {ratio:.3f}")
            assert ratio < 0.95, (fp32["activations"], bf16["activations"])


def test_bf16_inference_is_close_to_float32_but_not_equal(framework):
    fp32, bf16 = results(framework, "float32"), results(framework, "bf16-mixed")
    for name in WORKLOADS:
        a, b = np.asarray(fp32[name]["infer"]), np.asarray(bf16[name]["infer"])
        assert a.shape == b.shape and not np.array_equal(a, b), name  # it did run in bfloat16
        assert np.abs(a - b).max() <= 0.03 * np.abs(a).max(), (name, np.abs(a - b).max(), np.abs(a).max())
        if name == "digits":
            assert np.mean(a.argmax(-1) == b.argmax(-1)) >= 0.95
        assert bf16[name]["metric"] == pytest.approx(fp32[name]["metric"], rel=0.02, abs=0.02)
