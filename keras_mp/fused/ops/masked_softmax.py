"""Softmax with an optional mask, computed and masked in float32."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _float, _fused_enabled

__all__ = ["softmax", "softmax_reference"]

# Masked logits get this value in float32, where it cannot overflow; Keras
# must pick -3e4 for float16 because it masks in the input dtype.
_MASK_VALUE = -1e9




@xla.jit("elementwise")
def _softmax_fwd(x, mask, axis, scale):
    # ``scale``: the attention's scores scaled in float32 first
    # (keras_mp.fused.ops.attention), as keras.ops.dot_product_attention does.
    x32 = _float(x) if scale == 1.0 else _float(x) * scale
    if mask is not None:
        x32 = tf.where(mask, x32, _MASK_VALUE)
    y = tf.nn.softmax(x32, axis=axis)
    if mask is not None:
        # A fully masked row would otherwise come out uniform.
        y = tf.where(mask, y, 0.0)
    return tf.cast(y, x.dtype)


@xla.jit("elementwise")
def _softmax_bwd(dy, y, axis, scale):
    y32 = _float(y)
    dy32 = _float(dy)
    dx = y32 * (dy32 - tf.reduce_sum(dy32 * y32, axis, keepdims=True))
    return tf.cast(dx if scale == 1.0 else dx * scale, y.dtype)


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
        >>> from keras_mp.fused import ops as kops
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
        y = _softmax_fwd(x, bool_mask, axis, 1.0)

        def grad(dy):
            return _softmax_bwd(dy, y, axis, 1.0)

        return y, grad

    return fused(x)


def softmax_reference(x, mask=None, *, axis: int = -1) -> tf.Tensor:
    """What ``keras.layers.Softmax(axis)(x, mask)`` computes, in ``x``'s dtype.

    Example:
        >>> import tensorflow as tf
        >>> from keras_mp.fused import ops as kops
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
