"""Per-layer statistics (gradients, forward pass, probe), accumulated on the device.

:class:`keras_mp.LossScaleOptimizer` computes per-gradient statistics in the
same fused kernel that unscales and checks the gradients
(:func:`keras_mp.scaling.kernels.unscale_with_statistics`) and hands them to its
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
  ``bf16_subnormal``, ``zero``: as in :mod:`keras_mp.scaling.kernels`;
* forward statistics of every observed layer, weights or not
  (:mod:`keras_mp.adaptive.evidence.forward`), taken from the model's :class:`keras_mp.adaptive.evidence.hooks.Hooks`
  in the same call: amaxes are maxima, the others fractions of the steps in
  which the layer was observed;
* the float32 probe's results (:mod:`keras_mp.adaptive.evidence.probe`), averaged over the
  valid probes of the interval.

Gradients and forward statistics of one step agree across replicas in one
all-reduce; a probe's results (:meth:`LayerStatistics.accumulate_probe`) in
one of their own.

Example, as a custom loop would use it:
    >>> import keras, keras_mp, tensorflow as tf
    >>> from keras_mp.adaptive.evidence.stats import LayerStatistics
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

from keras_mp.adaptive.evidence import forward
from keras_mp.scaling import kernels
from keras_mp.adaptive.decisions.controller import LayerStats
from keras_mp.adaptive.record.state import AttachedState

__all__ = ["FRACTIONS", "IntervalStats", "LayerStatistics", "agree", "learned_variables",
           "variable_path"]

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


def learned_variables(layer: keras.layers.Layer) -> list:
    """``layer``'s trainable variables that gradients update: without the
    float8 scaling state that Keras's optimizer overwrites with new values
    (``overwrite_with_gradient``), whose "gradients" are not gradients."""
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {layer!r} of type "
                        f"{type(layer).__name__}.")
    return [v for v in layer._trainable_variables
            if v.trainable and not getattr(v, "overwrite_with_gradient", False)]


@dataclasses.dataclass(frozen=True)
class IntervalStats:
    """What :meth:`LayerStatistics.read` returns.

    Attributes:
        steps: steps accumulated.
        all_nonfinite: fraction of steps in which every layer's gradients
            were non-finite (the loss itself was).
        mean_scale: mean loss scale over the steps.
        paths: the layers' paths, in order.
        layers: one :class:`keras_mp.adaptive.decisions.controller.LayerStats` per layer.
        probe_steps: valid probes in the interval.
        probe_loss_error: their mean loss relative error.
        probe_loss_noise_ratio: their mean loss error over sampling noise.
    """

    steps: int
    all_nonfinite: float
    mean_scale: float
    paths: tuple[str, ...]
    layers: tuple[LayerStats, ...]
    probe_steps: int = 0
    probe_loss_error: float = 0.0
    probe_loss_noise_ratio: float = 0.0


def agree(parts: Sequence[tuple[tf.Tensor, str]]) -> list[tf.Tensor]:
    """Agrees on per-replica values across replicas with one all-reduce.

    Args:
        parts: ``(tensor, how)`` pairs, ``how`` one of ``"mean"``, ``"max"``.

    Returns:
        The agreed tensors, in order, with their shapes (the inputs
        themselves outside a multi-replica context).
    """
    for _, how in parts:
        if how not in ("mean", "max"):
            raise ValueError(f"`how` must be 'mean' or 'max', got {how!r}.")
    ctx = tf.distribute.get_replica_context()
    if not (tf.distribute.has_strategy() and ctx is not None and ctx.num_replicas_in_sync > 1):
        return [t for t, _ in parts]
    # Each replica writes its row of a [replicas, k] matrix and a sum gathers
    # them: a gather built from the all-reduce every strategy has.
    flat = [tf.reshape(tf.cast(t, tf.float32), [-1]) for t, _ in parts]
    row = tf.concat(flat, 0)
    rid = tf.reshape(tf.cast(ctx.replica_id_in_sync_group, tf.int32), [1, 1])
    rows = tf.scatter_nd(rid, row[None], [ctx.num_replicas_in_sync, row.shape[0]])
    rows = ctx.all_reduce(tf.distribute.ReduceOp.SUM, rows)
    out, at = [], 0
    for (t, how), f in zip(parts, flat):
        k = f.shape[0]
        cols = rows[:, at:at + k]
        at += k
        red = tf.reduce_mean(cols, 0) if how == "mean" else tf.reduce_max(cols, 0)
        out.append(tf.reshape(red, tf.shape(t)))
    return out


def _probe_rows(probe) -> tuple[tf.Tensor, tf.Tensor]:
    """A probe's results as sums to accumulate: ``[valid, loss error, loss
    noise ratio]`` and ``[grad error, cosine, grad noise ratio] x layers``,
    invalid probes contributing nothing."""
    v = probe.valid
    counts = tf.stack([v, probe.loss_error * v, probe.loss_noise_ratio * v])
    per_layer = tf.stack([probe.grad_error * v, probe.cosine * v, probe.grad_noise_ratio * v])
    return counts, per_layer


class LayerStatistics(AttachedState):
    """Accumulates per-layer statistics on device: the optimizer's gradient
    statistics and the forward statistics that the model's
    :class:`keras_mp.adaptive.evidence.hooks.Hooks` recorded in the same step, and
    the probe's results (:meth:`accumulate_probe`).

    It is a Keras layer only so that its variables are saved and restored
    with the model it is attached to (a run resumed mid-interval keeps its
    partial statistics); it is never called on data.

    Args:
        layers: the controlled layers, with or without weights; gradients of
            variables that none of them owns are ignored.
        scale_floor: the smallest loss scale the schedule reaches; non-finite
            gradients count only at steps whose scale is at most this. None
            counts them at every scale (right for a fixed scale).
        name: the layer's name.

    Attributes:
        hooks: the :class:`keras_mp.adaptive.evidence.hooks.Hooks` whose recordings
            :meth:`accumulate` takes, or None (gradients only).
    """

    def __init__(self, layers: Sequence[keras.layers.Layer], *,
                 scale_floor: float | None = None, name: str = "keras_mp_statistics"):
        # float32 whatever the global policy: these are counters, not activations.
        super().__init__(name=name, dtype="float32", trainable=False)
        layers = list(layers)
        if not layers:
            raise ValueError("`layers` must hold at least one layer.")
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
            for v in learned_variables(layer):
                self._owner[variable_path(v)] = i
        self.has_gradients: tuple[bool, ...] = tuple(
            bool(learned_variables(layer)) for layer in layers)
        object.__setattr__(self, "hooks", None)  # not tracked: no state of ours
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
        # forward: per field and layer (maxima for MAX_FIELDS, sums otherwise),
        # then the steps in which each layer was observed
        self.forward_sums = self.add_weight(shape=(len(forward.FIELDS) + 1, n),
                                            initializer="zeros", name="forward_sums", **kw)
        # probe: gradient error, cosine and noise-ratio sums per layer; valid
        # probes, loss error sum and loss noise-ratio sum
        self.probe_sums = self.add_weight(shape=(3, n), initializer="zeros", name="probe_sums",
                                          **kw)
        self.probe_counters = self.add_weight(shape=(3,), initializer="zeros",
                                              name="probe_counters", **kw)
        # per-layer loss scales: largest unscaled gradient at each layer boundary
        self.backward_amax = self.add_weight(shape=(n,), initializer="zeros",
                                             name="backward_amax", **kw)
        self.built = True

    def _variables_of_state(self):
        return (self.fraction_sums, self.nonfinite_steps, self.amax, self.counters,
                self.forward_sums, self.probe_sums, self.probe_counters, self.backward_amax)

    def accumulate(self, stats: kernels.GradientStatistics, scale, variables, *,
                   factors=None, bad_data=None) -> None:
        """The optimizer's ``statistics_sink``: adds one step's statistics.

        Runs in replica context inside the train step; takes what
        :attr:`hooks` recorded in the same trace; reduces across replicas
        with one all-reduce.

        Args:
            stats: per-gradient statistics, each field of shape ``[len(variables)]``.
            scale: the loss scale of the step.
            variables: the variables the gradients belong to.
            factors: with per-layer loss scales, each variable's own factor
                (``[len(variables)]``): a non-finite gradient whose factor is
                above 1 is the per-layer scale's to fix, and does not count.
            bad_data: a scalar bool, true where the step's batch itself held a
                non-finite value (:mod:`keras_mp.adaptive.integration.skipping`):
                such a step adds nothing, on any replica; None: not known.
        """
        n = len(self.paths)
        owner = [self._owner.get(variable_path(v), n) for v in variables]  # n: nobody's
        sizes = [float(max(v.shape.num_elements() or 0, 0)) for v in variables]
        seg = tf.constant(owner or [n], tf.int32)
        size = tf.constant(sizes or [0.0], tf.float32)
        layer_size = tf.math.unsorted_segment_sum(size, seg, n + 1)[:n]
        fr = tf.stack([tf.cast(getattr(stats, f), tf.float32) for f in FRACTIONS], axis=1)
        fr = tf.math.unsorted_segment_sum(fr * size[:, None], seg, n + 1)[:n]
        fr = tf.transpose(fr / tf.maximum(layer_size, 1.0)[:, None])  # [F, n]
        bad = tf.cast(tf.cast(stats.nonfinite, tf.float32) > 0.0, tf.float32)
        if factors is not None:
            bad = bad * tf.cast(tf.cast(factors, tf.float32) <= 1.0, tf.float32)
        bad = tf.maximum(tf.math.unsorted_segment_max(bad, seg, n + 1)[:n], 0.0)
        amax = tf.maximum(tf.math.unsorted_segment_max(
            tf.cast(stats.amax, tf.float32), seg, n + 1)[:n], 0.0)
        scale = tf.reshape(tf.cast(scale, tf.float32), [1])
        if self.scale_floor is not None:
            # A tolerance for the float32 rounding of the scale.
            at_floor = tf.cast(scale[0] <= self.scale_floor * (1 + 1e-6), tf.float32)
            bad = bad * at_floor
        with_grads = tf.constant([1.0 if g else 0.0 for g in self.has_gradients])
        # "every layer": every layer with gradients
        everywhere = tf.reduce_min(tf.where(with_grads > 0, bad, 1.0))

        fwd, observed, backward = self.hooks.take() if self.hooks is not None \
            else (None, None, None)
        backward = tf.zeros([n]) if backward is None else backward / scale[0]
        if fwd is None:
            fwd = tf.zeros([n, len(forward.FIELDS)])
            observed = tf.zeros([n])
        fwd = tf.transpose(fwd)  # [fields, n]
        k_max = len(forward.MAX_FIELDS)
        data_bad = tf.zeros([1]) if bad_data is None else \
            tf.reshape(tf.cast(bad_data, tf.float32), [1])
        (fr, bad, amax, everywhere, scale, fwd_max, fwd_sum, observed, backward, data_bad) = agree([
            (fr, "mean"), (bad, "max"), (amax, "max"), (everywhere, "max"), (scale, "mean"),
            (fwd[:k_max], "max"), (fwd[k_max:], "max"), (observed, "max"), (backward, "max"),
            (data_bad, "max")])
        step = tf.ones([1])
        on = self.hooks.statistics_on() if self.hooks is not None else None
        if bad_data is not None:
            good = data_bad[0] == 0.0
            on = good if on is None else tf.logical_and(on, good)
        if on is not None:
            # A gated trace's plain step adds nothing (every quantity here
            # is accumulated by a sum or by a maximum with values >= 0).
            (step, fr, bad, amax, everywhere, scale, fwd_max, fwd_sum, observed, backward) = (
                tf.where(on, t, tf.zeros_like(t)) for t in (
                    step, fr, bad, amax, everywhere, scale, fwd_max, fwd_sum, observed, backward))
        self.fraction_sums.assign_add(fr)
        self.nonfinite_steps.assign_add(bad)
        self.amax.assign(tf.maximum(self.amax.value, amax))
        self.counters.assign_add(tf.concat([step, everywhere[None], scale], 0))
        old = self.forward_sums.value
        self.forward_sums.assign(tf.concat([
            tf.maximum(old[:k_max], fwd_max), old[k_max:-1] + fwd_sum, old[-1:] + observed[None]],
            0))
        self.backward_amax.assign(tf.maximum(self.backward_amax.value, backward))

    def accumulate_probe(self, result) -> None:
        """Adds one probe's results (a :class:`keras_mp.adaptive.evidence.probe.ProbeResult`),
        traced beside the train step (:mod:`keras_mp.adaptive.integration.step_functions`);
        agrees across replicas."""
        counts, per_layer = agree([(t, "mean") for t in _probe_rows(result)])
        self.probe_sums.assign_add(per_layer)
        self.probe_counters.assign_add(counts)

    def read(self) -> IntervalStats:
        """The statistics accumulated since the last :meth:`reset` (reads the
        device once)."""
        fr, bad, amax, counters, fw, ps, pc, bw = (np.asarray(keras.ops.convert_to_numpy(v))
                                                   for v in self._variables_of_state())
        steps = int(round(float(counters[0])))
        d = max(steps, 1)
        probes = int(round(float(pc[0])))
        dp = max(probes, 1)
        k_max = len(forward.MAX_FIELDS)
        layers = []
        for i in range(len(self.paths)):
            seen = int(round(float(fw[-1, i])))
            fwd = {f: float(fw[j, i]) if j < k_max else float(fw[j, i]) / max(seen, 1)
                   for j, f in enumerate(forward.FIELDS)}
            grads = self.has_gradients[i]
            layers.append(LayerStats(
                steps=steps, gradients=grads,
                nonfinite=float(bad[i]) / d if grads else 0.0, amax=float(amax[i]),
                **{f: float(fr[j, i]) / d for j, f in enumerate(FRACTIONS)},
                forward_steps=seen, **fwd,
                probe_steps=probes if grads else 0,
                grad_error=float(ps[0, i]) / dp if grads else 0.0,
                cosine=float(ps[1, i]) / dp if grads and probes else 1.0,
                grad_noise_ratio=float(ps[2, i]) / dp if grads else 0.0,
                backward_amax=float(bw[i])))
        return IntervalStats(steps=steps, all_nonfinite=float(counters[1]) / d,
                             mean_scale=float(counters[2]) / d, paths=self.paths,
                             layers=tuple(layers), probe_steps=probes,
                             probe_loss_error=float(pc[1]) / dp,
                             probe_loss_noise_ratio=float(pc[2]) / dp)

    def reset(self) -> None:
        """Starts a new interval."""
        for v in self._variables_of_state():
            v.assign(keras.ops.zeros(v.shape, v.dtype))

    def call(self, inputs):  # pragma: no cover - never called on data
        raise TypeError("LayerStatistics holds statistics; it is not called on data.")
