"""Argument checks shared by keras-mp's constructors and functions: each
raises an error whose message names the argument and the allowed values (or
the fix), before any work starts.

Numbers: a NumPy scalar (``np.float32(1024)``, ``np.int64(100)``) counts
wherever a Python number does, as in Keras; a bool never does. The checks
return Python values, so configs stay plain JSON.

Paths: :func:`output_path` and :func:`output_folder` say whether something can
be written there now (the folder exists and takes a file); :func:`keras_file`
whether a file is a whole ``.keras`` archive; :func:`extra` imports an
optional dependency or names the ``pip install "keras-mp[...]"`` that brings it.

Example:
    >>> import numpy as np
    >>> from keras_mp import _checks
    >>> _checks.fraction("hysteresis", 0.5)
    0.5
    >>> _checks.positive("initial_scale", np.float32(1024))
    1024.0
    >>> _checks.count("patience", 0, 1)
    Traceback (most recent call last):
    ...
    ValueError: `patience` must be an int >= 1, got 0.
"""

from __future__ import annotations

import importlib
import numbers
import os
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["is_number", "is_integer", "number", "integer", "integers", "fraction", "positive",
           "non_negative", "count", "object_or_config", "path", "output_path",
           "output_folder", "writable", "keras_file", "extra"]


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and type(value).__name__ != "bool_"


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and is_number(value)


def number(name: str, value: Any) -> float:
    """``value`` as a float, if it is a number (else ``TypeError``)."""
    if not is_number(value):
        raise TypeError(f"`{name}` must be a number, got {value!r} of type "
                        f"{type(value).__name__}.")
    return float(value)


def integer(name: str, value: Any, minimum: int = 1, alternative: str = "") -> int:
    """``value`` as an int, if it is a whole number (``3.0`` included) >=
    ``minimum`` (``TypeError`` for another type, ``ValueError`` below it);
    ``alternative`` ends the type error (``" or a callable"``)."""
    if is_number(value) and not is_integer(value) and float(value).is_integer():
        value = int(value)  # 3.0, as Keras accepts
    if not is_integer(value):
        raise TypeError(f"`{name}` must be an int >= {minimum}{alternative}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}.")
    return int(value)


def integers(name: str, values: Any, minimum: int) -> list[int]:
    """``values`` as a list of ints, if it is a sequence of ints (``TypeError``
    otherwise: a single number, a string); their range is the caller's."""
    try:
        items = None if isinstance(values, (str, bytes)) else list(values)
    except TypeError:
        items = None
    if items is None or not all(is_integer(v) for v in items):
        raise TypeError(f"`{name}` must be a list of ints >= {minimum}, got {values!r}.")
    return [int(v) for v in items]


def fraction(name: str, value: Any) -> float:
    """``value`` as a float, if it is a number in [0, 1]."""
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}.")
    return float(value)


def positive(name: str, value: Any) -> float:
    """``value`` as a float, if it is a finite number > 0."""
    if not is_number(value) or not 0 < value < 1e30:
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    return float(value)


def non_negative(name: str, value: Any) -> float:
    """``value`` as a float, if it is a finite number >= 0."""
    if not is_number(value) or not 0 <= value < 1e30:
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
    return float(value)


def count(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int, if it is an int >= ``minimum`` (and <= ``maximum``)."""
    if not is_integer(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"`{name}` must be an int {bound}, got {value!r}.")
    return int(value)


def object_or_config(name: str, value: Any, cls: type, what: str) -> Any:
    """``value`` if it is a ``cls``, ``cls.from_config(value)`` for a dict,
    ``cls()`` for None; ``what`` names ``cls`` in the error."""
    if isinstance(value, dict):
        value = cls.from_config(value)
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"`{name}` must be a {what}, its config dict or None, got {value!r}.")
    return value if value is not None else cls()


# -- paths ---------------------------------------------------------------------

def path(name: str, value: Any) -> str:
    """``value`` as a str, if it is a non-empty str or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"`{name}` must be a file or folder path (a str or os.PathLike), "
                        f"got {value!r}.")
    return os.fspath(value)


