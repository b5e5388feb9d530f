"""Fused elementwise and reducing ops, each beside its plain ``keras.ops`` reference.

In mixed-precision training the matmuls get fast in 16 bits, and what is left
is the work around them: bias, activation, normalization, softmax, the loss.
As separate TensorFlow ops each of them reads and writes the whole activation
tensor, and bfloat16 elementwise kernels on CPU are slower than float32 ones
(bias+GELU fwd+bwd on 32x128x2048: 79 ms in bf16 against 48 ms in float32,
``python -m benchmarks.fused_bias_gelu``). Here each op's forward and its backward
are one XLA computation each, with float32 math inside and 16-bit tensors
only at the edges (25 ms for the same bias+GELU).

Every fused op:

* returns its result in the dtype of its main input (``x`` or ``logits``);
  parameter gradients come back in each parameter's own dtype;
* computes in float32 whatever the input dtype (statistics included);
* is XLA-compiled where :func:`keras_mp.device.xla.uses_xla` says so for
  ``"elementwise"`` work, and otherwise runs its ``*_reference`` twin, which
  is what Keras itself computes (in the input dtype).

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from keras_mp import ops as kops
    >>> x = tf.constant(np.linspace(-2, 2, 8).reshape(2, 4), tf.bfloat16)
    >>> y = kops.bias_activation(x, tf.zeros([4]), "relu")
    >>> y.dtype.name, y.shape
    ('bfloat16', TensorShape([2, 4]))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import keras
import tensorflow as tf
from keras import ops

from keras_mp.device import xla

__all__ = [
    "ACTIVATIONS",
    "bias_activation",
    "bias_activation_reference",
    "dense_activation",
    "dense_activation_reference",
    "multi_head_attention",
    "multi_head_attention_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "softmax",
    "softmax_reference",
    "sparse_softmax_cross_entropy",
    "sparse_softmax_cross_entropy_reference",
]

ACTIVATIONS: tuple[str, ...] = ("linear", "relu", "gelu", "silu", "tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# Masked logits get this value in float32, where it cannot overflow; Keras
# must pick -3e4 for float16 because it masks in the input dtype.
_MASK_VALUE = -1e9


def _check_activation(activation: str | None, approximate: bool) -> str:
    name = "linear" if activation is None else activation
    if name == "swish":  # Keras's other name for silu
        name = "silu"
    if name not in ACTIVATIONS:
        raise ValueError(
            f"`activation` must be one of {ACTIVATIONS} (or 'swish', None), "
            f"got {activation!r}.")
    if not isinstance(approximate, bool):
        raise TypeError(f"`approximate` must be True or False, got {approximate!r}.")
    if name == "gelu" and approximate:
        return "gelu_tanh"
    return name


def _float(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(x, tf.float32)


def _fused_enabled() -> bool:
    return xla.uses_xla("elementwise")


# --------------------------------------------------------------------------
# bias + activation


def _act_forward(z: tf.Tensor, act: str) -> tf.Tensor:
    if act == "linear":
        return z
    if act == "relu":
        return tf.maximum(z, 0.0)
    if act == "gelu":
        return 0.5 * z * (1.0 + tf.math.erf(z * _INV_SQRT_2))
    if act == "gelu_tanh":
        return 0.5 * z * (1.0 + tf.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)))
    if act == "silu":
        return z * tf.sigmoid(z)
    return tf.tanh(z)


def _act_derivative(z: tf.Tensor, act: str) -> tf.Tensor:
    if act == "linear":
        return tf.ones_like(z)
    if act == "relu":
        return tf.cast(z > 0.0, tf.float32)
    if act == "gelu":
        return (0.5 * (1.0 + tf.math.erf(z * _INV_SQRT_2))
                + z * _INV_SQRT_2PI * tf.exp(-0.5 * z * z))
    if act == "gelu_tanh":
        z2 = z * z
        t = tf.tanh(_SQRT_2_OVER_PI * z * (1.0 + 0.044715 * z2))
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * 0.044715 * z2)
    if act == "silu":
        s = tf.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    t = tf.tanh(z)
    return 1.0 - t * t


def _column_sum(t: tf.Tensor) -> tf.Tensor:
    """Sums a float32 tensor over every axis but the last (a bias gradient).

    Written as ``ones @ t`` because XLA:CPU emits a column reduction as a
    strided scalar loop (~40 ms for 32x128x2048 floats, 10x the elementwise
    work around it), while a dot goes to its vectorised GEMV. On GPU both
    are fast.
    """
    rows = tf.reshape(t, [-1, tf.shape(t)[-1]])
    ones = tf.ones([1, tf.shape(rows)[0]], t.dtype)
    return tf.reshape(tf.matmul(ones, rows), [-1])


@xla.jit("elementwise")
def _bias_act_fwd(x, bias, act):
    return tf.cast(_act_forward(_float(x) + _float(bias), act), x.dtype)


@xla.jit("elementwise")
def _bias_act_bwd(dy, x, bias, act):
    # Recomputing x + bias here costs less than storing it: the sum is one
    # fused add, storing it is a full extra activation tensor in memory.
    dx = tf.cast(_float(dy) * _act_derivative(_float(x) + _float(bias), act), x.dtype)
    # The bias gradient sums the rounded dx (as Keras does, but accumulating
    # in float32): fed the float32 product, XLA:CPU recomputes the whole
    # activation derivative for the sum, 2x slower for no useful precision.
    return dx, tf.cast(_column_sum(_float(dx)), bias.dtype)


def bias_activation(x, bias=None, activation: str | None = "gelu", *,
                    approximate: bool = False) -> tf.Tensor:
    """``activation(x + bias)`` as one fused kernel forward and one backward.

    Args:
        x: a float tensor of rank >= 1 (float32, bfloat16 or float16).
        bias: a vector of length ``x.shape[-1]`` (any float dtype; its
            gradient comes back in its dtype), or None for no bias.
        activation: one of ``"linear"``, ``"relu"``, ``"gelu"``, ``"silu"``
            (alias ``"swish"``), ``"tanh"``, or None (linear).
        approximate: for ``"gelu"`` only: the tanh approximation when True,
            the exact erf form when False, as
            ``keras.activations.gelu(x, approximate=...)`` (whose default,
            and that of ``activation="gelu"`` in Keras layers, is False).

    Returns:
        A tensor shaped and typed like ``x``.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> y = kops.bias_activation(tf.constant([[-1.0, 2.0]]), tf.constant([1.0, 1.0]), "relu")
        >>> y.numpy().tolist()
        [[0.0, 3.0]]
    """
    act = _check_activation(activation, approximate)
    x = tf.convert_to_tensor(x)
    bias_given = bias is not None
    bias = tf.convert_to_tensor(bias) if bias_given else tf.zeros(x.shape[-1:], x.dtype)
    _check_vector("bias", bias, x)
    if not _fused_enabled():
        return bias_activation_reference(x, bias, activation, approximate=approximate)

    @tf.custom_gradient
    def fused(x, bias):
        def grad(dy):
            return _bias_act_bwd(dy, x, bias, act)

        return _bias_act_fwd(x, bias, act), grad

    return fused(x, bias)


def bias_activation_reference(x, bias=None, activation: str | None = "gelu", *,
                              approximate: bool = False) -> tf.Tensor:
    """What Keras computes for ``activation(x + bias)``, in ``x``'s dtype.

    Args:
        x, bias, activation, approximate: as for :func:`bias_activation`.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> kops.bias_activation_reference(tf.constant([-1.0, 1.0]), None, "relu").numpy().tolist()
        [0.0, 1.0]
    """
    act = _check_activation(activation, approximate)
    x = tf.convert_to_tensor(x)
    if bias is not None:
        x = ops.add(x, ops.cast(bias, x.dtype))
    if act == "linear":
        return x
    if act in ("gelu", "gelu_tanh"):
        return keras.activations.gelu(x, approximate=act == "gelu_tanh")
    return keras.activations.get(act)(x)


def _check_vector(name: str, v: tf.Tensor, x: tf.Tensor) -> None:
    if v.shape.rank != 1 or (x.shape[-1] is not None and v.shape[0] != x.shape[-1]):
        raise ValueError(
            f"`{name}` must be a vector of length x.shape[-1]={x.shape[-1]}, "
            f"got shape {v.shape}.")


# --------------------------------------------------------------------------
# matmul + bias + activation (Dense)


def _matmul_last(x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    """``x @ kernel`` over ``x``'s last axis, any rank of ``x``."""
    rows = tf.reshape(x, [-1, tf.shape(x)[-1]])
    out = tf.matmul(rows, tf.cast(kernel, x.dtype))
    return tf.reshape(out, tf.concat([tf.shape(x)[:-1], tf.shape(kernel)[-1:]], 0))


