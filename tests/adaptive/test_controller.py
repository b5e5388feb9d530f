"""keras_mp.adaptive.decisions.controller.decide on synthetic statistics: promotion, attribution,
demotion, hysteresis, cool-down, caps, and bad input."""

import dataclasses

import pytest

from keras_mp.adaptive.decisions.controller import (PROXY_REASONS, DecisionRule, LayerState, LayerStats,
                                          Switch, decide, sort_candidates)

F16 = ("float16", "float32")
BF16 = ("bfloat16", "float32")
HEALTHY = LayerStats(steps=10)
BAD = LayerStats(steps=10, nonfinite=1.0)


def dtypes(decision):
    return [s.dtype for s in decision.states]


def test_whole_step_failure_promotes_input_most_narrow_layer_one_per_interval():
    states = [LayerState("float16")] * 3
    d = decide([BAD] * 3, states, F16, all_nonfinite=1.0)
    assert dtypes(d) == ["float32", "float16", "float16"]
    assert [(s.layer, s.reason) for s in d.switches] == [(0, "nonfinite_everywhere")]
    # Still failing: the next narrow layer follows.
    d = decide([BAD] * 3, d.states, F16, all_nonfinite=1.0)
    assert dtypes(d) == ["float32", "float32", "float16"]
    # Fixed: nothing more changes.
    d2 = decide([HEALTHY] * 3, d.states, F16)
    assert dtypes(d2) == dtypes(d) and d2.switches == ()


def test_partial_nonfinite_promotes_output_most_nonfinite_layer():
    # Backward overflow in layer 1: layers 0 and 1 non-finite, layer 2 finite.
    d = decide([BAD, BAD, HEALTHY], [LayerState("float16")] * 3, F16, all_nonfinite=0.0)
    assert dtypes(d) == ["float16", "float32", "float16"]
    assert d.switches[0].reason == "nonfinite"


def test_nonfinite_at_or_below_threshold_is_the_loss_scalers_business():
    rule = DecisionRule(max_nonfinite=0.25)
    s = LayerStats(steps=8, nonfinite=0.25)
    d = decide([s], [LayerState("float16")], F16, rule, all_nonfinite=0.25)
    assert d.switches == ()
    d = decide([dataclasses.replace(s, nonfinite=0.26)], [LayerState("float16")], F16, rule)
    assert dtypes(d) == ["float32"]


def test_range_statistics_promote_only_the_dtype_they_concern():
    under = LayerStats(steps=5, fp16_subnormal=0.3, bf16_subnormal=0.3)
    d = decide([under, under], [LayerState("float16"), LayerState("bfloat16")],
               ("float16", "bfloat16", "float32"))
    assert dtypes(d) == ["bfloat16", "float32"]
    assert [s.reason for s in d.switches] == ["fp16_subnormal", "bf16_subnormal"]
    # float16 statistics say nothing about a bfloat16 layer, and vice versa.
    d = decide([LayerStats(steps=5, fp16_subnormal=0.9), LayerStats(steps=5, bf16_subnormal=0.9)],
               [LayerState("bfloat16"), LayerState("float16")], ("float16", "bfloat16", "float32"))
    assert d.switches == ()


def test_demotion_after_patience_only_when_the_narrower_dtype_fits():
    rule = DecisionRule(patience=3, cooldown=0)
    st = [LayerState("float32"), LayerState("float32")]
    fits, overflows = HEALTHY, LayerStats(steps=10, fp16_overflow=0.01)
    for i in range(3):
        d = decide([fits, overflows], st, F16, rule)
        st = d.states
        assert dtypes(d) == (["float32"] * 2 if i < 2 else ["float16", "float32"])
    assert d.switches[0].reason == "healthy"
    assert st[1].healthy == 3  # healthy in float32, just not float16 material


def test_hysteresis_band_neither_promotes_nor_demotes():
    rule = DecisionRule(patience=1, cooldown=0, max_fp16_subnormal=0.2, hysteresis=0.5)
    band = LayerStats(steps=10, fp16_subnormal=0.15)  # between 0.1 and 0.2
    d = decide([band, band], [LayerState("float16"), LayerState("float32")], F16, rule)
    assert d.switches == ()
    below = LayerStats(steps=10, fp16_subnormal=0.1)
    d = decide([below], [LayerState("float32")], F16, rule)
    assert dtypes(d) == ["float16"]


