"""``LossScaleOptimizer(max_consecutive_skips=n)``: the stop of a run that
can only skip, as a Python exception whose message is the sentence that
says why (the steps, the limit, the scale, the variables) and what to do.

Inside a compiled train step the stop is an in-graph assertion, which
TensorFlow reports as ``tf.errors.InvalidArgumentError`` at the end of some
2,700 characters of "Graph execution error" and op stack. ``model.fit``
(wrapped on import, :mod:`keras_mp.adaptive.fit.autofit`) turns that error
into :class:`TooManySkipsError` with the sentence alone (:func:`readable`);
``optimizer.apply`` run eagerly raises it directly. A custom loop under
``tf.function`` still gets TensorFlow's error, the sentence after
"assertion failed:".

Example:
    >>> import keras, numpy as np, keras_mp
    >>> from keras_mp.scaling.skips import TooManySkipsError
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(keras_mp.LossScaleOptimizer(keras.optimizers.SGD(),
    ...                                           max_consecutive_skips=2), "mse")
    >>> x = np.full((8, 2), np.nan, "float32")
    >>> try:
    ...     model.fit(x, np.ones((8, 1)), batch_size=2, verbose=0)
    ... except TooManySkipsError as e:
    ...     print(str(e)[:73])
    keras_mp.LossScaleOptimizer: 3 consecutive steps had non-finite gradients
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from keras import ops

__all__ = ["TooManySkipsError", "check", "readable"]

_HEAD = "keras_mp.LossScaleOptimizer: "
_FOUND = re.compile(re.escape(_HEAD) + r"\d+ consecutive steps had non-finite gradients[^\]]*")


class TooManySkipsError(RuntimeError):
    """More consecutive steps had non-finite gradients than
    ``LossScaleOptimizer(max_consecutive_skips=...)`` allows: the message
    names the variables whose gradients were not finite and the loss scale."""


def _sentence(steps: Any, limit: int, scale: Any, names: Any) -> str:
    return (f"{_HEAD}{steps} consecutive steps had non-finite gradients "
            f"(max_consecutive_skips={limit}), and lowering the loss scale (now {scale}) did "
            "not make them finite: look for NaN/inf in the input data or a diverging learning "
            f"rate, or raise max_consecutive_skips. Non-finite gradients in: {names}")


def check(consecutive: Any, nonfinite: Any, names: Sequence[str], limit: int,
          scale: Any) -> None:
    """Stops the run once ``consecutive`` (skipped steps in a row) exceeds
    ``limit``: :class:`TooManySkipsError` when run eagerly, an in-graph
    assertion in a traced step. ``nonfinite`` flags ``names`` (the
    variables' paths) whose gradients were not finite in this step."""
    if tf.executing_eagerly():
        if int(consecutive) > limit:
            bad = [n for n, flag in zip(names, np.asarray(nonfinite)) if flag > 0]
            raise TooManySkipsError(_sentence(int(consecutive), limit,
                                              f"{float(scale):g}", ", ".join(bad)))
        return

    def fail():
        # Formatted only when the limit is exceeded: string ops on every
        # training step would cost time for a message rarely shown.
        bad = tf.strings.reduce_join(
            tf.boolean_mask(tf.constant(list(names)), nonfinite > 0), separator=", ")
        tf.debugging.Assert(False, [tf.strings.format(
            _sentence("{}", limit, "{}", "{}"), (consecutive, scale, bad))], summarize=1)

    ops.cond(consecutive > limit, fail, lambda: None)


def readable(error: BaseException) -> TooManySkipsError | None:
    """The :class:`TooManySkipsError` that ``error`` (TensorFlow's, from a
    compiled step that :func:`check` stopped) carries, or None for any other
    error."""
    found = _FOUND.search(str(error))
    # tf.strings.format quotes the joined names: \"a, b\"
    return None if found is None else TooManySkipsError(
        found.group(0).replace('\\"', "").strip())
