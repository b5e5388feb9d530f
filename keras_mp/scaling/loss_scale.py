"""Loss-scale schedules: pure state transitions, written in ``keras.ops``.

A schedule owns no variables. It declares its state (:meth:`state_spec`),
turns a state into a scale (:meth:`scale`) and maps ``(state, finite, step)``
to the next state (:meth:`update`). :class:`keras_mp.LossScaleOptimizer`
keeps the state in optimizer variables (so checkpoints and ``.keras`` files
carry it) and runs :meth:`update` inside the compiled train step, with no
host synchronisation.

Example:
    >>> import keras_mp
    >>> s = keras_mp.DynamicLossScale(initial_scale=1024.0, hysteresis=2)
    >>> state = s.initial_state()
    >>> state = s.update(state, finite=False, step=0)   # tolerated
    >>> float(s.scale(state))
    1024.0
    >>> state = s.update(state, finite=False, step=1)   # second overflow: back off
    >>> float(s.scale(state))
    512.0

Recovery: a streak of non-finite steps that reaches the scale's floor was not
the scale's doing (at the floor it still overflows: an input beyond float16,
a layer whose range does not fit). Once finite steps resume (the adaptive
policy promoted the layer at fault), :class:`DynamicLossScale` grows the
scale back to where it was before the streak, by ``growth_factor`` every
``recovery_interval`` finite steps, instead of once every ``growth_interval``
(2000) steps:

    >>> s = keras_mp.DynamicLossScale(initial_scale=8.0, min_scale=1.0)
    >>> st, scales = s.initial_state(), []
    >>> for finite in [False] * 4 + [True] * 3:      # 8 -> 4 -> 2 -> 1 -> 1, then back
    ...     st = s.update(st, finite=finite, step=0)
    ...     scales.append(float(s.scale(st)))
    >>> scales
    [4.0, 2.0, 1.0, 1.0, 2.0, 4.0, 8.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import keras
import numpy as np
from keras import ops
from keras.saving import deserialize_keras_object, serialize_keras_object

from keras_mp import _checks as checks

__all__ = [
    "LossScaleSchedule",
    "DynamicLossScale",
    "FixedLossScale",
    "PiecewiseInterval",
    "get",
]

State = dict[str, Any]
Interval = Union[int, Callable[[Any], Any]]

_PACKAGE = "keras_mp"


def _positive_finite(name: str, value) -> float:
    return checks.positive(name, checks.number(name, value))


def _probed(growth_interval: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``growth_interval`` if it gives an int >= 1 for step 0 (where it is
    evaluated, inside the compiled step, a bad value would only be a
    TensorFlow error, or a scale that grows every step)."""
    try:
        first = np.asarray(ops.convert_to_numpy(
            growth_interval(ops.convert_to_tensor(0, "int64"))))
    except Exception as e:  # noqa: BLE001 - a user's callable raises what it raises
        raise ValueError("`growth_interval` must be a callable of the step (an int64 scalar) "
                         f"returning an int >= 1; growth_interval(0) raised "
                         f"{type(e).__name__}: {e}") from e
    if first.shape != () or first.dtype.kind not in "iuf" or first != np.round(first) \
            or not first >= 1:
        raise ValueError("`growth_interval` must return an int >= 1 for every step; "
                         f"growth_interval(0) returned {first.tolist()!r}.")
    return growth_interval


