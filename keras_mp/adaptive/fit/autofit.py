"""The global policy is enough: ``fit`` adapts a model built under an
adaptive policy without the user adding a callback.

Keras offers no hook between ``fit`` and the callbacks it runs, so keras-mp
wraps one public method, ``keras.Model.fit``, once, on import. The wrapper
looks at the model's layers: if they hold a :class:`keras_mp.AdaptivePolicy`
and no :class:`keras_mp.callbacks.AdaptivePrecision` is among the callbacks,
it adds one with default settings (the same one for every ``fit`` of that
model, so a second ``fit`` continues the first). Everything else passes
through untouched: models under a static policy, models with no layer to
adapt (every layer quantized, say: they train as under Keras), models that override
``fit``, and calls that pass their own ``AdaptivePrecision`` (which is how
to configure it). Where other code replaced ``keras.Model.fit`` before
``import keras_mp``, its wrapper is wrapped if it passes ``**kwargs`` on;
otherwise a warning says once that fit will not adapt and what to pass by
hand (see :func:`install`).

A fit too small to gain from 16 bits gets no callback either: where the most
its arithmetic could save is under :func:`min_saving` seconds
(:mod:`keras_mp.adaptive.decisions.gain`), a model never adapted trains its layers in
float32 (reason ``no_gain``), as Keras float32 does, without adaptation's
start-up. :func:`set_min_saving` (0: adapt every fit) changes the bound.

:func:`set_enabled` turns this off (and on again); with it off, an adaptive
model trained without ``AdaptivePrecision`` keeps its precisions and a
warning says so once.

Every fit of a model under an adaptive policy, adapting or not (too small to
gain, autofit off, float32 the only candidate), also skips the steps whose
gradients are not finite, keeping everything as it was
(:mod:`keras_mp.adaptive.integration.skipping`): the wrapper connects the
optimizer as ``AdaptivePrecision`` would and guards the train step before
Keras traces it.

The same wrapper, for every model, raises the stop of
``LossScaleOptimizer(max_consecutive_skips=...)`` as
:class:`keras_mp.scaling.skips.TooManySkipsError`, whose message is the
sentence alone, in place of TensorFlow's error around it.

Example:
    >>> import keras, numpy as np, keras_mp
    >>> from keras_mp.adaptive.fit import autofit
    >>> from keras_mp.adaptive.decisions import gain
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    >>> autofit.callback_of(model), model.layers[0].compute_dtype  # too small to gain
    (None, 'float32')
    >>> autofit.set_min_saving(0)  # adapt every fit
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    >>> type(autofit.callback_of(model)).__name__, model.layers[0].compute_dtype
    ('AdaptivePrecision', 'bfloat16')
    >>> autofit.set_min_saving(gain.START_UP_S)
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings

import keras
import tensorflow as tf

from keras_mp import _checks as checks
from keras_mp import _installed
from keras_mp.adaptive.decisions import gain
from keras_mp.adaptive.integration import optimizer_setup, skipping, step_functions, switching
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.storage import frozen, moments
from keras_mp.execution import start_up
from keras_mp.scaling import skips

__all__ = ["callback_of", "enabled", "install", "min_saving", "set_enabled", "set_min_saving"]

_ATTR = "auto_callback"  # kept in the model's keras_mp._installed holder
_state = {"enabled": True, "warned": False, "warned_by_hand": False, "keras_fit": None,
          "min_saving": gain.START_UP_S}


def enabled() -> bool:
    """Whether ``fit`` adds an ``AdaptivePrecision`` to adaptive models."""
    return _state["enabled"]


def set_enabled(enabled: bool) -> None:
    """Turns the automatic ``AdaptivePrecision`` in ``fit`` on or off
    (documented as :func:`keras_mp.config.set_autofit`).

    Args:
        enabled: True or False.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be True or False, got {enabled!r}.")
    _state["enabled"] = enabled


def min_saving() -> float:
    """Seconds the most 16-bit could save in a fit must reach for ``fit`` to
    adapt a model never adapted (:func:`keras_mp.adaptive.decisions.gain.pays_off`)."""
    return _state["min_saving"]


