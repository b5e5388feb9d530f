"""Fused kernels for the work around the matmuls, and the layers that use them.

* :mod:`keras_mp.fused.ops`: each fused op (bias + activation, Dense,
  attention, normalization, masked softmax, cross-entropy) beside its plain
  ``keras.ops`` reference, one module per op family.
* :mod:`keras_mp.fused.layers`: drop-in Keras layers built on them.
* :mod:`keras_mp.fused.fuse`: :func:`fuse`, a model with its layers
  replaced by the fused ones (a copy, or in place).
* :mod:`keras_mp.fused.losses`: Keras's sparse cross-entropy from logits as
  one fused kernel (a language model's softmax over its vocabulary).

Where each kind of work runs (XLA or TensorFlow) is
:mod:`keras_mp.device.xla`'s decision.

Example:
    >>> import keras
    >>> from keras_mp import fused
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="gelu")])
    >>> type(fused.fuse(model).layers[0]) is fused.layers.Dense
    True
"""

from keras_mp.fused import layers, losses, ops
from keras_mp.fused.fuse import fuse

__all__ = ["fuse", "layers", "losses", "ops"]
