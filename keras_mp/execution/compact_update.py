"""Adam and AdamW updates over bfloat16 moments, computed in float32.

Where an optimizer's moments are stored in bfloat16
(:mod:`keras_mp.adaptive.storage.moments`), Keras's ``Adam.update_step``
would still run: its arithmetic is float32 (a float32 gradient promotes the
bfloat16 moment), but each moment is written back rounded to nearest, and
Adam's second moment moves by ``(1 - beta_2) = 0.1 %`` of itself per step,
less than half a bfloat16 ulp (0.2-0.4 %): ``v * 0.999`` rounds back to
``v``, so it can grow but never decay. :func:`adam` computes the update as
TensorFlow's ``ResourceApplyAdam`` formula in float32 (dequantize, update,
requantize)::

    m32, v32 = float32(m), float32(v)
    m32 += (g - m32) * (1 - beta_1);  v32 += (g * g - v32) * (1 - beta_2)
    w   -= lr * sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t) * m32 / (sqrt(v32) + epsilon)
    m, v = nearest(m32), dithered(v32)

The first moment moves by ``1 - beta_1 = 10 %`` of its distance to the
gradient a step and is rounded to nearest. The second is written back with
**dithered rounding**: its 16 dropped bits are compared with a number in
``[0, 2**16)`` from a deterministic sequence of the element's index, the
step and the variable's index in the optimizer (a Weyl sequence: each
element's numbers run through all 65536 values, evenly spread, before one
repeats), so it is rounded up with the probability of its remainder and its
expected value is the float32 one (stochastic rounding, reproducible: a
seeded run repeats bit for bit, a resumed run continues the same sequence,
replicas agree). Measured with ``python -m benchmarks.compact_quality``
(1000 steps, held-out loss against Keras float32's): both moments dithered
with one sequence (the second's half a period on) ended 1.4 % and 2.1 %
above float32 on seeds 0 and 1, the first to nearest 0.3 % above and 0.1 %
below (docs/benchmarks.md). The function is XLA-compiled where elementwise
work is (:func:`keras_mp.device.xla.uses_xla`): one pass over the variable's
memory, as TensorFlow's fused kernel.

Measured (100M parameters in 4 variables, median of 5 updates, process CPU
time, 2-core AMD EPYC with AVX512-BF16 under load, TF 2.21): ``ResourceApplyAdam``
on float32 moments 0.098 s, Keras's ``update_step`` as TensorFlow ops 0.377 s,
this update as TensorFlow ops 0.705 s and XLA-compiled 0.171 s
(0.164 s with nearest rounding instead of dithered).

Example:
    >>> import numpy as np, tensorflow as tf
    >>> from keras_mp.execution import compact_update
    >>> x = tf.constant([1.0 + 2.0 ** -9] * 4096)      # half a bfloat16 ulp above 1
    >>> r = compact_update.dithered(x, compact_update.dither(x.shape, 0, 0, 0))
    >>> sorted(set(float(v) for v in r.numpy()))       # 1 or the next bfloat16 up
    [1.0, 1.0078125]
    >>> abs(float(tf.reduce_mean(tf.cast(r, tf.float32))) - (1.0 + 2.0 ** -9)) < 1e-4
    True
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_mp import _checks as checks
from keras_mp.device import xla

__all__ = ["MOMENT_DTYPE", "adam", "applies", "dither", "dithered"]

#: The dtype compact moments are stored in.
MOMENT_DTYPE = tf.bfloat16
_LOW = 0xFFFF
# Odd multipliers: each term runs through all 2**16 values (the step's at
# about the golden ratio of the period, so consecutive steps spread evenly).
_ELEMENT, _STEP, _VARIABLE = 20011, 25033, 131


def dither(shape, step, variable: int, salt: int) -> tf.Tensor:
    """Numbers in ``[0, 2**16)``, one per element of ``shape``, from the
    element's index, ``step`` and ``variable`` (int32 arithmetic that never
    overflows), shifted by ``salt`` (an int in ``[0, 2**16)``)."""
    checks.count("salt", salt, 0, _LOW)
    index = tf.reshape(tf.range(tf.reduce_prod(shape), dtype=tf.int32), shape)
    step = tf.bitwise.bitwise_and(tf.cast(step, tf.int32), _LOW)
    offset = tf.bitwise.bitwise_and(step * _STEP, _LOW) + (variable % 256) * _VARIABLE + salt
    return tf.bitwise.bitwise_and(
        tf.bitwise.bitwise_and(tf.bitwise.bitwise_and(index, _LOW) * _ELEMENT, _LOW) + offset,
        _LOW)


def dithered(value: tf.Tensor, noise: tf.Tensor) -> tf.Tensor:
    """``value`` (float32) in bfloat16, its dropped 16 bits rounded up where
    they exceed ``noise`` (:func:`dither`), else down."""
    if getattr(value, "dtype", None) != tf.float32:
        raise TypeError(f"`value` must be a float32 tensor, got {value!r}.")
    bits = tf.bitcast(value, tf.int32) + noise
    return tf.cast(tf.bitcast(tf.bitwise.bitwise_and(bits, tf.constant(-65536, tf.int32)),
                              tf.float32), MOMENT_DTYPE)


@xla.jit("elementwise")
def _adam(gradient, variable, m, v, alpha, beta_1, beta_2, epsilon, step, index):
    f32 = tf.float32
    m32 = tf.cast(m, f32)
    v32 = tf.cast(v, f32)
    m32 = m32 + (gradient - m32) * (1.0 - beta_1)
    v32 = v32 + (tf.square(gradient) - v32) * (1.0 - beta_2)
    new = variable - alpha * m32 / (tf.sqrt(v32) + epsilon)
    return new, tf.cast(m32, MOMENT_DTYPE), dithered(v32, dither(tf.shape(v32), step, index, 0))


def applies(optimizer: Any, variable: Any) -> bool:
    """Whether ``variable``'s moments in ``optimizer`` (an Adam or AdamW,
    not AMSGrad) are stored in bfloat16."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    slots = getattr(optimizer, "_momentums", None)
    if not slots or getattr(optimizer, "amsgrad", True):
        return False
    i = optimizer._get_variable_index(variable)
    return all(s[i] is not None and s[i]._dtype == "bfloat16"
               for s in (slots, optimizer._velocities))


