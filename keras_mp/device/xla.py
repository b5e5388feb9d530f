"""The one place that decides which work runs under XLA, on which device.

Measured on a 2-core Xeon with AMX-BF16 (``keras-mp info``): XLA:CPU does
not use AMX, so a bfloat16 matmul runs at ~210 GFLOP/s under XLA against
~720 through TensorFlow/oneDNN, while elementwise and reduction work in
bfloat16 runs ~3x faster under XLA than as a TF graph. Hence, on such a CPU,
matmuls and convolutions stay outside XLA, everything elementwise or
reducing around them is compiled.

On a CPU without bfloat16 matmul hardware (no AMX-BF16, no AVX512-BF16; e.g.
an AVX2-only AMD EPYC) the balance flips: TensorFlow's own bfloat16 einsum
and batched-matmul kernels are emulated and slow (a 8x128x512 -> 8x128x8x64
projection fwd+bwd: ~500 ms as a TF graph, ~16 ms under XLA, which computes
bfloat16 dots in float32), so there matmuls are compiled too
(``python -m benchmarks.transformer_step``, docs/fused_kernels.md).
On GPU/TPU XLA handles both well.

The multi-tensor loss-scale kernels (:mod:`keras_mp.scaling.kernels`, one computation
over a whole gradient list) are a third kind. On GPU/TPU they replace
hundreds of kernel launches with one. On CPU there are no launches to save:
XLA:CPU runs the per-tensor pieces one after another, while TensorFlow's
executor spreads the same per-tensor ops over the cores, and the compiled
kernel measured 0.65-0.75x the speed of a per-tensor loop on a 200-tensor
list (``python -m benchmarks.unscale_multi_tensor``, 2-core AMD EPYC). So on
CPU they run as one TensorFlow graph.

Where the matmuls of fused layers run on CPU is first read from the CPU
flags, then replaced by a measurement (graph against XLA matmul throughput in
the model's narrowest compute dtype) when
:func:`keras_mp.execution.configure` runs, which the ``AdaptivePrecision``
callback does. Users override the decision per kind of work with
:func:`set_xla`.

A fourth decision concerns the fused ``Dense`` where its matmul stays
outside XLA: whether its epilogue (bias + activation) is one XLA kernel or
plain TensorFlow ops, which TensorFlow's graph optimizer fuses into oneDNN's
matmul (``_FusedMatMul`` with BiasAdd and Relu/Tanh...). Measured on the AMX
Xeon (3 bfloat16 ``Dense(1024)`` layers on 256 rows, forward, backward and
update, CPU time against Keras's ``Dense``): the XLA epilogue ran at 0.75x
for ``relu``, 0.77x for ``linear``, 0.79x for ``tanh``, 1.02x for ``silu``
and 1.31x for exact ``gelu`` (which oneDNN does not fuse). So by default on
such CPUs the epilogue of ``linear``, ``relu`` and ``tanh`` is left to
TensorFlow (:func:`fuses_epilogue`), and :func:`keras_mp.execution.configure`
replaces that default by a measurement for the activations the model uses.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar

import tensorflow as tf

from keras_mp.device import _cpuinfo

__all__ = ["Kind", "set_xla", "forced", "uses_xla", "disabled", "jit", "xla_available",
           "record_available", "cpu_has_bf16_matmul", "set_measured_default", "fuses_epilogue",
           "set_measured_epilogue", "memory_maps"]

Kind = Literal["elementwise", "matmul", "multi_tensor"]
KINDS: tuple[str, ...] = ("elementwise", "matmul", "multi_tensor")
DEVICE_TYPES: tuple[str, ...] = ("CPU", "GPU", "TPU")

# device type -> kind -> compiled by default? (CPU matmuls: see _default)
_DEFAULTS: dict[str, dict[str, bool]] = {
    "CPU": {"elementwise": True, "matmul": False, "multi_tensor": False},
    "GPU": {"elementwise": True, "matmul": True, "multi_tensor": True},
    "TPU": {"elementwise": True, "matmul": True, "multi_tensor": True},
}
_overrides: dict[str, bool] = {}
_measured: dict[tuple[str, str], bool] = {}  # (kind, device type) -> measured default
_available: dict[str, bool] = {}
_lock = threading.Lock()
_local = threading.local()  # .disabled: depth of disabled() scopes in this thread
_log = logging.getLogger("keras_mp")

F = TypeVar("F", bound=Callable)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}, got {kind!r}.")


def set_xla(kind: Kind, enabled: bool | None) -> None:
    """Forces XLA on or off for one kind of work, on every device.

    Args:
        kind: ``"elementwise"`` (the fused kernels around matmuls),
            ``"matmul"`` (matmuls inside fused layers) or ``"multi_tensor"``
            (the loss-scale kernels over a whole gradient list).
        enabled: ``True`` or ``False`` to force, ``None`` to return to the
            device's default.

    Example:
        >>> import keras_mp
        >>> keras_mp.config.set_xla("elementwise", False)   # run reference ops
        >>> keras_mp.config.uses_xla("elementwise")
        False
        >>> keras_mp.config.set_xla("elementwise", None)    # back to the default
    """
    _check_kind(kind)
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be True, False or None, got {enabled!r}.")
    with _lock:
        if enabled is None:
            _overrides.pop(kind, None)
        else:
            _overrides[kind] = enabled


def forced(kind: Kind) -> bool | None:
    """What :func:`set_xla` forces for ``kind``: True, False, or None where
    the device's default (or a measurement) decides.

    Example:
        >>> from keras_mp.device import xla
        >>> xla.set_xla("matmul", True); xla.forced("matmul")
        True
        >>> xla.set_xla("matmul", None); xla.forced("matmul") is None
        True
    """
    _check_kind(kind)
    with _lock:
        return _overrides.get(kind)


_BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AMX-BF16 or
    AVX512-BF16), which oneDNN uses and XLA:CPU does not.

    Read from ``/proc/cpuinfo``; where that is missing (not Linux) the
    answer is True, which keeps matmuls with TensorFlow's libraries, the
    choice that is never far off there.
    """
    flags = _cpuinfo.fields().get("flags")
    if flags is None:
        return True
    return any(flag in flags.split() for flag in _BF16_MATMUL_FLAGS)


