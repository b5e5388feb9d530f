"""Sparse softmax cross-entropy from logits, float32 inside."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _check_labels, _float, _fused_enabled

__all__ = ["sparse_softmax_cross_entropy", "sparse_softmax_cross_entropy_reference"]




def _ce_parts(labels, logits):
    z = _float(logits)
    classes = tf.shape(z)[-1]
    labels = tf.cast(labels, tf.int32)
    valid = (labels >= 0) & (labels < classes)
    onehot = tf.one_hot(labels, classes, dtype=tf.float32)
    return z, onehot, valid


@xla.jit("elementwise")
def _ce_fwd(labels, logits):
    z, onehot, valid = _ce_parts(labels, logits)
    # A select, not z * onehot: a -inf logit of another class (a masked
    # vocabulary entry) times 0 would make the loss nan.
    picked = tf.reduce_sum(tf.where(onehot > 0.0, z, 0.0), -1)
    loss = tf.reduce_logsumexp(z, -1) - picked
    # An out-of-range label is a bug in the data; NaN makes it visible (and
    # trips the loss scaler's finite check) instead of a plausible loss.
    return tf.where(valid, loss, float("nan"))  # float32: the caller casts


@xla.jit("elementwise")
def _ce_bwd(dloss, labels, logits):
    z, onehot, valid = _ce_parts(labels, logits)
    g = (tf.nn.softmax(z, -1) - onehot) * _float(dloss)[..., None]
    g = tf.where(valid[..., None], g, float("nan"))
    return tf.cast(g, logits.dtype)


def sparse_softmax_cross_entropy(labels, logits, *, dtype=None) -> tf.Tensor:
    """Per-example ``-log softmax(logits)[label]``, in float32 inside.

    Args:
        labels: integer class ids, shaped ``logits.shape[:-1]``. A label
            outside ``[0, classes)`` gives a NaN loss (and NaN gradient).
        logits: float logits, classes on the last axis. 16-bit logits are
            read as they are: no float32 copy of them is made.
        dtype: the loss's dtype (e.g. ``"float32"`` for 16-bit logits);
            None: ``logits``'s dtype.

    Returns:
        The loss per example, shaped like ``labels``, in ``dtype``.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp.fused import ops as kops
        >>> l = kops.sparse_softmax_cross_entropy(tf.constant([0]), tf.constant([[0.0, 0.0]]))
        >>> round(float(l[0]), 4)
        0.6931
    """
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    _check_labels(labels, logits)
    dtype = tf.as_dtype(dtype or logits.dtype)
    if not dtype.is_floating:
        raise ValueError(f"`dtype` must be a floating dtype or None, got {dtype.name}.")
    if not _fused_enabled():
        return tf.cast(sparse_softmax_cross_entropy_reference(labels, logits), dtype)

    @tf.custom_gradient
    def fused(logits):
        def grad(dloss):
            return _ce_bwd(dloss, labels, logits)

        return _ce_fwd(labels, logits), grad

    return tf.cast(fused(logits), dtype)


def sparse_softmax_cross_entropy_reference(labels, logits) -> tf.Tensor:
    """``keras.ops.sparse_categorical_crossentropy(..., from_logits=True)``.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp.fused import ops as kops
        >>> l = kops.sparse_softmax_cross_entropy_reference(tf.constant([0]), tf.constant([[0.0, 0.0]]))
        >>> round(float(l[0]), 4)
        0.6931
    """
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    _check_labels(labels, logits)
    return ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)
