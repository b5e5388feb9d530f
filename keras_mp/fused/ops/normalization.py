"""Layer normalization and RMS normalization over the last axis, statistics in float32."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _check_vector, _column_sum, _float, _fused_enabled

__all__ = ["layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference"]




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
        >>> from keras_mp.fused import ops as kops
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
        >>> from keras_mp.fused import ops as kops
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
        >>> from keras_mp.fused import ops as kops
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
        >>> from keras_mp.fused import ops as kops
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