def set_min_saving(seconds: float) -> None:
    """Sets :func:`min_saving`: 0 adapts every fit; the default is
    :data:`keras_mp.adaptive.decisions.gain.START_UP_S`.

    Args:
        seconds: a finite number >= 0.
    """
    _state["min_saving"] = checks.non_negative("seconds", seconds)


def callback_of(model: keras.Model):
    """The ``AdaptivePrecision`` that ``fit`` added to ``model``, or None."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    return getattr(model.__dict__.get(_installed.INSTALLED_ATTR), _ATTR, None)


def _settle(model: keras.Model, policy, layers, fit_arguments: dict) -> bool:
    """Whether ``fit`` trains a model never adapted in float32, as too small
    to gain from 16 bits (:func:`keras_mp.adaptive.decisions.gain.pays_off`); if so, its
    layers are put there (reason ``no_gain``; ``AdaptivePrecision`` puts them
    back when it adapts the model)."""
    if policy.calls or callback_of(model) is not None or len(policy.candidates) == 1:
        return False  # adapted before (its evidence and traces go on), or float32 alone
    if gain.pays_off(model, fit_arguments, _state["min_saving"]):
        return False
    if switching.settle(policy, [layer.path for layer in layers], layers, policy.calls):
        # Functions traced before in the old dtypes are traced again.
        model.train_function = model.test_function = model.predict_function = None
    return True


def _added(callbacks, given: list, new):
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(new)
        return callbacks
    return [*given, new]


def _guarded(model: keras.Model, policy, callbacks, given: list, by_hand):
    """Every fit of an adaptive model skips non-finite steps (skipping), from
    its first step: the optimizer connected as AdaptivePrecision would (with
    its ``loss_scale``), the train step guarded, and a report each epoch."""
    if not skipping.enabled() or getattr(model, "optimizer", None) is None:
        return callbacks
    optimizer_setup.connect(model, policy, getattr(by_hand, "loss_scale", None),
                            step_functions.keras_train_step(model))
    skipping.guard(model)
    if any(isinstance(cb, skipping.SkipReport) for cb in given):
        return callbacks
    return _added(callbacks, given, skipping.SkipReport())


def _stored(model: keras.Model, layers, restore_only: bool) -> None:
    """Each weight stored as :mod:`keras_mp.adaptive.storage.frozen` decides,
    and its moments as :mod:`~keras_mp.adaptive.storage.moments` does: first
    before anything of the fit builds the optimizer (its slots are then made
    in the dtype decided, never in float32 first: the Llama of
    ``benchmarks/llm_memory.py`` peaked 120-160 MiB higher where they were
    converted after the build), and again once the layers' dtypes for the
    fit are set (a small fit's ``no_gain`` puts them in float32, whose
    moments are float32: stored anew). Functions traced with a variable
    stored anew are traced again."""
    changed = frozen.apply(model, layers, restore_only=restore_only)
    if moments.apply(model):
        changed = True
    if changed:
        model.train_function = model.test_function = model.predict_function = None


def _with_adaptive(model: keras.Model, callbacks, fit_arguments: dict):
    policy = policy_of(model)
    layers = adaptive_layers(model, policy) if policy is not None else []
    if not layers:
        return callbacks  # nothing to adapt (every layer quantized, say): Keras's fit
    # Weights that train again are float32 before Keras builds the optimizer;
    # the frozen ones are stored once the layers' dtypes for this fit are set.
    _stored(model, layers, restore_only=True)
    callbacks = _adapting(model, policy, layers, callbacks, fit_arguments)
    _stored(model, layers, restore_only=False)
    return callbacks


def _adapting(model: keras.Model, policy, layers, callbacks, fit_arguments: dict):
    """The callbacks of an adaptive model's fit (see the module's docstring)."""
    given = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) \
        else list(callbacks or [])
    # Imported when a fit needs it: no AdaptivePrecision exists before its module is.
    module = sys.modules.get("keras_mp.adaptive.fit.callback")
    by_hand = next((cb for cb in given if module is not None
                    and isinstance(cb, module.AdaptivePrecision)), None)
    callbacks = _guarded(model, policy, callbacks, given, by_hand)
    given = callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList) \
        else list(callbacks or [])
    if by_hand is not None:
        return callbacks
    if not _state["enabled"]:
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(
                "keras_mp: this model uses an adaptive policy, but automatic adaptation is "
                "off (keras_mp.config.set_autofit(False)) and no "
                "keras_mp.callbacks.AdaptivePrecision was passed to fit: its precisions stay "
                "as they are. Pass callbacks=[keras_mp.callbacks.AdaptivePrecision()] to "
                "adapt.", stacklevel=3)
        return callbacks
    if _settle(model, policy, layers, fit_arguments):
        return callbacks  # too small to gain from 16 bits: float32, Keras's fit
    cb = callback_of(model)
    if cb is None:
        from keras_mp.adaptive.fit.callback import AdaptivePrecision

        cb = AdaptivePrecision(history_logs=False)  # History stays Keras's
        setattr(_installed.installed(model), _ATTR, cb)  # nothing Keras should track or save
    return _added(callbacks, given, cb)


def _keras_signature() -> inspect.Signature:
    """The signature of Keras's own ``fit`` (whatever wraps it now)."""
    for cls in keras.Model.__mro__:
        fn = cls.__dict__.get("fit")
        if fn is not None and getattr(fn, "__module__", "").startswith("keras."):
            return inspect.signature(fn)
    raise RuntimeError("Keras's own Model.fit was not found.")  # pragma: no cover


