"""The fused loss's top-1 matches, handed to the accuracy metric of the same step.

A classifier's cross-entropy and its accuracy both read the whole logits:
the loss for the maximum and the sum of exponentials, the metric for the
maximum and where it is. On a language model that is two passes over the
model's largest tensor (GPT-2's ``[2048, 50257]`` logits per batch of 16 x
128 tokens). Inside :func:`sharing`, the fused loss
(:class:`keras_mp.fused.losses.SparseCategoricalCrossentropy`) asks its
forward kernel for the matches too (``with_matches=True`` in
:func:`keras_mp.fused.ops.sparse_softmax_cross_entropy`, one more row
reduction after the maximum it has) and leaves them here under its
``(y_true, y_pred)``; the fused accuracy
(:func:`keras_mp.fused.metrics.sparse_categorical_accuracy`) takes them when
Keras calls it with those same two tensors, as Keras's train step does
(``compute_loss`` and then ``compute_metrics`` on one ``y`` and ``y_pred``),
and computes its own otherwise. :mod:`keras_mp.execution` traces its train
steps inside :func:`sharing` where it fuses both a loss and an accuracy.

The matches are kept for one trace (the block) and matched by identity, so
a tensor of another step, graph or output is never taken for them.

Example:
    >>> import tensorflow as tf
    >>> from keras_mp.fused import shared_matches
    >>> y_true, y_pred = tf.constant([1]), tf.constant([[0.0, 2.0]])
    >>> with shared_matches.sharing():
    ...     shared_matches.put(y_true, y_pred, tf.constant([1.0]))
    ...     shared_matches.take(y_true, y_pred).numpy().tolist()
    [1.0]
    >>> shared_matches.active()
    False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import tensorflow as tf

__all__ = ["sharing", "active", "put", "take"]

_local = threading.local()


def _entries() -> list | None:
    return getattr(_local, "entries", None)


@contextlib.contextmanager
def sharing() -> Iterator[None]:
    """Inside the block (on this thread), the fused loss leaves its matches
    for the fused accuracy. Blocks nest; each keeps its own matches."""
    outer = _entries()
    _local.entries = []
    try:
        yield
    finally:
        _local.entries = outer


def active() -> bool:
    """Whether a :func:`sharing` block is open on this thread."""
    return _entries() is not None


def put(y_true, y_pred, matches: tf.Tensor) -> None:
    """Leaves ``matches`` (per example, float32) for ``(y_true, y_pred)``.

    Raises:
        RuntimeError: no :func:`sharing` block is open.
    """
    entries = _entries()
    if entries is None:
        raise RuntimeError("shared_matches.put() needs an open shared_matches.sharing() block.")
    entries.append((y_true, y_pred, matches))


def take(y_true, y_pred) -> tf.Tensor | None:
    """The matches left for these very ``y_true`` and ``y_pred`` objects in
    the open block, or None."""
    for t, p, matches in reversed(_entries() or []):
        if t is y_true and p is y_pred:
            return matches
    return None