@xla.jit("matmul")
def _dense_fwd(x, kernel, bias, act):
    z = _float(_matmul_last(x, kernel))
    if bias is not None:
        z = z + _float(bias)
    # The pre-activation is kept in x's dtype for the backward (as Keras
    # keeps it): letting TensorFlow differentiate this function instead
    # would save float32 intermediates, ~2x the activation memory.
    return tf.cast(_act_forward(z, act), x.dtype), tf.cast(z, x.dtype)


@xla.jit("matmul")
def _dense_bwd(dy, x, kernel, z, has_bias, act):
    g = tf.cast(_float(dy) * _act_derivative(_float(z), act), x.dtype)
    rows_x = tf.reshape(x, [-1, tf.shape(x)[-1]])
    rows_g = tf.reshape(g, [-1, tf.shape(g)[-1]])
    k = tf.cast(kernel, x.dtype)
    dx = tf.reshape(tf.matmul(rows_g, k, transpose_b=True), tf.shape(x))
    dk = tf.cast(tf.matmul(rows_x, rows_g, transpose_a=True), kernel.dtype)
    db = _column_sum(_float(g)) if has_bias else None
    return dx, dk, db


def _dense_xla(x, kernel, bias, act):
    """The whole Dense as one XLA computation each way."""
    if bias is None:
        @tf.custom_gradient
        def fused(x, kernel):
            y, z = _dense_fwd(x, kernel, None, act)

            def grad(dy):
                dx, dk, _ = _dense_bwd(dy, x, kernel, z, False, act)
                return dx, dk

            return y, grad

        return fused(x, kernel)

    @tf.custom_gradient
    def fused_bias(x, kernel, bias):
        y, z = _dense_fwd(x, kernel, bias, act)

        def grad(dy):
            dx, dk, db = _dense_bwd(dy, x, kernel, z, True, act)
            return dx, dk, tf.cast(db, bias.dtype)

        return y, grad

    return fused_bias(x, kernel, bias)


