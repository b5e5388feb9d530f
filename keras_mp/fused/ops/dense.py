"""``activation(x @ kernel + bias)`` (``Dense``), placed by :mod:`keras_mp.device.xla`."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _column_sum, _float
from keras_mp.fused.ops.activation import (_act_derivative, _act_forward, _check_activation,
                                           bias_activation, bias_activation_reference)

__all__ = ["dense_activation", "dense_activation_reference"]




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
        >>> from keras_mp.fused import ops as kops
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
        >>> from keras_mp.fused import ops as kops
        >>> kops.dense_activation_reference(tf.ones([1, 2]), tf.ones([2, 1])).numpy().tolist()
        [[2.0]]
    """
    x = tf.convert_to_tensor(x)
    kernel = tf.convert_to_tensor(kernel)
    _check_kernel(kernel, x)
    y = ops.matmul(x, ops.cast(kernel, x.dtype))
    return bias_activation_reference(y, bias, activation, approximate=approximate)
