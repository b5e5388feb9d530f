"""Loss scaling: schedules, the optimizer wrapper, the multi-tensor kernels.

* :mod:`keras_mp.scaling.loss_scale`: schedules as pure state transitions
  (state in, finite flag in, state out): :class:`DynamicLossScale`,
  :class:`FixedLossScale`, :class:`PiecewiseInterval` growth intervals.
* :mod:`keras_mp.scaling.optimizer`: :class:`LossScaleOptimizer`, a drop-in
  for Keras's, whose schedule state lives in optimizer variables and whose
  skip is agreed across replicas.
* :mod:`keras_mp.scaling.kernels`: one computation over a whole gradient
  list: unscale, finite flags and per-tensor statistics.
* :mod:`keras_mp.scaling.skips`: :class:`TooManySkipsError`, the stop of a
  run past ``max_consecutive_skips``.

Example:
    >>> import keras
    >>> from keras_mp import scaling
    >>> opt = scaling.LossScaleOptimizer(keras.optimizers.SGD(),
    ...                                  schedule=scaling.DynamicLossScale(growth_interval=100))
    >>> opt.schedule.growth_interval
    100
"""

from keras_mp.scaling import kernels, loss_scale, optimizer, skips
from keras_mp.scaling.loss_scale import (DynamicLossScale, FixedLossScale, LossScaleSchedule,
                                         PiecewiseInterval)
from keras_mp.scaling.optimizer import LossScaleOptimizer
from keras_mp.scaling.skips import TooManySkipsError

__all__ = ["DynamicLossScale", "FixedLossScale", "LossScaleOptimizer", "LossScaleSchedule",
           "PiecewiseInterval", "TooManySkipsError", "kernels", "loss_scale", "optimizer", "skips"]
