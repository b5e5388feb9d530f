"""The model's own train step, timed in each execution mode it can use, on
a copy of its training state.

A micro-benchmark cannot tell whether XLA speeds a given model up: on a Xeon
with AMX-BF16, XLA made an elementwise-heavy bfloat16 probe step 0.8-1.1x
the graph's speed (it varied from run to run), while it made a small
bfloat16 CNN 3x slower (XLA:CPU runs convolutions and matmuls without AMX,
oneDNN in the TensorFlow graph uses it). So ``mode="auto"`` in
:func:`keras_mp.execution.configure` measures the model itself, on the
batch it trains on. The modes: ``"graph"`` (a TensorFlow graph, Keras's
default), ``"xla_update"`` (the same graph with only the optimizer's update
compiled by XLA, :mod:`keras_mp.execution.fused_update`) and ``"xla"`` (the
whole step compiled). They round differently (XLA keeps float32 between
fused operations), so the mode is one of keras_mp's decisions made from
timings, which all follow one rule (docs/architecture.md, "Decisions
made from timings"): the training steps are the same whatever was measured.

* the trial runs when the model's train function is first called with a set
  of compute dtypes, before that call trains: each mode runs on the call's
  batch, one call each (tracing and compilation), one more each (warm-up,
  untimed), then :data:`PAIRS` timed rounds, and after each of these calls
  the training state is put back as it was (:func:`training_state`); then
  the call trains, in the chosen mode, on the same batch;
* a mode other than the graph is kept when its median call is at least
  :data:`keras_mp.execution.MARGIN` times faster than the graph's by process
  CPU time **and** by wall time (the fastest such mode, by the smaller of
  its two speed-ups); otherwise the graph is kept;
* the decision holds for the model and its set of compute dtypes (a new
  set, after adaptive precision changes a layer's dtype, is measured anew,
  in the same way); it is logged once (logger ``keras_mp``, INFO) with the
  figures;
* the decision is kept on disk (:mod:`keras_mp.device.cache`), keyed by the
  device, the model's step (:func:`keras_mp.execution.start_up.signature`,
  the modes tried) and the shapes of its batches: a later process training
  the same model on batches of the same shapes takes it on its first call
  and measures nothing (on the keras-io "customizing fit" model the trial
  took 3-8 s of a fit Keras ran in 1.4 s). Every step trains in the mode
  decided, from the first: a seeded run with the decision measured (an
  empty cache) and one with it read back train the same weights, bit for
  bit (``tests/test_seeded_runs.py``).

The cost: one XLA compilation of each mode, ``2 + PAIRS`` calls of each
mode (:func:`calls_to_decide`), none of which trains, and, while it runs, a
copy of the training state in host memory. If a mode cannot compile, one
warning says so, and the trial goes on without that mode.

Memory: the graph and ``"xla_update"`` run one trace, which holds the update
both ways under a ``tf.cond`` (:func:`keras_mp.execution.fused_update.switched`),
so that trying the update under XLA does not trace the whole step a second
time. (On ResNet50V2, 64x64, batch 16, 2-core AMD EPYC, with adaptive
precision: the peak fell from 2065 to 1933 MiB.) Once decided, the trial
drops the other modes' train functions, so that their traces can be freed;
for that, each mode's first call hands the custom gradients its trace
registered over to its graph (:mod:`keras_mp._gradients`): TensorFlow's
gradient registry would otherwise keep every trace for good (149 MiB came
back without it, the traces' runtime part alone). What a mode's first call
grew stays in the process's peak, though, and TensorFlow's CPU allocator keeps
every region it grew.

So a mode is tried only where what it adds fits (``memory_cost``): after the
graph's first call, its estimate must be at most :data:`MEMORY_BUDGET` of the
process's resident memory (the allocator's peak on a GPU); otherwise the mode
is skipped, and one INFO message says so. The whole step compiled by XLA
holds its own copy of the step's tensors: on a 2-block Transformer (T=256,
d=512, batch 64, bfloat16, 2-core AMD EPYC) trying it raised the process's
peak from 2.9 to 5.1 GB, against 3.2 GB for Keras's ``mixed_bfloat16``
(``python -m benchmarks.transformer_memory``). Its estimate
(:mod:`keras_mp.execution.choice`) is what the graph step's tensors took on
its first call (TensorFlow's allocator peak during the call, its statistics
reset before it, minus what was live before; or the process's growth where
the allocator keeps no statistics). A model adapting among float32 alone
(:func:`keras_mp.execution.reasons.float32_class`) is tried under XLA
whatever that copy takes: Keras's best one-liner there is float32 with XLA,
which holds it too. The update under XLA keeps compiled code
per variable; where that would not fit, it is not a candidate at all
(:func:`keras_mp.execution.candidate_modes`, checked before anything is
traced).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _installed
from keras_mp.device import cache as disk
from keras_mp.device import memory
from keras_mp.execution import replay

__all__ = ["PAIRS", "MEMORY_BUDGET", "Record", "StepTrial", "FirstCallGuard",
           "calls_to_decide", "training_state"]

#: Timed rounds (one call of each mode) before the decision.
PAIRS = 4
#: A mode is tried only where what it would add (``memory_cost``) is at most
#: this fraction of the memory the process holds.
MEMORY_BUDGET = 0.05
_WARMUP = 2  # untimed calls of each mode: tracing/compilation, then one more
_NAMES = {"graph": "as a TensorFlow graph", "xla": "under XLA",
          "xla_update": "as a TensorFlow graph with the optimizer update under XLA"}


def calls_to_decide(modes: int) -> int:
    """Calls of the train functions a trial of ``modes`` modes makes on a
    copy of the training state before deciding (none of them trains).

    >>> calls_to_decide(3)
    18
    """
    if isinstance(modes, bool) or not isinstance(modes, int) or modes < 2:
        raise ValueError(f"`modes` must be an int >= 2, got {modes!r}.")
    return modes * (_WARMUP + PAIRS)

_log = logging.getLogger("keras_mp")


@dataclasses.dataclass
class Record:
    """What was measured for one model and set of compute dtypes.

    Attributes:
        samples: mode -> ``[(cpu_s, wall_s), ...]``, e.g.
            ``{"graph": [...], "xla_update": [...], "xla": [...]}``.
        decision: the chosen mode (``"graph"``, ``"xla_update"``, ``"xla"``)
            or None while measuring.
        step_bytes: what the graph step's tensors took on its first call
            (bytes; None until measured or where unknown).
        skipped: mode -> why it was not tried (its memory would not fit).
    """

    samples: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    decision: str | None = None
    step_bytes: int | None = None
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

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


def _replayable(iterator, count: int) -> Callable[[], Any]:
    """The next ``count`` elements of ``iterator``, read once, as a function
    returning a new iterator over them each time it is called.

    For a ``tf.data`` iterator the new one has the same element spec, so
    Keras's train function takes its iterator path and traces it once for
    this call and all later ones (a list of batches would trace a second
    function, ``one_step_on_data``, called from eager code, for one call):
    made from the tensors where it can be (:mod:`keras_mp.execution.replay`,
    no Python inside the timed call), from a generator otherwise.
    Where the spec cannot be rebuilt (a distributed iterator), the elements
    come back as a list, which Keras's train function also accepts.
    """
    batch = _take(iterator, count)
    if isinstance(iterator, tf.data.Iterator):
        spec = iterator.element_spec
        if replay.iterator_over(batch, spec) is not None:
            return lambda: replay.iterator_over(batch, spec)
        try:
            def make():
                return iter(tf.data.Dataset.from_generator(lambda: iter(batch),
                                                           output_signature=spec))
            make()  # the spec is one from_generator can produce
            return make
        except (TypeError, ValueError):
            pass
    return lambda: batch


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
        data = lambda: iterator  # noqa: E731
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            data = _replayable(iterator, self._model.steps_per_execution)
        try:
            out = self._fn(data())
        except (StopIteration, tf.errors.OutOfRangeError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - any compile failure: graph instead
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            _log.warning(
                "keras_mp: XLA could not compile this model's train step (%s: %s); training "
                "goes on as a TensorFlow graph, from this same batch. To skip the attempt: "
                "keras_mp.config.set_execution(model, 'graph') or %s=graph.",
                type(e).__name__, first, self._env)
            self.failed = True
            self._fn = self._on_fail()
            out = self._fn(data())
        self._checked = True
        # Compiled: the fallback (and the graph train function it holds) is
        # not needed any more.
        self._on_fail = self._known_failure = None
        return out


def training_state(model: keras.Model) -> list:
    """The variables ``model``'s train step may write: the model's (weights,
    moving statistics, seed generators' states), its optimizer's, its
    metrics', and what keras_mp keeps beside them
    (:func:`keras_mp._installed.step_variables`). A :class:`StepTrial`
    puts them back after each call it makes.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> state = training_state(model)
        >>> all(any(v is w for v in state) for w in model.weights)
        True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    optimizer = getattr(model, "optimizer", None)
    found = {}
    for v in (*model.variables, *(optimizer.variables if optimizer is not None else ()),
              *model.metrics_variables, *_installed.step_variables(model)):
        found.setdefault(id(v), v)
    return list(found.values())


def _copy_of(variables: list) -> list[tuple[Any, np.ndarray]]:
    """Each variable (a Keras or TensorFlow variable) with a copy of its
    value in host memory."""
    kept, seen = [], set()
    for v in variables:
        target = v.value if isinstance(v, keras.Variable) else v
        if target is not None and not isinstance(target, tf.Variable):
            target = v  # read through an autocast scope: the Keras variable itself
        if target is None or id(target) in seen:
            continue
        seen.add(id(target))
        kept.append((target, np.array(target.numpy(), copy=True)))
    return kept


def _put_back(kept: list[tuple[Any, np.ndarray]]) -> None:
    """Assigns each variable the value :func:`_copy_of` kept."""
    for target, value in kept:
        target.assign(value)


class StepTrial:
    """A train function that, on its first call, measures its candidate
    modes on a copy of the training state (see the module docstring), then
    runs the fastest, from that call on.

    Args:
        record: the shared :class:`Record` of the model and dtype set.
        candidates: mode name -> train function, ``"graph"`` first (the
            baseline, built with ``jit_compile=False``); the others (e.g.
            ``"xla_update"``, ``"xla"``) wrapped in a :class:`FirstCallGuard`,
            so that a mode that fails to compile drops out of the trial.
        margin: how much faster than the graph another mode must be, by
            both clocks.
        on_decision: called once with the chosen mode's name.
        memory_cost: mode -> ``cost(record)``: what trying the mode would add
            to the process, ``(bytes, what)`` (e.g. the whole step under XLA:
            a copy of the graph step's tensors, ``record.step_bytes``), or
            None where unknown; read after the graph's first call, and a mode
            whose cost is over :data:`MEMORY_BUDGET` of the process is not
            tried (module docstring).
        cache_key: where set, what identifies the model's step
            (:func:`keras_mp.execution.start_up.signature`): with the batches'
            shapes it keys the decision in :mod:`keras_mp.device.cache`, and
            a decision kept there for the same key is taken on the first call,
            without measuring (the other modes are then never traced).
        state: returns the variables the train functions write (the
            training state), put back as they were after each call the
            trial makes; None: nothing to put back (functions without state).
        build: called with the first call's first batch before the trial
            copies the training state: makes what the first trace would
            create (Keras's compiled metrics,
            :func:`keras_mp.execution.optimizer_state.build_metrics`), so
            that the copy holds it.
        steps_per_call: the batches one call reads from a ``tf.data``
            iterator (the model's ``steps_per_execution``): read once, and
            given to each mode's calls and to the call that trains.
    """

    def __init__(self, record: Record, candidates: dict[str, Callable[..., Any]],
                 margin: float, on_decision: Callable[[str], None],
                 memory_cost: dict[str, Callable[[Record], tuple[int, str] | None]] | None = None,
                 cache_key: str | None = None, state: Callable[[], list] | None = None,
                 steps_per_call: int = 1, build: Callable[[Any], Any] | None = None):
        if not isinstance(record, Record):
            raise TypeError(f"`record` must be a step_trial.Record, got {type(record).__name__}.")
        if not isinstance(candidates, dict) or next(iter(candidates), None) != "graph" \
                or len(candidates) < 2 or not all(callable(f) for f in candidates.values()):
            raise ValueError("`candidates` must be a dict of at least two train functions, "
                             f"'graph' first, got {candidates!r}.")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin < 1.0:
            raise ValueError(f"`margin` must be a number >= 1, got {margin!r}.")
        memory_cost = {} if memory_cost is None else memory_cost
        if not isinstance(memory_cost, dict) or any(
                m not in candidates or m == "graph" or not callable(f)
                for m, f in memory_cost.items()):
            raise ValueError("`memory_cost` must be a dict from candidate modes other than "
                             f"'graph' to callables, got {memory_cost!r}.")
        for name, fn in (("state", state), ("build", build)):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be None or callable, got {fn!r}.")
        if isinstance(steps_per_call, bool) or not isinstance(steps_per_call, int) \
                or steps_per_call < 1:
            raise ValueError(f"`steps_per_call` must be an int >= 1, got {steps_per_call!r}.")
        self.record, self._fns = record, dict(candidates)
        self._margin, self._on_decision = margin, on_decision
        self._costs = dict(memory_cost)
        self._cache_key = cache_key
        self._full_key: str | None = None
        self._state, self._steps, self._build = state, steps_per_call, build

    def _modes(self) -> list[str]:
        return [m for m, f in self._fns.items()
                if not getattr(f, "failed", False) and m not in self.record.skipped]

    def _first_graph_call(self, iterator):
        """The graph's first call, measuring what its tensors take; then the
        modes whose memory would not fit are skipped."""
        rec = self.record
        before, rss0 = memory.allocator(), memory.process_rss()
        reset = before is not None and memory.reset_peak()
        out, cpu, wall = _timed(self._fns["graph"], iterator, "graph")
        after, rss1 = memory.allocator(), memory.process_rss()
        if reset and after is not None:
            rec.step_bytes = max(after[1] - before[0], 0)
        elif rss0 is not None and rss1 is not None:
            rec.step_bytes = max(rss1 - rss0, 0)
        size = memory.footprint()
        for mode, cost in self._costs.items():
            estimate = None if mode in rec.skipped or size is None else cost(rec)
            if estimate is None or estimate[0] <= MEMORY_BUDGET * size:
                continue
            rec.skipped[mode] = (
                f"{estimate[1]} would take about {estimate[0] / 2**20:.0f} MiB, more than "
                f"{MEMORY_BUDGET:.0%} of the {size / 2**20:.0f} MiB this process holds")
            _log.info("keras_mp: this model's train step is not tried %s: %s.",
                      _NAMES.get(mode, mode), rec.skipped[mode])
        return out, cpu, wall

    def __call__(self, iterator):
        if self.record.decision is None and not (
                self._cache_key is not None and self._from_cache(iterator)):
            data = lambda: iterator  # noqa: E731 - a list of batches: read again as it is
            if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                data = _replayable(iterator, self._steps)
            self._measure(data)
            iterator = data()
        return self._decided(iterator)

    def _measure(self, data: Callable[[], Any]) -> None:
        """Runs every mode on ``data()`` (module docstring), putting the
        training state back after each call, and decides."""
        rec = self.record
        if self._build is not None:
            first = data()
            self._build(first[0] if isinstance(first, (list, tuple)) else next(iter(first)))
        kept = _copy_of(self._state() if self._state is not None else [])
        try:
            for round_ in range(_WARMUP + PAIRS):
                if len(self._modes()) == 1:
                    break  # the others failed to compile or would not fit: nothing to time
                for mode in list(self._fns):
                    if mode not in self._modes():  # failed to compile, or skipped just now
                        continue
                    fn = self._fns[mode]
                    if round_ == 0 and mode == "graph" and self._costs:
                        _, cpu, wall = self._first_graph_call(data())
                    else:
                        _, cpu, wall = _timed(fn, data(), mode)
                    _put_back(kept)
                    if round_ == 0:
                        # This mode's first call traced and compiled it: its
                        # graph owns its custom gradients (so that dropping it
                        # frees it), and the heap that freed goes back
                        # (keras_mp.device.memory), outside the timing.
                        memory.after_trace()
                    if round_ >= _WARMUP and not getattr(fn, "failed", False):
                        rec.samples.setdefault(mode, []).append((cpu, wall))
        finally:
            _put_back(kept)
        modes = self._modes()
        if len(modes) == 1:  # kept too: a later process must not decide otherwise
            self._decide("graph", "; ".join(rec.skipped.values())
                         or "XLA could not compile the step", remember=True)
        else:
            self._decide_from_samples(modes)

    def _from_cache(self, iterator) -> bool:
        """Takes the decision kept for this step and these batches, if any."""
        spec = getattr(iterator, "element_spec", None)
        self._full_key = f"{self._cache_key}/{spec!r}" if spec is not None else self._cache_key
        kept = disk.get("trial", self._full_key)
        if kept not in self._modes():
            return False
        self._decide(kept, f"measured before on this machine, kept in {disk.directory()}",
                     remember=False)
        return True

    def _decide_from_samples(self, modes: list[str]) -> None:
        med = self.record.medians()
        gc, gw = med["graph"]
        speedup = {m: min(gc / max(med[m][0], 1e-12), gw / max(med[m][1], 1e-12))
                   for m in modes if m != "graph"}
        best = max(speedup, key=speedup.get)
        times = ", ".join(f"{_NAMES.get(m, m)} {med[m][0] * 1e3:.1f} / {med[m][1] * 1e3:.1f}"
                          for m in modes)
        why = (f"median ms per call, CPU / wall, over {PAIRS} interleaved rounds: {times}")
        self._decide(best if speedup[best] >= self._margin else "graph", why, remember=True)

    def _decided(self, iterator):
        """The decided mode's call; the first one after the decision drops
        the other modes (another trial of the record may have decided)."""
        if len(self._fns) > 1:
            self._keep_only(self.record.decision)
        return next(iter(self._fns.values()))(iterator)

    def _keep_only(self, mode: str) -> None:
        # The other modes' traces and compiled code are never called again:
        # without a reference they are freed, and their heap is handed back.
        self._fns = {mode: self._fns.get(mode, self._fns["graph"])}
        gc.collect()
        memory.release_free_heap()

    def _decide(self, mode: str, why: str, remember: bool = False) -> None:
        if remember and self._full_key is not None:
            disk.put("trial", self._full_key, mode)
        self.record.decision = mode
        _log.info("keras_mp: this model's train step runs %s (%s).", _NAMES.get(mode, mode), why)
        self._on_decision(mode)
        self._keep_only(mode)
