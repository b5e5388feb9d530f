"""What the adaptive decision rule reads and writes: its thresholds
(:class:`DecisionRule`), one layer's evidence over an interval
(:class:`LayerStats`), what it remembers per layer (:class:`LayerState`) and
its answer (:class:`Switch`, :class:`Decision`). The rule itself is
:func:`keras_mp.adaptive.decisions.controller.decide`, which re-exports these names.

Example:
    >>> from keras_mp.adaptive.decisions.rule import DecisionRule, LayerState
    >>> DecisionRule(patience=4).patience, LayerState("bfloat16").healthy
    (4, 0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keras_mp import _checks as checks

__all__ = ["DTYPE_ORDER", "PROXY_REASONS", "DecisionRule", "LayerStats", "LayerState", "Switch",
           "Decision", "sort_candidates"]

#: Candidate dtypes from narrowest (cheapest, least range) to widest.
DTYPE_ORDER: tuple[str, ...] = ("float8", "float16", "bfloat16", "float32")

#: Promotion reasons that come from proxy statistics (elements near or below
#: a dtype's smallest normal number): where a probe runs, it must confirm harm
#: before such a promotion is made (a promotion trial). ``LayerState.suspect``
#: holds the 1-based index of the reason under trial.
PROXY_REASONS: tuple[str, ...] = ("fp16_subnormal", "bf16_subnormal", "output_flushed",
                                  "float8_flushed")


def sort_candidates(candidates: Sequence[str]) -> tuple[str, ...]:
    """Validates candidate dtypes and orders them narrowest first.

    Example:
        >>> sort_candidates(["float32", "float16"])
        ('float16', 'float32')
    """
    if isinstance(candidates, str) or not isinstance(candidates, Sequence) or not candidates:
        raise ValueError("`candidates` must be a non-empty sequence of dtypes from "
                         f"{DTYPE_ORDER}, got {candidates!r}.")
    bad = [c for c in candidates if c not in DTYPE_ORDER]
    if bad:
        raise ValueError(f"`candidates` must only hold dtypes from {DTYPE_ORDER}, got "
                         f"{list(candidates)!r} ({bad!r} not allowed).")
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"`candidates` must not repeat a dtype, got {list(candidates)!r}.")
    if all(c == "float8" for c in candidates):
        raise ValueError("`candidates` must hold a float dtype besides 'float8' (layers that "
                         f"cannot train in float8 use it), got {list(candidates)!r}.")
    return tuple(sorted(candidates, key=DTYPE_ORDER.index))


@dataclasses.dataclass(frozen=True)
class DecisionRule:
    """The thresholds of :func:`keras_mp.adaptive.decisions.controller.decide`.

    Args:
        max_nonfinite: fraction of an interval's steps with non-finite
            gradients above which a layer (or, for whole-step failures, the
            model) is in trouble.
        max_fp16_subnormal: fraction of a float16 layer's gradient elements in
            float16's subnormal range above which it is promoted.
        max_bf16_subnormal: the same for bfloat16's subnormal range.
        max_near_max: fraction of a layer's observed steps with an output
            within a factor 16 of its dtype's largest value, above which it is
            promoted.
        max_flushed: fraction of a narrow layer's output elements flushed to
            subnormals above which it is promoted.
        max_float8_saturated: fraction of a float8 layer's operand elements
            clipped at the format's largest value above which it is promoted.
        max_float8_flushed: fraction of its non-zero operand elements
            rounded to zero above which it is promoted.
        max_float8_growth: growth of an operand's amax over its amax
            history above which a layer is not demoted into float8 (> 1).
        max_probe_loss_error: the probe's loss relative error (configured
            dtypes vs float32) above which rounding costs accuracy.
        max_probe_grad_error: a layer's gradient relative error in the probe
            above which it is where rounding hurts.
        max_probe_noise_ratio: an error counts only if it also exceeds this
            multiple of the batch's sampling noise (rounding that moves the
            loss or a gradient less than drawing another batch would does
            not change training; a relative error alone grows without bound
            as the loss approaches zero).
        hysteresis: demotion requires the statistics to be below this
            fraction of the promotion thresholds, in (0, 1].
        patience: healthy intervals before a demotion, >= 1.
        cooldown: intervals after any switch during which the layer is not
            demoted, >= 0.
        max_switches: switches after which a layer is never demoted, >= 1.
        max_strikes: promotions after which a layer is pinned, >= 1.
        scale_headroom: underflow is answered by a larger loss scale (the
            global one, or the layer's own) only as far as leaves the largest
            gradient this factor below float16's largest value (> 1).

    Example:
        >>> DecisionRule(patience=4).get_config()["patience"]
        4
    """

    max_nonfinite: float = 0.25
    max_fp16_subnormal: float = 0.25
    max_bf16_subnormal: float = 0.25
    max_near_max: float = 0.25
    max_flushed: float = 0.5
    max_float8_saturated: float = 0.01
    max_float8_flushed: float = 0.1
    max_float8_growth: float = 16.0
    max_probe_loss_error: float = 0.1
    max_probe_grad_error: float = 0.5
    max_probe_noise_ratio: float = 1.0
    hysteresis: float = 0.5
    patience: int = 8
    cooldown: int = 2
    max_switches: int = 4
    max_strikes: int = 2
    scale_headroom: float = 16.0

    def __post_init__(self):
        # Stored as the checks return them: Python numbers (a NumPy scalar
        # given is accepted, and the config stays plain JSON).
        for name in ("max_nonfinite", "max_fp16_subnormal", "max_bf16_subnormal", "max_near_max",
                     "max_flushed", "max_float8_saturated", "max_float8_flushed",
                     "hysteresis"):
            object.__setattr__(self, name, checks.fraction(name, getattr(self, name)))
        for name in ("max_float8_growth", "max_probe_loss_error", "max_probe_grad_error",
                     "max_probe_noise_ratio", "scale_headroom"):
            object.__setattr__(self, name, checks.positive(name, getattr(self, name)))
        if self.max_float8_growth <= 1:
            raise ValueError("`max_float8_growth` must be a number > 1, got "
                             f"{self.max_float8_growth!r}.")
        if self.hysteresis == 0:
            raise ValueError("`hysteresis` must be in (0, 1], got 0.")
        for name, low in (("patience", 1), ("cooldown", 0), ("max_switches", 1),
                          ("max_strikes", 1)):
            object.__setattr__(self, name, checks.count(name, getattr(self, name), low))
        if self.scale_headroom <= 1:
            raise ValueError("`scale_headroom` must be a number > 1, got "
                             f"{self.scale_headroom!r}.")

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DecisionRule:
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One layer's evidence over one interval.

    Attributes:
        steps: statistics steps in the interval (0, with ``forward_steps``
            0 too: no statistics, the layer is left alone).
        gradients: whether the layer has gradients (trainable variables);
            the gradient fields below are not measured if not.
        nonfinite: fraction of the steps in which any of its gradients held
            inf or nan.
        amax: largest finite unscaled gradient magnitude.
        fp16_underflow, fp16_subnormal, fp16_overflow, bf16_subnormal, zero:
            fractions of its gradient elements, averaged over the steps (see
            :mod:`keras_mp.scaling.kernels`); the float16 ones are of the loss-scaled
            gradients.
        forward_steps: steps in which the layer's call was observed.
        in_amax, out_amax, in_range, out_nonfinite, out_near_max, out_flushed:
            forward statistics (see :mod:`keras_mp.adaptive.evidence.forward`): amaxes over the
            interval, the others fractions of the observed steps (the flushed
            fraction: of output elements, averaged).
        f8_growth, f8_saturated, f8_flushed: float8 evidence (see
            :mod:`keras_mp.adaptive.evidence.float8`): the largest amax growth over the
            history, and fractions of operand elements clipped / rounded to
            zero, averaged over the observed steps; measured as if in
            float8 while a float8-capable layer runs wider.
        probe_steps: float32 probes in the interval that measured this layer.
        grad_error: mean relative error of its gradient in the probe.
        cosine: mean cosine between its gradient and the float32 one.
        grad_noise_ratio: mean ratio of that error to the gradient's sampling
            noise (how far half the batch moves it); inf: not measured, the
            relative error decides alone.
        backward_amax: with per-layer loss scales, the largest unscaled
            magnitude of the gradients entering and leaving the layer at its
            boundaries (its activation gradients), over the interval; 0: not
            measured.
    """

    steps: int = 0
    gradients: bool = True
    nonfinite: float = 0.0
    amax: float = 0.0
    fp16_underflow: float = 0.0
    fp16_subnormal: float = 0.0
    fp16_overflow: float = 0.0
    bf16_subnormal: float = 0.0
    zero: float = 0.0
    forward_steps: int = 0
    in_amax: float = 0.0
    out_amax: float = 0.0
    in_range: float = 0.0
    out_nonfinite: float = 0.0
    out_near_max: float = 0.0
    out_flushed: float = 0.0
    f8_growth: float = 0.0
    f8_saturated: float = 0.0
    f8_flushed: float = 0.0
    probe_steps: int = 0
    grad_error: float = 0.0
    cosine: float = 1.0
    grad_noise_ratio: float = float("inf")
    backward_amax: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerState:
    """What the rule remembers about one layer.

    Attributes:
        dtype: the layer's current compute dtype, one of the candidates.
        healthy: consecutive healthy intervals.
        cooldown: intervals left before it may be demoted.
        switches: switches so far.
        strikes: promotions and failed trials so far.
        trial: 1 while the layer is on trial for a demotion (the next probe
            runs it in the next narrower candidate), else 0.
        suspect: while a proxy statistic asks for a promotion that the next
            probe must confirm (a promotion trial), the 1-based index of that
            reason in :data:`PROXY_REASONS`; else 0.
    """

    dtype: str
    healthy: int = 0
    cooldown: int = 0
    switches: int = 0
    strikes: int = 0
    trial: int = 0
    suspect: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPE_ORDER:
            raise ValueError(f"`dtype` must be one of {DTYPE_ORDER}, got {self.dtype!r}.")
        for name in ("healthy", "cooldown", "switches", "strikes", "trial", "suspect"):
            object.__setattr__(self, name, checks.count(name, getattr(self, name), 0))
        if self.suspect > len(PROXY_REASONS):
            raise ValueError(f"`suspect` must be in [0, {len(PROXY_REASONS)}], got "
                             f"{self.suspect!r}.")

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Switch:
    """One change of a layer's dtype: ``layer`` indexes the input lists."""

    layer: int
    old: str
    new: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Decision:
    """The answer of :func:`decide`: every layer's next state, the switches,
    and the loss scales to set (None: leave them).

    Attributes:
        states: every layer's next :class:`LayerState`.
        switches: the dtype changes, as :class:`Switch` es.
        loss_scale: the new global loss scale (gradients underflowed and
            every float16 layer has headroom), or None.
        layer_scales: every layer's own loss-scale factor after the decision
            (per-layer loss scales), or None.
    """

    states: tuple[LayerState, ...]
    switches: tuple[Switch, ...]
    loss_scale: float | None = None
    layer_scales: tuple[float, ...] | None = None
