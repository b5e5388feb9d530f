"""Keras's sparse categorical accuracy as one fused kernel, swapped in while a
train step is traced.

KerasHub's causal language models compile with
``keras.metrics.SparseCategoricalAccuracy`` by default, which Keras computes
over the whole logits tensor as a chain of separate ops
(:mod:`keras_mp.fused.ops.accuracy` has the figures).
:func:`sparse_categorical_accuracy` is Keras's function with
:func:`keras_mp.fused.ops.sparse_top1_matches` where it applies (integer or
integral labels, logits with classes on the last axis), or, beside the fused
loss in the same step, with the matches the loss's forward kernel computed
(:mod:`keras_mp.fused.shared_matches`);
:func:`fusing` gives the model's accuracy metrics that function while a step
is traced, as :func:`keras_mp.fused.losses.fusing` does for the loss
(:mod:`keras_mp.execution` does both, for the models it configures), so the
metric objects, their configs and saved models are Keras's. A metric given
as an object (KerasHub's default) is fused from the first step; one named by
a string (``"accuracy"``) is built by Keras inside the first traced step, so
it is fused from the next train function keras-mp builds (after a precision
change) on. On a small classifier (64-128-10 MLP, batch 128, same machine)
the fused metric cost nothing measurable: 1.68 against 1.70 ms CPU per step
(7 interleaved rounds of a 50-step epoch).

Example:
    >>> import numpy as np
    >>> from keras_mp.fused.metrics import sparse_categorical_accuracy
    >>> sparse_categorical_accuracy(np.array([1, 2]), np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]],
    ...                                                        "float32")).numpy().tolist()
    [1.0, 0.0]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import tensorflow as tf
from keras.src.metrics import accuracy_metrics

from keras_mp.fused import shared_matches
from keras_mp.fused.ops import accuracy

__all__ = ["sparse_categorical_accuracy", "fusable_metrics", "fusing"]

_KERAS_FN = accuracy_metrics.sparse_categorical_accuracy


def sparse_categorical_accuracy(y_true, y_pred) -> tf.Tensor:
    """``keras.metrics.sparse_categorical_accuracy`` with the fused kernel
    where it applies (Keras's own code otherwise): matches in Keras's
    ``floatx``, shaped as Keras shapes them."""
    shared = shared_matches.take(y_true, y_pred)
    y_pred, y_true = tf.convert_to_tensor(y_pred), tf.convert_to_tensor(y_true)
    if (not y_pred.dtype.is_floating or y_pred.shape.rank is None
            or y_true.shape.rank is None):
        return _KERAS_FN(y_true, y_pred)
    shape, squeeze = tf.shape(y_true), False
    labels = y_true
    if labels.shape.rank == y_pred.shape.rank and labels.shape[-1] == 1:
        labels, squeeze = tf.squeeze(labels, -1), True
    if labels.shape.rank != y_pred.shape.rank - 1:
        return _KERAS_FN(y_true, y_pred)
    if not labels.dtype.is_integer:
        labels = tf.cast(labels, tf.int32)  # class ids given as floats
    matches = shared   # the fused loss's matches of the same step, if it left them
    if matches is None:
        matches = accuracy.sparse_top1_matches(labels, y_pred)
    matches = tf.cast(matches, keras.backend.floatx())
    if squeeze:
        matches = tf.reshape(matches, shape)
    if matches.shape.rank is not None and matches.shape.rank > 1 and matches.shape[-1] == 1:
        matches = tf.squeeze(matches, -1)
    return matches


def fusable_metrics(model: keras.Model) -> list[keras.metrics.Metric]:
    """The metrics ``model`` was compiled with that compute Keras's
    ``sparse_categorical_accuracy`` (``SparseCategoricalAccuracy`` and the
    ``"sparse_categorical_accuracy"`` name once built)."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return []
    found: dict[int, keras.metrics.Metric] = {}

    def visit(items) -> None:
        for m in keras.tree.flatten(items or []):
            if not isinstance(m, keras.metrics.Metric):
                continue
            if getattr(m, "_fn", None) is _KERAS_FN:
                found[id(m)] = m
            inner = getattr(m, "metrics", None)   # Keras's per-output MetricsList
            if isinstance(inner, (list, tuple)):
                visit(list(inner))

    for name in ("_flat_metrics", "_flat_weighted_metrics", "_user_metrics",
                 "_user_weighted_metrics"):
        visit(getattr(compiled, name, None))
    return list(found.values())


@contextlib.contextmanager
def fusing(metrics: list[keras.metrics.Metric]) -> Iterator[None]:
    """Inside the block, ``metrics`` (from :func:`fusable_metrics`) compute with
    :func:`sparse_categorical_accuracy`; after it, with Keras's function again
    (what a step traced inside keeps is the fused kernel)."""
    for m in metrics:
        if getattr(m, "_fn", None) is not _KERAS_FN:
            raise TypeError("`metrics` must compute keras's sparse_categorical_accuracy, got "
                            f"{type(m).__name__}.")
    for m in metrics:
        m._fn = sparse_categorical_accuracy
    try:
        yield
    finally:
        for m in metrics:
            m._fn = _KERAS_FN
