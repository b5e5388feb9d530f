"""How a model's train step runs: ``graph``, ``xla_update`` or ``xla``, chosen
on the model's own first call (see :mod:`keras_mp.execution`).

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
import tensorflow as tf

from keras_mp import _installed
from keras_mp.device import memory, xla
from keras_mp.execution import (first_calls, fused_update, inference, native_update,
                                optimizer_state, placement, reasons, start_up, step_trial)
from keras_mp.fused import losses as fused_losses
from keras_mp.fused import metrics as fused_metrics
from keras_mp.fused import shared_matches
from keras_mp.execution.inference import trace_scope
from keras_mp.execution.placement import compute_dtypes as _compute_dtypes
from keras_mp.execution.micro_benchmark import MARGIN
from keras_mp.execution.reasons import MAPS_BUDGET, XLA_MATMUL_FLOOR

__all__ = ["MODES", "ENV_VAR", "MAPS_BUDGET", "XLA_MATMUL_FLOOR", "configure", "chosen",
           "measuring", "candidate_modes", "trace_scope"]

#: Accepted values of ``mode`` and of the ``KERAS_MP_EXECUTION`` variable.
MODES: tuple[str, ...] = ("auto", "xla", "xla_update", "graph", "keep")
#: The environment variable that overrides ``auto``.
ENV_VAR = "KERAS_MP_EXECUTION"
_ATTR = "execution"  # the model's keras_mp._installed holder keeps its _State here
_log = logging.getLogger("keras_mp")


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
    # mode="auto": the trial's graph and xla_update share a trace (_trial)
    update_switch: Any = None  # a bool tf.Variable: the update under XLA
    update_on: bool = False
    # mode="auto": the sets of compute dtypes whose fit's first calls were timed
    # (keras_mp.execution.first_calls)
    timed: set[frozenset] = dataclasses.field(default_factory=set)


def candidate_modes(model: keras.Model) -> tuple[str, ...]:
    """The modes ``mode="auto"`` measures for ``model``: ``"graph"`` first,
    then ``"xla_update"`` and ``"xla"`` where the model can use them
    (``"xla_update"`` only where the optimizer has no native update kernel,
    :mod:`keras_mp.execution.native_update`, and where its compiled code fits in
    :data:`keras_mp.execution.step_trial.MEMORY_BUDGET` of the process, as
    first found for the model's signature on this device,
    :func:`keras_mp.execution.start_up.kept_reason`;
    ``"xla"`` only where XLA's matmuls in the model's narrowest compute
    dtype reach :data:`XLA_MATMUL_FLOOR` of the graph's here, and on a CPU
    only for a model without convolutions).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="rmsprop", loss="mse")
        >>> modes = candidate_modes(model)
        >>> modes[:2]   # "xla" follows where this machine's measured XLA matmuls are fast
        ('graph', 'xla_update')
        >>> model.compile(optimizer="adam", loss="mse")   # one native kernel per variable
        >>> "xla_update" in candidate_modes(model)
        False
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    state = _state_of(model)
    failed = state.failed if state is not None else set()
    modes = ["graph"]
    if reasons.little_to_compile(model) is not None:
        return tuple(modes)  # asks nothing that would start XLA's runtime
    if reasons.update_only(model) is None and "xla_update" not in failed \
            and reasons.update_native(model) is None \
            and start_up.kept_reason(model, "update_memory", reasons.update_memory) is None:
        modes.append("xla_update")
    # The convolution rule first: it needs no measurement (the matmul one
    # compiles and times XLA matmuls in every candidate dtype).
    if reasons.graph_only(model) is None and "xla" not in failed \
            and reasons.convolution(model) is None and reasons.slow_matmul(model) is None:
        modes.append("xla")
    return tuple(modes)


def _decide(model: keras.Model, state: _State) -> str:
    if state.mode == "keep":
        return "xla" if model.jit_compile else "graph"
    if state.mode == "graph" or state.mode in state.failed:
        return "graph"
    if state.mode in ("xla", "xla_update"):
        reason = (reasons.graph_only if state.mode == "xla" else reasons.update_only)(model)
        if reason is None:
            return state.mode
        if state.strict:
            raise ValueError(f"`mode`={state.mode!r} cannot be used for this model: {reason}.")
        if not state.told:  # one message per model, not one per rebuild
            _log.info("keras_mp: the train step runs as a TensorFlow graph: %s.", reason)
            state.told = True
        return "graph"
    record = state.trials.get(frozenset(_compute_dtypes(model)))
    if record is not None and record.decision:
        return "graph" if record.decision in state.failed else record.decision
    if _first_calls_pending(model, state):
        return "trial"   # timed as a graph first: nothing measured before
    if len(candidate_modes(model)) == 1:
        if not state.told:
            reason = reasons.little_to_compile(model)
            if reason is None:
                reason = (reasons.graph_only(model) or reasons.update_only(model)
                          or reasons.update_native(model)
                          or start_up.kept_reason(model, "update_memory", reasons.update_memory)
                          or "XLA could not compile it")
                if reasons.graph_only(model) is None:
                    # The convolution rule first: it measures nothing.
                    why_not_xla = reasons.convolution(model) or reasons.slow_matmul(model)
                    if why_not_xla is not None:
                        reason = f"{why_not_xla}, and {reason}"
            _log.log(logging.WARNING if "memory maps" in reason else logging.INFO,
                     "keras_mp: the train step runs as a TensorFlow graph: %s.", reason)
            state.told = True
        return "graph"
    return "trial"


