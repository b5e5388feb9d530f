"""Batches read once from a ``tf.data`` iterator, fed again to the train
function Keras traced for that iterator.

keras-mp reads a call's batches itself in two places: the execution trial
runs the same batches through each mode before the call trains on them
(:mod:`keras_mp.execution.step_trial`), and the probe step runs the probe on
its batch before the statistics step trains on it
(:mod:`keras_mp.adaptive.integration.step_functions`). Keras's train function
takes a ``tf.data`` iterator through the function it traced for the fit, and
a list of batches through another one (its inner step function, called from
eager code), whose first call is a graph optimization of the whole step of
its own: on keras.io's timeseries FCN (2-core AMD EPYC with AVX512-BF16) the
probe step's statistics step took 0.45 s where the same step takes 25 ms.
So the batches go back in as an iterator of the first one's exact
``element_spec`` (a different spec would be a trace of its own).

:func:`iterator_over` makes it from the tensors (``from_tensor_slices`` and
``batch``: no Python in the pipeline). A dataset from a Python generator
(``from_generator``) reproduces any spec, but it runs Python for every
element inside the call: the execution trial timed the collaborative
filtering recommender's 2 ms step at 14.6-15.7 ms a call that way, the same
12 ms added to every mode, which hid what a mode saves.

Example:
    >>> import tensorflow as tf
    >>> from keras_mp.execution import replay
    >>> it = iter(tf.data.Dataset.from_tensor_slices((tf.ones([4, 2]), tf.ones([4]))).batch(2))
    >>> again = replay.iterator_over([next(it)], it.element_spec)
    >>> again.element_spec == it.element_spec, next(again)[0].shape.as_list()
    (True, [2, 2])
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["iterator_over"]


def iterator_over(batches: list, spec: Any) -> tf.data.Iterator | None:
    """A new iterator over ``batches`` (each a nest of dense tensors with
    one leading batch dimension) whose ``element_spec`` is ``spec``, with
    no Python in its pipeline; None where it cannot have that spec (a part
    that is not a dense tensor, such as the ``tf.experimental.Optional`` of a
    generator's missing input, or a fixed batch size the batches do not have).

    Args:
        batches: a list of batches, as a ``tf.data`` iterator gave them.
        spec: that iterator's ``element_spec``.
    """
    if not isinstance(batches, list):
        raise TypeError(f"`batches` must be a list, got {type(batches).__name__}.")
    if not batches or not all(isinstance(t, tf.Tensor) and t.shape.rank
                              for b in batches for t in tf.nest.flatten(b)):
        return None
    specs = tf.nest.flatten(spec)
    fixed = bool(specs) and all(getattr(s, "shape", None) is not None and s.shape.rank
                                and s.shape[0] is not None for s in specs)
    try:
        dataset = None
        for batch in batches:
            rows = tf.nest.flatten(batch)[0].shape[0]
            one = tf.data.Dataset.from_tensor_slices(batch).batch(rows, drop_remainder=fixed)
            dataset = one if dataset is None else dataset.concatenate(one)
        if dataset.element_spec != spec:
            return None
        return iter(dataset)
    except (TypeError, ValueError, tf.errors.OpError):  # shapes that do not slice alike
        return None
