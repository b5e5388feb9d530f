"""The float32 probe: how much rounding in the configured dtypes costs.

Range statistics cannot see a narrow dtype's *rounding*: a regression whose
targets sit near 1000 trains in bfloat16 with finite, normal gradients and
still ends far worse than in float32 (bfloat16's spacing at 1000 is 8). The
probe measures it directly. On a probe step, before the real update, the
first half of the batch runs in three passes, one after another, each inside
a ``StatelessScope`` so nothing is applied (no weight, no optimizer slot, no
BatchNormalization statistic, no metric), with the same dropout masks in every
run (the same seeds, and masks drawn in float32 whatever the pass's dtype:
:mod:`keras_mp.adaptive.evidence.same_draws`):

1. with every controlled layer in float32: the reference;
2. as configured, every controlled layer in its current dtype (layers on
   trial for a demotion in the narrower dtype they are tried in), with the
   optimizer's loss scale;
3. the first quarter of the batch in float32: how much the loss and the
   gradients move with the batch's own sampling (its difference from the
   reference, divided by sqrt(2), stands for a half batch against the whole
   one: sampling noise shrinks as one over the square root of the rows).

Each pass's loss is ``compute_loss``'s, with every ``add_loss``, activity and
weight regularization term the train step's loss holds.

Memory: half the rows in float32 hold about as many bytes as the whole batch
in a 16-bit dtype, and the passes run one after another (control
dependencies), the real step after them in a call of its own
(:mod:`keras_mp.adaptive.integration.step_functions`), so a probe step's tensors peak
near a plain step's. All
three passes on the whole batch, left to run side by side, took 5.6 GB in
TensorFlow's allocator against 1.6-1.9 GB for a plain step (2-block
Transformer, T=256, d=512, batch 64, bfloat16, 2-core AMD EPYC; ``python -m
benchmarks.transformer_memory``).

It returns the loss's relative error and, per layer with trainable
variables, the relative error and the cosine of its gradient (all its
variables together) against the reference, and how those errors compare to
the batch's sampling noise:

* ``loss_error = |L - L32| / |L32|``
* ``grad_error = ||g - g32|| / ||g32||``
* ``cosine = <g, g32> / (||g|| ||g32||)``
* ``loss_noise_ratio = |L - L32| / (|L32_quarter - L32| / sqrt(2))`` and
  ``grad_noise_ratio = ||g - g32|| / (||g32_quarter - g32|| / sqrt(2))``
  (every figure on the first half of the batch): above 1, rounding
  moves the loss (the gradient) more than drawing another batch would. A
  relative error alone grows without bound as a fit approaches zero loss; an
  error below the sampling noise does not change what SGD does.

A probe whose configured gradients are not finite (a loss scale too large
for this step) measures nothing (``valid`` is 0): overflow is the loss
scaler's business and the forward statistics'.

Example:
    >>> import keras, numpy as np, tensorflow as tf, keras_mp
    >>> from keras_mp import policies
    >>> from keras_mp.adaptive.evidence import probe
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> policy = policies.policy_of(model)
    >>> layers = policies.adaptive_layers(model, policy)
    >>> x = tf.ones([8, 4]); y = 1000.0 + tf.zeros([8, 1])
    >>> r = tf.function(lambda: probe.probe(model, (x, y), policy, layers))()
    >>> float(r.valid), float(r.loss_error) >= 0.0, r.grad_error.shape.as_list()
    (1.0, True, [1])
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import keras
import tensorflow as tf

from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
from keras_mp.adaptive.evidence.same_draws import same_draws
from keras_mp.adaptive.evidence.stats import learned_variables, variable_path

__all__ = ["ProbeResult", "probe", "after"]

_TINY = 1e-30
_RATIO_CAP = 1e6


class ProbeResult(NamedTuple):
    """One probe's measurements (float32 tensors).

    Attributes:
        valid: 1.0 if the configured gradients were finite, else 0.0.
        loss_error: ``|L - L32| / |L32|``.
        grad_error: ``[len(layers)]``, per layer (0 for a layer without
            trainable variables; see ``measured``).
        cosine: ``[len(layers)]``, per layer (1 where not measured).
        measured: ``[len(layers)]``, 1.0 for layers with gradients.
        loss_noise_ratio: the loss error over the batch's sampling noise.
        grad_noise_ratio: ``[len(layers)]``, each gradient's error over its
            sampling noise.
    """

    valid: tf.Tensor
    loss_error: tf.Tensor
    grad_error: tf.Tensor
    cosine: tf.Tensor
    measured: tf.Tensor
    loss_noise_ratio: tf.Tensor
    grad_noise_ratio: tf.Tensor


def _loss_and_grads(model, x, y, sample_weight, scale, tvars, factors=None):
    """The loss ``compute_loss`` returns on the batch, every ``add_loss``,
    activity and weight regularization term in it, and its gradients, inside
    a ``StatelessScope``: nothing is applied (weights, slots, statistics,
    seeds). Keras reads a regularized weight from the scope (None where the
    scope holds no value for it), and keeps ``add_loss`` terms made in one
    only when asked to collect them. Dropout masks and noise are drawn in
    float32 whatever the pass's dtypes (:func:`same_draws`)."""
    regularized = [v for v in model.trainable_weights if v.regularizer is not None]
    # The gradient inside same_draws too: a rematerialized layer (keras.RematScope)
    # draws its dropout mask again there.
    with same_draws():
        with tf.GradientTape() as tape:
            # Read inside the tape: the scope's values carry the gradients of the
            # regularization terms to the variables.
            values = [(v, v.value) for v in regularized]
            with keras.StatelessScope(state_mapping=values, collect_losses=True):
                if model._call_has_training_arg:
                    y_pred = model(x, training=True)
                else:
                    y_pred = model(x)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred,
                                          sample_weight=sample_weight, training=True)
                loss = tf.cast(loss, tf.float32)
                scaled = loss * scale
        grads = tape.gradient(scaled, tvars)
    out = []
    for g, v in zip(grads, tvars):
        if g is None:
            out.append(tf.zeros(v.shape, tf.float32))
            continue
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        out.append(tf.cast(g, tf.float32) / scale)
    if factors is not None:  # per-layer loss scales: each layer's own factor too
        out = [g / factors[k] for k, g in enumerate(out)]
    return loss, out


