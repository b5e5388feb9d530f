"""A long fit measures only once its first calls show that it is long in seconds.

Before a fit's train step runs in a measured mode, keras-mp measures: the
placement of fused matmuls in a child process
(:func:`keras_mp.execution.placement.measure_elsewhere`, seconds of wall
time, most of them importing TensorFlow) and the execution trial
(:mod:`keras_mp.execution.step_trial`: each candidate mode traced, compiled
and timed). A fit of fewer than :data:`keras_mp.execution.reasons.SHORT_FIT`
calls measures nothing; but a thousand calls of a small step take seconds.
keras.io's collaborative-filtering recommender (2,814 calls of about 2 ms,
2-core AMD EPYC with AVX512-BF16, an empty cache) spent 5.4 s from the fit's
start to the end of its first call (the child process, the trial and its XLA
compilation) against Keras's 0.55 s (pinned to XLA, it also compiled again
for the epoch's partial last batch), and its whole ``fit`` took 2.3x the
wall time of Keras ``mixed_bfloat16``'s; pinned to the graph, 1.06x.

So in a fit of known length the first :data:`FIRST_CALLS` calls train as a
TensorFlow graph without XLA (as Keras trains on a CPU), each timed (wall
clock, its result waited for); then, from the median call after the first
(which traces)::

    projected = median_call_s * fit_calls
    if projected < TRIAL_AFTER_S:    # measuring could not pay for itself
        keep the graph for this set of compute dtypes
    else:
        measure as before (child process, trial), from the next call on

A trial and its child process cost about 5 s on the machine above, and the
best mode won 15-25 % of a step where it won (the recommender: XLA 1.4-1.7
against 1.7-2.0 ms): only a fit of a minute or more repays that.

A decision made from a timing follows keras-mp's one rule for them
(docs/architecture.md, "Decisions made from timings"): the median is kept on
disk (:mod:`keras_mp.device.cache`, keyed by the model's step signature and
its batches' spec), a later process takes it from there, and the decision is
a function of the kept figure and the fit's length, so a seeded fit repeats
bit for bit with an empty cache and a full one. Every call of the fit trains
on its own batch: nothing is timed on a copy.

Example:
    >>> calls = []
    >>> fn = FirstCalls(calls.append, then=lambda: calls.append, keep=lambda why: None,
    ...                 key=None, fit_calls=2000)
    >>> for i in range(3):
    ...     fn(i)
    >>> calls
    [0, 1, 2]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_mp.device import cache as disk

__all__ = ["FIRST_CALLS", "TRIAL_AFTER_S", "FirstCalls", "projected"]

#: Calls of a fit that train as a graph, timed, before anything is measured.
FIRST_CALLS = 10
#: A fit whose calls at the graph's pace would take less than this (seconds)
#: measures nothing: it keeps the graph.
TRIAL_AFTER_S = 60.0
_SECTION = "first_calls"


def projected(per_call_s: float, fit_calls: int) -> str | None:
    """Why measuring cannot pay for itself in a fit of ``fit_calls`` calls
    of ``per_call_s`` seconds each as a graph (None where it may).

    Example:
        >>> projected(0.002, 2814)[:40]
        'its 2814 calls take about 5.6 s as a gra'
        >>> projected(0.1, 2000) is None
        True
    """
    if isinstance(per_call_s, bool) or not isinstance(per_call_s, (int, float)) \
            or not per_call_s >= 0:
        raise ValueError(f"`per_call_s` must be a number >= 0, got {per_call_s!r}.")
    if isinstance(fit_calls, bool) or not isinstance(fit_calls, int) or fit_calls < 0:
        raise ValueError(f"`fit_calls` must be an int >= 0, got {fit_calls!r}.")
    seconds = per_call_s * fit_calls
    if seconds >= TRIAL_AFTER_S:
        return None
    return (f"its {fit_calls} calls take about {seconds:.1f} s as a graph "
            f"({per_call_s * 1e3:.2f} ms each), less than {TRIAL_AFTER_S:.0f} s: too short "
            "for measuring (a child process, the trial of each mode, their XLA "
            "compilations) to pay for itself")


def _sync(out: Any) -> None:
    for t in tf.nest.flatten(out):
        if hasattr(t, "numpy"):
            t.numpy()
            return


class FirstCalls:
    """A train function whose first :data:`FIRST_CALLS` calls run ``graph``,
    timed; on the next call it either keeps ``graph`` (``keep(why)`` is
    told why) or calls ``then()`` for the train function to use from then
    on (the measured one). Calls after that go to the chosen function.

    Args:
        graph: the graph train function (it trains).
        then: returns the train function that measures (and then trains).
        keep: called once with the reason where the graph is kept.
        key: what identifies the model's step on disk (with the batches'
            spec), or None: the median is neither read nor kept.
        fit_calls: the calls of the coming fit.
    """

    def __init__(self, graph: Callable[[Any], Any], then: Callable[[], Callable[[Any], Any]],
                 keep: Callable[[str], None], key: str | None, fit_calls: int):
        for name, fn in (("graph", graph), ("then", then), ("keep", keep)):
            if not callable(fn):
                raise TypeError(f"`{name}` must be callable, got {fn!r}.")
        if key is not None and not isinstance(key, str):
            raise TypeError(f"`key` must be a str or None, got {key!r}.")
        if isinstance(fit_calls, bool) or not isinstance(fit_calls, int) or fit_calls < 0:
            raise ValueError(f"`fit_calls` must be an int >= 0, got {fit_calls!r}.")
        self._graph, self._then, self._keep = graph, then, keep
        self._key, self._fit_calls = key, fit_calls
        self._walls: list[float] = []
        self._next: Callable[[Any], Any] | None = None

    @property
    def decided(self) -> bool:
        """Whether the first calls are over (the graph kept or measuring)."""
        return self._next is not None

    def __call__(self, iterator):
        if self._next is None and len(self._walls) >= FIRST_CALLS:
            self._next = self._choose(getattr(iterator, "element_spec", None))
        if self._next is not None:
            return self._next(iterator)
        w0 = time.perf_counter()
        out = self._graph(iterator)
        _sync(out)
        self._walls.append(time.perf_counter() - w0)
        return out

    def _choose(self, spec: Any) -> Callable[[Any], Any]:
        per_call = statistics.median(self._walls[1:] or self._walls)
        key = None if self._key is None else f"{self._key}/{spec!r}"
        kept = None if key is None else disk.get(_SECTION, key)
        if isinstance(kept, (int, float)) and not isinstance(kept, bool) and kept >= 0:
            per_call = float(kept)   # a later process decides as the first did
        elif key is not None:
            disk.put(_SECTION, key, per_call)
        why = projected(per_call, self._fit_calls)
        if why is not None:
            self._keep(why)
            return self._graph
        return self._then()
