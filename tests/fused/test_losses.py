"""keras_mp.fused.losses: Keras's sparse cross-entropy from logits as the fused
kernel, equal to Keras's, and swapped in only while a train step is traced."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_mp import execution
from keras_mp.fused import losses


def _logits(dtype="bfloat16"):
    rng = np.random.default_rng(0)
    return tf.cast(rng.normal(size=(4, 5, 11)) * 3, dtype), rng.integers(0, 11, (4, 5))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equals_keras_loss_and_gradient(dtype):
    logits, labels = _logits(dtype)
    weights = np.linspace(0.5, 1.5, 20).reshape(4, 5).astype("float32")
    ours = losses.SparseCategoricalCrossentropy(from_logits=True)
    theirs = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert ours.fused and ours.get_config() == theirs.get_config()
    for loss in (ours, theirs):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            value = loss(labels, logits, sample_weight=weights)
        loss.value, loss.grad = value, tape.gradient(value, logits)
    assert ours.value.dtype == tf.float32
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(ours.value, theirs.value, rtol=tol)
    np.testing.assert_allclose(tf.cast(ours.grad, tf.float32), tf.cast(theirs.grad, tf.float32),
                               atol=tol)
    # Labels shaped [..., 1] and float labels, as Keras accepts them.
    np.testing.assert_allclose(ours(labels[..., None].astype("float32"), logits),
                               theirs(labels, logits), rtol=tol)
    assert not losses.SparseCategoricalCrossentropy().fused  # probabilities: Keras's code


def test_configured_model_traces_the_fused_loss_and_keeps_keras_loss():
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(11)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="sgd", loss=loss)
    assert losses.fusable_losses(model) == [loss]
    execution.configure(model, mode="graph")
    x = np.random.default_rng(1).normal(size=(8, 5, 3)).astype("float32")
    y = np.random.default_rng(2).integers(0, 11, (8, 5))
    expected = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert history.history["loss"][0] == pytest.approx(float(expected), rel=1e-5)
    assert type(model.loss) is keras.losses.SparseCategoricalCrossentropy  # saved as Keras's
    assert "keras_mp" not in str(model.get_compile_config())
    with pytest.raises(TypeError, match="`losses`"):
        with losses.fusing(["x"]):
            pass