class LossScaleSchedule:
    """Base class of loss-scale schedules: state in, finite flag in, state out.

    Subclasses implement :meth:`state_spec`, :meth:`scale`, :meth:`update`
    and :meth:`get_config`, and are registered with
    ``keras.saving.register_keras_serializable`` so that an optimizer using
    them can be saved. Use only ``keras.ops`` (or TensorFlow) in ``update``:
    it runs inside the compiled train step.

    Example, a schedule that halves on overflow and never grows:
        >>> import keras
        >>> from keras import ops
        >>> from keras_mp.scaling.loss_scale import LossScaleSchedule
        >>> @keras.saving.register_keras_serializable(package="my_project")
        ... class BackoffOnly(LossScaleSchedule):
        ...     def __init__(self, initial_scale=2.0**15):
        ...         self.initial_scale = initial_scale
        ...     def state_spec(self):
        ...         return {"loss_scale": ("float32", self.initial_scale)}
        ...     def update(self, state, finite, step):
        ...         s = state["loss_scale"]
        ...         return {"loss_scale": ops.where(finite, s, ops.maximum(s / 2, 1.0))}
        ...     def get_config(self):
        ...         return {"initial_scale": self.initial_scale}
        >>> float(BackoffOnly(8.0).scale(BackoffOnly(8.0).update(
        ...     BackoffOnly(8.0).initial_state(), False, 0)))
        4.0
    """

    def state_spec(self) -> dict[str, tuple[str, float | int]]:
        """Names of the state entries, each with ``(dtype, initial value)``.

        ``"loss_scale"`` (float32) must be one of them unless :meth:`scale`
        is overridden.
        """
        raise NotImplementedError

    def initial_state(self) -> State:
        """The state before the first step, as tensors."""
        return {k: ops.convert_to_tensor(v, dtype=d)
                for k, (d, v) in self.state_spec().items()}

    def scale(self, state: Mapping[str, Any]):
        """The loss scale (a float32 scalar) for ``state``."""
        return state["loss_scale"]

    def rescaled(self, state: Mapping[str, Any], scale) -> State:
        """The state with the loss scale set to ``scale`` (the adaptive rule's
        answer to underflow with headroom); the default replaces
        ``state["loss_scale"]``, a schedule without that entry overrides it."""
        if "loss_scale" not in state:
            raise NotImplementedError(
                f"{type(self).__name__} has no 'loss_scale' state entry: override rescaled().")
        return {**state, "loss_scale": ops.cast(ops.convert_to_tensor(scale), "float32")}

    def recovered(self, state: Mapping[str, Any]) -> State:
        """The state after the cause of a streak of non-finite steps was
        removed (the adaptive policy promoted the layer at fault). The
        default changes nothing; :class:`DynamicLossScale` comes back to the
        scale before the streak."""
        return dict(state)

    def update(self, state: Mapping[str, Any], finite, step) -> State:
        """The state after a step.

        Args:
            state: the current state, keyed as in :meth:`state_spec`.
            finite: scalar bool, True when every gradient of the step was
                finite (already agreed across replicas).
            step: the number of applied (non-skipped) optimizer steps so far.

        Returns:
            The new state, with the same keys and dtypes.
        """
        raise NotImplementedError

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale may change during training."""
        return True

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]):
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    __hash__ = object.__hash__


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PiecewiseInterval:
    """A growth interval that depends on the step: ``values[i]`` applies
    while ``step < boundaries[i]``, the last value after the last boundary.

    Use it as ``DynamicLossScale(growth_interval=PiecewiseInterval(...))`` to
    grow the scale quickly early in training and cautiously later.

    Example:
        >>> from keras_mp.scaling.loss_scale import PiecewiseInterval
        >>> f = PiecewiseInterval(boundaries=[1000], values=[100, 2000])
        >>> int(f(10)), int(f(5000))
        (100, 2000)
    """

    def __init__(self, boundaries: Sequence[int], values: Sequence[int]):
        boundaries, values = checks.integers("boundaries", boundaries, 0), \
            checks.integers("values", values, 1)
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                "`values` must have one more entry than `boundaries`, got "
                f"{len(values)} values for {len(boundaries)} boundaries.")
        if any(b < 0 for b in boundaries) or boundaries != sorted(boundaries):
            raise ValueError("`boundaries` must be increasing integers >= 0, "
                             f"got {boundaries!r}.")
        if any(v < 1 for v in values):
            raise ValueError(f"`values` must be integers >= 1, got {values!r}.")
        self.boundaries = boundaries
        self.values = values

    def __call__(self, step):
        step = ops.cast(step, "int64")
        result = ops.convert_to_tensor(self.values[-1], dtype="int64")
        for b, v in reversed(list(zip(self.boundaries, self.values))):
            result = ops.where(step < b, ops.convert_to_tensor(v, "int64"), result)
        return result

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": list(self.boundaries), "values": list(self.values)}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    __hash__ = object.__hash__


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DynamicLossScale(LossScaleSchedule):
    """Grows the scale after a run of finite steps; backs off on overflow;
    comes back after a streak of overflows that the scale did not cause.

    After ``growth_interval`` consecutive finite steps the scale is multiplied
    by ``growth_factor`` (at most ``max_scale``). A non-finite step resets that
    run; once ``hysteresis`` non-finite steps have occurred since the last
    growth (DeepSpeed/Megatron semantics), each further one multiplies the
    scale by ``backoff_factor`` (at least ``min_scale``). So the scale is never
    inf or 0.

    **Recovery** (``recovery_interval`` not None): a streak of consecutive
    non-finite steps that goes on at ``min_scale`` was not caused by the
    scale. The schedule remembers the scale the streak started from; once
    finite steps resume (the cause is gone, e.g. the adaptive policy promoted
    the layer that overflowed), it grows by ``growth_factor`` every
    ``recovery_interval`` finite steps until it is back there. A non-finite
    step during that regrowth ends it (the usual back-off follows), so a
    scale that was itself too large costs at most one more skipped step. A
    streak that ends above the floor is taken for the scale's own
    calibration, unless the cause is named (:meth:`recovered`, below).
    Without recovery a float16 run whose input overflowed for its first 100
    steps kept a scale of 1 for the rest of a 1440-step run (issue 20).

    Args:
        initial_scale: the scale of the first step.
        growth_factor: multiplier on growth, > 1.
        backoff_factor: multiplier on overflow, in (0, 1).
        growth_interval: finite steps between growths, an int >= 1, or a
            callable of the applied-step count returning one (for example a
            :class:`PiecewiseInterval`; called on step 0 when the schedule is
            made, so a bad value is an error here, not in the train step).
        hysteresis: overflowing steps tolerated before backing off, >= 1.
        min_scale: lower bound of the scale, > 0.
        max_scale: upper bound of the scale, finite and >= ``min_scale``.
        recovery_interval: finite steps between growths while the scale
            comes back after a streak at the floor (an int >= 1), or None for
            no recovery (Megatron/DeepSpeed semantics; what a file saved
            before recovery existed loads as).

    State: ``loss_scale``, ``good_steps`` (finite steps since the last growth
    or overflow), ``hysteresis_left`` (overflows still tolerated) and, with
    recovery, ``streak_start`` (the scale before the latest streak of
    non-finite steps: positive during it, negated once it ended, 0 before any)
    and ``recover_to`` (the scale to come back to, 0 for none).

    When the adaptive policy promotes the layer that overflowed, its callback
    calls :meth:`recovered` (through
    :meth:`keras_mp.LossScaleOptimizer.recover_loss_scale`): the scale grows
    back, the same way, to where it was before the latest streak.

    Example:
        >>> import keras_mp
        >>> s = keras_mp.DynamicLossScale(initial_scale=8.0, growth_interval=2)
        >>> st = s.initial_state()
        >>> for _ in range(4):
        ...     st = s.update(st, finite=True, step=0)
        >>> float(s.scale(st))
        32.0
    """

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: Interval = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        recovery_interval: int | None = 1,
    ):
        self.initial_scale = _positive_finite("initial_scale", initial_scale)
        self.growth_factor = _positive_finite("growth_factor", growth_factor)
        if self.growth_factor <= 1.0:
            raise ValueError(
                f"`growth_factor` must be > 1, got {growth_factor!r}. Use "
                "FixedLossScale for a scale that never grows.")
        self.backoff_factor = _positive_finite("backoff_factor", backoff_factor)
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError("`backoff_factor` must be in the open interval (0, 1), "
                             f"got {backoff_factor!r}.")
        self.growth_interval = _probed(growth_interval) if callable(growth_interval) else \
            checks.integer("growth_interval", growth_interval, 1, " or a callable of the step")
        self.hysteresis = checks.integer("hysteresis", hysteresis)
        self.min_scale = _positive_finite("min_scale", min_scale)
        self.max_scale = _positive_finite("max_scale", max_scale)
        if self.min_scale > self.max_scale:
            raise ValueError(f"`min_scale` ({min_scale!r}) must be <= `max_scale` "
                             f"({max_scale!r}).")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"`initial_scale` must be in [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}], got {initial_scale!r}.")
        if recovery_interval is not None:
            recovery_interval = checks.count("recovery_interval", recovery_interval, 1)
        self.recovery_interval = recovery_interval

    def state_spec(self):
        spec = {
            "loss_scale": ("float32", self.initial_scale),
            "good_steps": ("int64", 0),
            "hysteresis_left": ("int64", self.hysteresis),
        }
        if self.recovery_interval is not None:
            spec["streak_start"] = ("float32", 0.0)
            spec["recover_to"] = ("float32", 0.0)
        return spec

    def rescaled(self, state, scale):
        """The state with the scale set to ``scale`` (clipped to the bounds):
        a fresh growth run, full hysteresis, and a pending recovery dropped
        once the new scale reaches its target."""
        new = ops.clip(ops.cast(ops.convert_to_tensor(scale), "float32"),
                       self.min_scale, self.max_scale)
        out = {**state, "loss_scale": new,
               "good_steps": ops.convert_to_tensor(0, "int64"),
               "hysteresis_left": ops.convert_to_tensor(self.hysteresis, "int64")}
        if self.recovery_interval is not None:
            target = ops.convert_to_tensor(state["recover_to"], "float32")
            out["recover_to"] = ops.where(new >= target, 0.0, target)
            out["streak_start"] = ops.convert_to_tensor(0.0, "float32")
        return out

    def update(self, state, finite, step):
        scale = ops.convert_to_tensor(state["loss_scale"], "float32")
        good = ops.convert_to_tensor(state["good_steps"], "int64")
        left = ops.convert_to_tensor(state["hysteresis_left"], "int64")
        finite = ops.convert_to_tensor(finite, "bool")
        if callable(self.growth_interval):
            interval = ops.cast(self.growth_interval(step), "int64")
        else:
            interval = ops.convert_to_tensor(self.growth_interval, "int64")
        recovery = self.recovery_interval is not None
        if recovery:
            streak_start = ops.convert_to_tensor(state["streak_start"], "float32")
            recover_to = ops.convert_to_tensor(state["recover_to"], "float32")
            # The scale before this streak (a streak that starts while the
            # scale is coming back started, in effect, from the target);
            # negated, and so remembered, once the streak ends.
            start = ops.where(finite, -ops.abs(streak_start), ops.where(
                streak_start > 0, streak_start, ops.maximum(scale, recover_to)))
            # Non-finite at the floor: not the scale's doing, come back once it
            # ends; non-finite above it (regrowth overshot): no recovery.
            at_floor = scale <= self.min_scale
            recover_to = ops.where(finite, recover_to, ops.where(
                at_floor, ops.maximum(recover_to, ops.abs(start)), 0.0))
            recovering = recover_to > scale
            interval = ops.where(recovering, ops.convert_to_tensor(
                self.recovery_interval, "int64"), interval)

        grown_good = good + 1
        grow = ops.logical_and(finite, grown_good >= interval)
        left_after_overflow = ops.maximum(left - 1, 0)
        back_off = ops.logical_and(ops.logical_not(finite), left_after_overflow <= 0)

        grown = ops.minimum(scale * self.growth_factor, self.max_scale)
        if recovery:
            grown = ops.where(recovering, ops.minimum(grown, recover_to), grown)
        new_scale = ops.where(
            grow, grown,
            ops.where(back_off, ops.maximum(scale * self.backoff_factor, self.min_scale),
                      scale))
        new_good = ops.where(finite, ops.where(grow, 0, grown_good), 0)
        new_left = ops.where(finite, ops.where(grow, self.hysteresis, left),
                             left_after_overflow)
        out = {
            "loss_scale": ops.cast(new_scale, "float32"),
            "good_steps": ops.cast(new_good, "int64"),
            "hysteresis_left": ops.cast(new_left, "int64"),
        }
        if recovery:
            out["streak_start"] = ops.cast(start, "float32")
            out["recover_to"] = ops.cast(
                ops.where(ops.logical_and(grow, new_scale >= recover_to), 0.0, recover_to),
                "float32")
        return out

    def recovered(self, state):
        """The state after the cause of the latest streak of non-finite steps
        was removed: from the next finite step the scale grows back, by
        ``growth_factor`` every ``recovery_interval`` steps, to where it was
        before that streak (nothing changes if it is there already, or
        without recovery)."""
        if self.recovery_interval is None:
            return dict(state)
        scale = ops.convert_to_tensor(state["loss_scale"], "float32")
        before = ops.abs(ops.convert_to_tensor(state["streak_start"], "float32"))
        target = ops.maximum(ops.convert_to_tensor(state["recover_to"], "float32"),
                             ops.where(before > scale, before, 0.0))
        return {**state, "recover_to": target,
                "good_steps": ops.where(target > scale, 0, ops.convert_to_tensor(
                    state["good_steps"], "int64"))}

    def get_config(self):
        gi = self.growth_interval
        return {
            "initial_scale": self.initial_scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": serialize_keras_object(gi) if callable(gi) else gi,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "recovery_interval": self.recovery_interval,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        # Saved before recovery existed: as it was then (its state has no
        # recovery entries, so the file's optimizer variables still match).
        config.setdefault("recovery_interval", None)
        if isinstance(config.get("growth_interval"), dict):
            config["growth_interval"] = deserialize_keras_object(config["growth_interval"])
        return cls(**config)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class FixedLossScale(LossScaleSchedule):
    """A constant loss scale; non-finite steps are still skipped.

    Example:
        >>> import keras_mp
        >>> s = keras_mp.FixedLossScale(128.0)
        >>> float(s.scale(s.update(s.initial_state(), finite=False, step=0)))
        128.0
    """

    def __init__(self, scale: float = 2.0**15):
        self.fixed_scale = _positive_finite("scale", scale)

    def state_spec(self):
        return {"loss_scale": ("float32", self.fixed_scale)}

    def update(self, state, finite, step):
        return {"loss_scale": ops.convert_to_tensor(state["loss_scale"], "float32")}

    @property
    def is_dynamic(self) -> bool:
        return False

    def get_config(self):
        return {"scale": self.fixed_scale}


def get(identifier) -> LossScaleSchedule:
    """Turns a schedule, its serialized config, ``"dynamic"`` or a number
    (a fixed scale) into a :class:`LossScaleSchedule`."""
    if isinstance(identifier, LossScaleSchedule):
        return identifier
    if isinstance(identifier, str):
        if identifier == "dynamic":
            return DynamicLossScale()
        raise ValueError("`schedule` must be a LossScaleSchedule, 'dynamic', a "
                         f"number or a serialized schedule, got {identifier!r}.")
    if checks.is_number(identifier):
        return FixedLossScale(identifier)
    if isinstance(identifier, dict):
        obj = deserialize_keras_object(identifier)
        if isinstance(obj, LossScaleSchedule):
            return obj
    raise TypeError("`schedule` must be a LossScaleSchedule, 'dynamic', a number "
                    f"or a serialized schedule, got {identifier!r}.")
