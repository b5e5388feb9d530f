"""Rematerialization (``keras.RematScope``, ``keras.remat``) that works on
TensorFlow in graph mode: the same gradients as without it, half the
activation memory.

Keras 3.15.1's TensorFlow ``remat`` is ``tf.recompute_grad(f)``. Measured on
the bench's Transformer (4 post-norm blocks, T=256, d=512, batch 16, Adam,
``mixed_bfloat16``, ``fit`` as a graph; ``python -m
benchmarks.transformer_memory``), it fails in four ways:

1. **A keyword argument crashes it** in graph mode ("The custom_gradient
   decorator currently supports keywords arguments only when eager execution
   is enabled"): ``RematScope("full")`` on any functional model (Keras passes
   ``training=``), ``"larger_than"`` on ``MultiHeadAttention``, any layer
   called with ``training=`` or ``mask=``. Only ``"activations"`` ran.
2. **The recomputation runs outside the layer's call**: outside its autocast
   scope (under a mixed policy the recomputed layer reads float32 kernels:
   "Input 'b' of 'MatMul' Op has type float32 that does not match type
   bfloat16") and outside its call context (sublayers called without
   ``training`` recompute in inference mode: a ``Dropout`` keeps every unit).
3. **It draws new random numbers**: the forward pass moved each
   ``SeedGenerator``'s state on, so a recomputed ``Dropout`` drops other
   units than the forward pass did, and the gradient is not the loss's.
4. **It assigns and adds again** what the forward pass assigned and added:
   ``BatchNormalization``'s moving statistics move twice a step, an
   ``add_loss`` term from inside a call counts twice.
5. **``"larger_than"`` asks each layer's ``compute_output_spec`` about the
   call's own tensors** (``Operation.rematerialized_call``), which some layers
   read as Keras tensors: every model with a residual ``Add`` (ResNet50V2
   built inside the scope) fails with "'SymbolicTensor' object has no
   attribute 'sparse'", on any backend.

Here (installed on import, ``keras_mp/_keras_changes.py``, change
``remat``, only where the installed Keras still has faults 1 and 5), the
tensors of the call go through ``tf.recompute_grad`` as positional inputs and
everything else (Python values, ``training``, integer and boolean tensors)
is closed over; the recomputation runs inside the forward pass's autocast
scope and call context, and inside a ``keras.StatelessScope`` that reads
every ``SeedGenerator`` of the layer (and the global one) as the forward pass
read it and keeps every assignment and loss to itself. keras-mp's forward
statistics are recorded on the forward pass only (:func:`recomputing`), and
``"larger_than"`` measures a call's output from Keras tensors of its inputs'
shapes and dtypes (:func:`output_measured_symbolically`). A call
with no floating-point tensor runs without rematerialization (there is no
gradient to recompute for). ``tf.recompute_grad`` makes the recomputation wait
for the incoming gradient, so the executor cannot run it early.

What it saves, same machine class (2-core AMD EPYC with AVX512-BF16), the
model above built inside the scope, one fresh process per variant, single
runs, TensorFlow's allocator peak: ``mixed_bfloat16`` 1199 MiB,
``RematScope("activations")`` 984 (Keras's own), ``"full"`` 565,
``"larger_than"`` 528 (each layer's intermediates are recomputed, the
attention scores the largest); the step costs one more forward pass.
docs/memory.md has the benchmark (3 runs of each variant).

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> import keras_mp  # installs the change
    >>> with keras.RematScope("full"):
    ...     layer = keras.layers.Dropout(0.5, seed=1)
    >>> x = tf.ones([2, 4])
    >>> @tf.function
    ... def grad():
    ...     with tf.GradientTape() as tape:
    ...         tape.watch(x)
    ...         y = layer(x, training=True)
    ...     return y, tape.gradient(y, x)
    >>> y, g = grad()
    >>> bool(np.array_equal(y.numpy() != 0, g.numpy() != 0))  # the same units dropped
    True
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

__all__ = ["FAULT", "install", "keras_has_fault", "output_measured_symbolically", "recomputing",
           "remat"]

#: The error Keras's ``remat`` raises for a keyword argument in graph mode.
FAULT = "supports keywords arguments only when eager execution is enabled"

_local = threading.local()
_state: dict[str, Any] = {"keras_remat": None, "keras_rematerialized_call": None}


def recomputing() -> bool:
    """Whether this thread is recomputing a rematerialized call (the
    backward pass of :func:`remat`): forward statistics are not recorded
    there."""
    return getattr(_local, "depth", 0) > 0


def _layers_of(f: Callable) -> list:
    """The layers a call of ``f`` runs: its layer's tree (``f`` a bound method
    of a layer, or a wrapper of one such as keras-mp's hooks install), else
    none."""
    while f is not None and not hasattr(f, "__self__"):
        f = getattr(f, "__wrapped__", None)
    owner = getattr(f, "__self__", None)
    return list(owner._flatten_layers(include_self=True)) \
        if isinstance(owner, keras.layers.Layer) else []


def _seed_generators(layers: list) -> list:
    """The seed generators a call may draw from: those of its ``layers``
    (:func:`_layers_of`) and Keras's global one."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    found = []
    for layer in layers:
        found.extend(getattr(layer, "_seed_generators", ()))
    shared = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    if shared is not None:
        found.append(shared)
    return list({id(g): g for g in found}.values())


