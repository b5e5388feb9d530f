"""Whether adapting a fit can pay off: the most 16-bit arithmetic could save
in it, against the least that adaptation costs to start.

Adapting a fit has a fixed cost: the traces of its statistics and probe steps
and the early judgement. On the smallest model there is (keras-io's
"customizing fit" model, ``Dense(1)`` on 32 features, 96 steps) it was 0.78 s
of a 1.41 s fit under ``"adaptive"`` against 0.63 s for Keras ``float32``, and
0.85 s under ``"adaptive_float16"`` against 0.83 s for Keras ``mixed_float16``
(2-core Intel Xeon with AMX-BF16, median of 5 fresh processes). What a
narrower dtype can save is bounded by the time of the arithmetic it makes
cheaper: a step whose matmuls and convolutions do ``W`` FLOPs runs them in
``W / R`` seconds at the device's measured float32 matmul throughput ``R``
(:func:`keras_mp.device.profile`), and no dtype saves more than all of it.
Over a fit of ``n`` steps that is ``n * W / R``; where it is below
:data:`START_UP_S` (under the cost measured above), adaptation cannot pay off:
the fit trains its layers in float32, which is never less accurate and, at
that size, no slower. On the model above ``W`` is 6 kFLOP a step, and its fit
could save 8 microseconds.

``W`` counts ``6 * batch`` multiply-adds per weight and use (forward, and the
two products of the backward pass): a weight is used once per sample in a
``Dense`` on vectors, once per position in a convolution or a ``Dense`` on
sequences (the layer's output positions). It is known where every layer with
weights was called on a Keras symbolic input of known shape (functional and
``Sequential`` models); elsewhere (subclassed models, layers called inside
other layers, unknown sequence lengths, data of unknown size) nothing is
known, and the fit adapts. Elementwise work is not counted: a model of few
weights on large activations (where 16 bits would halve the memory traffic)
is judged by its weight products alone.

Example:
    >>> import keras, keras_mp
    >>> from keras_mp.adaptive.decisions import gain
    >>> with keras_mp.policy_scope("adaptive_bfloat16"):
    ...     model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(1)])
    >>> gain.step_work(model, batch_size=32)
    6336.0
    >>> gain.fit_steps(keras.ops.zeros((1000, 32)), None, epochs=3)
    (32, 96)
    >>> gain.most_saved(6336.0, 96, float32_gflops=100.0) < gain.START_UP_S
    True
"""

from __future__ import annotations

import math
from typing import Any

import keras
import tensorflow as tf

from keras_mp import _checks as checks
from keras_mp import device

__all__ = ["START_UP_S", "fit_steps", "most_saved", "pays_off", "step_work"]

#: The least adaptation's start-up was measured to cost (module docstring), in seconds.
START_UP_S = 0.5

_KERAS_BATCH = 32  # Keras's fit batches arrays by 32 when no batch_size is given


def _uses(layer: keras.layers.Layer) -> int | None:
    """How many times per sample ``layer``'s weights are used, summed over
    its calls in the model's graph, or None where a call's output shape is
    unknown or there is none."""
    nodes = getattr(layer, "_inbound_nodes", None) or []
    total = 0
    for node in nodes:
        for out in node.outputs:
            shape = tuple(out.shape)[1:-1]
            if any(d is None for d in shape):
                return None
            total += math.prod(shape)
    return total or None


def step_work(model: keras.Model, batch_size: int) -> float | None:
    """FLOPs of one train step's weight products (forward and backward) on
    batches of ``batch_size``, or None where it is not known.

    Args:
        model: a built Keras model.
        batch_size: an int >= 1.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    checks.count("batch_size", batch_size, 1)
    if not model.built or not model.weights:
        return None
    uses = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.Model) or not layer.weights:
            continue
        if list(layer._flatten_layers(include_self=False)):
            return None  # weights of sublayers called inside this layer's call
        n = _uses(layer)
        if n is None:
            return None
        uses += n * sum(math.prod(w.shape) for w in layer.weights)
    return float(6 * batch_size * uses)


def _first_leaf(x: Any):
    leaves = keras.tree.flatten(x) if x is not None else []
    return leaves[0] if leaves else None


def fit_steps(x: Any, batch_size: int | None, epochs: int = 1, steps_per_epoch: int | None = None,
              initial_epoch: int = 0) -> tuple[int, int] | None:
    """``(batch size, train steps)`` of a ``fit(x, ...)`` with these arguments,
    or None where the data does not say (a generator, a ``PyDataset``, a
    dataset of unknown size or batch).

    Arrays (NumPy, tensors, or nests of them) are batched by ``batch_size``
    (32 when None, as Keras does); a ``tf.data.Dataset`` by its own batch
    when its leading dimension is static.
    """
    if not isinstance(epochs, int) or not isinstance(initial_epoch, int):
        return None
    epochs = max(0, epochs - initial_epoch)
    if isinstance(x, tf.data.Dataset):
        shape = getattr(_first_leaf(x.element_spec), "shape", None)
        batch = shape[0] if shape is not None and shape.rank else None
        size = int(x.cardinality())
        per_epoch = steps_per_epoch or (size if size >= 0 else None)
    else:
        first = _first_leaf(x)
        rows = getattr(first, "shape", None) if hasattr(first, "__array__") else None
        if not rows or rows[0] is None:
            return None  # a generator, a PyDataset, a scalar
        batch = batch_size or _KERAS_BATCH
        per_epoch = steps_per_epoch or -(-int(rows[0]) // batch)
    if not batch or not per_epoch:
        return None
    return int(batch), int(per_epoch) * epochs


def most_saved(work: float, steps: int, float32_gflops: float) -> float:
    """Seconds a narrower dtype could save at most: all of the float32
    arithmetic time of ``steps`` steps of ``work`` FLOPs each (inf where
    nothing was measured: ``float32_gflops`` 0)."""
    work, steps = checks.non_negative("work", work), checks.count("steps", steps, 0)
    if checks.non_negative("float32_gflops", float32_gflops) == 0:
        return math.inf
    return steps * work / (float32_gflops * 1e9)


def pays_off(model: keras.Model, fit_arguments: dict[str, Any],
             min_saving: float = START_UP_S) -> bool:
    """Whether adapting ``model.fit(**fit_arguments)`` can pay off: False only
    where the fit's size is known and the most it could save is under
    ``min_saving`` seconds.

    Args:
        model: the model being fitted.
        fit_arguments: ``fit``'s arguments by name (``x``, ``batch_size``,
            ``epochs``, ``steps_per_epoch``, ``initial_epoch``).
        min_saving: seconds, a number >= 0 (0: every fit pays off).
    """
    if not isinstance(fit_arguments, dict):
        raise TypeError(f"`fit_arguments` must be a dict, got {type(fit_arguments).__name__}.")
    if checks.non_negative("min_saving", min_saving) == 0:
        return True
    size = fit_steps(fit_arguments.get("x"), fit_arguments.get("batch_size"),
                     fit_arguments.get("epochs", 1), fit_arguments.get("steps_per_epoch"),
                     fit_arguments.get("initial_epoch", 0))
    if size is None:
        return True
    work = step_work(model, size[0])
    if work is None:
        return True
    gflops = device.profile().throughput.get("float32", 0.0)
    return most_saved(work, size[1], gflops) >= min_saving

