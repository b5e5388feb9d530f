"""The names Keras's and tf.keras's loss-scale optimizers give what
:class:`keras_mp.LossScaleOptimizer` holds under its own names, so that code
written for either runs unchanged: ``dynamic_scale`` and ``step_counter``
(Keras 3), ``get_scaled_loss`` and ``get_unscaled_gradients`` (tf.keras).

Example:
    >>> import keras, keras_mp, tensorflow as tf
    >>> opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), schedule=4.0)
    >>> float(opt.get_scaled_loss(tf.constant(2.0)))
    8.0
    >>> [float(g) for g in opt.get_unscaled_gradients([tf.constant(8.0)])]
    [2.0]
"""

from __future__ import annotations

from keras_mp.scaling import kernels

__all__ = ["KerasNamesMixin"]


class KerasNamesMixin:
    """Keras's and tf.keras's names on :class:`keras_mp.LossScaleOptimizer`
    (which provides ``_state_variables``, ``scale_loss`` and ``loss_scale``)."""

    @property
    def dynamic_scale(self):
        """Keras's name for the loss-scale variable."""
        return self._state_variables.get("loss_scale")

    @property
    def step_counter(self):
        """Keras's name for the finite-steps-since-growth counter."""
        return self._state_variables.get("good_steps")

    def get_scaled_loss(self, loss):
        """:meth:`scale_loss`, for code migrating from ``tf.keras``: as there,
        a callable ``loss`` gives a callable that returns the scaled loss."""
        if callable(loss):
            return lambda: self.scale_loss(loss())
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        """Divides ``grads`` by the current loss scale (None stays None), for
        code migrating from ``tf.keras``. :meth:`apply` unscales by itself; call
        this only to inspect or clip gradients yourself."""
        return kernels.unscale_and_check(list(grads), self.loss_scale)[0]