def set_measured_default(kind: Kind, device_type: str, enabled: bool) -> None:
    """Records a measured default for ``kind`` on ``device_type`` (used by
    :mod:`keras_mp.execution`); :func:`set_xla` still overrides it."""
    _check_kind(kind)
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"`device_type` must be one of {DEVICE_TYPES}, got {device_type!r}.")
    if not isinstance(enabled, bool):
        raise TypeError(f"`enabled` must be True or False, got {enabled!r}.")
    with _lock:
        _measured[(kind, device_type)] = enabled


def _default(kind: str, device_type: str) -> bool:
    if (kind, device_type) in _measured:
        return _measured[(kind, device_type)]
    if device_type == "CPU" and kind == "matmul":
        return not cpu_has_bf16_matmul()
    return _DEFAULTS.get(device_type, _DEFAULTS["CPU"])[kind]


#: Activations whose epilogue oneDNN fuses into the matmul better than a
#: separate XLA kernel does (the measured default on CPUs where matmuls stay
#: outside XLA; see the module docstring).
_ONEDNN_EPILOGUES = ("linear", "relu", "tanh")
#: The epilogue kernels' activation names (:func:`keras_mp.fused.ops.bias_activation`).
EPILOGUE_ACTIVATIONS: tuple[str, ...] = ("linear", "relu", "gelu", "gelu_tanh", "silu", "tanh")
_epilogues: dict[tuple[str, str], bool] = {}  # (activation, device type) -> fused, measured


def _check_activation(activation: str) -> None:
    if activation not in EPILOGUE_ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {EPILOGUE_ACTIVATIONS}, got "
                         f"{activation!r}.")


def fuses_epilogue(activation: str, device_type: str | None = None) -> bool:
    """Whether a fused ``Dense`` whose matmul runs outside XLA computes
    ``activation(x @ kernel + bias)``'s epilogue as one XLA kernel (True) or
    as TensorFlow ops that TensorFlow fuses into the matmul (False).

    Args:
        activation: the kernel's name: ``"linear"``, ``"relu"``, ``"gelu"``,
            ``"gelu_tanh"``, ``"silu"`` or ``"tanh"``.
        device_type: as for :func:`uses_xla`.

    Example:
        >>> from keras_mp.device import xla
        >>> xla.set_xla("elementwise", False)    # forced: TensorFlow's ops
        >>> xla.fuses_epilogue("gelu", "CPU")
        False
        >>> xla.set_xla("elementwise", None)     # measured where configure ran, else the default
        >>> xla.fuses_epilogue("gelu", "CPU") in (True, False)
        True
    """
    _check_activation(activation)
    device_type = device_type or current_device_type()
    if "elementwise" in _overrides:
        return _overrides["elementwise"] and xla_available(device_type)
    with _lock:
        measured = _epilogues.get((activation, device_type))
    if measured is not None:
        return measured and xla_available(device_type)
    if device_type == "CPU" and activation in _ONEDNN_EPILOGUES and cpu_has_bf16_matmul():
        return False
    return uses_xla("elementwise", device_type)


def set_measured_epilogue(activation: str, device_type: str, fused: bool) -> None:
    """Records where a fused ``Dense``'s epilogue runs for ``activation``
    (used by :mod:`keras_mp.execution`; ``set_xla("elementwise", ...)``
    still overrides it)."""
    _check_activation(activation)
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"`device_type` must be one of {DEVICE_TYPES}, got {device_type!r}.")
    if not isinstance(fused, bool):
        raise TypeError(f"`fused` must be True or False, got {fused!r}.")
    with _lock:
        _epilogues[(activation, device_type)] = fused


def current_device_type() -> str:
    """The device type ops placed now would run on ("CPU", "GPU" or "TPU")."""
    if tf.config.list_logical_devices("TPU"):
        return "TPU"
    if tf.config.list_logical_devices("GPU"):
        return "GPU"
    return "CPU"