def _first_calls_pending(model: keras.Model, state: _State) -> bool:
    """Whether ``model``'s coming fit, of known length and not short, is to
    time its first calls as a graph before measuring anything
    (:mod:`keras_mp.execution.first_calls`), for its current compute dtypes."""
    return state.mode == "auto" and reasons.expected(model) is not None \
        and reasons.short_fit(model) is None and not xla.forced("elementwise") \
        and frozenset(_compute_dtypes(model)) not in state.timed


def _first_calls(model: keras.Model, state: _State) -> first_calls.FirstCalls:
    """The train function of a fit's first calls: a graph without XLA,
    timed; then the graph kept, or the measured train function."""
    dtypes = frozenset(_compute_dtypes(model))
    model.jit_compile = False
    state.original(force=True)
    graph = optimizer_state.metrics_built_first(model, inference.without_xla(model.train_function))
    graph = memory.released_after_first_call(graph)

    holder = _installed.installed(model)
    setattr(holder, reasons.FIRST_CALLS_ATTR, "its fit's first calls are timed as a graph")

    def then():
        state.timed.add(dtypes)
        setattr(holder, reasons.FIRST_CALLS_ATTR, None)   # measured from now on
        return model.make_train_function(force=True)

    def keep(why: str) -> None:
        state.timed.add(dtypes)
        setattr(holder, reasons.FIRST_CALLS_ATTR, why)   # nothing measured, no XLA
        state.trials.setdefault(dtypes, step_trial.Record()).decision = "graph"
        state.chosen = state.built = "graph"
        _log.info("keras_mp: the train step runs as a TensorFlow graph: %s.", why)

    return first_calls.FirstCalls(graph, then, keep, start_up.signature(model),
                                  reasons.expected(model))


def _fall_back(model: keras.Model, state: _State, mode: str) -> Callable[[], Callable[..., Any]]:
    """What a failed compilation of ``mode`` switches to: a graph train function."""

    def graph():
        state.failed.add(mode)
        state.chosen = "graph"
        model.jit_compile = False
        state.original(force=True)
        return model.train_function

    return graph


def _with_update(fn: Callable[..., Any], switch: tf.Variable | None = None) -> Callable[..., Any]:
    """``fn``, traced (now or on a retrace) with the optimizer's update
    compiled by XLA; with ``switch``, both ways under a ``tf.cond`` on it
    (:func:`keras_mp.execution.fused_update.switched`)."""

    def train_function(iterator):
        with fused_update.compiling(True) if switch is None else fused_update.switched(switch):
            return fn(iterator)

    return train_function


def _switched(fn: Callable[..., Any], state: _State, on: bool) -> Callable[..., Any]:
    """``fn`` (built with ``state.update_switch``), its update under XLA
    where ``on``: the switch is set before each call."""

    def train_function(iterator):
        if state.update_on != on:
            state.update_switch.assign(on)
            state.update_on = on
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


def _build(model: keras.Model, state: _State, mode: str,
           switch: tf.Variable | None = None) -> Callable[..., Any]:
    model.jit_compile = mode == "xla"
    state.original(force=True)
    fn = model.train_function  # traced as Keras traces it
    if mode == "xla_update":
        fused_update.install(model.optimizer)
        fn = _with_update(fn, switch)
    if mode == "graph" and reasons.little_to_compile(model) is not None:
        return inference.without_xla(fn)  # mode="xla_update"/"xla" asked for keeps its XLA
    if not xla.uses_xla("elementwise"):
        return fn
    losses = fused_losses.fusable_losses(model)
    metrics = fused_metrics.fusable_metrics(model)
    return _with_fused(fn, losses, metrics) if losses or metrics else fn


