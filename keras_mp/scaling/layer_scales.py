"""Per-layer loss scales (Zhao et al. 2019, "Adaptive Loss Scaling for Mixed
Precision Training"): the pieces below the adaptive policy.

With one global loss scale ``S`` every float16 layer's gradients carry the
same factor, so a model whose layers' gradients lie further apart than
float16's range cannot be served by any ``S``: at the scale one layer needs
to stay out of the subnormal range another overflows. With per-layer loss
scales each layer's backward pass runs at ``S * c`` with a factor ``c`` of
its own:

* the gradient entering the layer (at its output) is multiplied by ``c``
  (:func:`boundary_out`) and the gradient it hands back (at its input) by
  ``1 / c`` (:func:`boundary_in`), both in float32: every gradient *between*
  layers is a float32 tensor at scale ``S``, so any factors are consistent
  in any graph (branches, residual sums), and the conversion never rounds a
  gradient to float16 at the wrong scale;
* :class:`keras_mp.LossScaleOptimizer` (``layer_scales=True``) keeps the
  factors in a variable, one entry per variable (every variable of a layer
  holds its layer's factor), and divides each gradient by ``S * c`` in its
  one unscale pass;
* a non-finite step halves the factors (never below 1) of the layers whose
  gradients were non-finite (:func:`backoff`); only when none of those had a
  factor above 1 does the global schedule see an overflow.

The adaptive policy installs the boundaries on every controlled layer that is
not inside another (``AdaptivePolicy(layer_loss_scales=True)``) and chooses
the factors from the same statistics that choose dtypes
(:mod:`keras_mp.adaptive.decisions.scale_rule`).

Example, a layer boundary in a gradient tape:
    >>> import tensorflow as tf
    >>> from keras_mp.scaling import layer_scales
    >>> x = tf.constant([1.0, 2.0])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     h = layer_scales.boundary_in(x, "float16", tf.constant(1 / 64))   # layer input
    ...     y = layer_scales.boundary_out(h * 3, tf.constant(64.0))          # layer output
    ...     loss = tf.reduce_sum(y)
    >>> y.dtype.name, tape.gradient(loss, x).numpy().tolist()   # inside: at 64x
    ('float32', [3.0, 3.0])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.variables import AutocastScope  # no public equivalent

__all__ = ["boundary_in", "boundary_out", "cast_source", "backoff"]

Recorder = Callable[[tf.Tensor], None]


def _check_record(record) -> None:
    if record is not None and not callable(record):
        raise TypeError(f"`record` must be None or a callable, got {record!r}.")


def cast_source(x: tf.Tensor) -> tf.Tensor:
    """The float32 tensor that ``x`` was cast from, if ``x`` is the result of a
    cast in a traced graph (Keras casts a layer's inputs to its compute dtype
    before the layer's ``call``); else ``x``. Casting that source again gives
    ``x``'s values, with a gradient that stays float32 up to the cast."""
    op = getattr(x, "op", None)  # eager tensors have none
    try:
        if op is not None and op.type == "Cast" and op.inputs[0].dtype == tf.float32:
            return op.inputs[0]
    except (AttributeError, ValueError):
        pass
    return x


def boundary_in(x: tf.Tensor, dtype, inverse, record: Recorder | None = None) -> tf.Tensor:
    """A layer's input: ``x`` cast to ``dtype`` (the layer's compute dtype);
    its gradient, computed inside the layer at ``S * c``, is multiplied by
    ``inverse`` (``1 / c``) in float32 and handed back in ``x``'s dtype.

    Args:
        x: a floating tensor (float32 for a gradient that stays float32).
        dtype: the dtype the layer computes in.
        inverse: ``1 / c``, a float32 scalar tensor.
        record: called with the handed-back gradient (float32, at ``S``) while
            the backward pass is traced, or None.
    """
    _check_record(record)
    dtype = tf.as_dtype(dtype)
    inverse = tf.cast(inverse, tf.float32)

    @tf.custom_gradient
    def f(t):
        y = tf.cast(t, dtype) if t.dtype != dtype else tf.identity(t)

        def grad(g):
            back = tf.cast(g, tf.float32) * inverse
            if record is not None:
                record(back)
            return tf.cast(back, t.dtype)
        return y, grad

    return f(x)


def boundary_out(y: tf.Tensor, factor, record: Recorder | None = None) -> tf.Tensor:
    """A layer's output: ``y`` as float32 (exactly its values); the gradient
    arriving (float32, at ``S``) is multiplied by ``factor`` (``c``) and
    enters the layer in ``y``'s dtype.

    Args:
        y: a floating tensor, the layer's output.
        factor: ``c``, a float32 scalar tensor.
        record: called with the arriving gradient (float32, at ``S``) while
            the backward pass is traced, or None.
    """
    _check_record(record)
    factor = tf.cast(factor, tf.float32)

    @tf.custom_gradient
    def f(t):
        out = tf.cast(t, tf.float32) if t.dtype != tf.float32 else tf.identity(t)

        def grad(g):
            g32 = tf.cast(g, tf.float32)
            if record is not None:
                record(g32)
            return tf.cast(g32 * factor, t.dtype)
        return out, grad

    return f(y)


def backoff(factors: tf.Tensor, nonfinite: tf.Tensor,
            groups: Sequence[int]) -> tuple[tf.Tensor, tf.Tensor]:
    """One step's in-graph reaction to non-finite gradients.

    Args:
        factors: ``[n]`` float32, each variable's factor.
        nonfinite: ``[n]``, > 0 where a variable's gradient was non-finite
            (agreed across replicas).
        groups: ``n`` ints, the layer of each variable (its factor is shared
            with the layer's other variables); -1: a variable of no layer.

    Returns:
        ``(new_factors, schedule_finite)``: the factors of every layer with a
        non-finite gradient halved (not below 1), and whether the global
        schedule should count the step as finite (no non-finite gradient
        with a factor of 1 or less to blame).

    Example:
        >>> f, ok = backoff(tf.constant([8.0, 8.0, 1.0]), tf.constant([0, 1, 0]), [0, 0, 1])
        >>> f.numpy().tolist(), bool(ok)
        ([4.0, 4.0, 1.0], True)
    """
    groups = list(groups)
    n = len(groups)
    if isinstance(factors, (list, tuple)) or factors.shape.rank != 1 or factors.shape[0] != n:
        raise ValueError(f"`factors` must be a vector with one entry per group id ({n}), got "
                         f"{factors!r}.")
    if any(isinstance(g, bool) or not isinstance(g, int) or g < -1 for g in groups):
        raise ValueError(f"`groups` must be ints >= -1, got {groups!r}.")
    top = max(groups, default=-1) + 1
    # variables of no layer: a group of their own each
    seg = tf.constant([g if g >= 0 else top + k for k, g in enumerate(groups)] or [0],
                      tf.int32)
    bad = tf.cast(tf.cast(nonfinite, tf.float32) > 0, tf.float32)
    bad_group = tf.gather(tf.math.unsorted_segment_max(bad, seg, top + n), seg) > 0
    factors = tf.cast(factors, tf.float32)
    shrink = bad_group & (factors > 1.0)
    new = tf.where(shrink, tf.maximum(factors * 0.5, 1.0), factors)
    blamed = tf.reduce_any(shrink)
    finite = tf.logical_or(tf.logical_not(tf.reduce_any(bad > 0)), blamed)
    return new, finite


class LayerScalesMixin:
    """The per-layer part of :class:`keras_mp.LossScaleOptimizer`: which
    variables share a factor, and reading and setting the factors (kept in its
    ``variable_scales`` variable)."""

    def _check_layer_scales(self, what: str) -> None:
        if not self.layer_scales:
            raise ValueError(f"{what} needs per-layer loss scales: construct the optimizer "
                             "with `layer_scales=True`.")
        if not self.built:
            raise ValueError(f"{what} needs a built optimizer (optimizer.build(variables)).")

    def bind_layer_scales(self, groups) -> None:
        """Says which variables share a factor: ``groups[g]`` is the list of
        variables of layer group ``g`` (a layer and what it contains). Call it
        before the train step is traced; variables in no group keep factor 1.

        Args:
            groups: a sequence of sequences of this optimizer's variables.
        """
        self._check_layer_scales("bind_layer_scales()")
        if isinstance(groups, (str, bytes)) or not all(
                isinstance(g, (list, tuple)) for g in groups):
            raise TypeError(f"`groups` must be a sequence of lists of variables, got {groups!r}.")
        ids = [-1] * len(self._trainable_variables)
        for g, variables in enumerate(groups):
            for v in variables:
                try:
                    ids[self._get_variable_index(v)] = g
                except (KeyError, AttributeError):
                    raise ValueError(f"`groups` holds {v!r}, which this optimizer does not "
                                     "train.") from None
        self._scale_groups = ids
        self._first_of_group = [ids.index(g) if g in ids else -1 for g in range(len(groups))]

    def layer_scale(self, group: int):
        """Group ``group``'s factor, read inside a traced step (a float32
        scalar tensor; 1 for a group without variables)."""
        self._check_layer_scales("layer_scale()")
        if self._scale_groups is None or not 0 <= group < len(self._first_of_group):
            raise ValueError(f"`group` must index a group bound by bind_layer_scales(), got "
                             f"{group!r}.")
        first = self._first_of_group[group]
        if first < 0:
            return tf.constant(1.0)
        # Read inside a layer's call: not cast to its compute dtype (2**16 is
        # inf in float16).
        with AutocastScope(None):
            return tf.convert_to_tensor(self.variable_scales.value[first])

    def get_layer_scales(self) -> list[float]:
        """Each bound group's factor (one device read)."""
        self._check_layer_scales("get_layer_scales()")
        values = np.asarray(keras.ops.convert_to_numpy(self.variable_scales))
        return [float(values[k]) if k >= 0 else 1.0 for k in self._first_of_group or []]

    def set_layer_scales(self, factors) -> None:
        """Sets each bound group's factor (outside a train step).

        Args:
            factors: one finite number >= 1 per group, in the order of
                :meth:`bind_layer_scales`.
        """
        self._check_layer_scales("set_layer_scales()")
        factors = list(factors)
        if self._scale_groups is None or len(factors) != len(self._first_of_group):
            raise ValueError("`factors` must hold one factor per group bound by "
                             f"bind_layer_scales(), got {factors!r}.")
        if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 1 <= f < math.inf
               for f in factors):
            raise ValueError(f"`factors` must be finite numbers >= 1, got {factors!r}.")
        values = [factors[g] if g >= 0 else 1.0 for g in self._scale_groups]
        self.variable_scales.assign(np.asarray(values, np.float32))

    def _variable_factors(self, tvars):
        """Each of ``tvars``'s factor, a ``[len(tvars)]`` tensor."""
        index = [self._get_variable_index(v) for v in tvars]
        with AutocastScope(None):
            return tf.gather(self.variable_scales.value, index), index
