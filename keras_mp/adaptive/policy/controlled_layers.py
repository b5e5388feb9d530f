"""The layers a model's adaptive policy controls, and the policy itself.

Keras gives weightless layers no ``path`` (they are never built), so a
``DTypePolicyMap`` could never reach them: :func:`adaptive_layers` names them
first, the way Keras would have (:mod:`keras_mp.adaptive.policy.layer_paths`).
:func:`policy_of` makes every layer of a model share one
:class:`~keras_mp.AdaptivePolicy` (the model's own, never the global policy of
the moment instead), which from then on knows that model's layers. Both
:mod:`keras_mp.adaptive.evidence.float8` and the callback walk models through here;
:mod:`keras_mp.policies` re-exports both functions.

Example:
    >>> import keras, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> policy = policy_of(model)
    >>> [layer.name for layer in adaptive_layers(model, policy)]
    ['dense']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import keras

from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
from keras_mp.adaptive.policy.layer_paths import name_paths

__all__ = ["policy_of", "adaptive_layers"]


def policy_of(model: keras.Model) -> AdaptivePolicy | None:
    """The :class:`AdaptivePolicy` that ``model``'s layers use, or None.

    If its layers hold several (a model rebuilt from a config outside
    ``load_model``, whose layers each got a copy, and whose sublayers made
    in a custom layer's ``__init__`` took the global policy), they all take
    the first one that is not the current global policy: the model's own,
    with its decisions. A fresh global policy (``set_global_policy`` before
    ``load_model``) never replaces it.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    found: list[keras.layers.Layer] = [
        layer for layer in model._flatten_layers(include_self=True)
        if isinstance(getattr(layer, "_dtype_policy", None), AdaptivePolicy)]
    if not found:
        return None
    name_paths(model)
    current = keras.config.dtype_policy()
    chosen = next((layer._dtype_policy for layer in found
                   if layer._dtype_policy is not current), found[0]._dtype_policy)
    for layer in found:
        if layer._dtype_policy is not chosen:
            # Not the `dtype_policy` setter: it would insert into the map.
            layer._dtype_policy = chosen
    chosen.knows(model)
    return chosen


def _floating(dtype) -> bool:
    try:
        return keras.backend.standardize_dtype(dtype) in ("float8_e4m3fn", "float8_e5m2",
                                                          "float16", "bfloat16", "float32",
                                                          "float64")
    except ValueError:
        return False


def adaptive_layers(model: keras.Model, policy: AdaptivePolicy) -> list[keras.layers.Layer]:
    """The layers whose precision ``policy`` controls, in ``model``'s layer order.

    Every layer that holds ``policy`` and computes, with or without weights
    (a layer's compute dtype decides where Keras casts its inputs, so a
    weightless ``Rescaling`` or ``Softmax`` can be where the range is lost),
    including the sublayers of nested, subclassed and composite layers (such
    as ``MultiHeadAttention``'s projections and softmax). Left out: models
    (containers whose layers are listed instead), ``InputLayer``, quantized
    layers (their dtype belongs to the quantization), except the
    float8-capable layers the policy switches (:mod:`keras_mp.adaptive.evidence.float8`),
    and layers that compute in no floating dtype whatever their policy says
    (Keras's ``IntegerLookup``, ``StringLookup``, ``Hashing`` in its integer
    mode and ``TextVectorization`` report ``int64`` or ``string``: keras.io's structured-data example crashed the
    statistics step on them).

    Example:
        >>> import keras, keras_mp
        >>> with keras_mp.policy_scope("adaptive_bfloat16") as p:
        ...     m = keras.Sequential([keras.Input((3,)), keras.layers.Rescaling(0.1),
        ...                           keras.layers.Dense(2), keras.layers.Softmax()])
        >>> [type(layer).__name__ for layer in adaptive_layers(m, p)]
        ['Rescaling', 'Dense', 'Softmax']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    if not isinstance(policy, AdaptivePolicy):
        raise TypeError(f"`policy` must be an AdaptivePolicy (see policy_of), got {policy!r} "
                        f"of type {type(policy).__name__}.")
    name_paths(model)
    seen: set[int] = set()
    out = []
    for layer in model._flatten_layers(include_self=False):
        if id(layer) in seen or layer._dtype_policy is not policy:
            continue
        seen.add(id(layer))
        if isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue
        if layer.quantization_mode is not None and not policy.is_float8(layer.path):
            continue
        if not _floating(layer.compute_dtype):
            continue
        out.append(layer)
    return out
