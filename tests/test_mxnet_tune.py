"""``polyamp.tune`` on MXNet (``polyamp/mxnet/tune.py``): each policy's configurations in a worker process
of their own (contrib.amp is process-wide), the same losses as compare's MXNet trainer, a search's report,
``report.apply`` in a fresh process, a user's ``FILE.py:make`` on the command line, and bad input.
Runs in ``.venv-mxnet``; this process never calls ``amp.init``."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from frameworks import require

mx = require("mxnet")

from mxnet_caps import needs_bf16  # noqa: E402

from polyamp import PolyampError  # noqa: E402
from polyamp.compare import mxnet as compare_mxnet  # noqa: E402
from polyamp.mxnet import tune as mt  # noqa: E402
from polyamp.tune import Candidate  # noqa: E402
from polyamp.tune.report import STATUSES  # noqa: E402

MAKER, KWARGS = compare_mxnet.tune_inputs("mlp", quick=True)


def _losses(tunable, policy, steps=4, **settings):
    base = {"hybridize": "off", "threads": mt.knobs()["threads"].default} if "threads" in mt.knobs() \
        else {"hybridize": "off"}  # fmt: skip
    step = tunable.build(Candidate.of(policy, {**base, **settings}))
    try:
        return [step.step(i) for i in range(steps)]
    finally:
        step.close()


@needs_bf16
def test_each_policy_trains_in_its_own_process_as_compares_trainer_does():
    tunable = mt.Tunable(MAKER, KWARGS, name="mlp")
    try:
        fp32 = _losses(tunable, "float32")
        static = _losses(tunable, "float32", hybridize="static")
        bf16 = _losses(tunable, "bf16-mixed")
        workers = list(tunable._workers.values())
        assert len({key[0] for key in tunable._workers}) == 2  # float32 and bf16-mixed: two processes
    finally:
        tunable.close()
    assert all(w.proc.poll() is not None for w in workers)  # close() ended them
    # compare's trainer (float32, hybridized) from the same weights and batches, in a fresh process:
    # this one may run under an AMP an earlier test initialised (it is process-wide)
    script = ("import json; from polyamp.compare.mxnet import Trainer; from polyamp.compare.workloads import "
              "get_workload; t = Trainer(get_workload('mlp', quick=True), 'float32'); "
              "print(json.dumps([t.step(i) for i in range(4)]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    assert fp32 == pytest.approx(want, rel=1e-5) and static == pytest.approx(want, rel=1e-5)
    # bf16 compute rounds: close to float32, not equal
    assert bf16 == pytest.approx(want, rel=0.05) and bf16 != pytest.approx(want, rel=1e-6)


def test_a_policy_mxnet_refuses_here_reaches_the_search_with_its_reason():
    """Regression: the worker died at start (its MixedPrecision raised) and the search saw only 'the
    worker died'; fp16-mixed needs cuDNN, so a CPU refuses it on every machine."""
    tunable = mt.Tunable(MAKER, KWARGS, name="mlp")
    try:
        for _ in range(2):  # the same worker answers again
            with pytest.raises(RuntimeError, match=r"^UnsupportedError: MXNet cannot run fp16-mixed on CPU"):
                tunable.build(Candidate.of("fp16-mixed", {"hybridize": "off"}))
    finally:
        tunable.close()


@needs_bf16
def test_a_search_reports_every_trial_and_tunes_both_policies():
    report = mt.tune(MAKER, KWARGS, policies=("bf16-mixed",), budget_s=12.0, name="mlp")
    assert report.framework == "mxnet" and set(report.tuned) == {"float32", "bf16-mixed"}
    tried = {(t.candidate.policy, k, v) for t in report.trials for k, v in t.candidate.settings}
    assert ("float32", "hybridize", "static") in tried or any(t.status == "not tried" for t in report.trials)
    for t in report.trials:
        assert t.status in STATUSES
        if t.status in ("ok", "chosen", "no gain", "slower"):
            assert abs(t.final_loss - report.reference_loss) <= 0.05 * abs(report.reference_loss)
    finals = {f.key: f for f in report.final}
    assert "float32 default" in finals and "bf16-mixed default" in finals
    assert all(f.error is None and f.step_s > 0 for f in finals.values())
    assert report.spent_s <= 12.0 * 1.5
    assert json.loads(json.dumps(report.to_json()))["framework"] == "mxnet"


@needs_bf16  # tunes bf16-mixed, the default policy
def test_apply_builds_the_best_configuration_in_a_fresh_process(tmp_path):
    script = textwrap.dedent(f"""
        import json, warnings
        from polyamp.mxnet import tune as mt
        report = mt.tune({MAKER!r}, {KWARGS!r}, budget_s=8.0, name="mlp")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mp, net, step = report.apply({MAKER!r}, {KWARGS!r})
        losses = [step(i) for i in range(3)]
        print(json.dumps({{"policy": report.policy, "mp": mp.policy.name, "losses": losses,
                          "hybridized": bool(net._active), "settings": report.settings,
                          "warned": [str(w.message) for w in caught]}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a user's shell starts it
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mp"] == out["policy"] and len(out["losses"]) == 3 and out["losses"][2] < out["losses"][0]
    assert out["hybridized"] == (out["settings"]["hybridize"] != "off")
    chose_threads = out["settings"].get("threads") not in (None, mt._cores())
    assert any("OMP_NUM_THREADS" in w for w in out["warned"]) == chose_threads


@needs_bf16  # tunes bf16-mixed, the default policy
def test_the_command_line_tunes_a_users_file(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(textwrap.dedent("""
        import mxnet as mx
        from mxnet import gluon

        def make():
            mx.random.seed(0)
            net = gluon.nn.HybridSequential()
            net.add(gluon.nn.Dense(32, activation="relu"), gluon.nn.Dense(1))
            net.initialize(mx.init.Xavier())
            x = mx.nd.random.normal(shape=(64, 16))
            y = mx.nd.sum(x, axis=1, keepdims=True)

            def loss_fn(out, target):
                return mx.nd.mean(mx.nd.square(mx.nd.amp_cast(out, dtype="float32") - target))

            return net, (lambda i: ((x,), y)), loss_fn, ("adam", {"learning_rate": 1e-2})
    """))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "polyamp", "tune", f"{model}:make", "--framework", "mxnet", "--budget", "6",
           "--out", str(out), "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = json.loads(done.stdout)
    assert report["framework"] == "mxnet" and report["name"] == f"{model}:make"
    assert (out / "mxnet-model.json").exists()
    assert report["tuned"]["float32"]["settings"]["hybridize"] in mt.HYBRIDIZE


@pytest.mark.parametrize("maker, message", [
    ("no_colon", "'package.module:function' or 'file.py:function'"),
    ("missing_file.py:make", "does not exist"),
    ("polyamp.compare.mxnet:no_such_function", "has no function 'no_such_function'"),
])  # fmt: skip
def test_a_bad_maker_is_refused_by_name(maker, message):
    with pytest.raises(PolyampError, match=message):
        mt.Tunable(maker)


def test_a_bad_hybridize_value_is_refused_before_a_process_starts():
    tunable = mt.Tunable(MAKER, KWARGS)
    with pytest.raises(PolyampError, match="hybridize is one of off, on, static; received 'always'"):
        tunable.build(Candidate.of("float32", {"hybridize": "always"}))
    assert tunable._workers == {}
