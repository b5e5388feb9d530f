"""The global-policy functions, which accept the adaptive policies
(:class:`keras_mp.AdaptivePolicy`, defined in :mod:`keras_mp.adaptive.policy.adaptive_policy`),
and, re-exported from :mod:`keras_mp.adaptive.policy.controlled_layers`, the
policy of a model and the layers it controls.

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

from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy

__all__ = ["ADAPTIVE_NAMES", "AdaptivePolicy", "set_global_policy", "global_policy",
           "policy_scope", "get", "policy_of", "adaptive_layers"]

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
    if policy is None:
        # Keras's get(None) is its default float32 policy; setting None is
        # refused by Keras's own set_dtype_policy, and is here.
        raise ValueError(f"`policy` must be one of {sorted(ADAPTIVE_NAMES)}, a Keras dtype "
                         "policy name (e.g. 'float32', 'mixed_bfloat16') or a DTypePolicy, got "
                         "None; to go back to Keras's default, set 'float32'.")
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
