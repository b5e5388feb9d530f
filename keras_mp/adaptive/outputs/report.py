"""``precision_report(model)``: every layer's dtype, its evidence (gradient
statistics, forward statistics, float32-probe errors) and its switches with
their reasons, as a table and as data.

Example:
    >>> import keras, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2),
    ...                           keras.layers.Softmax()])
    >>> r = keras_mp.precision_report(model)
    >>> [(row["class"], row["compute_dtype"], row["switches"]) for row in r.rows]
    [('Dense', 'bfloat16', 0), ('Softmax', 'bfloat16', 0)]
    >>> lines = str(r).splitlines()
    >>> lines[0]
    'policy: adaptive_bfloat16, candidates: bfloat16, float32'
    >>> lines[1].split(" | ")[:4]
    ['| layer', 'class', 'dtype', 'grad nonfinite']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_mp.adaptive.integration import rescue, skipping
from keras_mp.adaptive.policy.controlled_layers import adaptive_layers, policy_of
from keras_mp.adaptive.storage import variables as storage_vars
from keras_mp.execution import compact_update, optimizer_state

__all__ = ["COLUMNS", "PrecisionReport", "dtype_switches", "precision_report", "switch_text"]

NOT_MEASURED = "n/m"

#: The rules a layer's history cell shows, as it names them.
_RULE_LABELS = {"integer_input": "exact input", "float32_loss": "float32 penalty",
                "float32_adapt": "float32 statistics"}

#: ``(stats key, column title, which evidence, legend)`` for the table.
COLUMNS: tuple[tuple[str, str, str, str], ...] = (
    ("nonfinite", "grad nonfinite", "gradients",
     "fraction of statistics steps with an inf/nan gradient (at the loss scale's floor)"),
    ("amax", "grad amax", "gradients", "largest finite unscaled gradient magnitude"),
    ("fp16_subnormal", "fp16 sub", "gradients",
     "fraction of scaled gradient elements in float16's subnormal range"),
    ("bf16_subnormal", "bf16 sub", "gradients",
     "fraction of gradient elements below bfloat16's normal range"),
    ("in_amax", "in amax", "forward", "largest finite |input| as the layer received it"),
    ("out_amax", "out amax", "forward", "largest finite |output|"),
    ("in_range", "in range", "forward",
     "fraction of observed steps whose cast input was non-finite or beyond the dtype's max"),
    ("out_nonfinite", "out nonfinite", "forward",
     "fraction of observed steps with an inf/nan output"),
    ("out_flushed", "out flushed", "forward",
     "fraction of output elements flushed to subnormals in the layer's dtype"),
    ("f8_saturated", "f8 sat", "float8",
     "float8 layers: fraction of operand elements clipped at the E4M3/E5M2 limits"),
    ("f8_flushed", "f8 flushed", "float8",
     "float8 layers: fraction of non-zero operand elements rounded to zero"),
    ("f8_growth", "f8 growth", "float8",
     "float8 layers: largest amax growth over the amax history"),
    ("grad_error", "probe err", "probe",
     "float32 probe: relative error of the layer's gradient in its dtype vs float32"),
    ("cosine", "probe cos", "probe", "float32 probe: cosine of the gradient vs float32"),
    ("loss_scale", "loss scale", "scale",
     "float16: the loss scale the layer's gradients carry (the global scale, times the "
     "layer's own factor with per-layer loss scales)"),
)


def switch_text(entry: dict[str, Any]) -> str:
    """One history entry as the table and the picture write it:
    ``old->new@step (reason)``.

    Example:
        >>> switch_text({"step": 8, "old": "float16", "new": "float32", "reason": "input_range"})
        'float16->float32@8 (input_range)'
    """
    _check_entry("entry", entry)
    return f"{entry['old']}->{entry['new']}@{entry['step']} ({entry['reason']})"


def _check_entry(name: str, entry: Any) -> None:
    if not isinstance(entry, dict) or not {"step", "old", "new", "reason"} <= set(entry):
        raise TypeError(f"`{name}` must be a history entry (a dict with step, old, new and "
                        f"reason), got {entry!r}.")


def dtype_switches(history: list[dict[str, Any]]) -> int:
    """How many entries of a layer's history changed its dtype, whatever
    their reason: the controller's decisions, ``with_parent``, the rescues'
    ``dtype_mismatch``, and a small fit's ``no_gain`` and the ``gain`` that
    undoes it.

    Example:
        >>> dtype_switches([
        ...     {"step": 0, "old": "bfloat16", "new": "float32", "reason": "no_gain"},
        ...     {"step": 0, "old": "float32", "new": "bfloat16", "reason": "gain"}])
        2
    """
    if not isinstance(history, (list, tuple)):
        raise TypeError(f"`history` must be a list of history entries, got {history!r}.")
    for entry in history:
        _check_entry("history", entry)
    return sum(1 for entry in history if entry["old"] != entry["new"])


def _cell(value: Any) -> str:
    if value is None:
        return NOT_MEASURED
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _measured(stats: dict[str, Any] | None) -> dict[str, bool]:
    """Which evidence the last interval collected for a layer."""
    if not stats:
        return {"gradients": False, "forward": False, "probe": False, "float8": False,
                "scale": False}
    return {"gradients": bool(stats.get("gradients", True)) and stats.get("steps", 0) > 0,
            "forward": stats.get("forward_steps", 0) > 0,
            "probe": stats.get("probe_steps", 0) > 0,
            "float8": stats.get("forward_steps", 0) > 0 and bool(stats.get("float8")),
            "scale": stats.get("loss_scale") is not None}


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """A model's precision, layer by layer, in forward order.

    Attributes:
        policy: the policy's name (the global policy's when no layer is adaptive).
        candidates: the adaptive candidates, or ``()``.
        rows: one dict per controlled layer (every layer that computes, with
            or without weights): ``layer`` (path), ``class``,
            ``dtype`` (the adaptive dtype: ``"float8"`` for a layer
            training in float8, else its compute dtype),
            ``compute_dtype``, ``variable_dtype``, ``stats`` (the last
            interval's evidence, or None), ``measured`` (which evidence that
            interval collected: ``gradients``, ``forward``, ``probe``,
            ``float8``),
            ``probe`` (the last probe's errors and whether they mark the layer
            sensitive, or None), ``loss_scale`` (float16: the loss scale its
            gradients carried at the last decision, or None), ``state`` (the
            controller's, or None),
            ``history`` (switch dicts with ``step``, ``old``, ``new``,
            ``reason``), ``switches`` (how many of them changed the dtype,
            every reason counted: :func:`dtype_switches`; the count in
            ``state``, which bounds demotions by ``max_switches``, leaves out
            a small fit's ``no_gain`` and the ``gain`` that undoes it, which
            are not evidence of a layer going back and forth), ``rules`` (the rules of
            :mod:`keras_mp.adaptive.integration.rescue` applied to it, such as
            ``"integer_input"``), ``storage`` (variable name -> ``dtype`` it is
            stored in now, and the last decision's ``reason`` and ``error``,
            :mod:`keras_mp.adaptive.storage.frozen`; None where none was made).
        metrics_in_float32: the compiled metrics that get float32 predictions
            (the ``float32_metric`` rule of :mod:`keras_mp.adaptive.integration.rescue`).
        skipped_steps: steps whose gradients were not finite and that changed
            nothing (the optimizer's count, saved with it), or None.
        bad_data_steps: of those, the steps whose batch itself was not finite,
            in this process (:mod:`keras_mp.adaptive.integration.skipping`), or None.
    """

    policy: str
    candidates: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]
    metrics_in_float32: tuple[str, ...] = ()
    skipped_steps: int | None = None
    bad_data_steps: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The structured form (JSON-serializable)."""
        return {"policy": self.policy, "candidates": list(self.candidates),
                "layers": [dict(r) for r in self.rows],
                "metrics_in_float32": list(self.metrics_in_float32),
                "skipped_steps": self.skipped_steps, "bad_data_steps": self.bad_data_steps}

    def storage(self) -> dict[str, dict[str, Any]]:
        """``"layer/variable"`` -> its storage (``dtype``, ``reason``,
        ``error``), for every variable a storage decision was made for."""
        return {f"{r['layer']}/{name}": dict(entry) for r in self.rows
                for name, entry in (r.get("storage") or {}).items()}

    def _storage_line(self) -> str | None:
        compact = {k: e for k, e in self.storage().items() if e["dtype"] != "float32"}
        if not compact:
            return None
        dtypes = sorted({e["dtype"] for e in compact.values()})
        return (f"frozen weights stored in {', '.join(dtypes)} (frozen): {len(compact)} "
                f"variables, {sum(e['bytes'] for e in compact.values()) / 2**20:.1f} MiB "
                "(half their float32 size)")

    def dtypes(self) -> dict[str, str]:
        """Layer path -> adaptive dtype (``"float8"`` or the compute dtype)."""
        return {r["layer"]: r["dtype"] for r in self.rows}

    def _columns(self):
        # The float8 columns only where float8 is a candidate, the loss scale
        # only where float16 is.
        return [c for c in COLUMNS if (c[2] != "float8" or "float8" in self.candidates)
                and (c[2] != "scale" or "float16" in self.candidates)]

    def __str__(self) -> str:
        head = f"policy: {self.policy}"
        if self.candidates:
            head += f", candidates: {', '.join(self.candidates)}"
        columns = self._columns()
        cols = ["layer", "class", "dtype", *(c[1] for c in columns), "switches", "history"]
        lines = [head, "| " + " | ".join(cols) + " |",
                 "| --- | --- | --- |" + " ---: |" * (len(columns) + 1) + " --- |"]
        for r in self.rows:
            stats, measured = r["stats"] or {}, r["measured"]
            history = ", ".join([switch_text(h) for h in r["history"]]
                                + [f"{_RULE_LABELS[rule]} ({rule})"
                                   for rule in r.get("rules", ()) if rule in _RULE_LABELS])
            cells = [r["layer"], r["class"], r["dtype"],
                     *(_cell(stats.get(key) if measured[kind] else None)
                       for key, _, kind, _ in columns),
                     str(r["switches"]), history]
            lines.append("| " + " | ".join(cells) + " |")
        if self._storage_line():
            lines.append(self._storage_line())
        if self.metrics_in_float32:
            lines.append("metrics given float32 predictions (float32_metric): "
                         + ", ".join(self.metrics_in_float32))
        if self.skipped_steps:
            bad = f", {self.bad_data_steps} of them on bad data (a non-finite batch)" \
                if self.bad_data_steps else ""
            lines.append(f"skipped steps (non-finite gradients): {self.skipped_steps}{bad}")
        return "\n".join(lines)

    def legend(self) -> str:
        """What each column means (``n/m``: not measured in the last interval:
        a layer without weights has no gradients, the probe had not run, ...)."""
        rows = [f"- {title}: {text}" for _, title, _, text in self._columns()]
        rows += ["- switches: dtype changes so far, every reason (the history's entries that "
                 "changed the dtype); history: old->new@call (reason)",
                 f"- {NOT_MEASURED}: not measured (no weights, no probe yet, or no statistics "
                 "step since the last decision)",
                 "- " + ", ".join(f"{label} ({rule})" for rule, label in _RULE_LABELS.items())
                 + ", (dtype_mismatch), float32_metric: rules for what breaks Keras's mixed "
                 "precision (docs/when_keras_fails.md):"]
        rows += [f"  - {rule}: {why}" for rule, why in rescue.RULES.items()]
        return "\n".join(rows)


def _computing_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    seen: set[int] = set()
    out = []
    for layer in model._flatten_layers(include_self=False):
        if id(layer) in seen or isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue
        seen.add(id(layer))
        out.append(layer)
    return out


def _storage(layer: keras.layers.Layer, record: dict[str, Any],
             optimizer: Any = None) -> dict[str, Any] | None:
    """Each variable a storage decision was made for: the dtype it is in now
    and its bytes, with the decision's reason and error, and for a weight
    stored in bfloat16 that trains, ``below_half_ulp``: the fraction of its
    last update's elements below half a bfloat16 ulp (what rounding to
    nearest would have lost; :func:`keras_mp.execution.compact_update.statistic`)."""
    decided = record.get("storage")
    if not decided:
        return None
    own = {v.name: v for v in layer._trainable_variables + layer._non_trainable_variables}
    return {name: {**entry, "dtype": storage_vars.stored_dtype(own[name]),
                   "bytes": storage_vars.nbytes(own[name]),
                   "below_half_ulp": None if optimizer is None
                   else compact_update.statistic(optimizer, own[name])}
            for name, entry in decided.items() if name in own}


def precision_report(model: keras.Model) -> PrecisionReport:
    """Reports every layer of ``model`` that computes, in forward order (as
    last observed by the adaptive policy; the model's layer order before).

    Args:
        model: a Keras model; adaptive or not (then only dtypes are shown).

    Returns:
        A :class:`PrecisionReport`; ``print`` it for the table and
        ``print(report.legend())`` for what the columns mean.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model or layer, got {model!r}.")
    policy = policy_of(model) if isinstance(model, keras.Model) else None
    layers = adaptive_layers(model, policy) if policy is not None \
        else _computing_layers(model)
    records = [policy.record(layer.path) if policy is not None else {} for layer in layers]
    order = sorted(range(len(layers)), key=lambda i: (records[i].get("position", i), i))
    optimizer = getattr(model, "optimizer", None)
    optimizer = optimizer_state.inner(optimizer) \
        if isinstance(optimizer, keras.optimizers.Optimizer) else None
    rows = []
    for i in order:
        layer, record = layers[i], records[i]
        state = record.get("state")
        stats = dict(record["stats"]) if record.get("stats") else None
        float8_capable = policy is not None and policy.is_float8(layer.path)
        if stats is not None:
            stats["float8"] = float8_capable
            stats["loss_scale"] = record.get("loss_scale")
        rows.append({
            "layer": layer.path or layer.name,
            "class": type(layer).__name__,
            "dtype": policy.dtype_of(layer.path) if policy is not None else layer.compute_dtype,
            "compute_dtype": layer.compute_dtype,
            "variable_dtype": layer.variable_dtype,
            "stats": stats,
            "measured": _measured(stats),
            "probe": dict(record["probe"]) if record.get("probe") else None,
            "loss_scale": record.get("loss_scale"),
            "state": dict(state) if state else None,
            "switches": dtype_switches(record.get("history", [])),
            "history": [dict(h) for h in record.get("history", [])],
            "rules": list(record.get("rules", [])),
            "storage": _storage(layer, record, optimizer),
        })
    name = policy.name if policy is not None else keras.config.dtype_policy().name
    metrics = tuple(rescue.float32_metrics(model)) if isinstance(model, keras.Model) else ()
    skipped = getattr(getattr(model, "optimizer", None), "skipped_steps", None)
    skipped = None if skipped is None else int(keras.ops.convert_to_numpy(skipped))
    bad = skipping.skipped(model) if isinstance(model, keras.Model) else None
    return PrecisionReport(name, policy.candidates if policy is not None else (), tuple(rows),
                           metrics, skipped, None if bad is None else bad[1])
