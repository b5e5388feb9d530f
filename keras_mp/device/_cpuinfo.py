"""``/proc/cpuinfo``, read in one place, or the CPU class keras-mp is told to decide as.

What keras-mp knows of the CPU (its 16-bit units for :mod:`capabilities` and
:mod:`xla`, its name for the measurement cache's key and ``keras-mp info``)
comes from here. CI's CPU changes between runs, and what ``"adaptive"`` means
changes with it, so any machine can decide as another CPU class:

* ``KERAS_MP_CPU_CLASS=avx2`` (or ``avx512_bf16``, ``amx_bf16``, :data:`CLASSES`)
  makes keras-mp read that class's flags instead of this CPU's: its
  *decisions* (``"adaptive"``'s candidates, where matmuls run, what the
  bench's ``keras_mp`` variant does) are that class's. The CPU's name gets
  ``(decisions of class ...)`` added, so measurements kept on disk are kept
  apart.
* the *kernels* are still this machine's: oneDNN and XLA use every unit this
  CPU has. Cap them as well, in the environment before Python starts
  (TensorFlow reads them once): ``ONEDNN_MAX_CPU_ISA`` and
  ``XLA_FLAGS=--xla_cpu_max_isa=...``; :func:`kernel_caps` gives the values for
  a class, and ``keras-mp info`` and the bench print both ("decisions of class
  X on hardware Y, kernels capped to Z").

Emulation works downward only: a CPU cannot run units it lacks (told
``amx_bf16`` on an AVX2-only machine, keras-mp decides as with AMX while
TensorFlow emulates bfloat16, slowly). The tests set the class with
``KERAS_MP_TEST_CPU_FLAGS`` (tests/conftest.py), through the same variable.

Example:
    >>> fields("processor : 0\\nflags : avx2\\n\\nprocessor : 1\\nflags : fpu\\n")
    {'processor': '0', 'flags': 'avx2'}
    >>> kernel_caps("avx2")
    {'ONEDNN_MAX_CPU_ISA': 'AVX2', 'XLA_FLAGS': '--xla_cpu_max_isa=AVX2'}
"""

from __future__ import annotations

import os

#: The file read when no text is given.
PATH = "/proc/cpuinfo"
#: The environment variable naming the CPU class keras-mp decides as.
ENV_VAR = "KERAS_MP_CPU_CLASS"
#: CPU class -> (its flags, oneDNN's ISA cap, XLA:CPU's ISA cap).
CLASSES: dict[str, tuple[str, str, str]] = {
    "avx2": ("fpu sse sse2 avx avx2 fma", "AVX2", "AVX2"),
    "avx512_bf16": ("fpu sse sse2 avx avx2 fma avx512f avx512_bf16", "AVX512_CORE_BF16",
                    "AVX512_BF16"),
    "amx_bf16": ("fpu sse sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile",
                 "AVX512_CORE_AMX", "AMX"),
}


def cpu_class() -> str | None:
    """The class named by ``KERAS_MP_CPU_CLASS``, or None (this CPU's own).

    Raises:
        ValueError: the variable names no class of :data:`CLASSES`.
    """
    name = os.environ.get(ENV_VAR, "").strip().lower()
    if not name:
        return None
    if name not in CLASSES:
        raise ValueError(f"{ENV_VAR} must be one of {sorted(CLASSES)} (or unset), got {name!r}.")
    return name


def kernel_caps(name: str) -> dict[str, str]:
    """The environment that caps oneDNN's and XLA:CPU's kernels to class ``name``."""
    if name not in CLASSES:
        raise ValueError(f"`name` must be one of {sorted(CLASSES)}, got {name!r}.")
    _, onednn, xla = CLASSES[name]
    return {"ONEDNN_MAX_CPU_ISA": onednn, "XLA_FLAGS": f"--xla_cpu_max_isa={xla}"}


def _read(text: str | None) -> dict[str, str]:
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


def fields(text: str | None = None) -> dict[str, str]:
    """The first value of each field of ``text`` (``/proc/cpuinfo``'s when
    None): the first processor's model name and flags, or with
    ``KERAS_MP_CPU_CLASS`` set (and ``text`` None) that class's flags. Empty
    where the file cannot be read (not Linux)."""
    found = _read(text)
    name = cpu_class() if text is None else None
    if name is not None:
        found = {**found, "flags": CLASSES[name][0],
                 "model name": f"{found.get('model name', 'CPU')} (decisions of class {name})"}
    return found


def describe() -> str:
    """One line for ``keras-mp info`` and the bench: whose decisions, on what
    hardware, with which kernel caps.

    Example:
        >>> describe().startswith("decisions of ")
        True
    """
    real = _read(None).get("model name", "unknown CPU")
    name = cpu_class()
    caps = ", ".join(f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "XLA_FLAGS")
                     if os.environ.get(k))
    whose = f"class {name}" if name else "this CPU"
    return f"decisions of {whose} on {real}; kernels " + (f"capped: {caps}" if caps else
                                                        "uncapped (every unit this CPU has)")
