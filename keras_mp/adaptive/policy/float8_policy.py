"""The float8 entries of an adaptive policy: :class:`Float8Policy` (Keras's
float8 policy with an on/off switch and the recipe) and :class:`Float8Recipe`
(delayed-scaling knobs, after Transformer Engine's names).

Plain values, no model in sight: :class:`keras_mp.AdaptivePolicy` holds them,
and :mod:`keras_mp.adaptive.evidence.float8` (which operates on models) makes layers
float8-capable and runs their float8 calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
from keras.dtype_policies import QuantizedFloat8DTypePolicy

from keras_mp import _checks as checks

__all__ = ["Float8Recipe", "Float8Policy"]

_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How float8 scales are computed (delayed scaling), per Transformer
    Engine's ``DelayedScaling`` names.

    Args:
        margin: scales leave ``2**margin`` headroom: the amax maps to the
            format's largest value divided by ``2**margin`` (TE ``margin``;
            Keras: 0, not exposed).
        amax_history_length: amaxes remembered per tensor (TE
            ``amax_history_len``; Keras's ``amax_history_length``).
        amax_compute_algo: ``"max"``, the largest amax in the history (Keras,
            TE's default), or ``"most_recent"`` (TE ``amax_compute_algo``).

    Example:
        >>> Float8Recipe(margin=1).get_config()
        {'margin': 1, 'amax_history_length': 1024, 'amax_compute_algo': 'max'}
    """

    margin: int = 0
    amax_history_length: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self):
        object.__setattr__(self, "margin", checks.count("margin", self.margin, 0, 16))
        object.__setattr__(self, "amax_history_length",
                           checks.count("amax_history_length", self.amax_history_length, 1))
        if self.amax_compute_algo not in _ALGOS:
            raise ValueError(f"`amax_compute_algo` must be one of {_ALGOS}, got "
                             f"{self.amax_compute_algo!r}.")

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Float8Recipe:
        return cls(**config)


@keras.saving.register_keras_serializable(package="keras_mp")
class Float8Policy(QuantizedFloat8DTypePolicy):
    """Keras's float8 policy with an on/off switch and the recipe (see the
    module docstring). Immutable: a switch replaces the entry.

    Args:
        mode: ``"float8"``.
        source_name: the float policy it computes in: ``"mixed_bfloat16"``,
            ``"mixed_float16"`` or ``"float32"``.
        amax_history_length: as in :class:`Float8Recipe`.
        active: whether the layer trains in float8 now (False: it computes
            in the source dtype, unquantized).
        margin, amax_compute_algo: as in :class:`Float8Recipe`.

    Example:
        >>> p = Float8Policy(source_name="mixed_bfloat16", active=False)
        >>> p.name, p.compute_dtype, p.quantization_mode, p.active
        ('float8_from_mixed_bfloat16', 'bfloat16', 'float8', False)
        >>> Float8Policy.from_config(p.get_config()) == p
        True
    """

    def __init__(self, mode: str = "float8", source_name: str | None = None,
                 amax_history_length: int = 1024, *, active: bool = True, margin: int = 0,
                 amax_compute_algo: str = "max"):
        if mode != "float8":
            raise ValueError(f"`mode` must be 'float8', got {mode!r}.")
        if source_name not in ("mixed_bfloat16", "mixed_float16", "float32"):
            raise ValueError("`source_name` must be one of ('mixed_bfloat16', "
                             f"'mixed_float16', 'float32'), got {source_name!r}.")
        if not isinstance(active, bool):
            raise TypeError(f"`active` must be True or False, got {active!r}.")
        self.recipe = Float8Recipe(margin, amax_history_length, amax_compute_algo)
        super().__init__(mode, source_name, amax_history_length)
        self.active = active

    @property
    def margin(self) -> int:
        return self.recipe.margin

    @property
    def amax_compute_algo(self) -> str:
        return self.recipe.amax_compute_algo

    def switched(self, source_name: str, active: bool) -> Float8Policy:
        """A copy computing in ``source_name``, active or not."""
        return Float8Policy(source_name=source_name, active=active,
                            **self.recipe.get_config())

    def __eq__(self, other):
        return isinstance(other, Float8Policy) and super().__eq__(other) \
            and self.active == other.active and self.recipe == other.recipe

    def __hash__(self):
        return hash((self.name, self.active, self.recipe))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update({"active": self.active, "margin": self.margin,
                       "amax_compute_algo": self.amax_compute_algo})
        return config

    def __repr__(self) -> str:
        return f"<Float8Policy {self.name!r} active={self.active}>"
