"""Per-layer gradient statistics, accumulated on the device.

:class:`keras_mp.LossScaleOptimizer` computes per-gradient statistics in the
same fused kernel that unscales and checks the gradients
(:func:`keras_mp.kernels.unscale_with_statistics`) and hands them to its
``statistics_sink``. :meth:`LayerStatistics.accumulate` is that sink: it
attributes each gradient to the layer that owns the variable (by the
variable's path), reduces the interval's statistics per layer, agrees on them
across replicas under ``tf.distribute`` (one all-reduce) and adds them to variables, all
inside the compiled train step. Nothing is read back to the host until
:meth:`LayerStatistics.read`, once per interval.

Per layer and interval (fractions are of the layer's gradient elements,
weighted by tensor size, and averaged over steps and replicas):

* ``nonfinite``: fraction of steps in which any of its gradients held inf/nan
  *while the loss scale was at its floor* (``scale_floor``). Above the
  floor an overflow is the loss scaler's to fix (it backs off at once); a
  layer whose gradients stay non-finite at the floor, or a forward pass that
  overflows at any scale, is a precision problem;
* ``amax``: the largest finite unscaled gradient magnitude;
* ``fp16_underflow``, ``fp16_subnormal``, ``fp16_overflow``,
  ``bf16_subnormal``, ``zero``: as in :mod:`keras_mp.kernels`.

Example, as a custom loop would use it:
    >>> import keras, keras_mp, tensorflow as tf
    >>> from keras_mp.stats import LayerStatistics
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> stats = LayerStatistics(model.layers)
    >>> opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), schedule=1.0)
    >>> opt.statistics_sink = stats.accumulate
    >>> with tf.GradientTape() as tape:
    ...     scaled = opt.scale_loss(tf.reduce_sum(model(tf.ones([4, 3]))))
    >>> grads = tape.gradient(scaled, model.trainable_variables)
    >>> opt.apply(grads, model.trainable_variables)
    >>> interval = stats.read()
    >>> interval.steps, interval.layers[0].nonfinite
    (1, 0.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_mp import kernels
from keras_mp.controller import LayerStats

__all__ = ["FRACTIONS", "IntervalStats", "LayerStatistics", "variable_path"]

#: The statistics that are fractions of elements (averaged, not maxed).
FRACTIONS: tuple[str, ...] = ("fp16_underflow", "fp16_subnormal", "fp16_overflow",
                              "bf16_subnormal", "zero")


def variable_path(variable) -> str:
    """A variable's path (``"model/dense/kernel"``), or its name if it has none."""
    path = getattr(variable, "path", None) or getattr(variable, "name", None)
    if not isinstance(path, str):
        raise TypeError(f"`variable` must be a Keras or TensorFlow variable, got {variable!r} "
                        f"of type {type(variable).__name__}.")
    return path


@dataclasses.dataclass(frozen=True)
class IntervalStats:
    """What :meth:`LayerStatistics.read` returns.

    Attributes:
        steps: steps accumulated.
        all_nonfinite: fraction of steps in which every layer's gradients
            were non-finite (the loss itself was).
        mean_scale: mean loss scale over the steps.
        paths: the layers' paths, in order.
        layers: one :class:`keras_mp.controller.LayerStats` per layer.
    """

    steps: int
    all_nonfinite: float
    mean_scale: float
    paths: tuple[str, ...]
    layers: tuple[LayerStats, ...]