def dense_activation(x, kernel, bias=None, activation: str | None = "linear", *,
                     approximate: bool = False) -> tf.Tensor:
    """``activation(x @ kernel + bias)``, placed by :mod:`keras_mp.device.xla`.

    Where matmuls run under XLA (GPU/TPU, and CPUs without bfloat16 matmul
    hardware) the whole expression is one XLA computation; elsewhere the
    matmul runs in TensorFlow (oneDNN, which uses AMX) and the epilogue is
    :func:`bias_activation`, or plain TensorFlow ops that TensorFlow fuses
    into the matmul where that is faster
    (:func:`keras_mp.device.xla.fuses_epilogue`).

    Args:
        x: float tensor, features on the last axis.
        kernel: ``[x.shape[-1], units]`` matrix (cast to ``x``'s dtype).
        bias, activation, approximate: as for :func:`bias_activation`.

    Returns:
        ``[..., units]`` in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> kops.dense_activation(tf.ones([2, 3]), tf.ones([3, 4]), None, "relu").shape
        TensorShape([2, 4])
    """
    act = _check_activation(activation, approximate)
    x = tf.convert_to_tensor(x)
    # Keras variables must enter the compiled function as tensors (read
    # under the layer's autocast scope, so already in the compute dtype).
    kernel = tf.convert_to_tensor(kernel)
    _check_kernel(kernel, x)
    bias = None if bias is None else tf.convert_to_tensor(bias)
    if bias is not None and (bias.shape.rank != 1 or bias.shape[0] != kernel.shape[-1]):
        raise ValueError(f"`bias` must be a vector of length kernel.shape[-1]="
                         f"{kernel.shape[-1]}, got shape {bias.shape}.")
    if xla.uses_xla("matmul"):
        return _dense_xla(x, kernel, bias, act)
    if not xla.fuses_epilogue(act):
        # TensorFlow's graph optimizer fuses MatMul + bias + activation into
        # one oneDNN call, faster than a separate XLA epilogue for these.
        return bias_activation_reference(tf.matmul(x, tf.cast(kernel, x.dtype)) if
                                          x.shape.rank == 2 else _matmul_last(x, kernel),
                                          bias, activation, approximate=approximate)
    return bias_activation(_matmul_last(x, kernel), bias, activation, approximate=approximate)


