"""How the train step runs: TensorFlow graph or XLA, chosen by measurement.

Whether XLA (``model.compile(jit_compile=True)``) speeds a train step up
depends on the machine and the compute dtype. On a 2-core AVX2 AMD EPYC,
XLA made a float32 Keras step 1.12-1.26x faster (it fuses the elementwise
work around the matmuls); on a Xeon with AMX-BF16 it makes a bfloat16 step
up to 4x slower (a small CNN), because XLA:CPU does not use AMX while TensorFlow's
oneDNN kernels do. So the choice is measured, once per process and device:

* a whole train step (dense -> gelu -> layer norm -> dense, gradients, SGD
  update, float32 variables with the compute cast to the dtype, as Keras
  mixed precision does) timed as a TensorFlow graph and under XLA, for
  float32 and the low-precision dtype the ``"adaptive"`` policy uses here
  (:func:`keras_mp.device.default_candidates`), in interleaved rounds, by
  process CPU time and by wall time;
* a matmul in the same dtypes, graph and XLA, which decides where the fused
  layers' matmuls run (:func:`keras_mp.device.xla.uses_xla` ``("matmul")``).

That micro-benchmark is what ``keras-mp info`` shows and what
:func:`choose` answers; it does not decide for a model. An elementwise-heavy
probe step says little about a model whose time goes to convolutions or
large matmuls (on an AMX-BF16 Xeon the bfloat16 probe step measured 0.8-1.1x
under XLA from run to run, a bfloat16 CNN 0.3x). So with ``mode="auto"``
:func:`configure` times **the model's own train step** on its first calls,
on the batches it trains on, in each mode the model can use
(:func:`candidate_modes`): ``"graph"``, ``"xla_update"`` (the graph with
only the optimizer's update compiled by XLA, :mod:`keras_mp.fused_update`)
and ``"xla"`` (the whole step compiled), and keeps another mode than the
graph only where it is at least :data:`MARGIN` faster by process CPU time
and by wall time (:mod:`keras_mp.step_trial`). XLA is not tried at all
where the model cannot use it: a layer without ``supports_jit``, a
distribution strategy, an optimizer that needs graph-only ops
(``max_consecutive_skips`` names variables with string ops, which XLA
cannot compile), ``run_eagerly``.

:func:`configure` applies the choice to a compiled model; the
:class:`~keras_mp.callbacks.AdaptivePrecision` callback calls it, so the
recommended set-up uses the fastest measured mode by default. If XLA then
fails to compile the model's train step, training goes on as a TensorFlow
graph with one warning, on the same batch (nothing is skipped).

Override, strongest first: ``configure(model, mode=...)``, the environment
variable ``KERAS_MP_EXECUTION`` (``auto``, ``xla``, ``xla_update``, ``graph``
or ``keep``),
the default ``auto``. ``keep`` leaves ``model.jit_compile`` as
``model.compile`` set it.

Example:
    >>> import keras, keras_mp
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> keras_mp.execution.configure(model, mode="graph")
    'graph'
    >>> model.jit_compile
    False
    >>> keras_mp.execution.configure(model, mode="xla")
    'xla'
    >>> import numpy as np
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 2)), verbose=0)
    >>> model.jit_compile
    True
    >>> keras_mp.execution.configure(model, mode="auto")   # measured on the next calls
    'trial'
    >>> _ = model.fit(np.ones((160, 4)), np.ones((160, 2)), batch_size=8, verbose=0)
    >>> keras_mp.execution.chosen(model) in ("graph", "xla_update", "xla")
    True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import keras
import tensorflow as tf

from keras_mp import device, fused_update, step_trial
from keras_mp.device import xla

__all__ = ["MODES", "ENV_VAR", "MARGIN", "MAPS_BUDGET", "ExecutionProfile", "profile", "choose",
           "configure", "chosen", "candidate_modes", "epilogue"]

#: Accepted values of ``mode`` and of the ``KERAS_MP_EXECUTION`` variable.
MODES: tuple[str, ...] = ("auto", "xla", "xla_update", "graph", "keep")
#: The environment variable that overrides ``auto``.
ENV_VAR = "KERAS_MP_EXECUTION"
#: XLA must be at least this much faster (by CPU time and by wall time).
MARGIN = 1.05
#: Past this fraction of the process's memory maps (:func:`keras_mp.device.xla.memory_maps`),
#: no new XLA compilation is tried.
MAPS_BUDGET = 0.5

_ATTR = "_keras_mp_execution"
_cache: dict[str, ExecutionProfile] = {}
_lock = threading.Lock()
_log = logging.getLogger("keras_mp")


@dataclasses.dataclass(frozen=True)
class ExecutionProfile:
    """What was measured about whole steps and matmuls under XLA.

    Attributes:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``.
        xla_available: whether XLA compiles and runs on this device.
        step: dtype -> ``{"graph": (cpu_s, wall_s), "xla": (cpu_s, wall_s)}``,
            median seconds per train step of the probe model.
        matmul: dtype -> ``{"graph": GFLOP/s, "xla": GFLOP/s}``.
    """

    device_type: str
    xla_available: bool
    step: dict[str, dict[str, tuple[float, float]]]
    matmul: dict[str, dict[str, float]]

    def xla_speedup(self, dtype: str) -> float:
        """The smaller of XLA's CPU-time and wall-time speed-ups over the
        graph for a train step in ``dtype`` (0.0 when not measured)."""
        times = self.step.get(dtype)
        if not times or "xla" not in times:
            return 0.0
        (gc, gw), (xc, xw) = times["graph"], times["xla"]
        return min(gc / max(xc, 1e-12), gw / max(xw, 1e-12))

    def xla_wins(self, dtype: str) -> bool:
        """Whether XLA runs a train step in ``dtype`` faster by both clocks."""
        return self.xla_speedup(dtype) >= MARGIN

    def matmul_xla_wins(self, dtype: str) -> bool:
        """Whether a matmul in ``dtype`` runs at least as fast under XLA."""
        m = self.matmul.get(dtype, {})
        return m.get("xla", 0.0) >= m.get("graph", float("inf"))


def _check_device_type(device_type: str | None) -> str:
    device_type = device_type or xla.current_device_type()
    if device_type not in xla.DEVICE_TYPES:
        raise ValueError(f"`device_type` must be one of {xla.DEVICE_TYPES} or None, got "
                         f"{device_type!r}.")
    return device_type


def _probe_step(dtype: str, batch: int, width: int, jit: bool) -> Callable[[], Any]:
    init = tf.random.stateless_normal
    x = tf.cast(init([batch, width], seed=[1, 1]), dtype)
    target = tf.cast(init([batch, width], seed=[1, 2]), dtype)
    w1 = tf.Variable(init([width, 2 * width], seed=[1, 3]) * 0.02)
    b1 = tf.Variable(tf.zeros([2 * width]))
    w2 = tf.Variable(init([2 * width, width], seed=[1, 4]) * 0.02)
    b2 = tf.Variable(tf.zeros([width]))
    weights = [w1, b1, w2, b2]

    def step():
        with tf.GradientTape() as tape:
            h = tf.nn.gelu(tf.matmul(x, tf.cast(w1, dtype)) + tf.cast(b1, dtype))
            mean, var = tf.nn.moments(tf.cast(h, "float32"), axes=[-1], keepdims=True)
            h = tf.cast((tf.cast(h, "float32") - mean) * tf.math.rsqrt(var + 1e-5), dtype)
            y = tf.matmul(h, tf.cast(w2, dtype)) + tf.cast(b2, dtype)
            loss = tf.reduce_mean(tf.square(tf.cast(y - target, "float32")))
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(1e-3 * g)
        return loss

    fn = tf.function(step, jit_compile=jit, autograph=False)
    return lambda: fn().numpy()


def _probe_matmul(dtype: str, n: int, jit: bool) -> Callable[[], Any]:
    a = tf.cast(tf.random.stateless_normal([n, n], seed=[2, 1]), dtype)
    fn = tf.function(lambda m: tf.matmul(m, m), jit_compile=jit, autograph=False)
    return lambda: fn(a)[:1, :1].numpy()


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int,
                 steps: int) -> dict[str, tuple[float, float]]:
    """Median (CPU s, wall s) per call of each fn, over interleaved rounds."""
    for fn in fns.values():
        fn()  # trace / compile
        fn()
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                fn()
            cpu[key].append((time.process_time() - c0) / steps)
            wall[key].append((time.perf_counter() - w0) / steps)
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in fns}


def _measure(device_type: str, dtypes: Iterable[str], use_xla: bool, batch: int, width: int,
             rounds: int) -> tuple[dict, dict]:
    step: dict[str, dict[str, tuple[float, float]]] = {}
    matmul: dict[str, dict[str, float]] = {}
    n = 2 * width
    with tf.device(f"/{device_type}:0"):
        for dtype in dtypes:
            modes = (False, True) if use_xla else (False,)
            names = {False: "graph", True: "xla"}
            try:
                step[dtype] = _interleaved(
                    {names[j]: _probe_step(dtype, batch, width, j) for j in modes}, rounds, 3)
                mm = _interleaved({names[j]: _probe_matmul(dtype, n, j) for j in modes},
                                  rounds, 3)
            except (tf.errors.OpError, TypeError, ValueError) as e:
                _log.info("keras_mp: could not time a %s step on %s (%s).", dtype,
                          device_type, e)
                continue
            matmul[dtype] = {k: 2.0 * n**3 / max(wall, 1e-12) / 1e9
                             for k, (_, wall) in mm.items()}
    return step, matmul


def profile(device_type: str | None = None, *, refresh: bool = False, batch: int = 256,
            width: int = 512, rounds: int = 5) -> ExecutionProfile:
    """Measures (once per process and device type) graph against XLA.

    Takes a few seconds on a 2-core CPU, most of it XLA compilation.

    Args:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``; the device new ops
            would run on when None.
        refresh: measure again instead of returning the cached profile.
        batch: rows of the probe step's input (>= 8).
        width: width of the probe model (>= 16); the matmul probe is
            ``2 * width`` square.
        rounds: interleaved timing rounds (>= 1); medians are kept.

    Returns:
        An :class:`ExecutionProfile`.
    """
    device_type = _check_device_type(device_type)
    for name, value, low in (("batch", batch, 8), ("width", width, 16), ("rounds", rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    with _lock:
        if not refresh and device_type in _cache:
            return _cache[device_type]
    # The dtypes "adaptive" computes in here (a "fast" float16 matmul can still
    # sit in a step of emulated float16 elementwise ops, seconds per step).
    dtypes = tuple(dict.fromkeys(("float32", *device.default_candidates(device_type))))
    available = xla.xla_available(device_type)
    step, matmul = _measure(device_type, dtypes, available, batch, width, rounds)
    result = ExecutionProfile(device_type, available, step, matmul)
    with _lock:
        _cache[device_type] = result
    return result


def choose(dtypes: Iterable[str], device_type: str | None = None) -> str:
    """``"xla"`` where the probe step (:func:`profile`) ran faster under XLA
    for every dtype in ``dtypes``, else ``"graph"``: the micro-benchmark's
    estimate, shown by ``keras-mp info``. :func:`configure` measures the
    model's own step instead.

    Args:
        dtypes: compute dtypes, e.g. ``["bfloat16", "float32"]``.
        device_type: as for :func:`profile`.

    Example:
        >>> choose(["float32"]) in ("xla", "graph")
        True
    """
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    dtypes = sorted(set(dtypes))
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if not dtypes or bad:
        raise ValueError("`dtypes` must name at least one of 'float32', 'bfloat16', "
                         f"'float16', got {dtypes!r}.")
    prof = profile(device_type)
    return "xla" if prof.xla_available and all(prof.xla_wins(d) for d in dtypes) else "graph"


def _compute_dtypes(model: keras.Model) -> set[str]:
    return {layer.compute_dtype for layer in model._flatten_layers(include_self=False)
            if layer.weights and layer.compute_dtype in ("float32", "bfloat16", "float16")} or {
                "float32"}


def _maps_reason() -> str | None:
    """Why another XLA compilation could crash this process (None when not)."""
    maps = xla.memory_maps()
    if maps is None or maps[0] <= MAPS_BUDGET * maps[1]:
        return None
    return (f"this process holds {maps[0]} of the {maps[1]} memory maps Linux allows it "
            "(vm.max_map_count) and TensorFlow never frees an XLA:CPU executable's, so "
            "another XLA compilation could crash it; raise the limit (sysctl -w "
            "vm.max_map_count=262144) or train new models in a new process")


def _graph_only_reason(model: keras.Model) -> str | None:
    """Why XLA cannot be used for this model at all (None when it can)."""
    from keras.src.trainers.trainer import model_supports_jit

    if getattr(model, "run_eagerly", False):
        return "the model runs eagerly (run_eagerly=True)"
    if getattr(model, "_distribute_strategy", None) is not None:
        return "a distribution strategy is set (Keras does not compile its steps with XLA)"
    opt = getattr(model, "optimizer", None)
    if getattr(opt, "max_consecutive_skips", None) is not None:
        return ("the optimizer sets max_consecutive_skips, whose message names variables "
                "with string ops XLA cannot compile; set max_consecutive_skips=None to allow XLA")
    if not model_supports_jit(model):
        names = sorted({type(layer).__name__ for layer in model._flatten_layers()
                        if not layer.supports_jit})
        return f"layers that do not support XLA: {', '.join(names) or 'see Keras'}"
    if not xla.xla_available():
        return "XLA does not run on this device"
    return _maps_reason()


@dataclasses.dataclass
class _State:
    mode: str
    strict: bool = True  # mode="xla"/"xla_update" from the argument: an error where it cannot run
    explicit: bool = False  # mode from the argument: later configure(model) calls keep it
    chosen: str = "graph"
    failed: set[str] = dataclasses.field(default_factory=set)  # modes that could not compile
    told: bool = False
    original: Callable[..., Any] | None = None
    # mode="auto": what the model's own step measured, per set of compute dtypes
    trials: dict[frozenset, step_trial.Record] = dataclasses.field(default_factory=dict)
    built: str | None = None  # the mode the current train function was built for


def _update_only_reason(model: keras.Model) -> str | None:
    """Why the optimizer's update alone cannot be compiled (None when it can)."""
    if getattr(model, "run_eagerly", False):
        return "the model runs eagerly (run_eagerly=True)"
    if getattr(model, "_distribute_strategy", None) is not None:
        return "a distribution strategy is set (the update holds its all-reduce)"
    if getattr(model, "optimizer", None) is None:
        return "the model has no optimizer"
    reason = fused_update.unsupported_reason(model.optimizer)
    if reason is not None:
        return reason
    if not xla.xla_available():
        return "XLA does not run on this device"
    if not xla.uses_xla("elementwise"):
        return "keras_mp.set_xla('elementwise', False) keeps elementwise work out of XLA"
    return _maps_reason()


