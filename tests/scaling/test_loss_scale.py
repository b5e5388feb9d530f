"""Loss-scale schedules: transitions, bounds, hysteresis, serialization, bad input."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.scaling.loss_scale import (DynamicLossScale, FixedLossScale, LossScaleSchedule,
                                         PiecewiseInterval)


def run(schedule, flags, *, graph=True):
    """Feeds a sequence of finite flags through ``schedule.update``; returns the
    scale after each step. In graph mode the whole loop is one tf.function,
    as inside a train step."""

    def loop(flags_t):
        state = schedule.initial_state()
        scales = []
        for i in range(len(flags)):
            state = schedule.update(state, flags_t[i], tf.constant(i, tf.int64))
            scales.append(schedule.scale(state))
        return tf.stack(scales)

    flags_t = tf.constant(flags, tf.bool)
    out = tf.function(loop)(flags_t) if graph else loop(flags_t)
    return out.numpy().tolist()


def reference(flags, *, initial, growth, backoff, interval, hysteresis, lo, hi,
              recovery=1):
    """Megatron/DeepSpeed semantics in plain Python, plus recovery: a streak of
    non-finite steps that goes on at the floor is followed, once steps are
    finite again, by growth every ``recovery`` steps back to the scale the
    streak started from (None: no recovery)."""
    scale, good, left, out = initial, 0, hysteresis, []
    streak_start, target = 0.0, 0.0
    for i, finite in enumerate(flags):
        n = interval(i) if callable(interval) else interval
        if recovery is not None:
            if finite:
                streak_start = 0.0
            else:
                streak_start = streak_start or max(scale, target)
                target = max(target, streak_start) if scale <= lo else 0.0
            if target > scale:
                n = recovery
        if finite:
            good += 1
            if good >= n:
                grown = min(scale * growth, hi)
                if recovery is not None and target > scale:
                    grown = min(grown, target)
                scale, good, left = grown, 0, hysteresis
                if scale >= target:
                    target = 0.0
        else:
            good, left = 0, max(left - 1, 0)
            if left <= 0:
                scale = max(scale * backoff, lo)
        out.append(scale)
    return out


SCHEDULES = {
    "keras_like": dict(initial_scale=2.0**15, growth_factor=2.0, backoff_factor=0.5,
                       growth_interval=3, hysteresis=1, min_scale=1.0, max_scale=2.0**24),
    "hysteresis3": dict(initial_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=4, hysteresis=3, min_scale=1.0, max_scale=2.0**20),
    "odd_factors": dict(initial_scale=100.0, growth_factor=1.5, backoff_factor=0.25,
                        growth_interval=2, hysteresis=2, min_scale=3.0, max_scale=500.0),
    "tight_bounds": dict(initial_scale=8.0, growth_factor=4.0, backoff_factor=0.5,
                         growth_interval=1, hysteresis=1, min_scale=2.0, max_scale=16.0),
    "slow_recovery": dict(initial_scale=64.0, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=50, hysteresis=2, min_scale=4.0, max_scale=2.0**20,
                          recovery_interval=3),
    "no_recovery": dict(initial_scale=64.0, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=50, hysteresis=1, min_scale=4.0, max_scale=2.0**20,
                        recovery_interval=None),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_matches_reference_on_random_flags(name, seed):
    kw = SCHEDULES[name]
    flags = (np.random.default_rng(seed).random(60) > 0.3).tolist()
    got = run(DynamicLossScale(**kw), flags)
    want = reference(flags, initial=kw["initial_scale"], growth=kw["growth_factor"],
                     backoff=kw["backoff_factor"], interval=kw["growth_interval"],
                     hysteresis=kw["hysteresis"], lo=kw["min_scale"], hi=kw["max_scale"],
                     recovery=kw.get("recovery_interval", 1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


# -- recovery: the scale comes back after a streak it did not cause -----------

def test_streak_at_the_floor_is_followed_by_regrowth_to_the_scale_before_it():
    s = DynamicLossScale(initial_scale=2.0**15, growth_interval=2000)
    # 15 overflows take 2^15 to the floor (1), 85 more happen there: an input
    # beyond float16, say; then the layer is promoted and steps are finite.
    scales = run(s, [False] * 100 + [True] * 20)
    assert scales[14] == 1.0 and scales[99] == 1.0
    assert scales[100:116] == [2.0**k for k in range(1, 16)] + [2.0**15]
    assert scales[-1] == 2.0**15  # back where it was, then the usual 2000-step growth


def test_regrowth_that_overflows_ends_the_recovery():
    s = DynamicLossScale(initial_scale=64.0, min_scale=1.0, growth_interval=1000)
    flags = [False] * 8 + [True] * 3 + [False] + [True] * 10
    scales = run(s, flags)
    assert scales[7] == 1.0 and scales[8:11] == [2.0, 4.0, 8.0]
    # 16 overflowed: back to 8, and no more fast growth (8 is the scale's own level)
    assert scales[11] == 4.0 and scales[12:] == [4.0] * 10


def test_streak_ending_above_the_floor_is_calibration_not_recovered():
    s = DynamicLossScale(initial_scale=2.0**15, growth_interval=1000)
    scales = run(s, [False] * 5 + [True] * 30)
    assert scales[4] == 2.0**10 and scales[-1] == 2.0**10


def test_streak_returning_during_regrowth_keeps_the_first_target():
    s = DynamicLossScale(initial_scale=16.0, min_scale=1.0, growth_interval=1000)
    flags = [False] * 6 + [True] * 2 + [False] * 4 + [True] * 6
    scales = run(s, flags)
    assert scales[7] == 4.0 and scales[11] == 1.0
    assert scales[12:16] == [2.0, 4.0, 8.0, 16.0] and scales[-1] == 16.0


def test_recovery_interval_and_no_recovery():
    slow = DynamicLossScale(initial_scale=8.0, min_scale=1.0, growth_interval=1000,
                            recovery_interval=2)
    assert run(slow, [False] * 4 + [True] * 6)[4:] == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]
    never = DynamicLossScale(initial_scale=8.0, min_scale=1.0, growth_interval=1000,
                             recovery_interval=None)
    assert run(never, [False] * 4 + [True] * 6)[4:] == [1.0] * 6
    assert set(never.state_spec()) == {"loss_scale", "good_steps", "hysteresis_left"}


def test_recovered_names_the_cause_of_a_streak_that_ended_above_the_floor():
    s = DynamicLossScale(initial_scale=2.0**15, growth_interval=1000)
    st = s.initial_state()
    for _ in range(5):
        st = s.update(st, False, 0)  # 2**15 -> 2**10
    st = s.update(st, True, 0)  # ended above the floor: calibration, as far as it knows
    assert float(s.scale(st)) == 2.0**10 and float(st["recover_to"]) == 0.0
    assert float(st["streak_start"]) == -(2.0**15)  # remembered
    st = s.recovered(st)  # the adaptive policy promoted the layer that overflowed
    scales = []
    for _ in range(6):
        st = s.update(st, True, 0)
        scales.append(float(s.scale(st)))
    assert scales == [2.0**11, 2.0**12, 2.0**13, 2.0**14, 2.0**15, 2.0**15]
    # nothing to come back to: nothing changes
    fresh = s.initial_state()
    assert {k: float(v) for k, v in s.recovered(fresh).items()} == \
        {k: float(v) for k, v in fresh.items()}
    plain = DynamicLossScale(recovery_interval=None)
    assert set(plain.recovered(plain.initial_state())) == set(plain.state_spec())
    assert HalveOnly().recovered({"loss_scale": 4.0}) == {"loss_scale": 4.0}


def test_rescaled_sets_the_scale_within_bounds_and_restarts_growth():
    s = DynamicLossScale(initial_scale=4.0, min_scale=1.0, max_scale=2.0**10,
                         growth_interval=3)
    st = s.update(s.update(s.initial_state(), True, 0), True, 1)  # two good steps
    st = s.rescaled(st, 256.0)
    assert float(s.scale(st)) == 256.0 and int(st["good_steps"]) == 0
    assert float(s.scale(s.rescaled(st, 2.0**20))) == 2.0**10
    # a pending recovery is met by a larger scale
    st = s.initial_state()
    for _ in range(4):
        st = s.update(st, False, 0)
    assert float(st["recover_to"]) == 4.0
    assert float(s.rescaled(st, 8.0)["recover_to"]) == 0.0
    assert float(s.rescaled(st, 2.0)["recover_to"]) == 4.0
    fixed = HalveOnly(8.0)
    assert float(fixed.rescaled(fixed.initial_state(), 2.0)["loss_scale"]) == 2.0


def test_files_from_before_recovery_load_without_it():
    config = DynamicLossScale().get_config()
    del config["recovery_interval"]
    assert DynamicLossScale.from_config(config).recovery_interval is None


def test_eager_and_graph_agree():
    s = DynamicLossScale(**SCHEDULES["hysteresis3"])
    flags = (np.random.default_rng(3).random(30) > 0.4).tolist()
    assert run(s, flags, graph=True) == run(s, flags, graph=False)


def test_hysteresis_backs_off_only_after_n_overflows():
    s = DynamicLossScale(initial_scale=64.0, hysteresis=3, growth_interval=100)
    assert run(s, [False, False, False, False]) == [64.0, 64.0, 32.0, 16.0]


def test_growth_resets_hysteresis():
    s = DynamicLossScale(initial_scale=64.0, hysteresis=2, growth_interval=2)
    # overflow (tolerated), 2 good -> grow and reset, overflow tolerated again
    assert run(s, [False, True, True, False, False]) == [64.0, 64.0, 128.0, 128.0, 64.0]


def test_callable_growth_interval():
    interval = PiecewiseInterval(boundaries=[4], values=[1, 3])
    s = DynamicLossScale(initial_scale=2.0, growth_interval=interval)
    flags = [True] * 10
    want = reference(flags, initial=2.0, growth=2.0, backoff=0.5, interval=interval_py,
                     hysteresis=1, lo=1.0, hi=2.0**24)
    assert run(s, flags) == want


def interval_py(step):
    return 1 if step < 4 else 3


@pytest.mark.parametrize("flag", [True, False])
def test_scale_never_leaves_bounds_or_becomes_inf_or_zero(flag):
    s = DynamicLossScale(initial_scale=2.0**10, growth_interval=1, min_scale=0.5,
                         max_scale=2.0**12)
    scales = run(s, [flag] * 300)
    assert all(math.isfinite(x) and 0.5 <= x <= 2.0**12 for x in scales)
    assert scales[-1] == (2.0**12 if flag else 0.5)


def test_fixed_never_changes():
    assert run(FixedLossScale(128.0), [True, False, True, False]) == [128.0] * 4
    assert not FixedLossScale(2.0).is_dynamic and DynamicLossScale().is_dynamic


ALL_SCHEDULES = [
    DynamicLossScale(),
    DynamicLossScale(initial_scale=4.0, growth_factor=3.0, backoff_factor=0.25,
                     growth_interval=7, hysteresis=2, min_scale=0.5, max_scale=1e6),
    DynamicLossScale(growth_interval=PiecewiseInterval([100, 1000], [10, 100, 1000])),
    FixedLossScale(512.0),
]


@pytest.mark.parametrize("schedule", ALL_SCHEDULES, ids=repr)
def test_config_round_trip(schedule):
    again = type(schedule).from_config(schedule.get_config())
    assert again == schedule
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(schedule))
    assert restored == schedule and type(restored) is type(schedule)
    flags = [True, False, True, True, False, True]
    assert run(restored, flags) == run(schedule, flags)


def test_get_accepts_names_numbers_and_configs():
    assert keras_mp.scaling.loss_scale.get("dynamic") == DynamicLossScale()
    assert keras_mp.scaling.loss_scale.get(64) == FixedLossScale(64.0)
    cfg = keras.saving.serialize_keras_object(FixedLossScale(8.0))
    assert keras_mp.scaling.loss_scale.get(cfg) == FixedLossScale(8.0)
    with pytest.raises(ValueError, match="schedule"):
        keras_mp.scaling.loss_scale.get("static")
    with pytest.raises(TypeError, match="schedule"):
        keras_mp.scaling.loss_scale.get([1.0])


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class HalveOnly(LossScaleSchedule):
    def __init__(self, initial_scale=16.0):
        self.initial_scale = initial_scale

    def state_spec(self):
        return {"loss_scale": ("float32", self.initial_scale)}

    def update(self, state, finite, step):
        s = state["loss_scale"]
        return {"loss_scale": keras.ops.where(finite, s, keras.ops.maximum(s / 2, 1.0))}

    def get_config(self):
        return {"initial_scale": self.initial_scale}


def test_user_schedule_through_the_base_class():
    assert run(HalveOnly(), [False, True, False]) == [8.0, 8.0, 4.0]
    assert keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(HalveOnly(4.0))) == HalveOnly(4.0)


BAD_DYNAMIC = [
    (dict(growth_factor=1.0), ValueError, "growth_factor"),
    (dict(growth_factor=0.5), ValueError, "growth_factor"),
    (dict(growth_factor="2"), TypeError, "growth_factor"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor.*\(0, 1\)"),
    (dict(backoff_factor=0.0), ValueError, "backoff_factor"),
    (dict(backoff_factor=-0.5), ValueError, "backoff_factor"),
    (dict(growth_interval=0), ValueError, "growth_interval"),
    (dict(growth_interval=-5), ValueError, "growth_interval"),
    (dict(growth_interval=2.5), TypeError, "growth_interval"),
    (dict(hysteresis=0), ValueError, "hysteresis"),
    (dict(hysteresis=1.5), TypeError, "hysteresis"),
    (dict(min_scale=10.0, max_scale=1.0, initial_scale=5.0), ValueError, "min_scale"),
    (dict(min_scale=0.0), ValueError, "min_scale"),
    (dict(max_scale=float("inf")), ValueError, "max_scale"),
    (dict(initial_scale=float("nan")), ValueError, "initial_scale"),
    (dict(initial_scale=0.5), ValueError, r"initial_scale.*\[min_scale, max_scale\]"),
    (dict(initial_scale=True), TypeError, "initial_scale"),
    (dict(recovery_interval=0), ValueError, "recovery_interval"),
    (dict(recovery_interval=2.0), ValueError, "recovery_interval"),
    (dict(recovery_interval=True), ValueError, "recovery_interval"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_DYNAMIC)
def test_dynamic_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value,error", [(0.0, ValueError), (-1.0, ValueError),
                                         (float("inf"), ValueError), ("big", TypeError)])
def test_fixed_bad_input(value, error):
    with pytest.raises(error, match="scale"):
        FixedLossScale(value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(boundaries=[10], values=[1]), "one more"),
    (dict(boundaries=[10, 5], values=[1, 2, 3]), "boundaries"),
    (dict(boundaries=[10], values=[0, 2]), "values"),
])
def test_piecewise_interval_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PiecewiseInterval(**kwargs)
