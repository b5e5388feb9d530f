"""Fused layers in a ``.keras`` file: a loaded model gets back every fused
layer the saved one had, the ones Keras rebuilds from a constructor included.

``fuse(model, inplace=True)`` swaps layers at any depth, and a file names a
fused class wherever a config holds the layer. A layer that another layer
makes in its ``__init__`` is not in any config, though: keras.io's
``TransformerBlock`` makes its ``MultiHeadAttention``, ``Dense`` and
``LayerNormalization`` layers there, and KerasHub rebuilds its blocks from
their constructor arguments. Loading makes such layers again as Keras's
classes, so the loaded model ran Keras's kernels where the trained one ran
the fused ones, and predicted other numbers (2-core Intel Xeon with
AMX-BF16, bfloat16): 0.0039 at most on keras.io's text classifier
(``Embedding(2000, 64)`` and ``TransformerBlock(64, 2, 64)``, fused in place,
3 epochs under ``"adaptive"``), 0.0156 on a 2-layer KerasHub BERT backbone
and 0.0312 on a ViT one from config (under ``mixed_bfloat16`` and
``"adaptive"`` alike); with the record below, 0.0 on all three and on a
Llama backbone.

So a save (:func:`install`, on import) writes :data:`KEY` into the file's
top-level config: each fused layer's place in ``model._flatten_layers()``
(the order in which Keras tracks layers and reads their weights back) and
its class's name; a load with keras_mp imported gives each of those layers
its fused class again (:func:`restore`), before any function is traced.
The loaded model then predicts what the saved one did, to the bit. Keras
alone ignores the entry and loads the model unfused, as before.

Example:
    >>> import os, tempfile, keras, numpy as np, keras_mp
    >>> class Block(keras.layers.Layer):
    ...     def __init__(self, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.norm = keras.layers.LayerNormalization()
    ...     def build(self, shape):
    ...         self.norm.build(shape)
    ...     def call(self, x):
    ...         return self.norm(x)
    >>> inputs = keras.Input((4,))
    >>> model = keras.Model(inputs, Block(dtype="mixed_bfloat16")(inputs))
    >>> _ = keras_mp.fuse(model, inplace=True)
    >>> record(model)
    [[2, 'LayerNormalization']]
    >>> path = os.path.join(tempfile.mkdtemp(), "m.keras")
    >>> model.save(path)
    >>> loaded = keras.saving.load_model(path, custom_objects={"Block": Block})
    >>> type(loaded.layers[1].norm).__module__
    'keras_mp.fused.layers'
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any

import keras
from keras.src.saving import saving_lib  # no public name

from keras_mp.fused.fuse import FUSED_CLASSES, swap_in_place
from keras_mp.fused.layers import fused_class

__all__ = ["KEY", "install", "record", "restore"]

#: The key of the fused layers in a ``.keras`` file's top-level config.
KEY = "keras_mp_fused"
_MARK = "_keras_mp_fused_layers"
_DAMAGED = ("The .keras file's '{key}' entry was edited or damaged ({why}): save the model "
            "again from where it trained.")


def _layers(model: keras.Model) -> list:
    return list(model._flatten_layers(include_self=False, recursive=True))


def record(model: keras.Model) -> list[list]:
    """``[index, class name]`` of each fused layer of ``model``, by its place
    in ``model._flatten_layers()``.

    Example:
        >>> import keras, keras_mp
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> record(model), record(keras_mp.fuse(model))
        ([], [[1, 'Dense']])
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    return [[i, type(layer).__name__] for i, layer in enumerate(_layers(model))
            if type(layer) in FUSED_CLASSES]


def _checked(entries: Any) -> list[tuple[int, str]]:
    if not isinstance(entries, list):
        raise ValueError(_DAMAGED.format(key=KEY, why=f"a list expected, got {entries!r}"))
    out = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and not isinstance(entry[0], bool) and entry[0] >= 0
                and isinstance(entry[1], str)):
            raise ValueError(_DAMAGED.format(
                key=KEY, why=f"[index, class name] expected, got {entry!r}"))
        out.append((entry[0], entry[1]))
    return out


def restore(model: keras.Model, entries: list) -> int:
    """Gives the layers :func:`record` listed for a saved model their fused
    class again in ``model`` (the same architecture, loaded); returns how
    many changed class. A listed place that holds another class (a file
    edited by hand, a custom layer whose code changed since the save) is
    left as loaded, with a warning.

    Raises:
        ValueError: ``entries`` is not a list of ``[index, class name]``.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> restore(model, [[1, "Dense"]]), type(model.layers[0]).__module__
        (1, 'keras_mp.fused.layers')
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    wanted = _checked(entries)
    layers = _layers(model)
    changed, misplaced = 0, []
    for index, name in wanted:
        layer = layers[index] if index < len(layers) else None
        if layer is not None and type(layer) in FUSED_CLASSES and type(layer).__name__ == name:
            continue  # its config named the fused class
        target = None if layer is None else fused_class(type(layer))
        if target is None or target.__name__ != name:
            misplaced.append(f"#{index} ({name}; loaded: "
                             f"{'none' if layer is None else type(layer).__name__})")
            continue
        changed += swap_in_place(layer)
    if misplaced:
        warnings.warn(
            "keras_mp: the saved model had fused layers where the loaded one has other "
            f"layers: {', '.join(misplaced)}. They run Keras's kernels, so predictions may "
            "differ from the saved model's by their rounding.", stacklevel=2)
    if changed:
        model.train_function = model.test_function = model.predict_function = None
    return changed


def _serialize(keras_serialize):
    @functools.wraps(keras_serialize)
    def serialize(model, *args, **kwargs):
        config_json, metadata_json = keras_serialize(model, *args, **kwargs)
        entries = record(model) if isinstance(model, keras.Model) else []
        if entries:
            config = json.loads(config_json)
            config[KEY] = entries
            config_json = json.dumps(config)
        return config_json, metadata_json
    return serialize


def _from_config(keras_from_config):
    @functools.wraps(keras_from_config)
    def from_config(config_json, *args, **kwargs):
        model = keras_from_config(config_json, *args, **kwargs)
        config = json.loads(config_json)  # str, or the bytes read from the zip
        if isinstance(model, keras.Model) and isinstance(config, dict) and KEY in config:
            restore(model, config[KEY])
        return model
    return from_config


def install() -> None:
    """Wraps Keras's ``saving_lib._serialize_model_as_json`` (the file's
    config, zipped or in a folder) and ``_model_from_config`` (its load);
    idempotent. Keras's functions stay reachable as ``__wrapped__``."""
    for name, make in (("_serialize_model_as_json", _serialize),
                       ("_model_from_config", _from_config)):
        current = getattr(saving_lib, name)
        if not getattr(current, _MARK, False):
            wrapped = make(current)
            setattr(wrapped, _MARK, True)
            setattr(saving_lib, name, wrapped)
