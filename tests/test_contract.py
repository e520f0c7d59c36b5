"""What every front end must do, written once and run on each installed framework (``contract.py``).

- fault injection: inf/-inf/NaN put into a gradient at ~5 % of 2000 steps: exactly those steps are
  skipped (parameters and optimizer state untouched), the scale follows the host rule and its
  bounds, and the parameters stay finite;
- skip agreement: one fault schedule gives every framework the same skipped steps and the same
  loss-scale state, step by step, as ``DynamicLossScale.update`` run on the host;
- resume: a checkpoint taken mid-run (``mp.state_dict()`` with the model's and the optimizer's)
  continues bit for bit, in this process and in a new one;
- bad input: one ``PolyampError`` each, and nothing changed (the run then equals an untouched twin);
- every policy skips a non-finite step; ``guard=False`` steps through it.
"""

import dataclasses
import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from contract import DRIVERS, SIZES, all_finite, drivers, same

import polyamp as pa
from polyamp import PolyampError

INF, NAN = math.inf, math.nan
pytestmark = [
    pytest.mark.filterwarnings("ignore:the loss scale fell below 1:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:a step was skipped:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*slower than float32:RuntimeWarning"),  # torch fp16 on CPU
    pytest.mark.filterwarnings("ignore:Please import `csr_matrix`:DeprecationWarning"),  # inside mxnet
]


def fault_schedule(steps, seed=0, rate=0.05):
    """Per step None, or (parameter, element, inf/-inf/NaN) at about ``rate`` of the steps."""
    rng = np.random.default_rng(seed)
    schedule = []
    for _ in range(steps):
        if rng.random() < rate:
            k = int(rng.integers(len(SIZES)))
            schedule.append((k, int(rng.integers(SIZES[k])), float(rng.choice([INF, -INF, NAN]))))
        else:
            schedule.append(None)
    return schedule


def changed(before, after):
    """Every parameter moved (a clean step updates them all)."""
    return not any(np.array_equal(a, b) for a, b in zip(before, after))


# -- fault injection -------------------------------------------------------------------------------
@pytest.mark.parametrize("driver", drivers(lambda d: d.id != "tensorflow-eager"))
def test_fault_injection_2000_steps(driver):
    """The step runs in the policy's low precision (fp16; bf16 in MXNet), where this network does
    not overflow on its own at these scales: every skip is an injected one."""
    ls = pa.DynamicLossScale(growth_interval=20)
    run = driver.make(optimizer="adam", lr=1e-3, loss_scale=ls)
    host = ls.init()
    scales = []
    for i, fault in enumerate(fault_schedule(2000)):
        before = run.snapshot() if fault is not None or i % 10 == 0 else None
        stepped, scale = run.step(fault)
        host = ls.update(host, fault is None)
        assert stepped == (fault is None), i
        assert scale == host.scale and ls.min_scale <= scale <= ls.max_scale, i
        if fault is not None:
            assert same(before, run.snapshot()), i  # parameters and optimizer state untouched
            if run.names:
                assert run.last.nonfinite == (run.param_names[fault[0]],), i
        elif before is not None:
            assert changed(before[: len(SIZES)], run.params()), i
        scales.append(scale)
    state = run.state()
    assert state == host and state.steps == 2000 and 80 <= state.skipped <= 120
    assert min(scales) == ls.min_scale  # the floor holds
    assert any(b > a for a, b in zip(scales, scales[1:])) and any(b < a for a, b in zip(scales, scales[1:]))
    assert all_finite(run.snapshot())


# -- skip agreement --------------------------------------------------------------------------------
# 40 steps: single faults, clean runs long enough to grow (and to reach the cap), a run of six faults
# (down to the floor), a fault right after a growth; every value and every parameter
SCHEDULE = [None] * 3 + [(0, 5, INF)] + [None] * 10 + [(3, 0, NAN)] * 2 + [None] * 2 + [(1, 2, -INF)] * 6
SCHEDULE += [None] * 3 + [(2, 7, NAN)] + [None] * 2 + [(0, 127, -INF)] + [None] * 9
LOSS_SCALES = {  # each from 2^3, growing every 2 or 3 clean steps: no fp16 step overflows on its own
    "polyamp": pa.DynamicLossScale(init_scale=8.0, growth_interval=3, max_scale=32.0),
    "torch": pa.DynamicLossScale.preset("torch", init_scale=8.0, growth_interval=3),
    "keras": pa.DynamicLossScale.preset("keras", init_scale=8.0, growth_interval=2),
    "deepspeed": pa.DynamicLossScale.preset("deepspeed", init_scale=8.0, growth_interval=3),
    "mxnet": pa.DynamicLossScale.preset("mxnet", init_scale=8.0, growth_interval=3),
}


