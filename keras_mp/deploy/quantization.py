"""Keras quantization on keras-mp models, and quantization guided by what
adaptive training learned.

Two things live here:

1. :func:`patch_quantize` (installed when ``keras_mp`` is imported) makes
   Keras's own ``model.quantize(mode)`` / ``layer.quantize(mode)`` work on
   layers that hold an :class:`keras_mp.AdaptivePolicy`. Keras's quantizable
   layers (``Dense``, ``EinsumDense``, ``Embedding``, ``ReversibleEmbedding``)
   name their new policy ``"{mode}_from_{layer.dtype_policy.name}"`` and read
   ``layer.dtype_policy.quantization_mode`` when saving; for a layer holding a
   ``DTypePolicyMap`` both read the *map* (``"adaptive_bfloat16"``: ``ValueError:
   Cannot convert 'adaptive_bfloat16' to a mixed precision DTypePolicy``). The
   fix hands the layer its own entry (``mixed_bfloat16``, or ``float32`` for a
   promoted layer) for the duration of the call; a layer that ends up
   quantized keeps its quantized policy (``int8_from_mixed_bfloat16``), exactly
   what it would hold in plain Keras, and the AdaptivePolicy records that
   entry, so the adaptive controller leaves the layer alone and
   :meth:`~keras_mp.AdaptivePolicy.assign` refuses to change it. A layer that
   Keras does not quantize (not supported, filtered out, or an error) goes
   back to the AdaptivePolicy unchanged.
2. :func:`quantize` quantizes the layers adaptive training found robust and
   keeps in float the ones it had to promote, the ones the float32 probe found
   sensitive, and a keep-list; :func:`plan` says which and why.

Example:
    >>> import keras, keras_mp, numpy as np
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
    ...                           keras.layers.Dense(2)])
    >>> keras_mp.set_global_policy("float32")
    >>> keras_mp.global_policy().name
    'float32'
    >>> model.quantize("int8")                     # Keras's own call
    >>> [layer.dtype_policy.name for layer in model.layers]
    ['int8_from_mixed_bfloat16', 'int8_from_mixed_bfloat16']
    >>> model.predict(np.ones((1, 4), "float32"), verbose=0).shape
    (1, 2)
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import keras
from keras.src.dtype_policies import QUANTIZATION_MODES  # no public name

from keras_mp.adaptive.evidence import float8
from keras_mp.adaptive.integration import switching
from keras_mp.adaptive.policy.controlled_layers import policy_of
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy

__all__ = ["MODES", "patch_quantize", "plan", "quantize", "quantizable"]

#: The quantization modes of the installed Keras.
MODES: tuple[str, ...] = tuple(QUANTIZATION_MODES)
#: Modes that :func:`quantize` can run without a calibration set (gptq and
#: awq need a ``keras.quantizers.GPTQConfig``/``AWQConfig`` with data and a
#: layer structure; pass one as ``config``).
_DATA_FREE = ("int8", "float8", "int4")
_MARK = "_keras_mp_quantize_fix"
_lock = threading.Lock()
_originals: dict[type, Callable] = {}
_WIDTH = {"float8": -1, "float16": 0, "bfloat16": 1, "float32": 2}


def _quantizable_classes() -> list[type]:
    classes = [keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding]
    if hasattr(keras.layers, "ReversibleEmbedding"):
        classes.append(keras.layers.ReversibleEmbedding)
    return classes


def _with_own_entry(original: Callable, cls: type) -> Callable:
    @functools.wraps(original)
    def quantize(self, mode=None, type_check=True, config=None):
        if type_check and type(self) is _fused_counterpart(cls):
            # A layer keras_mp.fuse(model, inplace=True) gave its fused
            # class: Keras bound this method to it when it was built, and
            # Keras's method refuses any class but its own.
            type_check = False
        held = self.__dict__.get("_dtype_policy")
        if not isinstance(held, AdaptivePolicy) or not self.path:
            return original(self, mode, type_check=type_check, config=config)
        # The layer's own entry, so Keras reads a real policy's name and mode.
        self._dtype_policy = held[self.path]
        try:
            original(self, mode, type_check=type_check, config=config)
        except BaseException:
            self._dtype_policy = held
            raise
        own = self._dtype_policy
        if own.quantization_mode is None:
            self._dtype_policy = held          # not quantized: still adaptive
        else:
            held.set_policy(self.path, own)    # recorded; the controller skips it
    setattr(quantize, _MARK, True)
    return quantize


def _fused_counterpart(cls: type) -> type | None:
    from keras_mp.fused.layers import FUSED_LAYERS  # the layer classes: imported when used

    return FUSED_LAYERS.get(cls)


def _release_float8_first(original: Callable) -> Callable:
    # Keras checks "already quantized" in a per-instance wrapper, before the
    # layer's quantize runs: a layer keras-mp trained in float8 becomes a
    # float layer first (float8.release), then Keras quantizes it.
    # The same wrapper checks a model's own compute dtype when model.quantize
    # starts, and each InputLayer's: under an AdaptivePolicy a model (a
    # container) or an InputLayer in float16 quantizes nothing itself, and the
    # layers that compute are each checked in turn (keras_mp.quantize hands
    # float16 ones a float32 entry first; a fit too small to gain left them
    # all in float32, its InputLayer in the policy's float16).
    @functools.wraps(original)
    def check(self, mode, compute_dtype):
        adaptive = isinstance(self.__dict__.get("_dtype_policy"), AdaptivePolicy)
        if (getattr(self, "_is_quantized", False) and float8.is_float8_layer(self)
                and adaptive):
            float8.release(self)
        if adaptive and compute_dtype == "float16" and (
                isinstance(self, keras.layers.InputLayer)
                or any(True for _ in self._flatten_layers(include_self=False))):
            compute_dtype = "float32"
        return original(self, mode, compute_dtype)
    setattr(check, _MARK, True)
    return check


def patch_quantize() -> tuple[str, ...]:
    """Lets Keras quantize layers that hold an :class:`~keras_mp.AdaptivePolicy`
    (see the module docstring). Idempotent; ``import keras_mp`` calls it.

    Returns:
        The names of the layer classes whose ``quantize`` is wrapped.
    """
    with _lock:
        for cls in _quantizable_classes():
            current = cls.__dict__.get("quantize")
            if current is None or getattr(current, _MARK, False):
                continue
            _originals[cls] = current
            cls.quantize = _with_own_entry(current, cls)
        check = keras.layers.Layer._check_quantize_args
        if not getattr(check, _MARK, False):
            _originals[keras.layers.Layer] = check
            keras.layers.Layer._check_quantize_args = _release_float8_first(check)
        return tuple(cls.__name__ for cls in _originals if cls is not keras.layers.Layer)


def unpatch_quantize() -> None:
    """Puts Keras's own ``quantize`` methods back (for tests)."""
    with _lock:
        for cls, original in list(_originals.items()):
            if cls is keras.layers.Layer:
                cls._check_quantize_args = original
            else:
                cls.quantize = original
            del _originals[cls]


