"""Drop-in Keras layers whose work around the matmul is one fused kernel.

Each layer subclasses its Keras namesake, so it takes the same arguments,
creates the same weights in the same order (a Keras checkpoint loads into
it and back) and respects the layer's dtype policy the same way (weights in
the variable dtype, float32; computation and output in the compute dtype).
Only :meth:`call` differs, and only for the options that are fused; any
other option (an activation without a fused kernel, normalization over
another axis, LoRA, quantization, a masked attention call) runs Keras's own
code.

Example:
    >>> import keras
    >>> from keras_mp.fused.layers import Dense
    >>> layer = Dense(4, activation="gelu", dtype="mixed_bfloat16")
    >>> y = layer(keras.ops.ones((2, 3)))
    >>> y.dtype.name, layer.kernel.dtype
    ('bfloat16', 'float32')
    >>> layer.fused
    True
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_mp.fused import ops as kops

__all__ = ["BatchNormalization", "Dense", "LayerNormalization", "MultiHeadAttention", "RMSNormalization",
           "ReversibleEmbedding", "Softmax", "FUSED_LAYERS", "fused_activation", "fused_class",
           "float32_alone"]

# Keras activation functions with a fused kernel, and how the kernel names them.
_FUSED_ACTIVATIONS: dict[Any, tuple[str, bool]] = {
    keras.activations.linear: ("linear", False),
    keras.activations.relu: ("relu", False),
    keras.activations.gelu: ("gelu", False),  # Keras's "gelu" is the exact (erf) form
    keras.activations.silu: ("silu", False),
    keras.activations.tanh: ("tanh", False),
}


def float32_alone(layer: keras.layers.Layer) -> bool:
    """Whether ``layer``'s dtype policy is an adaptive one whose only candidate
    is float32 (``"adaptive"`` on a CPU without 16-bit units): there the
    fused kernels of ``Dense``, the normalizations, ``Softmax`` and
    ``MultiHeadAttention`` run Keras's code instead. A fixed rule, from
    measurement (issue 48): as the AVX2 class (2-core AMD EPYC with
    AVX512-BF16, decisions and kernels capped to AVX2, quick bench
    Transformer, 7 interleaved rounds, CPU ms a step) the fused float32
    layers ran 216 as a graph against 173 for Keras's, and under XLA
    269.7 against 264.3 for the fused graph, where Keras's layers gain
    1.27x from XLA. (``BatchNormalization``'s fused kernel is TensorFlow's
    own, no XLA: it stays.)

    >>> import keras
    >>> float32_alone(keras.layers.Dense(2)), float32_alone(keras.layers.Dense(2, dtype="mixed_bfloat16"))
    (False, False)
    """
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {type(layer).__name__}.")
    return tuple(getattr(layer.dtype_policy, "candidates", None) or ()) == ("float32",)


def fused_activation(fn: Any) -> tuple[str, bool] | None:
    """``(kernel name, approximate)`` of the fused kernel for the activation
    function ``fn``, or None where there is none. KerasHub's
    ``gelu_approximate`` (GPT-2's) is the tanh form of GELU.

    Example:
        >>> import keras
        >>> fused_activation(keras.activations.gelu), fused_activation(keras.activations.elu)
        (('gelu', False), None)
    """
    try:
        hit = _FUSED_ACTIVATIONS.get(fn)
    except TypeError:  # not hashable
        return None
    if hit is None and getattr(fn, "__name__", None) == "gelu_approximate" \
            and str(getattr(fn, "__module__", "")).startswith("keras_hub."):
        return ("gelu", True)
    return hit


def _last_axis(axis: Any, rank: int | None) -> bool:
    """Whether ``axis`` (int or one-element list) names the last axis."""
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            return False
        axis = axis[0]
    return isinstance(axis, int) and (axis == -1 or (rank is not None and axis == rank - 1))


@keras.saving.register_keras_serializable(package="keras_mp")
class Dense(keras.layers.Dense):
    """``keras.layers.Dense`` with bias and activation fused after the matmul.

    The matmul runs where :mod:`keras_mp.device.xla` places it (oneDNN on CPUs
    with AMX, which XLA:CPU does not use; XLA elsewhere), the epilogue
    ``activation(x @ kernel + bias)`` is one XLA kernel forward and one
    backward (or part of the matmul's XLA computation). Activations fused: None/linear, relu, gelu (exact, as Keras's
    ``"gelu"``; KerasHub's ``gelu_approximate``, the tanh form), silu/swish, tanh; any other
    runs as in Keras.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import Dense
        >>> Dense(8, activation="relu")(keras.ops.ones((1, 4))).shape
        TensorShape([1, 8])
        >>> Dense(8, activation="softplus").fused   # not fused: Keras's path
        False
    """

    @property
    def fused(self) -> bool:
        """Whether :meth:`call` runs the fused epilogue (else Keras's code)."""
        return (fused_activation(self.activation) is not None
                and not self.lora_enabled
                and not self.quantization_mode
                and not float32_alone(self))

    def quantize(self, mode=None, type_check=True, config=None):
        # Keras quantizes only exact keras.layers.Dense unless told otherwise;
        # once quantized this layer runs Keras's own quantized call.
        super().quantize(mode, type_check=False, config=config)

    def call(self, inputs, training=None):
        if not self.fused:
            return super().call(inputs, training=training)
        # keras_mp.device.xla places the matmul: outside XLA on CPUs with AMX (oneDNN
        # runs bf16 matmuls ~3x faster than XLA:CPU there), inside elsewhere.
        name, approximate = fused_activation(self.activation)
        return kops.dense_activation(inputs, self.kernel, self.bias, name,
                                     approximate=approximate)


@keras.saving.register_keras_serializable(package="keras_mp")
class LayerNormalization(keras.layers.LayerNormalization):
    """``keras.layers.LayerNormalization`` as one fused kernel each way.

    Fused for normalization over the last axis with ``rms_scaling=False``
    (statistics in float32, like Keras); other settings run as in Keras.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import LayerNormalization
        >>> layer = LayerNormalization(dtype="mixed_bfloat16")
        >>> layer(keras.ops.ones((2, 4))).dtype.name, layer.fused
        ('bfloat16', True)
    """
    _input_rank: int | None = None  # set in build()

    @property
    def fused(self) -> bool:
        """Whether :meth:`call` runs the fused kernel (else Keras's code)."""
        return (not self.rms_scaling and _last_axis(self.axis, self._input_rank)
                and not float32_alone(self))

    def build(self, input_shape):
        # Keras may rewrite `axis` as a non-negative index in build, so the
        # rank is kept to recognise the last axis afterwards.
        self._input_rank = len(input_shape)
        super().build(input_shape)

    def call(self, inputs):
        if not self.fused:
            return super().call(inputs)
        # Keras keeps this layer's weights in float32 (autocast=False) and
        # so do we: the kernel casts them, its statistics are float32 anyway.
        y = kops.layer_norm(ops.cast(inputs, self.compute_dtype),
                            self.gamma if self.scale else None,
                            self.beta if self.center else None,
                            epsilon=self.epsilon)
        return y


@keras.saving.register_keras_serializable(package="keras_mp")
class BatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` as TensorFlow's fused kernel each way
    (:func:`keras_mp.fused.ops.batch_norm`: oneDNN on CPU, 3x faster than
    Keras's ops on 16-bit activations there).

    Fused for 4-D inputs normalized over the channels (the last axis), without
    ``renorm``, ``synchronized`` or a mask, and ``epsilon`` at least
    :data:`keras_mp.fused.ops.batch_normalization.MIN_EPSILON`; other settings
    run as in Keras. Statistics in float32, moving averages updated as Keras
    updates them (population variance).

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import BatchNormalization
        >>> layer = BatchNormalization(dtype="mixed_bfloat16")
        >>> layer(keras.ops.ones((2, 3, 3, 4)), training=True).dtype.name, layer.fused
        ('bfloat16', True)
    """
    _input_rank: int | None = None  # set in build()

    @property
    def fused(self) -> bool:
        """Whether :meth:`call` runs the fused kernel (else Keras's code)."""
        return (self._input_rank == 4 and self.axis in (-1, 3) and not self.renorm
                and not self.synchronized and self.epsilon >= kops.batch_normalization.MIN_EPSILON
                and self.compute_dtype in ("float16", "bfloat16", "float32"))

    def build(self, input_shape):
        self._input_rank = len(input_shape)
        super().build(input_shape)

    def call(self, inputs, training=None, mask=None):
        if mask is not None or not self.fused:
            return super().call(inputs, training=training, mask=mask)
        x = ops.cast(inputs, self.compute_dtype)
        gamma = self.gamma if self.scale else None
        beta = self.beta if self.center else None
        if training and self.trainable:
            y, mean, variance = kops.batch_norm(x, gamma, beta, epsilon=self.epsilon,
                                                training=True)
            momentum = self.momentum
            self.moving_mean.assign(self.moving_mean * momentum + mean * (1.0 - momentum))
            self.moving_variance.assign(
                self.moving_variance * momentum + variance * (1.0 - momentum))
            return y
        return kops.batch_norm(x, gamma, beta, self.moving_mean, self.moving_variance,
                               epsilon=self.epsilon)[0]


@keras.saving.register_keras_serializable(package="keras_mp")
class RMSNormalization(keras.layers.RMSNormalization):
    """``keras.layers.RMSNormalization`` as one fused kernel each way.

    Fused for normalization over the last axis (statistics in float32);
    other axes run as in Keras.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import RMSNormalization
        >>> RMSNormalization(dtype="mixed_bfloat16")(keras.ops.ones((2, 4))).dtype.name
        'bfloat16'
    """
    _input_rank: int | None = None  # set in build()

    def __init__(self, axis: int | list[int] | tuple[int, ...] = -1, epsilon: float = 1e-6,
                 **kwargs):
        # Keras does not check `axis` and fails later with an unrelated message.
        axes = axis if isinstance(axis, (list, tuple)) else [axis]
        if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
            raise TypeError(
                f"`axis` must be an int or a non-empty list/tuple of ints, got {axis!r}.")
        super().__init__(axis=axis, epsilon=epsilon, **kwargs)

    @property
    def fused(self) -> bool:
        """Whether :meth:`call` runs the fused kernel (else Keras's code)."""
        return _last_axis(self.axis, self._input_rank) and not float32_alone(self)

    def build(self, input_shape):
        self._input_rank = len(input_shape)
        super().build(input_shape)

    def call(self, x):
        if not self.fused:
            return super().call(x)
        return kops.rms_norm(ops.cast(x, self.compute_dtype), self.scale,
                             epsilon=self.epsilon)


@keras.saving.register_keras_serializable(package="keras_mp")
class Softmax(keras.layers.Softmax):
    """``keras.layers.Softmax`` (with its optional mask) as one fused kernel each way.

    Fused for a single axis, masking done in float32 so a float16 input
    cannot overflow; a list of several axes runs as in Keras.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import Softmax
        >>> Softmax()(keras.ops.zeros((1, 4))).numpy().tolist()
        [[0.25, 0.25, 0.25, 0.25]]
    """

    @property
    def fused(self) -> bool:
        """Whether :meth:`call` runs the fused kernel (else Keras's code)."""
        axis = self.axis
        return (isinstance(axis, int) or (isinstance(axis, (list, tuple)) and len(axis) == 1)) \
            and not float32_alone(self)

    def call(self, inputs, mask=None):
        if not self.fused:
            return super().call(inputs, mask=mask)
        axis = self.axis if isinstance(self.axis, int) else self.axis[0]
        return kops.softmax(inputs, mask, axis=axis)


@keras.saving.register_keras_serializable(package="keras_mp")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """``keras.layers.MultiHeadAttention`` with the unmasked rank-3 case as
    :func:`keras_mp.fused.ops.multi_head_attention`: one XLA computation
    where :mod:`keras_mp.device.xla` compiles matmuls (GPU/TPU, CPUs without
    bfloat16 matmul hardware, where TensorFlow's bfloat16 einsums are
    emulated and ~30x slower than XLA's), else a graph of 2-D projections
    and unbroadcast batched matmuls that oneDNN runs (1.2x Keras's layer,
    forward and backward, on an AMX-BF16 Xeon).

    Fused where the call has no mask (explicit, causal or carried by the
    inputs), no attention scores returned and no active dropout, the
    projections compute in the layer's dtype (an adaptive policy may
    promote one alone) and the layer's policy is not float32 alone
    (:func:`float32_alone`); any other call runs Keras's code. Weights and
    config are Keras's own.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import MultiHeadAttention
        >>> layer = MultiHeadAttention(num_heads=2, key_dim=4)
        >>> x = keras.ops.ones((1, 3, 8))
        >>> layer(x, x).shape
        TensorShape([1, 3, 8])
    """

    def _fusable(self, query, value, key, masks, return_attention_scores, training,
                 use_causal_mask) -> bool:
        inputs = [t for t in (query, value, key) if t is not None]
        return (not float32_alone(self)
                and all(m is None for m in masks)
                and not return_attention_scores and not use_causal_mask
                and not (self._dropout > 0.0 and training)
                and all(len(t.shape) == 3 for t in inputs)
                and all(getattr(t, "_keras_mask", None) is None for t in inputs)
                and self._query_dense.equation == "abc,cde->abde"
                and self._key_dense.equation == "abc,cde->abde"
                and self._value_dense.equation == "abc,cde->abde"
                and self._output_dense.equation == "abcd,cde->abe"
                and self._attention_axes == (1,)
                # One dtype for the whole computation: a projection an adaptive
                # policy promoted alone runs in its own dtype, in Keras's code.
                and all(sub.compute_dtype == self.compute_dtype for sub in (
                    self._query_dense, self._key_dense, self._value_dense,
                    self._output_dense)))

    def call(self, query, value, key=None, query_mask=None, value_mask=None,
             key_mask=None, attention_mask=None, return_attention_scores=False,
             training=None, use_causal_mask=False):
        masks = (query_mask, value_mask, key_mask, attention_mask)
        if not self._fusable(query, value, key, masks, return_attention_scores, training,
                             use_causal_mask):
            return super().call(query, value, key=key, query_mask=query_mask,
                                value_mask=value_mask, key_mask=key_mask,
                                attention_mask=attention_mask,
                                return_attention_scores=return_attention_scores,
                                training=training, use_causal_mask=use_causal_mask)
        key = value if key is None else key
        weights = []
        for dense in (self._query_dense, self._key_dense, self._value_dense,
                      self._output_dense):
            weights += [dense.kernel, dense.bias if dense.bias_axes else None]
        dtype = self.compute_dtype
        return kops.multi_head_attention(
            ops.cast(query, dtype), ops.cast(key, dtype), ops.cast(value, dtype),
            weights, scale=float(self._inverse_sqrt_key_dim))


@keras.saving.register_keras_serializable(package="keras_mp")
class ReversibleEmbedding(keras.layers.ReversibleEmbedding):
    """``keras.layers.ReversibleEmbedding`` whose reverse projection (the
    logits of a language model with tied embeddings, KerasHub's GPT-2, Gemma,
    Llama...) runs in the layer's compute dtype.

    Keras keeps an embedding table in float32 inside ``call``
    (``autocast=False``, so a lookup casts only the rows it takes), and so
    under ``mixed_bfloat16`` the reverse projection meets bfloat16 inputs
    with the float32 table and runs as a float32 matmul: the step's three
    largest matmuls (forward, and both products of the backward) in float32
    and float32 logits as large again. Here the table is cast to the compute
    dtype first, as a ``Dense`` layer's kernel is, so those matmuls run in
    bfloat16 (or float16) with float32 accumulation, and the logits come out
    in the compute dtype, as every other layer's outputs do under mixed
    precision. The lookup, ``reverse_dtype``, a float32 compute dtype, LoRA
    and quantized tables run Keras's code. Measured on a 2-core AMD EPYC
    with AVX512-BF16 (GPT-2's ``[2048, 256] x [256, 50257]`` logits, TF graph,
    5 interleaved rounds, CPU time): forward 241 ms in float32 against 136
    ms in bfloat16, input-gradient product 245 against 179 ms.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import ReversibleEmbedding
        >>> layer = ReversibleEmbedding(10, 4, dtype="mixed_bfloat16")
        >>> layer(keras.ops.ones((2, 3), "int32")).dtype.name
        'bfloat16'
        >>> layer(keras.ops.ones((2, 4)), reverse=True).dtype.name, layer.fused
        ('bfloat16', True)
        >>> keras.layers.ReversibleEmbedding(10, 4, dtype="mixed_bfloat16")(
        ...     keras.ops.ones((2, 4)), reverse=True).dtype.name   # Keras's
        'float32'
    """

    @property
    def fused(self) -> bool:
        """Whether the reverse projection runs in the compute dtype (else Keras's code)."""
        return (self.reverse_dtype is None and not self.lora_enabled
                and not self.quantization_mode
                and self.compute_dtype in ("bfloat16", "float16"))

    def quantize(self, mode=None, type_check=True, config=None):
        # As Dense above: once quantized, Keras's own quantized call runs.
        super().quantize(mode, type_check=False, config=config)

    def call(self, inputs, reverse=False):
        if not reverse or not self.fused:
            return super().call(inputs, reverse=reverse)
        dtype = self.compute_dtype
        table = self.embeddings if self.tie_weights else self.reverse_embeddings
        kernel = ops.cast(table, dtype)
        logits = ops.matmul(ops.cast(inputs, dtype),
                            ops.transpose(kernel) if self.tie_weights else kernel)
        if self.logit_soft_cap is not None:
            cap = self.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits


FUSED_LAYERS: dict[type, type] = {
    keras.layers.Dense: Dense,
    keras.layers.LayerNormalization: LayerNormalization,
    keras.layers.BatchNormalization: BatchNormalization,
    keras.layers.RMSNormalization: RMSNormalization,
    keras.layers.Softmax: Softmax,
    keras.layers.MultiHeadAttention: MultiHeadAttention,
    keras.layers.ReversibleEmbedding: ReversibleEmbedding,
}
"""Keras layer class -> its fused drop-in (exact classes; see :func:`fused_class`)."""


def fused_class(cls: type) -> type | None:
    """The fused drop-in for layer class ``cls``, or None: for a class of
    :data:`FUSED_LAYERS`, or KerasHub's re-export of one (a KerasHub class
    that subclasses it and defines no method or property, as
    ``keras_hub.layers.ReversibleEmbedding`` does). Other subclasses, a
    user's included, are left alone.

    Example:
        >>> import keras
        >>> from keras_mp.fused.layers import fused_class
        >>> class Mine(keras.layers.LayerNormalization):
        ...     pass
        >>> fused_class(keras.layers.LayerNormalization).__name__, fused_class(Mine)
        ('LayerNormalization', None)
    """
    if not isinstance(cls, type):
        raise TypeError(f"`cls` must be a layer class, got {cls!r}.")
    if cls in FUSED_LAYERS:
        return FUSED_LAYERS[cls]
    if not cls.__module__.startswith("keras_hub.") or len(cls.__bases__) != 1:
        return None
    own = [k for k, v in vars(cls).items()   # methods or properties of its own
           if callable(v) or isinstance(v, (property, staticmethod, classmethod))]
    return None if own else FUSED_LAYERS.get(cls.__bases__[0])
