"""Exporting keras-mp models for serving: SavedModel, LiteRT (TFLite) and ONNX.

Keras's own ``model.export(path)`` works on adaptive, fused and quantized
keras-mp models and writes a SavedModel whose outputs have the dtype of the
last layer's computation (``bfloat16`` for an adaptive_bfloat16 model).
:func:`export` wraps it with what a deployment usually wants:

* ``format="tf_saved_model"``: a ``serve`` endpoint taking float32 inputs
  (integer and boolean inputs, such as token ids and padding masks, keep
  their dtype; a model whose inputs are a dict, such as a KerasHub task,
  takes that dict, as Keras's own export does) and returning **float32**
  outputs (``output_dtype="compute"`` keeps the model's own output dtype). Works for adaptive, fused and Keras-quantized
  (int8, int4, float8) models; the computation inside is the model's own
  (bfloat16 matmuls, int8 kernels, ...).
* ``format="litert"``: a ``.tflite`` file computed in float32 (TFLite's
  builtin ops have no bfloat16 or float16 matmul, and no kernel for the
  int8 Keras ``Dense`` graph), optionally with TFLite's own weight
  compression: ``weights="float16"`` (float16 weights, float32 compute) or
  ``weights="int8"`` (dynamic-range int8). Inputs and outputs are float32.
  A Keras-quantized model is refused with a clear error: export its float
  model with ``weights="int8"`` instead.
* ``format="onnx"``: a ``.onnx`` file (tf2onnx, checked by loading and
  running it in onnxruntime) computed in ``compute_dtype="float32"``
  (default) or ``"float16"`` (TensorRT-style serving; layers the model
  computes in float32 stay float32), float32 inputs (integer and boolean
  inputs keep their dtype; a dict input becomes one ONNX input per key, of
  that name) and float32 outputs. bfloat16 layers are served in the chosen
  dtype (tf2onnx 1.17 writes TensorFlow's bfloat16 as ONNX float16, a file
  onnxruntime refuses); exact GELU's ``Erfc`` (no ONNX op) becomes
  ``1 - Erf``; fused layers are served as their Keras counterparts; int8
  layers keep their int8 kernels (``MatMulInteger``), dequantized in
  float32 (tf2onnx folds int4 kernels into float32 constants); float8 layers
  (a training-time quantize-dequantize) are served as float layers.
  Needs the ``onnx`` extra: ``pip install "keras-mp[onnx]"``.

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

from keras_mp import _checks as checks
from keras_mp._atomic import atomic_path
from keras_mp._cloning import clone_with_weights
from keras_mp.adaptive.evidence import float8

__all__ = ["COMPUTE_DTYPES", "FORMATS", "WEIGHTS", "check_arguments", "export", "float32_copy",
           "serving_copy"]

#: The formats :func:`export` writes without a GPU.
FORMATS: tuple[str, ...] = ("tf_saved_model", "litert", "onnx")
#: LiteRT weight storage: None (float32), "float16", "int8" (dynamic range).
WEIGHTS: tuple[str | None, ...] = (None, "float16", "int8")
#: ONNX compute dtypes (``compute_dtype``); the other formats take None.
COMPUTE_DTYPES: tuple[str, ...] = ("float32", "float16")
_OUTPUT_DTYPES = ("float32", "compute")
#: The ONNX opsets accepted (tf2onnx 1.17 writes up to 18; its default: 15).
_OPSETS = range(13, 19)


#: The file each format writes; a SavedModel is a folder.
_SUFFIXES = {"litert": ".tflite", "onnx": ".onnx"}


def check_arguments(path: Any, format: Any = "tf_saved_model", *, output_dtype: Any = "float32",
                    weights: Any = None, compute_dtype: Any = None, opset: Any = None) -> str:
    """Everything :func:`export` would refuse that does not depend on the
    model, checked before any work (``keras-mp export`` calls it before it
    loads the model): the arguments, the ONNX extra for ``format="onnx"``,
    and that ``path`` can be written now.

    ``path`` must be, for a SavedModel, a new or empty folder (or an earlier
    SavedModel, which is replaced) in an existing, writable folder, not a
    file nor a folder holding other files; for LiteRT and ONNX a ``.tflite``
    / ``.onnx`` file path in an existing, writable folder (an existing file
    there is replaced).

    Returns:
        ``path`` as a str.

    Raises:
        TypeError / ValueError: naming the argument and what it must be.
        ImportError: ``format="onnx"`` without ``pip install "keras-mp[onnx]"``.
    """
    checks.path("path", path)
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    if output_dtype not in _OUTPUT_DTYPES:
        raise ValueError(f"`output_dtype` must be one of {_OUTPUT_DTYPES}, got "
                         f"{output_dtype!r}.")
    if weights not in WEIGHTS:
        raise ValueError(f"`weights` must be one of {WEIGHTS}, got {weights!r}.")
    if weights is not None and format != "litert":
        raise ValueError(f"`weights`={weights!r} applies to format='litert' only (a "
                         "SavedModel or ONNX file keeps the model's own weights; quantize "
                         "the model with keras_mp.quantize or model.quantize first).")
    if format == "onnx":
        if compute_dtype not in (None, *COMPUTE_DTYPES):
            raise ValueError(f"`compute_dtype` must be one of {COMPUTE_DTYPES} (or None: "
                             f"float32), got {compute_dtype!r}.")
        if opset is not None and (isinstance(opset, bool) or opset not in _OPSETS):
            raise ValueError(f"`opset` must be None (tf2onnx's default, 15) or an int from "
                             f"{_OPSETS.start} to {_OPSETS.stop - 1}, got {opset!r}.")
        _onnx_modules()
    else:
        for name, value in (("compute_dtype", compute_dtype), ("opset", opset)):
            if value is not None:
                raise ValueError(f"`{name}`={value!r} applies to format='onnx' only "
                                 f"(format={format!r} was given).")
    if format in _SUFFIXES:
        return checks.output_path("path", path, suffixes=(_SUFFIXES[format],),
                                  what=f" for format={format!r}")
    for other, suffix in _SUFFIXES.items():
        if os.fspath(path).lower().endswith(suffix):
            raise ValueError(f"`path` {os.fspath(path)!r} names a {suffix} file, but "
                             "format='tf_saved_model' writes a folder: give a folder, or "
                             f"format={other!r}.")
    return checks.output_folder("path", path, what="a SavedModel",
                                replaceable=lambda folder: os.path.isfile(
                                    os.path.join(folder, "saved_model.pb")))


def _input_signature(model: keras.Model) -> list:
    """The serving function's positional inputs: one dict of specs for a model
    whose inputs are a dict (KerasHub's ``token_ids``, ``padding_mask``...;
    called as Keras's own ``model.export`` calls it), else one spec per input.
    Floating inputs are float32; integer and boolean inputs keep their dtype."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        raise ValueError("`model` must have known inputs (a functional or Sequential model, "
                         "or a subclassed one called on data).")

    def spec(t, name=None):
        own = tf.as_dtype(t.dtype)
        return tf.TensorSpec(shape=tuple(t.shape),
                             dtype=own if own.is_integer or own.is_bool else tf.float32,
                             name=name or t.name.split(":")[0])

    struct = getattr(model, "_inputs_struct", None)
    if isinstance(struct, dict):
        return [{key: spec(t, key) for key, t in struct.items()}]
    return [spec(t) for t in inputs]


def _to_float32(outputs):
    return tf.nest.map_structure(lambda t: tf.cast(t, "float32")
                                 if t.dtype.is_floating else t, outputs)


def _quantized_layers(model: keras.Model) -> list[str]:
    """Layers Keras quantized for inference; not the float8-capable layers
    of an adaptive float8 model (:mod:`keras_mp.adaptive.evidence.float8`: float8 is
    how keras-mp trains them, over float master weights)."""
    return [layer.name for layer in model._flatten_layers(include_self=False)
            if getattr(layer, "quantization_mode", None) is not None
            and not float8.is_float8_layer(layer)]


def _quantization_mode(layer: keras.layers.Layer) -> str | None:
    return getattr(layer, "quantization_mode", None)


def _serving_dtype(layer: keras.layers.Layer, compute: str, low_precision_model: bool) -> Any:
    """The dtype policy ``layer`` gets in a serving copy computing in ``compute``."""
    mode = _quantization_mode(layer)
    if mode in ("int8", "int4"):
        # Integer kernels kept (with the layer's own int4 block size);
        # dequantized in float32 (Keras refuses int8 over float16: the int32
        # accumulator overflows it).
        policy = keras.dtype_policies.serialize(layer.dtype_policy)
        policy["config"]["source_name"] = "float32"
        return policy
    if mode not in (None, "float8"):
        raise ValueError(f"layer {layer.name!r} is quantized in mode {mode!r}, which a "
                         "serving copy cannot carry (int8 and int4 can; float8 is served "
                         "as float).")
    # float8 is a training-time quantize-dequantize over a float kernel: the
    # layer is served as the float layer it holds.
    if compute == "float32":
        return "float32"
    # float16: a layer the model computes in float32 (promoted by adaptive
    # training, or pinned) stays float32, unless no layer is narrower.
    if low_precision_model and layer.compute_dtype == "float32":
        return "float32"
    return "mixed_float16"


def serving_copy(model: keras.Model, compute_dtype: str = "float32", *,
                 quantized: bool = True, unfuse: bool = False) -> keras.Model:
    """A copy of ``model`` with the same weights, every layer computing in
    ``compute_dtype``: the model that LiteRT and ONNX export convert.

    With ``compute_dtype="float16"``, layers that compute in float32 in a
    model that has narrower layers (promoted by adaptive training, or
    pinned to float32) stay in float32; in an all-float32 model every layer
    computes in float16. Variables stay float32 (``mixed_float16``).
    Quantized int8/int4 layers keep their integer kernels, dequantized in
    float32 (Keras refuses int8 over float16); float8 layers (Keras's float8
    training, keras-mp's float8 candidate) become float layers (their float
    kernel, without the quantize-dequantize).

    Args:
        model: a built functional or Sequential Keras model.
        compute_dtype: one of :data:`COMPUTE_DTYPES`.
        quantized: whether quantized and float8 layers are accepted (else
            ``ValueError``, as :func:`float32_copy` does).
        unfuse: whether :mod:`keras_mp.fused.layers` fused layers become their
            Keras namesakes (same config and weights; ONNX converters cannot
            express their XLA-compiled kernels).

    Raises:
        TypeError: ``model`` is not a Keras model, or is subclassed (it
            cannot be cloned from its config).
        ValueError: a bad ``compute_dtype``, or quantized layers that the
            copy cannot carry (or any, with ``quantized=False``).
    """
    from keras_mp.fused.layers import FUSED_LAYERS

    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"`compute_dtype` must be one of {COMPUTE_DTYPES}, got "
                         f"{compute_dtype!r}.")
    layers = list(model._flatten_layers(include_self=False))
    if not quantized:
        names = _quantized_layers(model)  # float8-trained layers are float layers here
        if names:
            raise ValueError(f"`model` has quantized layers ({', '.join(names)}); a "
                             "float32 copy needs the float model.")
    low_precision = any(getattr(layer, "compute_dtype", "float32") != "float32"
                        for layer in layers if not isinstance(layer, keras.Model))
    unfused = {fused: plain for plain, fused in FUSED_LAYERS.items()} if unfuse else {}

    def clone(layer):
        config = layer.get_config()
        if "dtype" in config and not isinstance(layer, keras.layers.InputLayer):
            config["dtype"] = _serving_dtype(layer, compute_dtype, low_precision)
        return unfused.get(type(layer), type(layer)).from_config(config)

    try:
        copy, _ = clone_with_weights(model, clone)
    except ValueError as e:
        raise TypeError(f"`model` must be a functional or Sequential model: {e}") from e
    except RuntimeError as e:
        raise RuntimeError(f"serving_copy(): {e}") from e
    return copy