def _loss_marks(layers: list, outer) -> tuple:
    """Where each layer's losses end before a call (its own list, and the
    collecting stateless scope's)."""
    collecting = outer is not None and outer.collect_losses
    return (layers, [len(layer._losses) for layer in layers],
            len(outer.losses) if collecting else None, outer if collecting else None)


def _losses_added(marks: tuple, outer) -> list[tuple[Any, list, int]]:
    """The losses the call added since :func:`_loss_marks`, layer by layer, as
    ``(layer, list holding it, index)``."""
    layers, own, start, scope = marks
    added = []
    for layer, n in zip(layers, own):
        added += [(layer, layer._losses, i) for i in range(n, len(layer._losses))]
        if scope is not None:
            added += [(layer, scope.losses, i) for i in range(start, len(scope.losses))
                      if id(scope.losses[i]) in layer._loss_ids]
    return added


def _losses_recomputed(layers: list, scope) -> list:
    """The losses the recomputation added (in ``scope``), in the order of
    :func:`_losses_added`; their ids leave the layers' records."""
    found = []
    for layer in layers:
        mine = [x for x in scope.losses if id(x) in layer._loss_ids]
        layer._loss_ids.difference_update(id(x) for x in mine)
        found += mine
    return found


@contextlib.contextmanager
def _as_in_forward(autocast, call_context, mapping: dict[int, Any]):
    """The recomputation's surroundings: the forward pass's autocast scope and
    call context, and a stateless scope that reads ``mapping`` (variable id
    -> value), applies nothing and collects the losses added (yielded)."""
    from keras.src.backend.common import global_state
    from keras.src.backend.common.stateless_scope import StatelessScope

    scope = StatelessScope(collect_losses=True, initialize_variables=False)
    scope.state_mapping = dict(mapping)
    old_context = global_state.get_global_attribute("current_call_ctx")
    global_state.set_global_attribute("current_call_ctx", call_context)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with scope, (autocast if autocast is not None else contextlib.nullcontext()):
            yield scope
    finally:
        _local.depth -= 1
        global_state.set_global_attribute("current_call_ctx", old_context)


