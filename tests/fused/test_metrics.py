"""keras_mp.fused.metrics and keras_mp.fused.ops.accuracy: Keras's sparse
categorical accuracy as one fused kernel, equal to Keras's (exact where
Keras rounds class ids to bfloat16), swapped in only while a train step is
traced."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp import execution
from keras_mp.device import xla
from keras_mp.fused import metrics, shared_matches
from keras_mp.fused.ops import accuracy


@pytest.fixture
def fused_on():
    xla.set_xla("elementwise", True)
    yield
    xla.set_xla("elementwise", None)


def _logits(classes, dtype, shape=(4, 5)):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(*shape, classes)) * 3
    return tf.cast(logits, dtype), rng.integers(0, classes, shape), logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equals_keras_accuracy(fused_on, dtype):
    logits, labels, _ = _logits(11, dtype)
    # Some rows right: the labels of the first 10 are the argmax.
    labels = labels.copy()
    labels.reshape(-1)[:10] = np.argmax(np.asarray(tf.cast(logits, tf.float32)), -1).reshape(-1)[:10]
    theirs = keras.metrics.sparse_categorical_accuracy(labels, logits)
    ours = metrics.sparse_categorical_accuracy(labels, logits)
    assert ours.dtype.name == keras.backend.floatx() and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)
    assert 0.0 < float(tf.reduce_mean(ours)) < 1.0
    # Labels shaped [..., 1], and class ids given as floats, as Keras accepts them.
    for y in (labels[..., None], labels.astype("float32"), labels[..., None].astype("float32")):
        np.testing.assert_array_equal(metrics.sparse_categorical_accuracy(y, logits),
                                      keras.metrics.sparse_categorical_accuracy(y, logits))
    # A 2-D [rows, 1] label column against [rows, classes] logits.
    flat, col = tf.reshape(logits, (20, 11)), labels.reshape(20, 1)
    np.testing.assert_array_equal(metrics.sparse_categorical_accuracy(col, flat),
                                  keras.metrics.sparse_categorical_accuracy(col, flat))


def test_large_vocabulary_ids_are_compared_exactly(fused_on):
    """Keras casts the labels to the logits' dtype: in bfloat16 ids above 256
    round (50001 and 50003 both become 49920 or 50176), so a wrong prediction
    can count as right. The fused kernel compares the integer ids."""
    logits, labels, raw = _logits(50257, "bfloat16", shape=(2, 3))
    truth = (np.argmax(np.asarray(tf.cast(logits, tf.float32)), -1) == labels).astype("float32")
    np.testing.assert_array_equal(metrics.sparse_categorical_accuracy(labels, logits), truth)
    near = np.argmax(np.asarray(tf.cast(logits, tf.float32)), -1) + 1   # off by one id, wrong
    near = np.minimum(near, 50256)
    assert float(tf.reduce_sum(metrics.sparse_categorical_accuracy(near, logits))) == 0.0
    assert float(tf.reduce_sum(keras.metrics.sparse_categorical_accuracy(near, logits))) > 0.0


def test_reference_and_bad_arguments():
    logits, labels, _ = _logits(7, "float32")
    np.testing.assert_array_equal(accuracy.sparse_top1_matches(labels, logits),
                                  accuracy.sparse_top1_matches_reference(labels, logits))
    with pytest.raises(TypeError, match="`labels`"):
        accuracy.sparse_top1_matches(tf.constant([[0.0]]), tf.constant([[[1.0]]]))
    with pytest.raises(ValueError, match="`labels` must have shape"):
        accuracy.sparse_top1_matches(tf.constant([0, 1]), tf.constant([[[1.0, 0.0]]]))
    with pytest.raises(TypeError, match="`logits`"):
        accuracy.sparse_top1_matches(tf.constant([0]), tf.constant([[1, 0]]))
    with pytest.raises(TypeError, match="`model`"):
        metrics.fusable_metrics("model")
    with pytest.raises(TypeError, match="`metrics`"):
        with metrics.fusing([keras.metrics.Mean()]):
            pass


def _spies(monkeypatch):
    """Records the accuracy kernel's traces and what the metric took from the loss."""
    traced, taken = [], []
    kernel, take = accuracy._top1, shared_matches.take
    monkeypatch.setattr(accuracy, "_top1", lambda *a: traced.append(1) or kernel(*a))
    monkeypatch.setattr(shared_matches, "take",
                        lambda t, p: taken.append(take(t, p)) or taken[-1])
    return traced, taken


def _classifier_data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(64, 5, 3)).astype("float32"), rng.integers(0, 11, (64, 5))


def test_configured_model_traces_the_fused_metric_and_keeps_keras_metric(fused_on,
                                                                          monkeypatch):
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(11)])
    metric = keras.metrics.SparseCategoricalAccuracy()
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[metric], weighted_metrics=["sparse_categorical_accuracy"])
    assert metrics.fusable_metrics(model) == [metric]   # the name is built on the first step
    traced, taken = _spies(monkeypatch)
    execution.configure(model, mode="graph")
    x, y = _classifier_data()
    expected = np.mean(np.argmax(np.asarray(model(x)), -1) == y)   # before the update
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    # The step was traced with the fused metric, which took its matches from
    # the fused loss's forward kernel: no accuracy kernel of its own.
    assert taken and all(m is not None for m in taken) and not traced
    assert history.history["sparse_categorical_accuracy"][0] == pytest.approx(expected)
    # The metric is Keras's again, and so is what is saved.
    assert metric._fn is keras.metrics.sparse_categorical_accuracy
    assert "keras_mp" not in str(model.get_compile_config())
    assert not shared_matches.active()
    built = metrics.fusable_metrics(model)
    assert metric in built and len(built) == 2   # the named one, now built
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    assert 0.0 <= history.history["sparse_categorical_accuracy"][0] <= 1.0


def test_fused_metric_beside_an_unfused_loss_runs_its_own_kernel(fused_on, monkeypatch):
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(11, activation="softmax")])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    traced, taken = _spies(monkeypatch)
    execution.configure(model, mode="graph")
    x, y = _classifier_data()
    expected = np.mean(np.argmax(np.asarray(model(x)), -1) == y)
    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
    assert traced and all(m is None for m in taken)
    assert history.history["sparse_categorical_accuracy"][0] == pytest.approx(expected)


def test_shared_matches_are_kept_per_block_and_matched_by_identity():
    y_true, y_pred, m = tf.constant([1]), tf.constant([[0.0, 2.0]]), tf.constant([1.0])
    with pytest.raises(RuntimeError, match="sharing"):
        shared_matches.put(y_true, y_pred, m)
    assert shared_matches.take(y_true, y_pred) is None
    with shared_matches.sharing():
        shared_matches.put(y_true, y_pred, m)
        assert shared_matches.take(y_true, y_pred) is m
        assert shared_matches.take(tf.constant([1]), y_pred) is None   # an equal, other tensor
        with shared_matches.sharing():
            assert shared_matches.take(y_true, y_pred) is None
        assert shared_matches.take(y_true, y_pred) is m
    assert not shared_matches.active()
