"""keras-mp: mixed-precision training for Keras 3 on TensorFlow."""

from keras_mp import _backend  # noqa: F401  (selects/validates the backend first)
from keras_mp import kernels, loss_scale, xla
from keras_mp.loss_scale import DynamicLossScale, FixedLossScale, LossScaleSchedule
from keras_mp.optimizer import LossScaleOptimizer
from keras_mp.xla import set_xla, uses_xla

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "LossScaleSchedule",
    "kernels",
    "loss_scale",
    "set_xla",
    "uses_xla",
    "xla",
]