def _check_kernel(kernel: tf.Tensor, x: tf.Tensor) -> None:
    if kernel.shape.rank != 2 or (x.shape[-1] is not None and kernel.shape[0] != x.shape[-1]):
        raise ValueError(
            f"`kernel` must be a matrix with x.shape[-1]={x.shape[-1]} rows, "
            f"got shape {kernel.shape}.")


def dense_activation_reference(x, kernel, bias=None, activation: str | None = "linear", *,
                               approximate: bool = False) -> tf.Tensor:
    """What Keras's ``Dense`` computes: ``keras.ops.matmul`` then
    :func:`bias_activation_reference`, in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> kops.dense_activation_reference(tf.ones([1, 2]), tf.ones([2, 1])).numpy().tolist()
        [[2.0]]
    """
    x = tf.convert_to_tensor(x)
    kernel = tf.convert_to_tensor(kernel)
    _check_kernel(kernel, x)
    y = ops.matmul(x, ops.cast(kernel, x.dtype))
    return bias_activation_reference(y, bias, activation, approximate=approximate)


# --------------------------------------------------------------------------
# multi-head self/cross attention without masks (MultiHeadAttention's core)


def _project(x, kernel, bias, equation):
    y = tf.einsum(equation, x, tf.cast(kernel, x.dtype))
    return y if bias is None else y + tf.cast(bias, y.dtype)


@xla.jit("matmul")
def _attention_xla(query, key, value, weights, scale):
    q_k, q_b, k_k, k_b, v_k, v_b, o_k, o_b = weights
    q = _project(query, q_k, q_b, "abc,cde->abde") * tf.cast(scale, query.dtype)
    k = _project(key, k_k, k_b, "abc,cde->abde")
    v = _project(value, v_k, v_b, "abc,cde->abde")
    scores = tf.einsum("aecd,abcd->acbe", k, q)
    # Softmax statistics in float32 whatever the compute dtype.
    probs = tf.cast(tf.nn.softmax(_float(scores), axis=-1), query.dtype)
    context = tf.einsum("acbe,aecd->abcd", probs, v)
    return _project(context, o_k, o_b, "abcd,cde->abe")


def multi_head_attention(query, key, value, weights, *, scale: float) -> tf.Tensor:
    """Unmasked multi-head attention with its four projections, as
    ``keras.layers.MultiHeadAttention`` computes it for rank-3 inputs.

    Where matmuls run under XLA this is one XLA computation (the CPU case
    where it matters: TensorFlow's bfloat16 einsum kernels are emulated and
    ~30x slower than XLA's on CPUs without bfloat16 hardware); elsewhere it
    is :func:`multi_head_attention_reference`.

    Args:
        query: ``[batch, T, dim]``; key, value: ``[batch, S, dim]``.
        weights: the 8 tensors ``(query_kernel [dim, heads, key_dim],
            query_bias [heads, key_dim] or None, key_kernel, key_bias,
            value_kernel [dim, heads, value_dim], value_bias, output_kernel
            [heads, value_dim, out], output_bias [out] or None)``.
        scale: multiplies the projected query, usually ``key_dim**-0.5``.

    Returns:
        ``[batch, T, out]`` in ``query``'s dtype.
    """
    weights = _check_attention_weights(weights)
    query, key, value = (tf.convert_to_tensor(t) for t in (query, key, value))
    if xla.uses_xla("matmul"):
        return _attention_xla(query, key, value, weights, float(scale))
    return multi_head_attention_reference(query, key, value, weights, scale=scale)


