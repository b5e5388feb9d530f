"""A copy of a functional model with swapped layers and the same weights.

:func:`keras_mp.fuse` (fused layers) and
:func:`keras_mp.deploy.export.serving_copy` (serving dtypes) both clone a
model with ``keras.models.clone_model(..., recursive=True)`` and then need
each copied variable to take the value of the one it copies. Pairing the two
models' ``weights`` lists (or their top-level ``layers``) by position is
wrong for a nested model: a KerasHub ``GPT2CausalLM`` holds its backbone
and the backbone's token embedding (shared: the output projection is its
transpose), and the clone lists them in another order; the backbone's
variables are named without the backbone's name (``token_embedding/...``).
Here every copied layer is paired with the layer it was cloned from (the
clone function sees both), and each variable of the copy takes the value of
the source layer's variable at the same path below the layer.

Example:
    >>> import keras, numpy as np
    >>> from keras_mp._cloning import clone_with_weights
    >>> inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> x = keras.Input((3,))
    >>> model = keras.Model(x, keras.layers.Dense(1)(inner(x)))
    >>> copy, pairs = clone_with_weights(
    ...     model, lambda layer: type(layer).from_config(layer.get_config()))
    >>> data = np.ones((2, 3), "float32")
    >>> bool(np.array_equal(model(data), copy(data))), len(pairs)
    (True, 2)
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np

__all__ = ["clone_with_weights"]


def _keys(layer: keras.layers.Layer) -> dict:
    """Each variable of ``layer`` under its path below the layer (a float8
    layer's extra scale variables, or a model loaded from a ``.keras`` file
    whose variables lack the model's prefix, still pair up); a variable
    outside the layer's path under its name and rank among same-named ones."""
    prefix = (layer.path or layer.name) + "/"
    out, seen = {}, {}
    for v in layer.weights:
        if v.path.startswith(prefix):
            out[v.path[len(prefix):]] = v
        else:
            rank = seen[v.name] = seen.get(v.name, -1) + 1
            out[(v.name, rank)] = v
    return out


def clone_with_weights(model: keras.Model,
                       clone_function: Callable[[keras.layers.Layer], keras.layers.Layer],
                       ) -> tuple[keras.Model, list[tuple[keras.layers.Layer,
                                                          keras.layers.Layer]]]:
    """Clones ``model`` (recursively: nested functional and Sequential
    models are rebuilt too) with ``clone_function`` and copies its weights.

    Args:
        model: a functional or Sequential Keras model.
        clone_function: ``layer -> new layer`` (the new layer must create
            variables of the same names and shapes as ``layer``).

    Returns:
        ``(copy, pairs)``: the copy, and ``(source layer, copied layer)``
        for every layer ``clone_function`` copied.

    Raises:
        ValueError: ``model`` is not a functional or Sequential model
            (Keras's ``clone_model`` refuses a clone function then).
        RuntimeError: a variable of the copy has no source variable of the
            same name and shape.
    """
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []

    def tracked(layer):
        new = clone_function(layer)
        if isinstance(layer, keras.layers.Layer):   # not an op such as GetItem
            pairs.append((layer, new))
        return new

    copy = keras.models.clone_model(model, clone_function=tracked, recursive=True)
    done: set[int] = set()
    missing = []
    for source, new in pairs:
        values = _keys(source)
        for key, w in _keys(new).items():
            value = values.get(key)
            if value is None or tuple(value.shape) != tuple(w.shape):
                missing.append(w.path)
                continue
            w.assign(value if value.dtype == w.dtype
                     else np.asarray(value).astype(w.dtype))
            done.add(id(w))
        for layer in new._flatten_layers():
            # What a layer computed from its variables when it was built
            # (Normalization's mean and variance) is computed again from the
            # copied values, as Keras does when it loads variables.
            finalize = getattr(layer, "finalize_state", None)
            if layer.built and callable(finalize):
                finalize()
    missing += [w.path for w in copy.weights if id(w) not in done and w.path not in missing]
    if missing:
        raise RuntimeError(f"the copy's variables {', '.join(missing[:5])} have no variable "
                           "of the same name and shape in the model; please report this model.")
    return copy, pairs
