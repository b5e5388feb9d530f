"""Argument checks shared by keras-mp's constructors: each raises a
``ValueError`` that names the argument and the allowed values.

Example:
    >>> from keras_mp import _checks
    >>> _checks.fraction("hysteresis", 0.5)
    0.5
    >>> _checks.count("patience", 0, 1)
    Traceback (most recent call last):
    ...
    ValueError: `patience` must be an int >= 1, got 0.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fraction", "positive", "non_negative", "count", "object_or_config"]


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def fraction(name: str, value: Any) -> float:
    """``value`` as a float, if it is a number in [0, 1]."""
    if not _is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}.")
    return float(value)


def positive(name: str, value: Any) -> float:
    """``value`` as a float, if it is a finite number > 0."""
    if not _is_number(value) or not 0 < value < 1e30:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    return float(value)


def non_negative(name: str, value: Any) -> float:
    """``value`` as a float, if it is a finite number >= 0."""
    if not _is_number(value) or not 0 <= value < 1e30:
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    return float(value)


def count(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value``, if it is an int >= ``minimum`` (and <= ``maximum``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"`{name}` must be an int {bound}, got {value!r}.")
    return value


def object_or_config(name: str, value: Any, cls: type, what: str) -> Any:
    """``value`` if it is a ``cls``, ``cls.from_config(value)`` for a dict,
    ``cls()`` for None; ``what`` names ``cls`` in the error."""
    if isinstance(value, dict):
        value = cls.from_config(value)
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"`{name}` must be a {what}, its config dict or None, got {value!r}.")
    return value if value is not None else cls()
