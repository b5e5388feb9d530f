"""Timing helpers shared by every benchmark scenario.

Absolute times drift between runs and machines (other processes share the
CPU), so every scenario measures its variants side by side in one process and
reports ratios; each figure is the median of several repeats with its spread.

Example:
    >>> import time
    >>> from benchmarks.common import time_steps, format_ratio_table
    >>> t = time_steps(lambda: time.sleep(0.001), steps=2, warmup=1, repeats=3)
    >>> sorted(t)
    ['median', 'min', 'samples', 'spread']
    >>> len(t["samples"])
    3
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "time_steps",
    "side_by_side",
    "interleaved_clocks",
    "format_ratio_table",
    "peak_rss_mb",
    "sync",
    "quiet_tensorflow",
    "without_autotune",
]


def sync(result: Any) -> None:
    """Waits until ``result`` (a tensor, or a nest of them) is computed.

    TensorFlow may return before the device has finished (GPU streams, async
    eager), so a timing must read a value back, or it times only the launch.
    """
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - the package requires TF
        return
    for t in tf.nest.flatten(result):
        if hasattr(t, "numpy"):
            # Reading one element forces the whole computation but copies
            # almost nothing back.
            tf.reshape(t, [-1])[:1].numpy() if t.shape.rank else t.numpy()


def without_autotune(dataset):
    """``dataset`` with tf.data's autotuning off, for timing ``fit`` calls.

    Every ``fit`` call makes a new iterator over its dataset, and tearing one
    down can wait for tf.data's autotuning thread to wake. That thread sleeps
    10, 20, 40 ... ms in turn, so it wakes 10 * (2**k - 1) ms after the
    iterator was made, and a round of ``fit`` that was just past one wake-up
    lasts until the next. On a 2-core AMD EPYC (TF 2.21.0) a 10-step round
    of Keras ``mixed_bfloat16`` on the bench MLP took 0.91 s in some rounds
    and exactly 1.27 s in others (the CPU time the same); the Transformer's
    rounds took 10.23 s or 20.47 s, whatever they computed; and a bare
    iterator over ten cached batches, 0.91 s of work, took 1.26 s to go away
    once in eight rounds. Which variant a round penalised was chance, so the
    median wall time of 5 rounds could move by 1.4x. The bench's pipelines
    (cached batches held in memory) have nothing to tune.

    >>> import tensorflow as tf
    >>> ds = without_autotune(tf.data.Dataset.range(4).batch(2))
    >>> ds.options().autotune.enabled, [b.numpy().tolist() for b in ds]
    (False, [[0, 1], [2, 3]])
    >>> without_autotune([0, 1])
    Traceback (most recent call last):
    TypeError: `dataset` must be a tf.data.Dataset, got list.
    """
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"`dataset` must be a tf.data.Dataset, got {type(dataset).__name__}.")
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def time_steps(fn: Callable[[], Any], steps: int = 10, warmup: int = 2,
               repeats: int = 5) -> dict[str, Any]:
    """Times ``fn`` and returns the median seconds per call and its spread.

    Args:
        fn: a callable with no arguments; its result is synchronised with
            :func:`sync` at the end of each repeat.
        steps: calls per repeat (> 0); the repeat's time is divided by it.
        warmup: calls before timing (>= 0): tracing and compilation are
            excluded this way.
        repeats: number of timed repeats (> 0).

    Returns:
        ``{"median": s, "spread": s, "min": s, "samples": [s, ...]}``,
        seconds per call; ``spread`` is max minus min over the repeats.
        ``min`` (best of the repeats) is the figure least disturbed by other
        processes on a shared machine.

    Example:
        >>> t = time_steps(lambda: sum(range(100)), steps=5, warmup=0, repeats=2)
        >>> t["median"] >= 0 and len(t["samples"]) == 2
        True
    """
    if steps < 1:
        raise ValueError(f"`steps` must be >= 1, got {steps}.")
    if warmup < 0:
        raise ValueError(f"`warmup` must be >= 0, got {warmup}.")
    if repeats < 1:
        raise ValueError(f"`repeats` must be >= 1, got {repeats}.")
    result = None
    for _ in range(warmup):
        result = fn()
    if warmup:
        sync(result)
    samples: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            result = fn()
        sync(result)
        samples.append((time.perf_counter() - start) / steps)
    return {
        "median": statistics.median(samples),
        "spread": max(samples) - min(samples),
        "min": min(samples),
        "samples": samples,
    }


def side_by_side(variants: Mapping[str, Callable[[], Any]], steps: int = 10,
                 warmup: int = 2, repeats: int = 5) -> dict[str, dict[str, Any]]:
    """Times several variants in one process, interleaving their repeats.

    Interleaving (A, B, C, A, B, C, ...) spreads any slow-down caused by other
    processes over all variants instead of penalising whichever ran while the
    machine was busy, which keeps their ratios honest.

    Args:
        variants: name -> callable with no arguments.
        steps, warmup, repeats: as for :func:`time_steps`.

    Returns:
        name -> the :func:`time_steps` dict of that variant (wall seconds per
        call), plus ``cpu_median``, ``cpu_spread`` and ``cpu_samples``: the
        same in process CPU seconds, which other processes on a shared
        machine disturb less.

    Example:
        >>> r = side_by_side({"a": lambda: 1, "b": lambda: 2}, steps=1, warmup=0, repeats=2)
        >>> sorted(r), len(r["a"]["samples"])
        (['a', 'b'], 2)
    """
    if not variants:
        raise ValueError("`variants` must name at least one callable.")
    for fn in variants.values():
        for _ in range(warmup):
            result = fn()
        if warmup:
            sync(result)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            c0 = time.process_time()
            samples[name].extend(
                time_steps(fn, steps=steps, warmup=0, repeats=1)["samples"])
            cpu[name].append((time.process_time() - c0) / steps)
    return {
        name: {"median": statistics.median(s), "spread": max(s) - min(s), "min": min(s),
               "samples": s, "cpu_median": statistics.median(cpu[name]),
               "cpu_spread": max(cpu[name]) - min(cpu[name]), "cpu_samples": cpu[name]}
        for name, s in samples.items()
    }


def _stats(samples: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "spread": max(samples) - min(samples),
            "min": min(samples), "max": max(samples), "samples": list(samples)}


def interleaved_clocks(variants: Mapping[str, Callable[[], Any]], rounds: int = 5,
                       warmup: int = 1, per_call: int = 1,
                       progress: Any = None) -> dict[str, dict[str, Any]]:
    """Times variants in interleaved rounds by process CPU time and wall time.

    Each round calls every variant once, in order (A, B, C, A, B, C, ...).
    Process CPU time (all threads of this process) is what other processes on
    a shared machine disturb least; wall time is what a user waits for. Both
    are reported.

    Args:
        variants: name -> callable with no arguments that runs ``per_call``
            steps and waits for them (e.g. one ``model.fit`` epoch).
        rounds: timed rounds (>= 1).
        warmup: untimed calls of each variant first (>= 0; tracing, XLA
            compilation).
        per_call: steps one call runs (>= 1); figures are per step.
        progress: a :class:`benchmarks.progress.Progress` started for
            ``rounds * len(variants)`` calls, or None.

    Returns:
        name -> ``{"cpu": stats, "wall": stats}``, each stats a dict with
        ``median``, ``spread`` (max - min), ``min``, ``max`` and ``samples``,
        in seconds per step.

    Example:
        >>> r = interleaved_clocks({"a": lambda: sum(range(1000))}, rounds=3, warmup=0)
        >>> sorted(r["a"]), len(r["a"]["cpu"]["samples"])
        (['cpu', 'wall'], 3)
    """
    if not variants:
        raise ValueError("`variants` must name at least one callable.")
    for name, value, low in (("rounds", rounds, 1), ("warmup", warmup, 0),
                             ("per_call", per_call, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}, got {value!r}.")
    for fn in variants.values():
        for _ in range(warmup):
            sync(fn())
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, fn in variants.items():
            if progress is not None:
                progress.update(f"round {r + 1}/{rounds} {name}")
            c0, w0 = time.process_time(), time.perf_counter()
            sync(fn())
            wall[name].append((time.perf_counter() - w0) / per_call)
            cpu[name].append((time.process_time() - c0) / per_call)
            if progress is not None:
                progress.done()
    return {name: {"cpu": _stats(cpu[name]), "wall": _stats(wall[name])} for name in variants}


def format_ratio_table(rows: Sequence[Mapping[str, Any]], baseline: str | None = None) -> str:
    """Formats timings as a Markdown table with ratios against a baseline.

    Args:
        rows: each a mapping with ``"name"``, ``"median"`` and ``"spread"``
            (seconds), optionally extra columns (e.g. ``"peak_mb"``).
        baseline: the row name every ratio is relative to (its time divided
            by the row's time, so > 1 means faster than the baseline); the
            first row when None.

    Returns:
        The table as a string.

    Example:
        >>> print(format_ratio_table([
        ...     {"name": "ref", "median": 0.02, "spread": 0.001},
        ...     {"name": "fused", "median": 0.01, "spread": 0.0005}]))
        | variant | median ms | spread ms | speed-up vs ref |
        | --- | ---: | ---: | ---: |
        | ref | 20.000 | 1.000 | 1.00x |
        | fused | 10.000 | 0.500 | 2.00x |
    """
    if not rows:
        raise ValueError("`rows` must hold at least one row.")
    names = [r["name"] for r in rows]
    base_name = names[0] if baseline is None else baseline
    if base_name not in names:
        raise ValueError(f"`baseline` must be one of {names}, got {baseline!r}.")
    base_row = next(r for r in rows if r["name"] == base_name)
    base = base_row["median"]
    with_cpu = all("cpu_median" in r for r in rows)
    extra = [k for k in rows[0] if k not in ("name", "median", "spread", "min", "max", "samples")
             and not k.startswith("cpu_")]
    header = ["variant", "median ms", "spread ms", f"speed-up vs {base_name}"]
    if with_cpu:
        header += ["CPU median ms", "CPU spread ms", "CPU speed-up"]
    header += extra
    lines = ["| " + " | ".join(header) + " |",
             "| --- |" + " ---: |" * (len(header) - 1)]
    for r in rows:
        cells = [str(r["name"]), f"{r['median'] * 1e3:.3f}", f"{r['spread'] * 1e3:.3f}",
                 f"{base / r['median']:.2f}x" if r["median"] > 0 else "inf"]
        if with_cpu:
            cells += [f"{r['cpu_median'] * 1e3:.3f}", f"{r['cpu_spread'] * 1e3:.3f}",
                      f"{base_row['cpu_median'] / r['cpu_median']:.2f}x"
                      if r["cpu_median"] > 0 else "inf"]
        cells += [_cell(r.get(k)) for k in extra]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    return "" if value is None else str(value)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB.

    It never goes down, so compare variants run in separate processes, or
    read it before and after each one. On Linux this is ``VmHWM``, which
    starts afresh in an exec'ed subprocess; ``ru_maxrss`` would instead
    inherit the parent's peak at fork.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # reported in kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def quiet_tensorflow() -> None:
    """Silences TensorFlow's C++ start-up log before it is imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def cpu_name() -> str:
    """The CPU's model name as keras-mp reads it (``keras_mp.device._cpuinfo``:
    with ``KERAS_MP_CPU_CLASS`` set, "... (decisions of class X)"), or what
    ``platform`` knows."""
    import platform

    from keras_mp.device import _cpuinfo

    return _cpuinfo.fields().get("model name") or platform.processor() or platform.machine()
