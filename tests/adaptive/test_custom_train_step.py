"""A model with its own ``train_step`` (``tf.GradientTape``, keras.io's
style) under an adaptive policy whose optimizer keras-mp wraps for loss
scaling (float16 a candidate).

What a user must do for loss scaling there: differentiate
``self.optimizer.scale_loss(loss)``, as Keras's own ``train_step`` does;
``apply`` unscales. A ``train_step`` that does not gets its gradients applied
as they are, without loss scaling, and a warning saying what to add
(keras_mp.scaling.scaled_loss); under Keras's ``mixed_float16`` the same
step divides the unscaled gradients by the loss scale (2**15).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest

import keras_mp
from tests.real_models import keras_io

_X = np.random.default_rng(0).normal(size=(32, 16)).astype("float32")
_Y = _X[:, :4].argmax(-1).astype("int32")


def _update(policy: str, scale_loss: bool, set_policy=keras_mp.set_global_policy):
    """The first kernel's change over one SGD step of fit, the optimizer
    fit ended with, and the warnings the fit raised."""
    set_policy(policy)
    model = keras_io.custom_step_classifier(16, 4, scale_loss=scale_loss)
    set_policy("float32")
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = np.array(model.layers[1].kernel)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(_X, _Y, batch_size=32, epochs=1, verbose=0)
    delta = np.array(model.layers[1].kernel) - before
    return delta, model.optimizer, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def float32_update():
    keras.utils.set_random_seed(0)
    return _update("float32", True)[0]


def _ratio(delta, reference) -> float:
    return float(np.linalg.norm(delta) / np.linalg.norm(reference))


@pytest.mark.parametrize("scale_loss", [True, False])
def test_custom_train_step_updates_as_in_float32(float32_update, scale_loss, adapt_every_fit):
    delta, optimizer, caught = _update("adaptive_float16", scale_loss)
    assert isinstance(optimizer, keras_mp.LossScaleOptimizer), type(optimizer)
    assert float(optimizer.loss_scale) > 1
    # The same step as float32's, within float16's rounding: unscaled once
    # when the loss was scaled, not divided by the scale when it was not.
    assert 0.9 < _ratio(delta, float32_update) < 1.1, _ratio(delta, float32_update)
    said = [m for m in caught if "scale_loss" in m]
    if scale_loss:
        assert not said, said
    else:
        assert len(said) == 1 and "differentiate `self.optimizer.scale_loss(loss)`" in said[0], \
            caught


def test_keras_mixed_float16_shrinks_an_unscaled_step(float32_update):
    """The control: Keras's own loss-scale optimizer divides the gradients
    of an unscaled loss by its scale, 2**15."""
    delta, optimizer, _ = _update("mixed_float16", False,
                                  keras.mixed_precision.set_global_policy)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer), type(optimizer)
    np.testing.assert_allclose(_ratio(delta, float32_update), 2.0**-15, rtol=0.1)