def _check_attention_weights(weights) -> tuple:
    weights = tuple(None if w is None else tf.convert_to_tensor(w) for w in weights)
    if len(weights) != 8 or any(weights[i] is None for i in (0, 2, 4, 6)):
        raise ValueError(
            "`weights` must hold 8 entries: query, key, value and output kernels "
            "(tensors) each followed by its bias (tensor or None), got "
            f"{len(weights)} entries.")
    return weights


def multi_head_attention_reference(query, key, value, weights, *, scale: float) -> tf.Tensor:
    """:func:`multi_head_attention` in plain ``keras.ops``, in ``query``'s dtype."""
    q_k, q_b, k_k, k_b, v_k, v_b, o_k, o_b = _check_attention_weights(weights)
    query = tf.convert_to_tensor(query)

    def project(x, kernel, bias, equation):
        y = ops.einsum(equation, x, ops.cast(kernel, x.dtype))
        return y if bias is None else y + ops.cast(bias, y.dtype)

    q = project(query, q_k, q_b, "abc,cde->abde") * ops.cast(scale, query.dtype)
    k = project(key, k_k, k_b, "abc,cde->abde")
    v = project(value, v_k, v_b, "abc,cde->abde")
    probs = ops.softmax(ops.einsum("aecd,abcd->acbe", k, q), axis=-1)
    return project(ops.einsum("acbe,aecd->abcd", probs, v), o_k, o_b, "abcd,cde->abe")


# --------------------------------------------------------------------------
# layer normalization and RMS normalization (over the last axis)


@xla.jit("elementwise")
def _layer_norm_fwd(x, gamma, beta, epsilon):
    x32 = _float(x)
    mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
    xhat = (x32 - mean) * tf.math.rsqrt(var + epsilon)
    return tf.cast(xhat * _float(gamma) + _float(beta), x.dtype)


@xla.jit("elementwise")
def _layer_norm_bwd(dy, x, gamma, beta, epsilon):
    # Statistics are recomputed rather than saved: a reduction over the last
    # axis is cheap next to keeping two extra float32 tensors alive.
    x32 = _float(x)
    mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
    rstd = tf.math.rsqrt(var + epsilon)
    xhat = (x32 - mean) * rstd
    dy32 = _float(dy)
    g = dy32 * _float(gamma)
    dx = rstd * (g - tf.reduce_mean(g, -1, keepdims=True)
                 - xhat * tf.reduce_mean(g * xhat, -1, keepdims=True))
    return (tf.cast(dx, x.dtype),
            tf.cast(_column_sum(dy32 * xhat), gamma.dtype),
            tf.cast(_column_sum(dy32), beta.dtype))


def layer_norm(x, gamma=None, beta=None, *, epsilon: float = 1e-3) -> tf.Tensor:
    """Layer normalization over the last axis, statistics in float32.

    Args:
        x: a float tensor of rank >= 1.
        gamma: scale vector of length ``x.shape[-1]``, or None (ones).
        beta: offset vector of length ``x.shape[-1]``, or None (zeros).
        epsilon: added to the variance; > 0. Keras's default, 1e-3.

    Returns:
        ``(x - mean) / sqrt(var + epsilon) * gamma + beta`` in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> y = kops.layer_norm(tf.constant([[1.0, 3.0]]), epsilon=1e-6)
        >>> [round(v, 3) for v in y.numpy()[0].tolist()]
        [-1.0, 1.0]
    """
    x = tf.convert_to_tensor(x)
    _check_epsilon(epsilon)
    gamma = tf.ones(x.shape[-1:], tf.float32) if gamma is None else tf.convert_to_tensor(gamma)
    beta = tf.zeros(x.shape[-1:], tf.float32) if beta is None else tf.convert_to_tensor(beta)
    _check_vector("gamma", gamma, x)
    _check_vector("beta", beta, x)
    if not _fused_enabled():
        return layer_norm_reference(x, gamma, beta, epsilon=epsilon)
    eps = float(epsilon)

    @tf.custom_gradient
    def fused(x, gamma, beta):
        def grad(dy):
            return _layer_norm_bwd(dy, x, gamma, beta, eps)

        return _layer_norm_fwd(x, gamma, beta, eps), grad

    return fused(x, gamma, beta)


