"""Keras's sparse categorical cross-entropy from logits as one fused kernel each way.

A language model's loss is a softmax over its whole vocabulary: on GPT-2's
``[batch * length, 50257]`` logits Keras runs log-softmax and the pick as
separate ops over float32 logits (a float32 copy of 16-bit ones), forward
and backward. Measured on a 2-core AMD EPYC with AVX512-BF16 (batch 16 x 128
tokens, ``python -m benchmarks.gpt2_parts``, 5 interleaved rounds): 452.9 ms
CPU per step for Keras's loss on the float32 logits Keras's GPT-2 makes,
226.7 ms for :func:`keras_mp.fused.ops.sparse_softmax_cross_entropy` on the
bfloat16 logits keras-mp's makes. Inside :func:`keras_mp.fused.shared_matches.sharing`
(a keras-mp train step that also fuses the accuracy) its forward kernel also
gives the accuracy's top-1 matches.

:class:`SparseCategoricalCrossentropy` is Keras's loss with that kernel where
it applies (``from_logits=True``, no ``ignore_class``, the last axis);
:func:`fusing` swaps a compiled model's Keras loss for it while a train step
is traced (:mod:`keras_mp.execution` does, for the models it configures), so
a saved model's compile config still names Keras's loss.

Example:
    >>> import numpy as np
    >>> from keras_mp.fused.losses import SparseCategoricalCrossentropy
    >>> loss = SparseCategoricalCrossentropy(from_logits=True)
    >>> round(float(loss(np.array([0]), np.zeros((1, 2), "float32"))), 4), loss.fused
    (0.6931, True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import tensorflow as tf

from keras_mp.fused import shared_matches
from keras_mp.fused.ops import cross_entropy

__all__ = ["SparseCategoricalCrossentropy", "fusable_losses", "fusing"]


@keras.saving.register_keras_serializable(package="keras_mp")
class SparseCategoricalCrossentropy(keras.losses.SparseCategoricalCrossentropy):
    """``keras.losses.SparseCategoricalCrossentropy`` whose ``from_logits``
    case is one fused kernel each way, reading 16-bit logits as they are
    (no float32 copy) and computing in float32; same arguments, same config,
    the loss in the loss's dtype (float32). Other settings run Keras's code.
    """

    @property
    def fused(self) -> bool:
        """Whether a call runs the fused kernel (else Keras's code)."""
        kw = self._fn_kwargs
        return bool(kw.get("from_logits")) and kw.get("ignore_class") is None \
            and kw.get("axis", -1) == -1

    def __call__(self, y_true, y_pred, sample_weight=None):
        if not self.fused or isinstance(y_pred, (list, tuple, dict)):
            return super().__call__(y_true, y_pred, sample_weight)
        from keras.src.backend import get_keras_mask
        from keras.src.losses.loss import reduce_weighted_values

        mask = get_keras_mask(y_pred)
        with tf.name_scope(self.name):
            logits = tf.convert_to_tensor(y_pred)
            labels = tf.convert_to_tensor(y_true)
            if labels.shape.rank is not None and labels.shape.rank == logits.shape.rank \
                    and labels.shape[-1] == 1:
                labels = tf.squeeze(labels, -1)
            if not labels.dtype.is_integer:
                labels = tf.cast(labels, tf.int32)
            if shared_matches.active():   # the step's accuracy reads these
                losses, matches = cross_entropy.sparse_softmax_cross_entropy(
                    labels, logits, dtype=self.dtype, with_matches=True)
                shared_matches.put(y_true, y_pred, matches)
            else:
                losses = cross_entropy.sparse_softmax_cross_entropy(labels, logits,
                                                                    dtype=self.dtype)
            return reduce_weighted_values(losses, sample_weight=sample_weight, mask=mask,
                                          reduction=self.reduction, dtype=self.dtype)


def fusable_losses(model: keras.Model) -> list[keras.losses.Loss]:
    """The Keras ``SparseCategoricalCrossentropy(from_logits=True)`` losses
    (exactly that class) ``model`` was compiled with."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    found = []
    for loss in keras.tree.flatten(getattr(model, "loss", None) or []):
        if type(loss) is keras.losses.SparseCategoricalCrossentropy:
            loss.__class__ = SparseCategoricalCrossentropy
            fused = loss.fused
            loss.__class__ = keras.losses.SparseCategoricalCrossentropy
            if fused:
                found.append(loss)
    return found


@contextlib.contextmanager
def fusing(losses: list[keras.losses.Loss]) -> Iterator[None]:
    """Inside the block, ``losses`` (from :func:`fusable_losses`) compute as
    :class:`SparseCategoricalCrossentropy`; after it, they are Keras's again
    (what a step traced inside keeps is the fused kernel)."""
    for loss in losses:
        if type(loss) is not keras.losses.SparseCategoricalCrossentropy:
            raise TypeError("`losses` must hold keras.losses.SparseCategoricalCrossentropy "
                            f"instances, got {type(loss).__name__}.")
    for loss in losses:
        loss.__class__ = SparseCategoricalCrossentropy
    try:
        yield
    finally:
        for loss in losses:
            loss.__class__ = keras.losses.SparseCategoricalCrossentropy