def test_cooldown_delays_demotion():
    rule = DecisionRule(patience=1, cooldown=3)
    st = [LayerState("float32", cooldown=3)]
    seen = []
    for _ in range(4):
        d = decide([HEALTHY], st, BF16, rule)
        st = d.states
        seen.append(dtypes(d)[0])
    assert seen == ["float32", "float32", "bfloat16", "bfloat16"]


def test_patience_doubles_per_strike_and_strikes_pin_the_layer():
    rule = DecisionRule(patience=2, cooldown=0, max_strikes=2)
    st = [LayerState("float32", strikes=1)]
    for i in range(4):
        d = decide([HEALTHY], st, F16, rule)
        st = d.states
        assert dtypes(d) == (["float32"] if i < 3 else ["float16"])
    st = [LayerState("float32", strikes=2)]
    for _ in range(50):
        st = decide([HEALTHY], st, F16, rule).states
    assert dtypes(decide([HEALTHY], st, F16, rule)) == ["float32"]


def test_switch_cap_blocks_demotion_but_never_promotion():
    rule = DecisionRule(patience=1, cooldown=0, max_switches=2, max_strikes=10)
    st = [LayerState("float32", switches=2)]
    for _ in range(5):
        st = decide([HEALTHY], st, F16, rule).states
    assert st[0].dtype == "float32"
    d = decide([BAD], [LayerState("float16", switches=9)], F16, rule, all_nonfinite=1.0)
    assert dtypes(d) == ["float32"]


def test_alternating_trouble_does_not_oscillate():
    rule = DecisionRule(patience=1, cooldown=1, max_switches=4, max_strikes=2)
    st = [LayerState("float16")]
    switches = 0
    for i in range(200):
        # A layer that fails whenever it is in float16, and looks healthy in float32.
        bad = st[0].dtype == "float16"
        d = decide([BAD if bad else HEALTHY], st, F16, rule, all_nonfinite=1.0 if bad else 0.0)
        switches += len(d.switches)
        st = d.states
    assert st[0].dtype == "float32"
    assert switches == 3  # up, down after patience, up again: pinned


def test_widest_layer_in_trouble_and_unmeasured_layers_are_left_alone():
    d = decide([BAD, LayerStats()], [LayerState("float32"), LayerState("float16")], F16,
               all_nonfinite=1.0)
    assert d.switches == () and dtypes(d) == ["float32", "float16"]
    assert d.states[1] == LayerState("float16")  # no statistics: untouched


def test_single_candidate_never_switches():
    d = decide([BAD], [LayerState("float32")], ("float32",), all_nonfinite=1.0)
    assert d.switches == ()


def test_sort_candidates_and_validation():
    assert sort_candidates(["float32", "bfloat16", "float16"]) == (
        "float16", "bfloat16", "float32")
    for bad in ([], "float16", ["float64"], ["float16", "float16"]):
        with pytest.raises(ValueError, match="candidates"):
            sort_candidates(bad)
    with pytest.raises(ValueError, match="same length"):
        decide([HEALTHY], [], F16)
    with pytest.raises(ValueError, match="candidates"):
        decide([HEALTHY], [LayerState("bfloat16")], F16)
    with pytest.raises(ValueError, match="`dtype`"):
        LayerState("int8")
    with pytest.raises(ValueError, match="`switches`"):
        LayerState("float16", switches=-1)
    with pytest.raises(ValueError, match="all_nonfinite"):
        decide([HEALTHY], [LayerState("float16")], F16, all_nonfinite=2.0)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_nonfinite": 1.5}, "max_nonfinite"), ({"hysteresis": 0.0}, "hysteresis"),
    ({"patience": 0}, "patience"), ({"cooldown": -1}, "cooldown"),
    ({"max_switches": 0}, "max_switches"), ({"max_strikes": 1.5}, "max_strikes"),
])
def test_rule_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DecisionRule(**kwargs)


