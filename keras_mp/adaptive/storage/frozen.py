"""Frozen variables stored in their layer's compute dtype.

A variable that does not train (its layer frozen with ``trainable=False``, a
LoRA base kernel, a frozen backbone) is only ever read, and under an
adaptive policy a layer computing in bfloat16 or float16 reads every
autocast variable in that dtype: a float32 copy holds 2 bytes per parameter
that no computation sees. So :func:`apply` stores such a variable in the
compute dtype. On the 99.5M-parameter Llama of ``benchmarks/llm_memory.py``
with ``enable_lora(8)`` (99% of the parameters frozen), that is 190 of its
380 MiB of weights.

When: at the start of every ``fit`` of a model under an adaptive policy
(:mod:`keras_mp.adaptive.fit.autofit`, and ``AdaptivePrecision.set_model``
once it has put the layers in their dtypes), when trainability is known, and
never inside a fit. A variable that trains again (``layer.trainable = True``
and a new ``fit``) is stored in float32 again before anything of that fit
(the optimizer's build included) sees it, its value kept: the 16-bit value
it had, exactly (the float32 digits below it were dropped when it was
stored in 16 bits: those are the digits the layer's 16-bit reads never
saw). A model loaded from a file starts with float32 variables and is
stored compactly again at its first ``fit``; its values are the file's.

The rule, per variable, in this order (:func:`decide`):

1. it trains: float32 (``trains``), unless trained weights may be compact
   (:mod:`~keras_mp.adaptive.storage.trained`, off by default) and its layer
   computes in bfloat16: then the rules below decide it, from 3 on, and it
   is bfloat16 with reason ``trains_compact``;
2. storage is switched off (:func:`set_enabled`, documented as
   :func:`keras_mp.config.set_compact_storage`): float32 (``switched_off``);
3. a per-variable override (:func:`set_override`): float32 (``override``);
4. its layer computes in float32 (``compute_float32``), or reads it in
   float32 (``read_in_float32``: Keras's normalization layers read gamma and
   beta so, and ``ReversibleEmbedding`` its logits' kernel;
   :func:`read_in_compute_dtype`); a weight that trains compactly and is
   read in float32 only through an explicit cast of its value (a
   ``ReversibleEmbedding``'s logits kernel, :func:`read_by_cast`) is the
   exception: its float32 reads then see its bfloat16 value, the logits still
   computed and accumulated in float32 (the Llama of
   ``benchmarks/llm_memory.py``: 24.6M of its 99.5M parameters, the last
   float32 weight there); variables that are not weights (float8
   scales, BatchNormalization's moving statistics, anything created
   non-trainable) are never stored compactly;
5. the cast loses more than a rounding: the relative error of the cast,
   ``||w - cast(w)|| / ||w||``, beyond the dtype's unit roundoff (2**-8 for
   bfloat16, 2**-11 for float16: what rounding to nearest costs in the
   normal range), or a value overflows (float16 past 65504): float32
   (``not_representable``). Values in float16's subnormal range are what
   fails here: a promotion of the layer to float32 would then read them
   flushed;
6. otherwise the compute dtype (``frozen``).

Each decision goes to the layer's record in the policy (``"storage"``:
variable name -> ``dtype``, ``reason``, ``error``), which ``.keras`` files
carry and :func:`keras_mp.precision_report` shows.

Example:
    >>> import keras, numpy as np, keras_mp
    >>> from keras_mp.adaptive.storage import frozen
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(1)])
    >>> model.layers[0].trainable = False
    >>> model.compile(optimizer="adam", loss="mse")
    >>> made = frozen.apply(model)     # what fit does at its start
    >>> [(m["variable"], m["dtype"]) for m in made]
    [('sequential/dense/kernel', 'bfloat16'), ('sequential/dense/bias', 'bfloat16')]
    >>> model.layers[1].kernel.dtype   # trains: float32
    'float32'
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _checks as checks
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.storage import trained
from keras_mp.adaptive.storage import variables as storage_vars
from keras_mp.device import memory

__all__ = ["REASONS", "UNIT_ROUNDOFF", "apply", "cast_error", "decide", "enabled",
           "frozen_variables", "read_by_cast", "read_in_compute_dtype", "set_enabled",
           "set_override"]

#: The reasons of :func:`decide`, and what each means.
REASONS: dict[str, str] = {
    "frozen": "does not train: stored in its layer's compute dtype",
    "trains": "trains: float32",
    "trains_compact": "trains, stored in bfloat16: updated in float32 and rounded "
                      "stochastically (keras_mp.config.set_compact_weights)",
    "switched_off": "compact storage is off (keras_mp.config.set_compact_storage)",
    "override": "kept in float32 by keras_mp.config.set_storage",
    "compute_float32": "its layer computes in float32",
    "read_in_float32": "read without autocast, or not a weight: float32",
    "not_representable": "the cast would lose more than a rounding (overflow or subnormals)",
    "strategy": "its distribution strategy cannot make a variable of that dtype "
                "(storage.variables.uncreatable)",
}
#: The relative error of rounding to nearest in the normal range, per dtype.
UNIT_ROUNDOFF: dict[str, float] = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
_RECORD = "storage"
_OVERRIDE = "storage_override"
_state = {"enabled": True}


def enabled() -> bool:
    """Whether frozen variables are stored in the compute dtype (on by default)."""
    return _state["enabled"]


def set_enabled(enabled: bool) -> None:
    """Turns compact storage of frozen variables on or off (documented as
    :func:`keras_mp.config.set_compact_storage`); off, the next ``fit``
    stores every variable in float32 again.

    Args:
        enabled: True or False.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be True or False, got {enabled!r}.")
    _state["enabled"] = enabled


