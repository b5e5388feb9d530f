"""How much memory this process and TensorFlow's allocator hold, read cheaply.

What keras-mp's own machinery may add to a training run's memory is judged
against these figures (:mod:`keras_mp.execution.step_trial` skips a mode
whose memory would not fit): on CPU, the process's resident size (Linux
``/proc/self/statm``), because TensorFlow's CPU allocator keeps every region
it grew (a BFC allocator: it never hands memory back) and XLA's compiled
code lives outside it; on a GPU, the peak of TensorFlow's device allocator.
TensorFlow's allocator figures come from
``tf.config.experimental.get_memory_info``, which works on CPU too where the
allocator keeps statistics (TensorFlow's oneDNN CPU allocator does).

Measured on a 2-core AMD EPYC (TF 2.21, 2-block Transformer, T=256, d=512,
batch 64, bfloat16; ``python -m benchmarks.transformer_memory``): a train
step's tensors peaked at 1.6-1.9 GB in the allocator while the process held
2.9 GB; the whole step compiled by XLA beside it added 2.1 GB of resident
memory, which the process never gave back.

Tracing and compiling a train function (TensorFlow's graph optimisation,
its kernels, XLA's compilation) mallocs memory and frees most of it again,
but glibc's allocator keeps the freed pages resident: keras-mp traces more
train functions than Keras (the execution trial's modes, the statistics and
probe steps), and each first call left 90-140 MiB of free heap in the
process, which the next step's tensors then came on top of. So keras-mp
hands those pages back (:func:`release_free_heap`, glibc's
``malloc_trim``) after each first call of a train function it made
(:func:`after_trace`, :func:`released_after_first_call`), and first hands
the trace's custom gradients over to its graph (:mod:`keras_mp._gradients`),
so that a trace keras-mp drops later is freed. Same Transformer, ``fit`` for 2 x 10
steps with a statistics step at call 15 or 20, each process beside another:
peak 3614-3740 MiB with the release, 3780-3956 without (Keras
``mixed_bfloat16``: 3465-3563).

Example:
    >>> from keras_mp.device import memory
    >>> rss = memory.process_rss()
    >>> rss is None or rss > 0
    True
    >>> memory.step_device() in ("CPU:0", "GPU:0")
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from keras_mp import _gradients

__all__ = ["process_rss", "process_peak_rss", "allocator", "reset_peak", "step_device",
           "footprint", "release_free_heap", "after_trace", "released_after_first_call"]


def process_rss() -> int | None:
    """This process's resident memory now, in bytes (None where unknown)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def process_peak_rss() -> int | None:
    """This process's peak resident memory so far (Linux ``VmHWM``), in
    bytes (None where unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def step_device() -> str:
    """The device a train step's tensors live on: ``"GPU:0"`` where a GPU
    is visible, else ``"CPU:0"``."""
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def _check_device(device) -> None:
    if device is not None and not isinstance(device, str):
        raise TypeError(f"`device` must be a device name such as 'CPU:0' or None, got "
                        f"{device!r}.")


def allocator(device: str | None = None) -> tuple[int, int] | None:
    """``(current, peak)`` bytes of TensorFlow's allocator on ``device``
    (:func:`step_device` when None), or None where it keeps no statistics.

    The peak is the allocator's since the process started or since the
    last :func:`reset_peak`.
    """
    _check_device(device)
    try:
        info = tf.config.experimental.get_memory_info(device or step_device())
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    return int(info["current"]), int(info["peak"])


def reset_peak(device: str | None = None) -> bool:
    """Starts the allocator's peak on ``device`` afresh (what ``(peak -
    current before)`` then measures is one call's own); False where the
    allocator keeps no statistics."""
    _check_device(device)
    try:
        tf.config.experimental.reset_memory_stats(device or step_device())
    except (ValueError, RuntimeError, tf.errors.OpError):
        return False
    return True


def footprint(device: str | None = None) -> int | None:
    """What this run's memory is measured against, in bytes: the process's
    resident size on CPU, the allocator's peak on a GPU (None where unknown)."""
    _check_device(device)
    device = device or step_device()
    if device.upper().startswith("CPU"):
        return process_rss()
    stats = allocator(device)
    return None if stats is None else stats[1]


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def release_free_heap() -> bool:
    """Hands the C heap's free pages back to the system (glibc's
    ``malloc_trim(0)``); False where the C library has no such call.

    >>> release_free_heap() in (True, False)
    True
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def after_trace() -> bool:
    """What follows a function's trace (its first call): the custom gradients
    it registered go with its graph (:func:`keras_mp._gradients.adopt`), then
    :func:`release_free_heap`.

    >>> after_trace() in (True, False)
    True
    """
    _gradients.adopt()
    return release_free_heap()


def released_after_first_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, calling :func:`after_trace` once, after its first call
    returns (a new train function traces and compiles on its first call).

    >>> calls = []
    >>> f = released_after_first_call(lambda x: calls.append(x) or x)
    >>> f(1), f(2), calls
    (1, 2, [1, 2])
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
    first = [True]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        if first[0]:
            first[0] = False
            after_trace()
        return out
    return call
