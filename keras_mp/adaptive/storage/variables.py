"""Changing the dtype a Keras variable is stored in, keeping the variable.

A TensorFlow variable's dtype is fixed when it is made, but a Keras 3
variable (``keras.Variable``) is a Python object around one: its layer,
``model.weights``, the optimizer's index (keyed by ``id``), checkpoints and
``.keras`` files all hold the Keras object, never the TensorFlow variable
inside. :func:`store_as` makes a new TensorFlow variable of the new dtype
from the old one's value, under the same distribution strategy, and puts it
in its place, so everything that holds the variable keeps it; what was
traced with the old one (train, test and predict functions) must be traced
again (the caller resets them). The value is cast: down to 16 bits it is
rounded to nearest (what every read under a 16-bit autocast scope returned
anyway), back up to float32 it is kept exactly.

``.keras`` and ``.weights.h5`` files store a variable in its own dtype
(Keras writes bfloat16 with a dtype attribute), and a variable assigned a
value of another dtype casts it, so a file written with 16-bit storage loads
into a float32 model and the reverse.

Example:
    >>> import keras, numpy as np
    >>> from keras_mp.adaptive.storage import variables
    >>> v = keras.Variable(np.array([1.0, 1 + 2**-10], "float32"))
    >>> keep = v
    >>> variables.store_as(v, "bfloat16")
    True
    >>> v is keep, v.dtype, [float(x) for x in v.numpy()]   # 1 + 2**-10 rounds to 1
    (True, 'bfloat16', [1.0, 1.0])
    >>> variables.store_as(v, "float32"), v.dtype, variables.nbytes(v)
    (True, 'float32', 8)
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["FLOAT_DTYPES", "nbytes", "store_as", "stored_dtype", "uncreatable"]

#: The dtypes a float variable can be stored in here.
FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def stored_dtype(variable: Any) -> str:
    """The dtype ``variable`` holds its value in (not the autocast dtype a
    read inside a layer's call sees)."""
    if not isinstance(variable, keras.Variable):
        raise TypeError(f"`variable` must be a keras.Variable, got {variable!r}.")
    return keras.backend.standardize_dtype(variable._dtype)


def nbytes(variable: Any) -> int:
    """Bytes of ``variable``'s stored value."""
    dtype = stored_dtype(variable)
    size = _ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    return int(np.prod(variable.shape, dtype=np.int64)) * size


def _strategy(variable: tf.Variable):
    """The distribution strategy ``variable`` was made under, or None."""
    distributed = getattr(variable, "_distribute_strategy", None)
    return distributed if distributed is not None else None


def uncreatable(variable: Any, dtype: str) -> str | None:
    """Why no variable of ``dtype`` can be made where ``variable`` lives
    (under its distribution strategy), or None where one can.

    ``MultiWorkerMirroredStrategy`` with more than one worker sends each new
    variable's initial value from the chief to the other workers with
    TensorFlow's collective broadcast, which has no bfloat16 kernel in
    TensorFlow 2.21 (``CollectiveBcastSend``: bool, float16, float32,
    float64, int32, int64): making a bfloat16 variable there fails, and so
    does a Keras ``"bfloat16"`` policy.

    Example:
        >>> import keras
        >>> uncreatable(keras.Variable([1.0]), "bfloat16") is None   # no strategy
        True
    """
    if not isinstance(variable, keras.Variable):
        raise TypeError(f"`variable` must be a keras.Variable, got {variable!r}.")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"`dtype` must be one of {FLOAT_DTYPES}, got {dtype!r}.")
    strategy = _strategy(variable._value) if variable._value is not None else None
    if strategy is None and tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
    if dtype == "bfloat16" and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) \
            and getattr(strategy.extended, "_num_workers", 2) > 1:
        return ("MultiWorkerMirroredStrategy cannot make a bfloat16 variable: TensorFlow "
                f"{tf.__version__}'s broadcast of initial values between workers has no "
                "bfloat16 kernel")
    return None


def store_as(variable: Any, dtype: str) -> bool:
    """Stores ``variable`` (a float ``keras.Variable`` of the TensorFlow
    backend) in ``dtype`` from now on, its value cast; returns whether
    anything changed. The Keras object stays the same; functions traced with
    it must be traced again.

    Args:
        variable: a built float ``keras.Variable``.
        dtype: one of :data:`FLOAT_DTYPES`.

    Raises:
        TypeError: ``variable`` is not a float ``keras.Variable``.
        ValueError: ``dtype`` is not one of :data:`FLOAT_DTYPES`, the
            variable is not built yet, or its strategy cannot make a
            variable of ``dtype`` (:func:`uncreatable`).
    """
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"`dtype` must be one of {FLOAT_DTYPES}, got {dtype!r}.")
    old_dtype = stored_dtype(variable)
    if old_dtype not in FLOAT_DTYPES:
        raise TypeError(f"`variable` must be a float variable, got {variable.path!r} of dtype "
                        f"{old_dtype}.")
    if old_dtype == dtype:
        return False
    old = variable._value
    if old is None:
        raise ValueError(f"`variable` {variable.path!r} is not built yet: store it after its "
                         "layer is built.")
    why = uncreatable(variable, dtype)
    if why is not None:
        raise ValueError(f"`variable` {variable.path!r} cannot be stored in {dtype}: {why}.")
    strategy = _strategy(old)
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope, tf.init_scope():
        value = tf.cast(old.read_value() if strategy is None else tf.convert_to_tensor(old),
                        dtype)
        new = tf.Variable(value, dtype=dtype, trainable=old.trainable, name=variable.name,
                          aggregation=old.aggregation, synchronization=old.synchronization)
    variable._value = new
    variable._dtype = dtype
    return True
