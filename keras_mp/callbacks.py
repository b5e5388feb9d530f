"""keras-mp's callbacks, where a Keras user looks for them (``keras.callbacks``).

:class:`AdaptivePrecision` applies the adaptive policy's decisions during
``fit``; it lives in :mod:`keras_mp.adaptive.fit.callback`.

Example:
    >>> from keras_mp.callbacks import AdaptivePrecision
    >>> AdaptivePrecision(interval=50).interval
    50
"""

from keras_mp.adaptive.fit.callback import AdaptivePrecision

__all__ = ["AdaptivePrecision"]
