"""Faults: non-finite gradients injected at random steps, on one replica only,
and for many steps in a row.

Each skipped step must change no weight, no optimizer slot (Adam's moments)
and no iteration count, on any replica; training afterwards must go on as if
the faulty batches had never been there; a run that can only skip must stop
with an error naming the variables whose gradients were non-finite.
Faults come from :class:`tests.faults.GradientFault`, which poisons only the
gradients of the layer before it (``first``), never those of ``second``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp import DynamicLossScale, LossScaleOptimizer
from keras_mp.scaling.skips import TooManySkipsError
from tests.faults import Snapshots, fault_data, fault_model, local_values, \
    two_replica_mirrored_strategy


@pytest.fixture
def mirrored():
    return two_replica_mirrored_strategy()


BATCH = 16  # global; two replicas get 8 rows each
STRATEGIES = ["one_device", "one_replica_of_two"]


def _strategy(kind, mirrored):
    return mirrored if kind == "one_replica_of_two" else tf.distribute.get_strategy()


def _rows(kind, rng):
    """Poisoned rows of a bad batch: one row on replica 1 only, or any row."""
    if kind == "one_replica_of_two":
        return [int(rng.integers(BATCH // 2, BATCH))]
    return [int(rng.integers(0, BATCH))]


def _build(strategy, schedule, **opt_kw):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = fault_model()
        opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2), schedule=schedule, **opt_kw)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
        opt.build(model.trainable_variables)
    return model, opt


def _training_state(model, opt):
    # What a skipped step must leave alone; the loss-scale state may change.
    return [*model.trainable_variables, *opt.inner_optimizer.variables, opt.iterations]


def _fit(model, x, flag, y, callbacks=()):
    return model.fit([x, flag], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                     callbacks=list(callbacks))


def _assert_replicas_agree(snapshot):
    for values in snapshot:
        for replica in values[1:]:
            np.testing.assert_array_equal(replica, values[0])


@pytest.mark.parametrize("kind", STRATEGIES)
def test_skips_at_random_steps_are_as_if_the_batches_were_never_there(
        kind, mirrored):
    steps = 10
    rng = np.random.default_rng(7)
    bad_steps = sorted(int(s) for s in rng.choice(steps, size=4, replace=False))
    x, flag, y = fault_data(steps, BATCH, {s: _rows(kind, rng) for s in bad_steps})

    model, opt = _build(_strategy(kind, mirrored),
                        DynamicLossScale(initial_scale=2.0**12, growth_interval=3))
    snaps = Snapshots(lambda: _training_state(model, opt))
    _fit(model, x, flag, y, [snaps])

    assert len(snaps.steps) == steps + 1
    for step in range(steps):
        before, after = snaps.steps[step], snaps.steps[step + 1]
        _assert_replicas_agree(after)
        changed = [not np.array_equal(a, b) for a, b in zip(before, after)]
        if step in bad_steps:
            assert not any(changed), f"skipped step {step} changed the training state"
        else:
            assert all(changed[:len(model.trainable_variables)]), f"step {step} was not applied"
    assert int(opt.skipped_steps.numpy()) == len(bad_steps)
    assert int(opt.iterations.numpy()) == steps - len(bad_steps)

    # The reference never sees the faulty batches, on one device.
    good = np.concatenate([np.arange(s * BATCH, (s + 1) * BATCH)
                           for s in range(steps) if s not in bad_steps])
    ref, ref_opt = _build(tf.distribute.get_strategy(),
                          DynamicLossScale(initial_scale=2.0**12, growth_interval=3))
    _fit(ref, x[good], np.zeros_like(flag[good]), y[good])
    # On one device the loss scale is a power of two, so scaling is exact and
    # only the skipped batches can differ: none may. Two replicas sum the
    # gradients in another order.
    tol = dict(rtol=0, atol=0) if kind == "one_device" else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(_training_state(model, opt), _training_state(ref, ref_opt)):
        np.testing.assert_allclose(local_values(a)[0], local_values(b)[0], **tol)


@pytest.mark.parametrize("kind", STRATEGIES)
def test_many_skips_in_a_row_then_recovery(kind, mirrored):
    good_before, bad_run, good_after = 3, 12, 12
    steps = good_before + bad_run + good_after
    rng = np.random.default_rng(1)
    bad_steps = list(range(good_before, good_before + bad_run))
    x, flag, y = fault_data(steps, BATCH, {s: _rows(kind, rng) for s in bad_steps})
    schedule = DynamicLossScale(initial_scale=2.0**8, growth_interval=2, hysteresis=2,
                                min_scale=2.0)
    model, opt = _build(_strategy(kind, mirrored), schedule)
    snaps = Snapshots(lambda: [*_training_state(model, opt), opt.loss_scale_state["loss_scale"],
                               opt.consecutive_skips])
    history = model.fit([x, flag], y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[snaps])
    assert history.history["loss"]
    n = len(_training_state(model, opt))
    scales = [float(s[n][0]) for s in snaps.steps[1:]]
    consecutive = [int(s[n + 1][0]) for s in snaps.steps[1:]]

    frozen = snaps.steps[good_before]
    for step in bad_steps:
        for a, b in zip(frozen[:n], snaps.steps[step + 1][:n]):
            np.testing.assert_array_equal(a, b)
    assert consecutive[good_before + bad_run - 1] == bad_run
    assert consecutive[-1] == 0

    # The scale follows the schedule on the agreed flags: hysteresis, then
    # halving down to the floor and no further, then growth again.
    state, applied, expected = schedule.initial_state(), 0, []
    for step in range(steps):
        finite = step not in bad_steps
        state = schedule.update(state, finite, applied)
        applied += finite
        expected.append(float(schedule.scale(state)))
    assert scales == expected
    assert min(scales) == schedule.min_scale
    assert scales[-1] >= 2.0**6

    # Recovered: the steps after the fault train (the loss on the clean data
    # falls) and every replica holds the same finite weights.
    weights = np.concatenate([local_values(v).ravel() for v in model.trainable_variables])
    assert np.isfinite(weights).all()
    _assert_replicas_agree(snaps.steps[-1])
    assert int(opt.iterations.numpy()) == good_before + good_after
    clean = np.zeros_like(flag)
    loss_at_fault = _loss_with(model, snaps.steps[good_before][:len(model.trainable_variables)],
                               x, clean, y)
    assert model.evaluate([x, clean], y, batch_size=BATCH, verbose=0) < 0.8 * loss_at_fault


def _loss_with(model, values, x, flag, y):
    now = [v.numpy() for v in model.trainable_variables]
    for v, val in zip(model.trainable_variables, values):
        v.assign(val[0])
    loss = model.evaluate([x, flag], y, batch_size=BATCH, verbose=0)
    for v, val in zip(model.trainable_variables, now):
        v.assign(val)
    return loss


@pytest.mark.parametrize("kind", STRATEGIES)
def test_max_consecutive_skips_stops_a_hopeless_run_naming_the_variables(
        kind, mirrored):
    steps, limit = 8, 3
    rng = np.random.default_rng(2)
    x, flag, y = fault_data(steps, BATCH, {s: _rows(kind, rng) for s in range(steps)})
    model, opt = _build(_strategy(kind, mirrored),
                        DynamicLossScale(initial_scale=2.0**4), max_consecutive_skips=limit)
    snaps = Snapshots(lambda: _training_state(model, opt))
    with pytest.raises(TooManySkipsError,
                       match=rf"{limit + 1} consecutive steps.*max_consecutive_skips={limit}") \
            as err:
        _fit(model, x, flag, y, [snaps])
    offending = str(err.value).split("Non-finite gradients in:")[1]
    assert "first/kernel" in offending and "first/bias" in offending
    assert "second" not in offending
    assert len(snaps.steps) == limit + 1  # stopped at the first step over the limit
    for snapshot in snaps.steps[1:]:
        for a, b in zip(snaps.steps[0], snapshot):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value", [np.inf, np.nan], ids=["inf", "nan"])
def test_sparse_gradient_fault_on_one_replica_is_skipped_everywhere(value,
                                                                    mirrored):
    """Embedding gradients are IndexedSlices, checked outside the dense kernel."""
    keras.utils.set_random_seed(0)
    from tests.faults import GradientFault

    with mirrored.scope():
        ids = keras.Input((3,), dtype="int32")
        flag = keras.Input((1,))
        h = keras.layers.Embedding(10, 4, name="embed")(ids)
        h = GradientFault(value)([h, flag])
        out = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(h))
        model = keras.Model([ids, flag], out)
        opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=8.0)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=(BATCH, 3)).astype("int32")
    f = np.zeros((BATCH, 1), "float32")
    f[BATCH - 1] = 1.0  # replica 1 only
    before = [local_values(v) for v in model.trainable_variables]
    model.fit([x, f], np.ones((BATCH, 1), "float32"), batch_size=BATCH, verbose=0)
    for a, b in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, local_values(b))
    assert int(opt.skipped_steps.numpy()) == 1 and int(opt.iterations.numpy()) == 0
    assert float(opt.loss_scale) == 4.0