def writable(name: str, folder: str) -> None:
    """Raises ``ValueError`` naming ``name`` unless a file can be made in
    ``folder`` now (tried: a hidden file made and removed, which also catches
    read-only file systems, ``/proc`` and a root user's ``os.access``)."""
    try:
        handle, probe = tempfile.mkstemp(prefix=".keras_mp_probe_", dir=folder)
    except OSError as e:
        raise ValueError(f"`{name}`: cannot write in {folder!r} ({e.strerror or e}): give a "
                         "folder you can write to.") from None
    os.close(handle)
    os.remove(probe)


def _parent(name: str, target: str) -> str:
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(parent):
        what = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"`{name}` {target!r}: its folder {parent!r} {what}; create the "
                         "folder first or give another path.")
    return parent


def output_path(name: str, value: Any, *, suffixes: Sequence[str] = (), what: str = "") -> str:
    """``value`` as a str, if a file can be written there now: a path (not a
    folder) in an existing, writable folder, ending in one of ``suffixes``
    (any case; none given: any ending). An existing file there is replaced.
    ``what`` (e.g. ``" for format='litert'"``) ends the suffix error."""
    target = path(name, value)
    if os.path.isdir(target):
        raise ValueError(f"`{name}` {target!r} is a folder; give the path of a file "
                         "to write.")
    if suffixes and not target.lower().endswith(tuple(s.lower() for s in suffixes)):
        shown = " or ".join(suffixes) if len(suffixes) <= 3 else \
            ", ".join(suffixes[:5]) + ", ..."
        raise ValueError(f"`{name}` must end in {shown}{what}, got {target!r}.")
    writable(name, _parent(name, target))
    return target


def output_folder(name: str, value: Any, *,
                  replaceable: Callable[[str], bool] | None = None, what: str = "") -> str:
    """``value`` as a str, if a folder can be written there now: a new
    folder in an existing, writable one, an empty folder, or a folder
    ``replaceable(folder)`` accepts (e.g. an earlier SavedModel); never an
    existing file, nor a folder holding other files (they would be mixed
    with what is written). ``what`` names what is written (``"a SavedModel"``)."""
    target = path(name, value)
    what = what or "the output"
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"`{name}` {target!r} is an existing file; {what} is written as a "
                         "folder: give a new or empty folder.")
    if os.path.isdir(target):
        held = sorted(os.listdir(target))
        if held and not (replaceable is not None and replaceable(target)):
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise ValueError(f"`{name}` {target!r} is a folder holding other files ({shown}); "
                             f"{what} would be written among them: give a new or empty "
                             "folder.")
        writable(name, target)
    else:
        writable(name, _parent(name, target))
    return target


def keras_file(name: str, value: Any) -> str:
    """``value`` as a str, if it is an existing, whole ``.keras`` file (a zip
    archive holding ``config.json``); a truncated or torn file is named as
    such (Keras itself says "File not found" for one)."""
    source = path(name, value)
    if not os.path.exists(source):
        raise ValueError(f"`{name}` {source!r} does not exist.")
    if os.path.isdir(source) or not source.lower().endswith(".keras"):
        raise ValueError(f"`{name}` must be a .keras file (what model.save writes), got "
                         f"{source!r}.")
    try:
        with zipfile.ZipFile(source) as archive:
            whole = "config.json" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        whole = False
    if not whole:
        raise ValueError(f"`{name}` {source!r} is not a whole .keras file: it is truncated or "
                         "damaged (an interrupted save or copy?), or not a Keras archive; "
                         "save the model again.")
    return source


def extra(modules: Sequence[str], extra_name: str, needed_for: str) -> list[Any]:
    """The ``modules``, imported, or ``ImportError`` naming the missing ones
    and ``pip install "keras-mp[extra_name]"``, which installs them."""
    found, missing = [], []
    for module in modules:
        try:
            found.append(importlib.import_module(module))
        except ImportError:
            missing.append(module.split(".")[0])
    missing = list(dict.fromkeys(missing))
    if missing:
        raise ImportError(f"{needed_for} needs {', '.join(missing)}, not installed: "
                          f'pip install "keras-mp[{extra_name}]".')
    return found

