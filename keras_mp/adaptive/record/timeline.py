"""What :class:`keras_mp.callbacks.AdaptivePrecision` records over a run, for
:func:`keras_mp.plot_precision`: at the start and at every decision, the
step (train-function call), the global loss scale, the per-layer loss scales
(where used), the skipped-step count and the training state's size (weights,
gradients and moments, as stored: :mod:`keras_mp.adaptive.storage` changes it
at the start of a fit); and the last step trained.

The dtypes over the steps need no record of their own: every layer's switch
history (step, old, new, reason) is kept in the policy
(:func:`keras_mp.precision_report`), which ``.keras`` files carry too. The
timeline lives beside the model, in what keras-mp installs on it
(:mod:`keras_mp._installed`), and a second ``fit`` of the same model continues
it. Weights files (``save_weights``, ``BackupAndRestore``, ``ModelCheckpoint``)
carry it beside the controller's state
(:class:`keras_mp.adaptive.record.state.PrecisionState`), so that a resumed run
draws its whole picture; :func:`restore` puts it back. One decision adds one
entry (a few floats).

Example:
    >>> import keras
    >>> from keras_mp.adaptive.record import timeline
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> timeline.record(model, 0, None, ("dense",), None)
    >>> t = timeline.of(model)
    >>> t.entries[0]["step"], t.entries[0]["loss_scale"], t.last_step
    (0, None, 0)
    >>> restore(model, {"entries": [], "last_step": 5}); of(model).last_step
    5
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _installed

__all__ = ["Timeline", "finish", "of", "record", "restore", "state_mib"]

_ATTR = "precision_timeline"


@dataclasses.dataclass
class Timeline:
    """A run's record.

    Attributes:
        entries: dicts with ``step``, ``loss_scale`` (the global scale, or
            None without loss scaling), ``layer_scales`` (path -> the scale
            its gradients carry, with per-layer loss scales; else None) and
            ``skipped_steps`` (skipped so far, or None) and ``state_mib``
            (:func:`state_mib`: MiB of weights, gradients and moments; absent
            from timelines saved before it), in step order.
        last_step: the last train-function call counted.
    """

    entries: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    last_step: int = 0

    def get_config(self) -> dict[str, Any]:
        """The timeline as plain values (JSON), for :func:`restore`."""
        return {"entries": copy.deepcopy(self.entries), "last_step": self.last_step}


def of(model: keras.Model) -> Timeline | None:
    """The model's timeline, or None if nothing was recorded."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    held = model.__dict__.get(_installed.INSTALLED_ATTR)
    return getattr(held, _ATTR, None)


def _scalar(value) -> float:
    return float(keras.ops.convert_to_numpy(value))


def record(model: keras.Model, step: int, optimizer, paths: Sequence[str],
           layer_scales: Sequence[float] | None) -> None:
    """Appends one entry (replacing one already at ``step``).

    Args:
        model: the model trained.
        step: the train-function call.
        optimizer: the model's optimizer (its ``loss_scale`` and
            ``skipped_steps`` are read where it has them), or None.
        paths: the controlled layers' paths.
        layer_scales: with per-layer loss scales, one scale per path; else None.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"`step` must be an int >= 0, got {step!r}.")
    timeline = of(model)
    if timeline is None:
        timeline = Timeline()
        setattr(_installed.installed(model), _ATTR, timeline)
    scale = getattr(optimizer, "loss_scale", None)
    skipped = getattr(optimizer, "skipped_steps", None)
    entry = {"step": int(step),
             "loss_scale": None if scale is None else _scalar(scale),
             "layer_scales": None if layer_scales is None
             else dict(zip(paths, map(float, layer_scales))),
             "skipped_steps": None if skipped is None else int(_scalar(skipped)),
             "state_mib": state_mib(model, optimizer)}
    if timeline.entries and timeline.entries[-1]["step"] == entry["step"]:
        timeline.entries[-1] = entry
    else:
        timeline.entries.append(entry)
    timeline.last_step = max(timeline.last_step, int(step))


def _mib(variables) -> float:
    seen: dict[int, Any] = {}
    for v in variables:
        seen.setdefault(id(v), v)
    return sum(int(np.prod(v.shape)) * tf.as_dtype(_stored(v)).size
               for v in seen.values()) / 2 ** 20


def _stored(variable) -> str:
    """The dtype ``variable`` holds its values in, not the autocast dtype a
    read inside a layer's call sees (as ``storage.variables.stored_dtype``)."""
    return keras.backend.standardize_dtype(getattr(variable, "_dtype", None) or variable.dtype)


def state_mib(model: keras.Model, optimizer) -> dict[str, float]:
    """MiB of ``model``'s training state now, by what holds it: ``weights``
    (every variable of the model), ``gradients`` (one per trainable variable,
    in its stored dtype, as the tape makes them) and ``moments`` (the
    optimizer's per-variable slots; its scalars left out).

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(256)])
        >>> {k: round(v, 2) for k, v in state_mib(model, None).items()}
        {'weights': 1.0, 'gradients': 1.0, 'moments': 0.0}
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    slots = [v for v in (getattr(optimizer, "variables", None) or []) if len(v.shape)]
    return {"weights": _mib(model.weights), "gradients": _mib(model.trainable_variables),
            "moments": _mib(slots)}


def finish(model: keras.Model, step: int) -> None:
    """Notes the last step trained (the end of ``fit``)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"`step` must be an int >= 0, got {step!r}.")
    timeline = of(model)
    if timeline is not None:
        timeline.last_step = max(timeline.last_step, int(step))


def restore(model: keras.Model, config: dict[str, Any]) -> None:
    """Makes ``config`` (:meth:`Timeline.get_config`) the model's timeline."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    if not isinstance(config, dict) or not isinstance(config.get("entries"), list) \
            or isinstance(config.get("last_step"), bool) \
            or not isinstance(config.get("last_step"), int):
        raise ValueError(f"`config` must be a Timeline.get_config() dict, got {config!r}.")
    setattr(_installed.installed(model), _ATTR,
            Timeline(copy.deepcopy(config["entries"]), config["last_step"]))
