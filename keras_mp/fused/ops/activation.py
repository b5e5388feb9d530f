"""``activation(x + bias)``: the epilogue of a matmul as one XLA kernel each way.

The activation math (forward and derivative) is shared with
:mod:`keras_mp.fused.ops.dense`, which runs it inside the matmul's computation.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _check_vector, _column_sum, _float, _fused_enabled

__all__ = ["ACTIVATIONS", "bias_activation", "bias_activation_reference"]

ACTIVATIONS: tuple[str, ...] = ("linear", "relu", "gelu", "silu", "tanh")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


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
        >>> from keras_mp.fused import ops as kops
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
        >>> from keras_mp.fused import ops as kops
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
