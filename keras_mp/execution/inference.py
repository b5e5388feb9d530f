"""How ``evaluate`` and ``predict`` run under :func:`keras_mp.execution.configure`:
as the model's ``compile`` set ``jit_compile``, whatever mode the train step
runs in.

The train step's mode (``graph``, ``xla_update``, ``xla``) is chosen for
speed, and XLA rounds differently from a TensorFlow graph (it keeps float32
between the operations it fuses, where a graph rounds each one to the
compute dtype). A model saved to a ``.keras`` file is loaded and compiled
with the ``jit_compile`` its ``compile`` resolved (Keras's ``"auto"`` is
False on a CPU), not with the mode keras_mp chose for its train step: had
the trained model predicted under XLA, the loaded one would predict other
numbers (0.0156 at most on the keras-io multi-input, multi-output model
under ``"adaptive_float16"``, where its step ran under XLA). So inference
runs in one fixed mode, :func:`jit`, before and after saving, and the loaded
model predicts what the trained model predicted, to the bit, as Keras's own
reloads do. ``model.export`` serves the model's call as a TensorFlow graph.

Example:
    >>> import keras
    >>> from keras_mp.execution import configure, inference
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="rmsprop", loss="mse")
    >>> configure(model, mode="xla"), model.jit_compile, inference.jit(model)
    ('xla', True, False)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras

from keras_mp.device import xla
from keras_mp.execution import reasons

__all__ = ["jit", "without_xla", "trace_scope", "make_function"]


def jit(model: keras.Model) -> bool:
    """Whether ``evaluate`` and ``predict`` run under XLA for ``model``: as
    its ``compile`` set ``jit_compile`` (``"auto"`` resolved when it
    compiled), which a model loaded from a ``.keras`` file gets back;
    False for a model that runs eagerly or cannot be compiled by XLA.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        >>> jit(model)
        True
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    from keras.src.trainers.trainer import model_supports_jit

    compiled = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    return compiled.get("jit_compile") is True and not getattr(model, "run_eagerly", False) \
        and model_supports_jit(model)


@contextlib.contextmanager
def _compiled_as(model: keras.Model) -> Iterator[None]:
    """``model.jit_compile`` set to :func:`jit` while Keras builds a test or
    predict function (Keras reads it then); the train step's afterwards."""
    train = model.__dict__.get("_jit_compile")
    object.__setattr__(model, "_jit_compile", jit(model))  # a bool: nothing for Keras to track
    try:
        yield
    finally:
        object.__setattr__(model, "_jit_compile", train)


def without_xla(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, called (and so traced) inside :func:`keras_mp.device.xla.disabled`.

    Example:
        >>> without_xla(lambda: xla.uses_xla("elementwise"))()
        False
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {fn!r}.")

    def step_function(*args, **kwargs):
        with xla.disabled():
            return fn(*args, **kwargs)

    return step_function


def trace_scope(model: keras.Model) -> contextlib.AbstractContextManager:
    """The context in which keras_mp traces a step of ``model`` in the
    graph: :func:`keras_mp.device.xla.disabled` where
    :func:`keras_mp.execution.reasons.little_to_compile` says XLA would not
    pay for itself, else nothing. (The train function's graph mode applies
    it itself; the adaptive float32 probe uses it.)

    Example:
        >>> import keras
        >>> from keras_mp.device import xla
        >>> cnn = keras.Sequential([keras.Input((8, 8, 16)), keras.layers.Conv2D(64, 3),
        ...                         keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
        >>> with trace_scope(cnn):
        ...     xla.uses_xla("elementwise")
        False
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if reasons.little_to_compile(model) is not None:
        return xla.disabled()
    return contextlib.nullcontext()


def make_function(model: keras.Model, attr: str,
                  original: Callable[..., Any]) -> Callable[..., Any]:
    """The model's ``make_test_function`` or ``make_predict_function``
    (``attr``: ``"test_function"`` or ``"predict_function"``, what it
    sets; ``original``: Keras's): Keras's, built as :func:`jit` says, not
    in the train step's mode, and traced inside
    :func:`keras_mp.device.xla.disabled` where
    :func:`keras_mp.execution.reasons.little_to_compile` gives a reason.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    if attr not in ("test_function", "predict_function"):
        raise ValueError(f"`attr` must be 'test_function' or 'predict_function', got {attr!r}.")

    seen: list[Callable[[], Any]] = [lambda: None]  # a weak reference: Keras may drop it

    def make(force: bool = False):
        with _compiled_as(model):
            original(force=force)  # Keras's returns nothing: it sets model.<attr>
        fn = getattr(model, attr)
        if fn is None or fn is seen[0]():  # evaluate() and predict() ask on every call
            return fn
        if not jit(model) and reasons.little_to_compile(model) is not None:
            fn = without_xla(fn)
            setattr(model, attr, fn)
        seen[0] = weakref.ref(fn)
        return fn

    return make