def test_rule_config_round_trip():
    rule = DecisionRule(patience=3, hysteresis=0.25)
    assert DecisionRule.from_config(rule.get_config()) == rule


# -- forward statistics and the probe ------------------------------------------

B16 = BF16


def _fwd(**kw):
    return LayerStats(steps=10, forward_steps=10, **kw)


@pytest.mark.parametrize("field, value, reason", [
    ("in_range", 1.0, "input_range"), ("out_nonfinite", 0.5, "output_nonfinite"),
    ("out_near_max", 0.3, "output_near_max")])
def test_forward_trouble_promotes_the_input_most_layer(field, value, reason):
    # Every later layer sees the damage too: only the first is promoted.
    stats = [_fwd(), _fwd(**{field: value}), _fwd(in_range=1.0, out_nonfinite=1.0)]
    d = decide(stats, [LayerState("float16")] * 3, F16)
    assert [(sw.layer, sw.reason) for sw in d.switches] == [(1, reason)]
    assert [s.healthy for s in d.states] == [1, 0, 0]  # the damaged ones are not healthy


def test_weightless_layers_are_decided_on_forward_statistics_alone():
    weightless = LayerStats(steps=10, gradients=False, forward_steps=10, in_range=1.0,
                            nonfinite=1.0)  # gradient fields are not measured: ignored
    d = decide([_fwd(), weightless], [LayerState("float16")] * 2, F16)
    assert [(sw.layer, sw.reason) for sw in d.switches] == [(1, "input_range")]


def test_nonfinite_everywhere_heuristic_only_without_forward_evidence():
    d = decide([BAD, BAD], [LayerState("float16")] * 2, F16, all_nonfinite=1.0)
    assert d.switches[0] == Switch(0, "float16", "float32", "nonfinite_everywhere")
    # A clean forward pass says the overflow was in the backward pass: output-most.
    clean = dataclasses.replace(BAD, forward_steps=10)
    d = decide([clean, clean], [LayerState("float16")] * 2, F16, all_nonfinite=1.0)
    assert d.switches[0] == Switch(1, "float16", "float32", "nonfinite")


def test_flushed_outputs_promote_a_narrow_layer():
    d = decide([_fwd(out_flushed=0.6), _fwd(out_flushed=0.6)],
               [LayerState("bfloat16"), LayerState("float32")], B16)
    assert [(sw.layer, sw.reason) for sw in d.switches] == [(0, "output_flushed")]


def _probed(grad_error=0.01, ratio=0.1, **kw):
    return LayerStats(steps=10, forward_steps=10, probe_steps=1, grad_error=grad_error,
                      grad_noise_ratio=ratio, **kw)


def test_probe_loss_error_promotes_the_output_most_narrow_layer():
    stats = [_probed(0.6, 0.8), _probed(0.3, 0.8), _probed(0.2, 0.6)]
    states = [LayerState("bfloat16")] * 3
    d = decide(stats, states, B16, probe_steps=1, probe_loss_error=0.9,
               probe_loss_noise_ratio=17.0)
    assert [(sw.layer, sw.reason) for sw in d.switches] == [(2, "probe_error")]
    # Below the batch's sampling noise the same relative error changes nothing.
    d = decide(stats, states, B16, probe_steps=1, probe_loss_error=0.9,
               probe_loss_noise_ratio=0.5)
    assert d.switches == ()
    # Only a gradient off (and above its noise): the output-most of those.
    stats = [_probed(0.9, 3.0), _probed(0.9, 2.0), _probed(0.9, 0.2)]
    d = decide(stats, states, B16, probe_steps=1, probe_loss_error=0.01,
               probe_loss_noise_ratio=0.1)
    assert [(sw.layer, sw.reason) for sw in d.switches] == [(1, "probe_error")]


