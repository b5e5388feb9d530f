"""What this device runs fast: measured once, cached.

The adaptive policy only considers a dtype that the device actually
accelerates: on a CPU without float16 units, float16 compute is emulated and
more than ten times slower than float32, so choosing it "to save time" would
do the opposite. Two sources of evidence are combined:

* hardware: on CPU the flags in ``/proc/cpuinfo`` (``amx_bf16``,
  ``avx512_bf16`` for bfloat16; ``amx_fp16``, ``avx512_fp16`` for float16);
  on GPU the compute capability (float16 from 7.0, bfloat16 from 8.0,
  float8 from 8.9: Ada and Hopper have float8 tensor cores);
* a micro-benchmark: a small matmul timed in each dtype (a few milliseconds),
  which catches a missing kernel or library that the flags cannot show.

A dtype is *fast* when the hardware supports it and the measurement does not
contradict it (at least ``0.9x`` float32's throughput); a measurement that
contradicts the hardware is taken again (at most :data:`_REMEASURE` times, each
dtype keeping its best), since one noisy measurement once turned bfloat16 off
for a whole process. float8 has no
TensorFlow matmul kernel to time: XLA turns Keras's quantize-dequantize
pattern into float8 GEMMs on GPUs with float8 units, so it counts as fast
where the hardware has them and bfloat16 is fast (never on a CPU, where it is
emulated; ``python -m benchmarks.float8_gpu`` measures it on a GPU). A measurement alone
never makes a dtype fast: on a shared machine a small matmul is noisy, and an
emulated float16 that happens to time well on a tiny matmul is still slow in
the elementwise ops around it.

Example:
    >>> from keras_mp import device
    >>> p = device.profile()
    >>> p.device_type in ("CPU", "GPU", "TPU")
    True
    >>> "float32" in device.default_candidates()
    True
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable

import tensorflow as tf

from keras_mp.device import _cpuinfo
from keras_mp.device import cache as disk
from keras_mp.device import xla

__all__ = ["DeviceProfile", "profile", "cpu_flags", "fast_dtypes", "default_candidates"]

NARROW_DTYPES: tuple[str, ...] = ("bfloat16", "float16")
_CPU_FLAGS = {"bfloat16": ("amx_bf16", "avx512_bf16"), "float16": ("amx_fp16", "avx512_fp16")}
_CONFIRM = 0.9  # a supported dtype may measure this much slower (noise) and still count
#: Measurements again (each dtype keeps its best throughput) while one
#: contradicts the hardware: once, in a ``keras-mp bench --quick`` process on
#: a 2-core AMD EPYC with AVX512-BF16 (bfloat16 1.22x float32 in ``keras-mp
#: info``), bfloat16 measured below 0.9x, and the whole process trained in
#: float32 (its Transformer at 0.54x Keras ``mixed_bfloat16``'s speed).
_REMEASURE = 2

_cache: dict[str, DeviceProfile] = {}
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What was measured about one device type.

    Attributes:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``.
        flags: the relevant CPU flags found (empty off CPU).
        hardware: dtype -> whether the hardware supports it natively.
        throughput: dtype -> measured matmul GFLOP/s (float32 included).
        fast: the narrow dtypes judged fast, fastest first.
    """

    device_type: str
    flags: frozenset[str]
    hardware: dict[str, bool]
    throughput: dict[str, float]
    fast: tuple[str, ...]

    def speedup(self, dtype: str) -> float:
        """Measured throughput of ``dtype`` relative to float32."""
        base = self.throughput.get("float32", 0.0)
        return self.throughput.get(dtype, 0.0) / base if base > 0 else 0.0


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU feature flags of the first processor in ``/proc/cpuinfo``.

    Args:
        cpuinfo: the file's text; read from ``/proc/cpuinfo`` when None
            (an empty set where the file does not exist, e.g. on macOS).

    Example:
        >>> sorted(cpu_flags("processor : 0\\nflags : fpu avx2 amx_bf16\\n"))
        ['amx_bf16', 'avx2', 'fpu']
    """
    if cpuinfo is not None and not isinstance(cpuinfo, str):
        raise TypeError(f"`cpuinfo` must be the text of /proc/cpuinfo or None, got "
                        f"{cpuinfo!r} of type {type(cpuinfo).__name__}.")
    found = _cpuinfo.fields(cpuinfo)
    return frozenset(found.get("flags", found.get("Features", "")).split())  # x86, ARM


def _hardware(device_type: str, flags: Iterable[str]) -> dict[str, bool]:
    flags = set(flags)
    if device_type == "CPU":
        out = {d: any(f in flags for f in names) for d, names in _CPU_FLAGS.items()}
        return {**out, "float8": False}
    if device_type == "TPU":
        return {"bfloat16": True, "float16": False, "float8": False}
    major, minor = 0, 0
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        major, minor = details.get("compute_capability", (0, 0)) or (0, 0)
    return {"bfloat16": (major, minor) >= (8, 0), "float16": (major, minor) >= (7, 0),
            "float8": (major, minor) >= (8, 9)}


def _measure(device_type: str, n: int, repeats: int) -> dict[str, float]:
    # A TF graph matmul, not XLA: Keras layers run their matmuls through TF's
    # kernels (oneDNN on CPU), which is where the dtype's speed shows. The
    # dtypes' repeats are interleaved, so that a burst of load from other
    # processes hits all of them rather than whichever was being timed.
    out: dict[str, float] = {}
    fns = {}
    # Deciding as a CPU class without a dtype's units (KERAS_MP_CPU_CLASS),
    # that dtype is not measured: with oneDNN capped to that class
    # (ONEDNN_MAX_CPU_ISA=AVX2 on a CPU with bfloat16 units), TensorFlow's
    # bfloat16 matmul aborts the process.
    lacking = () if device_type != "CPU" or _cpuinfo.cpu_class() is None else tuple(
        d for d, has in _hardware("CPU", cpu_flags()).items() if not has)
    with tf.device(f"/{device_type}:0"):
        for dtype in ("float32", *NARROW_DTYPES):
            if dtype in lacking:
                out[dtype] = 0.0
                continue
            x = tf.cast(tf.random.stateless_normal([n, n], seed=[1, 2]), dtype)
            fn = tf.function(lambda a: tf.matmul(a, a), autograph=False)
            try:
                fn(x).numpy()  # trace and warm up
                fn(x).numpy()
            except (tf.errors.OpError, TypeError, ValueError):
                out[dtype] = 0.0  # no kernel for this dtype here
                continue
            fns[dtype] = (fn, x)
        best = {dtype: float("inf") for dtype in fns}
        for _ in range(repeats):
            for dtype, (fn, x) in fns.items():
                start = time.perf_counter()
                fn(x).numpy()
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    for dtype, t in best.items():
        out[dtype] = 2.0 * n**3 / max(t, 1e-9) / 1e9
    return {d: out[d] for d in ("float32", *NARROW_DTYPES)}


def _judge(hardware: dict[str, bool], speed: dict[str, float]) -> tuple[str, ...]:
    base = speed.get("float32", 0.0)
    fast = []
    for dtype in NARROW_DTYPES:
        ratio = speed.get(dtype, 0.0) / base if base > 0 else 0.0
        if hardware.get(dtype) and ratio >= _CONFIRM:
            fast.append((ratio, dtype))
    return tuple(d for _, d in sorted(fast, reverse=True))


def profile(device_type: str | None = None, *, refresh: bool = False, size: int = 256,
            repeats: int = 9) -> DeviceProfile:
    """Measures (once per process and device type, kept on disk by
    :mod:`keras_mp.device.cache`) what ``device_type`` runs fast.

    Args:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``; the device new ops
            would run on when None.
        refresh: measure again instead of returning the cached profile.
        size: side of the square matmul timed (>= 16); small on purpose so
            that the measurement takes milliseconds.
        repeats: timed repeats per dtype (>= 1), interleaved across dtypes;
            the best is kept.

    Returns:
        A :class:`DeviceProfile`.
    """
    device_type = device_type or xla.current_device_type()
    if device_type not in ("CPU", "GPU", "TPU"):
        raise ValueError(f"`device_type` must be 'CPU', 'GPU', 'TPU' or None, got "
                         f"{device_type!r}.")
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise ValueError(f"`size` must be an int >= 16, got {size!r}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be an int >= 1, got {repeats!r}.")
    with _lock:
        if not refresh and device_type in _cache:
            return _cache[device_type]
    disk_key = f"{size}/{repeats}"
    kept = None if refresh else _from_disk(device_type, disk_key)
    if kept is not None:
        with _lock:
            return _cache.setdefault(device_type, kept)
    flags = cpu_flags() if device_type == "CPU" else frozenset()
    relevant = frozenset(f for names in _CPU_FLAGS.values() for f in names if f in flags)
    hardware = _hardware(device_type, flags)
    speed = _measure(device_type, size, repeats)
    supported = tuple(d for d in NARROW_DTYPES if hardware.get(d))
    for _ in range(_REMEASURE):
        if set(_judge(hardware, speed)) == set(supported):
            break  # the measurement agrees with the hardware
        again = _measure(device_type, size, repeats)
        speed = {d: max(speed.get(d, 0.0), again.get(d, 0.0)) for d in speed}
    result = DeviceProfile(device_type, relevant, hardware, speed, _judge(hardware, speed))
    with _lock:
        _cache[device_type] = result
    disk.put("device_profile", disk_key,
             {"flags": sorted(relevant), "hardware": hardware, "throughput": speed,
              "fast": list(result.fast)}, device_type)
    return result


def _from_disk(device_type: str, key: str) -> DeviceProfile | None:
    """The profile kept on disk (:mod:`keras_mp.device.cache`), or None."""
    found = disk.get("device_profile", key, device_type)
    try:
        return DeviceProfile(device_type, frozenset(found["flags"]),
                             {k: bool(v) for k, v in found["hardware"].items()},
                             {k: float(v) for k, v in found["throughput"].items()},
                             tuple(str(d) for d in found["fast"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def fast_dtypes(device_type: str | None = None) -> tuple[str, ...]:
    """The narrow dtypes (``"bfloat16"``, ``"float16"``) this device runs
    fast, fastest first; empty when none is.

    Example:
        >>> set(fast_dtypes()) <= {"bfloat16", "float16"}
        True
    """
    return profile(device_type).fast


def default_candidates(device_type: str | None = None) -> tuple[str, ...]:
    """The candidates of ``AdaptivePolicy(candidates=None)``: the fastest
    narrow dtype of this device, then float32.

    bfloat16 is preferred when both are fast: it needs no loss scaling and
    has float32's range. float8 comes first where the device has float8
    units (Dense and EinsumDense layers only; see :mod:`keras_mp.adaptive.evidence.float8`).
    Where neither is fast the answer is ``("float32",)`` and the adaptive
    policy is plain float32, which is the fastest choice there.

    Example:
        >>> default_candidates()[-1]
        'float32'
    """
    fast = fast_dtypes(device_type)
    if "bfloat16" in fast and profile(device_type).hardware.get("float8"):
        return ("float8", "bfloat16", "float32")
    if "bfloat16" in fast:
        return ("bfloat16", "float32")
    if "float16" in fast:
        return ("float16", "float32")
    return ("float32",)
