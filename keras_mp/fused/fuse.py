"""``fuse(model)``: a Keras model with its layers swapped for fused ones, as a
copy (functional and Sequential models) or in place (any model, subclassed
ones and KerasHub's included, down to the layers inside other layers).

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
from keras_mp.fused.layers import FUSED_LAYERS, MultiHeadAttention, float32_alone, fused_class

__all__ = ["FUSED_CLASSES", "fuse", "swap_in_place"]

#: The fused classes themselves.
FUSED_CLASSES = frozenset(FUSED_LAYERS.values())


def _swap(layer: keras.layers.Layer) -> keras.layers.Layer:
    fused_cls = fused_class(type(layer))
    config = layer.get_config()
    # Every other layer is cloned as clone_model would, so the copy shares
    # no state with the original.
    return (fused_cls or layer.__class__).from_config(config)


def fuse(model: keras.Model, *, inplace: bool = False) -> keras.Model:
    """Returns ``model`` with the supported layers fused: a copy, or the model
    itself with ``inplace=True``.

    ``keras.layers.Dense``, ``LayerNormalization``, ``BatchNormalization``, ``RMSNormalization``,
    ``Softmax``, ``MultiHeadAttention`` and ``ReversibleEmbedding`` (exactly
    these classes, or KerasHub's re-export of one, as its
    ``ReversibleEmbedding``: :func:`keras_mp.fused.layers.fused_class`)
    become their :mod:`keras_mp.fused.layers` counterparts, with the same config, so the same dtype policy, and the
    same weights; layers inside other layers (a KerasHub
    ``TransformerDecoder``'s ``Dense``, ``LayerNormalization`` and its
    attention's ``Softmax``) and nested models are fused too. In place, a
    layer whose fused class would run Keras's code anyway (a Dense whose
    activation has no fused kernel, normalization over another axis, a
    policy of float32 alone: :func:`~keras_mp.fused.layers.float32_alone`) keeps its Keras
    class; the copy swaps every layer of a supported class, as before.

    Args:
        model: a built Keras model.
        inplace: False: a new, uncompiled model (functional and ``Sequential``
            models only), the original left untouched. True: the layers of
            ``model`` itself change class (nothing else about them changes:
            weights, names, config), which works for any model, subclassed
            ones included; its train, test and predict functions are reset
            (compile again only if you had not compiled it yet).

    Returns:
        The fused model, whose outputs equal the original's within the
        rounding of its compute dtype. A ``.keras`` file of it names the fused
        classes: load it with ``keras_mp`` imported.

    Raises:
        TypeError: ``model`` is not a Keras model, or (``inplace=False``)
            not a functional or Sequential model (a subclassed model's
            ``call`` cannot be rewired from outside: use ``inplace=True``).
        ValueError: ``model`` is not built yet.

    Example:
        >>> import keras
        >>> class Net(keras.Model):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.norm = keras.layers.LayerNormalization()
        ...     def call(self, x):
        ...         return self.norm(x)
        >>> net = Net(); _ = net(keras.ops.ones((2, 4)))
        >>> type(fuse(net, inplace=True).norm).__module__
        'keras_mp.fused.layers'
    """
    if not isinstance(inplace, bool):
        raise TypeError(f"`inplace` must be a bool, got {inplace!r}.")
    if not isinstance(model, keras.Model) or (not inplace and not _is_graph_model(model)):
        raise TypeError(
            "`model` must be a Keras functional or Sequential model, got "
            f"{type(model).__name__}; for a subclassed model (KerasHub's included), "
            "call fuse(model, inplace=True).")
    if not model.built:
        raise ValueError(
            "`model` must be built (call it once, or give it an Input) so its "
            "weights can be carried over.")
    if inplace:
        _swap_in_place(model)
        model.train_function = model.test_function = model.predict_function = None
        return model
    try:
        fused, pairs = clone_with_weights(model, _swap)
    except RuntimeError as e:
        raise RuntimeError(f"fuse(): {e}") from e
    matched = [(model, fused)] + [
        (a, b) for source, copy in pairs
        for a, b in zip(source._flatten_layers(), copy._flatten_layers())]
    _share_policies(matched)
    for source, copy in matched:
        # A layer made inside keras.RematScope stays rematerialized (a config
        # does not hold the scope's mode).
        copy._remat_mode = getattr(source, "_remat_mode", None)
    _swap_in_place(fused)  # layers inside layers, which cloning rebuilt from their config
    return fused


def _swap_in_place(model: keras.Model) -> None:
    """Gives every layer of an exact supported class, at any depth, its fused
    class where the fused kernel would run (:func:`swap_in_place`)."""
    for layer in model._flatten_layers(include_self=False, recursive=True):
        swap_in_place(layer)


def swap_in_place(layer: keras.layers.Layer) -> bool:
    """Gives ``layer`` its fused class where it has one and the fused kernel
    would run (the fused classes add no state, only :meth:`call` differs);
    a layer that would run Keras's code anyway (an activation without a
    kernel, another axis, float32 alone) keeps its Keras class, so a saved
    model needs keras_mp only where it uses a fused layer. Returns whether
    the layer is fused now.

    Example:
        >>> import keras
        >>> layer = keras.layers.Dense(2, activation="gelu", dtype="mixed_bfloat16")
        >>> swap_in_place(layer), type(layer).__module__
        (True, 'keras_mp.fused.layers')
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {type(layer).__name__}.")
    if type(layer) in FUSED_CLASSES:
        return True
    fused_cls = fused_class(type(layer))
    if fused_cls is None:
        return False
    if fused_cls is MultiHeadAttention and float32_alone(layer):
        return False  # Keras's code where float32 is the only candidate (keras_mp.fused.layers)
    original = type(layer)
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    shape = next(iter(shapes.values()), None)
    layer.__class__ = fused_cls
    if hasattr(fused_cls, "_input_rank") and shape is not None:
        layer._input_rank = len(shape)
    if not getattr(layer, "fused", True):
        layer.__class__ = original
        return False
    return True


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
        if type(a._dtype_policy) is not type(b._dtype_policy) or \
                a._dtype_policy.name != b._dtype_policy.name:
            # A container built under another global policy than its layers
            # (the copy's functional model under float32, Keras's mixed_float16
            # policy object shared by every layer of the original).
            continue
        policy = shared.setdefault(id(a._dtype_policy), b._dtype_policy)
        if b._dtype_policy is not policy:
            # Not the `dtype_policy` setter: it would insert into a policy map.
            b._dtype_policy = policy
