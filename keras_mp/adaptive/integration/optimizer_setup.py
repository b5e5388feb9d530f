"""How :class:`keras_mp.callbacks.AdaptivePrecision` sets up the model's
optimizer: the smallest loss scale a schedule reaches (where non-finite
gradients start to count against layers), and replacing the model's
optimizer with a loss-scaling wrapper, or with a fresh copy when
:func:`keras_mp.adaptive.evidence.float8.prepare` added variables after ``fit`` built it.

Example:
    >>> from keras_mp import FixedLossScale, DynamicLossScale
    >>> from keras_mp.adaptive.integration import optimizer_setup
    >>> optimizer_setup.scale_floor(FixedLossScale(128.0))
    128.0
    >>> optimizer_setup.scale_floor(DynamicLossScale(min_scale=1.0))
    1.0
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_mp.scaling import loss_scale as loss_scale_lib
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["scale_floor", "check_loss_scale", "connect", "replace_optimizer", "rebuild_for_new_variables"]


def scale_floor(schedule: loss_scale_lib.LossScaleSchedule) -> float | None:
    """The smallest scale ``schedule`` reaches (None if unknown: every
    non-finite step then counts against the layers)."""
    if not isinstance(schedule, loss_scale_lib.LossScaleSchedule):
        raise TypeError(f"`schedule` must be a keras_mp LossScaleSchedule, got {schedule!r}.")
    if not schedule.is_dynamic:
        return float(schedule.scale(schedule.initial_state()))
    floor = getattr(schedule, "min_scale", None)
    return float(floor) if floor is not None else None


def replace_optimizer(model: keras.Model, make: Callable[[], keras.optimizers.Optimizer]):
    """``make()``'s optimizer, built on the model's variables, becomes the
    model's (and its compile config's, so that a ``.keras`` file recompiles
    with it and its saved variables load into it); the train function is
    traced anew (one traced before would keep the old optimizer). Returns it."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    with model.distribute_strategy.scope():
        new = make()
        # A model that fit builds in its first step (a Sequential without
        # an Input) has no variables yet: the optimizer builds at its first
        # apply, as Keras's does. Built on none it would refuse them.
        if model.trainable_variables:
            new.build(model.trainable_variables)
    model.optimizer = new
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is not None and "optimizer" in getattr(compile_config, "config", {}):
        compile_config.config["optimizer"] = new
    model.train_function = None
    return new


def check_loss_scale(loss_scale) -> None:
    """Raises a ``ValueError`` unless ``loss_scale`` is None or what
    :class:`keras_mp.LossScaleOptimizer` takes as ``schedule``."""
    if loss_scale is None:
        return
    try:
        loss_scale_lib.get(loss_scale)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`loss_scale` must be None, a keras_mp LossScaleSchedule, 'dynamic', a number (a "
            f"fixed scale) or a serialized schedule, got {loss_scale!r}.") from e


def wrap_for_loss_scaling(model: keras.Model, opt, schedule, layer_scales: bool,
                          keras_train_step: bool) -> LossScaleOptimizer:
    """Replaces ``model``'s optimizer by a :class:`keras_mp.LossScaleOptimizer`
    around its inner optimizer (Keras's own loss-scale wrapper taken off). A
    model with its own ``train_step`` may not call ``scale_loss``: its
    gradients are unscaled only where they were scaled
    (:mod:`keras_mp.scaling.scaled_loss`)."""
    inner = opt.inner_optimizer if isinstance(opt, keras.optimizers.LossScaleOptimizer) else opt
    new = replace_optimizer(
        model, lambda: LossScaleOptimizer(inner, schedule=schedule, layer_scales=layer_scales))
    if not keras_train_step:
        new.check_scaled_loss = model.name
    return new