def candidate_modes(model: keras.Model) -> tuple[str, ...]:
    """The modes ``mode="auto"`` measures for ``model``: ``"graph"`` first,
    then ``"xla_update"`` and ``"xla"`` where the model can use them.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> candidate_modes(model)
        ('graph', 'xla_update', 'xla')
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    state = getattr(model, _ATTR, None)
    failed = state.failed if state is not None else set()
    modes = ["graph"]
    if _update_only_reason(model) is None and "xla_update" not in failed:
        modes.append("xla_update")
    if _graph_only_reason(model) is None and "xla" not in failed:
        modes.append("xla")
    return tuple(modes)


def _decide(model: keras.Model, state: _State) -> str:
    if state.mode == "keep":
        return "xla" if model.jit_compile else "graph"
    if state.mode == "graph" or state.mode in state.failed:
        return "graph"
    if state.mode in ("xla", "xla_update"):
        reason = (_graph_only_reason if state.mode == "xla" else _update_only_reason)(model)
        if reason is None:
            return state.mode
        if state.strict:
            raise ValueError(f"`mode`={state.mode!r} cannot be used for this model: {reason}.")
        if not state.told:  # one message per model, not one per rebuild
            _log.info("keras_mp: the train step runs as a TensorFlow graph: %s.", reason)
            state.told = True
        return "graph"
    if len(candidate_modes(model)) == 1:
        if not state.told:
            reason = _graph_only_reason(model) or "XLA could not compile it"
            _log.log(logging.WARNING if "memory maps" in reason else logging.INFO,
                     "keras_mp: the train step runs as a TensorFlow graph: %s.", reason)
            state.told = True
        return "graph"
    record = state.trials.get(frozenset(_compute_dtypes(model)))
    if record is not None and record.decision:
        return "graph" if record.decision in state.failed else record.decision
    return "trial"


def _fall_back(model: keras.Model, state: _State, mode: str) -> Callable[[], Callable[..., Any]]:
    """What a failed compilation of ``mode`` switches to: a graph train function."""

    def graph():
        state.failed.add(mode)
        state.chosen = "graph"
        model.jit_compile = False
        state.original(force=True)
        model.test_function = model.predict_function = None
        return model.train_function

    return graph


def _with_update(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, traced (now or on a retrace) with the optimizer's update
    compiled by XLA."""

    def train_function(iterator):
        with fused_update.compiling(True):
            return fn(iterator)

    return train_function


