"""Top-1 matches of logits against integer labels: Keras's sparse
categorical accuracy as one fused kernel.

KerasHub's causal language models compile with that metric by default, and
Keras computes it over the whole ``[batch, length, vocabulary]`` logits as
separate ops: a float32 copy of the logits, a scan for negative zeros
(bitcast, bitwise and, compare, select: Keras's fix for flush-to-zero), the
argmax, and the labels cast to the logits' dtype (in bfloat16 that rounds
ids above 256, so a wrong prediction can count as right). Here it is one XLA
kernel of two plain row reductions over the 16-bit logits, the maximum and
then the first index holding it (:func:`top1_matches`), comparing integer
ids exactly. Alone on GPT-2's ``[2048, 50257]`` logits on a 2-core AMD EPYC
with AVX512-BF16 (``python -m benchmarks.gpt2_parts``, 5 interleaved
rounds): 101.5 ms CPU against Keras's 169.5 on its float32 logits. In a
keras-mp train step beside the fused cross-entropy it costs no pass of its
own: the loss's forward kernel computes the matches
(:mod:`keras_mp.fused.shared_matches`).

Example:
    >>> import tensorflow as tf
    >>> from keras_mp.fused.ops import accuracy
    >>> logits = tf.constant([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]], tf.bfloat16)
    >>> accuracy.sparse_top1_matches(tf.constant([1, 2]), logits).numpy().tolist()
    [1.0, 0.0]
"""

from __future__ import annotations

import tensorflow as tf

from keras_mp.device import xla
from keras_mp.fused.ops._common import _check_labels, _fused_enabled

__all__ = ["sparse_top1_matches", "sparse_top1_matches_reference", "top1_matches"]


def top1_matches(z: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """1.0 where ``z``'s largest entry (the first, on ties) is at ``labels``.

    ``z`` is float32 (exact for 16-bit logits), ``labels`` int32. Written as
    two plain row reductions, the maximum and then the first index holding
    it, not as an argmax: XLA:CPU runs an argmax as a variadic (value,
    index) reduction, 143 ms CPU on GPT-2's ``[2048, 50257]`` logits against
    80-100 ms for this form. A NaN row matches nothing; so does a label
    outside ``[0, classes)``. The fused cross-entropy computes the same in
    its forward kernel (:func:`keras_mp.fused.ops.sparse_softmax_cross_entropy`
    with ``with_matches=True``).
    """
    classes = tf.shape(z)[-1]
    top = tf.reduce_max(z, -1, keepdims=True)
    first = tf.reduce_min(tf.where(tf.equal(z, top), tf.range(classes), classes), -1)
    return tf.cast(tf.equal(first, labels), tf.float32)


def _matches(labels, logits):
    return top1_matches(tf.cast(logits, tf.float32), tf.cast(labels, tf.int32))


_top1 = xla.jit("elementwise")(_matches)


def sparse_top1_matches(labels, logits) -> tf.Tensor:
    """1.0 where ``logits``'s largest entry (the first, on ties) is at
    ``labels``, else 0.0, in float32.

    Args:
        labels: integer class ids, shaped ``logits.shape[:-1]``.
        logits: float scores, classes on the last axis, read in their own
            dtype (no float32 copy).

    Returns:
        float32 matches shaped like ``labels``. Not differentiable (a metric).
    """
    logits, labels = tf.convert_to_tensor(logits), tf.convert_to_tensor(labels)
    _check(labels, logits)
    if not _fused_enabled():
        return sparse_top1_matches_reference(labels, logits)
    return _top1(labels, logits)


def sparse_top1_matches_reference(labels, logits) -> tf.Tensor:
    """The same with TensorFlow's argmax (over the logits in float32), as
    plain ops: what the fused form is checked against, and what runs where
    fused kernels are off. Rows holding a NaN may differ from the fused form.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp.fused.ops import accuracy
        >>> accuracy.sparse_top1_matches_reference(tf.constant([0]), tf.constant([[1.0, 0.0]])).numpy()
        array([1.], dtype=float32)
    """
    logits, labels = tf.convert_to_tensor(logits), tf.convert_to_tensor(labels)
    _check(labels, logits)
    predicted = tf.argmax(tf.cast(logits, tf.float32), -1, output_type=tf.int32)
    return tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32)


def _check(labels: tf.Tensor, logits: tf.Tensor) -> None:
    if not logits.dtype.is_floating:
        raise TypeError(f"`logits` must be floating, got dtype {logits.dtype.name}.")
    _check_labels(labels, logits)