def memory_maps() -> tuple[int, int] | None:
    """The memory maps this process holds and the most Linux allows it
    (``vm.max_map_count``), or None where the system does not say.

    TensorFlow never frees an XLA:CPU executable: each compiled function
    keeps its memory maps for the life of the process (measured: about 100
    for a 3-layer MLP's train step, thousands for a small Transformer's,
    still held after ``keras.utils.clear_session()``). Past the limit the
    next ``mmap`` fails and the process crashes inside XLA's compiler, so
    :mod:`keras_mp.execution` stops trying XLA well before it.

    Example:
        >>> maps = memory_maps()
        >>> maps is None or 0 < maps[0] < maps[1]
        True
    """
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return used, limit


def xla_available(device_type: str | None = None) -> bool:
    """Whether XLA compiles and runs on ``device_type`` (probed once, cached).

    Args:
        device_type: ``"CPU"``, ``"GPU"``, ``"TPU"``, or None for the
            device that ops placed now would run on.
    """
    device_type = device_type or current_device_type()
    if device_type not in DEVICE_TYPES:
        raise ValueError(
            f"`device_type` must be one of {DEVICE_TYPES} or None, got {device_type!r}.")
    with _lock:
        if device_type in _available:
            return _available[device_type]
    try:
        probe = tf.function(lambda x: tf.reduce_sum(x * 2.0), jit_compile=True)
        with tf.device(f"/{device_type}:0"):
            probe(tf.ones([2]))
        ok = True
    except Exception as e:  # noqa: BLE001 - any failure means "no XLA here"
        _log.warning(
            "XLA is not usable on %s (%s); keras_mp falls back to its "
            "reference ops there.", device_type, e)
        ok = False
    with _lock:
        _available[device_type] = ok
    return ok


def record_available(device_type: str, ok: bool) -> None:
    """Records whether XLA runs on ``device_type`` as found by another
    process (:func:`keras_mp.execution.placement.measure_elsewhere`), so that
    :func:`xla_available` does not compile its probe here: a process's first
    XLA compilation loads XLA's runtime, which stays.

    Example:
        >>> from keras_mp.device import xla
        >>> xla.record_available("CPU", xla.xla_available("CPU"))
    """
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"`device_type` must be one of {DEVICE_TYPES}, got {device_type!r}.")
    if not isinstance(ok, bool):
        raise TypeError(f"`ok` must be True or False, got {ok!r}.")
    with _lock:
        _available[device_type] = ok


def uses_xla(kind: Kind, device_type: str | None = None) -> bool:
    """Whether work of ``kind`` is compiled with XLA on ``device_type``.

    Example:
        >>> from keras_mp.device import xla
        >>> xla.uses_xla("elementwise", "CPU")
        True
        >>> xla.uses_xla("matmul", "CPU") in (True, False)
        True
    """
    _check_kind(kind)
    if getattr(_local, "disabled", 0):
        return False  # before xla_available: a scope without XLA never starts its runtime
    device_type = device_type or current_device_type()
    if kind in _overrides:
        wanted = _overrides[kind]
    else:
        wanted = _default(kind, device_type)
    return wanted and xla_available(device_type)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within it, in this thread, :func:`uses_xla` says False for every kind
    of work, so that what is traced inside (a model's train step) runs its
    reference TensorFlow ops and compiles nothing; nor is XLA probed.

    :mod:`keras_mp.execution` traces a model's steps inside it where the XLA
    work keras_mp would add is too little to pay for XLA's runtime, which a
    process loads on its first compilation and keeps: 47 MiB of resident
    memory on a 2-core AMD EPYC (:func:`keras_mp.execution.reasons.little_to_compile`).

    Example:
        >>> from keras_mp.device import xla
        >>> with xla.disabled():
        ...     xla.uses_xla("elementwise")
        False
        >>> xla.uses_xla("elementwise", "CPU")
        True
    """
    _local.disabled = getattr(_local, "disabled", 0) + 1
    try:
        yield
    finally:
        _local.disabled -= 1


def jit(kind: Kind = "elementwise") -> Callable[[F], F]:
    """Decorates a TensorFlow function so that it is XLA-compiled where
    :func:`uses_xla` says so, and runs as a plain ``tf.function`` elsewhere.

    The decision is taken at call time, so :func:`set_xla` applies to
    functions defined before it was called. Each variant is traced once per
    signature; inside another trace (a train step) without XLA, the function's
    ops are added to that trace directly: a nested ``tf.function`` there is a
    trace of its own for every new tensor shape (the forward statistics of
    keras.io's timeseries FCN: 22 of them in its first train-step trace) that
    TensorFlow inlines again before running it.
    """
    _check_kind(kind)

    def decorate(fn: F) -> F:
        compiled = tf.function(fn, jit_compile=True, autograph=False)
        plain = tf.function(fn, jit_compile=False, autograph=False)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if uses_xla(kind):
                return compiled(*args, **kwargs)
            if tf.inside_function():
                return fn(*args, **kwargs)
            return plain(*args, **kwargs)

        wrapper.compiled = compiled  # type: ignore[attr-defined]
        wrapper.plain = plain  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
