"""How a model's train step runs: ``graph``, ``xla_update`` or ``xla``, chosen
on the model's own first calls (see :mod:`keras_mp.execution`).

Example:
    >>> import keras
    >>> from keras_mp.execution import choice
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> choice.configure(model, mode="graph"), choice.chosen(model)
    ('graph', 'graph')
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import keras

from keras_mp import _installed
from keras_mp.device import memory, xla
from keras_mp.execution import (fused_update, micro_benchmark, optimizer_state, placement,
                                step_trial)
from keras_mp.fused import losses as fused_losses
from keras_mp.fused import metrics as fused_metrics
from keras_mp.fused import shared_matches
from keras_mp.execution.placement import compute_dtypes as _compute_dtypes
from keras_mp.execution.micro_benchmark import MARGIN

__all__ = ["MODES", "ENV_VAR", "MAPS_BUDGET", "XLA_MATMUL_FLOOR", "configure", "chosen",
           "measuring", "candidate_modes"]

#: Accepted values of ``mode`` and of the ``KERAS_MP_EXECUTION`` variable.
MODES: tuple[str, ...] = ("auto", "xla", "xla_update", "graph", "keep")
#: The environment variable that overrides ``auto``.
ENV_VAR = "KERAS_MP_EXECUTION"
#: Past this fraction of the process's memory maps (:func:`keras_mp.device.xla.memory_maps`),
#: no new XLA compilation is tried.
MAPS_BUDGET = 0.5
#: The whole step is tried under XLA only where XLA's matmuls in the model's
#: narrowest compute dtype reach this fraction of the graph's throughput
#: (:func:`keras_mp.execution.profile`, matmuls only).
XLA_MATMUL_FLOOR = 0.8

_ATTR = "execution"  # the model's keras_mp._installed holder keeps its _State here
_log = logging.getLogger("keras_mp")


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


def _slow_matmul_reason(model: keras.Model) -> str | None:
    """Why the whole step under XLA cannot win here (None when it may): XLA's
    matmuls in the model's narrowest compute dtype run far slower than the
    graph's. (On a 2-core AMD EPYC with AVX512-BF16, XLA:CPU's bfloat16 matmul
    ran at 71 GFLOP/s against oneDNN's 147, and the whole bfloat16 step
    under XLA lost on every bench model; each try costs an XLA compilation
    that stays in memory.)"""
    dtypes = _compute_dtypes(model)
    dtype = next((d for d in ("bfloat16", "float16", "float32") if d in dtypes), "float32")
    speeds = micro_benchmark.profile(steps=False).matmul.get(dtype, {})
    if "xla" not in speeds or "graph" not in speeds:
        return None
    if speeds["xla"] >= XLA_MATMUL_FLOOR * speeds["graph"]:
        return None
    return (f"XLA runs {dtype} matmuls at {speeds['xla']:.0f} GFLOP/s here against "
            f"{speeds['graph']:.0f} as a TensorFlow graph")


#: Convolution layers, which XLA:CPU runs without oneDNN.
_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D,
                 keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose,
                 keras.layers.Conv3DTranspose, keras.layers.DepthwiseConv1D,
                 keras.layers.DepthwiseConv2D, keras.layers.SeparableConv1D,
                 keras.layers.SeparableConv2D)


def _convolution_reason(model: keras.Model) -> str | None:
    """Why the whole step under XLA is not tried on a CPU (None when it may):
    the model convolves, and XLA:CPU runs convolutions without oneDNN. A
    small bfloat16 CNN ran 3x slower under XLA on a Xeon with AMX-BF16, and
    ResNet50V2 4x slower on an AMD EPYC with AVX512-BF16. On that EPYC (2
    cores), MobileNetV3Small's first 12 steps (float16, 32x32, batch 16) took
    52 s of wall time with the whole step in the trial, 23 s without it."""
    if xla.current_device_type() != "CPU":
        return None
    found = next((layer for layer in model._flatten_layers(include_self=False)
                  if isinstance(layer, _CONVOLUTIONS)), None)
    if found is None:
        return None
    return (f"XLA:CPU runs convolutions ({type(found).__name__} {found.name!r}) without "
            "oneDNN, several times slower than the TensorFlow graph")


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
    then ``"xla_update"`` and ``"xla"`` where the model can use them
    (``"xla"`` only where XLA's matmuls in the model's narrowest compute
    dtype reach :data:`XLA_MATMUL_FLOOR` of the graph's here, and on a CPU
    only for a model without convolutions).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> modes = candidate_modes(model)
        >>> modes[:2]   # "xla" follows where this machine's measured XLA matmuls are fast
        ('graph', 'xla_update')
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    state = _state_of(model)
    failed = state.failed if state is not None else set()
    modes = ["graph"]
    if _update_only_reason(model) is None and "xla_update" not in failed:
        modes.append("xla_update")
    # The convolution rule first: it needs no measurement (the matmul one
    # compiles and times XLA matmuls in every candidate dtype).
    if _graph_only_reason(model) is None and "xla" not in failed \
            and _convolution_reason(model) is None and _slow_matmul_reason(model) is None:
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
            reason = (_graph_only_reason(model) or _update_only_reason(model)
                      or "XLA could not compile it")
            if _graph_only_reason(model) is None and _slow_matmul_reason(model) is not None:
                reason = f"{_slow_matmul_reason(model)}, and {reason}"
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


def _with_fused(fn: Callable[..., Any], losses: list, metrics: list) -> Callable[..., Any]:
    """``fn``, traced (now or on a retrace) with the model's Keras
    cross-entropy and sparse categorical accuracy as fused kernels
    (:mod:`keras_mp.fused.losses`, :mod:`keras_mp.fused.metrics`); with
    both, the accuracy takes its matches from the loss's forward kernel
    (:mod:`keras_mp.fused.shared_matches`)."""
    share = shared_matches.sharing if losses and metrics else contextlib.nullcontext

    def train_function(iterator):
        with fused_losses.fusing(losses), fused_metrics.fusing(metrics), share():
            return fn(iterator)

    return train_function


def _build(model: keras.Model, state: _State, mode: str) -> Callable[..., Any]:
    model.jit_compile = mode == "xla"
    state.original(force=True)
    fn = model.train_function  # traced as Keras traces it
    if mode == "xla_update":
        fused_update.install(model.optimizer)
        fn = _with_update(fn)
    if not xla.uses_xla("elementwise"):
        return fn
    losses = fused_losses.fusable_losses(model)
    metrics = fused_metrics.fusable_metrics(model)
    return _with_fused(fn, losses, metrics) if losses or metrics else fn


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

    heavy = ("xla",) if "xla" in candidates else ()
    return step_trial.StepTrial(record, candidates, MARGIN, decided, memory_heavy=heavy)


def _guarded(model: keras.Model, state: _State, mode: str, fn: Callable[..., Any],
             graph: Callable[[], Callable[..., Any]]) -> step_trial.FirstCallGuard:
    def fell_back():
        state.failed.add(mode)
        return graph()

    return step_trial.FirstCallGuard(model, fn, fell_back, ENV_VAR,
                                     known_failure=lambda: mode in state.failed)


def _state_of(model: keras.Model) -> _State | None:
    return getattr(model.__dict__.get(_installed.INSTALLED_ATTR), _ATTR, None)


def _install(model: keras.Model, state: _State) -> None:
    _installed.install_method(model, "make_train_function",
                         lambda original: _make_train_function(model, state, original))


def _make_train_function(model: keras.Model, state: _State,
                         original: Callable[..., Any]) -> Callable[..., Any]:
    """The model's ``make_train_function`` under :func:`configure`;
    ``original`` is the class's bound method."""

    def make_train_function(force: bool = False):
        if model.train_function is not None and not force:
            return model.train_function
        optimizer_state.build(model)  # so that the step is traced once, not twice
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
        model.train_function = memory.released_after_first_call(fn)
        return model.train_function

    state.original = original
    return make_train_function


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
            train-function calls, :mod:`keras_mp.execution.step_trial`), ``"xla"``,
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
    state = _state_of(model)
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
        setattr(_installed.installed(model), _ATTR, state)
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
    placement.apply(model)
    return chosen


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
    state = _state_of(model)
    return None if state is None else state.chosen


def measuring(model: keras.Model) -> bool:
    """Whether ``model``'s train step is, or at its next build will be, timed
    by the execution trial (``mode="auto"`` and a set of compute dtypes not
    measured yet): then the train functions built now are timed in each
    candidate mode.

    Args:
        model: a Keras model.

    Returns:
        False once the trial decided, for a fixed mode, and where
        :func:`configure` never ran on ``model``.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> measuring(model), configure(model, mode="graph"), measuring(model)
        (False, 'graph', False)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    state = _state_of(model)
    return state is not None and _decide(model, state) == "trial"
