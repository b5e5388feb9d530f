"""The float32 probe backs off while it confirms the dtypes, comes back after
any change, and a run resumed from a weights file probes where the
uninterrupted one does (keras_mp.adaptive.decisions.probe_schedule)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mp
from keras_mp.adaptive.decisions.probe_schedule import ProbeSchedule, probe_calls
from keras_mp.callbacks import AdaptivePrecision


def _walk(schedule, calls, confirmed=lambda call: True):
    """The calls that probe in ``calls`` calls, a decision at each probe."""
    seen = []
    for call in range(1, calls + 1):
        if schedule.due(call):
            seen.append(call)
            schedule = schedule.probed(call).decided(call, probed=True,
                                                     confirmed=confirmed(call))
    return seen, schedule


def test_the_gap_doubles_while_probes_confirm_up_to_the_backoff():
    seen, schedule = _walk(ProbeSchedule.start(10, backoff=4), 200)
    assert seen == [10, 30, 70, 110, 150, 190]  # gaps 20, 40, then 40 (4 x 10)
    assert schedule.gap == 40
    assert _walk(ProbeSchedule.start(10, backoff=1), 50)[0] == [10, 20, 30, 40, 50]
    assert probe_calls(200, 10, 4) == 6 and probe_calls(50, 10, 1) == 5


def test_any_change_brings_the_probe_back_to_probe_every():
    seen, schedule = _walk(ProbeSchedule.start(10, backoff=8), 200,
                           confirmed=lambda call: call != 70)
    assert seen == [10, 30, 70, 80, 100, 140]  # after 70's change: 10, then doubling again
    # A switch at a decision without a probe (the statistics' finding) too.
    s = ProbeSchedule.start(10, backoff=8).probed(10).decided(10, probed=True, confirmed=True)
    assert (s.gap, s.next) == (20, 30)
    s = s.decided(15, probed=False, confirmed=False)
    assert (s.gap, s.next) == (10, 25)
    # A decision that read no probe and changed nothing leaves it as it was.
    assert s.decided(20, probed=False, confirmed=True) == s


def test_a_run_that_made_calls_probes_where_the_periodic_probe_would():
    assert ProbeSchedule.start(200, calls=450).next == 600
    assert ProbeSchedule.start(200, calls=0).next == 200


def test_a_record_restores_only_what_the_settings_can_hold():
    base = ProbeSchedule.start(10, backoff=4)
    assert base.restored([40, 150, 110]).get_config() == [40, 150, 110]
    for bad in (None, [40, 150], [80, 150, 110], [15, 150, 110], [5, 150, 110],
                [40, 0, 110], ["40", 150, 110], [True, 150, 110]):
        assert base.restored(bad) == base


@pytest.mark.parametrize("kwargs", [dict(probe_every=0), dict(probe_every=10, backoff=0),
                                    dict(probe_every=1.5), dict(probe_every=10, calls=-1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="must be an int"):
        ProbeSchedule.start(**kwargs)
    with pytest.raises(ValueError, match="`probe_backoff` must be an int >= 1"):
        AdaptivePrecision(probe_backoff=0)


class _Recording(AdaptivePrecision):
    """Notes the calls that ran the probe step."""

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if self.model.train_function is self._train_functions()[2]:
            self.probed.append(self._calls + 1)


def _model():
    keras.utils.set_random_seed(0)
    with keras_mp.policy_scope("adaptive_bfloat16"):
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    return x, (x[:, :1] * 0.5).astype("float32")


def _callback():
    cb = _Recording(interval=4, probe_every=4, first_decision=None, probe_backoff=4)
    cb.probed = []
    return cb


def test_fit_probes_less_often_while_the_dtypes_hold_and_a_resumed_run_probes_alike(tmp_path):
    x, y = _data()
    fit = dict(batch_size=8, verbose=0, shuffle=False)  # 8 calls an epoch
    backup = str(tmp_path / "backup")
    model, cb = _model(), _callback()
    model.fit(x, y, epochs=4, callbacks=[
        cb, keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)], **fit)
    assert cb.events == []  # nothing to change: every probe confirmed
    assert cb.probed == [4, 12, 28]  # gaps 8, 16 (4 x 4)
    model.fit(x, y, epochs=8, initial_epoch=4, callbacks=[cb], **fit)
    assert cb.probed == [4, 12, 28, 44, 60]

    # The backup carries the schedule: a new model and callback resumed from it
    # probe on the calls the uninterrupted run did.
    again, cb2 = _model(), _callback()
    again.fit(x, y, epochs=8, callbacks=[cb2, keras.callbacks.BackupAndRestore(backup)], **fit)
    assert cb2.probed == [44, 60]
    assert cb2._state.probes == cb._state.probes