def _float32_pass(model, policy, layers, tvars, factors, batch):
    """The float32 pass (:func:`_loss_and_grads` with every controlled layer in
    float32) as a function of a batch like ``batch`` with any number of rows,
    traced once: the probe calls it on the half and on the quarter batch, and
    each trace of a forward and backward pass is a third of the probe's
    start-up (keras.io's functional-API guide model, two LSTMs: 0.6-0.8 s of
    tracing each, 2-core AMD EPYC). Inside another trace it is one function
    call; run eagerly (an eager probe step,
    :func:`keras_mp.adaptive.integration.step_functions.eager_probes`), it traces
    nothing."""
    float32 = {layer.path: "float32" for layer in layers}
    leaves = tf.nest.flatten(batch)
    present = [i for i, t in enumerate(leaves) if t is not None]
    if tf.executing_eagerly() or any(isinstance(leaves[i], (tf.RaggedTensor, tf.SparseTensor))
                                     for i in present):
        # Run eagerly (nothing traced), or inside the caller's trace: ragged
        # and sparse inputs have no fixed signature here.
        def each_time(rows):
            with policy.overriding(float32):
                return _loss_and_grads(model, *rows, tf.constant(1.0), tvars, factors)
        return each_time

    def specs():
        out = []
        for i in present:
            t = tf.convert_to_tensor(leaves[i])
            out.append(tf.TensorSpec([None, *t.shape[1:]], t.dtype))
        return out

    @tf.function(input_signature=[specs()], autograph=False)
    def run(tensors):
        full = [None] * len(leaves)
        for i, t in zip(present, tensors):
            full[i] = t
        with policy.overriding(float32):
            return _loss_and_grads(model, *tf.nest.pack_sequence_as(batch, full),
                                   tf.constant(1.0), tvars, factors)

    def call(rows):
        flat = tf.nest.flatten(rows)
        return run([flat[i] for i in present])
    return call