def float32_copy(model: keras.Model) -> keras.Model:
    """A copy of ``model`` whose every layer computes in float32, with the
    same weights (keras-mp's master weights are float32 already):
    ``serving_copy(model, "float32", quantized=False)``.

    Raises:
        TypeError: ``model`` is subclassed (it cannot be cloned from its config).
        ValueError: ``model`` has quantized layers.
    """
    return serving_copy(model, "float32", quantized=False)


def _onnx_modules() -> dict[str, Any]:
    names = ("tf2onnx", "onnx", "onnxruntime")
    return dict(zip(names, checks.extra(names, "onnx", "format='onnx'")))


def _erfc_as_one_minus_erf(ctx, node, name, args) -> None:
    """tf2onnx handler (its ``custom_op_handlers`` API) for TensorFlow's
    ``Erfc``, which ONNX lacks and TensorFlow's exact GELU uses
    (``0.5 * x * erfc(-x / sqrt(2))``): ``1 - Erf(x)``, in the node's dtype."""
    from tf2onnx import utils

    x = node.input[0]
    dtype = ctx.get_dtype(x)
    one = ctx.make_const(utils.make_name(f"{node.name}_one"),
                         np.array(1, utils.map_onnx_to_numpy_type(dtype)))
    erf = ctx.make_node("Erf", [x], op_name_scope=node.name, dtypes=[dtype],
                        shapes=[ctx.get_shape(x)])
    node.type = "Sub"
    ctx.replace_inputs(node, [one.output[0], erf.output[0]])


