"""The decision rule of the adaptive precision policy: a pure function.

:func:`decide` maps one interval's per-layer evidence (gradient statistics,
forward statistics, float32-probe errors) and each layer's state to the
layers' next state and the switches to make. It holds no TensorFlow state and
does no I/O, so it is tested on synthetic statistics and the callback only
feeds it and applies its answer.

The rule, per interval (layers are given in forward order, input first; at
most one promotion per interval comes from each of rules 1, 2 and 5, since
the next interval re-checks):

1. **Forward range** (reason ``input_range``, ``output_nonfinite`` or
   ``output_near_max``). The forward pass runs input to output, so once a value
   leaves a narrow dtype's range every later layer sees the damage. First, a
   layer that **made** a non-finite value from finite inputs (its output was
   non-finite in more than ``max_nonfinite`` of the observed steps beyond
   those whose input already was) is where the overflow happened: the first
   such layer in forward order is promoted (``output_nonfinite``), the
   innermost where one contains another (given ``parents``): T5's attention
   overflows in its own ops, not in its projections nor in the block around
   it, and its promotion takes its sublayers along. A layer whose input was
   already non-finite is downstream damage (a layer reused after the damage,
   such as a tied output embedding, included). Otherwise the *input-most*
   layer whose cast input was non-finite or beyond its dtype's largest value
   (the cast overflowed there: nothing before it made the value), or whose
   output was within a factor 16 of it, in more than ``max_nonfinite``
   (``max_near_max``) of the observed steps, is promoted. This covers layers
   without weights (``Rescaling``, ``Normalization``, ``Softmax``, ...), where
   the cast often is. A batch that was itself not finite is bad data and adds
   no evidence (:mod:`keras_mp.adaptive.integration.skipping`).
2. **Non-finite gradients.** If, in more than ``max_nonfinite`` of the
   steps, *every* layer's gradients were non-finite and no forward statistic
   says where (``nonfinite_everywhere``), the input-most narrow layer is
   promoted: a heuristic, used only without forward evidence. Otherwise
   (some layers non-finite, or the forward pass clean) the overflow happened
   in the backward pass, which runs output to input: the output-most
   non-finite layer is promoted (``nonfinite``). An isolated overflow at a
   too-large loss scale is the loss scaler's business (non-finite steps count
   only at the scale's floor).
3. **Local trouble**, in the order of the evidence's strength. A float8
   layer whose operands (inputs, kernel, output gradient) were clipped at the
   E4M3/E5M2 limits in more than ``max_float8_saturated`` of their elements
   (``float8_saturated``: out of range, a hard failure) is promoted at once;
   an amax that grew more than ``max_float8_growth`` times over its history
   (the scale lags) keeps a layer from being demoted into float8 but does
   not by itself promote. **Underflow with headroom**: a float16 layer whose
   scaled gradients are float16 subnormals (or below) in more than
   ``max_fp16_subnormal`` of their elements, or whose largest scaled gradient
   is below float16's smallest normal (the rest then reads as zeros) is
   first answered by a larger
   loss scale, where the caller passes ``loss_scale``: the global scale
   grows by the largest power of 2 that every float16 layer's headroom
   allows (:mod:`keras_mp.adaptive.decisions.scale_rule`), or with ``layer_scales``
   the layer's own factor grows; no promotion. **Proxies**: such underflow
   with no headroom left (``fp16_subnormal``), a bfloat16 layer with more
   than ``max_bf16_subnormal`` of its gradients below bfloat16's normal
   range (``bf16_subnormal``), a narrow layer with more than ``max_flushed``
   of its outputs flushed to subnormals (``output_flushed``), a float8 layer
   with more than ``max_float8_flushed`` of its non-zero operand elements
   rounded to zero (``float8_flushed``) say that precision *may* be lost,
   not that it is. Where probes run (``confirm_proxies``), the layer becomes
   a **suspect** (a promotion trial, the mirror of the demotion trial): the
   next probe measures it as it is, and it is promoted for that reason only
   if its gradient error (or the loss error) exceeds ``hysteresis`` times the
   probe thresholds and the sampling noise, i.e. if it is not at float32's
   quality; otherwise the suspicion is dropped. Without probes a proxy
   promotes at once.
4. **Demotion.** Any other layer had a healthy interval. After ``patience``
   consecutive healthy intervals (doubled for each strike) and no cool-down
   left, a layer whose statistics fit the next narrower candidate with
   margin (``hysteresis`` times the thresholds: gradients, and forward
   amaxes below the narrower dtype's largest value / 16; into float8 also
   the float8 evidence measured while the layer ran wider) is demoted
   (``healthy``) or, with ``validate_demotions``, put **on trial**: the next
   probe runs with it narrowed (one trial at a time).
5. **Probe** (rounding, which range statistics cannot see). With probe
   results in the interval: layers on trial are demoted (``probe_validated``)
   if the loss error and every layer's gradient error stayed below
   ``hysteresis`` times ``max_probe_loss_error`` / ``max_probe_grad_error``,
   and otherwise stay, with a strike. Without a trial, if the loss error
   exceeds ``max_probe_loss_error`` or a layer's gradient error exceeds
   ``max_probe_grad_error`` (each counting only where it also exceeds
   ``max_probe_noise_ratio`` times the batch's sampling noise), the
   *output-most* narrow layer with gradients is promoted (``probe_error``):
   rounding that moves the loss enters the backward pass at the output and
   reaches every layer below it (their relative errors are no guide: the
   output layer's own gradient often shows the smallest). If only gradients
   are off, the output-most narrow layer among them is promoted. The next
   probe re-checks. While a float8 layer takes part in the probe (in float8
   or on trial into it), the loss error is not used: float8's own
   quantization noise moves the loss wherever it runs, so only gradient
   errors (and rules 1-3) decide.

Never oscillating: a switch starts a ``cooldown`` of intervals without
demotion; a layer with ``max_strikes`` strikes (promotions and failed trials)
is pinned; a layer that has switched ``max_switches`` times is never demoted
again. Promotion on trouble is never blocked (a diverging run is worse than a
slow one); it moves towards float32, so it too is bounded.

Example:
    >>> from keras_mp.adaptive.decisions.controller import LayerState, LayerStats, decide
    >>> d = decide([LayerStats(steps=10, nonfinite=1.0), LayerStats(steps=10, nonfinite=1.0)],
    ...            [LayerState("float16"), LayerState("float16")],
    ...            candidates=("float16", "float32"), all_nonfinite=1.0)
    >>> [s.dtype for s in d.states], d.switches[0].reason
    (['float32', 'float16'], 'nonfinite_everywhere')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from keras_mp import _checks as checks
from keras_mp.adaptive.decisions import scale_rule
# The rule's inputs and outputs live in keras_mp.adaptive.decisions.rule; re-exported here.
from keras_mp.adaptive.decisions.rule import (DTYPE_ORDER, PROXY_REASONS, Decision,  # noqa: F401
                                   DecisionRule, LayerState, LayerStats, Switch,
                                   sort_candidates)

__all__ = ["decide"]

#: The largest finite value of each candidate (see :mod:`keras_mp.adaptive.evidence.forward`).
_DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028235e38}
#: :data:`keras_mp.adaptive.evidence.forward.NEAR_MAX`.
_NEAR_MAX = 16.0


def _promote(state: LayerState, dtype: str, rule: DecisionRule) -> LayerState:
    return LayerState(dtype, healthy=0, cooldown=rule.cooldown,
                      switches=state.switches + 1, strikes=state.strikes + 1)


def _forward_trouble(s: LayerStats, rule: DecisionRule) -> str | None:
    """Why the forward statistics say the layer left its dtype's range, or None."""
    if s.forward_steps == 0:
        return None
    if s.in_range > rule.max_nonfinite:
        return "input_range"
    if s.out_nonfinite > rule.max_nonfinite:
        return "output_nonfinite"
    if s.out_near_max > rule.max_near_max:
        return "output_near_max"
    return None


