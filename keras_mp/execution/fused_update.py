"""The optimizer's update step as one XLA computation, matmuls left outside.

A Keras optimizer updates each variable with a handful of elementwise ops
(Adam: about ten per variable: two moments, bias correction, square root,
division, assignment), and a TensorFlow graph runs each as a separate pass
over memory. XLA fuses them. Compiling the whole train step
(``compile(jit_compile=True)``) fuses them too, but also moves the matmuls
and convolutions into XLA, which on a CPU with AMX-BF16 is 3x slower for
bfloat16 matmuls than TensorFlow's oneDNN kernels (``keras-mp info``). This
module compiles **only the update**: the forward and backward pass stay in
the TensorFlow graph.

Measured on a 2-core Xeon with AMX-BF16 (Keras ``mixed_bfloat16``, a 3x1024
ReLU MLP on 256 rows, Adam, 7 interleaved epochs of 20 steps, one process):
the same ``fit`` ran 1.58x faster by process CPU time and 1.48x by wall
time with the update compiled. The variables agree with the graph's to
float32 rounding (largest difference / largest weight <= 4e-7 after 5
steps for Adam, AdamW, SGD, RMSprop, Lion, Adafactor, Nadam, Adagrad,
Adamax, Ftrl, Adadelta and Muon; ``tests/execution/test_fused_update.py``).

It does not pay everywhere (XLA:CPU runs the per-variable pieces one after
another, where the TensorFlow executor spreads small ops over the cores), so
:func:`keras_mp.execution.configure` measures it on the model's own train
step as a third mode, ``"xla_update"``, beside ``"graph"`` and ``"xla"``.

Its memory is per variable, not per byte, and it stays: XLA:CPU compiles
each fusion as a kernel of its own (Adam: three per variable) and never frees
an executable. On a 2-core AMD EPYC (TF 2.21.0), compiling Adam's update of
128 one-element variables grew the process by 134 MiB and of 16 by 68 MiB
(about 0.6 MiB per variable, whatever its size); ResNet50V2's 272 variables
took 178 MiB beside 64 MiB for the update's trace. ``XLA_FLAGS`` did not
change that much (``--xla_cpu_use_fusion_emitters=false``: 163 MiB;
``--xla_cpu_parallel_codegen_split_count=1``,
``--xla_backend_optimization_level=0``, ``--xla_cpu_use_thunk_runtime=false``:
within 7 MiB of the default).

How: :func:`install` wraps the optimizer's ``_backend_update_step`` (per
instance; for a loss-scale wrapper, its inner optimizer's) in a
``tf.function(jit_compile=True)``, used only while the step is traced inside
:func:`compiling` ``(True)``: train functions traced outside it contain
exactly Keras's ops. Under a ``tf.distribute`` strategy the update holds the
gradient all-reduce and is never compiled. The wrapper is a plain function
and the compiled update lives only inside it
(:func:`keras_mp._installed.install_method`): SavedModel traces every
``tf.function`` it finds among an object's attributes, and tracing the
update outside a train step fails (``KeyError: None`` in Keras's
``_get_variable_index``, from ``model.export``).

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from keras_mp.execution import fused_update
    >>> opt = keras.optimizers.Adam(0.1)
    >>> w = keras.Variable(np.ones((4,), "float32"))
    >>> opt.build([w])
    >>> fused_update.install(opt)
    True
    >>> @tf.function
    ... def step(g):
    ...     with fused_update.compiling(True):   # read when traced
    ...         opt.apply([g], [w])
    >>> step(tf.ones((4,)))
    >>> [round(float(v), 3) for v in w.numpy()]
    [0.9, 0.9, 0.9, 0.9]
    >>> fused_update.is_installed(opt)
    True
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from keras_mp import _installed
from keras_mp.execution import optimizer_state

__all__ = ["BYTES_PER_VARIABLE", "install", "is_installed", "compiling", "switched",
           "unsupported_reason", "updated_variables"]

#: What the update under XLA keeps per variable it updates, whatever the
#: variable's size (an estimate for :mod:`keras_mp.execution.step_trial`):
#: ResNet50V2's first Adam update under XLA grew the process by 213 MiB for its
#: 174 variables (2-core AMD EPYC, TF 2.21.0).
BYTES_PER_VARIABLE = 2**20

_METHOD = "_backend_update_step"
_flag = threading.local()


_target = optimizer_state.inner  # a loss-scale wrapper's inner optimizer


def unsupported_reason(optimizer: Any) -> str | None:
    """Why ``optimizer``'s update cannot be compiled on its own (None when it can).

    Args:
        optimizer: a Keras optimizer (a loss-scale wrapper counts as its
            inner optimizer).

    Example:
        >>> import keras
        >>> unsupported_reason(keras.optimizers.SGD()) is None
        True
    """
    opt = _target(optimizer)
    if not callable(getattr(opt, "_backend_update_step", None)):
        return f"{type(opt).__name__} has no TensorFlow update step"
    strategy = getattr(opt, "_distribution_strategy", None)
    if strategy is not None and strategy is not tf.distribute.get_strategy() \
            or tf.distribute.has_strategy():
        return "a distribution strategy is set (the update holds its all-reduce)"
    return None


def install(optimizer: Any) -> bool:
    """Lets ``optimizer``'s update run as one XLA computation in steps traced
    inside :func:`compiling` ``(True)``; idempotent.

    Args:
        optimizer: a Keras optimizer, or a loss-scale wrapper (its inner
            optimizer is the one changed).

    Returns:
        True if installed (now or before); False where
        :func:`unsupported_reason` names a reason.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
    """
    opt = _target(optimizer)
    if is_installed(opt):
        return True
    if unsupported_reason(opt) is not None:
        return False

    def make(original):
        # Held by the wrapper alone: not an attribute SavedModel would trace.
        compiled = tf.function(lambda grads, variables, lr: original(grads, variables, lr),
                               jit_compile=True, autograph=False)

        def _backend_update_step(grads, trainable_variables, learning_rate):
            switch = getattr(_flag, "switch", None)
            if not (getattr(_flag, "on", False) or switch is not None) \
                    or tf.executing_eagerly() or tf.distribute.has_strategy():
                return original(grads, trainable_variables, learning_rate)
            variables = [v.value if isinstance(v, keras.Variable) else v
                         for v in trainable_variables]
            lr = tf.convert_to_tensor(learning_rate)
            if switch is None:
                return compiled(list(grads), variables, lr)

            def under_xla():
                compiled(list(grads), variables, lr)
                return tf.constant(True)

            def in_graph():
                original(grads, trainable_variables, learning_rate)
                return tf.constant(False)
            tf.cond(switch, under_xla, in_graph)
            return None
        return _backend_update_step

    _installed.install_method(opt, _METHOD, make)
    return True


def updated_variables(optimizer: Any) -> list:
    """The variables ``optimizer``'s update writes to: those it was built for
    (a loss-scale wrapper's inner optimizer's; empty before it is built).

    Example:
        >>> import keras, numpy as np
        >>> opt = keras.optimizers.SGD()
        >>> opt.build([keras.Variable(np.ones((2,), "float32"))])
        >>> len(updated_variables(opt))
        1
    """
    return list(getattr(_target(optimizer), "_trainable_variables", None) or [])


def is_installed(optimizer: Any) -> bool:
    """Whether :func:`install` ran on ``optimizer`` (or its inner optimizer)."""
    return _installed.is_wrapped(_target(optimizer), _METHOD)


@contextlib.contextmanager
def compiling(enabled: bool) -> Iterator[None]:
    """Within this block (this thread), steps being traced compile installed
    optimizers' updates with XLA when ``enabled``, and leave them to the
    TensorFlow graph otherwise.

    Args:
        enabled: a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be a bool, got {enabled!r}.")
    previous = getattr(_flag, "on", False)
    _flag.on = enabled
    try:
        yield
    finally:
        _flag.on = previous


