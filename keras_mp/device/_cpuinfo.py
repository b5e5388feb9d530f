"""``/proc/cpuinfo``, read in one place.

What keras-mp knows of the CPU (its 16-bit units for :mod:`capabilities` and
:mod:`xla`, its name for the measurement cache's key and ``keras-mp info``)
comes from here. The tests point :data:`PATH` at another CPU's flags
(``KERAS_MP_TEST_CPU_FLAGS`` in tests/conftest.py): CI's CPU changes between
runs, and what ``"adaptive"`` means changes with it.

Example:
    >>> fields("processor : 0\\nflags : avx2\\n\\nprocessor : 1\\nflags : fpu\\n")
    {'processor': '0', 'flags': 'avx2'}
"""

from __future__ import annotations

#: The file read when no text is given.
PATH = "/proc/cpuinfo"


def fields(text: str | None = None) -> dict[str, str]:
    """The first value of each field of ``text`` (``/proc/cpuinfo``'s when
    None): the first processor's model name and flags. Empty where the file
    cannot be read (not Linux)."""
    if text is None:
        try:
            with open(PATH, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return {}
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            found.setdefault(key.strip(), value.strip())
        elif found and not line.strip():
            break  # the first processor's block ends (the file repeats it per core)
    return found