def layer_norm_reference(x, gamma=None, beta=None, *, epsilon: float = 1e-3) -> tf.Tensor:
    """``keras.ops.layer_normalization`` over the last axis (what Keras's
    ``LayerNormalization`` computes).

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> y = kops.layer_norm_reference(tf.constant([[1.0, 3.0]]), epsilon=1e-6)
        >>> [round(v, 3) for v in y.numpy()[0].tolist()]
        [-1.0, 1.0]
    """
    _check_epsilon(epsilon)
    return ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)


@xla.jit("elementwise")
def _rms_norm_fwd(x, scale, epsilon):
    x32 = _float(x)
    r = tf.math.rsqrt(tf.reduce_mean(x32 * x32, -1, keepdims=True) + epsilon)
    return tf.cast(x32 * r * _float(scale), x.dtype)


@xla.jit("elementwise")
def _rms_norm_bwd(dy, x, scale, epsilon):
    x32 = _float(x)
    r = tf.math.rsqrt(tf.reduce_mean(x32 * x32, -1, keepdims=True) + epsilon)
    xhat = x32 * r
    dy32 = _float(dy)
    g = dy32 * _float(scale)
    dx = r * (g - xhat * tf.reduce_mean(g * xhat, -1, keepdims=True))
    return (tf.cast(dx, x.dtype),
            tf.cast(_column_sum(dy32 * xhat), scale.dtype))


def rms_norm(x, scale=None, *, epsilon: float = 1e-6) -> tf.Tensor:
    """RMS normalization over the last axis, statistics in float32.

    Args:
        x: a float tensor of rank >= 1.
        scale: vector of length ``x.shape[-1]``, or None (ones).
        epsilon: added to the mean square; > 0. Keras's default, 1e-6.

    Returns:
        ``x / sqrt(mean(x**2) + epsilon) * scale`` in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> y = kops.rms_norm(tf.constant([[3.0, 4.0]]), epsilon=1e-12)
        >>> [round(v, 3) for v in y.numpy()[0].tolist()]
        [0.849, 1.131]
    """
    x = tf.convert_to_tensor(x)
    _check_epsilon(epsilon)
    scale = tf.ones(x.shape[-1:], tf.float32) if scale is None else tf.convert_to_tensor(scale)
    _check_vector("scale", scale, x)
    if not _fused_enabled():
        return rms_norm_reference(x, scale, epsilon=epsilon)
    eps = float(epsilon)

    @tf.custom_gradient
    def fused(x, scale):
        def grad(dy):
            return _rms_norm_bwd(dy, x, scale, eps)

        return _rms_norm_fwd(x, scale, eps), grad

    return fused(x, scale)


def rms_norm_reference(x, scale=None, *, epsilon: float = 1e-6) -> tf.Tensor:
    """``keras.ops.rms_normalization`` over the last axis (what Keras's
    ``RMSNormalization`` computes).

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> y = kops.rms_norm_reference(tf.constant([[3.0, 4.0]]), epsilon=1e-12)
        >>> [round(v, 3) for v in y.numpy()[0].tolist()]
        [0.849, 1.131]
    """
    _check_epsilon(epsilon)
    x = tf.convert_to_tensor(x)
    if scale is not None:
        scale = ops.cast(scale, x.dtype)
    return ops.rms_normalization(x, scale=scale, axis=-1, epsilon=epsilon)


