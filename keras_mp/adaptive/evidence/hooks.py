"""Trace-time hooks: how the adaptive policy sees inside a Keras train step.

Keras has no forward hooks, and the adaptive policy must not cost anything on
the steps where it does not look. :class:`Hooks` wraps, per instance, the
callables that Keras looks up when it traces a step:

* each controlled layer's ``call`` (``quantized_call`` for a float8-capable
  layer, :mod:`keras_mp.adaptive.evidence.float8`): on a statistics trace, records the
  layer's forward statistics (:mod:`keras_mp.adaptive.evidence.forward`) and the order in which
  layers are called (the forward order, input first); a float8-capable
  layer's call also reports its float8 evidence, forward and backward;
* the optimizer's ``apply``, where the optimizer is not a
  :class:`keras_mp.LossScaleOptimizer` (which has its own
  ``statistics_sink``): on a statistics trace, measures the gradients
  (:func:`keras_mp.scaling.kernels.gradient_statistics`) and hands them to the sink.

With per-layer loss scales (:attr:`Hooks.layer_scale_of` set), the call of
every layer in :attr:`Hooks.boundaries` (the controlled layers not inside
another) runs between the boundaries of :mod:`keras_mp.scaling.layer_scales`
in every training trace: its inputs are cast from the float32 tensors Keras
cast them from, its outputs leave as float32, and its backward pass runs at
its own factor; on a statistics trace the boundaries also record the largest
gradient crossing them.

Each wrapper checks a Python flag **when the step is traced**. A *gated*
trace (:meth:`Hooks.recording` ``(gated=True)``) builds the statistics into
the step under a switch read when the step runs (:meth:`Hooks.set_statistics`):
each layer's statistics, each boundary's gradient maximum and the gradient
statistics sit in a ``tf.cond`` that runs them only while the switch is on, and
what the step accumulates is kept only then (a :class:`keras_mp.LossScaleOptimizer`
reads the switch through its ``statistics_gate``).
:class:`keras_mp.callbacks.AdaptivePrecision` trains plain and statistics steps
with one such trace (the float32 probe is a traced function of its own,
:mod:`keras_mp.adaptive.integration.step_functions`): a separate statistics trace holds a
second copy of the whole step.
On ResNet50V2 (64x64, batch 16, 2-core AMD EPYC, 20 calls, the graph) the
statistics trace added 21,469 graph operations to the process and grew it by
288-413 MiB; its forward statistics were 1,585 of those operations (55 MiB),
the rest a second copy of the step. With the train step pinned to the graph, one
gated trace lowered the process's peak from 1976 to 1828 MiB there, and on the
bench's CNN from 844 to 805 MiB (30 steps). A plain step of a gated trace skips
the statistics (a ``tf.cond`` per layer, its branch not taken): in one process,
5 interleaved rounds, gated against separate traces, process CPU ms per step,
ResNet50V2 600.0 / 610.8, the CNN 184.3 / 184.8, the bench's Transformer 1074.7 /
1065.3 (spreads 40-100 ms). The forward statistics recorded while a step is traced wait
in the hooks (per graph and thread) until the statistics sink of the same trace takes
them (:meth:`Hooks.take`), so one all-reduce and one accumulation serve gradients and
forward statistics alike.

Example (what a statistics trace records):
    >>> import keras, tensorflow as tf
    >>> from keras_mp.adaptive.evidence.hooks import Hooks
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3),
    ...                           keras.layers.ReLU()])
    >>> hooks = Hooks(model, model.layers)
    >>> @tf.function
    ... def step(x):
    ...     with hooks.recording(forward=True):
    ...         model(x, training=True)
    ...         return hooks.take()[0]
    >>> step(tf.ones([4, 2])).shape.as_list(), hooks.call_order
    ([2, 9], [0, 1])
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import keras
import tensorflow as tf

from keras_mp._installed import install_method, installed
from keras_mp.adaptive.evidence import float8, forward
from keras_mp.execution import remat
from keras_mp.scaling import kernels, layer_scales

__all__ = ["Hooks"]

_CALL_ATTR = "_keras_mp_wrapped_call"


def _current_graph():
    return tf.compat.v1.get_default_graph()


def _training() -> bool:
    """Whether the innermost Keras layer call runs in training mode, in a
    step (not in a scratch graph where Keras infers a call's output shapes,
    as ``keras.RematScope("larger_than")`` does inside a training call)."""
    from keras.src.backend.common import global_state  # no public equivalent
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    ctx = global_state.get_global_attribute("current_call_ctx")
    return bool(ctx is not None and ctx.training) and not in_symbolic_scope()


class Hooks:
    """Trace-time hooks on one model (see the module docstring).

    Args:
        model: the Keras model.
        layers: the layers to observe, indexed as in
            :class:`keras_mp.adaptive.evidence.stats.LayerStatistics`.

    Attributes:
        forward: record forward statistics in the step being traced.
        call_order: layer indices in the order of their first call in the
            last statistics trace (the forward order), or empty.
        layer_scale_of: per-layer loss scales: ``layer_scale_of(index)`` ->
            the factor (a float32 scalar tensor) of the layer at ``index``,
            read in the traced step; None: no boundaries.
        boundaries: the indices of the layers that get boundaries.
    """

    def __init__(self, model: keras.Model, layers: Sequence[keras.layers.Layer]):
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                            f"{type(model).__name__}.")
        bad = [layer for layer in layers if not isinstance(layer, keras.layers.Layer)]
        if bad:
            raise TypeError(f"`layers` must hold Keras layers, got {bad[0]!r}.")
        self.model = model
        self.layers = list(layers)
        self.forward = False
        self.gated = False
        self._switch: tf.Variable | None = None
        self._switch_on: bool | None = None
        self.call_order: list[int] = []
        self.layer_scale_of: Callable[[int], tf.Tensor] | None = None
        self.boundaries: set[int] = set()
        # Per (graph, thread): replicas of a MirroredStrategy trace the same
        # step in threads of their own.
        self._slots: dict[tuple[int, int], dict] = {}
        self._order: list[int] = []
        for i, layer in enumerate(self.layers):
            self._wrap_call(i, layer)

    # -- recording ------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self, *, forward: bool = False, gated: bool = False) -> Iterator[None]:
        """Sets the flags for the step traced inside the block, then clears them.

        Args:
            forward: record statistics (forward, gradients, boundaries).
            gated: the statistics run only on steps where the switch
                (:meth:`set_statistics`) is on; needs ``forward``.
        """
        if gated and not forward:
            raise ValueError(f"`gated`=True needs `forward`=True, got forward={forward!r}.")
        if gated:
            self.switch()
        old = (self.forward, self.gated)
        self.forward, self.gated = forward, gated
        try:
            yield
        finally:
            self.forward, self.gated = old

    def switch(self) -> tf.Variable:
        """The boolean variable a gated trace reads: True on statistics steps
        (created on the first call, off; not part of the model's state)."""
        if self._switch is None:
            with tf.init_scope():
                self._switch = tf.Variable(False, trainable=False,
                                           name="keras_mp_statistics_on")
            self._switch_on = False
        return self._switch

    def set_statistics(self, on: bool) -> None:
        """Turns statistics on or off for the next steps of a gated trace
        (assigns the switch only when it changes; call it outside the step)."""
        if not isinstance(on, bool):
            raise TypeError(f"`on` must be a bool, got {on!r}.")
        switch = self.switch()
        if self._switch_on != on:
            switch.assign(on)
            self._switch_on = on

    def statistics_on(self) -> tf.Tensor | None:
        """In the step being traced: a scalar bool tensor, whether this step
        records statistics (None in an ungated trace: it always does)."""
        return tf.convert_to_tensor(self._switch) if self.gated else None

    def when(self, compute: Callable, off: Callable):
        """``compute()`` in the step being traced; in a gated trace, only on
        statistics steps, and ``off()`` (the same structure) on the others."""
        on = self.statistics_on()
        return compute() if on is None else tf.cond(on, compute, off)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No forward recording inside the block (the probe's own passes)."""
        old, self.forward = self.forward, False
        try:
            yield
        finally:
            self.forward = old

    def _slot(self) -> dict:
        key = (id(_current_graph()), threading.get_ident())
        if key not in self._slots:
            # A new trace: what older traces left unconsumed is stale.
            self._slots = {k: v for k, v in self._slots.items() if k[0] == key[0]}
            self._slots[key] = {}
            self._order = []
        return self._slots[key]

    def _observe(self, index: int, layer, args, kwargs, outputs) -> None:
        inputs = forward.floating_tensors((args, kwargs))
        outs = forward.floating_tensors(outputs)
        slot = self._slot()
        if self.gated:
            # Measured at take(), all calls under one switch (_gated_rows).
            slot.setdefault("calls", []).append((index, inputs, outs, layer.compute_dtype))
        else:
            vec = forward.call_statistics(inputs, outs, layer.compute_dtype,
                                          slot.setdefault("ranges", {}))
            seen = slot.setdefault("forward", {})
            seen[index] = vec if index not in seen else forward.combine(seen[index], vec)
        slot.setdefault("dtypes", {})[index] = layer.compute_dtype

    def _gated_rows(self, calls: list) -> dict[int, tf.Tensor]:
        """The statistics of a gated trace's recorded ``calls`` (``(index,
        inputs, outputs, dtype)``, in call order), computed in **one**
        ``tf.cond`` on the switch: index -> raw statistics vector (zeros on
        plain steps).

        One ``tf.cond`` per call held a pair of branch functions per layer: on
        ResNet50V2 (64x64, batch 16, the graph, 2-core AMD EPYC) the first
        call of such a trace peaked 245 MiB above where it settled, and the
        run's peak was 1819 MiB against 1574 without forward statistics
        (Keras ``mixed_bfloat16``: 1620). Lowered to switches, one
        ``tf.cond`` still runs each call's reductions as soon as its tensors
        exist, as the ungated trace does.
        """
        indices = list(dict.fromkeys(i for i, *_ in calls))

        def compute():
            memo, rows = {}, {}
            for index, inputs, outs, dtype in calls:
                vec = forward.call_statistics(inputs, outs, dtype, memo)
                rows[index] = vec if index not in rows else forward.combine(rows[index], vec)
            return [rows[i] for i in indices]

        def off():
            return [tf.zeros([len(forward.RAW_FIELDS)]) for _ in indices]

        return dict(zip(indices, self.when(compute, off)))

    def _recorder(self, index: int) -> Callable | None:
        """Where a float8-capable layer's call reports its float8 evidence in
        the step being traced, or None when nothing is recorded."""
        if not (self.forward and _training()):
            return None
        if self.gated:
            raise ValueError("float8 evidence cannot be recorded in a gated trace (the "
                             "float8-capable call differs on statistics steps): trace with "
                             "`gated`=False.")

        def record(vec: tf.Tensor) -> None:
            seen = self._slot().setdefault("float8", {})
            seen[index] = vec if index not in seen else tf.maximum(seen[index], vec)
        return record

    def _backward_recorder(self, index: int) -> Callable:
        """Where a boundary of layer ``index`` records the largest finite
        gradient crossing it (at the global scale) in the step being traced."""
        def largest(g: tf.Tensor) -> tf.Tensor:
            a = tf.abs(tf.reshape(g, [-1]))
            return tf.reduce_max(tf.where(tf.math.is_finite(a), a, 0.0))

        on = self.statistics_on()  # read here, not in the custom gradient

        def record(g: tf.Tensor) -> None:
            amax = largest(g) if on is None else tf.cond(on, lambda: largest(g),
                                                         lambda: tf.constant(0.0))
            seen = self._slot().setdefault("backward", {})
            seen[index] = amax if index not in seen else tf.maximum(seen[index], amax)
        return record

    def _scaled(self, index: int, fn: Callable, args, kwargs, observe: bool):
        """``fn(*args, **kwargs)`` between the layer's loss-scale boundaries."""
        factor = tf.cast(self.layer_scale_of(index), tf.float32)
        inverse = 1.0 / factor
        record = self._backward_recorder(index) if observe else None

        def enter(t):
            if not isinstance(t, tf.Tensor) or not t.dtype.is_floating:
                return t
            out = layer_scales.boundary_in(layer_scales.cast_source(t), t.dtype, inverse,
                                           record)
            mask = getattr(t, "_keras_mask", None)
            if mask is not None:
                out._keras_mask = mask
            return out

        def leave(t):
            if not isinstance(t, tf.Tensor) or not t.dtype.is_floating:
                return t
            return layer_scales.boundary_out(t, factor, record)

        args, kwargs = keras.tree.map_structure(enter, (args, kwargs))
        return keras.tree.map_structure(leave, fn(*args, **kwargs))

    def _wrap_call(self, index: int, layer) -> None:
        # A float8-capable layer runs quantized_call (Keras dispatches on its
        # policy's quantization mode), whether float8 is on or off.
        name = "quantized_call" if float8.is_float8_layer(layer) else "call"
        if name == "quantized_call":
            setattr(installed(layer), float8.RECORDER_ATTR,
                    functools.partial(self._recorder, index))
        hooks = self

        def make(original):
            def observed(*args, **kwargs):
                hooks._slot()  # starts the order anew on a new trace
                if index not in hooks._order:
                    hooks._order.append(index)
                outputs = original(*args, **kwargs)
                hooks._observe(index, layer, args, kwargs, outputs)
                return outputs

            @functools.wraps(original)
            def call(*args, **kwargs):
                training = _training()
                observe = hooks.forward and training
                # A rematerialized call runs twice: its forward statistics are
                # the forward pass's; its gradient crosses the recomputed call.
                seen = observed if observe and not remat.recomputing() else original
                if training and hooks.layer_scale_of is not None and index in hooks.boundaries:
                    return hooks._scaled(index, seen, args, kwargs, observe)
                return seen(*args, **kwargs)
            return call

        install_method(layer, name, make)

    def hook_optimizer(self, optimizer, sink: Callable) -> None:
        """Measures gradients for ``sink`` in ``optimizer.apply`` on statistics
        traces (for optimizers without a ``statistics_sink`` of their own)."""
        hooks = self

        def make(original):
            @functools.wraps(original)
            def apply(grads, trainable_variables=None):
                if hooks.forward:
                    grads = list(grads)
                    tvars = trainable_variables if trainable_variables is not None \
                        else optimizer._trainable_variables
                    zeros = lambda: kernels.GradientStatistics(  # noqa: E731
                        *[tf.zeros([len(grads)])] * len(kernels.STATISTICS))
                    stats = hooks.when(lambda: kernels.gradient_statistics(grads, 1.0), zeros)
                    sink(stats, tf.constant(1.0), tvars)
                return original(grads, trainable_variables)
            return apply

        install_method(optimizer, "apply", make)

    def take(self) -> tuple[tf.Tensor | None, tf.Tensor | None, tf.Tensor | None]:
        """What the step being traced recorded, and forgets it.

        Returns:
            ``(forward, observed, backward)``: forward statistics as a
            ``[len(layers), len(forward.FIELDS)]`` tensor (zeros where a layer
            was not called) and a ``[len(layers)]`` 0/1 tensor saying which
            were, or None, None if nothing was recorded; ``backward`` the largest gradient
            at each layer's loss-scale boundaries (``[len(layers)]``, at the
            global scale), or None.
        """
        pending = self._slots.pop((id(_current_graph()), threading.get_ident()), {})
        back = pending.get("backward", {})
        backward = tf.stack([back.get(i, tf.constant(0.0)) for i in range(len(self.layers))]) \
            if back else None
        if not {"forward", "calls"} & pending.keys():
            return None, None, backward
        seen = pending.get("forward", {})
        if pending.get("calls"):
            seen = {**seen, **self._gated_rows(pending["calls"])}
        f8 = pending.get("float8", {})
        if self._order:
            self.call_order = list(self._order)
        if not seen:
            return None, None, backward
        zeros = tf.zeros([len(forward.RAW_FIELDS)])
        dtypes = pending.get("dtypes", {})
        rows = forward.finish(tf.stack([seen.get(i, zeros) for i in range(len(self.layers))]),
                              [dtypes.get(i, "float32") for i in range(len(self.layers))])
        if f8:
            rows = tf.stack([forward.with_float8(r, f8[i]) if i in f8 else r
                             for i, r in enumerate(tf.unstack(rows))])
        observed = tf.constant([1.0 if i in seen else 0.0 for i in range(len(self.layers))])
        return rows, observed, backward

