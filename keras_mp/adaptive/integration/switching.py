"""Applying a decision of :func:`keras_mp.adaptive.decisions.controller.decide` to the
policy: composite layers take their sublayers along, each switch is assigned
and recorded, and every controlled layer's record (state, statistics, probe
errors, forward position) is written for the report and the ``.keras`` file.

Example:
    >>> import keras, keras_mp
    >>> from keras_mp.adaptive.policy import controlled_layers
    >>> from keras_mp.adaptive.integration import switching
    >>> keras_mp.set_global_policy("adaptive_float16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> policy = controlled_layers.policy_of(model)
    >>> layers = controlled_layers.adaptive_layers(model, policy)
    >>> made = switching.apply(policy, [layers[0].path], layers,
    ...                        [(0, "float16", "float32", "input_range")], calls=8)
    >>> made[0]["new"], layers[0].compute_dtype
    ('float32', 'float32')
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import keras

from keras_mp.adaptive.decisions import controller
from keras_mp.adaptive.policy.adaptive_policy import AdaptivePolicy
if TYPE_CHECKING:  # an annotation only: the statistics load when a fit adapts
    from keras_mp.adaptive.evidence.stats import IntervalStats

__all__ = ["refresh", "parents", "with_parents", "apply", "adopt", "write_records", "layer_states",
           "trial_dtypes", "settle", "release", "NO_GAIN", "GAIN"]

#: The reasons of :func:`settle` and :func:`release`.
NO_GAIN, GAIN = "no_gain", "gain"

#: A switch as the callback hands it on: (layer index, old dtype, new dtype, reason).
Switch = tuple[int, str, str, str]


def refresh(layer: keras.layers.Layer) -> None:
    """Recomputes what a layer cached in its old compute dtype: Keras's
    ``Normalization`` keeps its mean and variance as tensors cast when it was
    adapted, so a variance of 1e10 cached in float16 stays inf after the layer
    moves to float32 unless it is finalized again."""
    if not isinstance(layer, keras.layers.Layer):
        raise TypeError(f"`layer` must be a Keras layer, got {layer!r}.")
    finalize = getattr(layer, "finalize_state", None)
    if layer.built and callable(finalize):
        finalize()


def _check_policy(policy) -> None:
    if not isinstance(policy, AdaptivePolicy):
        raise TypeError(f"`policy` must be a keras_mp.AdaptivePolicy, got {policy!r}.")


def layer_states(policy: AdaptivePolicy, paths: Sequence[str]) -> list[controller.LayerState]:
    """Each layer's controller state, as its record in ``policy`` holds it
    (a fresh one where the record is missing or its dtype is not the layer's)."""
    _check_policy(policy)
    out = []
    for path in paths:
        saved = policy.record(path).get("state")
        dtype = policy.dtype_of(path)
        if saved and saved.get("dtype") == dtype:
            out.append(controller.LayerState(**saved))
        else:
            out.append(controller.LayerState(dtype))
    return out


def trial_dtypes(policy: AdaptivePolicy, paths: Sequence[str],
                 states: Sequence[controller.LayerState]) -> dict[str, str]:
    """Layers on trial for a demotion, in the narrower dtype they are tried in."""
    _check_policy(policy)
    out = {}
    for path, st in zip(paths, states):
        order = policy.candidates_for(path)
        if st.trial and order.index(st.dtype) > 0:
            out[path] = order[order.index(st.dtype) - 1]
    return out


def parents(paths: Sequence[str]) -> list[int]:
    """Per path, the index of the nearest other path that contains it (a
    composite layer's), or -1.

    Example:
        >>> parents(["block", "block/attention", "block/attention/query", "dense"])
        [-1, 0, 1, -1]
    """
    if isinstance(paths, str) or not all(isinstance(p, str) for p in paths):
        raise TypeError(f"`paths` must be a sequence of layer paths (str), got {paths!r}.")
    out = []
    for path in paths:
        best, length = -1, -1
        for j, other in enumerate(paths):
            if path.startswith(other + "/") and len(other) > length:
                best, length = j, len(other)
        out.append(best)
    return out


def with_parents(policy: AdaptivePolicy, paths: Sequence[str], switches: Sequence[Switch],
                 states: list[controller.LayerState]) -> list[Switch]:
    """The extra switches of sublayers whose composite layer is promoted.

    A composite layer (``MultiHeadAttention``, a block) promoted takes its
    sublayers along: its computation runs in theirs too (the attention scores
    come out of the query and key projections). ``states`` is updated in
    place for the sublayers moved.
    """
    _check_policy(policy)
    rank = policy.candidates.index
    extra: list[Switch] = []
    for k, old, dtype, _reason in switches:
        if rank(dtype) < rank(old):
            continue
        prefix = paths[k] + "/"
        for j, path in enumerate(paths):
            st = states[j]
            if path.startswith(prefix) and rank(st.dtype) < rank(dtype):
                extra.append((j, st.dtype, dtype, "with_parent"))
                states[j] = controller.LayerState(
                    dtype, cooldown=policy.rule.cooldown, switches=st.switches + 1,
                    strikes=st.strikes + 1)
    return extra


def apply(policy: AdaptivePolicy, paths: Sequence[str], layers: Sequence[keras.layers.Layer],
          switches: Sequence[Switch], calls: int, *, verbose: int = 0) -> list[dict[str, Any]]:
    """Assigns each switch in ``policy``, refreshes the layer and appends it
    to the layer's history; returns the events (``step``, ``layer``, ``old``,
    ``new``, ``reason``)."""
    _check_policy(policy)
    made = []
    for k, old, dtype, reason in switches:
        path = paths[k]
        policy.assign(path, dtype)
        refresh(layers[k])
        event = {"step": calls, "layer": path, "old": old, "new": dtype, "reason": reason}
        policy.record(path).setdefault("history", []).append(
            {key: v for key, v in event.items() if key != "layer"})
        made.append(event)
        if verbose:
            print(f"keras_mp: {path}: {old} -> {dtype} ({reason}) at call {calls}")
    return made


def adopt(policy: AdaptivePolicy, paths: Sequence[str], layers: Sequence[keras.layers.Layer],
          states: Sequence[controller.LayerState],
          histories: dict[str, list[dict[str, Any]]] | None = None) -> bool:
    """Makes restored controller states the policy's (dtypes assigned, layers
    refreshed) and, where given, restored switch histories (layer path -> its
    switches). Returns whether a dtype changed (the train step must be traced
    anew); nothing changes where the states are the policy's already."""
    _check_policy(policy)
    for path in paths:
        if histories is not None and path in histories:
            policy.record(path)["history"] = [dict(h) for h in histories[path]]
    if list(states) == layer_states(policy, paths):
        return False
    changed = False
    for layer, path, state in zip(layers, paths, states):
        changed |= policy.dtype_of(path) != state.dtype
        policy.assign(path, state.dtype)
        refresh(layer)
        policy.record(path)["state"] = state.get_config()
    return changed


def write_records(policy: AdaptivePolicy, paths: Sequence[str],
                  states: Sequence[controller.LayerState], interval: IntervalStats,
                  order: Sequence[int]) -> None:
    """Each layer's record: controller state, the interval's statistics, the
    probe's errors (where probed) and its position in forward order."""
    _check_policy(policy)
    rule = policy.rule
    for path, state, stats in zip(paths, states, interval.layers):
        record = policy.record(path)
        record["state"] = state.get_config()
        record["stats"] = dict(vars(stats))
        if stats.probe_steps:
            record["probe"] = {
                "loss_error": interval.probe_loss_error,
                "loss_noise_ratio": interval.probe_loss_noise_ratio,
                "grad_error": stats.grad_error, "cosine": stats.cosine,
                "grad_noise_ratio": stats.grad_noise_ratio,
                "sensitive": stats.grad_error > rule.max_probe_grad_error
                and stats.grad_noise_ratio > rule.max_probe_noise_ratio}
    for position, i in enumerate(order):
        policy.record(paths[i])["position"] = position


def settle(policy: AdaptivePolicy, paths: Sequence[str], layers: Sequence[keras.layers.Layer],
           calls: int) -> list[dict[str, Any]]:
    """Every layer not in float32 to float32, reason ``no_gain``: a fit whose
    16-bit arithmetic could not repay adaptation (:mod:`keras_mp.adaptive.decisions.gain`)."""
    _check_policy(policy)
    return apply(policy, paths, layers, [(k, policy.dtype_of(p), "float32", NO_GAIN)
                                         for k, p in enumerate(paths)
                                         if policy.dtype_of(p) != "float32"], calls)


def release(policy: AdaptivePolicy, paths: Sequence[str], layers: Sequence[keras.layers.Layer],
            calls: int) -> list[dict[str, Any]]:
    """Layers whose last switch was :func:`settle`'s back to their narrowest
    candidate, reason ``gain``: they are adapted now, from where evidence starts."""
    _check_policy(policy)
    switches = []
    for k, path in enumerate(paths):
        history = policy.record(path).get("history") or [{}]
        if history[-1].get("reason") == NO_GAIN:
            switches.append((k, policy.dtype_of(path), policy.candidates_for(path)[0], GAIN))
    return apply(policy, paths, layers, switches, calls)
