"""What keras_mp knows about a model's training before it starts: the
coming ``fit``'s length (:func:`expect`, from Keras's callback parameters,
:func:`expected_calls`) and what identifies its train step across processes
(:func:`signature`, the key of the execution trial's decision kept by
:mod:`keras_mp.device.cache`, and of the rules read from the process's
memory, :func:`kept_reason`).

Example:
    >>> import keras
    >>> from keras_mp.execution import start_up
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> start_up.expect(model, start_up.expected_calls({"epochs": 3, "steps": 32}))
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading

import keras

from keras_mp import _installed
from keras_mp.device import cache as disk
from keras_mp.execution import placement, reasons

__all__ = ["expect", "expected_calls", "fitting", "in_fit", "signature", "unsettled", "settle",
           "kept_reason"]

_fits = threading.local()  # ids of the models whose fit this thread is in


@contextlib.contextmanager
def fitting(model: keras.Model):
    """Marks ``model``'s ``fit`` as under way in this thread (keras_mp's wrapper
    of ``keras.Model.fit`` enters it, :mod:`keras_mp.adaptive.fit.autofit`), so
    that a callback set up by it (:class:`keras_mp.callbacks.AdaptivePrecision`)
    takes the execution choice once the fit's length is known
    (``set_params``, :func:`expect`), not before.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> with fitting(model):
        ...     in_fit(model)
        True
        >>> in_fit(model)
        False
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    outer = getattr(_fits, "models", ())
    _fits.models = (*outer, id(model))
    try:
        yield
    finally:
        _fits.models = outer


def in_fit(model: keras.Model) -> bool:
    """Whether ``model``'s ``fit`` is under way in this thread (:func:`fitting`)."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    return id(model) in getattr(_fits, "models", ())


def expect(model: keras.Model, calls: int | None) -> None:
    """Tells the execution choice how many train-function calls the coming
    ``fit`` of ``model`` makes (None: unknown, e.g. a dataset of unknown
    length). :class:`~keras_mp.callbacks.AdaptivePrecision` calls it from
    ``fit``'s epochs and steps; a short fit of a small ``Dense`` model then
    measures nothing (:func:`keras_mp.execution.reasons.short_fit`).

    Args:
        model: a Keras model.
        calls: an int >= 0, or None.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> expect(model, 300)
        >>> expect(model, None)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 0):
        raise ValueError(f"`calls` must be an int >= 0 or None, got {calls!r}.")
    setattr(_installed.installed(model), reasons.EXPECTED_ATTR, calls)


def expected_calls(params: dict, steps_per_execution: int = 1) -> int | None:
    """The train-function calls of a ``fit`` from the ``params`` Keras gives
    its callbacks (``epochs`` and ``steps`` per epoch), or None where unknown.

    >>> expected_calls({"epochs": 3, "steps": 32}), expected_calls({"epochs": 2, "steps": None})
    (96, None)
    """
    epochs, steps = (params or {}).get("epochs"), (params or {}).get("steps")
    if not isinstance(epochs, int) or not isinstance(steps, int):
        return None
    return epochs * math.ceil(steps / max(int(steps_per_execution or 1), 1))


def signature(model: keras.Model) -> str:
    """What identifies ``model``'s train step for the execution trial's
    decision kept on disk (:mod:`keras_mp.device.cache`): the model's class,
    each layer's class, compute dtype and weight shapes, the optimizer's and
    loss's classes and ``steps_per_execution``, hashed
    (layer names left out: they differ from process to process).

    Example:
        >>> import keras
        >>> def build():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     return model
        >>> signature(build()) == signature(build())
        True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    layers = [(type(layer).__name__, layer.compute_dtype,
               [list(map(int, w.shape)) for w in layer.weights])
              for layer in model._flatten_layers(include_self=False)]
    loss = getattr(model, "loss", None)
    parts = [type(model).__name__, layers, type(getattr(model, "optimizer", None)).__name__,
             loss if isinstance(loss, str) else type(loss).__name__,
             int(getattr(model, "steps_per_execution", 1) or 1)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def unsettled(model: keras.Model) -> bool:
    """Whether ``model``'s measurements are made in a child process and
    are not known yet (:func:`keras_mp.execution.placement.measured`):
    then :func:`keras_mp.execution.configure` leaves them to :func:`settle`,
    called when the train function is built."""
    return reasons.small_xla_work(model) == "dense" and not placement.measured(model)


def settle(model: keras.Model) -> None:
    """Measures what the decision needs (in a child process), unless the
    coming fit is too short to pay for it (:func:`keras_mp.execution.reasons.short_fit`)."""
    if reasons.short_fit(model) is not None:
        return
    placement.measure_elsewhere(model)
    placement.apply(model)


def kept_reason(model: keras.Model, name: str, rule) -> str | None:
    """``rule(model)`` (a :mod:`keras_mp.execution.reasons` rule, named
    ``name``), taken once per device and model :func:`signature` and kept
    on disk (:mod:`keras_mp.device.cache`): for a rule that reads what the
    process holds (its resident memory, which differs from one process to
    the next, e.g. with and without start-up's measurements), so that a
    later process training the same model gets the same answer, and the
    same train step (docs/architecture.md, "Decisions made from timings").
    With the cache off, the rule is asked each time.

    Example:
        >>> import keras
        >>> from keras_mp.execution import reasons
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="rmsprop", loss="mse")
        >>> kept_reason(model, "update_memory", reasons.update_memory) is None
        True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if not isinstance(name, str) or not name or not callable(rule):
        raise ValueError(f"`name` must be a non-empty str and `rule` callable, got {name!r} "
                         f"and {rule!r}.")
    key = f"{name}/{signature(model)}"
    found = disk.get("reasons", key)
    if isinstance(found, dict) and (found.get("reason") is None
                                    or isinstance(found.get("reason"), str)):
        return found.get("reason")
    reason = rule(model)
    disk.put("reasons", key, {"reason": reason})
    return reason