def remat(f: Callable) -> Callable:
    """``f`` rematerialized: its intermediate tensors are not kept for the
    gradient, but computed again from its inputs on the backward pass, as the
    forward pass computed them (module docstring). Keras's ``keras.remat``
    and ``keras.RematScope`` call it on TensorFlow once keras-mp is imported.

    Args:
        f: a callable (a layer's ``call``, an activation, any function of
            tensors).

    Returns:
        A callable with ``f``'s signature.

    Example:
        >>> import keras, tensorflow as tf
        >>> dense = keras.layers.Dense(3, activation="relu")
        >>> x = tf.ones([2, 4])
        >>> _ = dense(x)
        >>> @tf.function
        ... def grads(fn):
        ...     with tf.GradientTape() as tape:
        ...         y = tf.reduce_sum(fn(x) ** 2)
        ...     return tape.gradient(y, dense.trainable_variables)
        >>> a, b = grads(dense.call), grads(remat(dense.call))
        >>> all(bool(tf.reduce_all(p == q)) for p, q in zip(a, b))
        True
    """
    if not callable(f):
        raise TypeError(f"`f` must be callable, got {f!r} of type {type(f).__name__}.")

    @functools.wraps(f)
    def rematerialized(*args, **kwargs):
        from keras.src.backend.common import global_state
        from keras.src.backend.common.stateless_scope import get_stateless_scope
        from keras.src.backend.common.variables import get_autocast_scope

        flat = keras.tree.flatten((args, kwargs))
        where = [i for i, x in enumerate(flat)
                 if tf.is_tensor(x) and not isinstance(x, (tf.SparseTensor, tf.RaggedTensor))
                 and x.dtype.is_floating]
        if not where:
            return f(*args, **kwargs)  # nothing to differentiate
        outer = get_stateless_scope()
        # What the forward pass reads, read before it runs (automatic control
        # dependencies order the read before the forward pass's assignments).
        mapping = dict(outer.state_mapping) if outer is not None else {}
        layers = _layers_of(f)
        for generator in _seed_generators(layers):
            mapping[id(generator.state)] = tf.identity(generator.state.value)
        autocast = get_autocast_scope()
        call_context = global_state.get_global_attribute("current_call_ctx")
        passes = {"forward": True}
        structure: dict[str, Any] = {}

        def inner(*tensors):
            values = list(flat)
            for i, t in zip(where, tensors):
                values[i] = t
            a, k = keras.tree.pack_sequence_as((args, kwargs), values)
            if passes.pop("forward", False):
                marks = _loss_marks(layers, outer)
                out = f(*a, **k)
                leaves = keras.tree.flatten(out)
                structure.update(out=out, leaves=leaves, added=_losses_added(marks, outer),
                                 tensors=[i for i, x in enumerate(leaves) if tf.is_tensor(x)])
                losses = [place[i] for _, place, i in structure["added"]]
            else:
                with _as_in_forward(autocast, call_context, mapping) as scope:
                    leaves = keras.tree.flatten(f(*a, **k))
                losses = _losses_recomputed(layers, scope)
                if len(losses) != len(structure["added"]):
                    raise ValueError(
                        f"{getattr(f, '__qualname__', f)!r} added {len(structure['added'])} "
                        f"losses on its forward pass and {len(losses)} when recomputed: a "
                        "rematerialized call must add the same losses each time it runs.")
            return [leaves[i] for i in structure["tensors"]] + losses

        results = tf.recompute_grad(inner)(*[flat[i] for i in where])
        count = len(structure["tensors"])
        leaves = list(structure["leaves"])
        for i, t in zip(structure["tensors"], results[:count]):
            leaves[i] = t
        # Losses added inside the call take the rematerialized path too, so that
        # their gradient reaches what they were computed from.
        for (layer, place, i), t in zip(structure["added"], results[count:]):
            if id(place[i]) in layer._loss_ids:
                layer._loss_ids.discard(id(place[i]))
                layer._loss_ids.add(id(t))
            place[i] = t
        return keras.tree.pack_sequence_as(structure["out"], leaves)

    return rematerialized


def _symbolic(x):
    if isinstance(x, tf.SparseTensor):
        return keras.KerasTensor(x.shape, x.dtype, sparse=True)
    if tf.is_tensor(x) and not isinstance(x, tf.RaggedTensor):
        return keras.KerasTensor(x.shape, x.dtype)
    return x


def output_measured_symbolically(original: Callable) -> Callable:
    """Keras's ``Operation.rematerialized_call`` (``original``), handed Keras
    tensors of the call's tensors (the same shapes and dtypes): it reads them
    only to size the output in ``"larger_than"`` mode (fault 5 of the module
    docstring), and the call itself gets the real ones."""
    @functools.wraps(original)
    def rematerialized_call(self, fn, *args, **kwargs):
        mode = getattr(self, "_remat_mode", None)
        if mode is not None and mode.mode == "larger_than":
            args, kwargs = keras.tree.map_structure(_symbolic, (args, kwargs))
        return original(self, fn, *args, **kwargs)
    rematerialized_call.__wrapped__ = original
    return rematerialized_call


def keras_has_fault() -> bool:
    """Whether the installed Keras's TensorFlow ``remat`` still fails on a
    keyword argument in graph mode (fault 1 of the module docstring): a call
    of it, traced (tests/test_keras_changes.py)."""
    from keras.src.backend.tensorflow import core

    original = _state["keras_remat"] or core.remat

    @tf.function
    def call():
        x = tf.ones([2])
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = original(lambda t, scale: t * scale)(x, scale=2.0)
        return tape.gradient(y, x)

    try:
        call()
    except ValueError as e:
        if FAULT in str(e):
            return True
        raise
    return False


def install() -> None:
    """Replaces Keras's TensorFlow ``remat`` with :func:`remat` (once), where
    the installed Keras's is still ``tf.recompute_grad(f)`` (which has fault
    1: :func:`keras_has_fault`), and wraps ``Operation.rematerialized_call``
    (:func:`output_measured_symbolically`) where it still sizes the output
    from the call's own tensors (fault 5)."""
    from keras.src.backend.tensorflow import core

    from keras.src.ops.operation import Operation

    # Read from the source, not called: a traced call at import costs time.
    if _state["keras_remat"] is None and \
            "return tf.recompute_grad(f)" in inspect.getsource(core.remat):
        _state["keras_remat"] = core.remat
        core.remat = remat
    if _state["keras_rematerialized_call"] is None and "self.compute_output_spec(*args, **kwargs)" \
            in inspect.getsource(Operation.rematerialized_call):
        _state["keras_rematerialized_call"] = Operation.rematerialized_call
        Operation.rematerialized_call = output_measured_symbolically(
            Operation.rematerialized_call)