def _check_epsilon(epsilon: float) -> None:
    if not isinstance(epsilon, (int, float)) or not epsilon > 0:
        raise ValueError(f"`epsilon` must be a number > 0, got {epsilon!r}.")


# --------------------------------------------------------------------------
# softmax with an optional mask


@xla.jit("elementwise")
def _softmax_fwd(x, mask, axis):
    x32 = _float(x)
    if mask is not None:
        x32 = tf.where(mask, x32, _MASK_VALUE)
    y = tf.nn.softmax(x32, axis=axis)
    if mask is not None:
        # A fully masked row would otherwise come out uniform.
        y = tf.where(mask, y, 0.0)
    return tf.cast(y, x.dtype)


@xla.jit("elementwise")
def _softmax_bwd(dy, y, axis):
    y32 = _float(y)
    dy32 = _float(dy)
    dx = y32 * (dy32 - tf.reduce_sum(dy32 * y32, axis, keepdims=True))
    return tf.cast(dx, y.dtype)


def _as_bool_mask(mask, x: tf.Tensor) -> tf.Tensor | None:
    if mask is None:
        return None
    mask = tf.convert_to_tensor(mask)
    if mask.shape.rank is not None and mask.shape.rank > x.shape.rank:
        raise ValueError(
            f"`mask` must be broadcastable to x (shape {x.shape}) and have no "
            f"more dimensions, got shape {mask.shape}.")
    if mask.dtype != tf.bool:
        mask = mask > tf.cast(0.5, mask.dtype)  # Keras's rule: keep > 0.5
    return tf.broadcast_to(mask, tf.shape(x))


def _check_axis(axis: int, x: tf.Tensor) -> None:
    if (isinstance(axis, bool) or not isinstance(axis, int)
            or not -x.shape.rank <= axis < x.shape.rank):
        raise ValueError(
            f"`axis` must be an int in [{-x.shape.rank}, {x.shape.rank}), got {axis!r}.")


def softmax(x, mask=None, *, axis: int = -1) -> tf.Tensor:
    """Softmax along ``axis`` with an optional mask, computed in float32.

    Masking is applied in float32, so the masked value cannot overflow in
    float16 (Keras, masking in the input dtype, must use -3e4 there).

    Args:
        x: float logits.
        mask: None, or a tensor broadcastable to ``x`` with no more
            dimensions: bool (True keeps), or numeric (> 0.5 keeps).
            Masked positions, and rows that are fully masked, output 0.
        axis: the (single) axis to normalize over.

    Returns:
        Probabilities in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> kops.softmax(tf.constant([[0.0, 0.0, 5.0]]), tf.constant([[True, True, False]])).numpy().tolist()
        [[0.5, 0.5, 0.0]]
    """
    x = tf.convert_to_tensor(x)
    _check_axis(axis, x)
    bool_mask = _as_bool_mask(mask, x)
    if not _fused_enabled():
        return softmax_reference(x, mask, axis=axis)

    @tf.custom_gradient
    def fused(x):
        y = _softmax_fwd(x, bool_mask, axis)

        def grad(dy):
            return _softmax_bwd(dy, y, axis)

        return y, grad

    return fused(x)


def softmax_reference(x, mask=None, *, axis: int = -1) -> tf.Tensor:
    """What ``keras.layers.Softmax(axis)(x, mask)`` computes, in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> kops.softmax_reference(tf.constant([[0.0, 0.0]])).numpy().tolist()
        [[0.5, 0.5]]
    """
    x = tf.convert_to_tensor(x)
    _check_axis(axis, x)
    bool_mask = _as_bool_mask(mask, x)
    if bool_mask is None:
        return ops.softmax(x, axis=axis)
    neg = -3e4 if x.dtype == tf.float16 else _MASK_VALUE
    y = ops.softmax(ops.where(bool_mask, x, ops.cast(neg, x.dtype)), axis=axis)
    return ops.where(bool_mask, y, ops.zeros_like(y))