def connect(model: keras.Model, policy, loss_scale=None, keras_train_step: bool = True,
            skip_nonfinite: bool = True):
    """The optimizer a model adapts with: the model's own, or a
    :class:`keras_mp.LossScaleOptimizer` around it that replaces it. A
    dynamic loss scale (or ``loss_scale``) where float16 is a candidate (or
    the model was compiled with Keras's loss-scale wrapper); elsewhere, with
    ``skip_nonfinite``, ``FixedLossScale(1.0)``: no loss scaling, only the
    skip of a step whose gradients are not finite
    (:mod:`keras_mp.adaptive.integration.skipping`). A keras-mp
    ``LossScaleOptimizer`` the model has already is kept.

    Raises:
        ValueError: the model has no optimizer (not compiled).
    """
    opt = getattr(model, "optimizer", None)
    if opt is None:
        raise ValueError("AdaptivePrecision needs a compiled model (model.compile(...)) "
                         "or, in a custom loop, model.optimizer set.")
    if isinstance(opt, LossScaleOptimizer):
        return opt
    if policy.uses_float16 or loss_scale is not None \
            or isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return wrap_for_loss_scaling(model, opt, "dynamic" if loss_scale is None else loss_scale,
                                     policy.layer_loss_scales, keras_train_step)
    if skip_nonfinite:
        # A loss_scale_factor of the user's becomes the fixed scale (Keras's
        # wrapper takes the inner optimizer's over); none: 1, only the skip.
        factor = getattr(opt, "loss_scale_factor", None)
        return wrap_for_loss_scaling(model, opt, loss_scale_lib.FixedLossScale(
            float(factor) if factor else 1.0), False, True)
    return opt


def per_layer(model: keras.Model, policy, opt) -> bool:
    """Per-layer loss scales: asked for by the policy or the optimizer
    (built here, so that its layers can be bound before the first step)."""
    own = isinstance(opt, LossScaleOptimizer) and opt.layer_scales
    if own and not opt.built and model.trainable_variables:
        with model.distribute_strategy.scope():
            opt.build(model.trainable_variables)
    return policy.layer_loss_scales or own


def rebuild_for_new_variables(model: keras.Model) -> None:
    """A fresh copy of the model's optimizer, built on its variables now:
    :func:`keras_mp.adaptive.evidence.float8.prepare` just added float8 variables that an
    optimizer built before (``fit`` builds it before callbacks start, under a
    strategy) would refuse. The copy keeps the variables the optimizer
    excludes from weight decay. Only an optimizer that has not taken a step
    yet is replaced; otherwise a ``ValueError`` says what to do."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a Keras model, got {model!r}.")
    opt = getattr(model, "optimizer", None)
    if opt is None or not opt.built:
        return
    if int(keras.ops.convert_to_numpy(opt.iterations)) > 0:
        raise ValueError(
            "The model's optimizer has already trained without the float8 variables that "
            "keras_mp.adaptive.evidence.float8.prepare(model) adds; call it before the optimizer's first step "
            "(before fit, or before optimizer.build in a custom loop).")
    replace_optimizer(model, lambda: _fresh_copy(opt))


#: What ``exclude_from_weight_decay`` sets on an optimizer; not in its config.
_WEIGHT_DECAY_EXCLUSIONS = ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern")


def _fresh_copy(opt: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """An unbuilt copy of ``opt`` from its config, with the variables it
    excludes from weight decay (``exclude_from_weight_decay`` keeps them
    outside the config: a copy without them would decay the biases and
    LayerNorm weights of an ``AdamW`` set up to skip them)."""
    new = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    pairs = [(opt, new)]
    if hasattr(opt, "inner_optimizer") and hasattr(new, "inner_optimizer"):
        pairs.append((opt.inner_optimizer, new.inner_optimizer))
    for old, fresh in pairs:
        kept = [attr for attr in _WEIGHT_DECAY_EXCLUSIONS if attr in old.__dict__]
        for attr in kept:
            value = old.__dict__[attr]
            # Variable keys (ids) of the same variables: the copy is built on them.
            setattr(fresh, attr, set(value) if isinstance(value, set) else value)
        if kept:
            fresh._exclude_from_weight_decay_cache = {}
    return new