def quantizable(layer: keras.layers.Layer, mode: str = "int8") -> bool:
    """Whether Keras can quantize ``layer`` in ``mode`` (a built, not yet
    quantized Dense, EinsumDense, Embedding or ReversibleEmbedding; int8 never
    on a float16-computing layer, as in Keras)."""
    _check_mode(mode)
    return _supported(layer) and not (mode == "int8" and layer.compute_dtype == "float16")


def _supported(layer: keras.layers.Layer) -> bool:
    if float8.is_float8_layer(layer) and isinstance(layer._dtype_policy, AdaptivePolicy):
        return layer.built  # released to float first (see patch_quantize)
    return (isinstance(layer, tuple(_quantizable_classes())) and layer.built
            and layer.quantization_mode is None and not getattr(layer, "_is_quantized", False))


def _compute_in_float32(layer: keras.layers.Layer) -> None:
    held = layer.__dict__.get("_dtype_policy")
    if isinstance(held, AdaptivePolicy):
        held.set_policy(layer.path, "float32")
    else:
        layer.dtype_policy = "float32"


def _check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of the installed Keras's quantization modes "
                         f"{MODES}, got {mode!r}.")


def _promoted(record: dict[str, Any]) -> bool:
    state = record.get("state") or {}
    if int(state.get("strikes", 0) or 0) > 0:
        return True
    for switch in record.get("history") or []:
        old, new = switch.get("old"), switch.get("new")
        if switch.get("reason") == switching.NO_GAIN:
            continue  # a fit too small to gain, not evidence against the layer
        if old in _WIDTH and new in _WIDTH and _WIDTH[new] > _WIDTH[old]:
            return True
    return False


