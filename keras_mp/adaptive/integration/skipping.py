"""Under every adaptive policy a step whose gradients are not finite changes nothing.

Keras's ``mixed_float16`` skips such a step's update (its loss-scale optimizer
does), but Keras's ``mixed_bfloat16`` and float32 apply it: one NaN batch
turns every weight into NaN. Under a keras-mp adaptive policy, whatever the
dtypes it chose (float32 for a fit too small to gain included), a step whose
gradients hold inf or NaN, agreed across replicas, keeps:

* the weights, the optimizer's slots and ``iterations``: the model's
  optimizer is a :class:`keras_mp.LossScaleOptimizer` (a dynamic loss scale
  where float16 is a candidate, ``FixedLossScale(1.0)`` otherwise:
  :func:`keras_mp.adaptive.integration.optimizer_setup.connect`), which applies
  nothing on such a step;
* what the forward pass and the metrics assigned during the step:
  ``BatchNormalization``'s moving statistics, metric totals, seed states.
  Each non-trainable variable of the model and each metric variable is read
  just before its first assignment in the traced step (so variables nothing
  assigns, such as the frozen kernels of a LoRA fine-tune, cost nothing), and
  put back after the step under ``tf.cond(finite)``. The wrapper of Keras's
  ``Variable._direct_assign`` that takes these snapshots is installed on import
  (:mod:`keras_mp._keras_changes`) and acts only while a guarded step traces.

A skipped step's own logs carry the loss it computed, and the metric totals
after it no longer count the step. A batch whose own values (inputs, targets,
sample weights) are not finite is **bad data**: its step is skipped the same
way, its logged loss is NaN (whatever the layers made of the NaN: a ``relu``
turns it into 0), so that the logged loss says which steps were skipped for bad
data and ``keras.callbacks.TerminateOnNaN`` stops the run as it would under
Keras; its evidence counts for no layer (no promotion comes of it), and the
loss scale neither backs off nor grows. A step skipped for an overflow of its
own (float16 gradients at a loss scale too high, above the scale's floor)
logs its loss and does not stop the run; where that loss is finite it keeps
what its forward pass and metrics recorded, as under Keras's
``mixed_float16``. Skipped steps are
counted per epoch and warned about once per epoch (how many, the first, how
many were bad data; :class:`SkipReport`), but for the skips a dynamic loss
scale makes routinely above its floor (it backs off and goes on: a few per
thousand steps, and its first steps): those the optimizer counts
(``skipped_steps``, in the report). ``keras_mp.config.set_skip_nonfinite(False)``
turns all of it off (float16's loss scaling still skips, as Keras's does).

Example:
    >>> import keras, numpy as np, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x = np.ones((8, 2), "float32"); x[3] = np.nan      # one bad batch of four
    >>> with __import__("warnings").catch_warnings(record=True) as caught:
    ...     _ = model.fit(x, np.ones((8, 1)), batch_size=2, verbose=0)
    >>> bool(np.isfinite(model.layers[0].kernel.numpy()).all())
    True
    >>> "1 of 4 steps" in str(caught[-1].message)
    True
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _installed
from keras_mp.scaling import kernels

__all__ = ["SkipReport", "bad_data", "enabled", "guard", "install", "set_enabled", "skipped"]

_ATTR = "skip_guard"  # kept in the model's keras_mp._installed holder
_state = {"enabled": True, "keras_assign": None}
_local = threading.local()


def enabled() -> bool:
    """Whether adaptive fits skip non-finite steps (:func:`set_enabled`)."""
    return _state["enabled"]


def set_enabled(enabled: bool) -> None:
    """Turns skipping non-finite steps under adaptive policies on (default) or
    off (documented as :func:`keras_mp.config.set_skip_nonfinite`).

    Args:
        enabled: True or False.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be True or False, got {enabled!r}.")
    _state["enabled"] = enabled


def bad_data(data) -> tf.Tensor | None:
    """Whether a batch holds a non-finite value in any of its floating
    tensors (a scalar bool tensor), or None where it has none.

    Example:
        >>> import numpy as np
        >>> bool(bad_data((np.array([1.0, np.inf], "float32"), np.ones(2, "int32"))))
        True
    """
    floats = [t for t in tf.nest.flatten(data) if t is not None]
    floats = [tf.convert_to_tensor(t) if not tf.is_tensor(t) else t for t in floats
              if not isinstance(t, (tf.SparseTensor, tf.RaggedTensor, str, bytes))]
    floats = [t for t in floats if t.dtype.is_floating]
    if not floats:
        return None
    return tf.reduce_any(kernels.nonfinite_by_sums(floats))  # one pass over each tensor