def adam(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: Any) -> bool:
    """Applies ``optimizer``'s Adam update of ``variable`` over its bfloat16
    moments in float32 (see the module's docstring); returns False, doing
    nothing, where :func:`applies` does not hold or the gradient is not a
    dense float32 tensor for a float32 variable."""
    if not applies(optimizer, variable) or not (
            isinstance(gradient, tf.Tensor) and gradient.dtype == tf.float32
            and variable.dtype == "float32"):
        return False
    i = optimizer._get_variable_index(variable)
    f32 = tf.float32
    step = tf.cast(optimizer.iterations + 1, f32)
    beta_1 = tf.constant(optimizer.beta_1, f32)
    beta_2 = tf.constant(optimizer.beta_2, f32)
    alpha = tf.cast(learning_rate, f32) * tf.sqrt(1 - tf.pow(beta_2, step)) \
        / (1 - tf.pow(beta_1, step))
    m, v = optimizer._momentums[i], optimizer._velocities[i]
    new, m16, v16 = _adam(gradient, tf.convert_to_tensor(variable), tf.convert_to_tensor(m),
                          tf.convert_to_tensor(v), alpha, beta_1, beta_2,
                          tf.constant(optimizer.epsilon, f32),
                          tf.convert_to_tensor(optimizer.iterations), tf.constant(i, tf.int32))
    optimizer.assign(variable, new)
    optimizer.assign(m, m16)
    optimizer.assign(v, v16)
    return True
