"""Weights that train, stored in bfloat16: the update in float32, rounded stochastically.

Under an adaptive policy a layer computing in bfloat16 reads every weight in
bfloat16, yet Keras keeps the float32 "master" copy that each update is
added to: 4 bytes per parameter, and the gradient of a float32 weight is
float32 too (4 more). Stored in bfloat16 instead, the weight is 2 bytes and
so is its gradient (the tape's gradient has the variable's dtype). What goes
wrong with naive bfloat16 weights (Keras's ``"bfloat16"`` policy) is the
update: rounded to nearest, an update below half a bfloat16 ulp of its weight
(2**-9 of it) is lost, so a fine-tune with AdamW at lr 5e-5 does not move at
all. Here each update is computed in float32 and written back with
**stochastic rounding** (:func:`keras_mp.execution.compact_update.dithered`):
rounded up with the probability of its dropped remainder, so its expected
value is the float32 one and small updates add up::

    w32 = float32(w)
    w32 -= w32 * lr * weight_decay                  # AdamW, decoupled, in float32
    m, v = Adam's moments of float32(g)             # in float32 (compact_update)
    w32 -= alpha * m / (sqrt(v) + epsilon)
    w = dithered(w32, dither(shape, step, variable, salt))   # stochastic rounding

The rounding's numbers are a deterministic sequence of the element's index,
the step and the variable (``dither``): a seeded run repeats bit for bit,
a resumed run continues the sequence, replicas agree.

**On by default in a model that trains at least** :data:`AUTO_PARAMETERS`
**parameters** (2**24; :func:`set_enabled`, documented as
:func:`keras_mp.config.set_compact_weights`: True for every model, False for
none, None the default). Where on, at the start of each
``fit`` of a model under an adaptive policy the rule of
:mod:`~keras_mp.adaptive.storage.frozen` decides each trained weight as it
does a frozen one (reason ``"trains_compact"``): bfloat16 where its layer
computes in bfloat16 and reads it so, no override keeps it in float32, and the
cast loses no more than a rounding. A layer that computes in float32 (a
promotion) has its weights in float32 again at the next ``fit``, exactly
(the bfloat16 value). By default it applies where the optimizer is an exact
``keras.optimizers.Adam`` or ``AdamW`` (the update above;
:data:`DEFAULT_OPTIMIZERS`); with the setting True also to an exact ``SGD``
with momentum, ``Adamax``, ``Nadam``, ``Lion`` or ``Adafactor``
(:data:`OPTIMIZERS`), whose update is the float32 rule of
:mod:`keras_mp.execution.compact_rules` (Adafactor's:
:mod:`keras_mp.execution.compact_adafactor`) from the weight's float32
value, any Keras ``weight_decay`` applied there in float32 first, the weight
written back the same way (dithered, its update-to-ulp statistic kept).
Nadam's ``_u_product`` and Adafactor's factored ``_r`` and ``_c`` (a row and
a column per matrix: tiny) stay float32, where Keras's ``build`` would make
them in the weight's dtype; Adafactor's full-size ``_v`` follows
:func:`keras_mp.config.set_compact_moments`. Not with
AMSGrad, an exponential moving average or gradient accumulation
(:func:`unsupported_reason`), or a distribution strategy other than
``MirroredStrategy`` (under it every replica rounds alike). The moments stay float32
unless :func:`keras_mp.config.set_compact_moments` stores them in bfloat16
too (by default it does in the same models, Adam's and AdamW's). The other
optimizers' compact weights are opt-in as their moments are: the default's
quality runs trained with AdamW; those of SGD with momentum, Adamax,
Nadam and Lion with compact weights and moments (docs/benchmarks.md, three
seeds of a 0.46M-parameter LM, 1000 steps) ended within 0.7 % of Keras
float32's loss on average over the seeds, but single runs of SGD up to
4.4 % either way and one of Lion's +2.11 %; Adafactor's, all six figures
within 0.6 % (three seeds, train and held-out). Measured on the
99.5M-parameter Llama of ``benchmarks/llm_memory.py`` (docs/benchmarks.md;
its logits kernel, read as a float32 value, stored so too:
:func:`keras_mp.adaptive.storage.frozen.read_by_cast`):
8 bytes of training state a parameter instead of 16, its full fine-tune's
peak 0.71x Keras float32's and its step 0.92x Keras ``mixed_bfloat16``'s
CPU time (five rounds, 2-core AMD EPYC with AVX512-BF16).

Example:
    >>> import keras
    >>> from keras_mp.adaptive.storage import trained
    >>> trained.enabled()       # None: the default, by the model's size
    >>> trained.AUTO_PARAMETERS
    16777216
    >>> trained.unsupported_reason(keras.optimizers.AdamW(use_ema=True))
    'an exponential moving average (use_ema) averages in the weight dtype'
    >>> trained.unsupported_reason(keras.optimizers.Nadam())   # opt-in: set_enabled(True)
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_mp import _installed
from keras_mp.adaptive.storage import variables as storage_vars
from keras_mp.execution import compact_update, native_update, optimizer_state

__all__ = ["AUTO_PARAMETERS", "DEFAULT_OPTIMIZERS", "OPTIMIZERS", "adam_reason", "allowed",
           "enabled", "exclude_decay", "large", "mark", "on", "set_enabled",
           "unsupported_reason"]

#: The optimizer classes (exact) whose update runs over bfloat16 weights:
#: Adam's and AdamW's (:func:`keras_mp.execution.compact_update.adam`),
#: SGD with momentum's, Adamax's, Nadam's and Lion's
#: (:mod:`keras_mp.execution.compact_rules`) and Adafactor's
#: (:mod:`keras_mp.execution.compact_adafactor`).
OPTIMIZERS: tuple[type, ...] = (keras.optimizers.Adam, keras.optimizers.AdamW,
                                keras.optimizers.SGD, keras.optimizers.Adamax,
                                keras.optimizers.Nadam, keras.optimizers.Lion,
                                keras.optimizers.Adafactor)
#: The classes whose weights are compact by default (the setting None, in a
#: large model): those of the default's quality runs. The others of
#: :data:`OPTIMIZERS` only with ``keras_mp.config.set_compact_weights(True)``.
DEFAULT_OPTIMIZERS: tuple[type, ...] = (keras.optimizers.Adam, keras.optimizers.AdamW)
#: By default (the setting None) weights and moments are stored compactly in
#: a model that trains at least this many parameters (2**24: 16.8 million,
#: 128 MiB of training state saved at 8 bytes a parameter); below it the
#: saving is small and each compiled update costs start-up.
AUTO_PARAMETERS = 2 ** 24
_DECAY = "_use_weight_decay"
_BUILD = "build"
_state: dict[str, bool | None] = {"enabled": None}


def enabled() -> bool | None:
    """The setting: True (always), False (never) or None (the default:
    where :func:`large` holds)."""
    return _state["enabled"]


def set_enabled(enabled: bool | None) -> None:
    """Turns compact trained weights on (True), off (False) or back to the
    default (None: in a model :func:`large` holds for); documented as
    :func:`keras_mp.config.set_compact_weights`; applied at the next
    ``fit``, which stores them in float32 again where off.

    Args:
        enabled: True, False or None.
    """
    if not (enabled is None or isinstance(enabled, bool)):
        raise TypeError(f"`enabled` must be True, False or None, got {enabled!r}.")
    _state["enabled"] = enabled


def large(model: Any) -> bool:
    """Whether ``model`` trains at least :data:`AUTO_PARAMETERS` parameters
    (its trainable variables now).

    Raises:
        TypeError: ``model`` is not a Keras model.

    Example:
        >>> import keras
        >>> large(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
        False
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    return sum(int(np.prod(v.shape)) for v in model.trainable_variables) >= AUTO_PARAMETERS


def on(setting: bool | None, model: Any) -> bool:
    """Whether a compact-storage ``setting`` (True, False, or None: by
    size) stores ``model``'s state compactly."""
    return setting is True or (setting is None and large(model))


def adam_reason(optimizer: Any) -> str | None:
    """Why ``optimizer`` (a loss-scale wrapper counts as its inner optimizer)
    is not one whose update keras-mp computes over compact state (None when
    it is: an exact Adam, AdamW, SGD with momentum, Adamax, Nadam, Lion or
    Adafactor):
    the class, AMSGrad, SGD without momentum, the native update's own
    conditions, a distribution strategy other than ``MirroredStrategy``
    (under it each replica's update is the same, its dithered rounding keyed
    on the step and the variable alone, so the replicas agree:
    ``tests/test_distributed.py``; not tried under the others).

    Example:
        >>> import keras
        >>> adam_reason(keras.optimizers.Adam(amsgrad=True))
        'AMSGrad keeps a third moment: not stored compactly'
    """
    opt = optimizer_state.inner(optimizer)
    if type(opt) not in compact_update.SLOTS:
        names = ", ".join(cls.__name__ for cls in compact_update.SLOTS)
        return f"{type(opt).__name__}'s state is not stored compactly (only {names}'s)"
    if getattr(opt, "amsgrad", False):
        return "AMSGrad keeps a third moment: not stored compactly"
    if isinstance(opt, keras.optimizers.SGD) and opt.momentum == 0:
        return "SGD without momentum keeps no moments: its update is TensorFlow's kernel"
    strategy = getattr(opt, "_distribution_strategy", None)
    if tf.distribute.has_strategy() or (strategy is not None
                                        and strategy is not tf.distribute.get_strategy()):
        strategy = strategy if strategy is not None else tf.distribute.get_strategy()
        if not isinstance(strategy, tf.distribute.MirroredStrategy):
            why = ("; TensorFlow cannot make a bfloat16 variable across workers"
                   if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) else "")
            return (f"{type(strategy).__name__}: state stays float32 (compact state runs "
                    f"under MirroredStrategy{why})")
    return native_update.unsupported_reason(opt, compact=True)