def _model_policy(model: Any) -> AdaptivePolicy:
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    policy = policy_of(model)
    if policy is None:
        raise ValueError("`model` does not use a keras_mp.AdaptivePolicy: only adaptive "
                         "models store variables compactly (build it under "
                         "keras_mp.set_global_policy('adaptive')).")
    return policy


def _owner(model: keras.Model, variable: Any):
    """(layer, variable name) of the controlled layer that made ``variable``."""
    for layer in adaptive_layers(model, _model_policy(model)):
        for v in layer._trainable_variables + layer._non_trainable_variables:
            if v is variable:
                return layer, v.name
    return None, None


def set_override(model: Any, variable: Any, dtype: str | None) -> None:
    """Keeps ``variable`` of ``model`` in float32 whatever the rule says
    (``"float32"``), or lets the rule decide again (None). Saved with the
    model (the layer's record in its policy); applied at the next ``fit``
    (documented as :func:`keras_mp.config.set_storage`).

    Args:
        model: a Keras model under an adaptive policy.
        variable: one of its layers' variables (``keras.Variable``).
        dtype: ``"float32"`` or None.

    Raises:
        TypeError: ``model`` is not a Keras model or ``variable`` is not a
            ``keras.Variable``.
        ValueError: ``dtype`` is neither; the model is not adaptive; the
            variable is not one of its controlled layers'.
    """
    if dtype not in ("float32", None):
        raise ValueError(f"`dtype` must be 'float32' (keep it in float32) or None (the rule "
                         f"decides), got {dtype!r}.")
    if not isinstance(variable, keras.Variable):
        raise TypeError(f"`variable` must be a keras.Variable of the model, got {variable!r}.")
    policy = _model_policy(model)
    layer, name = _owner(model, variable)
    if layer is None:
        raise ValueError(f"`variable` {variable.path!r} belongs to no layer of `model` under "
                         "its adaptive policy.")
    overrides = policy.record(layer.path).setdefault(_OVERRIDE, {})
    if dtype is None:
        overrides.pop(name, None)
    else:
        overrides[name] = dtype


def cast_error(value: Any, dtype: str, chunk: int = 2**20) -> float:
    """``||w - cast(w)|| / ||w||`` for ``value`` cast to ``dtype``: inf where
    the cast overflows, 0 for an all-zero value. Computed ``chunk`` elements
    at a time, so that measuring a 25M-element embedding table holds a few
    MiB more, not copies of the table.

    Example:
        >>> import numpy as np
        >>> cast_error(np.array([1.0, 3.0]), "bfloat16")
        0.0
        >>> cast_error(np.array([1e5]), "float16")
        inf
        >>> cast_error(np.array([1e-7, 2e-7]), "float16") > UNIT_ROUNDOFF["float16"]
        True
    """
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"`dtype` must be one of {tuple(UNIT_ROUNDOFF)}, got {dtype!r}.")
    flat = tf.reshape(tf.cast(tf.convert_to_tensor(value), tf.float32), [-1])
    total = error = 0.0
    for start in range(0, int(flat.shape[0]), chunk):
        w = flat[start:start + chunk]
        back = tf.cast(tf.cast(w, dtype), tf.float32)
        finite = tf.math.is_finite(w)
        if not bool(tf.reduce_all(tf.math.is_finite(back) | ~finite)):
            return float("inf")
        w, back = (tf.cast(tf.where(finite, t, 0.0), tf.float64) for t in (w, back))
        total += float(tf.reduce_sum(tf.square(w)))
        error += float(tf.reduce_sum(tf.square(w - back)))
    return 0.0 if total == 0 else float(np.sqrt(error / total))


