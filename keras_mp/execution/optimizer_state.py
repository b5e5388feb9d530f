"""The optimizer's variables, made before the train step is first traced.

Without a distribution strategy, Keras leaves building the optimizer to the
first trace of the train step (its slots, e.g. Adam's two moments, are
created there). A ``tf.function`` that creates variables on its first call
is traced a second time, with variable creation forbidden, and keeps both
traces for good (``one_step_on_data``'s variable-creation trace stays in
its cache). So every Keras train function holds two graphs of the step.
Built before the first call, the optimizer creates nothing in the trace, and
the step is traced once.

Measured on keras.applications ResNet50V2 (64x64, batch 16, Keras
``mixed_bfloat16``, Adam, 2-core AMD EPYC with AVX512-BF16): 30 steps of
``fit`` peaked at 1651 MiB resident, and at 1477 MiB with the optimizer built
first. Under a strategy Keras builds the optimizer itself, before the first
trace (``Trainer._symbolic_build``); :func:`build` does what that does for
the optimizer, in the strategy's scope.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="adam", loss="mse")
    >>> build(model), model.optimizer.built
    (True, True)
    >>> build(model)   # built already: nothing to do
    False
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import keras

__all__ = ["build", "build_metrics", "inner", "metrics_built_first"]

_log = logging.getLogger("keras_mp")


def inner(optimizer: Any) -> keras.optimizers.Optimizer:
    """The optimizer whose variables are updated: a loss-scale wrapper's inner
    optimizer, else ``optimizer`` itself.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.

    Example:
        >>> import keras
        >>> sgd = keras.optimizers.SGD()
        >>> inner(keras.optimizers.LossScaleOptimizer(sgd)) is sgd, inner(sgd) is sgd
        (True, True)
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a keras.optimizers.Optimizer, got {optimizer!r}.")
    return getattr(optimizer, "inner_optimizer", optimizer)


def build(model: keras.Model) -> bool:
    """Builds ``model``'s optimizer for its trainable variables, where it is
    not built yet and the model's own variables all exist.

    A model with a layer not built yet (one whose variables its first call
    creates) is left as it is: the trace creates variables anyway, and the
    optimizer must see them all.

    Args:
        model: a compiled Keras model.

    Returns:
        True if the optimizer was built now.

    Raises:
        TypeError: ``model`` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or optimizer.built:
        return False
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    # As the optimizer's own apply() builds it: the same variable paths.
    with model.distribute_strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(model.trainable_variables)
    optimizer.built = True
    return True


def build_metrics(model: keras.Model, batch: Any) -> bool:
    """Builds ``model``'s compiled metrics and losses (and any layer not
    built yet) from ``batch`` (one batch as ``fit`` gives it: ``(x, y)`` or
    ``(x, y, sample_weight)``), where they are not built yet, as Keras does
    before the first trace under a distribution strategy
    (``Trainer._symbolic_build``, symbolically: nothing is computed).
    Without a strategy Keras creates their variables in the train step's
    first trace; the execution trial
    (:mod:`keras_mp.execution.step_trial`), which copies the training state
    before that trace, needs them to exist first.

    Returns:
        True if something was built now.

    Raises:
        TypeError: ``model`` is not a Keras model.

    Example:
        >>> import keras, numpy as np
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> build_metrics(model, (np.ones((8, 4), "float32"), np.ones((8, 2), "float32")))
        True
        >>> [v.path for v in model.metrics_variables if "absolute" in v.path]
        ['mean_absolute_error/total', 'mean_absolute_error/count']
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    unbuilt = [getattr(model, attr, None) for attr in ("_compile_metrics", "_compile_loss")]
    if all(part is None or part.built for part in unbuilt) \
            and all(layer.built for layer in model._flatten_layers()):
        return False
    model._symbolic_build(data_batch=batch)
    return True


def metrics_built_first(model: keras.Model, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn`` (a train function of ``model``), whose first call builds the
    model's compiled metrics and losses (:func:`build_metrics`) from what its
    iterator yields, its ``element_spec`` (nothing is read from it), before
    ``fn`` traces the step. Keras creates their variables in the step's first
    trace, and a ``tf.function`` that creates variables is traced twice:
    keras.io's character-level LSTM seq2seq (``metrics=["accuracy"]``) traced
    its train step twice, 0.6-0.8 s each on a 2-core AMD EPYC.

    Example:
        >>> import keras, numpy as np, tensorflow as tf
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> data = tf.data.Dataset.from_tensors((tf.ones([8, 4]), tf.ones([8, 2])))
        >>> fn = metrics_built_first(model, lambda iterator: model._compile_metrics.built)
        >>> fn(iter(data)), fn(iter(data))
        (True, True)
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    first = [True]

    @functools.wraps(fn)
    def call(iterator, *args, **kwargs):
        if first[0]:
            first[0] = False
            spec = getattr(iterator, "element_spec", None) if _trace_would_build(model) else None
            if spec is None and isinstance(iterator, (list, tuple)) and iterator:
                spec = iterator[0]  # a list of batches (read already)
            if spec is not None:
                try:
                    build_metrics(model, spec)
                except Exception as e:  # noqa: BLE001 - Keras builds them in the trace then
                    # A model Keras cannot call symbolically (Keras itself does so only
                    # under a distribution strategy): as without keras-mp.
                    _log.debug("keras_mp: metrics not built before the first trace: %s", e)
        return fn(iterator, *args, **kwargs)
    return call


def _trace_would_build(model: keras.Model) -> bool:
    """Whether the first trace of ``model``'s step would create variables that
    :func:`build_metrics` makes first: compiled metrics, a layer not built,
    or the per-output loss trackers of a compiled loss with several terms. A
    single loss of a single-output functional model makes none, and its
    symbolic build (a call of the whole model) would only cost time."""
    metrics, loss = getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None)
    if (metrics is not None and not metrics.built) \
            or not all(layer.built for layer in model._flatten_layers()):
        return True
    if loss is None or loss.built:
        return False
    single_output = len(getattr(model, "outputs", None) or ()) == 1
    return not (single_output and not keras.tree.is_nested(loss._user_loss))