class LayerStatistics(keras.layers.Layer):
    """Accumulates the optimizer's gradient statistics per layer, on device.

    It is a Keras layer only so that its variables are saved and restored
    with the model it is attached to (a run resumed mid-interval keeps its
    partial statistics); it is never called on data.

    Args:
        layers: the layers to attribute gradients to, in forward order;
            gradients of variables that none of them owns are ignored.
        scale_floor: the smallest loss scale the schedule reaches; non-finite
            gradients count only at steps whose scale is at most this. None
            counts them at every scale (right for a fixed scale).
        name: the layer's name.
    """

    def __init__(self, layers: Sequence[keras.layers.Layer], *,
                 scale_floor: float | None = None, name: str = "keras_mp_statistics"):
        # float32 whatever the global policy: these are counters, not activations.
        super().__init__(name=name, dtype="float32", trainable=False)
        layers = list(layers)
        if not layers:
            raise ValueError("`layers` must hold at least one layer with trainable variables.")
        bad = [layer for layer in layers if not isinstance(layer, keras.layers.Layer)]
        if bad:
            raise TypeError(f"`layers` must hold Keras layers, got {bad[0]!r} of type "
                            f"{type(bad[0]).__name__}.")
        if scale_floor is not None and (
                isinstance(scale_floor, bool) or not isinstance(scale_floor, (int, float))
                or not scale_floor > 0):
            raise ValueError(f"`scale_floor` must be None or a number > 0, got {scale_floor!r}.")
        self.paths: tuple[str, ...] = tuple(layer.path for layer in layers)
        self.scale_floor = scale_floor
        self._owner: dict[str, int] = {}
        for i, layer in enumerate(layers):
            for v in layer._trainable_variables:
                self._owner[variable_path(v)] = i
        n = len(layers)
        # Replicas hold identical values after the all-reduce in `accumulate`,
        # so any replica's update is the update.
        kw = dict(trainable=False, aggregation="only_first_replica")
        self.fraction_sums = self.add_weight(shape=(len(FRACTIONS), n), initializer="zeros",
                                             name="fraction_sums", **kw)
        self.nonfinite_steps = self.add_weight(shape=(n,), initializer="zeros",
                                               name="nonfinite_steps", **kw)
        self.amax = self.add_weight(shape=(n,), initializer="zeros", name="amax", **kw)
        # steps, steps with every layer non-finite, sum of the loss scale
        self.counters = self.add_weight(shape=(3,), initializer="zeros", name="counters", **kw)
        self.built = True

    def accumulate(self, stats: kernels.GradientStatistics, scale, variables) -> None:
        """The optimizer's ``statistics_sink``: adds one step's statistics.

        Runs in replica context inside the train step; reduces across
        replicas with one all-reduce.

        Args:
            stats: per-gradient statistics, each field of shape ``[len(variables)]``.
            scale: the loss scale of the step.
            variables: the variables the gradients belong to.
        """
        n = len(self.paths)
        owner = [self._owner.get(variable_path(v), n) for v in variables]  # n: nobody's
        sizes = [float(max(v.shape.num_elements() or 0, 0)) for v in variables]
        seg = tf.constant(owner, tf.int32)
        size = tf.constant(sizes, tf.float32)
        layer_size = tf.math.unsorted_segment_sum(size, seg, n + 1)[:n]
        fr = tf.stack([tf.cast(getattr(stats, f), tf.float32) for f in FRACTIONS], axis=1)
        fr = tf.math.unsorted_segment_sum(fr * size[:, None], seg, n + 1)[:n]
        fr = tf.transpose(fr / tf.maximum(layer_size, 1.0)[:, None])  # [F, n]
        bad = tf.cast(tf.cast(stats.nonfinite, tf.float32) > 0.0, tf.float32)
        bad = tf.maximum(tf.math.unsorted_segment_max(bad, seg, n + 1)[:n], 0.0)
        amax = tf.maximum(tf.math.unsorted_segment_max(
            tf.cast(stats.amax, tf.float32), seg, n + 1)[:n], 0.0)
        scale = tf.reshape(tf.cast(scale, tf.float32), [1])
        if self.scale_floor is not None:
            # A tolerance for the float32 rounding of the scale.
            at_floor = tf.cast(scale[0] <= self.scale_floor * (1 + 1e-6), tf.float32)
            bad = bad * at_floor
        everywhere = tf.reduce_min(bad)

        ctx = tf.distribute.get_replica_context()
        if tf.distribute.has_strategy() and ctx is not None and ctx.num_replicas_in_sync > 1:
            # One collective for everything: each replica writes its row of a
            # [replicas, k] matrix and a sum gathers them (then mean/max per
            # field): a gather built from the all-reduce every strategy has.
            row = tf.concat([tf.reshape(fr, [-1]), bad, amax, everywhere[None], scale], 0)
            rid = tf.reshape(tf.cast(ctx.replica_id_in_sync_group, tf.int32), [1, 1])
            rows = tf.scatter_nd(rid, row[None], [ctx.num_replicas_in_sync, row.shape[0]])
            rows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, rows)
            k = len(FRACTIONS) * n
            fr = tf.reshape(tf.reduce_mean(rows[:, :k], 0), [len(FRACTIONS), n])
            bad = tf.reduce_max(rows[:, k:k + n], 0)
            amax = tf.reduce_max(rows[:, k + n:k + 2 * n], 0)
            everywhere = tf.reduce_max(rows[:, k + 2 * n])
            scale = tf.reduce_mean(rows[:, -1:], 0)
        self.fraction_sums.assign_add(fr)
        self.nonfinite_steps.assign_add(bad)
        self.amax.assign(tf.maximum(self.amax.value, amax))
        self.counters.assign_add(tf.concat([tf.ones([1]), everywhere[None], scale], 0))

    def read(self) -> IntervalStats:
        """The statistics accumulated since the last :meth:`reset` (reads the
        device once)."""
        fr, bad, amax, counters = (np.asarray(keras.ops.convert_to_numpy(v)) for v in (
            self.fraction_sums, self.nonfinite_steps, self.amax, self.counters))
        steps = int(round(float(counters[0])))
        d = max(steps, 1)
        layers = tuple(
            LayerStats(steps=steps, nonfinite=float(bad[i]) / d, amax=float(amax[i]),
                       **{f: float(fr[j, i]) / d for j, f in enumerate(FRACTIONS)})
            for i in range(len(self.paths)))
        return IntervalStats(steps=steps, all_nonfinite=float(counters[1]) / d,
                             mean_scale=float(counters[2]) / d, paths=self.paths,
                             layers=layers)

    def reset(self) -> None:
        """Starts a new interval."""
        for v in (self.fraction_sums, self.nonfinite_steps, self.amax, self.counters):
            v.assign(keras.ops.zeros(v.shape, v.dtype))

    def call(self, inputs):  # pragma: no cover - never called on data
        raise TypeError("LayerStatistics holds statistics; it is not called on data.")
