"""The float32 update rules of SGD with momentum, Adamax, Nadam and Lion over compact state.

keras-mp stores an optimizer's moments in bfloat16
(:mod:`keras_mp.adaptive.storage.moments`) and computes each update in
float32: it reads the stored values, casts them to float32, applies the rule
and writes the results back rounded (the rounding, the weight decay and the
order of :mod:`keras_mp.execution.compact_update`). A weight stored in
bfloat16 (:mod:`keras_mp.adaptive.storage.trained`: by default only Adam's
and AdamW's, these optimizers' with
``keras_mp.config.set_compact_weights(True)``) is read in float32, any Keras
``weight_decay`` applied to it there (Keras's own, in the weight's dtype, is
left out), and written back with stochastic rounding, its update-to-ulp
statistic kept (:func:`keras_mp.execution.compact_update.weight_back`, as
Adam's). Nadam's ``_u_product`` stays float32 (Keras's ``build`` would make
it in the first weight's dtype). :func:`update` is
the entry (installed as ``update_step`` by
:mod:`keras_mp.execution.native_update`), dispatching on the optimizer's
exact class through :data:`UPDATES`: Adam and AdamW to
:func:`keras_mp.execution.compact_update.adam`, Adafactor (opt-in as these
four; its factored slots are not one slot of the variable's shape per
variable) to :func:`keras_mp.execution.compact_adafactor.update`, the others
to the rules here, XLA-compiled where Adam's update is. This module holds the rules, one small
pure function per optimizer class, written as Keras 3.15's own
``update_step`` computes them in float32 (the same operations in the same
order, the same float32 constants), so that the update from float32 values
is Keras's to float32 rounding; only what is stored is rounded. Each takes
float32 tensors (the gradient ``g``, a per-element term Keras makes of the
gradient's slices, ``term``, the weight ``w``, the slots) and float32
scalars, and returns the new weight and slots.

:data:`RULES` is the table :mod:`~keras_mp.execution.compact_update`
dispatches on (exact classes: a subclass may change ``update_step``). Per
rule: the optimizer's slot lists (the attributes its ``build`` makes), the
function, the scalars of a step (:func:`_sgd_hyper` and the like, as Keras
computes them), the per-slice term of a sparse gradient, and per slot the
hyperparameter it decays by. A moving average ``m += (x - m) * (1 - beta)``
rounded to nearest stops moving while its step is below half a bfloat16 ulp
of ``m``, that is while its target ``x`` is within ``2**-9 / (1 - beta)`` of
``m`` (relative): 2 % at ``beta = 0.9`` (Adam's first moment), 20 % at 0.99
(Lion's ``beta_2``), and at 0.999 it never decays (``x * 0.999`` rounds back
to ``x``). A slot whose ``1 - beta`` is below :data:`DITHER_BELOW` (2**-8)
is written with dithered rounding (its expected value the float32 one), the
others to nearest; Nadam's second moment always is, as Adam's. Lion's
momentum stays rounded to nearest though its band is 20 %: in the 1000-step
byte-level LM of ``benchmarks/compact_quality.py`` (``--optimizer lion``,
seeds 0-2) it ended +0.52/-1.37/+1.13 % (training loss against Keras
float32's) rounded to nearest and +3.02/+0.92/+1.21 % dithered (the sign
Lion takes of it flips with the dither's noise where it is near zero).

Sparse gradients (``tf.IndexedSlices``): Keras's ``update_step`` of these
classes turns them dense in its first operation with a dense tensor, after
applying ``abs`` (Adamax) or ``square`` (Nadam) to each slice: the same dense
gradient (slices of a repeated row summed) and per-slice term are made here
(:func:`densified`) before the rule, so a sparse gradient takes Keras's
update (to float32 rounding where a row repeats: Keras scales each slice by
the learning rate before the sum in SGD, Lion and Nadam).

Example:
    >>> import tensorflow as tf
    >>> from keras_mp.execution import compact_rules
    >>> g, w, m = tf.constant([1.0]), tf.constant([2.0]), tf.constant([0.5])
    >>> [round(float(x[0]), 6) for x in compact_rules.sgd(g, None, w, m, 0.1, 0.9, False)]
    [2.35, 0.35]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from keras_mp.execution import compact_adafactor
from keras_mp.execution import compact_update as cu

__all__ = ["DITHER_BELOW", "RULES", "UPDATES", "adamax", "densified", "dithers", "hyper", "lion",
           "nadam", "sgd", "update"]

#: A slot whose moving average moves by less than this fraction of its
#: distance to its target a step (``1 - beta``) is written with dithered
#: rounding (the module's docstring): it would never decay rounded to nearest.
DITHER_BELOW = 2.0 ** -8
_F32 = tf.float32


def sgd(g, term, w, m, lr, momentum, nesterov):
    """SGD with momentum (Keras's ``SGD.update_step``, ``momentum != 0``)::

        m = m * momentum - g * lr
        w = w + (m * momentum - g * lr)   if nesterov   else   w + m

    Raises:
        TypeError: the gradient, its term, the weight or a slot is not a float32
            tensor.

    Example:
        >>> import tensorflow as tf
        >>> g, w, m = tf.constant([1.0]), tf.constant([2.0]), tf.constant([0.5])
        >>> [float(x[0]) for x in sgd(g, None, w, m, 0.5, 0.5, True)]
        [1.375, -0.25]
    """
    cu._float32(g=g, w=w, m=m)
    m = m * momentum - g * lr
    return (w + (m * momentum - g * lr) if nesterov else w + m), m


def adamax(g, term, w, m, u, lr, one_minus_beta_1, beta_2, epsilon, one_minus_beta_1_power):
    """Adamax (Keras's ``Adamax.update_step``; ``term`` is ``|g|``)::

        m = m + (g - m) * (1 - beta_1)
        u = max(beta_2 * u, |g|)
        w = w - lr * m / ((1 - beta_1 ** t) * (u + epsilon))

    Raises:
        TypeError: the gradient, its term, the weight or a slot is not a float32
            tensor.

    Example:
        >>> import tensorflow as tf
        >>> g = tf.constant([-2.0])
        >>> z = tf.constant([0.0])
        >>> [float(x[0]) for x in adamax(g, tf.abs(g), z, z, z, 1.0, 0.5, 0.9, 0.0, 0.5)]
        [1.0, -1.0, 2.0]
    """
    cu._float32(g=g, term=term, w=w, m=m, u=u)
    m = m + (g - m) * one_minus_beta_1
    u = tf.maximum(beta_2 * u, term)
    return w - (lr * m) / (one_minus_beta_1_power * (u + epsilon)), m, u


def nadam(g, term, w, m, v, lr, one_minus_beta_1, one_minus_beta_2, u_t_1, one_minus_product_1,
          one_minus_u_t, one_minus_product, one_minus_beta_2_power, epsilon):
    """Nadam (Keras's ``Nadam.update_step``; ``term`` is ``g * g``; ``u_t``,
    the momentum schedule ``beta_1 * (1 - 0.5 * 0.96 ** t)``, ``product`` the
    optimizer's ``_u_product``, already advanced this step by Keras)::

        m = m + (g - m) * (1 - beta_1)
        v = v + (g * g - v) * (1 - beta_2)
        m_hat = u_t+1 * m / (1 - product * u_t+1) + (1 - u_t) * g / (1 - product)
        w = w - m_hat * lr / (sqrt(v / (1 - beta_2 ** t)) + epsilon)

    Raises:
        TypeError: the gradient, its term, the weight or a slot is not a float32
            tensor.

    Example:
        >>> import tensorflow as tf
        >>> g, z = tf.constant([1.0]), tf.constant([0.0])
        >>> [float(x[0]) for x in nadam(g, g * g, z, z, z, 1.0, 0.5, 0.5, 1.0, 1.0,
        ...                             1.0, 1.0, 0.5, 0.0)]
        [-1.5, 0.5, 0.5]
    """
    cu._float32(g=g, term=term, w=w, m=m, v=v)
    m = m + (g - m) * one_minus_beta_1
    v = v + (term - v) * one_minus_beta_2
    m_hat = (u_t_1 * m) / one_minus_product_1 + (one_minus_u_t * g) / one_minus_product
    return w - (m_hat * lr) / (tf.sqrt(v / one_minus_beta_2_power) + epsilon), m, v


def lion(g, term, w, m, lr, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2):
    """Lion (Keras's ``Lion.update_step``; the weight moves by the old ``m``)::

        w = w - lr * sign(m * beta_1 + g * (1 - beta_1))
        m = m * beta_2 + g * (1 - beta_2)

    Raises:
        TypeError: the gradient, its term, the weight or a slot is not a float32
            tensor.

    Example:
        >>> import tensorflow as tf
        >>> g, w, m = tf.constant([1.0]), tf.constant([0.0]), tf.constant([-4.0])
        >>> [float(x[0]) for x in lion(g, None, w, m, 0.5, 0.5, 0.5, 0.5, 0.5)]
        [0.5, -1.5]
    """
    cu._float32(g=g, w=w, m=m)
    return w - lr * tf.sign(m * beta_1 + g * one_minus_beta_1), m * beta_2 + g * one_minus_beta_2


def _step(opt, offset: int) -> tf.Tensor:
    return tf.cast(opt.iterations + offset, _F32)


def _sgd_hyper(opt, lr) -> tuple:
    return lr, tf.constant(opt.momentum, _F32), bool(opt.nesterov)


def _adamax_hyper(opt, lr) -> tuple:
    power = tf.pow(tf.constant(opt.beta_1, _F32), _step(opt, 1))
    return (lr, tf.constant(1 - opt.beta_1, _F32), tf.constant(opt.beta_2, _F32),
            tf.constant(opt.epsilon, _F32), 1 - power)


def _nadam_hyper(opt, lr) -> tuple:
    beta_1, beta_2 = tf.constant(opt.beta_1, _F32), tf.constant(opt.beta_2, _F32)
    decay = tf.constant(0.96, _F32)
    u_t = beta_1 * (1.0 - 0.5 * tf.pow(decay, _step(opt, 1)))
    u_t_1 = beta_1 * (1.0 - 0.5 * tf.pow(decay, _step(opt, 2)))
    product = tf.cast(opt._u_product, _F32)
    return (lr, 1 - beta_1, 1 - beta_2, u_t_1, 1 - product * u_t_1, 1 - u_t, 1 - product,
            1 - tf.pow(beta_2, _step(opt, 1)), tf.constant(opt.epsilon, _F32))


def _lion_hyper(opt, lr) -> tuple:
    beta_1, beta_2 = tf.constant(opt.beta_1, _F32), tf.constant(opt.beta_2, _F32)
    return lr, beta_1, 1.0 - beta_1, beta_2, 1.0 - beta_2


class Rule(NamedTuple):
    """One optimizer class's update over compact state."""

    #: The attributes holding the slot lists (one slot per variable).
    slots: tuple[str, ...]
    #: The pure float32 function: (g, term, w, *slots, *hyper) -> (w, *slots).
    math: Callable[..., tuple]
    #: The step's scalars from the optimizer and the float32 learning rate.
    hyper: Callable[[Any, tf.Tensor], tuple]
    #: Of each slice of the gradient, the term Keras sums per row (or None).
    term: Callable[[tf.Tensor], tf.Tensor] | None
    #: Per slot, the attribute of the factor it decays by a step, or None:
    #: always dithered.
    decays: tuple[str | None, ...]


#: The rules, by exact optimizer class.
RULES: dict[type, Rule] = {
    keras.optimizers.SGD: Rule(cu.SLOTS[keras.optimizers.SGD], sgd, _sgd_hyper, None,
                               ("momentum",)),
    keras.optimizers.Adamax: Rule(cu.SLOTS[keras.optimizers.Adamax], adamax, _adamax_hyper, tf.abs,
                                  ("beta_1", "beta_2")),
    keras.optimizers.Nadam: Rule(cu.SLOTS[keras.optimizers.Nadam], nadam, _nadam_hyper, tf.square,
                                 ("beta_1", None)),
    keras.optimizers.Lion: Rule(cu.SLOTS[keras.optimizers.Lion], lion, _lion_hyper, None,
                                ("beta_2",)),
}


def _rule(optimizer: Any) -> Rule:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    if type(optimizer) not in RULES:
        names = ", ".join(cls.__name__ for cls in RULES)
        raise ValueError(f"`optimizer` must be one of {names} (exact classes), got "
                         f"{type(optimizer).__name__}.")
    return RULES[type(optimizer)]


def dithers(optimizer: Any) -> tuple[bool, ...]:
    """Per slot of ``optimizer``'s rule, whether it is written back with
    dithered rounding (its ``1 - beta`` is below :data:`DITHER_BELOW`, or it
    is a second moment); the others are rounded to nearest.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: its class has no rule here.

    Example:
        >>> import keras
        >>> dithers(keras.optimizers.Nadam()), dithers(keras.optimizers.Adamax())
        ((False, True), (False, True))
        >>> dithers(keras.optimizers.SGD(momentum=0.9)), dithers(keras.optimizers.Lion())
        ((False,), (False,))
    """
    return tuple(name is None or 1 - float(getattr(optimizer, name)) < DITHER_BELOW
                 for name in _rule(optimizer).decays)


def hyper(optimizer: Any, learning_rate: Any) -> tuple:
    """The float32 scalars of ``optimizer``'s rule this step, as Keras
    computes them (the learning rate cast to float32 first).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: its class has no rule here.
    """
    return _rule(optimizer).hyper(optimizer, tf.cast(learning_rate, _F32))


def densified(optimizer: Any, gradient: Any) -> tuple[tf.Tensor, tf.Tensor | None]:
    """The float32 gradient and per-element term (``|g|``, ``g * g`` or None)
    ``optimizer``'s rule reads, from a dense gradient or from
    ``tf.IndexedSlices`` as Keras's ``update_step`` makes them dense (the term
    of each slice, then the slices of a row summed).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or ``gradient`` is
            neither a tensor nor ``tf.IndexedSlices``.
        ValueError: its class has no rule here.
    """
    term = _rule(optimizer).term
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.cast(gradient.values, _F32)

        def dense(x):
            return tf.convert_to_tensor(tf.IndexedSlices(x, gradient.indices,
                                                         gradient.dense_shape))
        return dense(values), None if term is None else dense(term(values))
    if not isinstance(gradient, (tf.Tensor, tf.Variable)):
        raise TypeError(f"`gradient` must be a tensor or tf.IndexedSlices, got {gradient!r}.")
    g = tf.cast(gradient, _F32)
    return g, None if term is None else term(g)


_SLOT_SALTS = (0, 0x4000)   # the slots' rounding numbers (the weight's: 0x8000)


def _ops(name, dithers, g, term, w, slots, hyper, decay, step, index, compiled):
    """The rule of optimizer class ``name`` (float32, from the stored
    values), the weight and the slots written back as stored: a bfloat16
    weight and the slots ``dithers`` marks dithered, the other bfloat16
    slots to nearest. Returns the new weight, slots and statistic."""
    f32 = tf.float32
    old = tf.cast(w, f32)
    new, *moved = _BY_NAME[name].math(g, term, old - old * decay,
                                      *(tf.cast(s, f32) for s in slots), *hyper)

    def numbers(salt):
        return cu.dither(tf.shape(w), step, index, salt, compiled=compiled)
    new, lost = cu.weight_back(old, new, w.dtype != f32, numbers)
    moved = [x if s.dtype == f32 else cu.dithered(x, numbers(_SLOT_SALTS[j])) if d
             else tf.cast(x, s.dtype) for j, (s, x, d) in enumerate(zip(slots, moved, dithers))]
    return [new, *moved, lost]


_xla = tf.function(_ops, jit_compile=True, autograph=False)
_graph = tf.function(_ops, autograph=False)


def _apply(optimizer: Any, gradient: Any, variable: Any, learning_rate: Any) -> bool:
    """:func:`update` by the rule of ``optimizer``'s class (:data:`RULES`),
    XLA-compiled where :func:`keras_mp.execution.compact_update.compiled`
    holds, over the variable flattened (variables of one size share a
    compilation)."""
    if not cu.applies(optimizer, variable) or not cu._takes(gradient, variable):
        return False
    rule = RULES[type(optimizer)]
    i = optimizer._get_variable_index(variable)
    slots = [getattr(optimizer, name)[i] for name in rule.slots]
    lr = tf.cast(learning_rate, tf.float32)
    scalars = hyper(optimizer, lr)
    static = (type(optimizer).__name__, dithers(optimizer))
    decay = cu._decay(optimizer, variable, lr)

    def make(held):
        g, term = densified(optimizer, gradient)   # Keras's dense gradient
        state = [tf.convert_to_tensor(x) for x in (variable, *slots)]
        shape, xla = tf.shape(state[0]), cu.compiled()
        flat = [None if x is None else tf.reshape(x, [-1]) if xla else x
                for x in (g, term, *state)]
        run = _xla if xla else _ops if tf.inside_function() else _graph
        *new, lost = run(*static, *flat[:3], flat[3:], scalars, decay,
                         tf.convert_to_tensor(optimizer.iterations), tf.constant(i, tf.int32),
                         xla)
        new = [tf.reshape(x, shape) for x in new] if xla else new
        return cu._assign((variable, *slots), new) + cu._note(held, variable, lost)
    cu._in_order(optimizer, make)
    return True


#: The update over compact state, by exact optimizer class.
UPDATES: dict[type, Callable[..., bool]] = {
    keras.optimizers.Adam: cu.adam, keras.optimizers.AdamW: cu.adam,
    **{cls: _apply for cls in RULES},
    keras.optimizers.Adafactor: compact_adafactor.update}
_BY_NAME = {cls.__name__: rule for cls, rule in RULES.items()}


def update(optimizer: Any, gradient: Any, variable: Any, learning_rate: Any) -> bool:
    """Applies ``optimizer``'s update of ``variable`` in float32 over its
    compact state, by the optimizer's exact class (:data:`UPDATES`): Adam's
    and AdamW's (:func:`keras_mp.execution.compact_update.adam`),
    Adafactor's (:func:`keras_mp.execution.compact_adafactor.update`), or the
    rule of :data:`RULES` (a sparse gradient made dense as Keras makes it,
    :func:`densified`). Returns False, doing nothing, where
    :func:`keras_mp.execution.compact_update.applies` does not hold or the
    gradient is neither a tensor nor ``tf.IndexedSlices`` of the variable's
    dtype or float32: Keras's own ``update_step`` runs then.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    run = UPDATES.get(type(optimizer))
    return run is not None and run(optimizer, gradient, variable, learning_rate)