def _made_nonfinite(s: LayerStats, rule: DecisionRule) -> bool:
    """Whether the layer made non-finite outputs from finite inputs (in more
    than ``max_nonfinite`` of the observed steps)."""
    return bool(s.forward_steps) and s.out_nonfinite - s.in_range > rule.max_nonfinite


def _innermost(made: Sequence[int], parents: Sequence[int] | None) -> list[int]:
    """``made`` without the layers that contain another of ``made``."""
    if parents is None:
        return list(made)
    outer = set()
    for j in made:
        p = parents[j]
        while p >= 0:
            outer.add(p)
            p = parents[p]
    return [i for i in made if i not in outer]


def _float8_trouble(s: LayerStats, rule: DecisionRule, margin: float = 1.0) -> str | None:
    """Why the float8 evidence says the layer should not be in float8, or None."""
    if not s.forward_steps:
        return None
    if s.f8_saturated > margin * rule.max_float8_saturated:
        return "float8_saturated"
    if s.f8_flushed > margin * rule.max_float8_flushed:
        return "float8_flushed"
    return None


def _fits(dtype: str, s: LayerStats, rule: DecisionRule, base: str = "bfloat16") -> bool:
    """Whether a layer with statistics ``s`` would be healthy in ``dtype``
    (a float8 layer computes in ``base``), with the hysteresis margin."""
    if dtype == "float8":
        return (_float8_trouble(s, rule, rule.hysteresis) is None
                and s.f8_growth <= rule.max_float8_growth and _fits(base, s, rule))
    if s.forward_steps:
        limit = rule.hysteresis * _DTYPE_MAX[dtype] / _NEAR_MAX
        if s.in_range > 0 or s.out_nonfinite > 0 or max(s.in_amax, s.out_amax) > limit:
            return False
    if not s.gradients:
        return True
    if s.nonfinite > 0:
        return False
    if dtype == "float16":
        return s.fp16_overflow == 0 and \
            s.fp16_underflow + s.fp16_subnormal <= rule.hysteresis * rule.max_fp16_subnormal
    if dtype == "bfloat16":
        return s.bf16_subnormal <= rule.hysteresis * rule.max_bf16_subnormal
    return True


