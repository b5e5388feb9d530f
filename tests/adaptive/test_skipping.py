"""Under every adaptive policy a step whose gradients are not finite changes
nothing, and a batch that is itself not finite is bad data, not evidence
(keras_mp/adaptive/integration/skipping.py): plain ``fit`` as a user runs it,
what fit adds by itself, Keras's policies beside it."""

from __future__ import annotations

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp.adaptive.integration import skipping
from keras_mp.callbacks import AdaptivePrecision

BATCH = 32


def _data(n: int = 512, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def _model(policy: str, batch_norm: bool):
    if policy.startswith("adaptive"):
        keras_mp.set_global_policy(policy)
    else:
        keras.mixed_precision.set_global_policy(policy)
    layers = [keras.Input((8,)), keras.layers.Dense(32, activation="relu")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    return model


@functools.lru_cache(maxsize=None)
def _keras_run(policy: str, batch_norm: bool) -> tuple[float, bool]:
    """Keras's policy on the same faulty run, once per module: (mse, finite)."""
    _, mse, finite, _ = _faulty_run(policy, batch_norm)
    return mse, finite


def _faulty_run(policy: str, batch_norm: bool, callbacks=()):
    """NaN and inf in 2 of 16 batches, an all-NaN epoch, then 3 clean epochs."""
    keras.utils.set_random_seed(0)
    x, y = _data()
    model = _model(policy, batch_norm)
    bad = x.copy()
    bad[3 * BATCH] = np.nan
    bad[7 * BATCH + 1, 2] = np.inf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(bad, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                  callbacks=list(callbacks))
        model.fit(np.full_like(x, np.nan), y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=list(callbacks))
        model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, callbacks=list(callbacks))
    mse = float(keras.ops.convert_to_numpy(keras.ops.mean((model.predict(x, verbose=0) - y) ** 2)))
    finite = all(np.isfinite(w).all() for w in model.get_weights())
    return model, mse, finite, [str(w.message) for w in caught]


@pytest.mark.parametrize("policy", ["adaptive_float16", "adaptive"])
def test_bad_batches_leave_the_mlp_as_keras_mixed_float16_leaves_it(policy):
    keras_mse, keras_finite = _keras_run("mixed_float16", False)
    _, ruined_finite = _keras_run("mixed_bfloat16", False)
    model, mse, finite, messages = _faulty_run(policy, False)
    assert keras_finite and not ruined_finite  # Keras: float16 skips, bfloat16 is ruined
    assert finite and mse <= 2 * keras_mse, (mse, keras_mse)
    skip = [m for m in messages if "were skipped" in m]
    assert skip[0].startswith("keras_mp: 2 of 16 steps in epoch 1") and "first: step 4" in skip[0]
    assert "2 of them bad data" in skip[0] and skip[1].startswith("keras_mp: 16 of 16 steps")
    report = keras_mp.precision_report(model)
    assert report.bad_data_steps == 18 and report.skipped_steps >= 18
    assert "18 of them on bad data" in str(report)


@pytest.mark.parametrize("policy", ["adaptive_float16", "adaptive"])
def test_bad_batches_leave_batch_normalization_finite(policy):
    model, mse, finite, _ = _faulty_run(policy, True)
    _, keras_finite = _keras_run("mixed_float16", True)
    assert not keras_finite  # Keras's skip keeps the weights, not the moving statistics
    bn = next(layer for layer in model.layers
              if isinstance(layer, keras.layers.BatchNormalization))
    assert np.isfinite(bn.moving_mean.numpy()).all()
    assert np.isfinite(bn.moving_variance.numpy()).all()
    assert finite and np.isfinite(mse)
    # As if the bad batches had not been there: the same model on the clean epochs only.
    keras.utils.set_random_seed(0)
    x, y = _data()
    clean = _model(policy, True)
    clean.fit(np.delete(x, [3 * BATCH, 7 * BATCH + 1], 0), np.delete(y, [96, 225], 0),
              batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    clean.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
    clean_mse = float(np.mean((clean.predict(x, verbose=0) - y) ** 2))
    assert mse <= 2 * clean_mse, (mse, clean_mse)


@pytest.mark.parametrize("policy", ["adaptive_float16", "adaptive"])
def test_bad_data_promotes_no_layer_while_adapting(policy, adapt_every_fit):
    cb = AdaptivePrecision(interval=4, probe_every=4)
    model, _, finite, _ = _faulty_run(policy, True, callbacks=[cb])
    assert finite
    assert cb.events == [], cb.events  # no input_range from NaN input, nothing to undo
    narrow = keras_mp.device.default_candidates()[0] if policy == "adaptive" else "float16"
    assert {layer.compute_dtype for layer in model.layers} == {narrow}
    # Evidence still counted on the clean steps, where there is a 16-bit
    # candidate to gather it for (float32 alone on a CPU without 16-bit units:
    # the callback steps aside, the skip still holds).
    stats = getattr(model, "_keras_mp_statistics", None)
    adapting = narrow != "float32"
    assert (stats is not None) == adapting and cb._calls == (16 * 5 if adapting else 0)


def test_bad_data_leaves_the_loss_scale_as_it_was(adapt_every_fit):
    keras.utils.set_random_seed(0)
    x, y = _data(128)
    model = _model("adaptive_float16", False)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    scale = float(model.optimizer.loss_scale)
    skipped = int(model.optimizer.skipped_steps.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(np.full_like(x, np.nan), y, batch_size=BATCH, epochs=2, verbose=0)
    assert int(model.optimizer.skipped_steps.numpy()) == skipped + 8
    assert float(model.optimizer.loss_scale) == scale  # no back-off for bad data


def test_the_metric_totals_of_an_epoch_leave_out_its_skipped_step():
    x, y = _data(128)
    model = _model("adaptive", False)
    bad = x.copy()
    bad[BATCH] = np.nan  # the second of four batches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged = []
        model.fit(bad, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False, callbacks=[
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, logs: logged.append(float(logs["loss"])))])
    assert np.isnan(logged[1]) and np.isfinite([logged[0], *logged[2:]]).all()


@pytest.mark.parametrize("policy", ["adaptive_float16", "mixed_float16"])
def test_routine_overflows_of_a_high_scale_keep_the_epochs_loss_as_keras_does(
        policy, adapt_every_fit):
    """A loss scale far too high overflows float16's gradients in every step
    of the epoch: skipped routinely (above its floor), the steps still count
    in the metric totals, so the epoch logs the loss the unchanged weights
    make (Keras's mixed_float16 beside it), not the 0 of an empty mean."""
    keras.utils.set_random_seed(0)
    x, y = _data(128)
    model = _model(policy, True)
    wrap = keras_mp.LossScaleOptimizer if policy.startswith("adaptive") else \
        keras.optimizers.LossScaleOptimizer
    model.compile(wrap(keras.optimizers.Adam(1e-2), initial_scale=2.0 ** 60), "mse")
    before = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == 0   # every step skipped
    moving = model.layers[1].moving_mean.numpy()   # the forward pass's own updates kept
    assert np.abs(moving).max() > 0
    np.testing.assert_allclose(h.history["loss"][0], before, rtol=0.05)
    assert not any("were skipped" in str(w.message) for w in caught)


def test_routine_skips_of_a_forward_overflow_leave_the_metric_totals_out(adapt_every_fit):
    """The demo's start: inputs beyond float16's range overflow the forward
    pass, and the dynamic scale backs off (routine: above its floor). Those
    steps' loss is not finite, so their records are put back: the epoch's
    loss is the mean of the finite steps, and NaN where none was."""
    keras.utils.set_random_seed(0)
    x, y = _data(128)
    model = _model("adaptive_float16", False)
    big = x.copy()
    big[:BATCH] *= 1e6   # the first batch overflows float16 (beyond 65504)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = model.fit(big, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        everywhere = model.fit(x * 1e6, y, batch_size=BATCH, epochs=1, verbose=0)
    assert np.isfinite(h.history["loss"][0]), h.history
    assert np.isnan(everywhere.history["loss"][0]), everywhere.history
    assert int(model.optimizer.skipped_steps.numpy()) == 5
    assert not any("were skipped" in str(w.message) for w in caught)  # routine: no warning


def test_terminate_on_nan_still_stops_the_run():
    x, y = _data(128)
    model = _model("adaptive", False)
    bad = x.copy()
    bad[BATCH] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = model.fit(bad, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                      callbacks=[keras.callbacks.TerminateOnNaN()])
    # Stopped in the first epoch, at the bad batch; the epoch's loss (its metric
    # totals, read at its end) leaves the skipped step out.
    assert len(h.history["loss"]) == 1 and np.isfinite(h.history["loss"][0])
    assert int(model.optimizer.iterations.numpy()) == 1  # one step applied before it
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_the_switch_turns_skipping_off():
    keras_mp.config.set_skip_nonfinite(False)
    try:
        _, _, finite, messages = _faulty_run("adaptive", False)
    finally:
        keras_mp.config.set_skip_nonfinite(True)
    assert not finite and not any("were skipped" in m for m in messages)


def test_a_custom_train_step_is_guarded_too():
    keras_mp.set_global_policy("adaptive")

    class Custom(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(grads, self.trainable_variables)
            return {"loss": loss}

    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1)(keras.layers.BatchNormalization()(
        keras.layers.Dense(8)(inputs)))
    model = Custom(inputs, outputs)
    model.compile(optimizer="adam")
    x, y = _data(64)
    x[5] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)
    assert keras_mp.precision_report(model).skipped_steps == 2


def test_replicas_agree_on_a_nan_in_one_replica(two_replica_strategy):
    keras_mp.set_global_policy("adaptive")
    with two_replica_strategy.scope():
        model = _model("adaptive", True)
    x, y = _data(128)
    x[BATCH + 1] = np.nan  # one row: one replica's half of the second batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)
    assert int(model.optimizer.skipped_steps.numpy()) == 1


def test_bad_data_and_its_errors():
    assert skipping.bad_data((np.ones(2, "int32"),)) is None  # nothing floating
    assert not bool(skipping.bad_data({"a": np.ones(3, "float32"), "b": None}))
    assert bool(skipping.bad_data([np.array([np.nan], "float16")]))
    with pytest.raises(TypeError, match="`enabled`"):
        keras_mp.config.set_skip_nonfinite("yes")
    with pytest.raises(TypeError, match="`model`"):
        skipping.guard("model")
    with pytest.raises(TypeError, match="`model`"):
        skipping.skipped(3)


def test_a_scale_of_one_only_skips_and_cannot_be_changed():
    opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(1.0), schedule=1.0)
    v = keras.Variable([1.0, 2.0])
    opt.apply([tf.constant([0.5, 0.5])], [v])
    opt.apply([tf.constant([np.nan, 0.5])], [v])  # skipped: nothing changes
    assert v.numpy().tolist() == [0.5, 1.5] and int(opt.skipped_steps.numpy()) == 1
    with pytest.raises(ValueError, match="only skips non-finite steps"):
        opt.set_loss_scale(2.0)
