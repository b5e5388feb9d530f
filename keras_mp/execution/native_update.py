"""The optimizer's update as TensorFlow's own fused kernel, one op per variable.

Keras's ``Adam.update_step`` is about ten TensorFlow ops per variable (two
moments, bias correction, square root, division, three assignments), and a
TensorFlow graph runs each as a separate pass over the variable's memory.
TensorFlow has the same update as one kernel (``ResourceApplyAdam``: one
pass, multi-threaded, no XLA), written for the same formula::

    alpha = lr * sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
    m += (g - m) * (1 - beta_1)
    v += (g * g - v) * (1 - beta_2)
    v_hat = max(v_hat, v)                      # amsgrad only
    w -= alpha * m / (sqrt(v or v_hat) + epsilon)

and likewise for SGD with momentum (``ResourceApplyKerasMomentum``:
``m = momentum * m - lr * g; w += m``, or with Nesterov
``w += momentum * m - lr * g``) and plain SGD
(``ResourceApplyGradientDescent``). :func:`install` points an optimizer's
``update_step`` at that kernel where it computes exactly what Keras's does:
an exact ``keras.optimizers.Adam``, ``AdamW`` (its weight decay is applied
before ``update_step``, as in Keras) or ``SGD``, a dense float32 gradient for
a float32 variable, no distribution strategy. Anything else (a subclass, a
sparse gradient, a 16-bit variable, a strategy) runs Keras's own
``update_step``; moments or weights stored in bfloat16 (of Adam, AdamW, SGD
with momentum, Adamax, Nadam, Lion) run :mod:`keras_mp.execution.compact_rules`'
update (float32 math, dithered rounding), which :func:`install` with
``compact=True`` installs also where there is no native kernel.
The variables are the same, so checkpoints, ``.keras``
files and ``model.export`` see nothing new. SGD agrees with Keras to float32
rounding; Adam's kernel takes ``1 - beta`` in float32 from float32 ``beta``
(for 0.999: 0.99998713e-3 where Keras rounds 1e-3), a relative 1.3e-5 on
the second moment's step, and it is closer than Keras to the formula in
float64 (``tests/execution/test_native_update.py``).

Measured in one process (Keras ``mixed_bfloat16``, Adam(1e-4), 8 interleaved
rounds of 20 steps, 2-core AMD EPYC with AVX512-BF16, TF 2.21.0), Keras's
update against this kernel, process CPU time per step: the bench's 4x2048
MLP 173.2 against 138.4 ms (1.25x; compiling the update with XLA,
:mod:`keras_mp.execution.fused_update`, gave 1.22x), keras.applications
ResNet50V2 (64x64, batch 16, 6 rounds of 10) 464.7 against 429.5 ms (1.08x),
the bench's CNN (290 thousand weights) 160.6 against 160.1 ms.

:func:`keras_mp.execution.configure` installs it on the model's optimizer
in every mode but ``"keep"``.

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from keras_mp.execution import native_update
    >>> opt = keras.optimizers.SGD(0.5, momentum=0.9)
    >>> w = keras.Variable(np.ones((2,), "float32"))
    >>> opt.build([w])
    >>> native_update.install(opt)
    True
    >>> opt.apply([tf.ones((2,))], [w])
    >>> [float(v) for v in w.numpy()]   # m = -0.5, w = 1 + m
    [0.5, 0.5]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from keras_mp import _installed
from keras_mp.execution import compact_rules, optimizer_state

__all__ = ["OPTIMIZERS", "install", "is_installed", "unsupported_reason"]

_METHOD = "update_step"


def _handle(variable: Any):
    """The resource handle of a float32 variable (a Keras or a TensorFlow
    one), or None where it has none."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    if not isinstance(variable, tf.Variable) or variable.dtype != tf.float32:
        return None
    return getattr(variable, "handle", None)


def _adam(opt, gradient, variable, learning_rate) -> bool:
    i = opt._get_variable_index(variable)
    slots = [opt._momentums[i], opt._velocities[i]]
    if opt.amsgrad:
        slots.append(opt._velocity_hats[i])
    handles = [_handle(v) for v in (variable, *slots)]
    if any(h is None for h in handles):
        return False
    f32 = tf.float32
    step = tf.cast(opt.iterations + 1, f32)
    beta_1, beta_2 = tf.constant(opt.beta_1, f32), tf.constant(opt.beta_2, f32)
    args = dict(beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
                lr=tf.cast(learning_rate, f32), beta1=beta_1, beta2=beta_2,
                epsilon=tf.constant(opt.epsilon, f32), grad=gradient)
    if opt.amsgrad:
        tf.raw_ops.ResourceApplyAdamWithAmsgrad(var=handles[0], m=handles[1], v=handles[2],
                                                vhat=handles[3], **args)
    else:
        tf.raw_ops.ResourceApplyAdam(var=handles[0], m=handles[1], v=handles[2], **args)
    return True