def _trial(model: keras.Model, state: _State) -> step_trial.StepTrial:
    """A train function measuring the model's candidate modes on its first call."""
    record = state.trials.setdefault(frozenset(_compute_dtypes(model)), step_trial.Record())
    modes = candidate_modes(model)
    candidates: dict[str, Callable[..., Any]] = {}
    if "xla" in modes:  # first: jit_compile ends False
        candidates["xla"] = _guarded(model, state, "xla", _build(model, state, "xla"),
                                     graph=lambda: candidates["graph"])
    if "xla_update" in modes:
        # One trace for both: the update under a tf.cond on the switch.
        if state.update_switch is None:
            with tf.init_scope():
                state.update_switch = tf.Variable(False, trainable=False,
                                                  name="keras_mp_update_under_xla")
            state.update_on = False
        both = _build(model, state, "xla_update", state.update_switch)
        candidates["graph"] = _switched(both, state, False)
        candidates["xla_update"] = _guarded(model, state, "xla_update",
                                            _switched(both, state, True),
                                            graph=lambda: candidates["graph"])
    else:
        candidates["graph"] = _build(model, state, "graph")
    candidates = {m: candidates[m] for m in modes}

    def decided(mode: str) -> None:
        state.chosen = mode
        model.jit_compile = mode == "xla"  # the train step's: evaluate's is inference.jit's

    costs = {}
    if "xla" in candidates and not reasons.float32_class(model):
        costs["xla"] = lambda rec: None if rec.step_bytes is None else (
            rec.step_bytes, "a copy of the step's tensors, held by the step under XLA")
    return step_trial.StepTrial(record, candidates, MARGIN, decided, memory_cost=costs,
                                cache_key=f"{start_up.signature(model)}/{','.join(modes)}",
                                state=lambda: step_trial.training_state(model),
                                steps_per_call=int(model.steps_per_execution or 1),
                                build=lambda batch: optimizer_state.build_metrics(model, batch))


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
    for attr in ("test_function", "predict_function"):
        _installed.install_method(
            model, f"make_{attr}",
            lambda original, attr=attr: inference.make_function(model, attr, original))


def _make_train_function(model: keras.Model, state: _State,
                         original: Callable[..., Any]) -> Callable[..., Any]:
    """The model's ``make_train_function`` under :func:`configure`;
    ``original`` is the class's bound method."""

    def make_train_function(force: bool = False):
        if state.mode == "auto" and start_up.unsettled(model) \
                and not _first_calls_pending(model, state):
            before = state.built
            start_up.settle(model)  # now the coming fit's length is known
            if model.train_function is not None and before not in (None, "trial") \
                    and _decide(model, state) != before:
                force = True
        if model.train_function is not None and not force:
            return model.train_function
        optimizer_state.build(model)  # so that the step is traced once, not twice
        if state.mode != "keep":
            native_update.install(model.optimizer)  # before the trace reads update_step
        chosen = _decide(model, state)  # again: the compute dtypes may have changed
        state.chosen = state.built = chosen
        if chosen == "trial":
            pending = _first_calls_pending(model, state)
            model.train_function = (_first_calls if pending else _trial)(model, state)
            return model.train_function
        if state.mode == "keep":
            original(force=True)
            return model.train_function
        fn = _build(model, state, chosen)
        if chosen != "graph":
            fn = step_trial.FirstCallGuard(model, fn, _fall_back(model, state, chosen), ENV_VAR,
                                           known_failure=lambda: chosen in state.failed)
        # Built before the first trace, so that the step is traced once.
        fn = optimizer_state.metrics_built_first(model, fn)
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
    dtypes is measured anew). The mode is the train step's: ``evaluate``
    and ``predict`` run as ``compile`` set ``jit_compile``
    (:func:`keras_mp.execution.inference.jit`), so that a saved and loaded
    model predicts what the trained one did.

    Args:
        model: a compiled Keras model.
        mode: ``"auto"`` (measure the model's own step on its first
            train-function call, on a copy of the training state,
            :mod:`keras_mp.execution.step_trial`), ``"xla"``,
            ``"xla_update"``, ``"graph"`` or ``"keep"`` (leave ``model.jit_compile`` as compiled). When
            None: the mode an earlier ``configure(model, mode=...)`` gave
            this model (so the callback keeps a mode you chose), else the
            ``KERAS_MP_EXECUTION`` environment variable, else ``"auto"``.
            ``"auto"`` replaces the ``jit_compile`` given to ``compile``;
            use ``"keep"`` to keep it.

    Returns:
        ``"xla"``, ``"xla_update"`` or ``"graph"``: the mode chosen now; ``"trial"`` when
        ``"auto"`` has not measured this model (and its compute dtypes) yet:
        the next train-function call measures it (:func:`chosen` tells the
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
                         "keras_mp.config.set_execution(model).")
    if mode in ("xla", "xla_update") and source == "`mode`":
        reason = (reasons.graph_only if mode == "xla" else reasons.update_only)(model)
        if reason is not None:  # before anything about the model changes
            raise ValueError(f"`mode`={mode!r} cannot be used for this model: {reason}.")
    if state is None:
        state = _State(mode)
        _install(model, state)
        setattr(_installed.installed(model), _ATTR, state)
    elif state.mode != mode:
        state.mode, state.failed = mode, set()
    state.strict = state.explicit = source == "`mode`"
    # Measured before the decision, which asks where the fused matmuls run;
    # where the model may compile nothing, measured in a child process when
    # the train function is built (the coming fit's length known by then,
    # keras_mp.execution.start_up.expect).
    before = model.jit_compile
    unsettled = start_up.unsettled(model)
    if unsettled and mode != "auto":
        placement.measure_elsewhere(model)
        unsettled = False
    if unsettled and reasons.short_fit(model) is None:
        chosen = "trial"  # measured when the train function is built
    else:
        if not unsettled and (mode != "auto" or reasons.short_fit(model) is None):
            # (A short fit measures nothing, whether or not this machine
            # kept measurements: then no model's placement depends on them.)
            placement.apply(model)
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
