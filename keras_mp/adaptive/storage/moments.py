"""Optimizer moments stored in bfloat16, the update in float32.

Keras's optimizers make each slot in its variable's dtype, so under mixed
precision Adam holds 8 bytes of moments per float32 weight. Where
:func:`set_enabled` says so (documented as
:func:`keras_mp.config.set_compact_moments`; by default, for the weights of
layers computing in 16 bits in a model that trains at least 2**24
parameters, :data:`keras_mp.adaptive.storage.trained.AUTO_PARAMETERS`),
``fit`` of a model under an adaptive policy stores the
first and second moments of its ``keras.optimizers.Adam`` or ``AdamW`` (the
exact classes, without AMSGrad, hyperparameters other than the learning rate
numbers; no distribution strategy but ``MirroredStrategy``) in bfloat16: 4
bytes per weight, and the
update is computed in float32 from them, the second moment written back with
dithered rounding (:mod:`keras_mp.execution.compact_update`, installed as the
optimizer's ``update_step`` with :mod:`keras_mp.execution.native_update`).
The same holds for the slots (:data:`SLOTS`) of ``SGD`` with momentum,
``Adamax``, ``Nadam`` and ``Lion``, their update computed by the rules of
:mod:`keras_mp.execution.compact_rules` (Nadam's scalar ``_u_product`` stays
float32), and for ``Adafactor``'s full-size ``_v`` (its update
:mod:`keras_mp.execution.compact_adafactor`; the factored ``_r`` and ``_c``,
a row and a column per matrix, stay float32: 2 bytes a parameter saved).
The optimizer stays the user's Keras optimizer: files, checkpoints and
``BackupAndRestore`` carry its slots in bfloat16, and a file with float32
slots loads into it (and the reverse) with the values cast.

When: at the start of each ``fit``, as :mod:`~keras_mp.adaptive.storage.frozen`
decides the frozen weights: the optimizer's ``add_variable_from_reference``
is wrapped (per instance), so the moments its ``build`` makes later in that
fit are made in bfloat16 (never in float32 first: a float32 slot freed into
TensorFlow's CPU allocator stays in the process, and converting them after
the build saved 16 of the 380 MiB on the Llama of
``benchmarks/llm_memory.py``); an optimizer already built has its slots
stored anew (the values cast), and the switch turned off puts them back in
float32 at the next ``fit``. Per variable:
compact unless :func:`keras_mp.config.set_storage` keeps that variable in
float32 (then its moments stay float32 too) or the variable is not float32.
Each decision is in the layer's record (``"storage"``, the variable's
``moments``).

Why by default there and only there: in a large model the moments are most
of the training state (8 of 16 bytes a parameter), and the 1000-step
quality runs of docs/benchmarks.md ("Does compact storage train as well?")
ended within 1 % of float32's loss on five of six figures (one +1.13 %);
in a small one they save little, and
each compiled update costs start-up. A layer computing in float32 (a
float32-only CPU, a promoted layer) keeps float32 moments by default: its
update stays TensorFlow's fused kernel. The other optimizers' moments
(SGD with momentum, Adamax, Nadam, Lion, Adafactor) are compact only where
the switch is True: the quality runs trained with AdamW. The per-variable statistic the issue
asks for (the probe comparing the update from compact moments with the
float32 one) is not built; the rule is the model's size.

Example:
    >>> import keras, numpy as np, keras_mp
    >>> from keras_mp.adaptive.storage import moments
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> keras_mp.config.set_min_saving(0)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse")
    >>> keras_mp.config.set_compact_moments(True)
    >>> _ = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
    >>> sorted({str(v.dtype) for v in model.optimizer.inner_optimizer._momentums})
    ['bfloat16']
    >>> keras_mp.config.set_compact_moments(None)
    >>> keras_mp.config.set_min_saving(0.5)
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import functools
from typing import Any

import keras
from keras.src.optimizers import base_optimizer  # no public name

from keras_mp import _installed
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.storage import trained
from keras_mp.adaptive.storage import variables as storage_vars
from keras_mp.execution import compact_update, native_update, optimizer_state

__all__ = ["DEFAULT_OPTIMIZERS", "SLOTS", "apply", "enabled", "set_enabled", "unsupported_reason"]

#: The optimizer classes whose moments can be compact, and their slot lists.
SLOTS: dict[type, tuple[str, ...]] = compact_update.SLOTS
#: The optimizer classes whose moments are compact by default (the setting
#: None, in a large model): those of the quality runs; the others of
#: :data:`SLOTS` with ``keras_mp.config.set_compact_moments(True)``.
DEFAULT_OPTIMIZERS: tuple[type, ...] = (keras.optimizers.Adam, keras.optimizers.AdamW)
_RECORD, _OVERRIDE = "storage", "storage_override"
# The names the classes' ``build`` gives their slots (Adamax's u: "norm").
_SLOT_NAMES = ("momentum", "velocity", "norm")
_HELD = "moment_owners"  # in the optimizer's keras_mp._installed holder
_state: dict[str, bool | None] = {"enabled": None}


def enabled() -> bool | None:
    """The setting: True (always), False (never) or None (the default: in a
    model :func:`keras_mp.adaptive.storage.trained.large` holds for, the
    moments of weights whose layer computes in 16 bits)."""
    return _state["enabled"]


def set_enabled(enabled: bool | None) -> None:
    """Turns compact moments on (True), off (False) or back to the default
    (None); documented as :func:`keras_mp.config.set_compact_moments`;
    applied at the next ``fit``.

    Args:
        enabled: True, False or None.
    """
    if not (enabled is None or isinstance(enabled, bool)):
        raise TypeError(f"`enabled` must be True, False or None, got {enabled!r}.")
    _state["enabled"] = enabled


def unsupported_reason(optimizer: Any) -> str | None:
    """Why ``optimizer``'s moments stay in their variables' dtype (None when
    they can be compact).

    Example:
        >>> import keras
        >>> unsupported_reason(keras.optimizers.Adam()) is None
        True
        >>> unsupported_reason(keras.optimizers.Adam(amsgrad=True))
        'AMSGrad keeps a third moment: not stored compactly'
    """
    return trained.adam_reason(optimizer)


def _owners(model: keras.Model) -> dict[int, tuple[Any, str, bool]]:
    """id(variable) -> (record, variable name, whether the moments are
    compact) for the controlled layers' weights, as the setting decides for
    ``model``: True, all of them; None, those of layers computing in 16 bits
    where the model is large and its optimizer one of :data:`DEFAULT_OPTIMIZERS`."""
    policy = policy_of(model)
    setting = _state["enabled"]
    # By default only where the quality runs were made: Adam's and AdamW's.
    on = trained.on(setting, model) and (setting is True or type(
        optimizer_state.inner(model.optimizer)) in DEFAULT_OPTIMIZERS)
    return {id(v): (policy.record(layer.path), v.name,
                    on and (setting is True or layer.compute_dtype in ("bfloat16", "float16")))
            for layer in adaptive_layers(model, policy) for v in layer._trainable_variables}


def _decide(variable: Any, owner: tuple[Any, str, bool] | None) -> str:
    """The dtype of ``variable``'s moments, recorded in its layer's record."""
    record, name, on = owner or (None, None, False)
    kept = record is not None and record.get(_OVERRIDE, {}).get(name) == "float32"
    dtype = "bfloat16" if on and not kept \
        and storage_vars.stored_dtype(variable) in ("float32", "bfloat16") else "float32"
    if record is not None:
        record.setdefault(_RECORD, {}).setdefault(name, {})["moments"] = dtype
    return dtype


def _store(opt, owners: dict[int, tuple[Any, str, bool]]) -> bool:
    """Stores a built ``opt``'s slots as decided; returns whether a slot was
    stored anew."""
    changed = False
    for i, variable in enumerate(opt._trainable_variables):
        slots = [getattr(opt, attr)[i] for attr in SLOTS[type(opt)]]
        if any(slot is None for slot in slots):
            continue  # none made (a variable overwritten with its gradient: float8 scales)
        dtype = _decide(variable, owners.get(id(variable)))
        for slot in slots:
            changed |= storage_vars.store_as(slot, dtype)
    return changed


class _Reference:
    """What Keras's ``add_variable_from_reference`` reads of a variable
    (``path``, ``name``, ``shape``, ``_layout``), with the slot's dtype."""

    def __init__(self, variable: Any, dtype: str):
        self.path, self.name, self.shape = variable.path, variable.name, variable.shape
        self._layout, self.dtype = getattr(variable, "_layout", None), dtype


