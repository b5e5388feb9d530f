"""The global-policy functions, which accept the adaptive policies
(:class:`keras_mp.AdaptivePolicy`, defined in :mod:`keras_mp.adaptive_policy`
and re-exported here), and the layers a model's adaptive policy controls.

Example:
    >>> import keras, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> policy = keras_mp.policies.policy_of(model)
    >>> [layer.name for layer in keras_mp.policies.adaptive_layers(model, policy)]
    ['dense']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
from keras.dtype_policies import DTypePolicy

from keras_mp.adaptive_policy import AdaptivePolicy  # noqa: F401 - re-exported

__all__ = ["ADAPTIVE_NAMES", "set_global_policy", "global_policy", "policy_scope", "get",
           "policy_of", "adaptive_layers"]

#: Adaptive policy names and their candidates (None: the device's fast set).
ADAPTIVE_NAMES: dict[str, tuple[str, ...] | None] = {
    "adaptive": None,
    "adaptive_bfloat16": ("bfloat16", "float32"),
    "adaptive_float16": ("float16", "float32"),
    "adaptive_float8": ("float8", "bfloat16", "float32"),
}
def get(policy: Any) -> DTypePolicy:
    """Turns a name, config or policy into a policy object.

    Args:
        policy: an :class:`AdaptivePolicy` or other ``DTypePolicy``, one of
            :data:`ADAPTIVE_NAMES`, or any name Keras accepts (``"float32"``,
            ``"mixed_bfloat16"``, ``"mixed_float16"``, ...).

    Example:
        >>> get("adaptive_float16").candidates
        ('float16', 'float32')
        >>> get("mixed_bfloat16").name
        'mixed_bfloat16'
    """
    if isinstance(policy, DTypePolicy):
        return policy
    if isinstance(policy, str) and policy in ADAPTIVE_NAMES:
        return AdaptivePolicy(ADAPTIVE_NAMES[policy], name=policy)
    try:
        return keras.dtype_policies.get(policy)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"`policy` must be one of {sorted(ADAPTIVE_NAMES)}, a Keras dtype policy name "
            "(e.g. 'float32', 'mixed_bfloat16', 'mixed_float16') or a DTypePolicy, got "
            f"{policy!r}.") from e


def set_global_policy(policy: Any) -> None:
    """Sets the policy of layers built from now on (like Keras's
    ``keras.config.set_dtype_policy``, plus the adaptive names).

    Args:
        policy: as for :func:`get`.

    Example:
        >>> import keras_mp
        >>> keras_mp.set_global_policy("adaptive_float16")
        >>> keras_mp.global_policy().name
        'adaptive_float16'
        >>> keras_mp.set_global_policy("float32")
    """
    keras.config.set_dtype_policy(get(policy))


def global_policy() -> DTypePolicy:
    """The current global policy (an :class:`AdaptivePolicy` when one is set)."""
    return keras.config.dtype_policy()


@contextlib.contextmanager
def policy_scope(policy: Any) -> Iterator[DTypePolicy]:
    """Sets the global policy inside a ``with`` block, restoring it after.

    Example:
        >>> import keras, keras_mp
        >>> with keras_mp.policy_scope("adaptive_float16") as p:
        ...     layer = keras.layers.Dense(2)
        >>> layer.compute_dtype, keras_mp.global_policy().name
        ('float16', 'float32')
    """
    previous = global_policy()
    policy = get(policy)
    keras.config.set_dtype_policy(policy)
    try:
        yield policy
    finally:
        keras.config.set_dtype_policy(previous)


def _name_paths(container: keras.layers.Layer) -> None:
    """Gives a path to every layer below ``container`` that has none.

    Keras sets a layer's ``path`` when it builds it, and never for a layer
    without weights (no ``build``): such a layer (``ReLU``, ``Softmax``,
    ``MultiHeadAttention``'s softmax) looks itself up in a policy map by a path
    of None and always gets the default. Its path here is its siblings'
    prefix (or its container's path) and its name, as Keras would have made it.
    """
    children = list(container._flatten_layers(include_self=False, recursive=False))
    prefix = next((child.path[:-len(child.name)] for child in children
                   if child.path and child.path.endswith(child.name)), None)
    if prefix is None:
        prefix = container.path + "/" if container.path else ""
    for child in children:
        if child.path is None:
            # Not Keras's __setattr__: a path is not state to track.
            object.__setattr__(child, "_path", prefix + child.name)
        _name_paths(child)


def policy_of(model: keras.Model) -> AdaptivePolicy | None:
    """The :class:`AdaptivePolicy` that ``model``'s layers use, or None.

    A model loaded from a ``.keras`` file gives each layer its own copy of
    the policy (Keras deserializes each layer's ``dtype`` separately); this
    makes them share one, so that a change reaches every layer.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    found: list[keras.layers.Layer] = [
        layer for layer in model._flatten_layers(include_self=True)
        if isinstance(getattr(layer, "_dtype_policy", None), AdaptivePolicy)]
    if not found:
        return None
    _name_paths(model)
    current = global_policy()
    policies = [layer._dtype_policy for layer in found]
    chosen = current if any(p is current for p in policies) else policies[0]
    for layer in found:
        if layer._dtype_policy is not chosen:
            # Not the `dtype_policy` setter: it would insert into the map.
            layer._dtype_policy = chosen
    return chosen


def adaptive_layers(model: keras.Model, policy: AdaptivePolicy) -> list[keras.layers.Layer]:
    """The layers whose precision ``policy`` controls, in ``model``'s layer order.

    Every layer that holds ``policy`` and computes, with or without weights
    (a layer's compute dtype decides where Keras casts its inputs, so a
    weightless ``Rescaling`` or ``Softmax`` can be where the range is lost),
    including the sublayers of nested, subclassed and composite layers (such
    as ``MultiHeadAttention``'s projections and softmax). Left out: models
    (containers whose layers are listed instead), ``InputLayer`` and quantized
    layers (their dtype belongs to the quantization), except the
    float8-capable layers the policy switches (:mod:`keras_mp.float8`).

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
    _name_paths(model)
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
        out.append(layer)
    return out