def runs(loss_scales):
    """(driver, loss-scale name) for every driver that runs that loss scale."""
    return [pytest.param(d, name, id=f"{d.id}-{name}") for d in DRIVERS.values()
            for name, ls in loss_scales.items() if d.one_step_lag or not ls.one_step_lag]  # fmt: skip


@pytest.mark.parametrize(("driver", "name"), runs(LOSS_SCALES))
def test_every_framework_skips_the_same_steps_with_the_host_scale_trajectory(driver, name):
    ls = LOSS_SCALES[name]
    run = driver.make(loss_scale=ls)
    host = ls.init()
    skipped = []
    for i, fault in enumerate(SCHEDULE):
        stepped, scale = run.step(fault)
        host = ls.update(host, fault is None)
        if not stepped:
            skipped.append(i)
        assert scale == host.scale and run.state() == host, i
    assert skipped == [i for i, fault in enumerate(SCHEDULE) if fault is not None]


def test_the_skip_agreement_schedule_reaches_the_floor_the_cap_and_the_hysteresis():
    """The schedule exercises what the loss scales differ in (so the agreement above means something)."""

    def trajectory(ls):
        states = [ls.init()]
        for fault in SCHEDULE:
            states.append(ls.update(states[-1], fault is None))
        return states[1:]

    trajectories = {name: trajectory(ls) for name, ls in LOSS_SCALES.items()}
    polyamp = [s.scale for s in trajectories["polyamp"]]
    uncapped = dataclasses.replace(LOSS_SCALES["polyamp"], max_scale=2.0**24)
    assert min(polyamp) == 1.0 and max(polyamp) == 32.0 < max(s.scale for s in trajectory(uncapped))
    assert min(s.scale for s in trajectories["torch"]) < 1.0  # no floor
    hysteresis = [s.hysteresis_left for s in trajectories["deepspeed"]]
    assert min(hysteresis) == 1 < max(hysteresis) == LOSS_SCALES["deepspeed"].hysteresis
    assert any(s.next_scale != s.scale for s in trajectories["mxnet"])  # the one-step lag shows
    assert len({tuple(s.scale for s in t) for t in trajectories.values()}) == len(LOSS_SCALES)


# -- resume ----------------------------------------------------------------------------------------
RESUME_SCALES = {"dynamic": pa.DynamicLossScale(growth_interval=3),
                 "mxnet": pa.DynamicLossScale.preset("mxnet", growth_interval=5)}  # fmt: skip


def resume_fault(i):
    return (i % 4, i % SIZES[i % 4], INF if i % 2 else NAN) if i % 7 == 3 else None


@pytest.mark.parametrize(("driver", "name"), runs(RESUME_SCALES))
def test_resume_from_a_checkpoint_is_bit_identical(driver, name):
    """Adam, from 2^16 growing every 3 (5) steps: under fp16, real overflows besides the injected
    faults; the fresh run starts from other weights, which the checkpoint overwrites."""
    ls = RESUME_SCALES[name]
    whole = driver.make(optimizer="adam", lr=1e-2, loss_scale=ls)
    scales = [whole.step(resume_fault(i))[1] for i in range(40)]
    first = driver.make(optimizer="adam", lr=1e-2, loss_scale=ls)
    for i in range(17):
        first.step(resume_fault(i))
    saved = first.mp.state_dict()
    assert json.loads(json.dumps(saved)) == saved  # plain values
    ckpt = pickle.loads(pickle.dumps(first.state_dict()))
    second = driver.make(seed=5, optimizer="adam", lr=1e-2, loss_scale=ls)
    second.load_state_dict(ckpt)
    assert second.state() == first.state() and same(second.snapshot(), first.snapshot())
    assert (second.state().next_scale is not None) == ls.one_step_lag  # the lag's pending scale too
    rest = [second.step(resume_fault(i))[1] for i in range(17, 40)]
    assert rest == scales[17:]
    assert second.state() == whole.state() and second.mp.state_dict() == whole.mp.state_dict()
    assert same(second.snapshot(), whole.snapshot()) and not same(first.params(), whole.params())
    assert whole.state().skipped >= 6  # the six injected faults, and any real overflow (fp16)
    assert whole.state().skipped == 6 or driver.policy != "bf16-mixed"


