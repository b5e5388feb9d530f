"""``LossScaleOptimizer``: Keras's loss-scale optimizer with schedules,
bounds, hysteresis, skip counting, and a finite check agreed across replicas.

One step, as run inside Keras's compiled train step:

1. one multi-tensor kernel unscales every gradient and flags the non-finite
   ones (:func:`keras_mp.scaling.kernels.unscale_and_check`);
2. under ``tf.distribute`` the per-variable flags are all-reduced, so every
   replica (and worker) takes the same decision, even when only one replica
   saw a NaN (Keras decides per replica, before the all-reduce);
3. the inner optimizer applies the *unscaled* gradients only if all are
   finite, so its ``clipnorm``/``clipvalue`` act on true gradient values and
   a skipped step changes no weight, slot or iteration count;
4. the schedule maps ``(state, finite)`` to the next state, in-graph.

With ``gradient_accumulation_steps=k`` each ``apply`` is one micro-batch and
step 3 holds it: a non-finite one is skipped alone (accumulators and count
stay, the scale backs off), so an update is always k finite micro-batches.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras import initializers, ops
from keras.saving import deserialize_keras_object, serialize_keras_object
from keras.src.utils import tracking  # Keras's own LSO.build uses it too

from keras_mp import _checks as checks
from keras_mp import distribute
from keras_mp.scaling import kernels, layer_scales as layer_scales_lib
from keras_mp.scaling import loss_scale as loss_scale_lib
from keras_mp.scaling import skips
from keras_mp.scaling.keras_names import (DEFAULT_GROWTH_STEPS, DEFAULT_INITIAL_SCALE,
                                           KerasNamesMixin, growth_steps_of, legacy_schedule)
from keras_mp.scaling.saved_state import SavedStateMixin
from keras_mp.scaling.scaled_loss import ScaledLossCheck

__all__ = ["LossScaleOptimizer"]

_KerasLSO = keras.optimizers.LossScaleOptimizer


def _in_xla_context() -> bool:
    from tensorflow.python.ops import control_flow_util  # no public equivalent

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(layer_scales_lib.LayerScalesMixin, KerasNamesMixin, SavedStateMixin,
                         _KerasLSO):
    """Loss scaling with configurable schedules; a drop-in for
    ``keras.optimizers.LossScaleOptimizer`` (and an instance of it, so Keras's
    ``compile`` does not wrap it again).

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap (not
            itself a ``LossScaleOptimizer``).
        initial_scale: as in Keras: the first loss scale of the default
            dynamic schedule. Not with ``schedule``.
        dynamic_growth_steps: as in Keras: finite steps between growths of
            the default dynamic schedule. Not with ``schedule``.
        schedule: a :class:`keras_mp.scaling.loss_scale.LossScaleSchedule` (for
            example :class:`keras_mp.DynamicLossScale` or
            :class:`keras_mp.FixedLossScale`), ``"dynamic"`` or a number (a
            fixed scale). Replaces the two arguments above.
        max_consecutive_skips: if set (an int >= 1), a step that makes the
            number of consecutive skipped steps exceed it stops the run with
            :class:`keras_mp.scaling.skips.TooManySkipsError` naming the
            variables whose gradients were non-finite, instead of skipping
            forever (``fit``, and ``apply`` run eagerly; a custom
            ``tf.function`` loop gets TensorFlow's error with that sentence).
            Needs a train step that is not XLA-compiled (``jit_compile=False``).
        layer_scales: per-layer loss scales (see
            :mod:`keras_mp.scaling.layer_scales`): each gradient is unscaled
            by the global scale times its layer's own factor, kept in the
            ``variable_scales`` variable (one entry per variable, 1 until set).
            The adaptive policy (``AdaptivePolicy(layer_loss_scales=True)``)
            installs the matching layer boundaries, binds the layers
            (:meth:`bind_layer_scales`) and chooses the factors; without
            boundaries the factors stay 1 and this changes nothing.
        name: the optimizer's name.
        **kwargs: Keras's ``dynamic=True`` is accepted; base-optimizer
            arguments (``clipnorm``, ...) belong on ``inner_optimizer``.

    State, all optimizer variables (saved by ``model.save`` and checkpoints):
    the schedule's (``loss_scale``, and for :class:`~keras_mp.DynamicLossScale`
    ``good_steps``, ``hysteresis_left`` and its recovery state),
    ``skipped_steps``, ``consecutive_skips`` and, with ``layer_scales``,
    ``variable_scales``.

    Example, with ``fit``:
        >>> import keras, keras_mp
        >>> opt = keras_mp.LossScaleOptimizer(
        ...     keras.optimizers.Adam(1e-3),
        ...     schedule=keras_mp.DynamicLossScale(growth_interval=500, hysteresis=2))
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer=opt, loss="mse")

    Example, in a custom training loop:
        >>> import tensorflow as tf
        >>> opt = keras_mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        >>> x, y = tf.ones([8, 4]), tf.zeros([8, 1])
        >>> with tf.GradientTape() as tape:
        ...     loss = keras.losses.mean_squared_error(y, model(x))
        ...     scaled = opt.scale_loss(tf.reduce_mean(loss))
        >>> grads = tape.gradient(scaled, model.trainable_variables)
        >>> opt.apply(grads, model.trainable_variables)   # unscales, checks, skips if needed
    """

    def __init__(
        self,
        inner_optimizer,
        initial_scale: float = DEFAULT_INITIAL_SCALE,
        dynamic_growth_steps: int = DEFAULT_GROWTH_STEPS,
        *,
        schedule: Any = None,
        max_consecutive_skips: int | None = None,
        layer_scales: bool = False,
        name: str | None = None,
        **kwargs,
    ):
        if isinstance(inner_optimizer, _KerasLSO):
            raise ValueError(
                "`inner_optimizer` is already a LossScaleOptimizer; wrapping twice "
                "would scale the loss twice. Pass the optimizer it wraps "
                f"(`{type(inner_optimizer).__name__}.inner_optimizer`) instead.")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "`inner_optimizer` must be a keras.optimizers.Optimizer instance, "
                f"got {inner_optimizer!r} of type {type(inner_optimizer).__name__}.")
        if dynamic_growth_steps is None and schedule is not None:
            dynamic_growth_steps = DEFAULT_GROWTH_STEPS   # as get_config writes it
        if schedule is not None:
            if initial_scale != DEFAULT_INITIAL_SCALE or \
                    dynamic_growth_steps != DEFAULT_GROWTH_STEPS:
                raise ValueError(
                    "Pass either `schedule` or `initial_scale`/`dynamic_growth_steps`, "
                    "not both: the schedule sets the initial scale and growth.")
            schedule_given = True
            schedule = loss_scale_lib.get(schedule)
        else:
            schedule_given = False
            schedule = legacy_schedule(initial_scale, dynamic_growth_steps)
        if max_consecutive_skips is not None:
            max_consecutive_skips = checks.count("max_consecutive_skips", max_consecutive_skips, 1)
        if not isinstance(layer_scales, bool):
            raise ValueError(f"`layer_scales` must be True or False, got {layer_scales!r}.")
        if tf.distribute.has_strategy():
            distribute.check_strategy()  # fail at construction, before compile
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        # None with a fixed scale (tf.keras's value); the schedule's interval otherwise.
        self.dynamic_growth_steps = growth_steps_of(schedule)
        self._schedule_given = schedule_given
        self.schedule = schedule
        self.max_consecutive_skips = max_consecutive_skips
        self.layer_scales = layer_scales
        self.variable_scales = None
        # Per variable (in build order), the layer group whose factor it takes
        # (see bind_layer_scales); -1: its own, which stays 1.
        self._scale_groups: list[int] | None = None
        self.initial_scale = float(schedule.scale(schedule.initial_state()))
        self._state_variables: dict[str, keras.Variable] = {}
        # Called in replica context with (GradientStatistics, scale, variables)
        # every step when set; the adaptive precision policy hooks in here.
        # The gate, a callable or None (every step), returns in the step being
        # traced a scalar bool: the sink runs only where it is true.
        self.statistics_sink = self.statistics_gate = None
        # Set while a guarded train step traces (keras_mp.adaptive.integration.
        # skipping): its ``bad_data`` (a scalar bool, or None) says the batch
        # itself was not finite, and ``decided(finite, bad)`` hears the verdict.
        self.step_guard = None
        # A model's name: unscale only what its scale_loss scaled (scaled_loss).
        self.check_scaled_loss = None
        object.__setattr__(self, "_scaled_loss", ScaledLossCheck())
        # What a checkpoint of this optimizer saved before its first step holds.
        self._unbuilt_variable_count = len(self.variables)

    # -- state ------------------------------------------------------------

    def build(self, var_list):
        # Not Keras's LSO.build: our state comes from the schedule. And the
        # inner optimizer builds as it builds alone, its variables tracked:
        # Keras's LSO builds it untracked, so that what an optimizer makes as
        # an attribute (Nadam's running product ``_u_product``, Adafactor's
        # placeholders) was neither listed nor saved, and a resumed Nadam
        # restarted its product at 1 (saved_state reads the files saved so).
        self._build_state(var_list)
        self.inner_optimizer.build(var_list)
        self._build_base(var_list)

    @tracking.no_automatic_dependency_tracking
    def _build_base(self, var_list):
        keras.optimizers.Optimizer.build(self, var_list)

    @tracking.no_automatic_dependency_tracking
    def _build_state(self, var_list):
        distribute.check_strategy()
        self._state_variables = {}
        for key, (dtype, value) in self.schedule.state_spec().items():
            self._state_variables[key] = self.add_variable(
                shape=(), dtype=dtype, initializer=initializers.Constant(value),
                aggregation="only_first_replica", name=key)
        self.skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros",
            aggregation="only_first_replica", name="skipped_steps")
        self.consecutive_skips = self.add_variable(
            shape=(), dtype="int64", initializer="zeros",
            aggregation="only_first_replica", name="consecutive_skips")
        if self.layer_scales:
            self.variable_scales = self.add_variable(
                shape=(len(var_list),), dtype="float32", initializer="ones",
                aggregation="only_first_replica", name="variable_scales")

    @property
    def loss_scale_state(self) -> dict[str, keras.Variable]:
        """The schedule's state variables, by name (empty before ``build``)."""
        return dict(self._state_variables)

    @property
    def loss_scale(self):
        """The current loss scale (a float32 scalar tensor)."""
        if not self.built:
            return ops.convert_to_tensor(self.initial_scale, "float32")
        return tf.convert_to_tensor(
            self.schedule.scale({k: v.value for k, v in self._state_variables.items()}))

    def _unit_scale(self) -> bool:
        """Whether the scale is 1 for good (``FixedLossScale(1.0)``, no
        per-layer factors): the optimizer only skips non-finite steps."""
        return not self.schedule.is_dynamic and self.initial_scale == 1.0 \
            and not self.layer_scales

    def set_loss_scale(self, scale: float) -> None:
        """Sets the loss scale, outside a train step (the adaptive policy
        grows it when gradients underflow with headroom). The schedule
        decides what else changes (:meth:`LossScaleSchedule.rescaled`: for
        :class:`keras_mp.DynamicLossScale`, a fresh growth run and the scale
        clipped to its bounds).

        Args:
            scale: the new scale, a finite number > 0.
        """
        scale = checks.positive("scale", scale)
        if not self.built:
            raise ValueError("set_loss_scale() needs a built optimizer: call it after the "
                             "first step or optimizer.build(variables).")
        if self._unit_scale():
            raise ValueError("This LossScaleOptimizer's FixedLossScale(1.0) only skips "
                             "non-finite steps; its traced steps do not unscale, so its scale "
                             "cannot change. Wrap the inner optimizer with the schedule you "
                             "want instead.")
        state = {k: v.value for k, v in self._state_variables.items()}
        for key, value in self.schedule.rescaled(state, float(scale)).items():
            var = self._state_variables[key]
            var.assign(ops.cast(value, var.dtype))

    def recover_loss_scale(self) -> None:
        """Says that the cause of the latest streak of non-finite steps is gone
        (outside a train step): the schedule comes back to the scale before
        it (:meth:`LossScaleSchedule.recovered`). The adaptive policy calls it
        when it promotes the layer that overflowed."""
        if not self.built:
            return
        state = {k: v.value for k, v in self._state_variables.items()}
        for key, value in self.schedule.recovered(state).items():
            var = self._state_variables[key]
            var.assign(ops.cast(value, var.dtype))

    # -- loss and gradient scaling ----------------------------------------

    def scale_loss(self, loss):
        """Multiplies ``loss`` by the current loss scale (cast to its dtype)."""
        loss = ops.convert_to_tensor(loss)
        self._scaled_loss.scaled()
        if self.built and self._unit_scale():
            return loss  # times 1: no op in the step
        return ops.multiply(loss, ops.cast(self.loss_scale, loss.dtype))

    # -- the step ---------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if not self.built and not tf.executing_eagerly() and tf.distribute.has_strategy() \
                and tf.distribute.get_strategy().num_replicas_in_sync > 1:
            # Variables created lazily inside a traced replica function would
            # not be initialised before the function reads them ("You must feed
            # a value for placeholder tensor"). As tf.keras's optimizer did,
            # create them once, outside the function, in cross-replica context.
            variables = trainable_variables
            ctx = tf.distribute.get_replica_context()
            if ctx is not None:
                ctx.merge_call(lambda _: self._build_outside_function(variables))
            else:
                self._build_outside_function(variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        tvars = trainable_variables if trainable_variables is not None \
            else self._trainable_variables
        grads = list(grads)
        if len(grads) != len(tvars):
            raise ValueError(f"Got {len(grads)} gradients for {len(tvars)} variables.")

        unit = self._unit_scale()
        scale = self._scaled_loss.scale_to_undo(
            tf.constant(1.0) if unit else self.loss_scale, self.check_scaled_loss)
        factors = None
        if self.layer_scales:
            factors, _ = self._variable_factors(tvars)
        total = scale if factors is None else scale * factors  # per gradient
        guard = self.step_guard
        bad = getattr(guard, "bad_data", None)

        def unscale_and_check():  # a scale of exactly 1: no unscaling, one sum per gradient
            if unit:
                return grads, kernels.nonfinite_by_sums(grads)
            return kernels.unscale_and_check(grads, total, return_mask=True)

        if self.statistics_sink is None:
            unscaled, nonfinite = unscale_and_check()
        else:
            on = self.statistics_gate() if self.statistics_gate is not None else None
            if on is None:
                # One pass yields both the finite flags and what the sink needs.
                unscaled, stats = kernels.unscale_with_statistics(grads, total)
                nonfinite = stats.nonfinite > 0
            else:
                # Statistics only on the steps the gate lets through.
                unscaled, nonfinite = unscale_and_check()
                stats = tf.cond(on, lambda: kernels.gradient_statistics(grads, total),
                                lambda: kernels.GradientStatistics(
                                    *[tf.zeros([len(grads)])] * len(kernels.STATISTICS)))
            extra = {} if factors is None else {"factors": factors}
            if bad is not None:  # a bad batch's evidence counts for no layer
                extra["bad_data"] = bad
            self.statistics_sink(stats, scale, tvars, **extra)
        # Variables that take the gradient as their new value (float8 scales)
        # are never loss-scaled.
        unscaled = [g if g is not None and self._overwrite_variable_with_gradient(v) else u
                    for g, u, v in zip(grads, unscaled, tvars)]
        ctx = tf.distribute.get_replica_context()
        if tf.distribute.has_strategy() and ctx.num_replicas_in_sync > 1:
            nonfinite = ops.cast(nonfinite, "int32")
            if bad is not None:  # agreed with the flags, in the same all-reduce
                nonfinite = ops.concatenate([nonfinite,
                                             ops.reshape(ops.cast(bad, "int32"), [1])])
            # Agree before deciding: a NaN on one replica skips the step everywhere.
            nonfinite = ctx.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
            if bad is not None:
                nonfinite, bad = nonfinite[:-1], ops.greater(nonfinite[-1], 0)
            finite = ops.equal(ops.sum(nonfinite), 0)
        else:
            finite = ops.logical_not(ops.any(nonfinite))
            if self.layer_scales or self.max_consecutive_skips is not None:
                nonfinite = ops.cast(nonfinite, "int32")  # what they read (> 0)
        if guard is not None:
            # A skip while a dynamic scale is above its floor is the scaler's
            # routine (it backs off and goes on); the guard counts the others.
            floor = getattr(self.schedule, "min_scale", None) if self.schedule.is_dynamic \
                else None
            guard.decided(finite, bad, None if floor is None else
                          ops.greater(ops.cast(scale, "float32"), float(floor) * (1 + 1e-6)))
        # Applied micro-batches (``iterations`` is a tensor under accumulation).
        step = ops.convert_to_tensor(self.inner_optimizer._iterations.value)

        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            ops.cond(finite, lambda: self._apply_inner(unscaled, trainable_variables),
                     lambda: None)
            self._update_state(finite, nonfinite, step, tvars, bad)
        else:
            ctx.merge_call(self._merged_apply,
                           args=(unscaled, trainable_variables, finite, nonfinite, step, tvars,
                                 bad))

    def _build_outside_function(self, variables):
        with tf.init_scope():
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True

    def _apply_inner(self, grads, trainable_variables):
        self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)

    def _merged_apply(self, distribution, grads, trainable_variables, finite, nonfinite,
                      step, tvars, bad=None):
        # All replicas hold the same (all-reduced) flags; take the first.
        first = lambda x: distribution.experimental_local_results(x)[0]  # noqa: E731
        finite, nonfinite, step = first(finite), first(nonfinite), first(step)
        bad = None if bad is None else first(bad)

        def apply_fn():
            distribution.extended.call_for_each_replica(
                self._apply_inner, args=(grads, trainable_variables))

        # The cond must run in cross-replica context: the inner optimizer's
        # apply calls merge_call, which a replica-context cond cannot contain.
        ops.cond(finite, apply_fn, lambda: None)
        self._update_state(finite, nonfinite, step, tvars, bad)

    def _update_state(self, finite, nonfinite, step, tvars, bad=None):
        """The schedule's and the counters' next state. A step on bad data
        (``bad``: the batch itself was not finite) leaves the scale as it was:
        no back-off, no growth count."""
        state = {k: v.value for k, v in self._state_variables.items()}
        scale_finite = finite
        if self.layer_scales:
            factors, index = self._variable_factors(tvars)
            groups = [(self._scale_groups or [-1] * len(self._trainable_variables))[i]
                      for i in index]
            new_factors, scale_finite = layer_scales_lib.backoff(factors, nonfinite, groups)
            if bad is not None:
                new_factors = ops.where(bad, factors, new_factors)
            self.variable_scales.assign(tf.tensor_scatter_nd_update(
                self.variable_scales.value, [[i] for i in index], new_factors))
        new_state = self.schedule.update(state, scale_finite, step)
        if set(new_state) != set(state):
            raise ValueError(
                f"{type(self.schedule).__name__}.update returned state keys "
                f"{sorted(new_state)}, expected {sorted(state)}.")
        for key, value in new_state.items():
            if value is state[key]:
                continue  # unchanged (a fixed scale): nothing to write
            var = self._state_variables[key]
            value = ops.cast(value, var.dtype)
            var.assign(value if bad is None else ops.where(bad, state[key], value))
        skipped = ops.cast(ops.logical_not(finite), "int64")
        self.skipped_steps.assign_add(skipped)
        consecutive = ops.where(finite, 0, self.consecutive_skips.value + 1)
        self.consecutive_skips.assign(consecutive)
        if self.max_consecutive_skips is not None:
            self._check_skips(consecutive, nonfinite, tvars)

    def _check_skips(self, consecutive, nonfinite, tvars):
        if _in_xla_context():
            raise ValueError(
                "`max_consecutive_skips` needs a train step that is not XLA-compiled "
                "(XLA drops assertions): compile the model with jit_compile=False, "
                "or set max_consecutive_skips=None.")
        skips.check(consecutive, nonfinite, [getattr(v, "path", v.name) for v in tvars],
                    self.max_consecutive_skips, self.loss_scale)

    # -- serialization ----------------------------------------------------

    def get_config(self):
        config = super().get_config()
        if self._schedule_given:
            config["initial_scale"] = DEFAULT_INITIAL_SCALE
            config["dynamic_growth_steps"] = self.dynamic_growth_steps
            config["schedule"] = serialize_keras_object(self.schedule)
        # Written only when set: with Keras's arguments alone the config is
        # exactly Keras's (its own tests check the keys).
        if self.max_consecutive_skips is not None:
            config["max_consecutive_skips"] = self.max_consecutive_skips
        if self.layer_scales:
            config["layer_scales"] = True
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = deserialize_keras_object(config.pop("inner_optimizer"),
                                         custom_objects=custom_objects)
        schedule = config.pop("schedule", None)
        if isinstance(schedule, dict):
            schedule = deserialize_keras_object(schedule, custom_objects=custom_objects)
        if schedule is not None:
            # Derived from the schedule, which sets both.
            config.pop("initial_scale", None)
            config.pop("dynamic_growth_steps", None)
        return cls(inner, schedule=schedule, **config)