def unsupported_reason(optimizer: Any) -> str | None:
    """Why ``optimizer`` keeps its trained weights in float32 (None when they
    can be bfloat16): :func:`adam_reason` (a class not in :data:`OPTIMIZERS`,
    AMSGrad, SGD without momentum), and Keras's own
    per-variable state that copies the weight's dtype (an exponential moving
    average, gradient accumulators). Whether they are bfloat16 by default is
    :func:`allowed`'s (only Adam's and AdamW's, :data:`DEFAULT_OPTIMIZERS`).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.

    Example:
        >>> import keras
        >>> unsupported_reason(keras.optimizers.Lion()) is None
        True
        >>> unsupported_reason(keras.optimizers.SGD(momentum=0.0))
        "SGD without momentum keeps no moments: its update is TensorFlow's kernel"
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    reason = adam_reason(optimizer)
    if reason is not None:
        return reason
    opt = optimizer_state.inner(optimizer)
    if type(opt) not in OPTIMIZERS:   # never: adam_reason's classes are these
        return f"{type(opt).__name__}: its weights are not stored in bfloat16"
    if opt.use_ema:
        return "an exponential moving average (use_ema) averages in the weight dtype"
    if opt.gradient_accumulation_steps:
        return "gradient accumulation sums in the weight dtype"
    return None


def allowed(model: Any) -> bool:
    """Whether ``model``'s trained weights may be stored in bfloat16 now: the
    setting says so for it (:func:`on`; where it is None, the default, only
    with an optimizer of :data:`DEFAULT_OPTIMIZERS`) and its optimizer is
    supported (:func:`unsupported_reason`).

    Raises:
        TypeError: ``model`` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r} of type "
                        f"{type(model).__name__}.")
    optimizer = getattr(model, "optimizer", None)
    setting = _state["enabled"]
    return optimizer is not None and on(setting, model) \
        and unsupported_reason(optimizer) is None \
        and (setting is True or type(optimizer_state.inner(optimizer)) in DEFAULT_OPTIMIZERS)


