"""Unmasked multi-head attention with its projections (``MultiHeadAttention``'s core)."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops._common import _float

__all__ = ["multi_head_attention", "multi_head_attention_reference"]




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
