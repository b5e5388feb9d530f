"""keras_mp.adaptive.evidence.same_draws: the probe's 16-bit and float32 passes
drop the same elements (Keras draws a dropout mask in its input's dtype, and
the same seed gives another mask in bfloat16), and Keras's draws elsewhere are
unchanged."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_mp
from keras_mp import policies
from keras_mp.adaptive.evidence import probe, same_draws

_BACKEND = keras.src.backend.random


def _kept(x):
    return tf.cast(x, tf.float32).numpy() != 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_inside_the_probe_a_16_bit_dropout_keeps_what_float32_keeps(dtype):
    x = tf.random.stateless_uniform([4, 500], seed=[3, 4]) + 0.5
    keras_own = _BACKEND.dropout(tf.cast(x, dtype), 0.4, seed=11)
    reference = _BACKEND.dropout(x, 0.4, seed=11)
    # Keras's own draws: about half the decisions differ between the dtypes.
    assert (_kept(keras_own) == _kept(reference)).mean() < 0.7
    with same_draws.same_draws():
        assert same_draws.active()
        ours = _BACKEND.dropout(tf.cast(x, dtype), 0.4, seed=11)
        again = _BACKEND.dropout(x, 0.4, seed=11)
    assert not same_draws.active()
    assert ours.dtype.name == dtype
    np.testing.assert_array_equal(_kept(ours), _kept(reference))
    np.testing.assert_array_equal(again.numpy(), reference.numpy())  # float32: Keras's own
    # Where both keep an element, the value is the one Keras's dropout of that dtype gives.
    both = _kept(ours) & _kept(keras_own)
    np.testing.assert_array_equal(tf.cast(ours, tf.float32).numpy()[both],
                                  tf.cast(keras_own, tf.float32).numpy()[both])
    # Outside the probe, Keras's draws as they were.
    np.testing.assert_array_equal(
        tf.cast(_BACKEND.dropout(tf.cast(x, dtype), 0.4, seed=11), tf.float32).numpy(),
        tf.cast(keras_own, tf.float32).numpy())


def test_inside_the_probe_16_bit_uniform_noise_is_float32_noise_rounded():
    def rounded(dtype):
        return tf.cast(tf.cast(keras.random.uniform([1000], seed=5), dtype), tf.float32).numpy()
    for dtype in ("bfloat16", "float16"):
        outside = tf.cast(keras.random.uniform([1000], dtype=dtype, seed=5), tf.float32)
        assert (outside.numpy() == rounded(dtype)).mean() < 0.1  # TensorFlow's own 16-bit draw
        with same_draws.same_draws():
            inside = keras.random.uniform([1000], dtype=dtype, seed=5)
        assert inside.dtype.name == dtype
        np.testing.assert_array_equal(tf.cast(inside, tf.float32).numpy(), rounded(dtype))


def _model(kind):
    inputs = keras.Input((12, 8))
    if kind == "dropout":
        h = keras.layers.Dense(64, activation="relu")(keras.layers.Flatten()(inputs))
        h = keras.layers.Dropout(0.4)(h)
    else:  # an LSTM's own input dropout, drawn on ones of the step input's dtype
        h = keras.layers.LSTM(16, dropout=0.3)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("traced", [True, False])
@pytest.mark.parametrize("kind", ["dropout", "lstm"])
def test_the_probe_reads_no_rounding_harm_from_dropout(kind, traced):
    # keras.io's timeseries Transformer: its Dense(128) before Dropout(0.4) read a
    # gradient error of 1.2-1.4 against float32 and was promoted (probe_error).
    keras_mp.set_global_policy("adaptive_bfloat16")
    try:
        model = _model(kind)
        policy = policies.policy_of(model)
        layers = policies.adaptive_layers(model, policy)
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(64, 12, 8)).astype("float32"))
        y = tf.constant(rng.normal(size=(64, 1)).astype("float32"))
        run = lambda: probe.probe(model, (x, y), policy, layers)  # noqa: E731
        result = tf.function(run)() if traced else run()
    finally:
        keras_mp.set_global_policy("float32")
    first = next(i for i, layer in enumerate(layers)
                 if isinstance(layer, (keras.layers.Dense, keras.layers.LSTMCell)))
    assert float(result.valid) == 1.0
    assert float(result.grad_error[first]) < 0.1, result
    assert float(result.cosine[first]) > 0.99, result
