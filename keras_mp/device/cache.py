"""What keras_mp's start-up measures, kept on disk across processes.

keras_mp measures, once per process, what this machine runs fast (the
device profile of :mod:`keras_mp.device.capabilities`, whether XLA runs,
graph against XLA matmuls and epilogues, :mod:`keras_mp.execution.placement`)
and, per model, which execution mode its train step runs fastest in (the
execution trial, :mod:`keras_mp.execution.step_trial`). On a 2-core AMD EPYC
that start-up took 4-10 s of a fit of the keras-io "customizing fit" model
(``Dense(1)`` on 32 features, 3 epochs), whose Keras fit took 1.4 s. This
module keeps those results in one JSON file, keyed by the device (the CPU's
model name and the flags keras_mp reads, the GPU's name, the thread count)
and by the TensorFlow, Keras and keras_mp versions, so that a later process
on the same machine reads them back instead of measuring.

Where: ``$KERAS_MP_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/keras_mp``,
else ``~/.cache/keras_mp``; the file is ``measurements.json``. Set
``KERAS_MP_CACHE_DIR=off`` (or ``0``, ``false``, ``no``) to measure in every
process and write nothing. Deleting the file measures again. A file that
cannot be read or written is ignored (the measurements are then kept in
this process only).

Example:
    >>> import os, tempfile
    >>> from keras_mp.device import cache
    >>> os.environ["KERAS_MP_CACHE_DIR"] = tempfile.mkdtemp()
    >>> cache.put("example", "answer", 42)
    >>> cache.get("example", "answer")
    42
    >>> os.environ["KERAS_MP_CACHE_DIR"] = "off"
    >>> cache.directory() is None, cache.get("example", "answer")
    (True, None)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import Any

from keras_mp._atomic import atomic_path
from keras_mp.device import _cpuinfo

__all__ = ["ENV_VAR", "FILE", "directory", "device_key", "get", "put"]

#: The environment variable naming the cache's directory (``off`` disables it).
ENV_VAR = "KERAS_MP_CACHE_DIR"
#: The file in that directory.
FILE = "measurements.json"
_OFF = ("off", "0", "false", "no", "none")
_lock = threading.Lock()
_keys: dict[str, str] = {}
_memo: dict[tuple[str, str, str, str], Any] = {}  # (file, device, section, key): this process's
_log = logging.getLogger("keras_mp")


def directory() -> str | None:
    """The cache's directory, or None where ``KERAS_MP_CACHE_DIR`` turns it off."""
    value = os.environ.get(ENV_VAR)
    if value is not None:
        return None if value.strip().lower() in _OFF else os.path.expanduser(value)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "keras_mp")


def device_key(device_type: str | None = None) -> str:
    """What identifies this machine's measurements: the device (CPU model
    and flags, or the GPU's name), the cores TensorFlow may use, and the
    TensorFlow, Keras and keras_mp versions, hashed.

    >>> device_key("CPU") == device_key("CPU") != device_key("GPU")
    True
    """
    from keras_mp.device import xla

    device_type = device_type or xla.current_device_type()
    if device_type not in xla.DEVICE_TYPES:
        raise ValueError(f"`device_type` must be one of {xla.DEVICE_TYPES} or None, got "
                         f"{device_type!r}.")
    with _lock:
        if device_type in _keys:
            return _keys[device_type]
    import keras
    import tensorflow as tf

    from keras_mp import _version

    parts = [device_type, tf.__version__, keras.__version__, _version.__version__,
             str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count()),
             *_cpu_lines()]
    if device_type == "GPU":
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            parts.append(str(tf.config.experimental.get_device_details(gpus[0])))
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    with _lock:
        _keys[device_type] = key
    return key


def _cpu_lines() -> list[str]:
    """The CPU's model name and flags (``/proc/cpuinfo``'s first ones)."""
    found = _cpuinfo.fields()
    if not found:
        import platform
        return [platform.processor(), ""]
    return [found.get("model name", ""), found.get("flags", "")]


def _path() -> str | None:
    folder = directory()
    return None if folder is None else os.path.join(folder, FILE)


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def get(section: str, key: str, device_type: str | None = None) -> Any:
    """The value kept for ``key`` in ``section`` for this device (by this
    process, or on disk), or None (none kept, or the cache is off)."""
    path = _path()
    if path is None:
        return None
    dev = device_key(device_type)
    with _lock:
        if (path, dev, section, key) in _memo:
            return _memo[(path, dev, section, key)]
    entry = _read(path).get(dev, {})
    section_entry = entry.get(section, {}) if isinstance(entry, dict) else {}
    return section_entry.get(key) if isinstance(section_entry, dict) else None


def put(section: str, key: str, value: Any, device_type: str | None = None) -> None:
    """Keeps ``value`` (JSON-serializable) for ``key`` in ``section`` for
    this device; nothing where the cache is off or cannot be written."""
    path = _path()
    if path is None:
        return
    dev = device_key(device_type)
    with _lock:
        _memo[(path, dev, section, key)] = value
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = _read(path)  # what other processes wrote meanwhile stays
            data.setdefault(dev, {}).setdefault(section, {})[key] = value
            with atomic_path(path) as tmp:  # other processes read it whole or not at all
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(data, f)
        except (OSError, TypeError, ValueError) as e:
            _log.info("keras_mp: could not write the measurement cache %s (%s).", path, e)