def _build(model: keras.Model, state: _State, mode: str) -> Callable[..., Any]:
    model.jit_compile = mode == "xla"
    state.original(force=True)
    if mode != "xla_update":
        return model.train_function  # traced as Keras traces it: nothing added per call
    fused_update.install(model.optimizer)
    return _with_update(model.train_function)


def _trial(model: keras.Model, state: _State) -> step_trial.StepTrial:
    """A train function measuring the model's candidate modes on its first calls."""
    record = state.trials.setdefault(frozenset(_compute_dtypes(model)), step_trial.Record())
    if record.decision is None:
        # New train functions (rebuilt, or the callback's variants): the
        # measurement restarts with them, so it never waits on a dropped one.
        record.owner, record.calls, record.samples = None, 0, {}
    modes = candidate_modes(model)
    candidates: dict[str, Callable[..., Any]] = {}
    for mode in reversed(modes):  # "graph" built last: jit_compile stays False
        fn = _build(model, state, mode)
        if mode != "graph":
            fn = _guarded(model, state, mode, fn, graph=lambda: candidates["graph"])
        candidates[mode] = fn
    candidates = {m: candidates[m] for m in modes}

    def decided(mode: str) -> None:
        state.chosen = mode
        if model.jit_compile != (mode == "xla"):
            model.jit_compile = mode == "xla"
            model.test_function = model.predict_function = None

    return step_trial.StepTrial(record, candidates, MARGIN, decided)