class _Step:
    """What one traced train step of a guarded model records: the snapshots
    of the variables it assigned, and the optimizer's verdict. The
    :class:`keras_mp.LossScaleOptimizer` of the model reads :attr:`bad_data`
    and calls :meth:`decided` (its ``step_guard``)."""

    def __init__(self, watched: dict[int, Any], bad: tf.Tensor | None):
        self.graph = id(tf.compat.v1.get_default_graph())  # an id: nothing held past the trace
        self.watched = watched
        self.saved: dict[int, tuple[Any, tf.Tensor]] = {}
        self.bad_data = bad
        self.verdicts: list[tuple[tf.Tensor, tf.Tensor | None, tf.Tensor | None]] = []

    def before_assign(self, variable) -> None:
        key = id(variable)
        if key in self.watched and key not in self.saved \
                and id(tf.compat.v1.get_default_graph()) == self.graph:
            self.saved[key] = (variable, tf.identity(variable._value.read_value()))

    def decided(self, finite: tf.Tensor, bad: tf.Tensor | None,
                routine: tf.Tensor | None = None) -> None:
        """The optimizer's agreed flags for one ``apply``: all gradients
        finite, the batch bad data (None: not known), and a skip the dynamic
        loss scale makes routinely, above its floor (None: never)."""
        self.verdicts.append((finite, bad, routine))

    def forget(self) -> None:
        """Drops what the trace made (its tensors), once the step is built:
        nothing here may keep a trace alive after it (the execution trial
        frees the traces of the modes it did not choose)."""
        self.saved, self.verdicts, self.bad_data, self.watched = {}, [], None, {}

    def restore(self) -> tf.Tensor:
        for variable, value in self.saved.values():
            variable._value.assign(value)
        return tf.constant(True)


def _direct_assign(keras_assign):
    def direct_assign(self, value):
        step = getattr(_local, "step", None)
        if step is not None:
            step.before_assign(self)
        return keras_assign(self, value)
    direct_assign.__wrapped__ = keras_assign
    return direct_assign


def install() -> None:
    """Wraps Keras's TensorFlow ``Variable._direct_assign`` (once) so that a
    guarded step can snapshot what it assigns (module docstring)."""
    if _state["keras_assign"] is not None:
        return
    from keras.src.backend.tensorflow.core import Variable

    _state["keras_assign"] = Variable._direct_assign
    Variable._direct_assign = _direct_assign(Variable._direct_assign)


