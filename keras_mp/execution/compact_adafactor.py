"""Adafactor's float32 update over compact state.

Keras 3.15's ``Adafactor`` keeps three slots per variable: ``_r`` and
``_c``, the row and column means of the squared gradient over its last two
dimensions (factored statistics: ``shape[:-1]`` and ``shape[:-2] +
shape[-1:]``; for a variable of fewer than 2 dimensions a scalar int32
placeholder each), and ``_v``, made full-size for **every** variable
(``add_variable_from_reference``): for a variable of 2 or more dimensions
its product of ``r`` and ``c``, made again each step and only read within
it; for one of fewer, its second moment, a moving average. :func:`update`
(dispatched from :func:`keras_mp.execution.compact_rules.update`, installed
as ``update_step`` by :mod:`keras_mp.execution.native_update`) computes the
step as Keras's ``Adafactor.update_step`` does in float32 (:func:`adafactor`:
the same operations in the same order, the same float32 constants) from the
weight's and slots' float32 values, and writes back:

* the weight, where stored in bfloat16
  (:mod:`keras_mp.adaptive.storage.trained`, with
  ``keras_mp.config.set_compact_weights(True)``), with stochastic rounding
  and its update-to-ulp statistic
  (:func:`keras_mp.execution.compact_update.weight_back`), any Keras
  ``weight_decay`` applied to it in float32 first, as the other rules;
* ``_v`` in bfloat16 where compact moments are asked
  (``keras_mp.config.set_compact_moments(True)``): the second moment of a
  vector (a bias, a norm's scale) with dithered rounding as Adam's (its
  ``1 - beta_2_t = t ** -0.8`` is below 2**-8 from step 1024 on, where
  rounded to nearest it would stop decaying), the per-step product of a
  matrix rounded to nearest (it is never read again: the next step makes it
  anew). It is the one slot worth storing compactly: 4 bytes a parameter in
  float32, 2 in bfloat16, as many parameters as the model has;
* ``_r`` and ``_c`` always in float32: ``(rows + columns)`` values per
  matrix, 32 KiB beside a 4096 x 4096 kernel's 64 MiB of float32 ``_v``
  (0.05 %): stored in bfloat16 they would save almost nothing and round the
  moving averages to 8 bits (Keras's ``build`` makes them in the weight's
  dtype: for a compact weight :func:`keras_mp.adaptive.storage.trained.mark`
  stores them in float32).

With compact weights and ``_v``, a parameter costs 6 bytes of training
state (weight, gradient, ``_v``: 2 each) against Keras float32's 12.
Adafactor's ``clip_threshold``, ``epsilon_1``, ``epsilon_2`` and
``beta_2_decay`` are read as float32 scalars (numbers or tensors, as
Keras's ops take them), and ``relative_step`` as Keras reads it (it caps
the learning rate at ``1 / sqrt(t)`` only for a learning rate that is not a
schedule). A sparse gradient (``tf.IndexedSlices``) is made dense as
Keras's ``update_step`` makes it (:func:`densified`): each slice squared,
then the slices of a repeated row summed, for the squared term; the slices
summed for the gradient.

Example:
    >>> import tensorflow as tf
    >>> from keras_mp.execution import compact_adafactor
    >>> g, v = tf.constant([2.0]), tf.constant([0.0])
    >>> w, _, _, v = compact_adafactor.adafactor(g, g * g, tf.constant([1.0]), None, None,
    ...                                          v, 0.1, 1.0, 0.0, 1e-3, -0.8, 1.0, True)
    >>> round(float(w[0]), 6), float(v[0])       # u = g / sqrt(v) = 1, w -= 1 * 0.1 * u
    (0.9, 4.0)
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_mp.execution import compact_update as cu

__all__ = ["adafactor", "densified", "hyper", "update"]

_F32 = tf.float32
#: Where ``_v``'s rounding numbers start (a weight's: half a period on).
_V_SALT = 0


def _rms(x):
    return tf.sqrt(tf.reduce_mean(tf.square(x)))


def adafactor(g, term, w, r, c, v, lr, step, epsilon_1, epsilon_2, beta_2_decay,
              clip_threshold, relative, sparse=False):
    """Adafactor (Keras's ``Adafactor.update_step``, float32; ``term`` is
    ``g * g``, or of a sparse gradient the sum of its slices' squares per
    element, :func:`densified`; ``step`` the float32 ``t = iterations + 1``,
    ``relative`` whether the learning rate is capped at ``1 / sqrt(t)``
    first)::

        rho = min(lr, 1 / sqrt(t));  alpha = max(epsilon_2, rms(w)) * rho
        s = g * g + epsilon_1;  beta_2_t = 1 - t ** beta_2_decay
        r = beta_2_t * r + (1 - beta_2_t) * mean(s, -1)        # rank >= 2
        c = beta_2_t * c + (1 - beta_2_t) * mean(s, -2)
        v = (r / mean(r, -1))[..., None] * c[..., None, :]
        v = beta_2_t * v + (1 - beta_2_t) * s                  # rank < 2
        u = g / sqrt(v);  u = u / max(1, rms(u) / clip_threshold)
        w = w - alpha * u

    ``sparse``: Keras divides a sparse gradient's slices by ``sqrt(v)`` each
    and takes ``rms(u)`` over the slices (a repeated row's counted once per
    lookup, the mean over the variable's size): ``sqrt(mean(term / v))``
    here, equal to float32 rounding.

    Returns the new ``(w, r, c, v)``; ``r`` and ``c`` are None, and stay so,
    for a weight of fewer than 2 dimensions.

    Raises:
        TypeError: the gradient, its term, the weight or a slot it reads is
            not a float32 tensor.

    Example:
        >>> import tensorflow as tf
        >>> g = tf.ones([2, 2])
        >>> w, r, c, v = adafactor(g, g * g, tf.ones([2, 2]), tf.zeros([2]), tf.zeros([2]),
        ...                        tf.zeros([2, 2]), 0.5, 1.0, 0.0, 1e-3, -0.8, 1.0, False)
        >>> w.numpy().tolist(), r.numpy().tolist(), v.numpy().tolist()
        ([[0.5, 0.5], [0.5, 0.5]], [1.0, 1.0], [[1.0, 1.0], [1.0, 1.0]])
    """
    factored = getattr(w, "shape", None) is not None and w.shape.rank >= 2
    cu._float32(g=g, term=term, w=w, v=v, **({"r": r, "c": c} if factored else {}))
    if relative:
        lr = tf.minimum(lr, 1 / tf.sqrt(step))
    rho = tf.minimum(lr, 1 / tf.sqrt(step))
    alpha = tf.maximum(epsilon_2, _rms(w)) * rho
    squared = term + epsilon_1
    beta_2_t = 1 - tf.pow(step, beta_2_decay)
    if factored:
        r = beta_2_t * r + (1 - beta_2_t) * tf.reduce_mean(squared, axis=-1)
        c = beta_2_t * c + (1 - beta_2_t) * tf.reduce_mean(squared, axis=-2)
        v = tf.expand_dims(r / tf.reduce_mean(r, axis=-1, keepdims=True), -1) \
            * tf.expand_dims(c, -2)
    else:
        v = beta_2_t * v + (1 - beta_2_t) * squared
    u = g / tf.sqrt(v)
    rms = tf.sqrt(tf.reduce_mean(term / v)) if sparse else _rms(u)
    u = u / tf.maximum(1.0, rms / clip_threshold)
    return w - alpha * u, r, c, v


def _adafactor_class(optimizer: Any) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    if type(optimizer) is not keras.optimizers.Adafactor:
        raise ValueError("`optimizer` must be a keras.optimizers.Adafactor (the exact class), "
                         f"got {type(optimizer).__name__}.")


def hyper(optimizer: Any, learning_rate: Any) -> tuple:
    """The scalars of :func:`adafactor` this step for ``optimizer``: the
    float32 learning rate, ``t``, ``epsilon_1``, ``epsilon_2``,
    ``beta_2_decay``, ``clip_threshold`` (float32) and whether the step is
    relative (``relative_step`` and a learning rate that is not a schedule,
    as Keras reads it).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: it is not an exact ``keras.optimizers.Adafactor``.

    Example:
        >>> import keras
        >>> s = hyper(keras.optimizers.Adafactor(1e-2, clip_threshold=2.0), 1e-2)
        >>> [round(float(x), 6) for x in s[:6]], s[6]
        ([0.01, 1.0, 0.0, 0.001, -0.8, 2.0], True)
    """
    _adafactor_class(optimizer)
    return (tf.cast(learning_rate, _F32), tf.cast(optimizer.iterations + 1, _F32),
            *(tf.cast(getattr(optimizer, name), _F32)
              for name in ("epsilon_1", "epsilon_2", "beta_2_decay", "clip_threshold")),
            not callable(optimizer._learning_rate) and bool(optimizer.relative_step))


def densified(gradient: Any) -> tuple[tf.Tensor, tf.Tensor]:
    """The float32 gradient and its square as Keras's ``update_step`` reads
    them: from ``tf.IndexedSlices`` the slices summed per row, and the
    square of each slice summed per row.

    Raises:
        TypeError: ``gradient`` is neither a tensor nor ``tf.IndexedSlices``.

    Example:
        >>> import tensorflow as tf
        >>> g = tf.IndexedSlices(tf.constant([[1.0], [2.0]]), tf.constant([1, 1]),
        ...                      tf.constant([2, 1]))
        >>> [x.numpy().ravel().tolist() for x in densified(g)]     # 1 + 2, 1 + 4
        [[0.0, 3.0], [0.0, 5.0]]
    """
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.cast(gradient.values, _F32)

        def dense(x):
            return tf.convert_to_tensor(tf.IndexedSlices(x, gradient.indices,
                                                         gradient.dense_shape))
        return dense(values), dense(tf.square(values))
    if not isinstance(gradient, (tf.Tensor, tf.Variable)):
        raise TypeError(f"`gradient` must be a tensor or tf.IndexedSlices, got {gradient!r}.")
    g = tf.cast(gradient, _F32)
    return g, tf.square(g)


def _ops(g, term, w, r, c, v, scalars, relative, sparse, decay, step, index, compiled):
    """:func:`adafactor` from the stored values, written back as stored (the
    module's docstring). Returns the new weight, ``r``, ``c`` (None for a
    vector), ``v`` and the update-to-ulp statistic."""
    old = tf.cast(w, _F32)
    new, r2, c2, v2 = adafactor(g, term, old - old * decay,
                                *(None if x is None else tf.cast(x, _F32) for x in (r, c, v)),
                                *scalars, relative, sparse)

    def numbers(salt):
        return cu.dither(tf.shape(w), step, index, salt, compiled=compiled)
    new, lost = cu.weight_back(old, new, w.dtype != _F32, numbers)
    if v.dtype != _F32:
        v2 = tf.cast(v2, v.dtype) if r is not None else cu.dithered(v2, numbers(_V_SALT))
    r2, c2 = (None, None) if r is None else (tf.cast(r2, r.dtype), tf.cast(c2, c.dtype))
    return new, r2, c2, v2, lost


_xla = tf.function(_ops, jit_compile=True, autograph=False)
_graph = tf.function(_ops, autograph=False)


def update(optimizer: Any, gradient: Any, variable: Any, learning_rate: Any) -> bool:
    """Applies an exact ``keras.optimizers.Adafactor``'s update of
    ``variable`` in float32 over its compact state (see the module's
    docstring), XLA-compiled where
    :func:`keras_mp.execution.compact_update.compiled` holds, one variable
    after another. Returns False, doing nothing, where
    :func:`keras_mp.execution.compact_update.applies` does not hold (no
    compact weight or ``_v``) or the gradient is neither a tensor nor
    ``tf.IndexedSlices`` of the variable's dtype or float32: Keras's own
    ``update_step`` runs then.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: it is not an exact ``keras.optimizers.Adafactor``.
    """
    _adafactor_class(optimizer)
    if not cu.applies(optimizer, variable) or not cu._takes(gradient, variable):
        return False
    i = optimizer._get_variable_index(variable)
    factored = len(variable.shape) >= 2
    r, c, v = optimizer._r[i], optimizer._c[i], optimizer._v[i]
    *scalars, relative = hyper(optimizer, learning_rate)
    decay = cu._decay(optimizer, variable, scalars[0])

    def make(held):
        g, term = densified(gradient)
        parts = (variable, r, c, v) if factored else (variable, None, None, v)
        state = [None if x is None else tf.convert_to_tensor(x) for x in parts]
        run = _xla if cu.compiled() else _ops if tf.inside_function() else _graph
        new_w, new_r, new_c, new_v, lost = run(
            g, term, *state, tuple(scalars), relative,
            isinstance(gradient, tf.IndexedSlices), decay,
            tf.convert_to_tensor(optimizer.iterations), tf.constant(i, tf.int32), cu.compiled())
        targets = (variable, r, c, v) if factored else (variable, v)
        values = (new_w, new_r, new_c, new_v) if factored else (new_w, new_v)
        return cu._assign(targets, values) + cu._note(held, variable, lost)
    cu._in_order(optimizer, make)
    return True
