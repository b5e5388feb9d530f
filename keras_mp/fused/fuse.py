"""``fuse(model)``: a copy of a Keras model with its layers swapped for fused ones.

Example:
    >>> import keras, numpy as np
    >>> from keras_mp.fused.fuse import fuse
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="gelu"),
    ...                           keras.layers.LayerNormalization(), keras.layers.Dense(2)])
    >>> fused = fuse(model)
    >>> [type(l).__module__ for l in fused.layers]
    ['keras_mp.fused.layers', 'keras_mp.fused.layers', 'keras_mp.fused.layers']
    >>> x = np.ones((3, 4), "float32")
    >>> bool(np.allclose(model(x), fused(x), atol=1e-5))
    True
"""

from __future__ import annotations

import keras

from keras_mp._cloning import clone_with_weights
from keras_mp.fused.layers import FUSED_LAYERS

__all__ = ["fuse"]


def _swap(layer: keras.layers.Layer) -> keras.layers.Layer:
    fused_cls = FUSED_LAYERS.get(type(layer))
    config = layer.get_config()
    if fused_cls is not None:
        return fused_cls.from_config(config)
    # Every other layer is cloned as clone_model would, so the copy shares
    # no state with the original.
    return layer.__class__.from_config(config)


def fuse(model: keras.Model) -> keras.Model:
    """Returns a copy of ``model`` with the supported layers fused.

    ``keras.layers.Dense``, ``LayerNormalization``, ``RMSNormalization`` and
    ``Softmax`` (exactly these classes, not subclasses of them) become their
    :mod:`keras_mp.fused.layers` counterparts, with the same config, so the same
    dtype policy, and the same weights; nested functional and Sequential
    models are fused too. The original model is left untouched. The copy is
    not compiled: compile it as you would the original.

    Args:
        model: a built Keras functional or ``Sequential`` model.

    Returns:
        The fused copy, whose outputs equal the original's within the
        rounding of its compute dtype.

    Raises:
        TypeError: ``model`` is not a functional or Sequential model
            (a subclassed model's ``call`` cannot be rewired from outside).
        ValueError: ``model`` is not built yet.
    """
    if not isinstance(model, keras.Model) or not _is_graph_model(model):
        raise TypeError(
            "`model` must be a Keras functional or Sequential model, got "
            f"{type(model).__name__}; for a subclassed model, use the layers "
            "of keras_mp.fused.layers in its definition instead.")
    if not model.built:
        raise ValueError(
            "`model` must be built (call it once, or give it an Input) so its "
            "weights can be carried over.")
    try:
        fused, pairs = clone_with_weights(model, _swap)
    except RuntimeError as e:
        raise RuntimeError(f"fuse(): {e}") from e
    _share_policies([(model, fused)] + [
        (a, b) for source, copy in pairs
        for a, b in zip(source._flatten_layers(), copy._flatten_layers())])
    return fused


def _is_graph_model(model: keras.Model) -> bool:
    return isinstance(model, keras.Sequential) or type(model) is keras.Model or (
        hasattr(model, "_operations") and hasattr(model, "_nodes_by_depth"))


def _share_policies(pairs) -> None:
    """Cloned layers each deserialized their own copy of a dtype policy
    (one ``AdaptivePolicy`` shared by the original's layers becomes one per
    layer): the copy's layers share one policy object wherever the
    original's did, so that a change reaches every layer that had it.
    ``pairs``: (original layer, its copy), sublayers of a copied composite
    layer (a KerasHub ``TransformerDecoder``'s ``Dense`` layers) included."""
    shared: dict[int, object] = {}
    for a, b in pairs:
        if type(a._dtype_policy) is not type(b._dtype_policy):
            continue  # a container built under another global policy than its layers
        policy = shared.setdefault(id(a._dtype_policy), b._dtype_policy)
        if b._dtype_policy is not policy:
            # Not the `dtype_policy` setter: it would insert into a policy map.
            b._dtype_policy = policy
