"""A copy of a functional model with swapped layers and the same weights.

:func:`keras_mp.fuse` (fused layers) and
:func:`keras_mp.deploy.export.serving_copy` (serving dtypes) both clone a
model with ``keras.models.clone_model(..., recursive=True)`` and then need
each copied variable to take the value of the one it copies. Pairing the two
models' ``weights`` lists (or their top-level ``layers``) by position is
wrong for a nested model: a KerasHub ``GPT2CausalLM`` holds its backbone
and the backbone's token embedding (shared: the output projection is its
transpose), and the clone lists them in another order; the backbone's
variables are named without the backbone's name (``token_embedding/...``);
a subclassed layer rebuilt from its config names its sublayers anew.
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

import contextlib
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


@contextlib.contextmanager
def _policy_of(layer):
    """``layer``'s dtype policy as the global one while it is cloned: the
    sublayers a subclassed layer creates in its ``__init__`` without a
    ``dtype`` take the global policy (keras.io's Transformer block: its
    float32 attention would meet its float16 inputs)."""
    policy = getattr(layer, "dtype_policy", None)
    if policy is None or getattr(policy, "quantization_mode", None):
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _paired(source: keras.layers.Layer, new: keras.layers.Layer) -> list:
    """``(variable of new, variable of source or None)``: by path below the
    layer; if that leaves any unpaired, by position, where both layers hold
    variables of the same shapes in the same order (a subclassed layer
    rebuilt from its config names the sublayers it creates anew:
    ``embedding_2`` for ``embedding``)."""
    values = _keys(source)
    keyed = [(w, values.get(key)) for key, w in _keys(new).items()]
    keyed = [(w, v if v is not None and tuple(v.shape) == tuple(w.shape) else None)
             for w, v in keyed]
    if all(v is not None for _, v in keyed) or len(source.weights) != len(new.weights) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(source.weights, new.weights)):
        return keyed
    return list(zip(new.weights, source.weights))


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
        with _policy_of(layer):
            new = clone_function(layer)
        if isinstance(layer, keras.layers.Layer):   # not an op such as GetItem
            pairs.append((layer, new))
        return new

    copy = keras.models.clone_model(model, clone_function=tracked, recursive=True)
    done: set[int] = set()
    missing = []
    for source, new in pairs:
        for w, value in _paired(source, new):
            if value is None:
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
