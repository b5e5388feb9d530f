"""keras-mp's settings, in one place (as ``keras.config`` holds Keras's).

| setting | call | default |
| --- | --- | --- |
| ``fit`` adds ``AdaptivePrecision`` under an adaptive policy | :func:`set_autofit` | on |
| the least a fit must be able to save for ``fit`` to adapt it | :func:`set_min_saving` | 0.5 s |
| XLA for a kind of work (``"matmul"``, ``"elementwise"``, ...) | :func:`set_xla` | measured |
| a model's execution mode (graph, ``xla_update``, ``xla``) | :func:`set_execution` | measured |
| adaptive fits skip steps whose gradients are not finite | :func:`set_skip_nonfinite` | on |
| frozen weights stored in their layer's compute dtype | :func:`set_compact_storage` | on |
| one variable kept in float32 whatever the rule | :func:`set_storage` | the rule |
| Adam's moments in bfloat16, the update in float32 | :func:`set_compact_moments` | on in a model training 2**24 parameters or more |
| trained weights (and their gradients) in bfloat16, updates rounded stochastically | :func:`set_compact_weights` | on in a model training 2**24 parameters or more |

Environment variables, read when used: ``KERAS_MP_EXECUTION`` (the
execution mode of every model: ``auto``, ``graph``, ``xla_update``, ``xla``,
``keep``; :func:`set_execution` wins over it) and ``KERAS_MP_CACHE_DIR``
(where what start-up measures is kept, :mod:`keras_mp.device.cache`).

Each function here is the documented name of a setting whose state lives
with its concept (:mod:`keras_mp.adaptive.fit.autofit`,
:mod:`keras_mp.device.xla`, :mod:`keras_mp.execution`).

Example:
    >>> import keras_mp
    >>> keras_mp.config.autofit_enabled(), keras_mp.config.min_saving()
    (True, 0.5)
    >>> keras_mp.config.set_min_saving(0)      # adapt every fit, however small
    >>> keras_mp.config.set_min_saving(0.5)
"""

from __future__ import annotations

from typing import Any

from keras_mp.adaptive.fit import autofit
from keras_mp.adaptive.integration import skipping
from keras_mp.adaptive.storage import frozen, moments, trained
from keras_mp.device import xla

__all__ = ["autofit_enabled", "compact_moments", "compact_storage", "compact_weights",
           "min_saving", "set_autofit", "set_compact_moments", "set_compact_storage",
           "set_compact_weights", "set_execution",
           "set_min_saving", "set_skip_nonfinite", "set_storage", "set_xla", "skip_nonfinite",
           "uses_xla"]


def set_autofit(enabled: bool) -> None:
    """Whether ``fit`` adds an ``AdaptivePrecision`` callback by itself to a
    model under an adaptive policy (on by default). Off, such a model keeps
    its precisions unless ``callbacks=[keras_mp.callbacks.AdaptivePrecision()]``
    is passed to ``fit``.

    Args:
        enabled: True or False.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_autofit(False); keras_mp.config.autofit_enabled()
        False
        >>> keras_mp.config.set_autofit(True)
    """
    autofit.set_enabled(enabled)


def autofit_enabled() -> bool:
    """Whether ``fit`` adds ``AdaptivePrecision`` by itself (:func:`set_autofit`)."""
    return autofit.enabled()


def set_min_saving(seconds: float) -> None:
    """The least time, in seconds, that 16-bit arithmetic must be able to
    save in a fit for ``fit`` to adapt a model never adapted
    (:mod:`keras_mp.adaptive.decisions.gain`); below it the fit trains in
    float32 (reason ``no_gain``). 0 adapts every fit, however small.

    Args:
        seconds: a finite number >= 0 (default 0.5).
    """
    autofit.set_min_saving(seconds)


def min_saving() -> float:
    """The bound set by :func:`set_min_saving`."""
    return autofit.min_saving()


def set_skip_nonfinite(enabled: bool) -> None:
    """Whether ``fit`` under an adaptive policy skips a step whose gradients
    are not finite and keeps everything as it was: weights, optimizer state,
    moving statistics, metric totals (on by default;
    :mod:`keras_mp.adaptive.integration.skipping`). Off, only float16's loss
    scaling skips such steps, as Keras's does, and a model compiled afterwards
    keeps its own optimizer where no float16 needs a loss scale.

    Args:
        enabled: True or False.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_skip_nonfinite(False); keras_mp.config.skip_nonfinite()
        False
        >>> keras_mp.config.set_skip_nonfinite(True)
    """
    skipping.set_enabled(enabled)


def skip_nonfinite() -> bool:
    """Whether adaptive fits skip non-finite steps (:func:`set_skip_nonfinite`)."""
    return skipping.enabled()