class _Guard:
    """A guarded model's counts (kept in this process, not saved): in the
    epoch, its steps, skipped steps, skipped bad-data steps, the first
    skipped step (1-based, 0: none) and the steps whose records were put
    back; since the guard was installed, skipped steps and bad-data steps."""

    def __init__(self, model: keras.Model):
        with model.distribute_strategy.scope():
            self.counts = tf.Variable(tf.zeros([7], tf.int64), trainable=False,
                                      aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def count(self, finite: tf.Tensor, bad: tf.Tensor | None,
              routine: tf.Tensor | None = None, kept: tf.Tensor | None = None) -> None:
        """Counts one step; a routine skip of a dynamic loss scale (``routine``:
        already False on bad data, :func:`_routine`) counts as a step, not as a
        skip; ``kept``: whether the step's records were kept."""
        c = self.counts.read_value()
        expected = routine if routine is not None else tf.constant(False)
        skipped = tf.cast(tf.logical_not(finite) & tf.logical_not(expected), tf.int64)
        bad = tf.zeros([], tf.int64) if bad is None else tf.cast(bad, tf.int64) * skipped
        # The first skipped step: this one (c[0] + 1) where none was before.
        first = tf.where(c[3] == 0, c[0] + 1, 0) * skipped
        restored = tf.zeros([], tf.int64) if kept is None else \
            1 - tf.cast(kept, tf.int64)
        self.counts.assign_add(tf.stack([tf.ones([], tf.int64), skipped, bad, first, restored,
                                         skipped, bad]))

    def epoch(self) -> tuple[int, int, int, int, int]:
        """This epoch's steps, skipped steps, bad-data steps, first skipped
        step, steps whose records were put back."""
        return tuple(int(x) for x in self.counts.numpy()[:5])

    def total(self) -> tuple[int, int]:
        """Skipped steps and bad-data steps since the guard was installed."""
        return tuple(int(x) for x in self.counts.numpy()[5:])

    def new_epoch(self) -> None:
        self.counts.assign(tf.concat([tf.zeros([5], tf.int64), self.counts[5:]], 0))


def _routine(routine: tf.Tensor | None, bad: tf.Tensor | None) -> tf.Tensor:
    """Whether a skip is one a dynamic loss scale makes routinely (above its
    floor, on a batch not known to be bad data)."""
    if routine is None:
        return tf.constant(False)
    return routine if bad is None else tf.logical_and(routine, tf.logical_not(bad))


def _guarded(model: keras.Model, guard: _Guard):
    def make(original):
        def train_step(data):
            opt = getattr(model, "optimizer", None)
            watched = {id(v): v for v in model.non_trainable_variables}
            watched.update((id(v), v) for m in model.metrics for v in m.variables)
            step = _Step(watched, bad_data(data))
            outer = getattr(_local, "step", None)
            _local.step = step
            holder = opt if hasattr(opt, "step_guard") else None
            if holder is not None:
                holder.step_guard = step
            try:
                logs = original(data)
            finally:
                _local.step = outer
                if holder is not None:
                    holder.step_guard = None
            if not step.verdicts:
                return logs  # nothing applied through keras-mp's optimizer
            def all_of(flags, reduce):  # one apply (the usual): its flag as it is
                return None if not flags else flags[0] if len(flags) == 1 else \
                    reduce(tf.stack(flags))

            finite = all_of([f for f, _, _ in step.verdicts], tf.reduce_all)
            bad = all_of([b for _, b, _ in step.verdicts if b is not None], tf.reduce_any)
            routine = all_of([r for _, _, r in step.verdicts if r is not None], tf.reduce_all)
            keep = finite
            if routine is not None:
                routine = _routine(routine, bad)  # once: the guard counts with it too
                # A routine skip whose loss is finite (the scale overflowed the
                # gradients, not the forward pass) keeps what the forward pass
                # and the metrics recorded, as Keras's mixed_float16 does.
                loss = logs.get("loss") if isinstance(logs, dict) else None
                fine = tf.reduce_all(tf.math.is_finite(loss)) if tf.is_tensor(loss) \
                    and loss.dtype.is_floating else tf.constant(True)
                keep = finite | (routine & fine)
            with tf.control_dependencies([t for t in tf.nest.flatten(logs) if tf.is_tensor(t)]):
                done = tf.cond(keep, lambda: tf.constant(False), step.restore)
                guard.count(finite, bad, routine, keep)
            step.forget()
            with tf.control_dependencies([done]):
                logs = tf.nest.map_structure(
                    lambda t: tf.identity(t) if tf.is_tensor(t) else t, logs)
            if bad is not None and isinstance(logs, dict) and tf.is_tensor(logs.get("loss")) \
                    and logs["loss"].dtype.is_floating:
                # A bad batch's logged loss is NaN, whatever the layers made of it.
                logs = {**logs, "loss": tf.where(bad, tf.constant(np.nan, logs["loss"].dtype),
                                                 logs["loss"])}
            return logs
        return train_step
    return make


def guard(model: keras.Model) -> bool:
    """Guards ``model``'s train step (once): a step the model's
    :class:`keras_mp.LossScaleOptimizer` skips puts back what it assigned.
    Returns whether the guard was installed just now (the train function is
    then traced anew).

    Raises:
        TypeError: ``model`` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    held = _installed.installed(model)
    if getattr(held, _ATTR, None) is not None:
        return False
    if isinstance(model.distribute_strategy, tf.distribute.experimental.CentralStorageStrategy):
        # Its variables' assign is a cross-replica merge, which the tf.cond that
        # puts them back cannot hold: the fit failed at its first trace ("merge_call
        # called while defining a new graph"). The loss-scale optimizer still skips
        # the update; what the forward pass assigned stays, as under mixed_float16.
        logging.getLogger("keras_mp").info(
            "keras_mp: under CentralStorageStrategy a skipped step keeps what its forward "
            "pass assigned (moving statistics, metric totals); its update is skipped.")
        return False
    install()
    setattr(held, _ATTR, _Guard(model))
    _installed.keep_with_step(model, _ATTR, [getattr(held, _ATTR).counts])  # written by each step
    _installed.install_method(model, "train_step", _guarded(model, getattr(held, _ATTR)))
    model.train_function = None
    return True


def _guard_of(model: keras.Model) -> _Guard | None:
    return getattr(model.__dict__.get(_installed.INSTALLED_ATTR), _ATTR, None)


def skipped(model: keras.Model) -> tuple[int, int] | None:
    """Steps of ``model`` skipped in this process since its guard was
    installed, and how many of them were bad data; None for a model never
    guarded (:func:`guard`)."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    guard_ = _guard_of(model)
    return None if guard_ is None else guard_.total()


class SkipReport(keras.callbacks.Callback):
    """Warns once per epoch where steps of a guarded model were skipped: how
    many, the first, and how many of them were bad data. Reads the device
    once per epoch; ``fit`` adds it to every guarded model's fit."""

    def on_epoch_begin(self, epoch, logs=None):
        guard_ = _guard_of(self.model)
        if guard_ is not None:
            guard_.new_epoch()

    def on_epoch_end(self, epoch, logs=None):
        guard_ = _guard_of(self.model)
        if guard_ is None:
            return
        steps, count, bad, first, restored = guard_.epoch()
        if steps and restored == steps and logs is not None and "loss" in logs:
            # Every step's records put back: the metric totals count none
            # (Keras's mean of nothing reads 0); say so in the epoch's loss.
            logs["loss"] = float("nan")
        if not count:
            return
        why = f", {bad} of them bad data (non-finite inputs or targets)" if bad else ""
        warnings.warn(
            f"keras_mp: {count} of {steps} steps in epoch {epoch + 1} had non-finite "
            f"gradients and were skipped (first: step {first}){why}; weights, optimizer "
            "state, moving statistics and metric totals were kept as they were. "
            "keras_mp.config.set_skip_nonfinite(False) turns skipping off.", stacklevel=2)