def _serving_function(model: keras.Model, output_dtype: str, keys: list[str] | None = None):
    """The traced serving function: float32 outputs unless asked, named
    ``output_0``, ``output_1``... in the model's order (a dict output keeps its keys).
    With ``keys``, its positional inputs are the model's dict input, in that order."""

    @tf.function
    def serve(*args):
        inputs = dict(zip(keys, args)) if keys is not None else \
            list(args) if len(args) > 1 else args[0]
        outputs = model(inputs, training=False)
        if output_dtype == "float32":
            outputs = _to_float32(outputs)
        if isinstance(outputs, dict):
            return outputs
        flat = tf.nest.flatten(outputs)
        width = len(str(len(flat) - 1))
        return {f"output_{i:0{width}d}": t for i, t in enumerate(flat)}

    return serve


class _Frozen:
    """A ``tf.function`` as tf2onnx's ``from_function`` takes it, whose
    concrete function holds the model's variables and the tensors it
    captured (Keras's ``Normalization`` keeps its mean and variance as
    tensors made when it was built) as constants: tf2onnx 1.17 lists every
    captured tensor that is not a variable among the ONNX model's inputs
    (an input ``.../normalization/Sub/y:0`` that no caller feeds)."""

    def __init__(self, function):
        self.function = function

    def get_concrete_function(self, *signature):
        from tensorflow.python.framework.convert_to_constants import (  # no public name
            convert_variables_to_constants_v2)

        traced = self.function.get_concrete_function(*signature)
        frozen = convert_variables_to_constants_v2(traced)
        # The input names and output keys tf2onnx names the ONNX model's by
        # (the conversion keeps neither).
        frozen.graph.structured_input_signature = traced.structured_input_signature
        frozen.graph.structured_outputs = tf.nest.pack_sequence_as(
            traced.structured_outputs, frozen.outputs)
        return frozen