def _warn_by_hand(why: str) -> None:
    if not _state["warned_by_hand"]:
        _state["warned_by_hand"] = True
        warnings.warn(
            f"keras_mp: {why}, so fit cannot add keras_mp's AdaptivePrecision by itself: "
            "models under an adaptive policy keep their precisions unless you pass "
            "callbacks=[keras_mp.callbacks.AdaptivePrecision()] to fit.", stacklevel=3)


def install() -> None:
    """Wraps ``keras.Model.fit`` (once; idempotent). Called on import.

    If other code replaced ``keras.Model.fit`` before (a wrapper), the
    wrapper is wrapped: the callbacks are found by Keras's own signature and
    handed on by keyword, which a wrapper taking ``**kwargs`` passes on. A
    replacement that takes no ``callbacks`` and no ``**kwargs`` cannot be
    adapted: a warning says so once, with what to pass by hand.
    """
    if _state["keras_fit"] is not None:
        return
    keras_fit = keras.Model.fit
    signature = inspect.signature(keras_fit)
    params = signature.parameters
    if "callbacks" not in params:
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            _warn_by_hand(f"keras.Model.fit was replaced by {keras_fit.__qualname__!r} "
                          f"(of {keras_fit.__module__}), which takes no `callbacks`")
            return
        signature = _keras_signature()  # a wrapper: (self, *args, **kwargs)

    def adapted(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            # Arguments Keras's fit would refuse: let whoever wrapped it say so.
            return keras_fit(self, *args, **kwargs)
        callbacks = bound.arguments.get("callbacks")
        new = _with_adaptive(self, callbacks, bound.arguments)
        if new is not callbacks:
            bound.arguments["callbacks"] = new
        # The callbacks take the execution choice once they know the fit's length.
        with start_up.fitting(self):
            if "callbacks" in params:
                return keras_fit(*bound.args, **bound.kwargs)
            # A wrapper with **kwargs: callbacks by keyword, the rest as given.
            n = len(args) + 1
            names = list(signature.parameters)
            if "callbacks" in names[:n]:
                args = list(args)
                args[names.index("callbacks") - 1] = bound.arguments["callbacks"]
            elif new is not callbacks:
                kwargs = {**kwargs, "callbacks": new}
            return keras_fit(self, *args, **kwargs)

    @functools.wraps(keras_fit)
    def fit(self, *args, **kwargs):
        try:
            return adapted(self, *args, **kwargs)
        except tf.errors.OpError as e:
            # max_consecutive_skips stopped the compiled step: its sentence
            # first, not at the end of TensorFlow's op stack.
            readable = skips.readable(e)
            if readable is None:
                raise
            raise readable from None

    _state["keras_fit"] = keras_fit
    keras.Model.fit = fit