def test_demotion_waits_for_a_probe_and_one_trial_at_a_time():
    rule = DecisionRule(patience=1, cooldown=0)
    st = [LayerState("float32"), LayerState("float32")]
    d = decide([HEALTHY, HEALTHY], st, B16, rule, validate_demotions=True)
    assert d.switches == () and [s.trial for s in d.states] == [1, 0]
    # no probe in the interval: the trial waits
    d = decide([HEALTHY, HEALTHY], d.states, B16, rule, validate_demotions=True)
    assert d.switches == () and [s.trial for s in d.states] == [1, 0]
    # a clean probe with the layer narrowed: demoted, validated
    d = decide([_probed(), _probed()], d.states, B16, rule, probe_steps=1,
               probe_loss_error=0.001, probe_loss_noise_ratio=0.1, validate_demotions=True)
    assert [(sw.layer, sw.reason) for sw in d.switches] == [(0, "probe_validated")]
    assert d.states[0].dtype == "bfloat16" and d.states[1].trial == 1  # the next trial


def test_a_failed_trial_is_a_strike_and_no_demotion():
    rule = DecisionRule(patience=1, cooldown=0)
    st = [LayerState("float32", trial=1)]
    d = decide([_probed(0.9, 5.0)], st, B16, rule, probe_steps=1, probe_loss_error=0.5,
               probe_loss_noise_ratio=5.0, validate_demotions=True)
    assert d.switches == ()
    assert (d.states[0].dtype, d.states[0].trial, d.states[0].strikes) == ("float32", 0, 1)


def test_forward_range_blocks_a_demotion_to_float16():
    rule = DecisionRule(patience=1, cooldown=0)
    big = _fwd(in_amax=5e4)  # fits float32; within 16x of float16's largest value
    d = decide([big, _fwd(in_amax=10.0)], [LayerState("float32")] * 2, F16, rule)
    assert [sw.layer for sw in d.switches] == [1]


# -- the loss scale before the dtype; the probe as the judge of proxies ---------

UNDER = LayerStats(steps=10, fp16_subnormal=0.3, fp16_underflow=0.1, amax=0.01)


def test_underflow_with_headroom_grows_the_loss_scale_instead_of_promoting():
    # amax 0.01 at scale 1: 2**18 more leaves it 16x below 65504
    d = decide([UNDER, HEALTHY], [LayerState("float16")] * 2, F16, loss_scale=1.0)
    assert d.switches == () and d.loss_scale == 2.0**18
    assert [s.healthy for s in d.states] == [0, 1]  # in trouble, just not a dtype's
    # the layer with the largest gradients limits the growth for everyone
    big = LayerStats(steps=10, amax=100.0)
    d = decide([UNDER, big], [LayerState("float16")] * 2, F16, loss_scale=1.0)
    assert d.loss_scale == 2.0**5
    # and the schedule's bound
    d = decide([UNDER], [LayerState("float16")], F16, loss_scale=1.0, max_loss_scale=16.0)
    assert d.loss_scale == 16.0
    # no loss scale to change: a proxy, promoted at once without probes (as before)
    d = decide([UNDER], [LayerState("float16")], F16)
    assert d.loss_scale is None and d.switches[0].reason == "fp16_subnormal"


def test_underflow_without_headroom_waits_for_the_probe_to_confirm_harm():
    limited = LayerStats(steps=10, amax=4000.0)  # at scale 1: no headroom left
    stats, states = [UNDER, limited], [LayerState("float16")] * 2
    d = decide(stats, states, F16, loss_scale=1.0, validate_demotions=True)
    assert d.switches == () and d.loss_scale is None
    assert [s.suspect for s in d.states] == [1, 0]  # fp16_subnormal on trial
    # the probe measures the layer at float32's quality: not promoted, no strike
    probed = dataclasses.replace(UNDER, probe_steps=1, grad_error=0.005, grad_noise_ratio=0.3)
    kw = dict(loss_scale=1.0, validate_demotions=True, probe_steps=1,
              probe_loss_error=0.001, probe_loss_noise_ratio=0.2)
    d2 = decide([probed, limited], d.states, F16, **kw)
    assert d2.switches == () and d2.states[0] == dataclasses.replace(
        d.states[0], suspect=0, healthy=0)
    # the probe measures harm (beyond hysteresis x the threshold, and the noise)
    harmed = dataclasses.replace(probed, grad_error=0.4, grad_noise_ratio=3.0)
    d3 = decide([harmed, limited], d.states, F16, **kw)
    assert [(sw.layer, sw.reason) for sw in d3.switches] == [(0, "fp16_subnormal")]
    assert d3.states[0].dtype == "float32" and d3.states[0].suspect == 0