# --------------------------------------------------------------------------
# sparse softmax cross-entropy from logits


def _ce_parts(labels, logits):
    z = _float(logits)
    classes = tf.shape(z)[-1]
    labels = tf.cast(labels, tf.int32)
    valid = (labels >= 0) & (labels < classes)
    onehot = tf.one_hot(labels, classes, dtype=tf.float32)
    return z, onehot, valid


@xla.jit("elementwise")
def _ce_fwd(labels, logits):
    z, onehot, valid = _ce_parts(labels, logits)
    # A select, not z * onehot: a -inf logit of another class (a masked
    # vocabulary entry) times 0 would make the loss nan.
    picked = tf.reduce_sum(tf.where(onehot > 0.0, z, 0.0), -1)
    loss = tf.reduce_logsumexp(z, -1) - picked
    # An out-of-range label is a bug in the data; NaN makes it visible (and
    # trips the loss scaler's finite check) instead of a plausible loss.
    return tf.cast(tf.where(valid, loss, float("nan")), logits.dtype)


@xla.jit("elementwise")
def _ce_bwd(dloss, labels, logits):
    z, onehot, valid = _ce_parts(labels, logits)
    g = (tf.nn.softmax(z, -1) - onehot) * _float(dloss)[..., None]
    g = tf.where(valid[..., None], g, float("nan"))
    return tf.cast(g, logits.dtype)


def sparse_softmax_cross_entropy(labels, logits) -> tf.Tensor:
    """Per-example ``-log softmax(logits)[label]``, in float32 inside.

    Args:
        labels: integer class ids, shaped ``logits.shape[:-1]``. A label
            outside ``[0, classes)`` gives a NaN loss (and NaN gradient).
        logits: float logits, classes on the last axis.

    Returns:
        The loss per example, shaped like ``labels``, in ``logits``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> l = kops.sparse_softmax_cross_entropy(tf.constant([0]), tf.constant([[0.0, 0.0]]))
        >>> round(float(l[0]), 4)
        0.6931
    """
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    _check_labels(labels, logits)
    if not _fused_enabled():
        return sparse_softmax_cross_entropy_reference(labels, logits)

    @tf.custom_gradient
    def fused(logits):
        def grad(dloss):
            return _ce_bwd(dloss, labels, logits)

        return _ce_fwd(labels, logits), grad

    return fused(logits)


def sparse_softmax_cross_entropy_reference(labels, logits) -> tf.Tensor:
    """``keras.ops.sparse_categorical_crossentropy(..., from_logits=True)``.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp import ops as kops
        >>> l = kops.sparse_softmax_cross_entropy_reference(tf.constant([0]), tf.constant([[0.0, 0.0]]))
        >>> round(float(l[0]), 4)
        0.6931
    """
    logits = tf.convert_to_tensor(logits)
    labels = tf.convert_to_tensor(labels)
    _check_labels(labels, logits)
    return ops.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def _check_labels(labels: tf.Tensor, logits: tf.Tensor) -> None:
    if not labels.dtype.is_integer:
        raise TypeError(f"`labels` must be integer class ids, got dtype {labels.dtype.name}.")
    if (labels.shape.rank is not None and logits.shape.rank is not None
            and labels.shape.rank != logits.shape.rank - 1):
        raise ValueError(
            f"`labels` must have shape logits.shape[:-1]={logits.shape[:-1]}, "
            f"got {labels.shape}.")


_FUSED: dict[str, tuple[Callable, ...]] = {
    "bias_activation": (_bias_act_fwd, _bias_act_bwd),
    "layer_norm": (_layer_norm_fwd, _layer_norm_bwd),
    "rms_norm": (_rms_norm_fwd, _rms_norm_bwd),
    "softmax": (_softmax_fwd, _softmax_bwd),
    "sparse_softmax_cross_entropy": (_ce_fwd, _ce_bwd),
}
"""op name -> its (forward, backward) kernels; each has ``.compiled`` and
``.plain`` variants (see :func:`keras_mp.device.xla.jit`), for tests and tooling."""