RESUME = textwrap.dedent(
    """
    import os, pickle, sys, time
    sys.path.insert(0, sys.argv[1])
    import test_contract as t
    from contract import DRIVERS
    driver, mode, path = DRIVERS[sys.argv[2]], sys.argv[3], sys.argv[4]
    out = {}
    for name in sys.argv[5:]:
        run = driver.make(optimizer="adam", lr=1e-2, loss_scale=t.RESUME_SCALES[name])
        if mode == "resume":
            deadline = time.time() + 300
            while not os.path.exists(f"{path}.{name}.saved") and time.time() < deadline:  # "save" runs
                time.sleep(0.05)
            with open(f"{path}.{name}", "rb") as f:
                run.load_state_dict(pickle.load(f))
        scales = []
        for i in range(run.t, 40):
            if mode == "save" and i == 17:
                with open(f"{path}.{name}", "wb") as f:
                    pickle.dump(run.state_dict(), f)
                open(f"{path}.{name}.saved", "w").close()
            scales.append(run.step(t.resume_fault(i))[1])
        run.state()  # JAX: mp.sync, so that mp.state_dict() holds the last step
        out[name] = {"scales": scales, "snapshot": run.snapshot(), "state": run.mp.state_dict()}
    with open(f"{path}.{mode}", "wb") as f:
        pickle.dump(out, f)
    """
)


# TensorFlow's new-process resume is test_tensorflow.py's, through tf.train.Checkpoint (which holds
# the loss-scale variables); its mp.state_dict() resume is test_resume_from_a_checkpoint_is_bit_identical
@pytest.mark.parametrize("driver", drivers(lambda d: d.framework != "tensorflow"))
def test_resume_in_a_new_process_is_bit_identical(driver, tmp_path):
    """One process runs 40 steps and saves the checkpoint of step 17 on the way; another resumes
    from it (with every loss scale the framework runs)."""
    names = [name for name in RESUME_SCALES if driver.one_step_lag or not RESUME_SCALES[name].one_step_lag]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TF_CPP_MIN_LOG_LEVEL": "3"}
    driver.load()  # skips here, where the framework is not installed and not requested

    def start(mode):
        cmd = [sys.executable, "-c", RESUME, str(Path(__file__).parent), driver.id, mode,
               str(tmp_path / "ckpt"), *names]  # fmt: skip
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(proc, mode):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        return pickle.loads((tmp_path / f"ckpt.{mode}").read_bytes())

    # side by side: the resuming process imports its framework while the saving one runs, and waits for
    # each checkpoint of step 17
    saving, resuming = start("save"), start("resume")
    try:
        whole, resumed = finish(saving, "save"), finish(resuming, "resume")
    finally:
        for proc in (saving, resuming):
            proc.kill()
    for name in names:
        assert resumed[name]["scales"] == whole[name]["scales"][17:], name
        assert resumed[name]["state"] == whole[name]["state"], name
        assert same(resumed[name]["snapshot"], whole[name]["snapshot"]), name
        skipped = whole[name]["state"]["state"]["skipped"]
        assert skipped >= 6 and (skipped == 6 or driver.policy != "bf16-mixed"), name


# -- bad input -------------------------------------------------------------------------------------
class Incomplete:
    """A custom loss scale missing most of the protocol."""

    def init(self):
        return pa.LossScaleState(scale=1.0)

    def update(self, state, finite):
        return state


BAD_CONSTRUCTION = [
    ({"policy": "fp17"}, r"'fp17'"),
    ({"loss_scale": "bogus"}, r"unknown loss-scale preset 'bogus'"),
    ({"loss_scale": -1.0}, r"StaticLossScale scale must be a finite number > 0; received -1.0"),
    ({"loss_scale": NAN}, r"StaticLossScale scale must be a finite number > 0; received nan"),
    ({"loss_scale": object()}, r"unknown loss_scale <object"),
    (
        {"loss_scale": Incomplete()},
        r"Incomplete lacks kind, max_consecutive_skips, update_arrays, check, check_traceable, as_dict",
    ),
    ({"guard": "yes"}, r"guard must be True or False; received 'yes'"),
    ({"guard": False, "loss_scale": "dynamic"}, r"guard=False needs loss_scale='none'"),
]