def _from_reference(opt, original):
    # Keras makes each slot in its variable's dtype: a moment decided compact
    # is made in bfloat16, never in float32 first (a float32 slot freed into
    # TensorFlow's allocator would stay in the process's memory).
    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        owners = getattr(_installed.installed(opt), _HELD, None)
        if owners is not None and name in _SLOT_NAMES:
            dtype = _decide(reference_variable, owners.get(id(reference_variable)))
            if dtype != storage_vars.stored_dtype(reference_variable):
                # As TensorFlow's optimizer does, then Keras's own naming.
                with opt._distribution_strategy.extended.colocate_vars_with(
                        reference_variable.value):
                    return base_optimizer.BaseOptimizer.add_variable_from_reference(
                        opt, _Reference(reference_variable, dtype), name=name,
                        initializer=initializer)
        return original(reference_variable, name=name, initializer=initializer)
    return add_variable_from_reference


def apply(model: Any) -> bool:
    """Stores ``model``'s optimizer moments as decided (see the module's
    docstring), now if it is built and from its ``build`` on; returns whether
    a slot was stored anew (functions traced before must be traced again).

    Args:
        model: a compiled Keras model under an adaptive policy.

    Raises:
        TypeError: ``model`` is not a Keras model.
        ValueError: it is not under an adaptive policy.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    if policy_of(model) is None:
        raise ValueError("`model` does not use a keras_mp.AdaptivePolicy: only adaptive "
                         "models store moments compactly.")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or unsupported_reason(optimizer) is not None:
        return False
    opt = optimizer_state.inner(optimizer)
    owners = _owners(model)
    setattr(_installed.installed(opt), _HELD, owners)   # read by the slots' maker
    if any(on for _, _, on in owners.values()) or trained.allowed(model):
        # The update over compact moments; the slots of a bfloat16 weight
        # are float32 unless compact moments are on (Keras copies its dtype).
        native_update.install(opt, compact=True)
        trained.exclude_decay(opt)
        _installed.install_method(opt, "add_variable_from_reference",
                                  functools.partial(_from_reference, opt))
    return _store(opt, owners) if opt.built else False
