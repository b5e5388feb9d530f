"""Sparse softmax cross-entropy from logits, float32 inside, one kernel each way.

A language model's logits are its largest tensor (GPT-2's ``[2048, 50257]``
per batch of 16 x 128 tokens), so the kernels are written to pass over them
as few times as they can: the forward reads them for the maximum and the sum
of exponentials (the log-sum-exp, kept for the backward) and picks each
label's logit with a gather; the backward reads them once more, for
``exp(z - lse) - onehot``. With ``with_matches=True`` the forward also says
whether each row's top logit is at its label (the top-1 accuracy) from the
maximum it already has, so the model's accuracy metric needs no pass of its
own (:mod:`keras_mp.fused.shared_matches`). Measured on a 2-core AMD EPYC
with AVX512-BF16: in a GPT-2 train step (TF profiler) the forward kernel
took 100 ms and the backward 68 ms when the forward selected the label's
logit over every class and the backward recomputed the softmax; alone on
``[2048, 50257]`` bfloat16 logits, forward and backward, 7 interleaved
rounds: 166.8 ms CPU now against 271.5 then, 215.4 with the matches.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _check_labels, _float, _fused_enabled
from keras_mp.fused.ops.accuracy import sparse_top1_matches_reference, top1_matches

__all__ = ["sparse_softmax_cross_entropy", "sparse_softmax_cross_entropy_reference"]


def _ce_parts(labels, logits):
    z = _float(logits)
    labels = tf.cast(labels, tf.int32)
    valid = (labels >= 0) & (labels < tf.shape(z)[-1])
    return z, labels, valid


def _picked(z, labels, valid):
    """``z[..., label]`` as a gather (a select over every class is a pass over the logits)."""
    classes = tf.shape(z)[-1]
    rows = tf.reshape(z, [-1, classes])
    index = tf.reshape(tf.where(valid, labels, 0), [-1, 1])
    return tf.reshape(tf.gather(rows, index, batch_dims=1), tf.shape(labels))


@xla.jit("elementwise")
def _ce_fwd(labels, logits, with_matches):
    z, labels, valid = _ce_parts(labels, logits)
    lse = tf.reduce_logsumexp(z, -1)
    # An out-of-range label is a bug in the data; NaN makes it visible (and
    # trips the loss scaler's finite check) instead of a plausible loss.
    loss = tf.where(valid, lse - _picked(z, labels, valid), float("nan"))  # float32
    matches = top1_matches(z, labels) if with_matches else tf.zeros([0])
    return loss, lse, matches


@xla.jit("elementwise")
def _ce_bwd(dloss, labels, logits, lse):
    z, labels, valid = _ce_parts(labels, logits)
    onehot = tf.one_hot(labels, tf.shape(z)[-1], dtype=tf.float32)
    g = (tf.exp(z - lse[..., None]) - onehot) * _float(dloss)[..., None]
    g = tf.where(valid[..., None], g, float("nan"))
    return tf.cast(g, logits.dtype)


def sparse_softmax_cross_entropy(labels, logits, *, dtype=None, with_matches: bool = False):
    """Per-example ``-log softmax(logits)[label]``, in float32 inside.

    Args:
        labels: integer class ids, shaped ``logits.shape[:-1]``. A label
            outside ``[0, classes)`` gives a NaN loss (and NaN gradient).
        logits: float logits, classes on the last axis. 16-bit logits are
            read as they are: no float32 copy of them is made.
        dtype: the loss's dtype (e.g. ``"float32"`` for 16-bit logits);
            None: ``logits``'s dtype.
        with_matches: also return the top-1 matches
            (:func:`keras_mp.fused.ops.sparse_top1_matches`), from the same
            forward kernel.

    Returns:
        The loss per example, shaped like ``labels``, in ``dtype``; with
        ``with_matches``, ``(loss, matches)``, the matches in float32 and
        not differentiable.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp.fused import ops as kops
        >>> l = kops.sparse_softmax_cross_entropy(tf.constant([0]), tf.constant([[0.0, 0.0]]))
        >>> round(float(l[0]), 4)
        0.6931
        >>> l, m = kops.sparse_softmax_cross_entropy(tf.constant([1]), tf.constant([[0.0, 2.0]]),
        ...                                          with_matches=True)
        >>> m.numpy().tolist()
        [1.0]
    """
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    _check_labels(labels, logits)
    dtype = tf.as_dtype(dtype or logits.dtype)
    if not dtype.is_floating:
        raise ValueError(f"`dtype` must be a floating dtype or None, got {dtype.name}.")
    if not isinstance(with_matches, bool):
        raise TypeError(f"`with_matches` must be True or False, got {with_matches!r}.")
    if not _fused_enabled():
        loss = tf.cast(sparse_softmax_cross_entropy_reference(labels, logits), dtype)
        if not with_matches:
            return loss
        return loss, sparse_top1_matches_reference(labels, logits)
    found = {}

    @tf.custom_gradient
    def fused(logits):
        loss, lse, found["matches"] = _ce_fwd(labels, logits, with_matches)

        def grad(dloss):
            return _ce_bwd(dloss, labels, logits, lse)

        return loss, grad

    loss = tf.cast(fused(logits), dtype)
    return (loss, tf.stop_gradient(found["matches"])) if with_matches else loss


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
