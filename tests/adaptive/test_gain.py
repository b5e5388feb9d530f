"""A fit whose 16-bit arithmetic could not repay adaptation's start-up trains
in float32 (keras_mp.adaptive.decisions.gain, applied by keras_mp.adaptive.fit.autofit):
the work it counts, the data it reads, and the float32 fit through Keras's
lifecycle, as Keras float32 trains it."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import policies
from keras_mp.adaptive.fit import autofit
from keras_mp.adaptive.decisions import gain
from keras_mp.adaptive.outputs.report import precision_report


def _dense(policy="adaptive_float16", features=4):
    policies.set_global_policy(policy)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(8),
                              keras.layers.ReLU(), keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _xy(n=64, features=4):
    x = np.random.default_rng(0).normal(size=(n, features)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def test_step_work_counts_each_use_of_each_weight():
    policies.set_global_policy("adaptive_bfloat16")
    dense = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
    assert gain.step_work(dense, 32) == 6 * 32 * 33
    conv = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(4, 3, padding="same"),
                             keras.layers.GlobalAveragePooling2D()])
    assert gain.step_work(conv, 2) == 6 * 2 * (3 * 3 * 3 * 4 + 4) * 64  # once per position
    seq = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(2)])
    assert gain.step_work(seq, 1) == 6 * 8 * 5
    # Not known: a layer calling its sublayers, a length unknown, a model unbuilt
    inp = keras.Input((5, 4))
    mha = keras.Model(inp, keras.layers.MultiHeadAttention(2, 2)(inp, inp))
    assert gain.step_work(mha, 8) is None
    assert gain.step_work(keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(2)]),
                          8) is None
    assert gain.step_work(keras.Sequential([keras.layers.Dense(2)]), 8) is None
    with pytest.raises(ValueError, match="`batch_size` must be an int >= 1"):
        gain.step_work(dense, 0)
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        gain.step_work(keras.layers.Dense(2), 8)


def test_fit_steps_reads_the_data_as_keras_batches_it():
    x = np.zeros((1000, 32), "float32")
    assert gain.fit_steps(x, None, epochs=3) == (32, 96)  # Keras's default batch
    assert gain.fit_steps({"a": x}, 10, epochs=3, initial_epoch=1) == (10, 200)
    assert gain.fit_steps(x, 10, epochs=3, steps_per_epoch=5) == (10, 15)
    ds = tf.data.Dataset.from_tensor_slices((x[:20], x[:20]))
    assert gain.fit_steps(ds.batch(8, drop_remainder=True), None, epochs=2) == (8, 4)
    assert gain.fit_steps(ds.batch(8), None, epochs=2) is None  # its batch is not static
    assert gain.fit_steps(ds.batch(8, drop_remainder=True).repeat(), None, epochs=2) is None
    assert gain.fit_steps(ds.batch(8, drop_remainder=True).repeat(), None, epochs=2,
                          steps_per_epoch=4) == (8, 8)
    assert gain.fit_steps(iter([(x, x)]), None) is None  # a generator


def test_most_saved_and_the_threshold_reject_what_is_not_seconds():
    assert gain.most_saved(1e9, 10, float32_gflops=100.0) == pytest.approx(0.1)
    assert gain.most_saved(1e9, 10, float32_gflops=0.0) == math.inf  # nothing measured
    for bad in (-1, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ValueError, match="`seconds` must be a finite number"):
            autofit.set_min_saving(bad)
    assert autofit.min_saving() == gain.START_UP_S  # unchanged by the refusals
    with pytest.raises(TypeError, match="`fit_arguments` must be a dict"):
        gain.pays_off(_dense(), [])
    with pytest.raises(ValueError, match="`min_saving` must be a finite number"):
        gain.pays_off(_dense(), {}, min_saving=float("nan"))
    with pytest.raises(ValueError, match="`float32_gflops` must be a finite number"):
        gain.most_saved(1.0, 1, float32_gflops=-1.0)


def test_a_fit_too_small_to_gain_trains_as_keras_float32_does(tmp_path):
    x, y = _xy()
    keras.utils.set_random_seed(1)
    model = _dense("adaptive_float16")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)   # 16 steps of a 4-8-1 MLP
    keras.utils.set_random_seed(1)
    reference = _dense("float32")
    reference.fit(x, y, batch_size=8, epochs=2, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)  # the same float32 fit
    assert autofit.callback_of(model) is None
    # The loss scale float16 would need, kept from the first step (its skip of
    # non-finite steps guards the float32 fit too): the fit is float32's to the bit.
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert type(model.optimizer.inner_optimizer) is keras.optimizers.Adam
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}
    policy = keras_mp.adaptive.policy_of(model)
    reasons = {p: r["history"][-1]["reason"] for p, r in policy.records.items()}
    assert set(reasons.values()) == {"no_gain"} and len(reasons) == 3
    assert "no_gain" in str(precision_report(model))
    # Saved, loaded, exported and quantized as the float32 model it is.
    path = str(tmp_path / "m.keras")
    model.save(path)
    policies.set_global_policy("float32")
    want = model.predict(x, verbose=0)
    for global_policy in ("mixed_float16", "adaptive_bfloat16", "float32"):  # whatever it is
        policies.set_global_policy(global_policy)
        loaded = keras.models.load_model(path)
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), want)  # the ReLU too
        assert {layer.compute_dtype for layer in loaded.layers} == {"float32"}
    assert keras_mp.adaptive.policy_of(loaded).record(loaded.layers[0].path)["history"][-1][
        "reason"] == "no_gain"
    model.export(str(tmp_path / "exported"), verbose=False)
    artifact = tf.saved_model.load(str(tmp_path / "exported"))
    np.testing.assert_allclose(artifact.serve(tf.constant(x)).numpy(), want, rtol=1e-6, atol=1e-6)
    loaded.quantize("int8")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, atol=0.1 * np.abs(want).max())
    # A second small fit changes nothing; one that can gain adapts from the narrowest dtype.
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert autofit.callback_of(model) is None
    autofit.set_min_saving(0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert isinstance(autofit.callback_of(model), keras_mp.callbacks.AdaptivePrecision)
    assert isinstance(model.optimizer, keras_mp.LossScaleOptimizer)
    assert policy.record(model.layers[0].path)["history"][-1]["reason"] == "gain"
    assert model.layers[0].compute_dtype == "float16"


def test_a_fit_that_can_gain_adapts_by_itself():
    # 4096-wide layers: the most bfloat16 could save in 200 steps is seconds.
    policies.set_global_policy("adaptive_bfloat16")
    model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096),
                              keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((64, 1024), "float32")
    assert gain.pays_off(model, {"x": x, "batch_size": 64, "epochs": 200})
    # One step saves under START_UP_S at the float32 throughput measured in
    # this process: unless the measurement itself ran on a machine so loaded
    # (the other pytest worker and the background pipelines on 2 cores) that
    # it read under 3.2 GFLOP/s, where one 1.6 GFLOP step may take 0.5 s.
    gflops = keras_mp.device.profile().throughput["float32"]
    one_step = gain.most_saved(gain.step_work(model, 64), 1, gflops)
    assert gain.pays_off(model, {"x": x, "batch_size": 64, "epochs": 1}) == \
        (one_step >= gain.START_UP_S), (gflops, one_step)
    assert not gain.pays_off(model, {"x": x, "batch_size": 64, "epochs": 1},
                             min_saving=one_step * 1.01)
    assert not gain.pays_off(_dense(), {"x": x[:, :4], "epochs": 1000})
    assert gain.pays_off(_dense(), {"x": x[:, :4], "epochs": 1}, min_saving=0)
    assert gain.pays_off(_dense(), {"x": iter([])})  # its size unknown: adapt
