"""The device-wide micro-benchmark: a probe train step and a matmul, timed as a
TensorFlow graph and under XLA (what ``keras-mp info`` shows; :func:`choose`
answers from it). It does not decide for a model: :mod:`keras_mp.execution.choice`
times the model's own step.

Example:
    >>> from keras_mp.execution import micro_benchmark
    >>> p = micro_benchmark.profile()
    >>> sorted(p.step) == sorted(p.matmul)
    True
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

from keras_mp import device
from keras_mp.device import cache as disk
from keras_mp.device import xla

__all__ = ["MARGIN", "ExecutionProfile", "profile", "cached", "remember", "choose"]

#: Another mode than the graph must be at least this much faster (by CPU time
#: and by wall time) to be kept.
MARGIN = 1.05

_cache: dict[str | tuple[str, str], ExecutionProfile] = {}  # device (full) or (device, "matmul")
_lock = threading.Lock()
_log = logging.getLogger("keras_mp")


@dataclasses.dataclass(frozen=True)
class ExecutionProfile:
    """What was measured about whole steps and matmuls under XLA.

    Attributes:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``.
        xla_available: whether XLA compiles and runs on this device.
        step: dtype -> ``{"graph": (cpu_s, wall_s), "xla": (cpu_s, wall_s)}``,
            median seconds per train step of the probe model.
        matmul: dtype -> ``{"graph": GFLOP/s, "xla": GFLOP/s}``.
    """

    device_type: str
    xla_available: bool
    step: dict[str, dict[str, tuple[float, float]]]
    matmul: dict[str, dict[str, float]]

    def xla_speedup(self, dtype: str) -> float:
        """The smaller of XLA's CPU-time and wall-time speed-ups over the
        graph for a train step in ``dtype`` (0.0 when not measured)."""
        times = self.step.get(dtype)
        if not times or "xla" not in times:
            return 0.0
        (gc, gw), (xc, xw) = times["graph"], times["xla"]
        return min(gc / max(xc, 1e-12), gw / max(xw, 1e-12))

    def xla_wins(self, dtype: str) -> bool:
        """Whether XLA runs a train step in ``dtype`` faster by both clocks."""
        return self.xla_speedup(dtype) >= MARGIN

    def matmul_xla_wins(self, dtype: str) -> bool:
        """Whether a matmul in ``dtype`` runs at least as fast under XLA."""
        m = self.matmul.get(dtype, {})
        return m.get("xla", 0.0) >= m.get("graph", float("inf"))


def _check_device_type(device_type: str | None) -> str:
    device_type = device_type or xla.current_device_type()
    if device_type not in xla.DEVICE_TYPES:
        raise ValueError(f"`device_type` must be one of {xla.DEVICE_TYPES} or None, got "
                         f"{device_type!r}.")
    return device_type


def _probe_step(dtype: str, batch: int, width: int, jit: bool) -> Callable[[], Any]:
    init = tf.random.stateless_normal
    x = tf.cast(init([batch, width], seed=[1, 1]), dtype)
    target = tf.cast(init([batch, width], seed=[1, 2]), dtype)
    w1 = tf.Variable(init([width, 2 * width], seed=[1, 3]) * 0.02)
    b1 = tf.Variable(tf.zeros([2 * width]))
    w2 = tf.Variable(init([2 * width, width], seed=[1, 4]) * 0.02)
    b2 = tf.Variable(tf.zeros([width]))
    weights = [w1, b1, w2, b2]

    def step():
        with tf.GradientTape() as tape:
            h = tf.nn.gelu(tf.matmul(x, tf.cast(w1, dtype)) + tf.cast(b1, dtype))
            mean, var = tf.nn.moments(tf.cast(h, "float32"), axes=[-1], keepdims=True)
            h = tf.cast((tf.cast(h, "float32") - mean) * tf.math.rsqrt(var + 1e-5), dtype)
            y = tf.matmul(h, tf.cast(w2, dtype)) + tf.cast(b2, dtype)
            loss = tf.reduce_mean(tf.square(tf.cast(y - target, "float32")))
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(1e-3 * g)
        return loss

    fn = tf.function(step, jit_compile=jit, autograph=False)
    return lambda: fn().numpy()


def _probe_matmul(dtype: str, n: int, jit: bool) -> Callable[[], Any]:
    a = tf.cast(tf.random.stateless_normal([n, n], seed=[2, 1]), dtype)
    fn = tf.function(lambda m: tf.matmul(m, m), jit_compile=jit, autograph=False)
    return lambda: fn(a)[:1, :1].numpy()


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int,
                 steps: int) -> dict[str, tuple[float, float]]:
    """Median (CPU s, wall s) per call of each fn, over interleaved rounds."""
    for fn in fns.values():
        fn()  # trace / compile
        fn()
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                fn()
            cpu[key].append((time.process_time() - c0) / steps)
            wall[key].append((time.perf_counter() - w0) / steps)
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in fns}


def _measure(device_type: str, dtypes: Iterable[str], use_xla: bool, batch: int, width: int,
             rounds: int, steps: bool = True) -> tuple[dict, dict]:
    step: dict[str, dict[str, tuple[float, float]]] = {}
    matmul: dict[str, dict[str, float]] = {}
    n = 2 * width
    with tf.device(f"/{device_type}:0"):
        for dtype in dtypes:
            modes = (False, True) if use_xla else (False,)
            names = {False: "graph", True: "xla"}
            try:
                if steps:
                    step[dtype] = _interleaved(
                        {names[j]: _probe_step(dtype, batch, width, j) for j in modes}, rounds, 3)
                mm = _interleaved({names[j]: _probe_matmul(dtype, n, j) for j in modes},
                                  rounds, 3)
            except (tf.errors.OpError, TypeError, ValueError) as e:
                _log.info("keras_mp: could not time a %s step on %s (%s).", dtype,
                          device_type, e)
                continue
            matmul[dtype] = {k: 2.0 * n**3 / max(wall, 1e-12) / 1e9
                             for k, (_, wall) in mm.items()}
    return step, matmul


def profile(device_type: str | None = None, *, refresh: bool = False, batch: int = 256,
            width: int = 512, rounds: int = 5, steps: bool = True) -> ExecutionProfile:
    """Measures (once per process and device type, kept on disk by
    :mod:`keras_mp.device.cache` for the default sizes) graph against XLA.

    Takes a few seconds on a 2-core CPU, most of it XLA compilation. Each
    XLA compilation stays in the process's memory (TensorFlow never frees
    an XLA:CPU executable): on a 2-core AMD EPYC the full profile added 201
    MB to the process's resident memory, the matmuls alone 112 MB (most of
    it the process's first XLA compilation, which fused kernels make
    anyway), so training (:mod:`keras_mp.execution.placement`) asks for the
    matmuls only.

    Args:
        device_type: ``"CPU"``, ``"GPU"`` or ``"TPU"``; the device new ops
            would run on when None.
        refresh: measure again instead of returning the cached profile.
        batch: rows of the probe step's input (>= 8).
        width: width of the probe model (>= 16); the matmul probe is
            ``2 * width`` square.
        rounds: interleaved timing rounds (>= 1); medians are kept.
        steps: also time the probe train step (``step``); False: matmuls
            only (``step`` is empty unless only a full profile is kept).

    Returns:
        An :class:`ExecutionProfile`.
    """
    device_type = _check_device_type(device_type)
    for name, value, low in (("batch", batch, 8), ("width", width, 16), ("rounds", rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    if not isinstance(steps, bool):
        raise TypeError(f"`steps` must be a bool, got {steps!r}.")
    defaults = (batch, width, rounds) == (256, 512, 5)
    if not refresh and defaults:
        _from_disk(device_type, steps)
    with _lock:
        if not refresh and not steps and (device_type, "matmul") in _cache:
            return _cache[(device_type, "matmul")]
        if not refresh and device_type in _cache:
            return _cache[device_type]
    # The dtypes "adaptive" computes in here (a "fast" float16 matmul can still
    # sit in a step of emulated float16 elementwise ops, seconds per step).
    dtypes = tuple(dict.fromkeys(("float32", *device.default_candidates(device_type))))
    available = xla.xla_available(device_type)
    step, matmul = _measure(device_type, dtypes, available, batch, width, rounds, steps)
    result = ExecutionProfile(device_type, available, step, matmul)
    with _lock:
        _cache[device_type if steps else (device_type, "matmul")] = result
    if defaults:
        _to_disk(result)
    return result


def _disk_key(steps: bool) -> str:
    return "full" if steps else "matmul"


def _from_disk(device_type: str, steps: bool) -> None:
    """Loads the profile kept on disk (:mod:`keras_mp.device.cache`) into
    this process's, where it has none: the full one; for ``steps=False``
    the matmuls-only one first, then the full one. (Always in that order,
    whichever this process measured or the cache holds besides: the
    decisions made from the matmuls, :mod:`keras_mp.execution.placement`
    and :func:`keras_mp.execution.reasons.slow_matmul`, then read the same
    figures in every process, a ``keras-mp info`` run in between or not.)"""
    for full in ((True,) if steps else (False, True)):
        with _lock:
            if (device_type if full else (device_type, "matmul")) in _cache:
                return
        found = disk.get("execution_profile", _disk_key(full), device_type)
        if isinstance(found, dict):
            try:
                step = {d: {m: (float(t[0]), float(t[1])) for m, t in modes.items()}
                        for d, modes in found["step"].items()}
                matmul = {d: {m: float(v) for m, v in modes.items()}
                          for d, modes in found["matmul"].items()}
                prof = ExecutionProfile(device_type, bool(found["xla_available"]), step, matmul)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError):
                continue
            with _lock:
                _cache.setdefault(device_type if full else (device_type, "matmul"), prof)
            xla.record_available(device_type, prof.xla_available)
            return


def _to_disk(result: ExecutionProfile) -> None:
    disk.put("execution_profile", _disk_key(bool(result.step)),
             {"xla_available": result.xla_available, "matmul": result.matmul,
              "step": {d: {m: list(t) for m, t in modes.items()}
                       for d, modes in result.step.items()}}, result.device_type)


def cached(device_type: str | None = None, *, steps: bool = True) -> ExecutionProfile | None:
    """The profile :func:`profile` would return without measuring (the full
    one, or with ``steps=False`` the matmuls-only one, else the full one),
    or None where it would measure.

    Example:
        >>> from keras_mp.execution import micro_benchmark
        >>> micro_benchmark.cached(steps=False) in (None, micro_benchmark.profile(steps=False))
        True
    """
    device_type = _check_device_type(device_type)
    if not isinstance(steps, bool):
        raise TypeError(f"`steps` must be a bool, got {steps!r}.")
    _from_disk(device_type, steps)
    with _lock:
        if not steps and (device_type, "matmul") in _cache:
            return _cache[(device_type, "matmul")]
        return _cache.get(device_type)


def remember(result: ExecutionProfile) -> None:
    """Keeps a profile measured elsewhere (another process:
    :func:`keras_mp.execution.placement.measure_elsewhere`) as this
    process's: :func:`profile` returns it, the full one where it has steps,
    else the matmuls-only one (``steps=False``).

    Example:
        >>> from keras_mp.execution import micro_benchmark
        >>> p = micro_benchmark.profile(steps=False)
        >>> micro_benchmark.remember(p)
        >>> micro_benchmark.profile(steps=False) is p
        True
    """
    if not isinstance(result, ExecutionProfile):
        raise TypeError(f"`result` must be an ExecutionProfile, got {result!r}.")
    _check_device_type(result.device_type)
    with _lock:
        _cache[result.device_type if result.step else (result.device_type, "matmul")] = result
    _to_disk(result)


def choose(dtypes: Iterable[str], device_type: str | None = None) -> str:
    """``"xla"`` where the probe step (:func:`profile`) ran faster under XLA
    for every dtype in ``dtypes``, else ``"graph"``: the micro-benchmark's
    estimate, shown by ``keras-mp info``. :func:`keras_mp.execution.configure`
    measures the model's own step instead.

    Args:
        dtypes: compute dtypes, e.g. ``["bfloat16", "float32"]``.
        device_type: as for :func:`profile`.

    Example:
        >>> choose(["float32"]) in ("xla", "graph")
        True
    """
    if isinstance(dtypes, str):
        dtypes = [dtypes]
    dtypes = sorted(set(dtypes))
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if not dtypes or bad:
        raise ValueError("`dtypes` must name at least one of 'float32', 'bfloat16', "
                         f"'float16', got {dtypes!r}.")
    prof = profile(device_type)
    return "xla" if prof.xla_available and all(prof.xla_wins(d) for d in dtypes) else "graph"
