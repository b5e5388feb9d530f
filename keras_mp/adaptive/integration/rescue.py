"""What breaks Keras's mixed precision, handled under an adaptive policy.

Code that trains in float32 can fail under Keras's ``mixed_bfloat16`` /
``mixed_float16`` in several ways (docs/when_keras_fails.md has the examples).
Under an :class:`keras_mp.AdaptivePolicy` each is a rule, applied where Keras
casts or calls, and recorded in the layer's record (so
:func:`keras_mp.precision_report` shows it):

* ``integer_input``: a layer that reads its input as indices (an
  ``Embedding``, or a layer holding one, such as a token-and-position
  embedding) and receives it as float32 (token ids through a float
  ``keras.Input(shape=(maxlen,))``) gets it as it came: Keras would cast it
  to the layer's 16-bit compute dtype first, where float16 rounds ids
  19996-19999 to 20000 (the gather then fails) and bfloat16 rounds every id
  above 256 without a word. The ids stay exact (float32 holds integers up to
  2**24); the ``Embedding`` casts them to int32 itself. Ids that already
  arrive in a 16-bit dtype cannot be repaired: a warning says so, once per
  layer, with the fix (``keras.Input(..., dtype="int32")``).
* ``dtype_mismatch``: a layer whose ``call`` fails because a float32 tensor
  met a 16-bit one (a VAE ``Sampling`` layer that draws its epsilon with
  ``keras.random.normal(shape)``, float32, and multiplies it with a 16-bit
  ``z_log_var``) moves to float32, with its sublayers, and is called again;
  it stays there (pinned: the controller never demotes it). Where that does
  not help, or where the mismatch is outside any layer (a custom
  ``train_step`` that ``tf.concat``'s a 16-bit generator output with float32
  images), a :class:`DtypeMismatchError` names the layer or model and the fix.
* ``float32_metric``: metrics whose TensorFlow ops take float32 only
  (``SparseTopKCategoricalAccuracy`` and ``TopKCategoricalAccuracy``:
  ``tf.math.in_top_k``) get float32 predictions; the other metrics get the
  model's outputs as they are.

:func:`install` (called on import) wraps ``keras.layers.Layer.__call__`` and
``keras.Model.compute_metrics`` once; under any other policy both pass
through after one ``isinstance`` check (per layer call: when a step is
traced, not when it runs).

Example:
    >>> import keras, numpy as np, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> ids = keras.Input((3,))                                  # float32 token ids
    >>> model = keras.Model(ids, keras.layers.Embedding(20000, 2)(ids))
    >>> x = np.array([[19999.0, 257.0, 3.0]], "float32")
    >>> bool(np.all(model(x) == model.layers[1](x.astype("int32"))))
    True
    >>> keras_mp.precision_report(model).rows[0]["rules"]
    ['integer_input']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.name_scope import current_path
from keras.src.metrics import accuracy_metrics

from keras_mp._installed import installed
from keras_mp.adaptive.policy.layer_paths import name_paths
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
from keras_mp.adaptive.decisions.rule import LayerState

__all__ = ["DtypeMismatchError", "RULES", "install", "is_dtype_mismatch", "explain", "explaining",
           "float32_metrics"]

#: rule -> why, as the report and the docs state it.
RULES = {
    "integer_input": "its input holds integer ids (indices): it gets them unrounded, "
                     "not cast to its 16-bit compute dtype",
    "dtype_mismatch": "its call mixed a float32 tensor with a 16-bit one: it computes in "
                      "float32",
    "float32_metric": "its TensorFlow op takes float32 only: it gets float32 predictions",
    "float32_loss": "its activity penalty (or add_loss term) is computed in float32, where "
                    "the float32 loss adds it",
    "float32_adapt": "Normalization.adapt computed its mean and variance in float32, not in "
                     "its 16-bit compute dtype",
}

#: Keras's metric functions whose ops take float32 only (tf.math.in_top_k).
_FLOAT32_FNS = (accuracy_metrics.sparse_top_k_categorical_accuracy,
                accuracy_metrics.top_k_categorical_accuracy)
_NARROW = ("bfloat16", "float16")
_MISMATCH = re.compile(r"does not match|don't all match|do not all match|"
                       r"expected to be a|expected type of")
_ERRORS = (TypeError, ValueError, tf.errors.InvalidArgumentError)
_keras: dict[str, Any] = {}


class DtypeMismatchError(TypeError):
    """A 16-bit tensor met a float32 one where keras-mp could not resolve it;
    the message names the layer (or model) and what to change."""


def is_dtype_mismatch(error: BaseException) -> bool:
    """Whether ``error`` is TensorFlow's (or Keras's) complaint that a 16-bit
    tensor met a tensor of another float dtype.

    Example:
        >>> is_dtype_mismatch(TypeError("Input 'y' of 'Mul' Op has type float32 that does "
        ...                             "not match type bfloat16 of argument 'x'."))
        True
        >>> is_dtype_mismatch(ValueError("Shapes (2,) and (3,) are incompatible"))
        False
    """
    if not isinstance(error, BaseException):
        raise TypeError(f"`error` must be an exception, got {error!r}.")
    text = str(error)
    return (not isinstance(error, DtypeMismatchError) and bool(_MISMATCH.search(text))
            and any(d in text for d in ("bfloat16", "float16", "half")))


def _first_line(error: BaseException) -> str:
    lines = [s.strip() for s in str(error).splitlines() if s.strip()]
    hits = [s for s in lines if _MISMATCH.search(s)]
    return (hits or lines or [type(error).__name__])[0]


def explain(error: BaseException, where: str, policy_name: str) -> DtypeMismatchError:
    """The :class:`DtypeMismatchError` for a dtype mismatch keras-mp could not
    resolve in ``where`` (a layer or a model's train step).

    Example:
        >>> e = TypeError("Tensors in list passed to 'values' of 'ConcatV2' Op have types "
        ...               "[bfloat16, float32] that don't all match.")
        >>> print(explain(e, "the train step of model 'gan' (GAN)", "adaptive_bfloat16"))
        ... # doctest: +NORMALIZE_WHITESPACE
        Under the adaptive policy 'adaptive_bfloat16', a 16-bit tensor met a float32 one in the
        train step of model 'gan' (GAN): cast one side where they meet (keras.ops.cast(x,
        'float32')) or combine them with keras.ops, which promotes mixed dtypes. (TensorFlow:
        Tensors in list passed to 'values' of 'ConcatV2' Op have types [bfloat16, float32] that
        don't all match.)
    """
    return DtypeMismatchError(
        f"Under the adaptive policy {policy_name!r}, a 16-bit tensor met a float32 one in "
        f"{where}: cast one side where they meet (keras.ops.cast(x, 'float32')) or combine "
        f"them with keras.ops, which promotes mixed dtypes. (TensorFlow: {_first_line(error)})")


@contextlib.contextmanager
def explaining(model: keras.Model) -> Iterator[None]:
    """Inside the block (a train step of ``model`` traced and run), a dtype
    mismatch outside any layer (a custom ``train_step``) raises
    :func:`explain`'s error, naming the model."""
    try:
        yield
    except _ERRORS as e:
        if not is_dtype_mismatch(e):
            raise
        policy = getattr(model, "_dtype_policy", None)
        raise explain(e, f"the train step of model {model.name!r} ({type(model).__name__})",
                      getattr(policy, "name", str(policy))) from e


# -- layers ----------------------------------------------------------------

def _path(layer: keras.layers.Layer) -> str:
    """The layer's path, named as Keras names a built layer's where it has none."""
    if layer.path is None:
        with layer._open_name_scope():
            object.__setattr__(layer, "_path", current_path())
    name_paths(layer)
    return layer.path


def _reads_indices(layer: keras.layers.Layer, kwargs: dict) -> bool:
    """An ``Embedding`` (not KerasHub's reverse call, which takes hidden
    states), or a layer holding one."""
    found = installed(layer).__dict__.get("reads_indices")
    if found is None:
        found = any(isinstance(sub, keras.layers.Embedding)
                    for sub in layer._flatten_layers(include_self=True))
        installed(layer).reads_indices = found
    return found and not kwargs.get("reverse", False)


def _float_dtypes(args, kwargs) -> set[str]:
    return {keras.backend.standardize_dtype(x.dtype) for x in keras.tree.flatten((args, kwargs))
            if hasattr(x, "dtype") and keras.backend.is_float_dtype(x.dtype)}


def _note(policy: AdaptivePolicy, layer: keras.layers.Layer, rule: str) -> None:
    rules = policy.record(_path(layer)).setdefault("rules", [])
    if rule not in rules:
        rules.append(rule)


def _promote(layer: keras.layers.Layer, policy: AdaptivePolicy) -> bool:
    """Moves ``layer`` and its sublayers under ``policy`` to float32, pinned,
    with the reason ``dtype_mismatch``; whether any moved."""
    if "float32" not in policy.candidates:
        return False
    _path(layer)
    moved = False
    for sub in layer._flatten_layers(include_self=True):
        if sub._dtype_policy is not policy or isinstance(sub, keras.Model) or not sub.path:
            continue
        old = policy.dtype_of(sub.path)
        if old == "float32":
            continue
        policy.assign(sub.path, "float32")
        record = policy.record(sub.path)
        record.setdefault("history", []).append(
            {"step": 0, "old": old, "new": "float32", "reason": "dtype_mismatch"})
        record["state"] = LayerState("float32", switches=1,
                                     strikes=policy.rule.max_strikes).get_config()
        moved = True
    return moved


def _float32_term(loss):
    """A 16-bit loss term in float32 (anything else as it is)."""
    if tf.is_tensor(loss) and loss.dtype in (tf.bfloat16, tf.float16):
        return tf.cast(loss, tf.float32)
    return loss


@contextlib.contextmanager
def _activity_in_float32(layer: keras.layers.Layer, policy: AdaptivePolicy) -> Iterator[None]:
    """Inside the block, ``layer``'s activity regularizer reads its 16-bit
    outputs in float32 (Keras calls it in ``__call__``, after ``call``)."""
    current = layer.__dict__.get("activity_regularizer")
    if current is None:
        yield
        return
    regularizer = getattr(current, "keras_regularizer", current)   # never a wrapper's wrapper

    def in_float32(output):
        widened = _float32_term(output)
        if widened is not output:
            _note(policy, layer, "float32_loss")
        return regularizer(widened)
    in_float32.keras_regularizer = regularizer
    # Not Keras's __setattr__: the swap is not state to track (or to save).
    object.__setattr__(layer, "activity_regularizer", in_float32)
    try:
        yield
    finally:
        object.__setattr__(layer, "activity_regularizer", regularizer)


def _call_keras(layer, policy: AdaptivePolicy, exact: bool, args, kwargs):
    with _activity_in_float32(layer, policy):
        return _call_exact(layer, exact, args, kwargs)


def _call_exact(layer, exact: bool, args, kwargs):
    if not exact:
        return _keras["call"](layer, *args, **kwargs)
    # Input conversion off for this call: float32 ids reach call() unrounded
    # (arrays become tensors as Keras's conversion would make them, uncast).
    args, kwargs = keras.tree.map_structure(
        lambda v: tf.convert_to_tensor(v) if isinstance(v, np.ndarray) else v, (args, kwargs))
    before = layer._convert_input_args
    object.__setattr__(layer, "_convert_input_args", False)
    try:
        return _keras["call"](layer, *args, **kwargs)
    finally:
        object.__setattr__(layer, "_convert_input_args", before)


def _adaptive_call(layer: keras.layers.Layer, policy: AdaptivePolicy, args, kwargs):
    exact = False
    if layer.compute_dtype in _NARROW and _reads_indices(layer, kwargs):
        dtypes = _float_dtypes(args, kwargs)
        exact = bool(dtypes - set(_NARROW))
        if dtypes & set(_NARROW) and not installed(layer).__dict__.get("warned_ids"):
            installed(layer).warned_ids = True
            warnings.warn(
                f"keras_mp: layer {layer.name!r} reads indices that arrive as "
                f"{sorted(dtypes & set(_NARROW))}, which cannot hold every integer id "
                "(bfloat16 rounds ids above 256): give the model's input "
                "dtype='int32' (keras.Input(shape, dtype='int32')).", stacklevel=3)
    try:
        out = _call_keras(layer, policy, exact, args, kwargs)
    except _ERRORS as e:
        if not is_dtype_mismatch(e) or not _promote(layer, policy):
            raise
        try:
            out = _call_keras(layer, policy, exact, args, kwargs)
        except _ERRORS as again:
            if not is_dtype_mismatch(again):
                raise
            raise explain(again, f"layer {layer.name!r} ({type(layer).__name__}), even in "
                          "float32", policy.name) from again
    if exact:
        _note(policy, layer, "integer_input")
    return out


_checked_paths: weakref.WeakSet = weakref.WeakSet()  # models whose paths were checked


def _name_once(model: keras.Model) -> None:
    """On a model's first call: a loaded model's weightless layers (``ReLU``)
    have no path (Keras names a layer when it builds it), so they would look
    up the policy's default, not the entry saved for them; they get theirs."""
    if model in _checked_paths:
        return
    _checked_paths.add(model)
    if any(layer.path is None and isinstance(layer._dtype_policy, AdaptivePolicy)
           for layer in model._flatten_layers(include_self=False)):
        name_paths(model)


def _layer_call(self, *args, **kwargs):
    if isinstance(self, keras.Model):
        _name_once(self)
        return _keras["call"](self, *args, **kwargs)
    policy = getattr(self, "_dtype_policy", None)
    if not isinstance(policy, AdaptivePolicy) or isinstance(self, keras.layers.InputLayer):
        return _keras["call"](self, *args, **kwargs)
    return _adaptive_call(self, policy, args, kwargs)


def _add_loss(self, loss):
    """Keras's ``add_loss``, its 16-bit terms cast to float32 under an adaptive policy."""
    policy = getattr(self, "_dtype_policy", None)
    if isinstance(policy, AdaptivePolicy):
        terms = keras.tree.flatten(loss)     # as Keras's add_loss reads it
        loss = [_float32_term(t) for t in terms]
        if not isinstance(self, keras.Model) and any(a is not b for a, b in zip(loss, terms)):
            _note(policy, self, "float32_loss")
    return _keras["add_loss"](self, loss)


def _adapt(self, data, *args, **kwargs):
    """Keras's ``Normalization.adapt``, in float32 under an adaptive policy."""
    policy = getattr(self, "_dtype_policy", None)
    if not isinstance(policy, AdaptivePolicy):
        return _keras["adapt"](self, data, *args, **kwargs)
    with policy.overriding({_path(self): "float32"}):
        out = _keras["adapt"](self, data, *args, **kwargs)
    self.finalize_state()   # the mean and variance it holds, cast to its compute dtype
    if self.compute_dtype in _NARROW:
        _note(policy, self, "float32_adapt")
    return out


# -- metrics ---------------------------------------------------------------

def _widened(fn):
    # Named as Keras's function: a metric's config serializes it by name.
    @functools.wraps(fn)
    def in_float32(y_true, y_pred, **kwargs):
        y_pred = keras.ops.convert_to_tensor(y_pred)
        if keras.backend.standardize_dtype(y_pred.dtype) in _NARROW:
            y_pred = keras.ops.cast(y_pred, "float32")
        return fn(y_true, y_pred, **kwargs)
    in_float32.keras_fn = fn
    return in_float32


def _compiled(model: keras.Model) -> list[keras.metrics.Metric]:
    found: dict[int, keras.metrics.Metric] = {}

    def visit(items) -> None:
        for m in keras.tree.flatten(items or []):
            if isinstance(m, keras.metrics.Metric) and id(m) not in found:
                found[id(m)] = m
                inner = getattr(m, "metrics", None)   # Keras's per-output MetricsList
                if isinstance(inner, (list, tuple)):
                    visit(list(inner))

    compiled = getattr(model, "_compile_metrics", None)
    for name in ("_flat_metrics", "_flat_weighted_metrics"):
        visit(getattr(compiled, name, None))
    return list(found.values())


def float32_metrics(model: keras.Model) -> list[str]:
    """The names of ``model``'s compiled metrics that get float32 predictions
    (the ``float32_metric`` rule)."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    return [m.name for m in _compiled(model)
            if getattr(getattr(m, "_fn", None), "keras_fn", None) in _FLOAT32_FNS]


def _compute_metrics(self, x, y, y_pred, sample_weight=None):
    policy = getattr(self, "_dtype_policy", None)
    compiled = getattr(self, "_compile_metrics", None)
    if not isinstance(policy, AdaptivePolicy) or compiled is None:
        return _keras["compute_metrics"](self, x, y, y_pred, sample_weight)
    if not compiled.built:
        compiled.build(y, y_pred)   # as its update_state does first
    for m in _compiled(self):
        if getattr(m, "_fn", None) in _FLOAT32_FNS:
            m._fn = _widened(m._fn)
    try:
        return _keras["compute_metrics"](self, x, y, y_pred, sample_weight)
    except _ERRORS as e:
        if not is_dtype_mismatch(e):
            raise
        raise explain(e, f"a metric compiled with model {self.name!r}", policy.name) from e


def install() -> None:
    """Wraps ``keras.layers.Layer.__call__``, ``keras.layers.Layer.add_loss``,
    ``keras.layers.Normalization.adapt`` and ``keras.Model.compute_metrics``
    (once; a second call does nothing)."""
    if _keras:
        return
    _keras["call"] = keras.layers.Layer.__call__
    _keras["add_loss"] = keras.layers.Layer.add_loss
    _keras["adapt"] = keras.layers.Normalization.adapt
    _keras["compute_metrics"] = keras.Model.compute_metrics
    keras.layers.Layer.__call__ = _layer_call
    keras.layers.Layer.add_loss = _add_loss
    keras.layers.Normalization.adapt = _adapt
    keras.Model.compute_metrics = _compute_metrics