def set_compact_storage(enabled: bool) -> None:
    """Whether ``fit`` under an adaptive policy stores the weights that do not
    train (``trainable=False``, LoRA base kernels, frozen backbones) in their
    layer's compute dtype, bfloat16 or float16 (on by default;
    :mod:`keras_mp.adaptive.storage.frozen` says when and which). Off, the
    next ``fit`` stores every variable in float32 again (the values kept).

    Args:
        enabled: True or False.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_compact_storage(False); keras_mp.config.compact_storage()
        False
        >>> keras_mp.config.set_compact_storage(True)
    """
    frozen.set_enabled(enabled)


def compact_storage() -> bool:
    """Whether frozen weights are stored compactly (:func:`set_compact_storage`)."""
    return frozen.enabled()


def set_compact_moments(enabled: bool | None) -> None:
    """Whether ``fit`` under an adaptive policy stores an optimizer's moments
    in bfloat16 and computes the update in float32 from them: True for every
    weight (the moments of an exact Adam, AdamW, SGD with momentum, Adamax,
    Nadam or Lion, Adafactor's ``_v``), False for none, None (the default)
    for Adam's and AdamW's moments of the weights of layers computing in 16
    bits in a model that trains at least 2**24 parameters
    (:data:`keras_mp.adaptive.storage.trained.AUTO_PARAMETERS`);
    :mod:`keras_mp.adaptive.storage.moments` says what it applies to.

    Args:
        enabled: True, False or None.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_compact_moments(True); keras_mp.config.compact_moments()
        True
        >>> keras_mp.config.set_compact_moments(None)     # the default
    """
    moments.set_enabled(enabled)


def compact_moments() -> bool | None:
    """The setting of :func:`set_compact_moments` (None: the default)."""
    return moments.enabled()


def set_compact_weights(enabled: bool | None) -> None:
    """Whether ``fit`` under an adaptive policy stores the weights that train
    in bfloat16 where their layer computes in bfloat16, their gradients
    bfloat16 with them, each update computed in float32 and rounded
    stochastically: True in every model, False in none, None (the default)
    in a model that trains at least 2**24 parameters
    (:data:`keras_mp.adaptive.storage.trained.AUTO_PARAMETERS`);
    :mod:`keras_mp.adaptive.storage.trained` says how, and for which
    optimizers. Where off, the next ``fit`` stores them in float32 again.

    Args:
        enabled: True, False or None.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_compact_weights(True); keras_mp.config.compact_weights()
        True
        >>> keras_mp.config.set_compact_weights(None)     # the default
    """
    trained.set_enabled(enabled)


def compact_weights() -> bool | None:
    """The setting of :func:`set_compact_weights` (None: the default)."""
    return trained.enabled()


def set_storage(model: Any, variable: Any, dtype: str | None) -> None:
    """Keeps one variable of ``model`` in float32 (``"float32"``), and its
    optimizer moments, whatever :func:`set_compact_storage`'s rule (and
    :func:`set_compact_moments`) decides, or gives it back to the rule (None).
    Saved with the model, applied at its next ``fit``.

    Args:
        model: a Keras model under an adaptive policy.
        variable: a ``keras.Variable`` of one of its layers.
        dtype: ``"float32"`` or None.

    Example:
        >>> import keras, keras_mp
        >>> keras_mp.set_global_policy("adaptive_bfloat16")
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.trainable = False
        >>> keras_mp.config.set_storage(model, model.layers[0].kernel, "float32")
        >>> [m["variable"].split("/")[-1] for m in keras_mp.adaptive.storage.frozen.apply(model)]
        ['bias']
        >>> keras_mp.set_global_policy("float32")
    """
    frozen.set_override(model, variable, dtype)


def set_xla(kind: str, enabled: bool | None) -> None:
    """Forces XLA on (True) or off (False) for one kind of work, or gives the
    choice back to the measurement (None).

    Args:
        kind: ``"matmul"``, ``"elementwise"`` or ``"multi_tensor"``
            (:data:`keras_mp.device.xla.Kind`).
        enabled: True, False or None.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_xla("elementwise", False); keras_mp.config.uses_xla("elementwise")
        False
        >>> keras_mp.config.set_xla("elementwise", None)
    """
    xla.set_xla(kind, enabled)


def uses_xla(kind: str) -> bool:
    """Whether work of ``kind`` runs under XLA now (:func:`set_xla`)."""
    return xla.uses_xla(kind)


def set_execution(model: Any, mode: str | None = None) -> str:
    """Sets how ``model``'s train step runs: ``"graph"``, ``"xla_update"``
    (the graph, with the optimizer's update compiled by XLA), ``"xla"`` (the
    whole step compiled), ``"auto"`` (measured on the model's first call),
    or ``"keep"`` (as ``model.compile`` set it). None reads
    ``KERAS_MP_EXECUTION`` (default ``"auto"``). Returns the mode applied
    (``"trial"`` while ``auto`` measures). ``AdaptivePrecision`` calls it
    with ``mode=None`` when it attaches.

    Args:
        model: a compiled Keras model.
        mode: one of the modes above, or None.

    Example:
        >>> import keras, keras_mp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> keras_mp.config.set_execution(model, "graph")
        'graph'
    """
    from keras_mp.execution import choice  # the execution choice: imported when used

    return choice.configure(model, mode=mode)