def _without_compact(opt, original):
    def _use_weight_decay(variable):
        return False if compact_update.applies(opt, variable) else original(variable)
    return _use_weight_decay


def exclude_decay(optimizer: Any) -> None:
    """Leaves the weight decay (Keras's ``weight_decay`` argument, of any
    optimizer: AdamW's, SGD's, Lion's ...) of every variable whose update
    keras-mp computes over compact state
    (:func:`keras_mp.execution.compact_update.applies`) to that update, which
    applies it in float32 within its one pass: Keras's own (``variable *
    wd * lr`` in the variable's dtype, before the update) is below half a
    bfloat16 ulp of a bfloat16 weight, and of a float32 one it makes a
    temporary of the variable's size (94 MiB for the logits kernel of
    ``benchmarks/llm_memory.py``'s Llama, alive at its step's peak).

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer, got {optimizer!r}.")
    if not _installed.is_wrapped(optimizer, _DECAY):
        _installed.install_method(optimizer, _DECAY,
                                  lambda original: _without_compact(optimizer, original))


#: The optimizer classes whose ``build`` makes small state in a weight's
#: dtype that stays float32 beside compact weights, and its attributes.
_FLOAT32_STATE = {keras.optimizers.Nadam: ("_u_product",),
                  keras.optimizers.Adafactor: ("_r", "_c")}


def _state_in_float32(opt) -> None:
    """Nadam's ``_u_product`` (the momentum schedule's running product, a
    scalar) and Adafactor's factored ``_r`` and ``_c`` in float32: Keras's
    ``build`` makes the first in the first weight's dtype, the others in
    their weight's, bfloat16 for a compact weight, where each step's product
    or moving average would be rounded to 8 bits. (Adafactor's placeholders
    for vectors are int32 and stay so.)"""
    for name in _FLOAT32_STATE.get(type(opt), ()):
        held = getattr(opt, name, None)
        for x in held if isinstance(held, list) else [held]:
            if isinstance(x, keras.Variable) \
                    and storage_vars.stored_dtype(x) in ("bfloat16", "float16"):
                storage_vars.store_as(x, "float32")


def _build_then_float32(opt, original):
    def build(var_list):
        original(var_list)
        _state_in_float32(opt)
    return build


def _rekey(opt) -> None:
    """Keras indexes an optimizer's variables by their TensorFlow variable;
    a variable stored anew has a new one."""
    if getattr(opt, "built", False) and hasattr(opt, "_trainable_variables_indices"):
        opt._trainable_variables_indices = {
            opt._var_key(v): i for i, v in enumerate(opt._trainable_variables)}
        opt.__dict__.pop("_exclude_from_weight_decay_cache", None)


def mark(optimizer: Any, compact: list | None, restored: bool) -> None:
    """After a model's weights were stored as decided: tells its
    ``optimizer`` (None: nothing to tell) which trained weights are stored in
    bfloat16 (``compact``, the variables, or None to leave that as it is;
    their update is :func:`keras_mp.execution.compact_update.adam` or
    :func:`keras_mp.execution.compact_rules.update`'s rule), installs that
    update and the decay's exclusion (a Nadam's ``_u_product`` and an
    Adafactor's ``_r`` and ``_c`` kept float32, also where its ``build``
    comes later), and, where a trained variable was
    stored anew (``restored``), indexes the optimizer's variables again.

    Raises:
        TypeError: ``optimizer`` is neither a Keras optimizer nor None.
    """
    if optimizer is None:
        return
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"`optimizer` must be a Keras optimizer or None, got {optimizer!r}.")
    opt = optimizer_state.inner(optimizer)
    ids = {id(v) for v in compact or () if storage_vars.stored_dtype(v) == "bfloat16"}
    if compact is not None:
        setattr(_installed.installed(opt), compact_update.WEIGHTS, ids)
        compact_update.keep_statistics(opt, [v for v in compact if id(v) in ids])
    if ids:
        native_update.install(opt, compact=True)
        exclude_decay(opt)
        if type(opt) in _FLOAT32_STATE:   # its build may come later in the fit
            _state_in_float32(opt)
            if not _installed.is_wrapped(opt, _BUILD):
                _installed.install_method(opt, _BUILD,
                                          lambda original: _build_then_float32(opt, original))
    if restored:
        for o in {id(optimizer): optimizer, id(opt): opt}.values():
            _rekey(o)
