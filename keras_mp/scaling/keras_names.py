"""What makes :class:`keras_mp.LossScaleOptimizer` a drop-in for Keras's and
tf.keras's loss-scale optimizers: their constructor arguments
(``initial_scale``, ``dynamic_growth_steps``) turned into a schedule, and their
names for what it holds under its own (``dynamic_scale`` and ``step_counter``
of Keras 3, ``get_scaled_loss`` and ``get_unscaled_gradients`` of tf.keras), so
that code written for either runs unchanged.

Example:
    >>> import keras, keras_mp, tensorflow as tf
    >>> opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), schedule=4.0)
    >>> float(opt.get_scaled_loss(tf.constant(2.0)))
    8.0
    >>> [float(g) for g in opt.get_unscaled_gradients([tf.constant(8.0)])]
    [2.0]
"""

from __future__ import annotations

from keras_mp import _checks as checks
from keras_mp.scaling import kernels
from keras_mp.scaling import loss_scale as loss_scale_lib

__all__ = ["DEFAULT_GROWTH_STEPS", "DEFAULT_INITIAL_SCALE", "KerasNamesMixin", "growth_steps_of",
           "legacy_schedule", "whole_steps"]

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000


def whole_steps(value) -> int:
    """A step count: an int >= 1, or a float holding one (``3.0``), as Keras accepts."""
    if not checks.is_number(value) or not float(value).is_integer() or value < 1:
        raise ValueError("`dynamic_growth_steps` must be a whole number >= 1 (an int, or a "
                         f"float such as 3.0), got {value!r}.")
    return int(value)


def growth_steps_of(schedule: loss_scale_lib.LossScaleSchedule) -> int | None:
    """What ``dynamic_growth_steps`` reports: the schedule's fixed growth
    interval, None when it has none (a fixed scale, as tf.keras reported)."""
    interval = getattr(schedule, "growth_interval", None)
    if not schedule.is_dynamic or isinstance(interval, bool) or not isinstance(interval, int):
        return None
    return interval


def legacy_schedule(initial_scale, dynamic_growth_steps) -> loss_scale_lib.DynamicLossScale:
    """The dynamic schedule Keras's ``initial_scale`` and ``dynamic_growth_steps`` describe."""
    initial_scale = checks.positive("initial_scale", initial_scale)
    dynamic_growth_steps = whole_steps(dynamic_growth_steps)
    # Keras has no bounds; ours must contain the scale the user asked for.
    return loss_scale_lib.DynamicLossScale(
        initial_scale=initial_scale,
        growth_interval=dynamic_growth_steps,
        min_scale=min(1.0, initial_scale),
        max_scale=max(2.0**24, initial_scale),
        recovery_interval=None,   # Keras's semantics
    )


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

    @property
    def _model_variables_moving_average(self):
        """The inner optimizer's moving averages (``use_ema=True``), where
        Keras reads them on ``model.optimizer``: ``keras.callbacks.SwapEMAWeights``
        and Keras's own tests. An inner optimizer without EMA has none
        (AttributeError, as on a Keras optimizer without it)."""
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or not hasattr(inner, "_model_variables_moving_average"):
            raise AttributeError("_model_variables_moving_average: the inner optimizer keeps "
                                 "no moving average (use_ema=False)")
        return inner._model_variables_moving_average

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
