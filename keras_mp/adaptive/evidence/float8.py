"""float8 as an adaptive candidate: Keras's float8 training, per layer.

Keras trains ``Dense`` and ``EinsumDense`` in float8 after
``layer.quantize("float8")``: the matmul's inputs and kernel are
quantized-dequantized to E4M3 and the gradient of its output to E5M2, each
with a per-tensor scale from a history of recent amaxes (delayed scaling),
kept in six variables of the layer (``inputs_scale``,
``inputs_amax_history``, ``kernel_scale``, ...) that the optimizer
overwrites with their new values. keras-mp builds on exactly that: the same
``quantize("float8")``, the same variables (so ``.keras`` files, checkpoints
and the optimizer handle them as Keras does), the same quantizers
(:func:`keras.quantizers.compute_float8_scale`,
:func:`keras.quantizers.compute_float8_amax_history`,
:func:`keras.quantizers.quantize_and_dequantize`). What it adds:

* **a per-layer switch.** A layer under an adaptive policy with ``"float8"``
  among its candidates holds a :class:`Float8Policy`: Keras's
  ``QuantizedFloat8DTypePolicy`` plus ``active``. Active, the layer trains in
  float8 as Keras's ``_float8_call`` does; inactive, it computes in its
  source dtype (bfloat16 or float32) with no quantization, its float8
  variables kept. The adaptive controller flips ``active`` (and the source
  dtype) like any other dtype change; the entry is saved with the model, so
  a reloaded model predicts as it trained.
* **the recipe knobs Keras does not expose** (:class:`Float8Recipe`):
  ``margin`` and ``amax_compute_algo`` beside ``amax_history_length``, named
  after Transformer Engine's ``DelayedScaling``. With the defaults the
  computation is Keras's, bit for bit (tested).
* **evidence** on statistics steps (:data:`FIELDS`): per layer, the fraction
  of elements clipped at the E4M3/E5M2 limits to less than half their
  magnitude (``f8_saturated``, see :data:`SATURATION`), the
  fraction of non-zero elements rounded to zero (``f8_flushed``; the typical
  harm of an outlier that sets a per-tensor scale), and the amax growth
  against the history (``f8_growth``), each the worst of the three operands.
* **scale state carried across switches**: while a layer computes wider, its
  amax histories and scales keep being updated on statistics steps (and the
  same evidence is measured as if it were in float8), so a trial or a switch
  into float8 starts from current scales, and a demotion to float8 can be
  judged on what float8 would have done.

Example:
    >>> import keras, numpy as np, keras_mp
    >>> from keras_mp.adaptive.evidence import float8
    >>> p = keras_mp.AdaptivePolicy(candidates=("float8", "bfloat16", "float32"))
    >>> with keras_mp.policy_scope(p):
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                               keras.layers.ReLU(), keras.layers.Dense(1)])
    >>> [layer.name for layer in float8.prepare(model)]
    ['dense', 'dense_1']
    >>> p.dtype_of(model.layers[0].path), p[model.layers[0].path].name
    ('float8', 'float8_from_mixed_bfloat16')
    >>> model(np.ones((2, 4))).dtype.name
    'bfloat16'
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import keras
import tensorflow as tf
from keras import ops, quantizers
from keras.dtype_policies import DTypePolicyMap

from keras_mp._installed import INSTALLED_ATTR
from keras_mp.adaptive.evidence import forward
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.policy.float8_policy import Float8Policy, Float8Recipe
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy

__all__ = ["Float8Recipe", "Float8Policy", "FIELDS", "ELIGIBLE", "VARIABLES", "eligible",
           "is_float8_layer", "prepare", "release", "install"]

#: The formats and their limits: E4M3 (forward) and E5M2 (gradients).
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
_MAX = {E4M3: 448.0, E5M2: 57344.0}
#: An element counts as saturated when it exceeds the format's largest value
#: by more than this factor (it is clipped to less than half its magnitude).
SATURATION = 2.0
#: Amaxes a tensor's history must hold before its evidence counts.
WARMUP = 16
#: Half the smallest subnormal number: smaller magnitudes round to zero.
_ZERO = {E4M3: 2.0 ** -10, E5M2: 2.0 ** -17}
#: The float8 statistics (see the module docstring), in the order recorded.
FIELDS: tuple[str, ...] = forward.FLOAT8_FIELDS
#: Keras's float8 variables of a layer (its delayed-scaling state).
VARIABLES: tuple[str, ...] = ("inputs_scale", "inputs_amax_history", "kernel_scale",
                              "kernel_amax_history", "outputs_grad_scale",
                              "outputs_grad_amax_history")
#: The layer types Keras trains in float8.
ELIGIBLE: tuple[type, ...] = (keras.layers.Dense, keras.layers.EinsumDense)
#: The attribute of a layer's :func:`keras_mp._installed.installed` holder
#: through which :class:`keras_mp.adaptive.evidence.hooks.Hooks` hands the layer's call
#: a recorder of its float8 evidence on statistics steps.
RECORDER_ATTR = "float8_recorder"


def eligible(layer: keras.layers.Layer) -> bool:
    """Whether Keras can train ``layer`` in float8: a built ``Dense`` or
    ``EinsumDense`` (not a subclass: Keras refuses those), not quantized
    otherwise, without LoRA.

    Example:
        >>> layer = keras.layers.Dense(2); layer.build((None, 3))
        >>> eligible(layer), eligible(keras.layers.ReLU())
        (True, False)
    """
    _check_layer(layer)
    return (type(layer) in ELIGIBLE and layer.built and not layer.lora_enabled
            and (layer.quantization_mode is None or is_float8_layer(layer)))


def _entry(layer: keras.layers.Layer):
    """The policy that applies to ``layer``: its entry where it holds a
    ``DTypePolicyMap`` (``layer.dtype_policy`` returns the map)."""
    held = getattr(layer, "_dtype_policy", None)
    if isinstance(held, DTypePolicyMap) and layer.path:
        return held[layer.path]
    return held


def is_float8_layer(layer: keras.layers.Layer) -> bool:
    """Whether ``layer``'s policy is a :class:`Float8Policy` (it has Keras's
    float8 variables and keras-mp switches it)."""
    _check_layer(layer)
    return isinstance(_entry(layer), Float8Policy)


def _check_layer(layer) -> None:
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {layer!r} of type "
                        f"{type(layer).__name__}.")


def prepare(model: keras.Model, policy=None) -> list[keras.layers.Layer]:
    """Makes every eligible layer under an adaptive policy with ``"float8"``
    among its candidates float8-capable: Keras's ``layer.quantize("float8")``
    under a :class:`Float8Policy` entry (active where the layer's adaptive
    dtype is float8). :class:`keras_mp.callbacks.AdaptivePrecision` calls it
    when training starts; call it yourself before building the optimizer in
    a custom loop.

    Args:
        model: a built Keras model.
        policy: its :class:`keras_mp.AdaptivePolicy`; found when None.

    Returns:
        The layers prepared now (empty when all already were).

    Raises:
        ValueError: if the model has no adaptive policy with float8 among
            its candidates.
    """

    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    policy = policy if policy is not None else policy_of(model)
    if not isinstance(policy, AdaptivePolicy) or "float8" not in policy.candidates:
        raise ValueError("`model` must use a keras_mp.AdaptivePolicy with 'float8' among its "
                         "candidates (e.g. keras_mp.set_global_policy('adaptive_float8') "
                         f"before building it), got policy {policy!r}.")
    install()
    done = []
    for layer in adaptive_layers(model, policy):
        if is_float8_layer(layer) or not eligible(layer) or layer.path in policy.policies():
            continue
        dtype = policy.dtype_of(layer.path)
        # Layers start in the narrowest candidate (float8); one already
        # assigned a wider dtype keeps it.
        policy.set_float8(layer.path, "float8" if dtype == policy.float_candidates[0] else dtype)
        layer.quantize("float8")  # keeps the entry: it is already a float8 policy
        # keras_mp.deploy.quantization hands a quantized layer its own entry; this
        # one stays switchable, so it looks itself up in the map again.
        layer._dtype_policy = policy
        done.append(layer)
    return done


def release(layer: keras.layers.Layer) -> str:
    """Turns a float8-capable layer back into a plain float layer, for
    deployment after training: its float8 variables are dropped and it
    computes in its float source dtype from now on (the float8 quantization
    was a training device; a layer that trained in float8 predicts in
    bfloat16 afterwards). Keras's ``quantize`` (int8, int4, ...) and
    :func:`keras_mp.quantize` call it on such layers first.

    Args:
        layer: a layer for which :func:`is_float8_layer` holds.

    Returns:
        The dtype it computes in now.

    Example:
        >>> import keras, keras_mp
        >>> p = keras_mp.AdaptivePolicy(candidates=("float8", "bfloat16", "float32"))
        >>> with keras_mp.policy_scope(p):
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> _ = prepare(model)
        >>> layer = model.layers[0]
        >>> release(layer), len(layer.weights), is_float8_layer(layer)
        ('bfloat16', 2, False)
    """

    if not is_float8_layer(layer):
        raise ValueError(f"`layer` must be a float8-capable layer (see keras_mp.adaptive.evidence.float8.prepare), "
                         f"got {layer!r} with policy {_entry(layer)!r}.")
    policy = layer._dtype_policy
    dtype = _entry(layer).compute_dtype
    layer._tracker.unlock()
    try:
        for name in VARIABLES:
            # As Keras's Layer.__delattr__, without its gc.collect() per
            # variable (about 0.3 s each once TensorFlow is loaded: seconds
            # per layer when keras_mp.quantize releases a float8 model).
            layer._untrack_variable(getattr(layer, name))
            super(keras.layers.Layer, layer).__delattr__(name)
    finally:
        layer._tracker.lock()
    layer._is_quantized = False
    if isinstance(policy, AdaptivePolicy):
        policy.release_float8(layer.path, dtype)
    else:  # a layer handed its own Float8Policy
        layer._dtype_policy = keras.dtype_policies.get(_entry(layer)._source_name)
    return dtype


# -- the call ----------------------------------------------------------------


def _new_scale(history, scale, fmt: str, recipe: Float8Recipe):
    amax = ops.max(history, axis=0) if recipe.amax_compute_algo == "max" else history[0]
    return quantizers.compute_float8_scale(amax, scale, ops.cast(_MAX[fmt], "float32"),
                                           margin=recipe.margin)


def _evidence(x, scale, history, fmt: str) -> tf.Tensor:
    """``[growth, saturated, flushed]`` of one operand quantized with ``scale``.

    Nothing (``[1, 0, 0]``) until the history holds :data:`WARMUP` amaxes:
    delayed scaling starts from a scale of 1 and then follows amaxes that
    grow several times over per step early in training (measured: 8-36x on a
    LayerNorm MLP's gradients), so its first steps say how the scale
    settles, not whether the layer suits float8.
    """
    x = tf.cast(x, tf.float32)
    amax = tf.reduce_max(tf.abs(x)) if x.shape.num_elements() != 0 else tf.constant(0.0)
    seen = tf.reduce_max(history)
    growth = tf.where(seen > 0.0, amax / tf.maximum(seen, 1e-30), 1.0)
    size = x.shape.num_elements()
    stride = 1 if size is None or size <= forward.SAMPLE else -(-size // forward.SAMPLE)
    a = tf.abs(tf.reshape(x, [-1])[::stride]) / scale  # fractions on a strided sample
    # Clipped to less than half its magnitude: with a margin of 0 the few
    # largest elements of a slowly growing tensor are clipped a little by
    # design (delayed scaling); that costs little.
    saturated = tf.reduce_mean(tf.cast(a > SATURATION * _MAX[fmt], tf.float32))
    nonzero = tf.cast(a > 0.0, tf.float32)
    flushed = tf.reduce_sum(tf.cast(a < _ZERO[fmt], tf.float32) * nonzero) / tf.maximum(
        tf.reduce_sum(nonzero), 1.0)
    ready = tf.math.count_nonzero(history) >= WARMUP
    return tf.where(ready, tf.stack([growth, saturated, flushed]), tf.constant([1.0, 0.0, 0.0]))


def _operand(x, scale, history, fmt, compute_dtype, recipe, quantize: bool,
             record: Callable | None, backward: bool):
    """One operand's delayed scaling as a custom gradient: quantizes ``x``
    (forward) or its gradient (``backward``) if ``quantize``, and returns the
    new scale and amax history as the gradients of ``scale`` and ``history``
    (the optimizer overwrites them with those)."""

    def update(t):
        if record is not None:
            record(_evidence(t, scale, history, fmt))
        return (_new_scale(history, scale, fmt, recipe),
                quantizers.compute_float8_amax_history(t, history))

    @ops.custom_gradient
    def forward_qdq(x, scale, history):
        new = update(x)
        out = quantizers.quantize_and_dequantize(x, scale, fmt, compute_dtype) if quantize \
            else x

        def grad(*args, upstream=None, variables=None):
            if upstream is None:
                (upstream,) = args
            return (upstream, *new)
        return out, grad

    @ops.custom_gradient
    def backward_qdq(x, scale, history):
        def grad(*args, upstream=None, variables=None):
            if upstream is None:
                (upstream,) = args
            new = update(upstream)
            if quantize:
                upstream = quantizers.quantize_and_dequantize(upstream, scale, fmt,
                                                              compute_dtype)
            return (upstream, *new)
        return x, grad

    return (backward_qdq if backward else forward_qdq)(x, scale, history)


@ops.custom_gradient
def _keep(x, *state):
    """Identity whose state variables' "gradients" are their own values: the
    optimizer overwrites them with themselves (they stay as they are)."""
    def grad(*args, upstream=None, variables=None):
        if upstream is None:
            (upstream,) = args
        return (upstream, *state)
    return x, grad


def _read(variable) -> tf.Tensor:
    """The variable's value as a tensor (cast to the compute dtype inside a
    layer's call, as Keras does)."""
    return tf.convert_to_tensor(ops.convert_to_tensor(variable))


def _contract(layer, a, b):
    if isinstance(layer, keras.layers.EinsumDense):
        return ops.einsum(layer.equation, a, b)
    return ops.matmul(a, b)


def _call(layer, inputs, training=None):
    """The float8-capable layer's call (see the module docstring)."""

    policy = _entry(layer)
    recorder = getattr(layer.__dict__.get(INSTALLED_ATTR), RECORDER_ATTR, None)
    record = recorder() if recorder is not None else None
    # Read, not the variables: a custom gradient must not see variables
    # reads inside it (the gradients flow back through the reads).
    v = [_read(getattr(layer, name)) for name in VARIABLES]
    if not training and policy.active:
        # Inference in float8: Keras's call (quantized with the current
        # scales, nothing updated).
        return _installed[type(layer)](layer, inputs, training=training)
    if not (policy.active or (training and record is not None)):
        # Computing wider, on a step without statistics or in inference: the
        # source dtype's call; float8 state untouched.
        x = type(layer).call(layer, inputs, training=training)
        return _keep(x, *v) if training else x
    if layer.lora_enabled:
        raise NotImplementedError("float8 training does not support LoRA (as in Keras).")
    q, dtype, recipe = policy.active, layer.compute_dtype, policy.recipe
    a = _operand(inputs, v[0], v[1], E4M3, dtype, recipe, q, record, False)
    b = _operand(_read(layer._kernel), v[2], v[3], E4M3, dtype, recipe, q,
                 record, False)
    # The output gradient's quantization sits right after the contraction,
    # as in Keras (XLA's gemm_rewrite matches the pattern into an FP8 GEMM).
    x = _operand(_contract(layer, a, b), v[4], v[5], E5M2, dtype, recipe, q, record, True)
    if layer.bias is not None:
        bias = layer.bias
        if q and layer.compute_dtype == "float32":
            # Keras's float8 call rounds a float32 bias through bfloat16.
            bias = ops.cast(ops.cast(bias, "bfloat16"), bias.dtype)
        x = ops.add(x, bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


_installed: dict[type, Callable] = {}


def install() -> None:
    """Routes ``_float8_call`` of Keras's ``Dense`` and ``EinsumDense`` to
    keras-mp's for layers holding a :class:`Float8Policy` (others keep
    Keras's). Idempotent; ``import keras_mp`` does it
    (:mod:`keras_mp._keras_changes`), and :func:`prepare` again."""
    for cls in ELIGIBLE:
        if cls in _installed:
            continue
        keras_call = cls._float8_call
        _installed[cls] = keras_call

        @functools.wraps(keras_call)
        def float8_call(self, inputs, training=None, _keras_call=keras_call):
            if is_float8_layer(self):
                return _call(self, inputs, training=training)
            return _keras_call(self, inputs, training=training)

        cls._float8_call = float8_call

