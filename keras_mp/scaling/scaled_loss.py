"""Whether the loss a step differentiates went through the optimizer's
``scale_loss``.

A model with its own ``train_step`` (``tf.GradientTape``, as keras.io's
examples write it) differentiates whatever loss it computes. Keras's own
``train_step`` passes the loss through ``optimizer.scale_loss`` before
differentiating it; most hand-written ones do not. When keras-mp's adaptive
policy wraps such a model's optimizer in a loss-scale optimizer (float16 is
a candidate), ``apply`` must know whether the gradients it gets are scaled:
dividing unscaled gradients by the loss scale (2**15 at first) would shrink
every update by that much (what Keras's ``mixed_float16`` does with such a
``train_step``; Adam hides most of it, SGD does not).

:class:`ScaledLossCheck` records where ``scale_loss`` was last called (the
graph being traced, or eagerly) and answers, in ``apply``, whether that was
in the step being traced (the same graph, or one nested in it or around it).

Example:
    >>> import tensorflow as tf
    >>> check, seen = ScaledLossCheck(), []
    >>> @tf.function
    ... def step(scale):   # one trace per value of `scale`
    ...     if scale:
    ...         check.scaled()
    ...     seen.append(check.consume())
    >>> step(True); step(False)
    >>> seen
    [True, False]
"""

from __future__ import annotations

import warnings
import weakref

import tensorflow as tf

__all__ = ["ScaledLossCheck", "UNSCALED_LOSS_MESSAGE"]

UNSCALED_LOSS_MESSAGE = (
    "{model}'s train_step differentiates a loss that did not go through "
    "`self.optimizer.scale_loss(loss)`: keras-mp applies its gradients without loss scaling "
    "(float16 gradients below ~6e-8 flush to zero; the adaptive policy moves the layers where "
    "that happens to float32). To keep float16 gradients in range, differentiate "
    "`self.optimizer.scale_loss(loss)` instead of `loss`, as Keras's own train_step does "
    "(`apply` unscales the gradients).")


def _chain(graph):
    """``graph`` and the graphs around it (a ``tf.cond`` branch's outer graph...)."""
    while graph is not None:
        yield graph
        graph = getattr(graph, "outer_graph", None)


class ScaledLossCheck:
    """Records the calls of ``scale_loss`` (:meth:`scaled`) and tells, at
    ``apply`` (:meth:`consume`), whether one happened in the same step."""

    def __init__(self):
        self._graph = None
        self._eager = False

    def scaled(self) -> None:
        """``scale_loss`` was called (in the graph being traced, or eagerly)."""
        if tf.executing_eagerly():
            self._eager = True
        else:
            self._graph = weakref.ref(tf.compat.v1.get_default_graph())

    def consume(self) -> bool:
        """Whether ``scale_loss`` was called in the step being traced (or,
        eagerly, since the last call)."""
        if tf.executing_eagerly():
            seen, self._eager = self._eager, False
            return seen
        recorded = self._graph() if self._graph is not None else None
        if recorded is None:
            return False
        current = tf.compat.v1.get_default_graph()
        return any(g is recorded for g in _chain(current)) or \
            any(g is current for g in _chain(recorded))

    def scale_to_undo(self, scale, model: str | None):
        """What ``apply`` divides the gradients by: ``scale``, or 1 when
        ``model`` (a name: its own train_step is checked; None: never) did
        not call ``scale_loss`` in this step (a warning says what to add)."""
        if model is None or self.consume():
            return scale
        warnings.warn(UNSCALED_LOSS_MESSAGE.format(model=model), stacklevel=3)
        return tf.ones_like(scale)
