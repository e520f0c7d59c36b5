"""Seeded fuzzing of the framework-free entry points: every call returns or raises PolyampError."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import polyamp as pa
from polyamp.policy import POLICY_NAMES
from polyamp.scaling import PRESETS, DynamicLossScale, LossScaleState, loss_scale_from_dict

FIELDS = [f for f in DynamicLossScale.__dataclass_fields__]
STATE_FIELDS = [f for f in LossScaleState.__dataclass_fields__]

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                st.integers(), max_size=2),
    st.sampled_from([np.float32(2.0), np.int64(3), np.array([True]), np.array([1.0, 2.0]), math.inf]),
)  # fmt: skip
near_names = st.sampled_from(POLICY_NAMES).map(lambda s: s.upper()) | st.sampled_from(POLICY_NAMES).map(
    lambda s: s[:-1]
)


def returns_or_refuses(call, *args, **kwargs):
    try:
        return call(*args, **kwargs)
    except pa.PolyampError:
        return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(anything, near_names, st.text(alphabet="pcof=123bl6,", max_size=20)))
def test_policy_parse(spec):
    policy = returns_or_refuses(pa.Policy.parse, spec)
    assert policy is None or pa.Policy.parse(policy.name) == policy


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.dictionaries(st.sampled_from(FIELDS), anything, max_size=4))  # an unknown keyword: TypeError
def test_dynamic_loss_scale_config(kwargs):
    ls = returns_or_refuses(DynamicLossScale, **kwargs)
    if ls is not None:
        assert loss_scale_from_dict(ls.as_dict()) == ls
        state = ls.init()
        for finite in (True, False, False, True):
            state = ls.update(state, finite)
        assert state.steps == 4 and state.skipped == 2


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.sampled_from(PRESETS + ("apex", "TORCH", 3)), st.dictionaries(st.sampled_from(FIELDS + ["x"]),
                                                                        anything, max_size=2))
def test_presets_with_overrides(name, overrides):
    returns_or_refuses(DynamicLossScale.preset, name, **overrides)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.one_of(anything, st.dictionaries(st.sampled_from(STATE_FIELDS + ["kind"]), anything, max_size=4)))
def test_saved_states_and_configs(data):
    state = returns_or_refuses(LossScaleState.from_dict, data)
    if state is not None:
        assert LossScaleState.from_dict(state.as_dict()) == state
        DynamicLossScale().update(state, True)
    returns_or_refuses(loss_scale_from_dict, data)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(anything, anything)
def test_update_flags_and_states(state, finite):
    ls = DynamicLossScale()
    returns_or_refuses(ls.update, ls.init(), finite)
    returns_or_refuses(ls.update, state, True)


FRAMEWORK_ARGS = st.one_of(st.sampled_from([None, "torch", "pytorch", "PyTorch", "torchh", "", "caffe"]),
                           anything.filter(lambda v: not isinstance(v, str)))  # imports no other framework


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.one_of(anything, st.sampled_from(["bf16-mixed", "fp16-mixed"])), anything, anything, anything,
       FRAMEWORK_ARGS, st.one_of(anything, st.sampled_from(["cpu", "cuda:0", "tpu:9", "cpu:x"])))
def test_mixed_precision_constructor(policy, loss_scale, guard, debug, framework, device):
    mp = returns_or_refuses(pa.MixedPrecision, policy, loss_scale=loss_scale, guard=guard, debug=debug,
                            framework=framework, device=device)  # fmt: skip
    assert mp is None or mp.framework in (None, "torch")
