"""The loss scale's side of :class:`keras_mp.callbacks.AdaptivePrecision`: the
loss scale and the dtype rule read the same statistics and decide together.

* What :func:`keras_mp.adaptive.decisions.controller.decide` needs to answer float16
  underflow with a larger scale instead of a promotion: the current scale
  and its bound (where the optimizer's schedule can change), and with
  per-layer loss scales each layer's factor and group.
* Applying the answer: :meth:`keras_mp.LossScaleOptimizer.set_loss_scale`,
  :meth:`~keras_mp.LossScaleOptimizer.set_layer_scales`; each change is an
  event (``step``, ``layer``: None for the global scale or the path of the
  layer whose own factor changed, ``old``, ``new``). A promotion that removes
  the cause of non-finite steps (:data:`CAUSES`) also tells the schedule so
  (:meth:`~keras_mp.LossScaleOptimizer.recover_loss_scale`): the scale grows
  back to where it was before the streak.
* Per-layer loss scales (``AdaptivePolicy(layer_loss_scales=True)``): the
  boundaries of :mod:`keras_mp.scaling.layer_scales` go around every
  controlled layer that is not inside another (a composite layer's
  sublayers share its factor); each such layer with variables is one group
  of the optimizer's ``variable_scales``; a layer without variables takes the
  factor of the nearest layer with variables before it in forward order (its
  gradient is about that layer's entering one), or 1.

Example:
    >>> import keras, keras_mp
    >>> from keras_mp.adaptive.integration.loss_scales import top_level
    >>> keras_mp.set_global_policy(keras_mp.AdaptivePolicy(("float16", "float32")))
    >>> inp = keras.Input((4, 8))
    >>> mha = keras.layers.MultiHeadAttention(2, 4)
    >>> model = keras.Model(inp, keras.layers.Dense(1)(mha(inp, inp)))
    >>> layers = keras_mp.policies.adaptive_layers(model, keras_mp.policies.policy_of(model))
    >>> [type(layers[i]).__name__ for i in top_level(layers)]
    ['MultiHeadAttention', 'Dense']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_mp.adaptive.decisions import controller
from keras_mp.adaptive.evidence.stats import learned_variables
from keras_mp.scaling import loss_scale as loss_scale_lib
from keras_mp.scaling.optimizer import LossScaleOptimizer

__all__ = ["CAUSES", "LossScales", "top_level"]

#: Promotion reasons that name the cause of non-finite steps (or of values
#: about to overflow): after one, the loss scale comes back.
CAUSES = frozenset({"input_range", "output_nonfinite", "output_near_max", "nonfinite",
                    "nonfinite_everywhere"})


def top_level(layers: Sequence[keras.layers.Layer]) -> list[int]:
    """The indices of the layers that are not inside another of ``layers``
    (by path)."""
    if any(not isinstance(layer, keras.layers.Layer) for layer in layers):
        raise TypeError(f"`layers` must hold Keras layers, got {list(layers)!r}.")
    paths = [layer.path for layer in layers]
    return [i for i, p in enumerate(paths)
            if not any(q != p and p.startswith(q + "/") for q in paths)]


def _rescalable(schedule: loss_scale_lib.LossScaleSchedule) -> bool:
    """Whether the schedule can take a new scale (its own ``rescaled``, or a
    ``loss_scale`` state entry for the default one)."""
    return type(schedule).rescaled is not loss_scale_lib.LossScaleSchedule.rescaled \
        or "loss_scale" in schedule.state_spec()


def _trained(layer: keras.layers.Layer) -> list:
    """The variables a layer's gradients update, its sublayers' included."""
    return [v for v in layer.trainable_variables
            if v.trainable and not getattr(v, "overwrite_with_gradient", False)]


class LossScales:
    """The loss scales of one model under :class:`keras_mp.callbacks.AdaptivePrecision`.

    Args:
        optimizer: the model's optimizer (a :class:`keras_mp.LossScaleOptimizer`
            for anything to happen; built).
        layers: the controlled layers, indexed as the statistics.
        hooks: the model's :class:`keras_mp.adaptive.evidence.hooks.Hooks`, or None.
        per_layer: install per-layer loss scales (the optimizer must have
            ``layer_scales=True``).
    """

    def __init__(self, optimizer, layers: Sequence[keras.layers.Layer], hooks=None, *,
                 per_layer: bool = False):
        if not isinstance(per_layer, bool):
            raise ValueError(f"`per_layer` must be True or False, got {per_layer!r}.")
        own = isinstance(optimizer, LossScaleOptimizer)
        if per_layer and not (own and optimizer.layer_scales):
            raise ValueError(
                "Per-layer loss scales need the model's optimizer to be a "
                "keras_mp.LossScaleOptimizer(..., layer_scales=True), got "
                f"{type(optimizer).__name__}"
                + (" without layer_scales" if own else "") + ".")
        self.optimizer = optimizer if own else None
        self.layers = list(layers)
        self.paths = [layer.path for layer in self.layers]
        self.hooks = hooks
        self.per_layer = per_layer
        self.groups: list[int] = [-1] * len(self.layers)  # per controlled layer
        self._group_heads: list[int] = []  # the top-level layer of each group
        if hooks is not None:  # no boundaries from an earlier optimizer
            hooks.layer_scale_of, hooks.boundaries = None, set()
        if per_layer:
            self._bind()

    # -- per-layer set-up ----------------------------------------------------

    def _bind(self) -> None:
        top = top_level(self.layers)
        variables = []
        for i in top:
            trained = _trained(self.layers[i])
            if trained:
                self._group_heads.append(i)
                variables.append(trained)
        for g, head in enumerate(self._group_heads):
            prefix = self.paths[head] + "/"
            for j, p in enumerate(self.paths):
                if j == head or p.startswith(prefix):
                    self.groups[j] = g
        self._top = top
        self.optimizer.bind_layer_scales(variables)
        if self.hooks is not None:
            self.hooks.boundaries = set(top)

    def install(self, forward_order: Sequence[int]) -> None:
        """Points the hooks' boundaries at the factors (before a trace):
        a layer without variables takes the factor of the nearest layer with
        variables before it in ``forward_order``."""
        if not self.per_layer or self.hooks is None:
            return
        source: dict[int, int] = {}
        last = -1
        for i in forward_order:
            if i in self._top:
                if self.groups[i] >= 0:
                    last = self.groups[i]
                source[i] = self.groups[i] if self.groups[i] >= 0 else last
        opt = self.optimizer

        def factor(i: int) -> tf.Tensor:
            g = source.get(i, self.groups[i])
            return opt.layer_scale(g) if g >= 0 else tf.constant(1.0)
        self.hooks.layer_scale_of = factor

    def variable_factors(self):
        """For the probe: ``f(variables)`` -> their factors, or None."""
        if not self.per_layer:
            return None
        return lambda variables: self.optimizer._variable_factors(variables)[0]

    # -- the decision --------------------------------------------------------

    def _adjustable(self) -> bool:
        opt = self.optimizer
        return opt is not None and opt.built and opt.schedule.is_dynamic \
            and _rescalable(opt.schedule)

    def factors(self) -> list[float]:
        """Each controlled layer's own factor (1 without one)."""
        if not self.per_layer:
            return [1.0] * len(self.layers)
        by_group = self.optimizer.get_layer_scales()
        return [by_group[g] if g >= 0 else 1.0 for g in self.groups]

    def arguments(self, order: Sequence[int]) -> dict[str, Any]:
        """``decide``'s loss-scale arguments, for the layers in ``order``."""
        if self.optimizer is None or not self.optimizer.built:
            return {}
        out: dict[str, Any] = {}
        if self._adjustable() or self.per_layer:
            out["loss_scale"] = float(self.optimizer.loss_scale)
        if self._adjustable():
            out["max_loss_scale"] = float(getattr(self.optimizer.schedule, "max_scale",
                                                  2.0**24))
        if self.per_layer:
            factors = self.factors()
            out["layer_scales"] = [factors[i] for i in order]
            out["layer_groups"] = [self.groups[i] for i in order]
        return out

    def apply(self, decision: controller.Decision, order: Sequence[int], calls: int, *,
              verbose: int = 0) -> list[dict[str, Any]]:
        """Sets the scales ``decision`` asks for; returns the changes as events."""
        events = []
        opt = self.optimizer
        if opt is not None and any(sw.reason in CAUSES for sw in decision.switches):
            opt.recover_loss_scale()  # the cause of the streak is gone
        if decision.loss_scale is not None and self._adjustable():
            old = float(opt.loss_scale)
            opt.set_loss_scale(decision.loss_scale)
            events.append({"step": calls, "layer": None, "old": old,
                           "new": float(opt.loss_scale)})
        if decision.layer_scales is not None and self.per_layer:
            current = opt.get_layer_scales()
            wanted = list(current)
            for k, i in enumerate(order):
                g = self.groups[i]
                if g >= 0:
                    wanted[g] = max(1.0, float(decision.layer_scales[k]))
            if wanted != current:
                opt.set_layer_scales(wanted)
                events += [{"step": calls, "layer": self.paths[self._group_heads[g]],
                            "old": current[g], "new": wanted[g]}
                           for g in range(len(wanted)) if wanted[g] != current[g]]
        if verbose:
            for e in events:
                what = "loss scale" if e["layer"] is None else f"{e['layer']}: own loss scale"
                print(f"keras_mp: {what} {e['old']:g} -> {e['new']:g} (gradients underflowed "
                      f"with headroom) at call {calls}")
        return events

    def layer_loss_scales(self) -> list[float] | None:
        """With per-layer loss scales, the scale each layer's gradients carry."""
        if not self.per_layer:
            return None
        scale = float(self.optimizer.loss_scale)
        return [scale * f for f in self.factors()]

    def write_records(self, policy) -> None:
        """Each controlled layer with gradients records the loss scale its
        gradients carry (the global scale times its own factor)."""
        if self.optimizer is None or not self.optimizer.built:
            return
        scale = float(self.optimizer.loss_scale)
        for path, layer, f in zip(self.paths, self.layers, self.factors()):
            if learned_variables(layer) or (self.per_layer and f != 1.0):
                policy.record(path)["loss_scale"] = scale * f