def decide(*, trains: bool, compute_dtype: str, read_in_compute: bool, overridden: bool,
           error: float | Callable[[], float] = 0.0,
           compact_training: bool = False, read_by_cast: bool = False) -> tuple[str, str]:
    """(stored dtype, reason) for one variable (the rule of the module's
    docstring). ``error``: :func:`cast_error` to ``compute_dtype``, or a
    function computing it, called only when the rule gets that far;
    ``compact_training``: whether a weight that trains may be stored in
    bfloat16 (:func:`keras_mp.adaptive.storage.trained.allowed`);
    ``read_by_cast``: whether its reads outside the compute dtype all cast
    its value (:func:`read_by_cast`), which lets a weight that trains
    compactly be bfloat16 though not ``read_in_compute``.

    Example:
        >>> decide(trains=False, compute_dtype="bfloat16", read_in_compute=True,
        ...        overridden=False, error=0.002)
        ('bfloat16', 'frozen')
        >>> decide(trains=False, compute_dtype="float16", read_in_compute=True,
        ...        overridden=False, error=float("inf"))
        ('float32', 'not_representable')
        >>> decide(trains=True, compute_dtype="bfloat16", read_in_compute=True,
        ...        overridden=False)
        ('float32', 'trains')
        >>> decide(trains=True, compute_dtype="bfloat16", read_in_compute=True,
        ...        overridden=False, error=0.002, compact_training=True)
        ('bfloat16', 'trains_compact')
        >>> decide(trains=True, compute_dtype="bfloat16", read_in_compute=False,
        ...        overridden=False, error=0.002, compact_training=True, read_by_cast=True)
        ('bfloat16', 'trains_compact')
        >>> decide(trains=False, compute_dtype="bfloat16", read_in_compute=False,
        ...        overridden=False, error=0.002, read_by_cast=True)
        ('float32', 'read_in_float32')
    """
    if not (callable(error) or checks.is_number(error)):
        raise TypeError(f"`error` must be a number or a function returning one, got {error!r}.")
    if not isinstance(read_by_cast, bool):
        raise TypeError(f"`read_by_cast` must be True or False, got {read_by_cast!r}.")
    if trains and not (compact_training and compute_dtype == "bfloat16"):
        return "float32", "trains"
    if not trains and not _state["enabled"]:
        return "float32", "switched_off"
    if overridden:
        return "float32", "override"
    if compute_dtype not in UNIT_ROUNDOFF:
        return "float32", "compute_float32"
    if not (read_in_compute or (trains and read_by_cast)):
        return "float32", "read_in_float32"
    if not (error() if callable(error) else error) <= UNIT_ROUNDOFF[compute_dtype]:
        return "float32", "not_representable"
    return compute_dtype, "trains_compact" if trains else "frozen"


