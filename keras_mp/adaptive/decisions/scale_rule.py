"""The loss-scale side of :func:`keras_mp.adaptive.decisions.controller.decide`: float16
underflow is answered by a larger loss scale wherever the gradients have
headroom, before any promotion is considered (a pure computation).

A layer's headroom is ``65504 / (scale_headroom * amax * scale)``, with
``amax`` its largest unscaled gradient magnitude over the interval (with
per-layer loss scales also of the activation gradients at its boundaries,
``backward_amax``) and ``scale`` the total scale its gradients carry (the
global one, times the layer's own factor with per-layer loss scales). Layers
inside one boundary (a composite layer's sublayers) share its factor: they
form a group, which grows as far as every member's headroom allows. With one global scale, the
scale grows by the largest power of 2 that *every* float16 layer's headroom
allows (a larger one would overflow the layer with the largest gradients);
with per-layer scales, a layer's own factor grows by what its own headroom
allows, and a factor whose headroom is gone is given back. Only where no
scale can grow is the underflow a question for the dtype (and, where a probe
runs, for the probe).

Example:
    >>> from keras_mp.adaptive.decisions.rule import DecisionRule, LayerState, LayerStats
    >>> from keras_mp.adaptive.decisions.scale_rule import Scales
    >>> stats = [LayerStats(steps=5, amax=0.01), LayerStats(steps=5, amax=100.0)]
    >>> states = [LayerState("float16")] * 2
    >>> one = Scales(stats, states, DecisionRule(), loss_scale=1.0)
    >>> one.lift(0), one.result()   # the second layer leaves room for 2**5 only
    (True, (32.0, None))
    >>> own = Scales(stats, states, DecisionRule(), loss_scale=1.0, layer_scales=[1.0, 1.0])
    >>> own.lift(0), own.result()   # the first layer's own factor: 2**18
    (True, (None, (262144.0, 1.0)))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from keras_mp.adaptive.decisions.rule import DecisionRule, LayerState, LayerStats

__all__ = ["MAX_LAYER_SCALE", "Scales"]

#: The largest per-layer loss-scale factor set.
MAX_LAYER_SCALE = 2.0**48
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 2.0**-14


def _positive(name, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
        raise ValueError(f"`{name}` must be a finite number > 0, got {v!r}.")


class Scales:
    """The loss scales of one decision.

    Args:
        stats: one :class:`keras_mp.adaptive.decisions.rule.LayerStats` per layer.
        states: one :class:`keras_mp.adaptive.decisions.rule.LayerState` per layer (a
            list the caller may update: the float16 layers are read from it
            when first needed).
        rule: the thresholds (``scale_headroom``).
        loss_scale: the current global scale, or None when it cannot change
            (then nothing is lifted).
        max_loss_scale: the largest global scale allowed.
        layer_scales: each layer's own factor (per-layer loss scales), or None.
        layer_groups: with ``layer_scales``, each layer's group (layers of one
            group share a factor; -1: a layer without a factor of its own);
            None: each layer is its own group.
    """

    def __init__(self, stats: Sequence[LayerStats], states: Sequence[LayerState],
                 rule: DecisionRule, *, loss_scale: float | None = None,
                 max_loss_scale: float = 2.0**24,
                 layer_scales: Sequence[float] | None = None,
                 layer_groups: Sequence[int] | None = None):
        if len(stats) != len(states):
            raise ValueError(f"`stats` and `states` must have the same length, got "
                             f"{len(stats)} and {len(states)}.")
        if not isinstance(rule, DecisionRule):
            raise TypeError(f"`rule` must be a DecisionRule, got {rule!r}.")
        if loss_scale is not None:
            _positive("loss_scale", loss_scale)
        _positive("max_loss_scale", max_loss_scale)
        if layer_scales is not None:
            if loss_scale is None:
                raise ValueError("`layer_scales` needs `loss_scale` (the global scale they "
                                 "multiply).")
            if isinstance(layer_scales, str) or not isinstance(layer_scales, Sequence) \
                    or len(layer_scales) != len(stats):
                raise ValueError(f"`layer_scales` must hold one factor per layer "
                                 f"({len(stats)}), got {layer_scales!r}.")
            for f in layer_scales:
                _positive("layer_scales", f)
        if layer_groups is None:
            layer_groups = list(range(len(stats)))
        if isinstance(layer_groups, str) or not isinstance(layer_groups, Sequence) \
                or len(layer_groups) != len(stats) or any(
                    isinstance(g, bool) or not isinstance(g, int) or g < -1
                    for g in layer_groups):
            raise ValueError(f"`layer_groups` must hold one int >= -1 per layer ({len(stats)}), "
                             f"got {layer_groups!r}.")
        if layer_scales is not None and any(
                layer_scales[i] != layer_scales[j] for i, gi in enumerate(layer_groups)
                for j, gj in enumerate(layer_groups) if gi == gj >= 0):
            raise ValueError("`layer_scales` must be equal within each group of `layer_groups`, "
                             f"got {list(layer_scales)!r} for groups {list(layer_groups)!r}.")
        self.groups = list(layer_groups)
        self._lifted: set[int] = set()
        #: the layers whose scale grew in this decision (the probe measured
        #: them at the old one)
        self.lifted: set[int] = set()
        self.stats, self.states, self.rule = stats, states, rule
        self.scale, self.max_scale = loss_scale, float(max_loss_scale)
        self.per_layer = layer_scales is not None
        self.factors = [float(f) for f in layer_scales] if self.per_layer \
            else [1.0] * len(stats)
        self._global: int | None = None
        self.grow = 0

    def _exponent(self, i: int) -> float:
        amax = self.stats[i].amax
        if self.per_layer:
            amax = max(amax, self.stats[i].backward_amax)
        if not amax > 0:
            return math.inf
        room = _FP16_MAX / (self.rule.scale_headroom * amax * self.scale * self.factors[i])
        return math.floor(math.log2(room))

    def _float16(self) -> list[int]:
        return [i for i, (s, st) in enumerate(zip(self.stats, self.states))
                if st.dtype == "float16" and s.gradients and s.steps > 0]

    def below_normal(self, i: int) -> bool:
        """Whether even layer ``i``'s largest gradient is below float16's
        smallest normal number at the scale it carries (then its elements
        are subnormals or flushed to zero, which the fractions count as
        zeros). With per-layer scales the gradient entering the layer counts
        too: measured in float32 at its boundary, it shows a layer whose
        float16 gradients are all zero."""
        amax = self.stats[i].amax
        if self.per_layer:  # the gradient entering it, measured in float32
            amax = max(amax, self.stats[i].backward_amax)
        return self.scale is not None and amax > 0 and \
            amax * self.scale * self.factors[i] < _FP16_MIN_NORMAL

    def _members(self, group: int) -> list[int]:
        return [j for j, g in enumerate(self.groups) if g == group]

    def _group_exponent(self, group: int) -> float:
        float16 = set(self._float16())
        return min([self._exponent(j) for j in self._members(group) if j in float16],
                   default=math.inf)

    def lift(self, i: int) -> bool:
        """Grows a scale so that layer ``i``'s gradients leave the subnormal
        range, if the headroom allows; returns whether it did."""
        if self.scale is None:
            return False
        if self.per_layer:
            group = self.groups[i]
            if group < 0:
                return False
            if group in self._lifted:
                self.lifted.add(i)
                return True
            k = min(self._group_exponent(group),
                    math.floor(math.log2(MAX_LAYER_SCALE / self.factors[i])))
            if k < 1:
                return False
            for j in self._members(group):
                self.factors[j] *= 2.0**k
            self._lifted.add(group)
            self.lifted.add(i)
            return True
        if self._global is None:
            cap = math.floor(math.log2(self.max_scale / self.scale))
            self._global = int(min([cap] + [self._exponent(j) for j in self._float16()]))
        if self._global >= 1:
            self.grow = self._global
            self.lifted.add(i)
            return True
        return False

    def result(self) -> tuple[float | None, tuple[float, ...] | None]:
        """``(loss_scale, layer_scales)``: the new global scale (None: leave
        it) and every layer's factor (None without per-layer scales)."""
        if self.per_layer:
            for group in sorted({g for g in self.groups if g >= 0}):
                k = self._group_exponent(group)  # give back a factor whose headroom is gone
                for j in self._members(group):
                    if k < 0 and self.factors[j] > 1:
                        self.factors[j] = max(1.0, self.factors[j] * 2.0**k)
        return (self.scale * 2.0**self.grow if self.grow else None,
                tuple(self.factors) if self.per_layer else None)
