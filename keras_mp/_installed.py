"""What keras-mp installs on a Keras object, kept out of what serializes it.

keras-mp wraps methods of single instances (a layer's ``call`` for forward
statistics, a model's ``train_step`` for the probe and
``make_train_function`` for the execution mode, an optimizer's ``apply`` or
its update step) and keeps state beside them (the originals, the compiled
optimizer update, the execution mode's measurements, ``fit``'s callback).
All of it goes through :func:`install_method` and :func:`installed`: the
wrapper is a plain Python function in the instance's ``__dict__``, and
everything else sits in one :class:`Installed` holder that nothing
serializing a Keras object follows. SavedModel traces every ``tf.function``
among an object's attributes: a compiled optimizer update found there made
``model.export`` raise ``KeyError: None`` (Keras's ``_get_variable_index``)
after the ``xla_update`` mode or the execution trial.

The bottom of the package (floor 0): the adaptive hooks, the execution mode
and the compiled update all install through here.

Example:
    >>> import keras
    >>> from keras_mp import _installed
    >>> opt = keras.optimizers.SGD()
    >>> _ = _installed.install_method(opt, "get_config", lambda f: lambda: {**f(), "seen": 1})
    >>> opt.get_config()["seen"], _installed.is_wrapped(opt, "get_config")
    (1, True)
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

__all__ = ["INSTALLED_ATTR", "Installed", "installed", "install_method", "original", "is_wrapped",
           "keep_with_step", "step_variables"]

#: The one attribute that holds what keras-mp installed on a Keras object.
INSTALLED_ATTR = "_keras_mp_installed"


class Installed:
    """What keras-mp installed on one Keras object (model, layer or
    optimizer): ``originals`` (method name -> the method before keras-mp
    wrapped it) and, as attributes, the state its modules keep there (e.g.
    ``compiled_update``, ``execution``, ``auto_callback``,
    ``float8_recorder``).

    Opaque to what serializes, tracks or copies Keras objects: not a
    TensorFlow ``Trackable`` (checkpoints and SavedModel follow those), not a
    ``tf.function`` (SavedModel traces every one among an object's
    attributes, outside any train step), not a Keras saveable, list or dict
    (``.keras`` files and Keras's tracking follow those), and set with
    ``object.__setattr__``.
    """

    def __init__(self):
        self.originals: dict[str, Callable] = {}

    def __repr__(self) -> str:
        names = sorted(k for k in vars(self) if k != "originals")
        return f"<keras_mp Installed: wraps {sorted(self.originals)}, holds {names}>"


def installed(obj) -> Installed:
    """The :class:`Installed` holder of ``obj`` (a Keras model, layer or
    optimizer), attached on first use.

    Example:
        >>> import keras
        >>> opt = keras.optimizers.SGD()
        >>> installed(opt) is installed(opt), installed(opt).originals
        (True, {})
    """
    held = obj.__dict__.get(INSTALLED_ATTR)
    if held is None:
        held = Installed()
        # Not Keras's __setattr__: nothing to track, and nothing to save.
        object.__setattr__(obj, INSTALLED_ATTR, held)
    return held


def install_method(obj, name: str, make: Callable[[Callable], Callable]) -> Callable:
    """Replaces ``obj.<name>``, for this instance only, with
    ``make(original)``, where ``original`` is the method as it was before
    keras-mp first wrapped it (installing again wraps the original anew,
    never a wrapper). Returns the wrapper.

    Raises:
        TypeError: ``make`` returned a ``tf.function`` (or anything not a
            plain callable): SavedModel would trace it when the model is
            exported; keep compiled functions inside the wrapper (or in
            :func:`installed`) instead.

    Example:
        >>> import keras
        >>> opt = keras.optimizers.SGD()
        >>> _ = install_method(opt, "get_config", lambda f: lambda: {**f(), "seen": True})
        >>> opt.get_config()["seen"], is_wrapped(opt, "get_config")
        (True, True)
        >>> original(opt, "get_config")().get("seen")
    """
    held = installed(obj)
    if name not in held.originals:
        held.originals[name] = getattr(obj, name)
    wrapper = make(held.originals[name])
    if not callable(wrapper) or isinstance(wrapper, (tf.types.experimental.GenericFunction,
                                                     tf.types.experimental.ConcreteFunction)):
        raise TypeError(f"The wrapper of {name!r} must be a plain Python callable, got "
                        f"{wrapper!r}: SavedModel traces the tf.functions it finds on an "
                        "object.")
    object.__setattr__(obj, name, wrapper)
    return wrapper


def original(obj, name: str) -> Callable:
    """``obj.<name>`` as it was before keras-mp wrapped it (as it is, if it
    did not)."""
    held = obj.__dict__.get(INSTALLED_ATTR)
    if held is not None and name in held.originals:
        return held.originals[name]
    return getattr(obj, name)


def is_wrapped(obj, name: str) -> bool:
    """Whether :func:`install_method` replaced ``obj.<name>``."""
    held = obj.__dict__.get(INSTALLED_ATTR)
    return held is not None and name in held.originals


def keep_with_step(obj, name: str, variables) -> None:
    """Counts ``variables`` among the state of ``obj``'s train step (``obj``:
    a model) beyond what Keras lists (its ``variables``, its optimizer's and
    its metrics'): keras-mp's own, which its step writes (the adaptive
    statistics, the skip guard's counts), under ``name`` (kept again under
    the same name: replaced). The execution trial puts all of it back after
    each call it makes on a copy of the training state
    (:mod:`keras_mp.execution.step_trial`).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        >>> counter = keras.Variable(0)
        >>> keep_with_step(model, "counter", [counter])
        >>> step_variables(model) == [counter]
        True
    """
    installed(obj).__dict__.setdefault("step_variables", {})[name] = list(variables)


def step_variables(obj) -> list:
    """What :func:`keep_with_step` counted for ``obj``, in order (empty if nothing)."""
    held = obj.__dict__.get(INSTALLED_ATTR)
    return [v for kept in getattr(held, "step_variables", {}).values() for v in kept]