def _sgd(opt, gradient, variable, learning_rate) -> bool:
    lr = tf.cast(learning_rate, tf.float32)
    if opt.momentum == 0:
        handle = _handle(variable)
        if handle is None:
            return False
        tf.raw_ops.ResourceApplyGradientDescent(var=handle, alpha=lr, delta=gradient)
        return True
    handles = [_handle(variable), _handle(opt.momentums[opt._get_variable_index(variable)])]
    if any(h is None for h in handles):
        return False
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=handles[0], accum=handles[1], lr=lr, grad=gradient,
        momentum=tf.constant(opt.momentum, tf.float32), use_nesterov=bool(opt.nesterov))
    return True


#: The optimizer classes with a native kernel (exact classes: a subclass may
#: change ``update_step``), and the function applying it.
OPTIMIZERS: dict[type, Callable[..., bool]] = {
    keras.optimizers.Adam: _adam, keras.optimizers.AdamW: _adam, keras.optimizers.SGD: _sgd}


def _no_kernel(opt, gradient, variable, learning_rate) -> bool:
    """The native kernel of a class with none (Adamax, Nadam, Lion): Keras's
    own ``update_step`` runs where no compact update applies."""
    return False


def unsupported_reason(optimizer: Any, *, compact: bool = False) -> str | None:
    """Why ``optimizer``'s update has no native kernel here (None when it
    has); ``compact``: or no update over compact state
    (:data:`keras_mp.execution.compact_rules.UPDATES`).

    Args:
        optimizer: a Keras optimizer (a loss-scale wrapper counts as its
            inner optimizer).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or ``compact`` is
            not a bool.

    Example:
        >>> import keras
        >>> unsupported_reason(keras.optimizers.Adam()) is None
        True
        >>> unsupported_reason(keras.optimizers.RMSprop())
        'RMSprop has no native update kernel (Adam, AdamW, SGD have)'
    """
    if not isinstance(compact, bool):
        raise TypeError(f"`compact` must be True or False, got {compact!r}.")
    opt = optimizer_state.inner(optimizer)
    if type(opt) not in OPTIMIZERS and not (compact and type(opt) in compact_rules.UPDATES):
        names = ", ".join(cls.__name__ for cls in OPTIMIZERS)
        return f"{type(opt).__name__} has no native update kernel ({names} have)"
    if keras.backend.backend() != "tensorflow":
        return "the backend is not TensorFlow"
    numbers = [getattr(opt, n) for n in ("beta_1", "beta_2", "epsilon", "momentum")
               if hasattr(opt, n)]
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in numbers):
        return "a hyperparameter other than the learning rate is not a number"
    return None


def _wrap(opt, kernel: Callable[..., bool], original: Callable[..., Any]) -> Callable[..., Any]:
    """``opt``'s ``update_step``: ``kernel`` where it applies, else ``original``."""

    def update_step(gradient, variable, learning_rate):
        if compact_rules.update(opt, gradient, variable, learning_rate):
            return None   # compact state (keras_mp.adaptive.storage.moments, .trained)
        if (isinstance(gradient, tf.Tensor) and gradient.dtype == tf.float32
                and not tf.distribute.has_strategy()
                and kernel(opt, gradient, variable, learning_rate)):
            return None
        return original(gradient, variable, learning_rate)

    return update_step


def install(optimizer: Any, *, compact: bool = False) -> bool:
    """Points ``optimizer``'s ``update_step`` (a loss-scale wrapper's inner
    optimizer's) at TensorFlow's fused kernel, where :func:`unsupported_reason`
    finds none against it; idempotent. Returns whether it is installed.
    ``compact``: also for a class whose only faster update is the one over
    compact state (:func:`keras_mp.execution.compact_rules.update`; Keras's
    own ``update_step`` for the variables it does not take).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer, or ``compact`` is
            not a bool.
    """
    opt = optimizer_state.inner(optimizer)
    if not is_installed(opt) and unsupported_reason(opt, compact=compact) is None:
        _installed.install_method(
            opt, _METHOD, functools.partial(_wrap, opt, OPTIMIZERS.get(type(opt), _no_kernel)))
    return is_installed(opt)


def is_installed(optimizer: Any) -> bool:
    """Whether :func:`install` ran on ``optimizer`` (or its inner optimizer).

    Example:
        >>> import keras
        >>> is_installed(keras.optimizers.Adam())
        False
    """
    return _installed.is_wrapped(optimizer_state.inner(optimizer), _METHOD)
