"""Exporting keras-mp models for serving: SavedModel and LiteRT (TFLite).

Keras's own ``model.export(path)`` works on adaptive, fused and quantized
keras-mp models and writes a SavedModel whose outputs have the dtype of the
last layer's computation (``bfloat16`` for an adaptive_bfloat16 model).
:func:`export` wraps it with what a deployment usually wants:

* ``format="tf_saved_model"``: a ``serve`` endpoint taking float32 inputs and
  returning **float32** outputs (``output_dtype="compute"`` keeps the
  model's own output dtype). Works for adaptive, fused and Keras-quantized
  (int8, int4, float8) models; the computation inside is the model's own
  (bfloat16 matmuls, int8 kernels, ...).
* ``format="litert"``: a ``.tflite`` file computed in float32 (TFLite's
  builtin ops have no bfloat16 or float16 matmul, and no kernel for the
  int8 Keras ``Dense`` graph), optionally with TFLite's own weight
  compression: ``weights="float16"`` (float16 weights, float32 compute) or
  ``weights="int8"`` (dynamic-range int8). Inputs and outputs are float32.
  A Keras-quantized model is refused with a clear error: export its float
  model with ``weights="int8"`` instead.

Example:
    >>> import os, tempfile, keras, numpy as np, tensorflow as tf, keras_mp
    >>> with keras_mp.policy_scope("adaptive_bfloat16"):
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> path = os.path.join(tempfile.mkdtemp(), "served")
    >>> keras_mp.deploy.export.export(model, path)
    >>> served = tf.saved_model.load(path)
    >>> served.serve(np.ones((1, 4), "float32")).dtype.name
    'float32'
"""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["FORMATS", "WEIGHTS", "export", "float32_copy"]

#: The formats :func:`export` writes without a GPU.
FORMATS: tuple[str, ...] = ("tf_saved_model", "litert")
#: LiteRT weight storage: None (float32), "float16", "int8" (dynamic range).
WEIGHTS: tuple[str | None, ...] = (None, "float16", "int8")
_OUTPUT_DTYPES = ("float32", "compute")


def _check(model: Any, path: Any, format: Any, output_dtype: Any, weights: Any) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    if not model.built:
        raise ValueError("`model` must be built (call it once, or give it an Input).")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"`path` must be a file or folder path, got {path!r}.")
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"`output_dtype` must be one of {_OUTPUT_DTYPES}, got "
                         f"{output_dtype!r}.")
    if weights not in WEIGHTS:
        raise ValueError(f"`weights` must be one of {WEIGHTS}, got {weights!r}.")
    if weights is not None and format != "litert":
        raise ValueError(f"`weights`={weights!r} applies to format='litert' only (a "
                         "SavedModel keeps the model's own weights; quantize the model "
                         "with keras_mp.quantize or model.quantize first).")


def _input_signature(model: keras.Model) -> list[tf.TensorSpec]:
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError("`model` must have known inputs (a functional or Sequential model, "
                         "or a subclassed one called on data).")
    return [tf.TensorSpec(shape=tuple(t.shape), dtype="float32", name=t.name.split(":")[0])
            for t in inputs]


def _to_float32(outputs):
    return tf.nest.map_structure(lambda t: tf.cast(t, "float32")
                                 if t.dtype.is_floating else t, outputs)


def _quantized_layers(model: keras.Model) -> list[str]:
    return [layer.name for layer in model._flatten_layers(include_self=False)
            if getattr(layer, "quantization_mode", None) is not None]


def float32_copy(model: keras.Model) -> keras.Model:
    """A copy of ``model`` whose every layer computes in float32, with the
    same weights (keras-mp's master weights are float32 already).

    Raises:
        TypeError: ``model`` is subclassed (it cannot be cloned from its config).
        ValueError: ``model`` has quantized layers.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    quantized = _quantized_layers(model)
    if quantized:
        raise ValueError(f"`model` has quantized layers ({', '.join(quantized)}); a float32 "
                         "copy needs the float model.")

    def clone(layer):
        config = layer.get_config()
        if "dtype" in config:
            config["dtype"] = "float32"
        return layer.__class__.from_config(config)

    try:
        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as e:
        raise TypeError(f"`model` must be a functional or Sequential model: {e}") from e
    copy.set_weights([np.asarray(w) for w in model.get_weights()])
    return copy


def export(model: keras.Model, path: str | os.PathLike, format: str = "tf_saved_model", *,
           output_dtype: str = "float32", weights: str | None = None) -> None:
    """Writes ``model`` for serving (see the module docstring).

    Args:
        model: a built functional or Sequential Keras model: adaptive, fused
            (:func:`keras_mp.fuse`) or quantized.
        path: the SavedModel folder, or the ``.tflite`` file for LiteRT.
        format: one of :data:`FORMATS`.
        output_dtype: ``"float32"`` (default): outputs cast to float32;
            ``"compute"``: the model's own output dtype (SavedModel only;
            LiteRT is float32 throughout).
        weights: LiteRT only: one of :data:`WEIGHTS`.

    Raises:
        ValueError: a bad argument, or LiteRT of a Keras-quantized model.
    """
    _check(model, path, format, output_dtype, weights)
    path = os.fspath(path)
    signature = _input_signature(model)
    if format == "tf_saved_model":
        archive = keras.export.ExportArchive()
        archive.track(model)

        def serve(*args):
            outputs = model(list(args) if len(args) > 1 else args[0], training=False)
            return _to_float32(outputs) if output_dtype == "float32" else outputs

        archive.add_endpoint("serve", serve, input_signature=signature)
        archive.write_out(path, verbose=False)
        return
    quantized = _quantized_layers(model)
    if quantized:
        raise ValueError(
            "format='litert' cannot convert a Keras-quantized model (TFLite has no kernel "
            f"for its int8 matmul graph; quantized layers: {', '.join(quantized)}): export "
            "the float model with weights='int8' (TFLite dynamic-range int8) instead.")
    options: dict[str, Any] = {}
    if weights is not None:
        options["optimizations"] = [tf.lite.Optimize.DEFAULT]
    if weights == "float16":
        options["target_spec"] = {"supported_types": [tf.float16]}
    float32_copy(model).export(path, format="litert", verbose=False, **options)
