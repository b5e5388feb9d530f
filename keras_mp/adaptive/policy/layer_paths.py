"""How an :class:`~keras_mp.AdaptivePolicy` names its layers: by path, with
or without the model's name, and which paths can name no layer at all.

A layer's ``path`` includes its model's name when it was built inside the
model (``"sequential/dense"``) but not when Keras rebuilt it from a config
(``"dense"``), so a path matches the other form too (:func:`same_layer`).
Keras sets a path when it builds a layer, and never for a layer without
weights: :func:`name_paths` names those the way Keras would have.

:func:`check_path` refuses a path that cannot name a layer: an empty part,
or a path inside a model (or layer) the policy knows whole, among whose
layers it is not. Paths elsewhere are accepted: a layer may be given its
dtype before it is built, or belong to a model the policy has not met.

Example:
    >>> import keras
    >>> from keras_mp.adaptive.policy import layer_paths
    >>> layer_paths.same_layer("sequential/dense", "dense")
    True
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)], name="m")
    >>> layer_paths.check_path("m/dense_9", [model])
    Traceback (most recent call last):
    ...
    ValueError: `path` 'm/dense_9' names no layer of 'm', whose layers are known (m/input_layer, m/dense); a layer's path is `layer.path`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras

__all__ = ["same_layer", "name_paths", "check_path"]


def _strip_root(path: str) -> str:
    return path.split("/", 1)[1] if "/" in path else path


def same_layer(path: str, key: str) -> bool:
    """Whether ``path`` and ``key`` name the same layer (one of them may
    lack the model's name)."""
    return key == path or _strip_root(key) == path or _strip_root(path) == key


def name_paths(container: keras.layers.Layer) -> None:
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
        name_paths(child)


def check_path(path: Any, models: Iterable[keras.layers.Layer]) -> None:
    """Raises ``ValueError`` naming ``path`` if it cannot name a layer: it is
    not a non-empty string of non-empty parts, or it lies inside one of
    ``models`` (or inside one of their layers), whose layers are all known,
    and names none of them."""
    if not isinstance(path, str) or not path or "" in path.split("/"):
        raise ValueError(f"`path` must be a layer path such as 'model/dense' (no empty part), "
                         f"got {path!r}.")
    known = []
    for model in models:
        name_paths(model)
        known += [layer.path for layer in model._flatten_layers(include_self=True) if layer.path]
    if any(same_layer(path, p) for p in known):
        return
    inside = {p.rsplit("/", k)[0] for p in known for k in range(p.count("/") + 1)}
    parts = path.split("/")
    owner = next((prefix for prefix in ("/".join(parts[:i]) for i in range(1, len(parts)))
                  if prefix in inside), None)
    if owner is not None:
        shown = ", ".join(p for p in known if p.startswith(owner + "/"))[:200]
        raise ValueError(f"`path` {path!r} names no layer of {owner!r}, whose layers are "
                         f"known ({shown}); a layer's path is `layer.path`.")