def read_in_compute_dtype(layer: keras.layers.Layer, variable: Any) -> bool:
    """Whether every read of ``variable`` in ``layer``'s call sees it in the
    layer's compute dtype, so that storing it there changes no computation:
    an autocast variable of an autocast layer; an ``Embedding``'s table
    (its gathered rows are cast to the compute dtype, and a cast commutes
    with a gather) unless LoRA adds to it in float32 first or, tied, it is
    also the float32 kernel of a ``ReversibleEmbedding``'s logits; a
    ``ReversibleEmbedding``'s reverse kernel where ``reverse_dtype`` is the
    compute dtype (by default Keras computes those logits in float32).

    Example:
        >>> import keras
        >>> layer = keras.layers.Embedding(10, 4)
        >>> layer.build(None)
        >>> read_in_compute_dtype(layer, layer.embeddings)
        True
        >>> norm = keras.layers.LayerNormalization()
        >>> norm.build((None, 4))
        >>> read_in_compute_dtype(norm, norm.gamma)   # read in float32
        False
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {layer!r}.")
    if not isinstance(variable, keras.Variable):
        raise TypeError(f"`variable` must be a keras.Variable, got {variable!r}.")
    if layer.autocast and variable._autocast:
        return True
    reverse = isinstance(layer, keras.layers.ReversibleEmbedding)
    in_float32 = reverse and layer.reverse_dtype != layer.compute_dtype
    if isinstance(layer, keras.layers.Embedding) and variable is layer._embeddings:
        return not getattr(layer, "lora_enabled", False) and not (
            in_float32 and layer.tie_weights)
    return reverse and variable is getattr(layer, "reverse_embeddings", None) \
        and not in_float32


def read_by_cast(layer: keras.layers.Layer, variable: Any) -> bool:
    """Whether ``variable`` is the kernel of a ``ReversibleEmbedding``'s
    logits read as a float32 value: its ``reverse_embeddings`` (Keras's
    ``matmul`` reads the variable itself in its float32 dtype, or casts it to
    ``reverse_dtype``), or its table where tied and ``reverse_dtype`` casts
    the transposed table (with ``reverse_dtype=None`` the transpose would
    carry a bfloat16 table's dtype into the logits). Stored in bfloat16, those
    float32 logits are computed from its bfloat16 value.

    Example:
        >>> import keras
        >>> layer = keras.layers.ReversibleEmbedding(10, 4, tie_weights=False)
        >>> layer.build(None)
        >>> read_by_cast(layer, layer.reverse_embeddings)
        True
        >>> read_by_cast(keras.layers.Embedding(10, 4), layer.reverse_embeddings)
        False
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {layer!r}.")
    if not isinstance(variable, keras.Variable):
        raise TypeError(f"`variable` must be a keras.Variable, got {variable!r}.")
    if not isinstance(layer, keras.layers.ReversibleEmbedding) \
            or getattr(layer, "lora_enabled", False):
        return False
    if layer.tie_weights:
        return variable is layer._embeddings and layer.reverse_dtype is not None
    return variable is getattr(layer, "reverse_embeddings", None)


def frozen_variables(model: keras.Model, layers=None) -> list[tuple[Any, Any, bool]]:
    """``(layer, variable, trains)`` for every float weight of ``model``'s
    controlled layers: the variables each layer made as trainable (its own
    ``_trainable_variables``), whether they train now or not. Variables made
    non-trainable (moving statistics, float8 scales) are not weights and
    never stored compactly."""
    policy = _model_policy(model)
    layers = adaptive_layers(model, policy) if layers is None else layers
    training = {id(v) for v in model.trainable_variables}
    out = []
    for layer in layers:
        for v in layer._trainable_variables:
            if storage_vars.stored_dtype(v) in storage_vars.FLOAT_DTYPES \
                    and not v.overwrite_with_gradient:
                out.append((layer, v, id(v) in training))
    return out


def apply(model: Any, layers=None, *, restore_only: bool = False) -> list[dict[str, Any]]:
    """Stores each weight of ``model`` as the rule decides (see the module's
    docstring), records every decision in its layer's record, and returns
    the changes made (``variable`` path, ``old``, ``dtype``, ``reason``,
    ``error``). ``restore_only``: only put variables that train back in
    float32 (before anything of a fit reads them; the rest waits for the
    layers' dtypes). Functions traced before a change are the caller's to
    reset (``model.train_function = None`` ...).

    Args:
        model: a Keras model under an adaptive policy.
        layers: its controlled layers, if known.
        restore_only: True or False.
    """
    policy = _model_policy(model)
    made, compact, restored = [], [], False
    compact_training = trained.allowed(model)
    for layer, v, trains in frozen_variables(model, layers):
        old = storage_vars.stored_dtype(v)
        if restore_only and not (trains and old != "float32" and not compact_training):
            continue
        record = policy.record(layer.path)
        compute = layer.compute_dtype
        measured: list[float] = []

        prior = record.get(_RECORD, {}).get(v.name, {}).get("error")

        def error(v=v, old=old, compute=compute, measured=measured, prior=prior) -> float:
            # Stored in the compute dtype already: the error of its first cast.
            measured.append((prior or 0.0) if old == compute else cast_error(v.value, compute))
            return measured[-1]

        dtype, reason = decide(
            trains=trains, compute_dtype=compute,
            read_in_compute=read_in_compute_dtype(layer, v),
            overridden=record.get(_OVERRIDE, {}).get(v.name) == "float32", error=error,
            compact_training=compact_training, read_by_cast=read_by_cast(layer, v))
        if dtype != old and storage_vars.uncreatable(v, dtype) is not None:
            dtype, reason = "float32", "strategy"
        found = dict(dtype=dtype, reason=reason, error=measured[0] if measured else None)
        if storage_vars.store_as(v, dtype):
            made.append(dict(variable=v.path, old=old, **found))
            restored |= trains   # a variable the optimizer may index
        compact += [v] if reason == "trains_compact" else []
        record.setdefault(_RECORD, {}).setdefault(v.name, {}).update(found)
    if made:
        memory.release_free_heap()   # the float32 values' pages, back to the system
    trained.mark(getattr(model, "optimizer", None), None if restore_only else compact,
                 restored=restored)
    return made
