"""Unmasked multi-head attention with its projections (``MultiHeadAttention``'s core).

Two forms, placed by :mod:`keras_mp.device.xla`: one XLA computation where
matmuls run under XLA, and a TensorFlow graph of plain matmuls where they do
not (CPUs with bfloat16 matmul units, whose oneDNN matmuls use them). Keras
computes each projection as an einsum over a ``[batch, T, dim]`` input and
a ``[dim, heads, key_dim]`` kernel; TensorFlow runs it as a matmul batched
over ``batch`` with the kernel broadcast, so the kernel's gradient is
``batch`` products summed afterwards, and the scores and context einsums
run as oneDNN einsums. The graph form projects the ``batch * T`` rows with
one 2-D matmul each, lays the heads out once (``[batch, heads, T, key_dim]``)
and takes the scores and context as unbroadcast batched matmuls; the
softmax is Keras's (float32, scale applied in float32), so with
TensorFlow's softmax the outputs are Keras's bit for bit, and with the XLA
softmax kernel (:func:`_scaled_softmax`) within a float32 rounding of the
probabilities. Measured on the 2-core Intel Xeon with AMX-BF16 (batch 32,
T=128, dim 512, 8 heads, forward and backward as one graph, TensorFlow's
softmax, 7 interleaved rounds, process CPU time): 88.7 ms against Keras's
106.5 under ``mixed_bfloat16``, 234.9 against 286.2 in float32.
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.device import xla
from keras_mp.fused.ops import masked_softmax
from keras_mp.fused.ops._common import _float, _fused_enabled

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


def _project_rows(x, kernel, bias):
    """``x [..., dim]`` times ``kernel [dim, ...]`` made a matrix, as
    one 2-D matmul over ``x``'s rows, plus the bias: ``[rows, units]``.

    The bias is added, not ``tf.nn.bias_add``'ed: TensorFlow's
    ``BiasAddGrad`` sums a bfloat16 gradient in bfloat16 (the query and
    value biases' gradients of the layer measured above: relative error
    0.07-0.21 against float32, where Keras's layer, which adds, has
    0.003-0.007), while the ``Sum`` that differentiates an add accumulates
    in float32."""
    rows = tf.reshape(x, [-1, tf.shape(x)[-1]])
    matrix = tf.reshape(tf.cast(kernel, x.dtype), [kernel.shape[0], -1])
    y = tf.matmul(rows, matrix)
    return y if bias is None else y + tf.reshape(tf.cast(bias, y.dtype), [-1])


def _heads(rows, batch, length, heads: int, dim: int):
    """``[batch * length, heads * dim]`` to ``[batch, heads, length, dim]``."""
    return tf.transpose(tf.reshape(rows, [batch, length, heads, dim]), [0, 2, 1, 3])


def _scaled_softmax(scores, scale: float):
    """``softmax(float32(scores) * scale)`` in ``scores``' dtype, as
    ``keras.ops.dot_product_attention`` normalizes its scores: the kernels
    of :func:`keras_mp.fused.ops.softmax`, scale first, one XLA kernel each
    way where elementwise work is compiled (12.0 against 18.8
    ms of CPU time, forward and backward, for ``[32, 8, 128, 128]``
    bfloat16 scores on the AMX-BF16 Xeon: TensorFlow runs the two casts, the
    scale and the softmax's gradient as seven passes), else TensorFlow's
    ops."""
    if not _fused_enabled():
        return tf.cast(tf.nn.softmax(_float(scores) * scale, axis=-1), scores.dtype)

    @tf.custom_gradient
    def fused(scores):
        y = masked_softmax._softmax_fwd(scores, None, -1, scale)  # noqa: SLF001

        def grad(dy):
            return masked_softmax._softmax_bwd(dy, y, -1, scale)  # noqa: SLF001

        return y, grad

    return fused(scores)


def _attention_graph(query, key, value, weights, scale):
    q_k, q_b, k_k, k_b, v_k, v_b, o_k, o_b = weights
    heads, key_dim, value_dim = q_k.shape[1], q_k.shape[2], v_k.shape[2]
    batch, t, s = tf.shape(query)[0], tf.shape(query)[1], tf.shape(key)[1]
    q = _heads(_project_rows(query, q_k, q_b), batch, t, heads, key_dim)
    k = _heads(_project_rows(key, k_k, k_b), batch, s, heads, key_dim)
    v = _heads(_project_rows(value, v_k, v_b), batch, s, heads, value_dim)
    # As keras.ops.dot_product_attention: scores in the compute dtype, then
    # scaled and normalized in float32.
    probs = _scaled_softmax(tf.matmul(q, k, transpose_b=True), scale)
    context = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]),
                         [batch * t, heads * value_dim])
    out = _project_rows(context, tf.reshape(o_k, [heads * value_dim, o_k.shape[-1]]), o_b)
    return tf.reshape(out, [batch, t, o_k.shape[-1]])


def multi_head_attention(query, key, value, weights, *, scale: float) -> tf.Tensor:
    """Unmasked multi-head attention with its four projections, as
    ``keras.layers.MultiHeadAttention`` computes it for rank-3 inputs.

    Where matmuls run under XLA this is one XLA computation (the CPU case
    where it matters: TensorFlow's bfloat16 einsum kernels are emulated and
    ~30x slower than XLA's on CPUs without bfloat16 hardware); elsewhere a
    TensorFlow graph of 2-D projections and unbroadcast batched matmuls
    (the module's docstring), its softmax in float32 as Keras's.

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
    return _attention_graph(query, key, value, weights, float(scale))


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
