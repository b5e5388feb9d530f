"""Issue 49, item 5: a model loaded from a ``.keras`` file predicts and
evaluates what the trained model did, to the bit, whichever execution mode
its train step ran in (keras_mp.execution.inference); ``model.export`` serves
the same predictions."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import execution
from keras_mp.execution import inference


def _multi_io():
    """The keras-io functional guide's kind of model: two inputs (a sequence
    through an LSTM, a vector through a Dense layer), two outputs."""
    sequence = keras.Input((12, 8), name="sequence")
    extra = keras.Input((5,), name="extra")
    h = keras.layers.concatenate([keras.layers.LSTM(16)(sequence),
                                  keras.layers.Dense(16, activation="gelu")(extra)])
    model = keras.Model([sequence, extra], [keras.layers.Dense(3, name="scores")(h),
                                            keras.layers.Dense(1, name="flag")(h)])
    model.compile(optimizer="rmsprop", loss=["mse", "mse"])  # no native update: all 3 modes
    return model


def _data(n=96):
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(n, 12, 8)).astype("float32"),
         rng.normal(size=(n, 5)).astype("float32")]
    return x, [rng.normal(size=(n, 3)).astype("float32"),
               rng.normal(size=(n, 1)).astype("float32")]


@pytest.mark.parametrize("mode, policy", [
    ("graph", "adaptive_float16"), ("xla_update", "adaptive_float16"),
    ("xla", "adaptive_float16"), ("auto", "adaptive_float16"), ("xla", "adaptive_bfloat16")])
def test_a_loaded_model_predicts_what_the_trained_model_predicted(tmp_path, mode, policy):
    x, y = _data()
    keras_mp.set_global_policy(policy)
    keras_mp.config.set_min_saving(0)
    try:
        model = _multi_io()
        if mode != "auto":
            keras_mp.config.set_execution(model, mode)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        assert execution.chosen(model) == mode or mode == "auto"
        assert model.jit_compile is (execution.chosen(model) == "xla")  # the train step's
        assert inference.jit(model) is False   # compile's: "auto" on a CPU-only machine
        predicted = model.predict(x, verbose=0)
        evaluated = model.evaluate(x, y, verbose=0)
        model.save(tmp_path / "m.keras")
        loaded = keras.saving.load_model(tmp_path / "m.keras")
        for a, b in zip(predicted, loaded.predict(x, verbose=0)):
            np.testing.assert_array_equal(a, b)
        assert loaded.evaluate(x, y, verbose=0) == evaluated
        # The trained model's own predictions stay the same after saving.
        for a, b in zip(predicted, model.predict(x, verbose=0)):
            np.testing.assert_array_equal(a, b)
        # A SavedModel serves the model's call as a graph: the same numbers
        # for the same batch.
        model.export(str(tmp_path / "served"), verbose=False)
        reloaded = tf.saved_model.load(str(tmp_path / "served"))   # holds the variables
        served = reloaded.serve([tf.constant(x[0][:32]), tf.constant(x[1][:32])])
        for a, b in zip(model.predict([t[:32] for t in x], batch_size=32, verbose=0), served):
            np.testing.assert_array_equal(a, np.asarray(b))
    finally:
        keras_mp.set_global_policy("float32")


def test_inference_runs_as_compile_set_it():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="rmsprop", loss="mse", jit_compile=True)
    assert execution.configure(model, mode="graph") == "graph" and model.jit_compile is False
    assert inference.jit(model) is True
    model.predict(np.ones((2, 4), "float32"), verbose=0)
    assert model.jit_compile is False   # the train step's, put back
    eager = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    eager.compile(optimizer="sgd", loss="mse", jit_compile=True, run_eagerly=True)
    assert inference.jit(eager) is False
    assert inference.jit(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])) is False
