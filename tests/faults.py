"""Fault injection shared by the fault, distributed and resume tests.

:class:`GradientFault` is an ordinary Keras layer: the identity in the
forward pass, and in the backward pass it replaces the gradient of the rows
whose flag input is set with a non-finite value. Flags are data, so a fault
can be placed at any step, on any replica (rows ``[r*b, (r+1)*b)`` of a
global batch go to replica ``r`` of a MirroredStrategy), and only the layers
*before* it get non-finite gradients: the variables to name in errors.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def _poison(value: float):
    @tf.custom_gradient
    def poison(h, flag):
        def grad(dy):
            bad = tf.reshape(flag > 0, [-1] + [1] * (len(dy.shape) - 1))
            return tf.where(bad, tf.constant(value, dy.dtype), dy), tf.zeros_like(flag)

        return tf.identity(h), grad

    return poison


class GradientFault(keras.layers.Layer):
    """``[h, flag] -> h``; the gradient of rows with ``flag > 0`` becomes ``value``."""

    def __init__(self, value: float = np.inf, **kwargs):
        super().__init__(**kwargs)
        self.value = float(value)

    def call(self, inputs):
        h, flag = inputs
        return _poison(self.value)(h, tf.cast(flag, h.dtype))


FEATURES = 4


def fault_model(value: float = np.inf) -> keras.Model:
    """``first`` (before the fault) gets the non-finite gradients, ``second`` never.

    tanh, not relu: relu's zero derivative would turn an injected inf into a
    finite 0 for inactive units.
    """
    x = keras.Input((FEATURES,), name="x")
    flag = keras.Input((1,), name="flag")
    h = keras.layers.Dense(8, activation="tanh", name="first")(x)
    h = GradientFault(value, name="fault")([h, flag])
    out = keras.layers.Dense(1, name="second")(h)
    return keras.Model([x, flag], out, name="faulty")


def fault_data(steps: int, batch: int, bad: dict[int, list[int]] | None = None, seed: int = 0):
    """``steps`` batches of a regression problem; ``bad`` maps a step to the
    rows (within its batch) whose gradient is poisoned."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    flag = np.zeros((steps * batch, 1), "float32")
    for step, rows in (bad or {}).items():
        for r in rows:
            flag[step * batch + r] = 1.0
    return x, flag, y


def local_values(variable) -> np.ndarray:
    """A variable's value on every replica, stacked (one row without a strategy)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    strategy = tf.distribute.get_strategy()
    if isinstance(value, tf.distribute.DistributedValues):
        strategy = value._distribute_strategy
    return np.stack([np.asarray(v) for v in strategy.experimental_local_results(value)])


class Snapshots(keras.callbacks.Callback):
    """Every variable of ``get_variables()`` on every replica, before the
    first step and after each step."""

    def __init__(self, get_variables):
        super().__init__()
        self.get_variables = get_variables
        self.steps: list[list[np.ndarray]] = []

    def take(self) -> None:
        self.steps.append([local_values(v) for v in self.get_variables()])

    def on_train_begin(self, logs=None):
        if not self.steps:
            self.take()

    def on_train_batch_end(self, batch, logs=None):
        self.take()


def two_replica_mirrored_strategy() -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy over the two logical CPU devices whose collectives
    cannot collide with those of strategies made before it in this process.

    Every MirroredStrategy numbers its collective groups and instances from
    the same start, and TensorFlow remembers each (group, instance) it has run
    for the life of the process: a later strategy whose n-th collective is of
    another kind (an all-gather where an earlier one had an all-reduce) fails
    with "Collective instance ... expected type 0 ... but got type 2". The
    class attribute that offsets the numbering is TensorFlow's own, "only set
    in tests".
    """
    tf.distribute.MirroredStrategy._collective_key_base += 10_000
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    assert len(devices) == 2, devices
    return tf.distribute.MirroredStrategy(devices)
