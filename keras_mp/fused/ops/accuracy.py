"""Top-1 matches of logits against integer labels in one pass: Keras's
sparse categorical accuracy.

KerasHub's causal language models compile with that metric by default, and
Keras computes it over the whole ``[batch, length, vocabulary]`` logits as
separate ops: a float32 copy of the logits, a scan for negative zeros
(bitcast, bitwise and, compare, select: Keras's fix for flush-to-zero), the
argmax, and the labels cast to the logits' dtype. Measured on a 2-core AMD
EPYC with AVX512-BF16 (KerasHub ``GPT2CausalLM``, 4 blocks, d=256, batch 16 x
128 tokens, 50257 tokens, median train step by process CPU time): the
metric cost Keras ``mixed_bfloat16`` 149 ms of its 1490 ms step and
keras-mp 228 ms of 1369 ms. Here it is one XLA kernel reading the 16-bit
logits once and comparing integer ids exactly; alone, on GPT-2's bfloat16
``[2048, 50257]`` logits (``python -m benchmarks.gpt2_parts``, 5 interleaved
rounds): 134 ms CPU against Keras's 168.5 (Keras casts the labels to the
logits' dtype, so in bfloat16 ids above 256 are rounded before the
comparison).

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

__all__ = ["sparse_top1_matches", "sparse_top1_matches_reference"]


def _matches(labels, logits):
    # Compared in float32 (exact for 16-bit values): XLA:CPU's argmax over
    # bfloat16 took 382 ms CPU for GPT-2's logits, 2.4x Keras's whole metric.
    predicted = tf.argmax(tf.cast(logits, tf.float32), -1, output_type=tf.int32)
    return tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32)


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
    """The same as TensorFlow ops (the argmax over the logits as they are).

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp.fused.ops import accuracy
        >>> accuracy.sparse_top1_matches_reference(tf.constant([0]), tf.constant([[1.0, 0.0]])).numpy()
        array([1.], dtype=float32)
    """
    logits, labels = tf.convert_to_tensor(logits), tf.convert_to_tensor(labels)
    _check(labels, logits)
    return _matches(labels, logits)


def _check(labels: tf.Tensor, logits: tf.Tensor) -> None:
    if not logits.dtype.is_floating:
        raise TypeError(f"`logits` must be floating, got dtype {logits.dtype.name}.")
    _check_labels(labels, logits)
