"""The decision rule of the adaptive precision policy: a pure function.

:func:`decide` maps one interval's per-layer gradient statistics and each
layer's state to the layers' next state and the switches to make. It holds no
TensorFlow state and does no I/O, so it is tested on synthetic statistics and
the callback only feeds it and applies its answer.

The rule, per interval (layers are given in forward order, input first):

1. **Whole-step failures.** If, in more than ``max_nonfinite`` of the
   interval's steps, *every* layer's gradients were non-finite, the loss itself
   was non-finite: some activation left a narrow dtype's range in the forward
   pass. Gradients cannot say which layer did it (the non-finite loss reaches
   them all), so the input-most narrow layer is promoted, one per interval:
   range problems most often enter with the data (unnormalized features,
   embeddings, the first normalization). The next interval tells whether that
   was enough; if not, the next layer follows.
2. **Partial non-finite gradients.** If some layers' gradients were
   non-finite in more than ``max_nonfinite`` of the steps while others were
   finite, the overflow happened in the backward pass, which runs from the
   output to the input: the output-most non-finite layer is where it started,
   and it is promoted. (An isolated overflow at a too-large loss scale is the
   loss scaler's business: it backs off after one step, far below the
   threshold.)
3. **Range and precision.** A float16 layer whose scaled gradients are
   float16 subnormals in more than ``max_fp16_subnormal`` of their elements
   is losing them to underflow (the loss scale cannot rise further without
   overflowing another layer); a bfloat16 layer with more than
   ``max_bf16_subnormal`` below bfloat16's normal range likewise. Each such
   layer is promoted.
4. **Demotion.** Any other layer had a healthy interval. After ``patience``
   consecutive healthy intervals (doubled for each earlier promotion of the
   layer) and no cool-down left, it moves to the next narrower candidate if
   its statistics say the gradients fit there with margin (``hysteresis``
   times the promotion thresholds, no overflow, nothing non-finite).

Never oscillating: a switch starts a ``cooldown`` of intervals without
demotion; a layer promoted ``max_strikes`` times is pinned; a layer that has
switched ``max_switches`` times is never demoted again. Promotion on trouble is
never blocked (a diverging run is worse than a slow one); it moves towards
float32, so it too is bounded.

Example:
    >>> from keras_mp.controller import LayerState, LayerStats, decide
    >>> d = decide([LayerStats(steps=10, nonfinite=1.0), LayerStats(steps=10, nonfinite=1.0)],
    ...            [LayerState("float16"), LayerState("float16")],
    ...            candidates=("float16", "float32"), all_nonfinite=1.0)
    >>> [s.dtype for s in d.states], d.switches[0].reason
    (['float32', 'float16'], 'nonfinite_everywhere')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["DTYPE_ORDER", "DecisionRule", "LayerStats", "LayerState", "Switch", "Decision",
           "decide", "sort_candidates"]

#: Candidate dtypes from narrowest (cheapest, least range) to widest.
DTYPE_ORDER: tuple[str, ...] = ("float16", "bfloat16", "float32")


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
    return tuple(sorted(candidates, key=DTYPE_ORDER.index))


def _fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}.")
    return float(value)


def _count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class DecisionRule:
    """The thresholds of :func:`decide`.

    Args:
        max_nonfinite: fraction of an interval's steps with non-finite
            gradients above which a layer (or, for whole-step failures, the
            model) is in trouble.
        max_fp16_subnormal: fraction of a float16 layer's gradient elements in
            float16's subnormal range above which it is promoted.
        max_bf16_subnormal: the same for bfloat16's subnormal range.
        hysteresis: demotion requires the statistics to be below this
            fraction of the promotion thresholds, in (0, 1].
        patience: healthy intervals before a demotion, >= 1.
        cooldown: intervals after any switch during which the layer is not
            demoted, >= 0.
        max_switches: switches after which a layer is never demoted, >= 1.
        max_strikes: promotions after which a layer is pinned, >= 1.

    Example:
        >>> DecisionRule(patience=4).get_config()["patience"]
        4
    """

    max_nonfinite: float = 0.25
    max_fp16_subnormal: float = 0.25
    max_bf16_subnormal: float = 0.25
    hysteresis: float = 0.5
    patience: int = 8
    cooldown: int = 2
    max_switches: int = 4
    max_strikes: int = 2

    def __post_init__(self):
        for name in ("max_nonfinite", "max_fp16_subnormal", "max_bf16_subnormal", "hysteresis"):
            _fraction(name, getattr(self, name))
        if self.hysteresis == 0:
            raise ValueError("`hysteresis` must be in (0, 1], got 0.")
        _count("patience", self.patience, 1)
        _count("cooldown", self.cooldown, 0)
        _count("max_switches", self.max_switches, 1)
        _count("max_strikes", self.max_strikes, 1)

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> DecisionRule:
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """One layer's gradient statistics over one interval.

    Attributes:
        steps: steps in the interval (0: no statistics, the layer is left alone).
        nonfinite: fraction of the steps in which any of its gradients held
            inf or nan.
        amax: largest finite unscaled gradient magnitude.
        fp16_underflow, fp16_subnormal, fp16_overflow, bf16_subnormal, zero:
            fractions of its gradient elements, averaged over the steps (see
            :mod:`keras_mp.kernels`); the float16 ones are of the loss-scaled
            gradients.
    """

    steps: int = 0
    nonfinite: float = 0.0
    amax: float = 0.0
    fp16_underflow: float = 0.0
    fp16_subnormal: float = 0.0
    fp16_overflow: float = 0.0
    bf16_subnormal: float = 0.0
    zero: float = 0.0


@dataclasses.dataclass(frozen=True)
class LayerState:
    """What the rule remembers about one layer.

    Attributes:
        dtype: the layer's current compute dtype, one of the candidates.
        healthy: consecutive healthy intervals.
        cooldown: intervals left before it may be demoted.
        switches: switches so far.
        strikes: promotions so far.
    """

    dtype: str
    healthy: int = 0
    cooldown: int = 0
    switches: int = 0
    strikes: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPE_ORDER:
            raise ValueError(f"`dtype` must be one of {DTYPE_ORDER}, got {self.dtype!r}.")
        for name in ("healthy", "cooldown", "switches", "strikes"):
            _count(name, getattr(self, name), 0)

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
    """The answer of :func:`decide`: every layer's next state, and the switches."""

    states: tuple[LayerState, ...]
    switches: tuple[Switch, ...]


