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

One module per op family: :mod:`~keras_mp.fused.ops.activation` (bias +
activation), :mod:`~keras_mp.fused.ops.dense`, :mod:`~keras_mp.fused.ops.attention`,
:mod:`~keras_mp.fused.ops.normalization`, :mod:`~keras_mp.fused.ops.batch_normalization`
(TensorFlow's fused kernel, not XLA), :mod:`~keras_mp.fused.ops.masked_softmax`,
:mod:`~keras_mp.fused.ops.cross_entropy`, :mod:`~keras_mp.fused.ops.accuracy`; every op is
re-exported here.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from keras_mp.fused import ops as kops
    >>> x = tf.constant(np.linspace(-2, 2, 8).reshape(2, 4), tf.bfloat16)
    >>> y = kops.bias_activation(x, tf.zeros([4]), "relu")
    >>> y.dtype.name, y.shape
    ('bfloat16', TensorShape([2, 4]))
"""

from __future__ import annotations

from collections.abc import Callable

from keras_mp.fused.ops import (accuracy, activation, attention, batch_normalization,
                                cross_entropy, dense, masked_softmax, normalization)
from keras_mp.fused.ops.accuracy import sparse_top1_matches, sparse_top1_matches_reference
from keras_mp.fused.ops.activation import ACTIVATIONS, bias_activation, bias_activation_reference
from keras_mp.fused.ops.attention import multi_head_attention, multi_head_attention_reference
from keras_mp.fused.ops.batch_normalization import batch_norm, batch_norm_reference
from keras_mp.fused.ops.cross_entropy import (sparse_softmax_cross_entropy,
                                              sparse_softmax_cross_entropy_reference)
from keras_mp.fused.ops.dense import dense_activation, dense_activation_reference
from keras_mp.fused.ops.normalization import (layer_norm, layer_norm_reference, rms_norm,
                                              rms_norm_reference)
from keras_mp.fused.ops.masked_softmax import softmax, softmax_reference

__all__ = [
    "ACTIVATIONS",
    "bias_activation",
    "bias_activation_reference",
    "dense_activation",
    "dense_activation_reference",
    "multi_head_attention",
    "multi_head_attention_reference",
    "batch_norm",
    "batch_norm_reference",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "softmax",
    "softmax_reference",
    "sparse_softmax_cross_entropy",
    "sparse_softmax_cross_entropy_reference",
    "sparse_top1_matches",
    "sparse_top1_matches_reference",
]

_FUSED: dict[str, tuple[Callable, ...]] = {
    "bias_activation": (activation._bias_act_fwd, activation._bias_act_bwd),
    "layer_norm": (normalization._layer_norm_fwd, normalization._layer_norm_bwd),
    "rms_norm": (normalization._rms_norm_fwd, normalization._rms_norm_bwd),
    "softmax": (masked_softmax._softmax_fwd, masked_softmax._softmax_bwd),
    "sparse_softmax_cross_entropy": (cross_entropy._ce_fwd, cross_entropy._ce_bwd),
}
"""op name -> its (forward, backward) kernels; each has ``.compiled`` and
``.plain`` variants (see :func:`keras_mp.device.xla.jit`), for tests and tooling."""