def test_a_suspect_whose_proxy_evidence_is_gone_is_cleared():
    st = [LayerState("float16", suspect=1)]
    d = decide([HEALTHY], st, F16, loss_scale=1.0, validate_demotions=True)
    assert d.states[0].suspect == 0 and d.switches == ()


@pytest.mark.parametrize("stats, dtype, reason", [
    (LayerStats(steps=10, forward_steps=10, out_flushed=0.7), "bfloat16", "output_flushed"),
    (LayerStats(steps=10, bf16_subnormal=0.5), "bfloat16", "bf16_subnormal"),
    (LayerStats(steps=10, forward_steps=10, f8_flushed=0.5), "float8", "float8_flushed")])
def test_every_proxy_is_a_promotion_trial_where_probes_run(stats, dtype, reason):
    candidates = ("float8", "bfloat16", "float32")
    d = decide([stats], [LayerState(dtype)], candidates, validate_demotions=True)
    assert d.switches == () and d.states[0].suspect == PROXY_REASONS.index(reason) + 1
    # harm in the loss confirms it too
    probed = dataclasses.replace(stats, probe_steps=1, grad_error=0.01, grad_noise_ratio=0.1)
    d = decide([probed], d.states, candidates, validate_demotions=True, probe_steps=1,
               probe_loss_error=0.3, probe_loss_noise_ratio=5.0)
    if dtype == "float8":  # float8 noise makes the loss error no evidence
        assert d.switches == ()
    else:
        assert [sw.reason for sw in d.switches] == [reason]


def test_hard_failures_still_promote_at_once_where_probes_run():
    saturated = LayerStats(steps=10, forward_steps=10, f8_saturated=0.5)
    d = decide([saturated], [LayerState("float8")], ("float8", "bfloat16", "float32"),
               validate_demotions=True)
    assert [sw.reason for sw in d.switches] == ["float8_saturated"]
    d = decide([_fwd(in_range=1.0)], [LayerState("float16")], F16, loss_scale=1.0,
               validate_demotions=True)
    assert [sw.reason for sw in d.switches] == ["input_range"]
    d = decide([BAD, HEALTHY], [LayerState("float16")] * 2, F16, loss_scale=1.0,
               validate_demotions=True)
    assert [sw.reason for sw in d.switches] == ["nonfinite"]


def test_per_layer_scales_lift_only_the_layer_that_underflows():
    big = LayerStats(steps=10, amax=4000.0)
    d = decide([UNDER, big], [LayerState("float16")] * 2, F16, loss_scale=1.0,
               layer_scales=[1.0, 1.0], validate_demotions=True)
    assert d.switches == () and d.loss_scale is None
    assert d.layer_scales == (2.0**18, 1.0) and d.states[0].suspect == 0
    # a factor whose headroom is gone is given back (to at least 1)
    grown = LayerStats(steps=10, amax=1.0)
    d = decide([grown, big], [LayerState("float16")] * 2, F16, loss_scale=2.0,
               layer_scales=[2.0**12, 1.0])
    assert d.layer_scales == (2.0**10, 1.0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(loss_scale=0.0), "loss_scale"), (dict(loss_scale=float("inf")), "loss_scale"),
    (dict(loss_scale=1.0, max_loss_scale=-1.0), "max_loss_scale"),
    (dict(layer_scales=[1.0]), "layer_scales"),
    (dict(loss_scale=1.0, layer_scales=[1.0, 2.0]), "layer_scales"),
    (dict(loss_scale=1.0, layer_scales=[0.0]), "layer_scales")])
def test_scale_arguments_are_checked(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        decide([HEALTHY], [LayerState("float16")], F16, **kwargs)


def test_suspect_and_scale_headroom_validation():
    with pytest.raises(ValueError, match="`suspect`"):
        LayerState("float16", suspect=len(PROXY_REASONS) + 1)
    with pytest.raises(ValueError, match="`scale_headroom`"):
        DecisionRule(scale_headroom=1.0)