def _promote(state: LayerState, dtype: str, rule: DecisionRule) -> LayerState:
    return LayerState(dtype, healthy=0, cooldown=rule.cooldown,
                      switches=state.switches + 1, strikes=state.strikes + 1)


def _fits(dtype: str, s: LayerStats, rule: DecisionRule) -> bool:
    """Whether gradients with statistics ``s`` would be healthy in ``dtype``,
    with the hysteresis margin."""
    if s.nonfinite > 0:
        return False
    if dtype == "float16":
        return s.fp16_overflow == 0 and \
            s.fp16_underflow + s.fp16_subnormal <= rule.hysteresis * rule.max_fp16_subnormal
    if dtype == "bfloat16":
        return s.bf16_subnormal <= rule.hysteresis * rule.max_bf16_subnormal
    return True


def decide(stats: Sequence[LayerStats], states: Sequence[LayerState],
           candidates: Sequence[str], rule: DecisionRule | None = None, *,
           all_nonfinite: float = 0.0) -> Decision:
    """Applies the rule (see the module docstring) to one interval.

    Args:
        stats: one :class:`LayerStats` per layer, in forward order.
        states: one :class:`LayerState` per layer, same order.
        candidates: the allowed dtypes (any order; see :func:`sort_candidates`).
        rule: the thresholds; ``DecisionRule()`` when None.
        all_nonfinite: fraction of the interval's steps in which every
            layer's gradients were non-finite.

    Returns:
        A :class:`Decision`.

    Example, a float32 layer demoted after its patience:
        >>> from keras_mp.controller import DecisionRule, LayerState, LayerStats, decide
        >>> rule = DecisionRule(patience=2, cooldown=0)
        >>> st = [LayerState("float32", strikes=0)]
        >>> for _ in range(2):
        ...     d = decide([LayerStats(steps=5)], st, ("bfloat16", "float32"), rule)
        ...     st = d.states
        >>> st[0].dtype, d.switches[0].reason
        ('bfloat16', 'healthy')
    """
    rule = rule or DecisionRule()
    order = sort_candidates(candidates)
    if len(stats) != len(states):
        raise ValueError(f"`stats` and `states` must have the same length, got "
                         f"{len(stats)} and {len(states)}.")
    for s in states:
        if s.dtype not in order:
            raise ValueError(f"A layer state's dtype must be one of the candidates {order}, "
                             f"got {s.dtype!r}.")
    _fraction("all_nonfinite", all_nonfinite)

    def wider(dtype: str) -> str | None:
        i = order.index(dtype)
        return order[i + 1] if i + 1 < len(order) else None

    def narrower(dtype: str) -> str | None:
        i = order.index(dtype)
        return order[i - 1] if i > 0 else None

    new = list(states)
    switches: list[Switch] = []
    troubled: set[int] = set()
    measured = [i for i, s in enumerate(stats) if s.steps > 0]

    def promote(i: int, reason: str) -> None:
        target = wider(new[i].dtype)
        if target is not None:
            switches.append(Switch(i, new[i].dtype, target, reason))
            new[i] = _promote(new[i], target, rule)

    if measured and all_nonfinite > rule.max_nonfinite:
        troubled.update(measured)
        first = next((i for i in measured if wider(new[i].dtype) is not None), None)
        if first is not None:
            promote(first, "nonfinite_everywhere")
    else:
        bad = [i for i in measured if stats[i].nonfinite > rule.max_nonfinite]
        troubled.update(bad)
        last = next((i for i in reversed(bad) if wider(new[i].dtype) is not None), None)
        if last is not None:
            promote(last, "nonfinite")
        for i in measured:
            if i in troubled:
                continue
            s, dtype = stats[i], new[i].dtype
            if dtype == "float16" and s.fp16_subnormal > rule.max_fp16_subnormal:
                troubled.add(i)
                promote(i, "fp16_subnormal")
            elif dtype == "bfloat16" and s.bf16_subnormal > rule.max_bf16_subnormal:
                troubled.add(i)
                promote(i, "bf16_subnormal")

    switched = {sw.layer for sw in switches}
    for i in measured:
        if i in switched:
            continue
        st = new[i]
        cooldown = max(st.cooldown - 1, 0)
        if i in troubled:
            new[i] = dataclasses.replace(st, healthy=0, cooldown=cooldown)
            continue
        healthy = st.healthy + 1
        target = narrower(st.dtype)
        if (target is not None and cooldown == 0 and st.switches < rule.max_switches
                and st.strikes < rule.max_strikes
                and healthy >= rule.patience * 2**st.strikes
                and _fits(target, stats[i], rule)):
            switches.append(Switch(i, st.dtype, target, "healthy"))
            new[i] = LayerState(target, healthy=0, cooldown=rule.cooldown,
                                switches=st.switches + 1, strikes=st.strikes)
        else:
            new[i] = dataclasses.replace(st, healthy=healthy, cooldown=cooldown)
    return Decision(tuple(new), tuple(switches))