def _export_onnx(model: keras.Model, path: str, compute_dtype: str, output_dtype: str,
                 opset: int | None) -> None:
    import logging

    modules = _onnx_modules()
    copy = serving_copy(model, compute_dtype, unfuse=True)
    signature = _input_signature(copy)
    keys = None
    if len(signature) == 1 and isinstance(signature[0], dict):   # ONNX inputs are flat
        keys, signature = list(signature[0]), list(signature[0].values())
    serve = _Frozen(_serving_function(copy, output_dtype, keys))
    logger = logging.getLogger("tf2onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)  # its INFO/WARNING chatter; errors still show
    try:
        modules["tf2onnx"].convert.from_function(
            serve, signature, opset=opset, output_path=path,
            custom_op_handlers={"Erfc": (_erfc_as_one_minus_erf, [])})
    finally:
        logger.setLevel(level)
    _check_onnx(path, signature, modules)  # before the file takes the caller's name


def _check_onnx(path: str, signature: list[tf.TensorSpec], modules: dict[str, Any]) -> None:
    """Loads ``path`` in onnxruntime and runs it on one batch of zeros."""
    onnx, ort = modules["onnx"], modules["onnxruntime"]
    proto = onnx.load(path, load_external_data=False)
    unknown = sorted({f"{n.domain}.{n.op_type}" if n.domain else n.op_type
                      for n in proto.graph.node
                      if n.domain not in ("", "ai.onnx") or not onnx.defs.has(n.op_type)})
    if unknown:
        raise ValueError(f"format='onnx': tf2onnx {modules['tf2onnx'].__version__} cannot "
                         f"express this model's TensorFlow ops {unknown} in ONNX.")
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        feeds = {spec.name: np.zeros([1 if d is None else d for d in spec.shape],
                                     spec.dtype.as_numpy_dtype)
                 for spec in signature}
        session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
    except Exception as e:  # onnxruntime raises its own exception types
        raise ValueError(f"format='onnx': the converted model does not run in onnxruntime "
                         f"{ort.__version__}: {e}") from e


def export(model: keras.Model, path: str | os.PathLike, format: str = "tf_saved_model", *,
           output_dtype: str = "float32", weights: str | None = None,
           compute_dtype: str | None = None, opset: int | None = None) -> None:
    """Writes ``model`` for serving (see the module docstring).

    Args:
        model: a built functional or Sequential Keras model: adaptive, fused
            (:func:`keras_mp.fuse`) or quantized.
        path: the SavedModel folder, the ``.tflite`` file for LiteRT, the
            ``.onnx`` file for ONNX (see :func:`check_arguments`). Written beside
            it and moved into place (:func:`keras_mp._atomic.atomic_path`): an
            earlier export there is replaced whole, or kept whole if the export
            fails or is killed.
        format: one of :data:`FORMATS`.
        output_dtype: ``"float32"`` (default): outputs cast to float32;
            ``"compute"``: the model's own output dtype (SavedModel), the
            last layer's serving dtype (ONNX; LiteRT is float32 throughout).
        weights: LiteRT only: one of :data:`WEIGHTS`.
        compute_dtype: ONNX only: one of :data:`COMPUTE_DTYPES` (None:
            ``"float32"``); see :func:`serving_copy`.
        opset: ONNX only: the ONNX opset, 13 to 18 (None: tf2onnx's default, 15).

    Raises:
        ValueError: a bad argument (:func:`check_arguments`, before any
            work: a path that cannot be written is one), LiteRT of a
            Keras-quantized model, or an ONNX conversion that does not run in
            onnxruntime (no file is written).
        ImportError: ONNX without the ``onnx`` extra (tf2onnx, onnx, onnxruntime).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    path = check_arguments(path, format, output_dtype=output_dtype, weights=weights,
                           compute_dtype=compute_dtype, opset=opset)
    if not model.built:
        raise ValueError("`model` must be built (call it once, or give it an Input).")
    # Written beside `path` and moved into place: a kill leaves the old export or the new one.
    with atomic_path(path, directory=format == "tf_saved_model") as tmp:
        _export(model, tmp, format, output_dtype, weights, compute_dtype, opset)


def _export(model: keras.Model, path: str, format: str, output_dtype: str,
            weights: str | None, compute_dtype: str | None, opset: int | None) -> None:
    if format == "onnx":
        _export_onnx(model, path, compute_dtype or "float32", output_dtype, opset)
        return
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