def _guarded(model: keras.Model, state: _State, mode: str, fn: Callable[..., Any],
             graph: Callable[[], Callable[..., Any]]) -> step_trial.FirstCallGuard:
    def fell_back():
        state.failed.add(mode)
        return graph()

    return step_trial.FirstCallGuard(model, fn, fell_back, ENV_VAR,
                                     known_failure=lambda: mode in state.failed)


def _install(model: keras.Model, state: _State) -> None:
    original = model.make_train_function  # the class's bound method

    def make_train_function(force: bool = False):
        if model.train_function is not None and not force:
            return model.train_function
        chosen = _decide(model, state)  # again: the compute dtypes may have changed
        state.chosen = state.built = chosen
        if chosen == "trial":
            model.train_function = _trial(model, state)
            return model.train_function
        if state.mode == "keep":
            original(force=True)
            return model.train_function
        fn = _build(model, state, chosen)
        if chosen != "graph":
            fn = step_trial.FirstCallGuard(model, fn, _fall_back(model, state, chosen), ENV_VAR,
                                           known_failure=lambda: chosen in state.failed)
        model.train_function = fn
        return model.train_function

    state.original = original
    model.make_train_function = make_train_function


def configure(model: keras.Model, mode: str | None = None) -> str:
    """Sets how ``model``'s train step runs: the fastest measured mode.

    Call it after ``model.compile(...)`` (which resets ``jit_compile``); the
    :class:`~keras_mp.callbacks.AdaptivePrecision` callback calls it for
    you. The choice is taken again whenever the train step is rebuilt (e.g.
    when adaptive precision changes a layer's compute dtypes: a new set of
    dtypes is measured anew). XLA also applies to ``evaluate`` and
    ``predict``, as with ``compile(jit_compile=True)``.

    Args:
        model: a compiled Keras model.
        mode: ``"auto"`` (measure the model's own step on its first
            train-function calls, :mod:`keras_mp.step_trial`), ``"xla"``,
            ``"xla_update"``, ``"graph"`` or ``"keep"`` (leave ``model.jit_compile`` as compiled). When
            None: the mode an earlier ``configure(model, mode=...)`` gave
            this model (so the callback keeps a mode you chose), else the
            ``KERAS_MP_EXECUTION`` environment variable, else ``"auto"``.
            ``"auto"`` replaces the ``jit_compile`` given to ``compile``;
            use ``"keep"`` to keep it.

    Returns:
        ``"xla"``, ``"xla_update"`` or ``"graph"``: the mode chosen now; ``"trial"`` when
        ``"auto"`` has not measured this model (and its compute dtypes) yet:
        the next train-function calls measure it (:func:`chosen` tells the
        outcome).

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: ``model`` is not compiled, ``mode`` (or the environment
            variable) is not one of :data:`MODES`, or ``mode="xla"`` for a
            model that cannot use XLA (the message says why; the
            environment variable set to ``xla`` instead falls back to the
            graph for such a model, with an info message).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    source = "`mode`"
    state = getattr(model, _ATTR, None)
    if mode is None and state is not None and state.explicit:
        mode = state.mode  # chosen by an earlier configure(model, mode=...): it sticks
    elif mode is None:
        mode, source = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR
    if mode not in MODES:
        raise ValueError(f"{source} must be one of {MODES}, got {mode!r}.")
    if not getattr(model, "compiled", False):
        raise ValueError("`model` must be compiled first: call model.compile(...), then "
                         "keras_mp.execution.configure(model).")
    if mode in ("xla", "xla_update") and source == "`mode`":
        reason = (_graph_only_reason if mode == "xla" else _update_only_reason)(model)
        if reason is not None:  # before anything about the model changes
            raise ValueError(f"`mode`={mode!r} cannot be used for this model: {reason}.")
    if state is None:
        state = _State(mode)
        _install(model, state)
        setattr(model, _ATTR, state)
    elif state.mode != mode:
        state.mode, state.failed = mode, set()
    state.strict = state.explicit = source == "`mode`"
    before = model.jit_compile
    chosen = _decide(model, state)
    state.chosen = chosen
    if mode != "keep":
        model.jit_compile = chosen == "xla"  # a trial starts as a graph
    if model.jit_compile != before:
        model.train_function = model.test_function = model.predict_function = None
    elif chosen != state.built and state.built != "trial" and model.train_function is not None:
        # Built for another mode (or by Keras): rebuilt. (A trial's function
        # runs whatever its measurement decided.)
        model.train_function = None
    _set_matmul_placement(model)
    return chosen


def _set_matmul_placement(model: keras.Model) -> None:
    """Points the fused layers' matmuls at the faster of graph and XLA for
    the narrowest dtype the model computes in (measured, not from flags),
    and, where matmuls stay outside XLA, their epilogues (:func:`epilogue`)."""
    prof = profile()
    dtypes = _compute_dtypes(model)
    dtype = next((d for d in ("bfloat16", "float16", "float32") if d in dtypes), "float32")
    if dtype in prof.matmul and "xla" in prof.matmul[dtype]:
        xla.set_measured_default("matmul", prof.device_type, prof.matmul_xla_wins(dtype))
    if xla.uses_xla("matmul", prof.device_type) or not xla.xla_available(prof.device_type):
        return
    for act in _fused_dense_activations(model):
        speedup = epilogue(act, dtype, prof.device_type)
        xla.set_measured_epilogue(act, prof.device_type, speedup > 1.0)


def _fused_dense_activations(model: keras.Model) -> list[str]:
    from keras_mp.fused import layers as fused_layers
    from keras_mp.fused import ops as kops

    names = set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, fused_layers.Dense) and layer.fused:
            name, approximate = fused_layers._FUSED_ACTIVATIONS[layer.activation]
            names.add(kops.activation._check_activation(name, approximate))
    return sorted(names)


_epilogue_cache: dict[tuple[str, str, str], float] = {}


def epilogue(activation: str, dtype: str = "bfloat16", device_type: str | None = None, *,
             batch: int = 256, width: int = 1024, rounds: int = 5) -> float:
    """Measures (once per process) a fused ``Dense``'s epilogue as one XLA
    kernel against TensorFlow ops fused into the matmul by TensorFlow.

    The step: three ``activation(h @ kernel + bias)`` layers, forward,
    backward and update, matmuls in TensorFlow, ``[batch, width] x [width,
    width]`` in ``dtype``, timed in interleaved rounds. (One layer alone
    does not show it: the cost of the XLA epilogue on an AMX Xeon came from
    the boundaries between oneDNN matmuls and XLA kernels across layers.)

    Args:
        activation: a :func:`keras_mp.fused.ops.bias_activation` kernel name
            (``"linear"``, ``"relu"``, ``"gelu"``, ``"gelu_tanh"``,
            ``"silu"``, ``"tanh"``).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device_type: as for :func:`profile`.
        batch, width, rounds: the step's size and the timing rounds.

    Returns:
        The XLA epilogue's speed-up over TensorFlow's fusion: the smaller of
        the CPU-time and wall-time ratios (> 1: the XLA kernel is faster).
    """
    from keras_mp.fused import ops as kops

    device_type = _check_device_type(device_type)
    if activation not in xla.EPILOGUE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {xla.EPILOGUE_ACTIVATIONS}, "
                         f"got {activation!r}.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"`dtype` must be one of 'float32', 'bfloat16', 'float16', got "
                         f"{dtype!r}.")
    key = (activation, dtype, device_type)
    with _lock:
        if key in _epilogue_cache:
            return _epilogue_cache[key]
    name, approximate = ("gelu", True) if activation == "gelu_tanh" else (activation, False)
    init = tf.random.stateless_normal
    with tf.device(f"/{device_type}:0"):
        x = tf.cast(init([batch, width], seed=[3, 1]), dtype)
        weights = [tf.Variable(init([width, width], seed=[3, 2 + i]) * 0.03) for i in range(3)]
        weights += [tf.Variable(tf.zeros([width])) for _ in range(3)]

        def make(impl):
            def step():
                with tf.GradientTape() as tape:
                    h = x
                    for kernel, bias in zip(weights[:3], weights[3:]):
                        h = impl(tf.matmul(h, tf.cast(kernel, dtype)), bias, name,
                                 approximate=approximate)
                    loss = tf.reduce_mean(tf.square(tf.cast(h, "float32")))
                for w, g in zip(weights, tape.gradient(loss, weights)):
                    w.assign_sub(1e-4 * g)
                return loss
            fn = tf.function(step, autograph=False)
            return lambda: fn().numpy()

        times = _interleaved({"xla": make(kops.bias_activation),
                              "tf": make(kops.bias_activation_reference)}, rounds, 3)
    (tc, tw), (xc, xw) = times["tf"], times["xla"]
    speedup = min(tc / max(xc, 1e-12), tw / max(xw, 1e-12))
    with _lock:
        _epilogue_cache[key] = speedup
    return speedup


def chosen(model: keras.Model) -> str | None:
    """How ``model``'s train step runs now under :func:`configure`.

    Args:
        model: a Keras model.

    Returns:
        ``"xla"``, ``"xla_update"``, ``"graph"``, ``"trial"`` (``"auto"``, still measuring),
        or None where :func:`configure` never ran on ``model``.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    state = getattr(model, _ATTR, None)
    return None if state is None else state.chosen