def probe(model: keras.Model, data, policy: AdaptivePolicy,
          layers: Sequence[keras.layers.Layer], *, scale=1.0,
          trial: Mapping[str, str] | None = None,
          variable_factors: Callable | None = None) -> ProbeResult:
    """Runs the probe on one batch (inside a traced step; see the module docstring).

    Args:
        model: a compiled Keras model.
        data: the batch as the train step gets it (``x``, ``(x, y)`` or
            ``(x, y, sample_weight)``).
        policy: the model's :class:`keras_mp.AdaptivePolicy`.
        layers: the controlled layers; results are indexed like them.
        scale: the loss scale for the configured run (float16 gradients
            underflow without it).
        trial: layer path -> dtype for layers tried in another dtype than
            their current one.
        variable_factors: with per-layer loss scales, ``variable_factors(variables)``
            -> each variable's own factor (its gradients carry ``scale`` times
            it, in every pass); None: none.

    Returns:
        A :class:`ProbeResult`.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    if not isinstance(policy, AdaptivePolicy):
        raise TypeError(f"`policy` must be a keras_mp.AdaptivePolicy, got {policy!r}.")
    half = _first_half(keras.utils.unpack_x_y_sample_weight(data))
    quarter = _first_half(half)
    tvars = [v for v in model.trainable_variables
             if not getattr(v, "overwrite_with_gradient", False)]
    if variable_factors is not None and not callable(variable_factors):
        raise TypeError(f"`variable_factors` must be None or a callable, got "
                        f"{variable_factors!r}.")
    scale = tf.cast(tf.convert_to_tensor(scale), tf.float32)
    factors = variable_factors(tvars) if variable_factors is not None and tvars else None
    reference = _float32_pass(model, policy, layers, tvars, factors, half)
    loss32, grads32 = reference(half)

    def per_var(fn, other):
        if not tvars:
            return tf.zeros([1])
        return tf.stack([fn(g, r) for g, r in zip(other, grads32)])

    with policy.overriding(dict(trial or {})):
        loss, grads = _loss_and_grads(model, *after(half, [loss32, *grads32]), scale, tvars,
                                      factors)
    diff2 = per_var(lambda g, r: tf.reduce_sum(tf.square(g - r)), grads)
    ref2 = per_var(lambda g, r: tf.reduce_sum(tf.square(r)), grads)
    own2 = per_var(lambda g, r: tf.reduce_sum(tf.square(g)), grads)
    dot = per_var(lambda g, r: tf.reduce_sum(g * r), grads)
    loss_q, grads_q = reference(after(quarter, [loss, diff2, own2, dot]))
    # A quarter against a half of the batch: sqrt(2) times the noise of a half
    # against the whole (squared norms: twice).
    noise2 = per_var(lambda g, r: tf.reduce_sum(tf.square(g - r)), grads_q) / 2.0
    noise_loss = tf.abs(loss_q - loss32) / tf.sqrt(2.0)

    n = len(layers)
    owner: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for v in learned_variables(layer):
            owner[variable_path(v)] = i
    seg = tf.constant([owner.get(variable_path(v), n) for v in tvars] or [n], tf.int32)

    finite = tf.reduce_all(tf.math.is_finite(own2)) & tf.math.is_finite(loss)
    sums = [tf.math.unsorted_segment_sum(t, seg, n + 1)[:n]
            for t in (diff2, ref2, own2, dot, noise2)]
    diff2, ref2, own2, dot, noise2 = sums
    measured = tf.constant([1.0 if learned_variables(layer) else 0.0 for layer in layers])
    grad_error = tf.sqrt(diff2) / tf.maximum(tf.sqrt(ref2), _TINY) * measured
    # sqrt of each: the product of two squared norms of tiny gradients underflows
    cosine = tf.where(measured > 0, dot / tf.maximum(tf.sqrt(own2) * tf.sqrt(ref2), _TINY),
                      1.0)
    loss_error = tf.abs(loss - loss32) / tf.maximum(tf.abs(loss32), _TINY)
    # Capped: a batch whose halves agree exactly has no measurable noise.
    loss_ratio = tf.minimum(tf.abs(loss - loss32) / tf.maximum(noise_loss, _TINY), _RATIO_CAP)
    grad_ratio = tf.minimum(tf.sqrt(diff2) / tf.maximum(tf.sqrt(noise2), _TINY),
                            _RATIO_CAP) * measured
    valid = tf.cast(finite, tf.float32)
    clean = lambda t: tf.where(finite, t, tf.zeros_like(t))  # noqa: E731
    return ProbeResult(valid, clean(loss_error), clean(grad_error),
                       tf.where(finite, cosine, tf.ones_like(cosine)), measured,
                       clean(loss_ratio), clean(grad_ratio))


def after(data, deps):
    """``data`` (a nest of tensors and Nones), computed only after every tensor
    in ``deps``: what a graph then runs on ``data`` waits for ``deps``, so
    the tensors of the two computations are not alive at the same time.

    Example:
        >>> import tensorflow as tf
        >>> after((tf.ones([2]), None), [tf.zeros([1])])[1] is None
        True
    """
    deps = [d for d in tf.nest.flatten(deps) if d is not None]
    if not all(tf.is_tensor(d) or isinstance(d, tf.Operation) for d in deps):
        raise TypeError(f"`deps` must hold tensors (or None), got {deps!r}.")
    with tf.control_dependencies(deps):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), data)


def _first_half(data):
    """The first half of a batch (at least one row), every tensor sliced alike."""
    def half(t):
        if t is None:
            return None
        if isinstance(t, tf.experimental.Optional):
            # An optional input a generator left out: None, as Keras's train
            # step makes it (TensorFlow trainer's _autoconvert_optionals).
            return None
        n = tf.shape(t)[0]
        return t[:tf.maximum(n // 2, 1)]
    return tuple(keras.tree.map_structure(half, d) if d is not None else None for d in data)