def _matches(layer: keras.layers.Layer, keep: Iterable[str]) -> bool:
    path = layer.path or layer.name
    names = {layer.name, path, path.split("/", 1)[-1]}
    return any(any(k == n or re.fullmatch(k, n) for n in names) for k in keep)


def _check_keep(keep: Any, model: keras.layers.Layer) -> tuple[str, ...]:
    """``keep`` as a tuple, if each entry is a valid regex that names at
    least one layer of ``model`` (a typo would quantize the layer it meant)."""
    if isinstance(keep, str) or not isinstance(keep, (list, tuple, set, frozenset)) \
            or not all(isinstance(k, str) and k for k in keep):
        raise TypeError("`keep` must be a list of layer names, paths or regexes (strings), "
                        f"got {keep!r}.")
    for k in keep:
        try:
            re.compile(k)
        except re.error as e:
            raise ValueError(f"`keep` holds {k!r}, which is not a valid regex ({e}); escape "
                             "special characters with re.escape to match a name as "
                             "written.") from None
    layers = list(model._flatten_layers(include_self=False))
    unmatched = [k for k in keep if not any(_matches(layer, [k]) for layer in layers)]
    if unmatched:
        names = ", ".join(layer.name for layer in layers[:8]) + (", ..." if len(layers) > 8
                                                                 else "")
        raise ValueError(f"`keep` holds {unmatched!r}, which match no layer of "
                         f"{model.name!r} (by name, path or regex; its layers: {names}).")
    return tuple(keep)