@contextlib.contextmanager
def switched(switch: tf.Variable) -> Iterator[None]:
    """Within this block (this thread), steps being traced hold installed
    optimizers' updates both ways, in a ``tf.cond`` on ``switch``: under XLA
    while it is True, as the TensorFlow graph's own ops while it is False.
    One trace then serves ``"graph"`` and ``"xla_update"``
    (:mod:`keras_mp.execution.step_trial` times both on it).

    Args:
        switch: a scalar boolean ``tf.Variable``, read when the step runs.

    Example:
        >>> import keras, numpy as np, tensorflow as tf
        >>> opt = keras.optimizers.SGD(0.5)
        >>> w = keras.Variable(np.ones((2,), "float32"))
        >>> opt.build([w])
        >>> install(opt)
        True
        >>> on = tf.Variable(False)
        >>> @tf.function
        ... def step(g):
        ...     with switched(on):   # read when traced
        ...         opt.apply([g], [w])
        >>> step(tf.ones((2,))); _ = on.assign(True); step(tf.ones((2,)))
        >>> [float(v) for v in w.numpy()]
        [0.0, 0.0]
    """
    if not isinstance(switch, tf.Variable) or switch.dtype != tf.bool or switch.shape.rank != 0:
        raise TypeError(f"`switch` must be a scalar boolean tf.Variable, got {switch!r}.")
    previous = getattr(_flag, "switch", None)
    _flag.switch = switch
    try:
        yield
    finally:
        _flag.switch = previous
