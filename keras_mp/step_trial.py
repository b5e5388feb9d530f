"""The model's own train step, timed as a TensorFlow graph and under XLA.

A micro-benchmark cannot tell whether XLA speeds a given model up: on a Xeon
with AMX-BF16, XLA made an elementwise-heavy bfloat16 probe step 0.8-1.1x
the graph's speed (it varied from run to run), while it made a small
bfloat16 CNN 3x slower (XLA:CPU runs convolutions and matmuls without AMX,
oneDNN in the TensorFlow graph uses it). So ``mode="auto"`` in
:func:`keras_mp.execution.configure` measures the model itself, on the
batches it trains on (nothing is computed twice, no batch is skipped):

* the first calls of the train function alternate between a TensorFlow
  graph and an XLA build of the same step: graph, XLA (tracing and
  compilation), graph, XLA (warm-up, untimed), then :data:`PAIRS` timed pairs;
* XLA is kept when its median call is at least
  :data:`keras_mp.execution.MARGIN` times faster than the graph's by process
  CPU time **and** by wall time; otherwise the graph is kept;
* the decision holds for the model and its set of compute dtypes (a new
  set, after adaptive precision changes a layer's dtype, is measured anew);
  it is logged once (logger ``keras_mp``, INFO) with the figures.

The cost: one XLA compilation of the train step and ``2 + PAIRS`` calls of
the slower mode. If XLA cannot compile the step, the same batch is rerun
as a graph, one warning says so, and the graph is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

__all__ = ["PAIRS", "Record", "StepTrial", "FirstCallGuard"]

#: Timed (graph, XLA) pairs of calls before the decision.
PAIRS = 4
_WARMUP = 2  # untimed calls of each mode: tracing/compilation, then one more

_log = logging.getLogger("keras_mp")


@dataclasses.dataclass
class Record:
    """What was measured for one model and set of compute dtypes.

    Attributes:
        owner: id of the :class:`StepTrial` that runs the measurement (the
            first one called); other train functions of the model (the
            adaptive-precision statistics and probe variants) run as a graph
            until the decision.
        calls: calls of the owner so far.
        samples: ``{"graph": [(cpu_s, wall_s), ...], "xla": [...]}``.
        decision: ``"xla"``, ``"graph"`` or None while measuring.
    """

    owner: int | None = None
    calls: int = 0
    samples: dict[str, list[tuple[float, float]]] = dataclasses.field(
        default_factory=lambda: {"graph": [], "xla": []})
    decision: str | None = None

    def medians(self) -> dict[str, tuple[float, float]]:
        """Median (CPU s, wall s) per timed call of each mode."""
        return {mode: (statistics.median(c for c, _ in s), statistics.median(w for _, w in s))
                for mode, s in self.samples.items() if s}


def _sync(out: Any) -> None:
    for t in tf.nest.flatten(out):
        if hasattr(t, "numpy"):
            t.numpy()
            return


def _timed(fn: Callable[[Any], Any], data: Any, mode: str) -> tuple[Any, float, float]:
    """``fn(data)`` and the process CPU seconds and wall seconds it took
    (``mode`` names what runs; tests replace this function to fake clocks)."""
    del mode
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn(data)
    _sync(out)
    return out, time.process_time() - c0, time.perf_counter() - w0


def _take(iterator, count: int) -> list:
    """Up to ``count`` elements of a TF iterator, read eagerly."""
    batch = []
    for _ in range(count):
        opt = iterator.get_next_as_optional()
        if not opt.has_value():
            break
        batch.append(opt.get_value())
    if not batch:
        raise StopIteration
    return batch


class FirstCallGuard:
    """Runs an XLA train function; if its first call fails to compile,
    warns once, calls ``on_fail()`` for a graph train function and reruns
    the same data there.

    Args:
        model: the Keras model (its ``steps_per_execution`` is read).
        fn: the XLA train function.
        on_fail: returns the graph train function to use from now on.
        env_var: the environment variable named in the warning.
        known_failure: returns True where another train function of the
            model already failed to compile (then no new attempt, no new
            warning).
    """

    def __init__(self, model: keras.Model, fn: Callable[..., Any],
                 on_fail: Callable[[], Callable[..., Any]], env_var: str,
                 known_failure: Callable[[], bool] = lambda: False):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
        self._model, self._fn, self._on_fail, self._env = model, fn, on_fail, env_var
        self._known_failure = known_failure
        self._checked = False
        self.failed = False

    def __call__(self, iterator):
        if self._checked:
            return self._fn(iterator)
        if self._known_failure():
            self._fn, self._checked, self.failed = self._on_fail(), True, True
            return self._fn(iterator)
        data = iterator
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            data = _take(iterator, self._model.steps_per_execution)
        try:
            out = self._fn(data)
        except (StopIteration, tf.errors.OutOfRangeError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - any compile failure: graph instead
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            _log.warning(
                "keras_mp: XLA could not compile this model's train step (%s: %s); training "
                "goes on as a TensorFlow graph, from this same batch. To skip the attempt: "
                "keras_mp.execution.configure(model, mode='graph') or %s=graph.",
                type(e).__name__, first, self._env)
            self.failed = True
            self._fn = self._on_fail()
            out = self._fn(data)
        self._checked = True
        return out


class StepTrial:
    """A train function that measures graph against XLA on its first calls
    (see the module docstring), then runs the faster.

    Args:
        record: the shared :class:`Record` of the model and dtype set.
        graph_fn: the train function built with ``jit_compile=False``.
        xla_fn: the same built with ``jit_compile=True``, wrapped in a
            :class:`FirstCallGuard`.
        margin: how much faster XLA must be, by both clocks.
        on_decision: called once with ``"xla"`` or ``"graph"``.
    """

    def __init__(self, record: Record, graph_fn: Callable[..., Any], xla_fn: FirstCallGuard,
                 margin: float, on_decision: Callable[[str], None]):
        if not isinstance(record, Record):
            raise TypeError(f"`record` must be a step_trial.Record, got {type(record).__name__}.")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 1.0:
            raise ValueError(f"`margin` must be a number >= 1, got {margin!r}.")
        self.record, self._graph, self._xla = record, graph_fn, xla_fn
        self._margin, self._on_decision = margin, on_decision

    def __call__(self, iterator):
        rec = self.record
        if rec.decision is not None:
            return (self._xla if rec.decision == "xla" else self._graph)(iterator)
        if rec.owner is None:
            rec.owner = id(self)
        if rec.owner != id(self):
            return self._graph(iterator)  # another variant measures; until then, graph
        mode = "graph" if rec.calls % 2 == 0 else "xla"
        fn = self._graph if mode == "graph" else self._xla
        out, cpu, wall = _timed(fn, iterator, mode)
        rec.calls += 1
        if self._xla.failed:
            self._decide("graph", "XLA could not compile the step")
        elif rec.calls > 2 * _WARMUP:
            rec.samples[mode].append((cpu, wall))
            if rec.calls >= 2 * (_WARMUP + PAIRS):
                self._decide_from_samples()
        return out

    def _decide_from_samples(self) -> None:
        med = self.record.medians()
        (gc, gw), (xc, xw) = med["graph"], med["xla"]
        speedup = min(gc / max(xc, 1e-12), gw / max(xw, 1e-12))
        why = (f"median per call over {PAIRS} interleaved pairs: graph {gc * 1e3:.1f} ms CPU / "
               f"{gw * 1e3:.1f} ms wall, XLA {xc * 1e3:.1f} / {xw * 1e3:.1f}")
        self._decide("xla" if speedup >= self._margin else "graph", why)

    def _decide(self, mode: str, why: str) -> None:
        self.record.decision = mode
        _log.info("keras_mp: this model's train step runs %s (%s).",
                  "under XLA" if mode == "xla" else "as a TensorFlow graph", why)
        self._on_decision(mode)
