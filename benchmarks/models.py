"""The models ``keras-mp bench`` trains, and their synthetic data.

* ``mlp``: ReLU Dense layers; ``cnn``: 6 convolutions, 3 poolings;
  ``transformer``: post-norm blocks of 8-head attention and a GELU MLP (all
  three end in a 10-class head whose last activation is float32);
* ``gpt2``: KerasHub's ``GPT2CausalLM`` built from a config (GPT-2's own
  vocabulary of 50257 tokens, pre-norm decoder blocks with causal
  ``CachedMultiHeadAttention``, tanh-approximated GELU, logits through the
  ``ReversibleEmbedding``), random weights, next-token loss on random token ids;
* ``resnet``: ``keras.applications.ResNet50V2`` without its top, random
  weights, with the same 10-class head.

Nothing is downloaded. ``gpt2`` needs the ``keras-hub`` package
(``pip install "keras-mp[hub]"``); :func:`missing` says so where it is
absent.

Example:
    >>> from benchmarks import models
    >>> build, data = models.get("mlp", dict(batch=4, features=8, width=16, depth=2), steps=2)
    >>> build().count_params() > 0, data.element_spec[0].shape.as_list()
    (True, [None, 8])
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from .common import without_autotune

__all__ = ["MODELS", "SIZES", "get", "missing"]

MODELS: tuple[str, ...] = ("mlp", "cnn", "transformer", "gpt2", "resnet")

#: name -> {"full": sizes, "quick": sizes}
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "mlp": {"full": dict(batch=256, features=1024, width=2048, depth=4),
            "quick": dict(batch=256, features=1024, width=1024, depth=3)},
    "cnn": {"full": dict(batch=32, side=64, filters=32),
            "quick": dict(batch=32, side=32, filters=32)},
    "transformer": {"full": dict(batch=32, length=128, dim=512, blocks=2),
                    "quick": dict(batch=32, length=128, dim=256, blocks=2)},
    "gpt2": {"full": dict(batch=16, length=128, dim=256, blocks=4, vocabulary=50257),
             "quick": dict(batch=16, length=128, dim=256, blocks=4, vocabulary=50257)},
    "resnet": {"full": dict(batch=16, side=64), "quick": dict(batch=16, side=64)},
}


def missing(kind: str) -> str | None:
    """Why model ``kind`` cannot be built here (a missing package), or None."""
    if kind == "gpt2" and importlib.util.find_spec("keras_hub") is None:
        return ("the gpt2 model needs KerasHub, which is not installed: "
                "pip install 'keras-mp[hub]' (or keras-hub)")
    return None


def _head(h):
    import keras

    out = keras.layers.Dense(10)(h)
    return keras.layers.Activation("linear", dtype="float32")(out)


def _mlp(size):
    import keras

    inp = keras.Input((size["features"],))
    h = inp
    for _ in range(size["depth"]):
        h = keras.layers.Dense(size["width"], activation="relu")(h)
    return keras.Model(inp, _head(h))


def _cnn(size):
    import keras

    inp = keras.Input((size["side"], size["side"], 3))
    h = inp
    for k in (1, 2, 4):
        for _ in range(2):
            h = keras.layers.Conv2D(size["filters"] * k, 3, padding="same",
                                    activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    return keras.Model(inp, _head(keras.layers.GlobalAveragePooling2D()(h)))


def _transformer(size):
    import keras

    d = size["dim"]
    inp = keras.Input((size["length"], d))
    h = inp
    for _ in range(size["blocks"]):
        a = keras.layers.MultiHeadAttention(8, d // 8)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(d)(keras.layers.Dense(4 * d, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h + f)
    return keras.Model(inp, _head(keras.layers.GlobalAveragePooling1D()(h)))


def _gpt2(size):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=size["vocabulary"], num_layers=size["blocks"],
        num_heads=max(1, size["dim"] // 64), hidden_dim=size["dim"],
        intermediate_dim=4 * size["dim"], max_sequence_length=size["length"])
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _resnet(size):
    import keras

    base = keras.applications.ResNet50V2(include_top=False, weights=None, pooling="avg",
                                         input_shape=(size["side"], size["side"], 3))
    return keras.Model(base.input, _head(base.output))


_BUILDERS: dict[str, Callable[[dict[str, int]], Any]] = {
    "mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "gpt2": _gpt2, "resnet": _resnet}


def _arrays(kind: str, size: dict[str, int], rows: int):
    import numpy as np

    rng = np.random.default_rng(0)
    if kind == "gpt2":
        tokens = rng.integers(0, size["vocabulary"], (rows, size["length"] + 1))
        x = {"token_ids": tokens[:, :-1].astype("int32"),
             "padding_mask": np.ones((rows, size["length"]), "int32")}
        return x, tokens[:, 1:].astype("int32")
    shape = {"mlp": lambda: (size["features"],),
             "cnn": lambda: (size["side"], size["side"], 3),
             "resnet": lambda: (size["side"], size["side"], 3),
             "transformer": lambda: (size["length"], size["dim"])}[kind]()
    x = rng.standard_normal((rows,) + shape).astype("float32")
    return x, rng.integers(0, 10, rows).astype("int32")


def get(kind: str, size: dict[str, int], steps: int, rows: int | None = None):
    """``(build, data)``: a function building a new model of ``kind`` (under the
    global dtype policy in force when it is called), and a repeating, cached
    ``tf.data`` dataset of ``steps`` distinct batches of ``size["batch"]``
    rows (or of ``rows`` rows), with tf.data's autotuning off (see
    :func:`~benchmarks.common.without_autotune`: a round of ``fit`` could
    otherwise last until that thread's next wake-up).

    Raises:
        ValueError: ``kind`` is not one of :data:`MODELS`.
        ImportError: the model needs a package that is missing (:func:`missing`).
    """
    import tensorflow as tf

    if kind not in MODELS:
        raise ValueError(f"`models` must be among {MODELS}, got {kind!r}.")
    reason = missing(kind)
    if reason is not None:
        raise ImportError(reason)
    batch = size["batch"] if rows is None else rows
    x, y = _arrays(kind, size, batch * steps)
    data = without_autotune(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache().repeat())
    return (lambda: _BUILDERS[kind](size)), data