def _grad_bad(s: LayerStats, rule: DecisionRule, margin: float = 1.0) -> bool:
    return bool(s.probe_steps) and s.grad_error > margin * rule.max_probe_grad_error \
        and s.grad_noise_ratio > margin * rule.max_probe_noise_ratio


def _probe_bad(stats: Sequence[LayerStats], loss_error: float, loss_ratio: float,
               rule: DecisionRule, margin: float = 1.0) -> bool:
    loss_bad = loss_error > margin * rule.max_probe_loss_error \
        and loss_ratio > margin * rule.max_probe_noise_ratio
    return loss_bad or any(_grad_bad(s, rule, margin) for s in stats)


def decide(stats: Sequence[LayerStats], states: Sequence[LayerState],
           candidates: Sequence[str], rule: DecisionRule | None = None, *,
           all_nonfinite: float = 0.0, probe_steps: float = 0,
           probe_loss_error: float = 0.0, probe_loss_noise_ratio: float = float("inf"),
           validate_demotions: bool = False,
           float8_layers: Sequence[bool] | None = None,
           loss_scale: float | None = None, max_loss_scale: float = 2.0**24,
           layer_scales: Sequence[float] | None = None,
           layer_groups: Sequence[int] | None = None,
           confirm_proxies: bool | None = None,
           parents: Sequence[int] | None = None) -> Decision:
    """Applies the rule (see the module docstring) to one interval.

    Args:
        stats: one :class:`LayerStats` per layer, in forward order.
        states: one :class:`LayerState` per layer, same order.
        candidates: the allowed dtypes (any order; see :func:`sort_candidates`).
        rule: the thresholds; ``DecisionRule()`` when None.
        all_nonfinite: fraction of the interval's steps in which every
            layer's gradients were non-finite.
        probe_steps: float32 probes run in the interval (0: none).
        probe_loss_error: their mean loss relative error.
        probe_loss_noise_ratio: their mean ratio of the loss error to the
            batch's sampling noise (inf: not measured).
        validate_demotions: demote only after a probe with the layer narrowed
            (a trial) stayed under the thresholds; False demotes on range
            evidence alone (for callers that run no probe).
        float8_layers: per layer, whether it may compute in ``"float8"``
            (Keras trains only ``Dense`` and ``EinsumDense`` in float8); the
            others choose among the other candidates. None: every layer may.
        loss_scale: the current (global) loss scale, where the caller can
            change it (a dynamic schedule); None: no loss scale to change,
            float16 underflow is then a proxy like the others.
        max_loss_scale: the largest scale the schedule allows.
        layer_scales: per-layer loss scales: each layer's own factor (on
            top of ``loss_scale``), in the same order; None: one global scale.
        layer_groups: with ``layer_scales``, each layer's group: the layers
            inside one boundary share its factor (-1: no factor of its own);
            None: each layer its own.
        confirm_proxies: a promotion from a proxy statistic (see
            :data:`keras_mp.adaptive.decisions.rule.PROXY_REASONS`) waits for a probe
            that confirms harm; None: as ``validate_demotions`` (whether
            probes run).
        parents: per layer (same order), the index of the nearest layer
            given here that contains it (a sublayer of a composite layer), or
            -1; None: not known (no layer is taken to contain another).

    Returns:
        A :class:`Decision` (with the loss scales to set, if any).

    Example, float16 underflow with headroom grows the loss scale instead:
        >>> from keras_mp.adaptive.decisions.controller import LayerState, LayerStats, decide
        >>> under = LayerStats(steps=5, fp16_subnormal=0.4, amax=0.01)
        >>> d = decide([under], [LayerState("float16")], ("float16", "float32"),
        ...            loss_scale=1.0)
        >>> d.switches, d.loss_scale   # 0.01 * 2**18 * 16 <= 65504
        ((), 262144.0)

    Example, a float32 layer demoted after its patience:
        >>> from keras_mp.adaptive.decisions.controller import DecisionRule, LayerState, LayerStats, decide
        >>> rule = DecisionRule(patience=2, cooldown=0)
        >>> st = [LayerState("float32", strikes=0)]
        >>> for _ in range(2):
        ...     d = decide([LayerStats(steps=5)], st, ("bfloat16", "float32"), rule)
        ...     st = d.states
        >>> st[0].dtype, d.switches[0].reason
        ('bfloat16', 'healthy')

    The same with probe validation: first a trial, then the probe decides:
        >>> st = [LayerState("float32")]
        >>> for _ in range(2):
        ...     st = decide([LayerStats(steps=5)], st, ("bfloat16", "float32"), rule,
        ...                 validate_demotions=True).states
        >>> st[0].dtype, st[0].trial
        ('float32', 1)
        >>> d = decide([LayerStats(steps=5, probe_steps=1, grad_error=0.01)], st,
        ...            ("bfloat16", "float32"), rule, probe_steps=1, probe_loss_error=0.001,
        ...            validate_demotions=True)
        >>> d.states[0].dtype, d.switches[0].reason
        ('bfloat16', 'probe_validated')
    """
    rule = rule or DecisionRule()
    order = sort_candidates(candidates)
    if len(stats) != len(states):
        raise ValueError(f"`stats` and `states` must have the same length, got "
                         f"{len(stats)} and {len(states)}.")
    if float8_layers is None:
        float8_layers = [True] * len(states)
    if len(float8_layers) != len(states):
        raise ValueError(f"`float8_layers` must have one entry per layer ({len(states)}), "
                         f"got {len(float8_layers)}.")
    floats = tuple(c for c in order if c != "float8")
    orders = [order if f8 else floats for f8 in float8_layers]
    if parents is not None and (len(parents) != len(states) or any(
            isinstance(p, bool) or not isinstance(p, int) or not -1 <= p < len(states)
            or p == i for i, p in enumerate(parents))):
        raise ValueError(f"`parents` must hold, per layer, the index of another layer or -1 "
                         f"({len(states)} entries), got {parents!r}.")
    for s, own in zip(states, orders):
        if s.dtype not in own:
            raise ValueError(f"A layer state's dtype must be one of its candidates {own}, "
                             f"got {s.dtype!r}.")
    checks.fraction("all_nonfinite", all_nonfinite)
    if confirm_proxies is None:
        confirm_proxies = validate_demotions
    if isinstance(probe_steps, bool) or not isinstance(probe_steps, (int, float)) \
            or probe_steps < 0:
        raise ValueError(f"`probe_steps` must be a number >= 0, got {probe_steps!r}.")
    if isinstance(probe_loss_error, bool) or not isinstance(probe_loss_error, (int, float)) \
            or not probe_loss_error >= 0:
        raise ValueError(f"`probe_loss_error` must be a number >= 0, got {probe_loss_error!r}.")
    if isinstance(probe_loss_noise_ratio, bool) or not isinstance(
            probe_loss_noise_ratio, (int, float)) or not probe_loss_noise_ratio >= 0:
        raise ValueError("`probe_loss_noise_ratio` must be a number >= 0, got "
                         f"{probe_loss_noise_ratio!r}.")

    def wider(i: int, dtype: str) -> str | None:
        k = orders[i].index(dtype)
        return orders[i][k + 1] if k + 1 < len(orders[i]) else None

    def narrower(i: int, dtype: str) -> str | None:
        k = orders[i].index(dtype)
        return orders[i][k - 1] if k > 0 else None

    new = list(states)
    switches: list[Switch] = []
    troubled: set[int] = set()
    measured = [i for i, s in enumerate(stats) if s.steps > 0 or s.forward_steps > 0]
    with_grads = [i for i in measured if stats[i].gradients and stats[i].steps > 0]

    def promote(i: int, reason: str) -> None:
        target = wider(i, new[i].dtype)
        if target is not None:
            switches.append(Switch(i, new[i].dtype, target, reason))
            new[i] = _promote(new[i], target, rule)

    def can_widen(i: int) -> bool:
        return wider(i, new[i].dtype) is not None

    # 1. forward range: where a non-finite value was made, else input-most
    forward_bad = [(i, r) for i in measured if (r := _forward_trouble(stats[i], rule))]
    troubled.update(i for i, _ in forward_bad)
    made = _innermost([i for i in measured if _made_nonfinite(stats[i], rule)], parents)
    first = next(((i, "output_nonfinite") for i in made if can_widen(i)), None) or \
        next(((i, r) for i, r in forward_bad if can_widen(i)), None)
    if first is not None:
        promote(*first)
    # 2. non-finite gradients
    everywhere = with_grads and all_nonfinite > rule.max_nonfinite
    bad = [i for i in with_grads if stats[i].nonfinite > rule.max_nonfinite]
    troubled.update(bad)
    if everywhere:
        troubled.update(measured)
    if not switches:
        observed = any(stats[i].forward_steps for i in measured)
        if everywhere and not observed:
            first_i = next((i for i in with_grads if can_widen(i)), None)
            if first_i is not None:
                promote(first_i, "nonfinite_everywhere")
        else:
            last = next((i for i in reversed(bad) if can_widen(i)), None)
            if last is None and everywhere:
                last = next((i for i in reversed(with_grads) if can_widen(i)), None)
            if last is not None:
                promote(last, "nonfinite")
    # 3. local trouble: float8 clipping promotes at once; underflow is
    # answered by a larger loss scale where the gradients have headroom;
    # proxies wait for the probe to confirm harm (a promotion trial)
    scales = scale_rule.Scales(stats, new, rule, loss_scale=loss_scale,
                               max_loss_scale=max_loss_scale, layer_scales=layer_scales,
                               layer_groups=layer_groups)
    for i in measured:
        if i in troubled:
            continue
        s, dtype = stats[i], new[i].dtype
        reason = _float8_trouble(s, rule) if dtype == "float8" else None
        if reason == "float8_saturated":
            troubled.add(i)
            promote(i, reason)
            continue
        if reason is not None:
            pass
        elif s.gradients and dtype == "float16" and (
                s.fp16_subnormal + s.fp16_underflow > rule.max_fp16_subnormal
                or scales.below_normal(i)):
            troubled.add(i)
            if scales.lift(i):
                continue  # the loss scale grows instead
            reason = "fp16_subnormal"
        elif s.gradients and dtype == "bfloat16" and s.bf16_subnormal > rule.max_bf16_subnormal:
            reason = "bf16_subnormal"
        elif s.forward_steps and dtype != "float32" and s.out_flushed > rule.max_flushed:
            reason = "output_flushed"
        if reason is None:
            continue
        troubled.add(i)
        if not confirm_proxies:
            promote(i, reason)
        elif not new[i].suspect:
            new[i] = dataclasses.replace(new[i], suspect=PROXY_REASONS.index(reason) + 1)
    # 5. probe: trials first, then rounding trouble
    trials = [i for i, st in enumerate(new) if st.trial]
    validated: set[int] = set()
    # float8's own quantization noise moves the loss wherever it runs (3
    # mantissa bits), so with a float8 layer in the probe the loss error
    # localizes nothing: layers are then judged by their gradient errors.
    if any(st.dtype == "float8" or (st.trial and narrower(i, st.dtype) == "float8")
           for i, st in enumerate(states)):
        probe_loss_error = 0.0
    # promotion trials: the probe measured the suspect layers as they are
    if probe_steps > 0:
        loss_harm = _probe_bad([], probe_loss_error, probe_loss_noise_ratio, rule,
                               rule.hysteresis)
        for i, st in enumerate(new):
            if not st.suspect:
                continue
            if loss_harm or _grad_bad(stats[i], rule, rule.hysteresis):
                troubled.add(i)
                promote(i, PROXY_REASONS[st.suspect - 1])
            else:  # measured at float32's quality: the proxy is not taken
                new[i] = dataclasses.replace(st, suspect=0)
    if probe_steps > 0 and trials:
        if troubled or _probe_bad(stats, probe_loss_error, probe_loss_noise_ratio, rule,
                                  rule.hysteresis):
            for i in trials:  # rejected: a strike, and a cool-down
                new[i] = dataclasses.replace(new[i], trial=0, healthy=0, cooldown=rule.cooldown,
                                             strikes=new[i].strikes + 1)
        else:
            for i in trials:
                target = narrower(i, new[i].dtype)
                switches.append(Switch(i, new[i].dtype, target, "probe_validated"))
                new[i] = LayerState(target, healthy=0, cooldown=rule.cooldown,
                                    switches=new[i].switches + 1, strikes=new[i].strikes)
                validated.add(i)
    elif probe_steps > 0 and not switches and _probe_bad(stats, probe_loss_error,
                                                         probe_loss_noise_ratio, rule):
        # (not a layer whose scale just grew: the probe measured the old one)
        narrow = [i for i in measured if can_widen(i) and stats[i].probe_steps
                  and i not in scales.lifted]
        if not _probe_bad([], probe_loss_error, probe_loss_noise_ratio, rule):
            # The loss is fine but some gradients are not: the output-most of those.
            narrow = [i for i in narrow if _grad_bad(stats[i], rule)]
        # Otherwise the output-most narrow layer: rounding that moves the loss
        # enters the backward pass at the output and reaches every layer below.
        if narrow:
            troubled.add(narrow[-1])
            promote(narrow[-1], "probe_error")
    # 4. demotion (and the health counters)
    switched = {sw.layer for sw in switches}
    trial_open = any(st.trial for st in new)
    for i in measured:
        if i in switched or i in validated:
            continue
        st = new[i]
        cooldown = max(st.cooldown - 1, 0)
        if i in troubled:
            new[i] = dataclasses.replace(st, healthy=0, cooldown=cooldown, trial=0)
            continue
        st = dataclasses.replace(st, suspect=0)  # the proxy evidence is gone
        healthy = st.healthy + 1
        target = narrower(i, st.dtype)
        ready = (target is not None and cooldown == 0 and st.switches < rule.max_switches
                 and st.strikes < rule.max_strikes
                 and healthy >= rule.patience * 2**st.strikes
                 and _fits(target, stats[i], rule, floats[0]))
        if ready and not validate_demotions:
            switches.append(Switch(i, st.dtype, target, "healthy"))
            new[i] = LayerState(target, healthy=0, cooldown=rule.cooldown,
                                switches=st.switches + 1, strikes=st.strikes)
        elif ready and not trial_open:
            new[i] = dataclasses.replace(st, healthy=healthy, cooldown=cooldown, trial=1)
            trial_open = True
        else:
            new[i] = dataclasses.replace(st, healthy=healthy, cooldown=cooldown,
                                         trial=st.trial if ready else 0)
    return Decision(tuple(new), tuple(switches), *scales.result())
