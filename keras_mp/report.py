"""``precision_report(model)``: every layer's dtype, key statistics and
switch history, as a table and as data.

Example:
    >>> import keras, keras_mp
    >>> keras_mp.set_global_policy("adaptive_bfloat16")
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> r = keras_mp.precision_report(model)
    >>> r.rows[0]["compute_dtype"], r.rows[0]["switches"]
    ('bfloat16', 0)
    >>> lines = str(r).splitlines()
    >>> lines[0]
    'policy: adaptive_bfloat16, candidates: bfloat16, float32'
    >>> lines[1].split(" | ")[:4]
    ['| layer', 'class', 'dtype', 'nonfinite']
    >>> keras_mp.set_global_policy("float32")
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_mp import policies

__all__ = ["PrecisionReport", "precision_report"]

_STAT_COLUMNS = (("nonfinite", "nonfinite"), ("amax", "amax"), ("fp16_subnormal", "fp16 sub"),
                 ("fp16_overflow", "fp16 ovf"), ("bf16_subnormal", "bf16 sub"), ("zero", "zero"))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """A model's precision, layer by layer.

    Attributes:
        policy: the policy's name (the global policy's when no layer is adaptive).
        candidates: the adaptive candidates, or ``()``.
        rows: one dict per layer with trainable variables: ``layer`` (path),
            ``class``, ``compute_dtype``, ``variable_dtype``, ``stats`` (the
            last interval's statistics, or None), ``state`` (the controller's,
            or None), ``switches`` and ``history`` (list of switch dicts).
    """

    policy: str
    candidates: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        """The structured form (JSON-serializable)."""
        return {"policy": self.policy, "candidates": list(self.candidates),
                "layers": [dict(r) for r in self.rows]}

    def dtypes(self) -> dict[str, str]:
        """Layer path -> compute dtype."""
        return {r["layer"]: r["compute_dtype"] for r in self.rows}

    def __str__(self) -> str:
        head = f"policy: {self.policy}"
        if self.candidates:
            head += f", candidates: {', '.join(self.candidates)}"
        cols = ["layer", "class", "dtype", *(t for _, t in _STAT_COLUMNS), "switches", "history"]
        lines = [head, "| " + " | ".join(cols) + " |",
                 "| --- | --- | --- |" + " ---: |" * (len(_STAT_COLUMNS) + 1) + " --- |"]
        for r in self.rows:
            stats = r["stats"] or {}
            history = ", ".join(f"{h['old']}->{h['new']}@{h['step']} ({h['reason']})"
                                for h in r["history"])
            cells = [r["layer"], r["class"], r["compute_dtype"],
                     *(_cell(stats.get(k)) for k, _ in _STAT_COLUMNS),
                     str(r["switches"]), history]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def precision_report(model: keras.Model) -> PrecisionReport:
    """Reports every layer of ``model`` that has trainable variables.

    Args:
        model: a Keras model; adaptive or not (then only dtypes are shown).

    Returns:
        A :class:`PrecisionReport`; ``print`` it for the table.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"`model` must be a Keras model or layer, got {model!r}.")
    policy = policies.policy_of(model) if isinstance(model, keras.Model) else None
    rows = []
    seen: set[int] = set()
    for layer in model._flatten_layers(include_self=False):
        if id(layer) in seen or not layer._trainable_variables:
            continue
        seen.add(id(layer))
        record = policy.record(layer.path) if policy is not None and \
            layer._dtype_policy is policy else {}
        state = record.get("state")
        rows.append({
            "layer": layer.path,
            "class": type(layer).__name__,
            "compute_dtype": layer.compute_dtype,
            "variable_dtype": layer.variable_dtype,
            "stats": dict(record["stats"]) if record.get("stats") else None,
            "state": dict(state) if state else None,
            "switches": int(state["switches"]) if state else 0,
            "history": [dict(h) for h in record.get("history", [])],
        })
    name = policy.name if policy is not None else policies.global_policy().name
    return PrecisionReport(name, policy.candidates if policy is not None else (), tuple(rows))
