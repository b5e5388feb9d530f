"""``AdaptivePrecision``: applies the adaptive policy's decisions during ``fit``.

What the callback does, and when:

* ``set_model`` (Keras calls it when ``fit`` starts, before the train
  function is built): finds the model's :class:`keras_mp.AdaptivePolicy`,
  makes sure the optimizer is a :class:`keras_mp.LossScaleOptimizer`
  (wrapping the compiled one if not: with a dynamic loss scale when float16
  is a candidate, with a fixed scale of 1 otherwise, so that its statistics
  kernel still runs), and sets the optimizer's ``statistics_sink`` to a
  :class:`keras_mp.stats.LayerStatistics` attached to the model (which
  counts non-finite gradients only at the schedule's smallest scale: above
  it, an overflow is the loss scaler's to fix). This is how
  loss scaling is wired in without the user wrapping the optimizer: Keras's
  own auto-wrap fires only for the policy name ``"mixed_float16"``.
* every ``statistics_every`` train-function calls: runs the step whose
  optimizer has the sink set (the other steps run a second trace of the train
  function without it, so the statistics kernel costs nothing there);
* every ``interval`` train-function calls: reads the statistics once, asks
  :func:`keras_mp.controller.decide`, assigns the new dtypes in the policy and
  rebuilds the train function only if a dtype changed. Optimizer variables
  are untouched (variables stay float32 whatever the compute dtype).
* every epoch end: adds ``precision_switches`` (switches this epoch) and
  ``precision_narrow_layers`` (layers in the narrowest candidate) to the logs,
  so ``History`` records them; with ``log_dir``, writes per-layer scalars
  for TensorBoard.

Persistence: the per-layer dtypes and controller state live in the policy
(which Keras writes into every layer's config in a ``.keras`` file) and in
variables of a small state object attached to the model (which
``save_weights``, ``ModelCheckpoint``, ``BackupAndRestore`` and
``tf.train.Checkpoint(model=...)`` save and load). When ``fit`` starts, those
variables win if they differ from the policy: they were just restored.

Example:
    >>> import keras, numpy as np, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> cb = keras_mp.callbacks.AdaptivePrecision(interval=2)
    >>> h = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, epochs=2,
    ...               callbacks=[cb], verbose=0)
    >>> h.history["precision_switches"]
    [0, 0]
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from keras_mp import controller, execution, policies
from keras_mp import loss_scale as loss_scale_lib  # `loss_scale` is an argument below
from keras_mp.optimizer import LossScaleOptimizer
from keras_mp.stats import IntervalStats, LayerStatistics

__all__ = ["AdaptivePrecision"]

_STATE_FIELDS = ("dtype", "healthy", "cooldown", "switches", "strikes")
_STATS_ATTR = "_keras_mp_statistics"
_STATE_ATTR = "_keras_mp_precision_state"
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
).SerializeToString()
_BITS = {"float16": 16, "bfloat16": 16, "float32": 32}


def _scalar(tag: str, value: float) -> None:
    # tf.summary.scalar lives in the tensorboard package, which training
    # machines often lack; tf.summary.write with the scalars plugin's
    # metadata writes the same event without it.
    tf.summary.write(tag, tf.constant(float(value), tf.float32), metadata=_SCALAR_METADATA)


class _PrecisionState(keras.layers.Layer):
    """The controller's per-layer state as variables, so that checkpoints and
    ``BackupAndRestore`` carry it. Never called on data."""

    def __init__(self, paths: tuple[str, ...]):
        super().__init__(name="keras_mp_precision_state", dtype="float32", trainable=False)
        self.paths = paths
        kw = dict(trainable=False, aggregation="only_first_replica", initializer="zeros")
        self.table = self.add_weight(shape=(len(_STATE_FIELDS), len(paths)), dtype="int32",
                                     name="table", **kw)
        self.calls = self.add_weight(shape=(), dtype="int64", name="calls", **kw)
        self.built = True
        self._last: tuple | None = None  # what was last written or read, on the host

    def write(self, states: list[controller.LayerState], candidates: tuple[str, ...],
              calls: int) -> None:
        rows = [[candidates.index(s.dtype) for s in states]]
        rows += [[getattr(s, f) for s in states] for f in _STATE_FIELDS[1:]]
        self.table.assign(np.asarray(rows, np.int32))
        self.calls.assign(calls)
        self._last = (list(states), calls)

    def restored(self, candidates: tuple[str, ...]) -> bool:
        """Whether the variables changed since this process last wrote or read
        them: a checkpoint was loaded into them."""
        last = self._last  # read() replaces it
        return last is None or self.read(candidates) != last

    def read(self, candidates: tuple[str, ...]) -> tuple[list[controller.LayerState], int]:
        table = np.asarray(keras.ops.convert_to_numpy(self.table))
        states = [controller.LayerState(
            candidates[min(int(table[0, i]), len(candidates) - 1)],
            *(int(table[j, i]) for j in range(1, len(_STATE_FIELDS))))
            for i in range(len(self.paths))]
        calls = int(keras.ops.convert_to_numpy(self.calls))
        self._last = (states, calls)
        return states, calls

    def call(self, inputs):  # pragma: no cover - never called on data
        raise TypeError("_PrecisionState holds state; it is not called on data.")


def _scale_floor(schedule: loss_scale_lib.LossScaleSchedule) -> float | None:
    """The smallest scale ``schedule`` reaches (None if unknown: every
    non-finite step then counts against the layers)."""
    if not schedule.is_dynamic:
        return float(schedule.scale(schedule.initial_state()))
    floor = getattr(schedule, "min_scale", None)
    return float(floor) if floor is not None else None


def _attached(model: keras.Model, attr: str, cls, paths: tuple[str, ...], make):
    """``(object, created)``: the ``cls`` attached to ``model`` as ``attr``
    for these layer paths, attaching a new one if there is none."""
    obj = getattr(model, attr, None)
    if isinstance(obj, cls) and obj.paths == paths:
        return obj, False
    with model.distribute_strategy.scope():
        obj = make()
    # Bypasses Keras's tracking on purpose: tracked, it would become one of
    # model.layers and change model.weights. Keras's saving walks plain
    # attributes, so .keras/.weights.h5 files still carry its variables;
    # TensorFlow's own dependency (what Keras's tracking would also have
    # added) makes tf.train.Checkpoint(model=...) carry them too.
    object.__setattr__(model, attr, obj)
    model._track_trackable(obj, name=attr, overwrite=True)
    return obj, True


class AdaptivePrecision(keras.callbacks.Callback):
    """Chooses each layer's compute dtype during ``fit`` from live gradient
    statistics (see the module docstring for what happens when).

    Args:
        interval: train-function calls between decisions, an int >= 1. Each
            decision reads a few small variables from the device once.
        statistics_every: statistics are gathered on one train-function call
            in this many (an int in ``[1, interval]``); the others run a
            second compiled train function without the statistics kernel.
            None: ``min(10, max(1, interval // 10))``, about ten samples per
            decision (every step for intervals below 20). 1 gathers them
            every step (the most responsive, and the costliest: a pass over
            every gradient each step).
        loss_scale: the schedule used when the callback wraps the optimizer
            (anything :class:`keras_mp.LossScaleOptimizer` accepts as
            ``schedule``); None: ``"dynamic"`` when float16 is a candidate,
            a fixed scale of 1 otherwise. Ignored if the optimizer already is
            a :class:`keras_mp.LossScaleOptimizer`.
        log_dir: a directory for TensorBoard scalars (per layer: compute
            bits and key statistics; the loss scale; switches), or None.
        verbose: 1 prints every switch.

    Attributes:
        events: every switch made so far, as dicts with ``step``, ``layer``,
            ``old``, ``new`` and ``reason``.

    Use in a custom training loop: call :meth:`set_model` once (it wraps
    ``model.optimizer``; use that optimizer's ``scale_loss`` and ``apply``),
    then :meth:`step_end` after each step; when it returns switches, trace the
    train step again (e.g. build a new ``tf.function``). There statistics
    are gathered on every step (``statistics_every`` applies to ``fit``).
    """

    def __init__(self, interval: int = 100, *, statistics_every: int | None = None,
                 loss_scale: Any = None, log_dir: str | None = None, verbose: int = 0):
        super().__init__()
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"`interval` must be an int >= 1, got {interval!r}.")
        if statistics_every is None:
            # About ten samples per decision, and never fewer than one step
            # in ten: short intervals sample every step.
            statistics_every = min(10, max(1, interval // 10))
        if isinstance(statistics_every, bool) or not isinstance(statistics_every, int) \
                or not 1 <= statistics_every <= interval:
            raise ValueError("`statistics_every` must be an int in [1, interval] = "
                             f"[1, {interval}], got {statistics_every!r}.")
        if log_dir is not None and not isinstance(log_dir, str):
            raise TypeError(f"`log_dir` must be a path string or None, got {log_dir!r}.")
        if verbose not in (0, 1):
            raise ValueError(f"`verbose` must be 0 or 1, got {verbose!r}.")
        if loss_scale is not None:
            try:
                loss_scale_lib.get(loss_scale)
            except (ValueError, TypeError) as e:
                raise ValueError(
                    "`loss_scale` must be None, a keras_mp LossScaleSchedule, 'dynamic', a "
                    f"number (a fixed scale) or a serialized schedule, got {loss_scale!r}."
                ) from e
        self.interval = interval
        self.statistics_every = statistics_every
        self._functions: tuple | None = None
        self.loss_scale = loss_scale
        self.log_dir = log_dir
        self.verbose = verbose
        self.events: list[dict[str, Any]] = []
        self._writer = None
        self._policy: policies.AdaptivePolicy | None = None
        self._calls = 0
        self._epoch_switches = 0
        self._restored = False

    # -- set-up ------------------------------------------------------------

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        policy = policies.policy_of(model)
        if policy is None:
            raise ValueError(
                "AdaptivePrecision needs a model whose layers use a keras_mp.AdaptivePolicy: "
                "call keras_mp.set_global_policy('adaptive') (or 'adaptive_bfloat16', "
                "'adaptive_float16', or an AdaptivePolicy) before building the model.")
        layers = policies.adaptive_layers(model, policy)
        if not layers:
            raise ValueError("AdaptivePrecision found no layer with trainable variables under "
                             "the model's AdaptivePolicy.")
        self._policy = policy
        self._paths = tuple(layer.path for layer in layers)
        self._stats, _ = _attached(model, _STATS_ATTR, LayerStatistics, self._paths,
                                   lambda: LayerStatistics(layers))
        self._state, created = _attached(model, _STATE_ATTR, _PrecisionState, self._paths,
                                         lambda: _PrecisionState(self._paths))
        if created or not self._state.restored(policy.candidates):
            # Otherwise a checkpoint was just loaded into the variables: keep
            # them for on_epoch_begin to adopt.
            self._state.write(self._states(), policy.candidates, self._calls)
        optimizer = self._wrap_optimizer(model)
        execution.configure(model)  # XLA or graph: the faster measured here
        self._stats.scale_floor = _scale_floor(optimizer.schedule)
        optimizer.statistics_sink = self._stats.accumulate
        if optimizer is not getattr(self, "_optimizer", None) or model.train_function is None:
            # Recompiled, wrapped just now, or reset by the user: trace anew.
            # Otherwise a later fit reuses the traces of the last one.
            self._functions = None
        self._optimizer = optimizer
        self._restored = False

    def _wrap_optimizer(self, model: keras.Model) -> LossScaleOptimizer:
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise ValueError("AdaptivePrecision needs a compiled model (model.compile(...)) "
                             "or, in a custom loop, model.optimizer set.")
        if isinstance(opt, LossScaleOptimizer):
            return opt
        inner = opt.inner_optimizer if isinstance(opt, keras.optimizers.LossScaleOptimizer) \
            else opt
        schedule = self.loss_scale
        if schedule is None:
            schedule = "dynamic" if self._policy.uses_float16 else loss_scale_lib.FixedLossScale(1.0)
        with model.distribute_strategy.scope():
            wrapped = LossScaleOptimizer(inner, schedule=schedule)
            wrapped.build(model.trainable_variables)
        model.optimizer = wrapped
        compile_config = getattr(model, "_compile_config", None)
        if compile_config is not None and "optimizer" in getattr(compile_config, "config", {}):
            # So that a .keras file recompiles with the wrapped optimizer and
            # its saved variables (loss-scale state included) load into it.
            compile_config.config["optimizer"] = wrapped
        # A train function traced before the wrap would keep the old optimizer.
        model.train_function = None
        return wrapped

    # -- state -------------------------------------------------------------

    def _states(self) -> list[controller.LayerState]:
        out = []
        for path in self._paths:
            saved = self._policy.record(path).get("state")
            dtype = self._policy.dtype_of(path)
            if saved and saved.get("dtype") == dtype:
                out.append(controller.LayerState(**saved))
            else:
                out.append(controller.LayerState(dtype))
        return out

    def _restore_from_variables(self) -> None:
        """Adopts the state variables if they differ from the policy: a
        checkpoint (e.g. ``BackupAndRestore``) was loaded into them."""
        states, calls = self._state.read(self._policy.candidates)
        self._calls = calls
        if states == self._states():
            return
        changed = False
        for path, state in zip(self._paths, states):
            changed |= self._policy.dtype_of(path) != state.dtype
            self._policy.assign(path, state.dtype)
            self._policy.record(path)["state"] = state.get_config()
        if changed:
            self._rebuild()

    def _rebuild(self) -> None:
        self._functions = None  # both train functions are rebuilt at the next step
        model = self.model
        if getattr(model, "train_function", None) is not None:
            model.make_train_function(force=True)
        model.test_function = None
        model.predict_function = None

    def _train_functions(self) -> tuple:
        """(with statistics, without), each traced on its first call.

        The optimizer reads ``statistics_sink`` when the step is traced, so
        each wrapper sets it before calling: the first call traces with the
        sink (or without), later calls reuse that trace.
        """
        if self._functions is None:
            model, opt, sink = self.model, self._optimizer, self._stats.accumulate

            def bind(fn, value):
                def call(*args, **kwargs):
                    opt.statistics_sink = value
                    return fn(*args, **kwargs)
                return call

            model.make_train_function(force=True)
            with_stats = bind(model.train_function, sink)
            if self.statistics_every == 1:
                without = with_stats
            else:
                model.make_train_function(force=True)
                without = bind(model.train_function, None)
            self._functions = (with_stats, without)
        return self._functions

    # -- Keras hooks -------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._restored = False

    def on_epoch_begin(self, epoch, logs=None):
        if not self._restored:
            # Not in on_train_begin: BackupAndRestore may restore after us there.
            self._restore_from_variables()
            self._restored = True
        self._epoch_switches = 0

    def on_train_batch_begin(self, batch, logs=None):
        # Statistics cost a pass over every gradient; sampling them keeps a
        # well-behaved run's step close to plain mixed precision.
        sample = (self._calls + 1) % self.statistics_every == 0
        self.model.train_function = self._train_functions()[0 if sample else 1]

    def on_train_batch_end(self, batch, logs=None):
        self.step_end()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["precision_switches"] = self._epoch_switches
            narrow = self._policy.candidates[0]
            logs["precision_narrow_layers"] = sum(
                self._policy.dtype_of(p) == narrow for p in self._paths)

    def on_train_end(self, logs=None):
        # Custom loops and later fits see the sink set, as after set_model.
        self._optimizer.statistics_sink = self._stats.accumulate
        if self._writer is not None:
            self._writer.flush()

    # -- decisions ---------------------------------------------------------

    def step_end(self) -> list[dict[str, Any]]:
        """Counts one train-function call; every ``interval`` calls, decides.

        Returns:
            The switches made now (usually none).
        """
        if self._policy is None:
            raise ValueError("Call set_model(model) before step_end().")
        self._calls += 1
        if self._calls % self.interval:
            return []
        return self.update()

    def update(self) -> list[dict[str, Any]]:
        """Decides now on the statistics accumulated since the last decision,
        applies the switches and starts a new interval.

        Returns:
            The switches made, as dicts (see :attr:`events`).
        """
        interval = self._stats.read()
        self._stats.reset()
        if interval.steps == 0:
            return []
        policy = self._policy
        decision = controller.decide(interval.layers, self._states(), policy.candidates,
                                     policy.rule, all_nonfinite=interval.all_nonfinite)
        made = []
        for sw in decision.switches:
            path = self._paths[sw.layer]
            policy.assign(path, sw.new)
            event = {"step": self._calls, "layer": path, "old": sw.old, "new": sw.new,
                     "reason": sw.reason}
            policy.record(path).setdefault("history", []).append(
                {k: v for k, v in event.items() if k != "layer"})
            made.append(event)
            if self.verbose:
                print(f"keras_mp: {path}: {sw.old} -> {sw.new} ({sw.reason}) "
                      f"at call {self._calls}")
        for path, state, stats in zip(self._paths, decision.states, interval.layers):
            record = policy.record(path)
            record["state"] = state.get_config()
            record["stats"] = {k: v for k, v in vars(stats).items()}
        self._state.write(list(decision.states), policy.candidates, self._calls)
        self.events.extend(made)
        self._epoch_switches += len(made)
        self._log(interval, made)
        if made:
            self._rebuild()
        return made

    def _log(self, interval: IntervalStats, made: list[dict[str, Any]]) -> None:
        if self.log_dir is None:
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default(step=self._calls):
            _scalar("precision/switches", len(made))
            _scalar("precision/loss_scale", interval.mean_scale)
            for path, stats in zip(self._paths, interval.layers):
                _scalar(f"precision/{path}/bits", _BITS[self._policy.dtype_of(path)])
                for key in ("nonfinite", "fp16_subnormal", "fp16_overflow", "bf16_subnormal"):
                    _scalar(f"precision/{path}/{key}", getattr(stats, key))
