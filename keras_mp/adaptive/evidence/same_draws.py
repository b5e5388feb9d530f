"""The same random draws in every pass of the probe, whatever their dtype.

The probe (:mod:`keras_mp.adaptive.evidence.probe`) runs one batch in float32
and in the configured dtypes, each pass in a ``StatelessScope``, so every
dropout draws from the same seed in every pass. Keras draws a dropout mask
in its input's dtype, though (``tf.nn.experimental.stateless_dropout`` makes
uniform noise of ``x.dtype``), and the same seed gives other noise in
bfloat16 or float16 than in float32: on 1,000 elements, the masks of rate
0.4 agreed on 49.9 % (bfloat16) and 52.2 % (float16) of them, as two
independent masks would. A layer next to a dropout then had its gradient
compared between two different masks, and read as harmed by rounding:
keras.io's timeseries Transformer's ``Dense(128)`` before ``Dropout(0.4)``
read a gradient error of 1.2-1.4 and a cosine of 0.14 (-0.01 traced), and
was promoted to float32 (``probe_error``, a retrace of 5.3 s on a 2-core AMD
EPYC); with the model's dropout rates at 0, nothing was promoted.

While :func:`same_draws` is active (in this thread: the probe's passes),
Keras's TensorFlow backend draws in float32 what it would draw in a 16-bit
dtype: a dropout's mask on float32 ones, multiplied into the input in its own
dtype (the values Keras's dropout of that dtype gives: each kept element
times ``1 / (1 - rate)`` rounded to the dtype), and uniform noise cast to the
16-bit dtype asked for (TensorFlow's 16-bit uniform draws are other numbers:
0.3 % of bfloat16 ones matched the float32 ones rounded; its normal and
truncated normal draws, ``GaussianNoise`` and ``GaussianDropout``'s, are the
float32 ones rounded already). So a 16-bit pass and the float32 one keep and
drop the same elements, and differ only by rounding, which is what the probe
measures. Outside it, in every
training step, Keras's functions run unchanged (:func:`install` wraps them
on import, ``keras_mp._keras_changes``, ``"probe_draws"``).

Example:
    >>> import tensorflow as tf, keras_mp
    >>> from keras.src.backend import random as backend_random
    >>> x = tf.ones([1000])
    >>> def kept(dtype):
    ...     out = backend_random.dropout(tf.cast(x, dtype), 0.4, seed=7)
    ...     return tf.cast(out, tf.float32).numpy() > 0
    >>> with same_draws():
    ...     bool((kept("bfloat16") == kept("float32")).all())
    True
    >>> float((kept("bfloat16") == kept("float32")).mean()) < 0.6   # Keras's own draws
    True
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

__all__ = ["MODULE", "active", "install", "same_draws"]

#: The Keras backend module whose draws are wrapped.
MODULE = "keras.src.backend.tensorflow.random"
_NARROW = (tf.bfloat16, tf.float16)
_local = threading.local()
_original: dict[str, Any] = {}   # Keras's functions, and "module": the module holding them


def active() -> bool:
    """Whether draws of this thread are made in float32 (inside :func:`same_draws`)."""
    return bool(getattr(_local, "depth", 0))


@contextlib.contextmanager
def same_draws() -> Iterator[None]:
    """Within it, in this thread, Keras's TensorFlow backend draws dropout
    masks and 16-bit uniform noise in float32 (module docstring). Nests."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _narrow(dtype) -> bool:
    try:
        return dtype is not None and tf.as_dtype(dtype) in _NARROW
    except TypeError:
        return False


def _dropout(inputs, rate, noise_shape=None, seed=None):
    original = _original["dropout"]
    if not active() or isinstance(rate, (int, float)) and rate in (0.0, 1.0):
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    x = tf.convert_to_tensor(inputs)
    if x.dtype not in _NARROW:
        return original(inputs, rate, noise_shape=noise_shape, seed=seed)
    shape = _original["module"]._get_concrete_noise_shape(x, noise_shape)
    mask = original(tf.ones(shape, tf.float32), rate, seed=seed)
    return x * tf.cast(mask, x.dtype)


def _uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
    original = _original["uniform"]
    if not (active() and _narrow(dtype)):
        return original(shape, minval=minval, maxval=maxval, dtype=dtype, seed=seed)
    return tf.cast(original(shape, minval=minval, maxval=maxval, dtype="float32", seed=seed),
                   dtype)


def install() -> None:
    """Wraps the backend's ``dropout`` and ``uniform`` (once; ``import
    keras_mp`` does it)."""
    if _original:
        return
    module = importlib.import_module(MODULE)
    wrappers = {"dropout": _dropout, "uniform": _uniform}
    for name, wrapper in wrappers.items():
        _original[name] = getattr(module, name)
        wrapper.__wrapped__ = _original[name]
        setattr(module, name, wrapper)
    _original["module"] = module