def plan(model: keras.Model, mode: str = "int8", *,
         keep: Iterable[str] = ()) -> dict[str, str]:
    """What :func:`quantize` would do with each layer Keras can quantize.

    Args:
        model: a built Keras model (trained under an adaptive policy for the
            evidence; without one only ``keep`` keeps layers in float).
        mode: one of :data:`MODES`.
        keep: layer names, paths or regexes (full match) to keep in float;
            each must match a layer of ``model`` (else ``ValueError``).

    Returns:
        Layer path -> ``"quantize"`` or the reason it stays in float:
        ``"promoted"`` (adaptive training widened its dtype), ``"sensitive"``
        (the float32 probe flagged it), ``"keep"`` (in ``keep``).

    Example:
        >>> import keras, keras_mp
        >>> keras_mp.set_global_policy("adaptive_bfloat16")
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
        ...                           keras.layers.Dense(2, name="head")])
        >>> keras_mp.set_global_policy("float32")
        >>> policy = keras_mp.policies.policy_of(model)
        >>> policy.record(model.layers[0].path)["history"] = [
        ...     {"step": 3, "old": "bfloat16", "new": "float32", "reason": "overflow"}]
        >>> sorted(keras_mp.deploy.quantization.plan(model, "int8", keep=["head"]).values())
        ['keep', 'promoted']
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    _check_mode(mode)
    keep = _check_keep(keep, model)
    policy = policy_of(model)
    out: dict[str, str] = {}
    for layer in model._flatten_layers(include_self=False):
        if not _supported(layer) or layer.path in out:
            continue
        record: dict[str, Any] = {}
        if policy is not None and isinstance(layer._dtype_policy, AdaptivePolicy):
            record = policy.record(layer.path)
        if _matches(layer, keep):
            out[layer.path] = "keep"
        elif _promoted(record):
            out[layer.path] = "promoted"
        elif (record.get("probe") or {}).get("sensitive"):
            out[layer.path] = "sensitive"
        else:
            out[layer.path] = "quantize"
    return out


def quantize(model: keras.Model, mode: str = "int8", *, keep: Iterable[str] = (),
             config: Any = None) -> dict[str, str]:
    """Quantizes, in place, the layers adaptive training found robust.

    Keeps in float the layers :func:`plan` gives a reason for (promoted
    during adaptive training, flagged sensitive by the float32 probe, or in
    ``keep``) and hands the others to Keras's ``model.quantize`` (through
    its ``filters``), so the result is a plain Keras quantized model: it
    saves to ``.keras``, reloads with ``keras.saving.load_model`` and
    exports like any other.

    Args:
        model: a built Keras model.
        mode: one of :data:`MODES` (``"int8"``, ``"float8"``, ``"int4"``; gptq
            and awq need ``config``).
        keep: layer names, paths or regexes (full match) to keep in float.
        config: a ``keras.quantizers.QuantizationConfig`` for ``mode``, passed
            on to Keras.

    Layers that trained in float8 under keras-mp become plain float layers
    first (:func:`keras_mp.adaptive.evidence.float8.release`), quantized or kept.

    A built optimizer of the model (e.g. the loss-scale wrapper the adaptive
    callback installed) holds state for the float weights quantization
    replaces; it is replaced by a fresh copy built on the model's variables
    now (:func:`keras_mp.adaptive.integration.optimizer_setup.replace_optimizer`), so the
    quantized model's ``.keras`` file loads (a
    :class:`keras_mp.LossScaleOptimizer` refuses optimizer state saved for
    other variables).

    Keras refuses int8 on a layer that computes in float16 (an
    ``adaptive_float16`` layer that was never promoted): in int8 mode such a
    layer is quantized from float32 (``int8_from_float32``).

    Returns:
        The plan that was applied (see :func:`plan`).

    Raises:
        ValueError: ``mode`` is not a Keras mode, gptq/awq without ``config``,
            or a ``keep`` entry that is no valid regex or matches no layer.
    """
    decisions = plan(model, mode, keep=keep)
    if mode not in _DATA_FREE and config is None:
        raise ValueError(f"`mode`={mode!r} needs `config` (a keras.quantizers config with "
                         "calibration data); data-free modes: " + ", ".join(_DATA_FREE) + ".")
    chosen = {path for path, what in decisions.items() if what == "quantize"}
    for layer in model._flatten_layers(include_self=False):
        if float8.is_float8_layer(layer) and isinstance(layer._dtype_policy, AdaptivePolicy):
            float8.release(layer)  # float8 was for training; kept layers stay plain float
    if mode == "int8":
        # Keras refuses int8 on a float16-computing layer: quantize those from float32.
        for layer in model._flatten_layers(include_self=False):
            if layer.path in chosen and layer.compute_dtype == "float16":
                _compute_in_float32(layer)
    if chosen:
        model.quantize(mode, config=config,
                       filters=lambda layer: layer.path in chosen)
    _refresh_optimizer(model)
    return decisions


def _refresh_optimizer(model: keras.Model) -> None:
    """A fresh copy of the model's built optimizer where the variables it
    was built on are no longer the model's trainable variables."""
    from keras_mp.adaptive.integration import optimizer_setup

    opt = getattr(model, "optimizer", None)
    if opt is None or not opt.built:
        return
    inner = getattr(opt, "inner_optimizer", opt)
    if [id(v) for v in inner._trainable_variables] == [id(v) for v in model.trainable_variables]:
        return
    optimizer_setup.replace_optimizer(model, lambda: keras.optimizers.deserialize(
        keras.optimizers.serialize(opt)))
