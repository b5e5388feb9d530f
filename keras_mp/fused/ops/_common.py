"""What every fused op shares: float32 math inside, the on/off switch from
:mod:`keras_mp.device.xla`, the bias-gradient reduction and argument checks."""

from __future__ import annotations

import tensorflow as tf

from keras_mp.device import xla


def _float(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(x, tf.float32)


def _fused_enabled() -> bool:
    return xla.uses_xla("elementwise")


def _column_sum(t: tf.Tensor) -> tf.Tensor:
    """Sums a float32 tensor over every axis but the last (a bias gradient).

    Written as ``ones @ t`` because XLA:CPU emits a column reduction as a
    strided scalar loop (~40 ms for 32x128x2048 floats, 10x the elementwise
    work around it), while a dot goes to its vectorised GEMV. On GPU both
    are fast.
    """
    rows = tf.reshape(t, [-1, tf.shape(t)[-1]])
    ones = tf.ones([1, tf.shape(rows)[0]], t.dtype)
    return tf.reshape(tf.matmul(ones, rows), [-1])


def _check_vector(name: str, v: tf.Tensor, x: tf.Tensor) -> None:
    if v.shape.rank != 1 or (x.shape[-1] is not None and v.shape[0] != x.shape[-1]):
        raise ValueError(
            f"`{name}` must be a vector of length x.shape[-1]={x.shape[-1]}, "
            f"got shape {v.shape}.")


def _check_labels(labels: tf.Tensor, logits: tf.Tensor) -> None:
    """Integer class ids shaped like ``logits`` without its class axis."""
    if not labels.dtype.is_integer:
        raise TypeError(f"`labels` must be integer class ids, got dtype {labels.dtype.name}.")
    if (labels.shape.rank is not None and logits.shape.rank is not None
            and not labels.shape.is_compatible_with(logits.shape[:-1])):
        raise ValueError(
            f"`labels` must have shape logits.shape[:-1]={logits.shape[:-1]}, "
            f"got {labels.shape}.")
