"""The train functions adaptive precision switches between, one per kind of step.

:class:`keras_mp.callbacks.AdaptivePrecision` runs three kinds of step:
plain, statistics (one in ``statistics_every``) and probe (one in
``probe_every``). What a step records is fixed when it is traced (the flags of
:meth:`keras_mp.adaptive.evidence.hooks.Hooks.recording`), so each kind is a train
function of its own, traced on its first call.

A probe step is a statistics step and, before it, the float32 probe on the
same batch (:func:`probe_function`: the probe traced on its own, its
results accumulated across replicas): the probe step takes the batch from the
iterator itself and hands it to the statistics step, which runs the trace
already built (Keras's train function steps through a list of batches with
the same traced step). A probe traced into the step instead made one graph of
the step, its statistics and the probe's three forward and backward passes:
on ResNet50V2 (64x64, batch 16, 2-core AMD EPYC with AVX512-BF16, the graph,
a probe at call 30) its first call took the process from 1621 to 2287 MiB,
with a peak of 2726 MiB (1745 before); with the probe traced on its own,
from 1614 to 2167 MiB, peak 2167 (1797 before). On the bench's CNN the peak
after the first probe went from 952 to 916 MiB, on its Transformer from
1917 to 1842.

Plain and statistics steps share **one trace** where they can (a *gated* trace,
:mod:`keras_mp.adaptive.evidence.hooks`: the statistics run under a switch the step
reads, and the forward statistics of all layers under one ``tf.cond``), so
that the process does not hold a second copy of the whole step. They cannot
where every step records statistics (``statistics_every=1``), or where a
float8-capable layer's call differs on statistics steps. The trace is shared
from the first call, the execution trial's too
(:mod:`keras_mp.execution.step_trial`: it times the shared trace on the
first call, on a copy of the training state), so no step is traced twice
for the trial's sake.

Measured (2-core AMD EPYC with AVX512-BF16, peak process memory over 30
steps, fresh processes, the bench's models): with the step pinned to the
graph (``KERAS_MP_EXECUTION=graph``), one shared trace lowered ResNet50V2's
peak (64x64, batch 16) from 1976 to 1828 MiB, and one ``tf.cond`` for the
forward statistics instead of one per layer call to 1747 (Keras
``mixed_bfloat16``: 1621). Under the measured mode, sharing the trace from
the first call (and one trace for the trial's ``graph`` and ``xla_update``,
:mod:`keras_mp.execution.choice`) took ResNet50V2 from 2065 to 1701-1791 MiB
(Keras: 1628-1638).

Example:
    >>> import keras, numpy as np, keras_mp
    >>> from keras_mp.adaptive.integration.step_functions import StepFunctions
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> cb = keras_mp.callbacks.AdaptivePrecision(interval=4, probe_every=None)
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0,
    ...               callbacks=[cb])
    >>> isinstance(cb._functions, StepFunctions)
    True
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from keras_mp import _installed
from keras_mp.execution import choice, replay
from keras_mp.adaptive.integration import rescue
from keras_mp.adaptive.evidence.hooks import Hooks
from keras_mp.device import memory
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["EAGER_PROBES", "StepFunctions", "eager_probes", "probe_function", "replayed"]


#: A fit that makes at most this many probe calls runs them eagerly
#: (:func:`eager_probes`): about where the eager calls' dispatch outweighs
#: the one trace on keras.io's examples (see there).
EAGER_PROBES = 8


def eager_probes(model: keras.Model, expected: int | None, probe_every: int | None,
                 first: int | None) -> bool:
    """Whether the coming fit's probe calls run eagerly rather than traced: a
    fit of ``expected`` train-function calls (None: unknown) that probes on
    its early decision's call ``first`` (None: none) and on one call in
    ``probe_every`` makes at most :data:`EAGER_PROBES` probe calls, and the
    model has no distribution strategy of its own, no per-layer loss scales
    (run eagerly, a layer's input reaches its loss-scale boundary already cast
    to float16, so the gradient it hands back rounds there:
    :func:`keras_mp.scaling.layer_scales.cast_source`) and no layer Keras
    quantized (its float8 training call's custom gradient fails under an
    eager tape: "too many values to unpack"). A fixed rule (no timing), so a
    seeded fit runs its probe alike every time.

    Why: a traced probe is a trace and graph optimization of three forward
    and backward passes, paid once per set of dtypes (again after each
    switch); run eagerly, the same passes cost only their ops' dispatch. On
    keras.io's timeseries FCN (3 Conv1D + BatchNormalization, 69 calls,
    2-core AMD EPYC with AVX512-BF16) the probe step took 1.2-1.3 s traced and
    0.4 s eagerly. A long fit probes every ``probe_every`` calls, where the one
    trace is cheaper: on the collaborative-filtering recommender (2,814 calls,
    15 probe calls) a probe call took 0.05 s eagerly against 0.01 s traced,
    after a first traced one of 0.39 s (eagerly 0.11 s), so about 8 probe
    calls repay the trace there; about 8 on the FCN too.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> eager_probes(model, 69, 200, 20), eager_probes(model, 5000, 200, 20)
        (True, False)
        >>> eager_probes(model, None, 200, 20), eager_probes(model, 1600, 200, None)
        (False, True)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    for name, value in (("expected", expected), ("probe_every", probe_every),
                        ("first", first)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ValueError(f"`{name}` must be an int >= 0 or None, got {value!r}.")
    if expected is None or getattr(model, "_distribute_strategy", None) is not None:
        return False
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, LossScaleOptimizer) and optimizer.layer_scales:
        return False
    if any(getattr(layer, "quantization_mode", None) for layer in model._flatten_layers()):
        return False
    probes = (1 if first is not None and 0 < first <= expected else 0) + \
        (expected // probe_every if probe_every else 0)
    return probes <= EAGER_PROBES


def probe_function(model: keras.Model, run: Callable[[Any], Any],
                   accumulate: Callable[[Any], None], eager: bool = False
                   ) -> Callable[[Any], None]:
    """A function that runs the probe on one batch: ``run(data)`` (a
    :class:`keras_mp.adaptive.evidence.probe.ProbeResult`), then ``accumulate(result)``,
    in each replica of ``model``'s distribution strategy (a batch the
    strategy distributed, or one every replica gets whole).

    Args:
        model: the Keras model (its ``distribute_strategy``).
        run: the probe, ``run(data)`` -> result.
        accumulate: takes the result (it agrees across replicas).
        eager: run it eagerly, tracing nothing (:func:`eager_probes`).

    Returns:
        ``fn(batch)``, traced on its first call (once more for a batch of
        another shape, then for any batch size), or eager.

    Example:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> seen = []
        >>> fn = probe_function(model, lambda data: data[0] * 2.0, seen.append)
        >>> fn((np.ones((4, 2), "float32"), np.ones((4, 1), "float32")))
        >>> [t.shape.as_list() for t in seen]
        [[4, 2]]
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    for name, fn in (("run", run), ("accumulate", accumulate)):
        if not callable(fn):
            raise TypeError(f"`{name}` must be callable, got {fn!r}.")
    if not isinstance(eager, bool):
        raise TypeError(f"`eager` must be True or False, got {eager!r}.")
    strategy = model.distribute_strategy

    def replica(data):
        accumulate(run(data))

    if eager:
        def eager_step(batch):
            with choice.trace_scope(model):  # the same XLA choices as traced
                strategy.run(replica, args=(batch,))
        eager_step.eager = True
        return eager_step

    # No AutoGraph, as Keras's own train step (``do_not_convert``): the probe
    # is graph code already, and converting it with every layer's ``call``
    # it reaches took seconds (a one-Dense fit: 3.9 s of a 6.7 s fit).
    @tf.function(reduce_retracing=True, autograph=False)
    def probe_step(batch):
        with choice.trace_scope(model):  # traced as the model's train step is
            strategy.run(replica, args=(batch,))

    return memory.released_after_first_call(probe_step)


class StepFunctions:
    """The (plain, statistics, probe) train functions of one model.

    Args:
        model: the compiled Keras model.
        optimizer: its optimizer; a :class:`keras_mp.LossScaleOptimizer` gets
            its ``statistics_sink`` set on statistics steps only.
        hooks: the model's :class:`keras_mp.adaptive.evidence.hooks.Hooks`.
        sink: where the optimizer hands a step's statistics.
        probe: a :func:`probe_function` for probe steps, or None (they run
            the statistics step).
        gateable: whether plain and statistics steps may share one trace.

    Attributes:
        shared: whether plain and statistics steps share one trace now.
        functions: ``(plain, statistics, probe)``.
    """

    def __init__(self, model: keras.Model, optimizer: Any, hooks: Hooks,
                 sink: Callable[..., None], *, probe: Callable[[Any], None] | None,
                 gateable: bool):
        if not isinstance(hooks, Hooks):
            raise TypeError(f"`hooks` must be a keras_mp Hooks, got {type(hooks).__name__}.")
        if probe is not None and not callable(probe):
            raise TypeError(f"`probe` must be None or callable, got {probe!r}.")
        self._model, self._optimizer, self._hooks, self._sink = model, optimizer, hooks, sink
        self._gateable = bool(gateable)
        self.shared = self._gateable
        if self.shared:
            hooks.switch()  # created here, outside any trace
            both = self._variant(True, gated=True)
            plain, stats = self._switched(both, False), self._switched(both, True)
        else:
            plain, stats = self._variant(False), self._variant(True)
        self.functions = (plain, stats, stats if probe is None else self._probing(stats, probe))

    def _variant(self, forward: bool, gated: bool = False) -> Callable[..., Any]:
        model, opt, hooks, sink = self._model, self._optimizer, self._hooks, self._sink
        own_sink = isinstance(opt, LossScaleOptimizer)
        model.make_train_function(force=True)
        fn = model.train_function

        def call(*args, **kwargs):
            if own_sink:
                opt.statistics_sink = sink if forward else None
            with hooks.recording(forward=forward, gated=gated), rescue.explaining(model):
                return fn(*args, **kwargs)
        # Its first call traces and compiles: the heap it freed goes back.
        return memory.released_after_first_call(call)

    def _switched(self, fn: Callable[..., Any], on: bool) -> Callable[..., Any]:
        hooks = self._hooks

        def call(*args, **kwargs):
            hooks.set_statistics(on)
            return fn(*args, **kwargs)
        return call

    def _probing(self, stats: Callable[..., Any], probe: Callable[[Any], None]
                 ) -> Callable[..., Any]:
        """The probe step: ``probe`` on the first batch, then the statistics
        step on the batches taken (``steps_per_execution`` of them)."""
        model = self._model

        def call(iterator):
            batches = list(itertools.islice(iterator, int(model.steps_per_execution or 1)))
            if not batches:
                raise StopIteration  # as Keras's train function, at the data's end
            probe(batches[0])
            return stats(replayed(batches, iterator))
        return call


def replayed(batches: list, iterator: Any) -> Any:
    """``batches`` (read from ``iterator``) as an iterator of ``iterator``'s
    ``element_spec`` where ``iterator`` is a ``tf.data`` one and such an
    iterator can be made (:func:`keras_mp.execution.replay.iterator_over`:
    Keras's train function then runs them through the function it traced for
    the fit), else the list.

    Example:
        >>> import tensorflow as tf
        >>> it = iter(tf.data.Dataset.from_tensor_slices((tf.ones([4, 2]), tf.ones([4]))).batch(2))
        >>> isinstance(replayed([next(it)], it), tf.data.Iterator), replayed([1, 2], iter([3]))
        (True, [1, 2])
    """
    if not isinstance(batches, list):
        raise TypeError(f"`batches` must be a list, got {type(batches).__name__}.")
    if not isinstance(iterator, tf.data.Iterator):
        return batches
    again = replay.iterator_over(batches, iterator.element_spec)
    return batches if again is None else again


def keras_train_step(model: keras.Model) -> bool:
    """Whether ``model`` trains with Keras's own ``train_step`` (the probe
    repeats what it does; a custom one may do anything)."""
    own = _installed.original(model, "train_step")
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return getattr(own, "__func__", None) is TensorFlowTrainer.train_step


def first_call(first_decision: int | None, interval: int, steps: int | None,
               calls: int, total: int | None = None) -> int | None:
    """The call of a ``fit``'s early decision, or None: in a fit from scratch
    (``calls`` == 0), after ``first_decision`` calls or the epoch's ``steps``
    if fewer, when that comes before ``interval`` and before the fit's last
    call (``total`` calls, where known). A decision on the last call changes
    nothing in the fit, and its probe is a trace and compilation of its own:
    28 s of a 56 s one-epoch, 8-step fit of MobileNetV3Small (32x32, float16
    on a 2-core AMD EPYC; Keras ``mixed_float16`` fitted it in 36 s).

    Example:
        >>> first_call(20, 100, 50, 0), first_call(20, 100, 8, 0), first_call(20, 10, 50, 0)
        (20, 8, None)
        >>> first_call(20, 100, 8, 0, total=8), first_call(20, 100, 8, 0, total=16)
        (None, 8)
    """
    if first_decision is None or calls:
        return None
    first = min(first_decision, steps or first_decision)
    if total is not None and first >= total:
        return None
    return first if first < interval else None


def kind_of_call(call: int, statistics_every: int, probe_every: int | None,
                 first: int | None, start: int = 0, next_probe: int | None = None) -> int:
    """Which train function a call runs: 0 plain, 1 statistics, 2 probe.
    In a window of early judgement, from call ``start`` to a decision at
    ``first``: five statistics samples and the probe on its call; then one
    call in ``statistics_every``, and the probe on one call in
    ``probe_every`` or, where ``next_probe`` is given (fit's
    :class:`keras_mp.adaptive.decisions.probe_schedule.ProbeSchedule`), from
    that call on.

    Example:
        >>> [kind_of_call(c, 20, 200, 20) for c in (3, 4, 20, 40, 200)]
        [0, 1, 2, 1, 2]
        >>> [kind_of_call(c, 20, 200, 105, start=100) for c in (101, 104, 105, 106)]
        [1, 1, 2, 0]
        >>> [kind_of_call(c, 20, 200, None, next_probe=400) for c in (200, 400)]
        [1, 2]
    """
    early = first is not None and start < call <= first
    if probe_every is None:
        probe = False
    else:
        periodic = call % probe_every == 0 if next_probe is None else call >= next_probe
        probe = periodic or (early and call == first)
    every = max(1, (first - start) // 5) if early else statistics_every
    return 2 if probe else 1 if (call - (start if early else 0)) % every == 0 else 0
