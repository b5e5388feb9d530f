"""The train functions adaptive precision switches between, one per kind of step.

:class:`keras_mp.callbacks.AdaptivePrecision` runs three kinds of step:
plain, statistics (one in ``statistics_every``) and probe (one in
``probe_every``). What a step records is fixed when it is traced (the flags of
:meth:`keras_mp.adaptive.hooks.Hooks.recording`), so each kind is a train
function of its own, traced on its first call.

Plain and statistics steps share **one trace** where they can (a *gated* trace,
:mod:`keras_mp.adaptive.hooks`: the statistics run under a switch the step
reads, and the forward statistics of all layers under one ``tf.cond``), so
that the process does not hold a second copy of the whole step. They cannot
where every step records statistics (``statistics_every=1``), or where a
float8-capable layer's call differs on statistics steps. The trace is shared
from the first call, the execution trial's too
(:mod:`keras_mp.execution.step_trial`): it times the shared trace's plain
steps, and statistics steps run untimed (:func:`~keras_mp.execution.step_trial.untimed`),
so no step is traced twice for the trial's sake.

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
    >>> from keras_mp.adaptive.step_functions import StepFunctions
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

import contextlib
from collections.abc import Callable
from typing import Any

import keras

from keras_mp.execution import step_trial
from keras_mp.adaptive.hooks import Hooks
from keras_mp.device import memory
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["StepFunctions"]


class StepFunctions:
    """The (plain, statistics, probe) train functions of one model.

    Args:
        model: the compiled Keras model.
        optimizer: its optimizer; a :class:`keras_mp.LossScaleOptimizer` gets
            its ``statistics_sink`` set on statistics steps only.
        hooks: the model's :class:`keras_mp.adaptive.hooks.Hooks`.
        sink: where the optimizer hands a step's statistics.
        probe: whether probe steps get a trace of their own (else they run
            the statistics step).
        gateable: whether plain and statistics steps may share one trace.

    Attributes:
        shared: whether plain and statistics steps share one trace now.
        functions: ``(plain, statistics, probe)``.
    """

    def __init__(self, model: keras.Model, optimizer: Any, hooks: Hooks,
                 sink: Callable[..., None], *, probe: bool, gateable: bool):
        if not isinstance(hooks, Hooks):
            raise TypeError(f"`hooks` must be a keras_mp Hooks, got {type(hooks).__name__}.")
        self._model, self._optimizer, self._hooks, self._sink = model, optimizer, hooks, sink
        self._gateable = bool(gateable)
        self.shared = self._gateable
        if self.shared:
            hooks.switch()  # created here, outside any trace
            both = self._variant(True, False, gated=True)
            plain, stats = self._switched(both, False), self._switched(both, True)
        else:
            plain, stats = self._variant(False, False), self._variant(True, False)
        self.functions = (plain, stats, self._variant(True, True) if probe else stats)

    def _variant(self, forward: bool, probe: bool, gated: bool = False) -> Callable[..., Any]:
        model, opt, hooks, sink = self._model, self._optimizer, self._hooks, self._sink
        own_sink = isinstance(opt, LossScaleOptimizer)
        model.make_train_function(force=True)
        fn = model.train_function

        def call(*args, **kwargs):
            if own_sink:
                opt.statistics_sink = sink if forward else None
            with hooks.recording(forward=forward, probe=probe, gated=gated):
                return fn(*args, **kwargs)
        # Its first call traces and compiles: the heap it freed goes back.
        return memory.released_after_first_call(call)

    def _switched(self, fn: Callable[..., Any], on: bool) -> Callable[..., Any]:
        hooks = self._hooks

        def call(*args, **kwargs):
            hooks.set_statistics(on)
            # A statistics step is slower: the execution trial does not time it.
            with step_trial.untimed() if on else contextlib.nullcontext():
                return fn(*args, **kwargs)
        return call