def bad_state_dicts(good, other_policy):
    """(a refused variant of the good ``mp.state_dict()``, the error)."""
    field = "loss-scale state field {!r} must be {}; received {}"
    number, count = r"a number >= 0 \(inf allowed\)", "an integer >= {}"

    def state(**changes):
        return {**good, "state": {**good["state"], **changes}}

    return [
        (state(scale=NAN), field.format("scale", number, "nan")),
        (state(scale=-1.0), field.format("scale", number, "-1.0")),
        (state(scale="2"), field.format("scale", number, "'2'")),
        (state(good_steps=1.5), field.format("good_steps", count.format(-(2**31)), "1.5")),
        (state(hysteresis_left=0), field.format("hysteresis_left", count.format(1), "0")),
        (state(steps=-1), field.format("steps", count.format(0), "-1")),
        (state(bogus=1), r"unknown loss-scale state field 'bogus'"),
        ({**good, "state": {k: v for k, v in good["state"].items() if k != "scale"}}, r"needs 'scale'"),
        ({**good, "state": 3}, r"expected a dict of loss-scale state fields; received 3"),
        ({**good, "policy": other_policy}, rf"saved with policy '{other_policy}'"),
        (3, r"from_native cannot read a builtins.int"),
    ]


@pytest.mark.parametrize("driver", drivers())
def test_bad_input_is_one_clear_error_and_changes_nothing(driver):
    ls = pa.DynamicLossScale(growth_interval=2)
    run, twin = (driver.make(optimizer="adam", loss_scale=ls) for _ in range(2))
    for r in (run, twin):
        r.step((0, 0, INF))  # the state is not the initial one
        r.step()
    before, state = run.snapshot(), run.state()

    def unchanged(case):
        assert same(run.snapshot(), before) and run.mp.state == state, case

    for kwargs, message in BAD_CONSTRUCTION:
        kwargs = {"policy": driver.policy, **kwargs}
        with pytest.raises(PolyampError, match=message):
            pa.MixedPrecision(kwargs.pop("policy"), framework=driver.framework, **kwargs)
        unchanged(kwargs)
    if not driver.one_step_lag:
        with pytest.raises(PolyampError, match=r"'mxnet' loss-scale preset \(one_step_lag\) has no "
                                               r"(jit|tf.function) form"):  # fmt: skip
            driver.make(loss_scale="mxnet")
        unchanged("the mxnet preset")
    other = "float32" if driver.policy != "float32" else "bf16-mixed"
    for bad, message in bad_state_dicts(run.mp.state_dict(), other):
        with pytest.raises(PolyampError, match=message):
            run.mp.load_state_dict(bad)
        unchanged(bad)
    with pytest.raises(PolyampError, match=driver.bad_loss_message):
        run.bad_loss()
    unchanged("an integer loss")
    if driver.clips:
        run.backward()
        for clip in (-1, 0, NAN, "1", True):
            with pytest.raises(PolyampError, match=rf"clip_grad_norm must be a positive number or None, "
                                                   rf"got {clip!r}"):  # fmt: skip
                run.apply(clip)
            unchanged(f"clip_grad_norm={clip!r}")
        assert run.apply()[0]  # the gradients are still the scaled ones: the same step as the twin's
        twin.backward()
        assert twin.apply()[0]
    else:
        assert run.step()[0] and twin.step()[0]
    assert same(run.snapshot(), twin.snapshot()) and run.state() == twin.state()


# -- every policy ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("driver", "policy"), [pytest.param(d, p, id=f"{d.id}-{p}") for d in DRIVERS.values()
                                                for p in d.policies])  # fmt: skip
def test_every_policy_skips_nonfinite_steps_and_guard_off_steps_through(driver, policy):
    run = driver.make(policy, optimizer="adam")
    ls = run.mp.loss_scale  # the policy's default: dynamic for fp16, none otherwise
    host = ls.update(ls.init(), True)
    assert run.step() == (True, host.scale)
    for k, value in ((0, INF), (2, -INF), (3, NAN)):
        before = run.snapshot()
        stepped, scale = run.step((k, 1 % SIZES[k], value))
        host = ls.update(host, False)
        assert (stepped, scale) == (False, host.scale), value
        assert same(before, run.snapshot()), value  # parameters and optimizer state untouched
        if run.names:
            assert run.last == pa.StepResult(False, host.scale, None, (run.param_names[k],), None)
    assert run.state() == host and host.skipped_in_a_row == 3
    before = run.params()
    assert run.step() == (True, ls.update(host, True).scale)
    assert changed(before, run.params()) and run.state() == ls.update(host, True)

    off = driver.make(policy, guard=False, loss_scale="none")
    assert off.step((3, 0, NAN)) == (True, 1.0)
    assert np.isnan(off.params()[3]).all() and off.state().skipped == 0
