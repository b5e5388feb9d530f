"""keras-mp under tf.distribute in one process: fused layers and the adaptive
policy on two replicas (two logical CPU devices, see conftest.py) against one
device, every replica holding the same state, and the strategy check.

The two-worker counterparts are in test_multi_worker.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import DynamicLossScale, LossScaleOptimizer, distribute, policies
from keras_mp.scaling import loss_scale
from keras_mp.callbacks import AdaptivePrecision
from keras_mp.adaptive.outputs.report import precision_report
from tests.faults import local_values, two_replica_mirrored_strategy


@pytest.fixture
def mirrored():
    return two_replica_mirrored_strategy()


BATCH = 16  # global; 8 rows per replica


def _assert_replicas_agree(variables):
    for v in variables:
        values = local_values(v)
        for replica in values[1:]:
            np.testing.assert_array_equal(replica, values[0], err_msg=v.path)


def _central_storage():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    return tf.distribute.experimental.CentralStorageStrategy(devices)


# -- fused layers --------------------------------------------------------------

def _fused_model():
    model = keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(16, activation="gelu"),
        keras.layers.LayerNormalization(), keras.layers.Dense(8, activation="silu"),
        keras.layers.Dense(1)])
    fused = keras_mp.fuse(model)
    assert all(type(layer).__module__ == "keras_mp.fused.layers" for layer in fused.layers)
    return fused


def _fused_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 6)).astype("float32")
    y = np.tanh(x[:, :1] - x[:, 1:2]).astype("float32")
    x[BATCH + 12, 2] = np.inf  # step 1, replica 1 only
    return x, y


def _train_fused(strategy, policy):
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(policy)
    with strategy.scope():
        model = _fused_model()
        opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2), schedule=DynamicLossScale(
            initial_scale=2.0**10, growth_interval=2))
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(*_fused_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model, opt


@pytest.mark.parametrize("strategy,policy,tol", [
    ("mirrored", "mixed_float16", 2e-2),  # float16 sums over 8 rows, not 16
    ("central_storage", "float32", 1e-5),
])
def test_fused_layers_match_single_device(strategy, policy, tol, mirrored):
    dist = mirrored if strategy == "mirrored" else _central_storage()
    single, single_opt = _train_fused(tf.distribute.get_strategy(), policy)
    model, opt = _train_fused(dist, policy)
    for name in ("skipped_steps", "iterations"):
        assert int(getattr(opt, name).numpy()) == int(getattr(single_opt, name).numpy())
    assert int(opt.skipped_steps.numpy()) == 2  # the NaN batch, once per epoch
    assert float(opt.loss_scale) == float(single_opt.loss_scale)
    for a, b in zip(model.weights, single.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=tol, atol=tol, err_msg=a.path)
    if strategy == "mirrored":
        _assert_replicas_agree(model.weights + opt.variables)


# -- the adaptive policy ---------------------------------------------------------

def _adaptive_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    # Beyond float16 in replica 1's half of every batch only.
    x[BATCH - 1::BATCH, 0] = 7e4
    return x, y


def _train_adaptive(strategy):
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    policies.set_global_policy("adaptive_float16")
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)),
                                  keras.layers.Dense(8, kernel_initializer=small),
                                  keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    cb = AdaptivePrecision(interval=2, loss_scale=loss_scale.DynamicLossScale(initial_scale=2.0))
    model.fit(*_adaptive_data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb])
    return model, cb


def test_adaptive_policy_decides_as_on_one_device(mirrored):
    single, single_cb = _train_adaptive(tf.distribute.get_strategy())
    model, cb = _train_adaptive(mirrored)
    # Only replica 1 overflowed: the all-gathered statistics still promote.
    assert cb.events, "no precision decision was made"
    assert cb.events == single_cb.events
    assert precision_report(model).rows[0]["compute_dtype"] == "float32"
    assert [r["state"] for r in precision_report(model).rows] == \
        [r["state"] for r in precision_report(single).rows]
    for a, b in zip(model.weights, single.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-2, atol=2e-2, err_msg=a.path)
    # Statistics, controller state and loss-scale state: one value on every replica.
    _assert_replicas_agree(cb._stats.weights + cb._state.weights + model.optimizer.variables
                           + model.weights)
    ours, ref = cb._stats.read(), single_cb._stats.read()
    assert ours.steps == ref.steps and ours.all_nonfinite == ref.all_nonfinite
    for a, b in zip(ours.layers, ref.layers):
        assert a.nonfinite == b.nonfinite
        np.testing.assert_allclose(a.amax, b.amax, rtol=2e-2)


def _train_layer_scales(strategy):
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    policies.set_global_policy(keras_mp.AdaptivePolicy(("float16", "float32"),
                                                       layer_loss_scales=True))
    small = keras.initializers.RandomUniform(-0.05, 0.05, seed=1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,))] + [
            keras.layers.Dense(u, kernel_initializer=small) for u in (8, 4, 1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=False)
    # Tiny targets at a scale of 1: float16 gradients in the subnormal range.
    cb = AdaptivePrecision(interval=2, probe_every=None, loss_scale=DynamicLossScale(
        initial_scale=1.0, recovery_interval=None))
    x, y = _adaptive_data()
    x[:, 0] = np.clip(x[:, 0], -3, 3)
    model.fit(x, 1e-3 * y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[cb])
    return model, cb


def test_per_layer_loss_scales_agree_across_replicas(mirrored):
    single, single_cb = _train_layer_scales(tf.distribute.get_strategy())
    model, cb = _train_layer_scales(mirrored)
    assert cb.scale_events and all(e["layer"] is not None for e in cb.scale_events)
    first = [(e["layer"], e["new"]) for e in cb.scale_events if e["step"] == 2]
    first_single = [(e["layer"], e["new"]) for e in single_cb.scale_events if e["step"] == 2]
    # The same layers lifted from the same statistics; each replica carries half
    # the batch's gradient (Keras divides the loss by the replicas), so a factor
    # may be one power of 2 above one device's.
    assert [layer for layer, _ in first] == [layer for layer, _ in first_single]
    assert all(new / ref in (1.0, 2.0) for (_, new), (_, ref) in zip(first, first_single))
    assert cb.events == single_cb.events == []
    # one value of every factor (and all other optimizer state) on every replica
    _assert_replicas_agree(model.optimizer.variables + model.weights)
    for a, b in zip(model.weights, single.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=2e-2, atol=2e-2, err_msg=a.path)


# -- which strategies --------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda two: None,
    lambda two: tf.distribute.OneDeviceStrategy("/cpu:0"),
    lambda two: two,
    lambda two: _central_storage(),
], ids=["default", "one_device", "mirrored", "central_storage"])
def test_supported_strategies_pass_the_check(make, mirrored):
    strategy = make(mirrored) or tf.distribute.get_strategy()
    distribute.check_strategy(strategy)
    with strategy.scope():
        opt = LossScaleOptimizer(keras.optimizers.SGD())
        opt.build([keras.Variable([1.0])])
    assert opt.built


def test_check_strategy_rejects_a_non_strategy():
    with pytest.raises(TypeError, match="`strategy` must be a tf.distribute.Strategy"):
        distribute.check_strategy("mirrored")


def _train_compact(strategy):
    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    policies.set_global_policy("adaptive_bfloat16")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    history = model.fit(x, x[:, :2].sum(axis=1, keepdims=True), batch_size=BATCH, epochs=3,
                        shuffle=False, verbose=0)
    return model, history.history["loss"]


def test_compact_weights_and_moments_under_a_strategy(mirrored, tmp_path):
    """Compact (bfloat16) weights and moments train under MirroredStrategy as
    on one device: every replica's dithered update is the same, so the
    replicas agree; the model saves and loads. Under CentralStorageStrategy
    the state stays float32, with its reason."""
    from keras_mp.adaptive.storage import trained, variables
    from keras_mp.execution import optimizer_state

    keras_mp.config.set_min_saving(0)
    keras_mp.config.set_compact_weights(True)
    keras_mp.config.set_compact_moments(True)
    try:
        single, single_loss = _train_compact(tf.distribute.get_strategy())
        model, loss = _train_compact(mirrored)
        inner = optimizer_state.inner(model.optimizer)
        for m in (single, model):
            assert {variables.stored_dtype(v) for v in m.trainable_variables} == {"bfloat16"}
        assert {variables.stored_dtype(v) for v in inner._momentums} == {"bfloat16"}
        _assert_replicas_agree(model.weights + model.optimizer.variables)
        assert loss[-1] < 0.25 * loss[0]
        np.testing.assert_allclose(loss, single_loss, rtol=0.05)
        path = str(tmp_path / "compact.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
        x = np.random.default_rng(1).normal(size=(16, 8)).astype("float32")
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                                   rtol=1e-2, atol=1e-2)
        central, _ = _train_compact(_central_storage())
        assert {variables.stored_dtype(v) for v in central.trainable_variables} == {"float32"}
        assert trained.adam_reason(central.optimizer).startswith("CentralStorageStrategy")
    finally:
        keras_mp.config.set_compact_weights(None)
        keras_mp.config.set_compact_moments(None)
        keras_mp.config.set_min_saving(0.5)
        policies.set_global_policy("float32")


def test_an_adaptive_policy_trains_under_central_storage(caplog):
    """Under CentralStorageStrategy the fit failed at its first trace (the
    guard's tf.cond held a cross-replica merge): now it trains, the update of
    a non-finite step still skipped by the loss-scale optimizer."""
    import logging

    keras.utils.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    policies.set_global_policy("adaptive_bfloat16")
    try:
        with _central_storage().scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        x = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
        y = x[:, :1].copy()
        y[40] = np.nan                                   # one bad batch: its update skipped
        with caplog.at_level(logging.INFO, logger="keras_mp"):
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        assert "under CentralStorageStrategy a skipped step" in caplog.text
        assert all(np.isfinite(w.numpy()).all() for w in model.trainable_weights)
        assert model.optimizer.skipped_steps.numpy() >= 1
        assert len(history.history["loss"]) == 2
    finally:
        policies.set_global_policy("float32")
