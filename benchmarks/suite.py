"""The ``keras-mp bench`` suite: keras-mp against every Keras one-liner, side by side.

For each model (:mod:`benchmarks.models`: ``mlp``, ``cnn``, ``transformer``,
KerasHub's ``gpt2`` and keras.applications' ``resnet``; ``--quick`` runs
``mlp`` and ``transformer`` at smaller sizes) these variants train on the
same synthetic data in one process (:mod:`benchmarks.variants`):

* ``keras_float32``: plain Keras, ``compile()`` defaults;
* ``keras_float32_xla``: plain Keras, ``compile(jit_compile=True)``;
* ``keras_mixed_bfloat16`` and ``keras_mixed_bfloat16_xla``: Keras's
  ``mixed_bfloat16`` policy, without and with XLA;
* ``keras_mixed_float16`` and ``keras_mixed_float16_xla``: Keras's
  ``mixed_float16`` (loss scaling by Keras's own optimizer wrapper), without
  and with XLA (dropped, with the reason, where XLA does not compile it);
* ``keras_mp``: keras-mp's recommended set-up,
  ``keras_mp.set_global_policy("adaptive")``, :func:`keras_mp.fuse`, the
  :class:`~keras_mp.callbacks.AdaptivePrecision` callback (which picks the
  device's fast dtypes and the measured execution mode,
  :mod:`keras_mp.execution`), ``compile()`` defaults.

Every variant runs the same number of training steps per round (one
``model.fit`` epoch over a ``tf.data`` dataset, 20 steps by default: the
``AdaptivePrecision`` default gathers statistics on one call in 20, so every
round of keras_mp holds exactly one statistics step, at its steady-state
rate; ``--quick``: 6 rounds of 10 steps, every other one holding it); after a
warm-up (two single steps, on 8 rows, or on full batches for the ``*_xla``
variants, which XLA compiles per shape, none for ``keras_mp``,
:func:`benchmarks.variants.first_steps`; then one epoch of at least
:data:`WARMUP_CALLS` steps: tracing, XLA compilation, keras_mp's measured
choice of graph or XLA and the first statistics step, all before timing), the rounds are interleaved across
variants and timed by process CPU time and by wall time. Each figure is the
median over the rounds with its spread (max - min), per training step.
keras_mp's decisions (one per 100 calls) fall inside the rounds as they
would in training. Its float32 probe (one call in 200 at first, one in 1,600
once probes keep confirming the dtypes) is timed on its own after the rounds
(:meth:`AdaptivePrecision.probe <keras_mp.callbacks.AdaptivePrecision.probe>`,
the same computation on one batch) and its cost per step (the probe's time
divided by the mean gap between probes over a fit of ``LONG_FIT`` calls) is
**added** to keras_mp's figures (``probe`` in the results says how much).
Ratios are taken against ``keras_float32`` and against the best Keras
variant (the fastest of the six one-liners, by the same clock) measured in
the same run.

Memory (``memory`` in the results, the ``peak MiB`` column): each variant's
peak resident memory, measured after the timing in a fresh process per
variant that repeats the variant's warm-up and one round (``--quick``: the
warm-up alone, which holds keras_mp's execution trial and first statistics
step; :mod:`benchmarks.memory` says why a fresh process), two at a time,
``keras_mp`` side by side with the Keras one-liner of its compute dtype (the
same load on the cores for both); on a GPU also the device allocator's
peak. ``--quick`` measures ``keras_mp`` and the Keras one-liner of its
compute dtype (``keras_float32`` where that one was not timed); the full
bench every timed variant; ``--no-memory`` none.

``--quick`` with no ``--variants`` leaves out the Keras one-liners of a 16-bit
dtype this device has no hardware support for (``keras-mp info``; float16 on
most CPUs), with the reason in ``skipped``: they are never the best one-liner
there (Keras's ``mixed_float16`` on a 2-core AMD EPYC without float16 units:
0.45x and 0.77x the best one-liner, with and without XLA, on the quick
Transformer; 61-439x slower than float32 on an AMX Xeon), and leaving them out
took a quick run there from 234 to 191 s. The full bench times them all.

Sizes: ``size`` (``--size batch=64,length=256``) overrides the named sizes
of every model run (:data:`benchmarks.models.SIZES`: ``batch`` for all,
``length``, ``dim``, ``blocks`` for the transformer...), e.g. to read the
memory column at the size one will train.

Run: ``python -m benchmarks.suite [--quick] [--models mlp,cnn] [--size batch=64] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import memory as memory_lib
from .common import cpu_name, interleaved_clocks, quiet_tensorflow
from .progress import Progress
from .models import MODELS, SIZES, missing
from .models import get as get_model
from .variants import KERAS_VARIANTS, VARIANTS, add_probe_cost, dtype_counts, first_steps
from .variants import make as make_variant

__all__ = ["MODELS", "QUICK_MODELS", "VARIANTS", "KERAS_VARIANTS", "parse_size",
           "quick_left_out", "run", "main"]

#: What ``--quick`` runs when no model is named.
QUICK_MODELS: tuple[str, ...] = ("mlp", "transformer")

# (steps per round, rounds)
_SCHEDULE = {"full": (20, 7), "quick": (10, 6)}
#: Steps of the warm-up epoch (at least; ``steps`` when more): keras_mp's
#: measured choice of execution mode (its first 18 calls) and its first
#: statistics step (call 20) fall in it.
WARMUP_CALLS = 20
#: --quick sizes (smaller than :data:`benchmarks.models.SIZES`' own quick ones:
#: the whole quick bench fits in 3 minutes on 2 cores).
_QUICK = {"mlp": dict(batch=128, features=512, width=1024, depth=3),
          "transformer": dict(batch=16, length=64, dim=256, blocks=2)}
#: A variant whose single step (after tracing; on 8 rows, or a full batch for
#: the *_xla variants) is this many times slower than keras_float32's on the
#: same rows is reported from that step and not timed
#: (Keras's mixed_float16 on an AMX Xeon: 61-439x slower than float32).
#: Both sides are the fastest of :data:`SINGLE_STEPS` steps (a step over the
#: bound is timed again before it counts): one step of a small model is a few
#: milliseconds, and one pause of a shared machine can be ten times that.
TOO_SLOW = 8.0
SINGLE_STEPS = 3


def parse_size(text: str) -> dict[str, int]:
    """``"batch=64,length=256"`` -> ``{"batch": 64, "length": 256}``.

    >>> parse_size("batch=64, length=256")
    {'batch': 64, 'length': 256}

    Raises:
        ValueError: ``text`` is not comma-separated ``KEY=INT`` pairs.
    """
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        key, eq, value = part.partition("=")
        if not part or not eq or not key.strip() or not value.strip().isdigit():
            raise ValueError("`size` must be comma-separated KEY=INT pairs such as "
                             f"'batch=64,length=256', got {text!r}.")
        out[key.strip()] = int(value)
    return out


def quick_left_out(variants: Sequence[str], hardware: dict[str, bool]) -> dict[str, str]:
    """The variants ``--quick`` leaves out when none are named: the Keras
    one-liners of a 16-bit dtype that ``hardware`` (``keras_mp.device.profile().hardware``)
    does not support, each with the reason.

    >>> sorted(quick_left_out(["keras_float32", "keras_mixed_float16_xla", "keras_mp"],
    ...                       {"bfloat16": True, "float16": False}))
    ['keras_mixed_float16_xla']
    >>> quick_left_out(["keras_mixed_float16"], {"bfloat16": True, "float16": True})
    {}
    """
    out = {}
    for v in variants:
        if not v.startswith("keras_mixed_"):
            continue
        dtype = v[len("keras_mixed_"):].removesuffix("_xla")
        if not hardware.get(dtype, False):
            out[v] = (f"not timed by --quick: {dtype} has no hardware support on this device "
                      f"(keras-mp info); the full bench, or --variants, times it")
    return out


def _size(kind: str, quick: bool, size: dict[str, int] | None) -> dict[str, int]:
    """Model ``kind``'s sizes for this run, with ``size``'s overrides."""
    base = _QUICK.get(kind, SIZES[kind]["quick"]) if quick else SIZES[kind]["full"]
    if not size:
        return dict(base)
    unknown = sorted(set(size) - set(base))
    if unknown:
        raise ValueError(f"`size` keys must be among {sorted(base)} for model {kind!r}, "
                         f"got {unknown}.")
    for key, value in size.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`size` values must be ints >= 1, got {key}={value!r}.")
    return {**base, **size}


def _gpu_peak_mib(fn: Callable[[], Any]) -> float | None:
    """Peak GPU memory (MiB) TensorFlow's allocator reached during ``fn()``."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return None
    tf.config.experimental.reset_memory_stats(gpus[0].name)
    fn()
    return tf.config.experimental.get_memory_info(gpus[0].name)["peak"] / 2**20


def _machine(prof, exec_prof) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    import keras_mp

    cpu = cpu_name()
    gpus = tf.config.list_physical_devices("GPU")
    gpu_names = [tf.config.experimental.get_device_details(g).get("device_name", g.name)
                 for g in gpus]
    from keras_mp.device import _cpuinfo

    return {"cpu": cpu, "cores": os.cpu_count(), "cpu_flags": sorted(prof.flags),
            "cpu_class": _cpuinfo.describe(),
            "gpus": gpu_names, "device_type": prof.device_type,
            "fast_dtypes": list(prof.fast),
            "xla_step_speedup": {d: round(exec_prof.xla_speedup(d), 3)
                                 for d in exec_prof.step},
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "keras_mp": keras_mp.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _best(entries: dict[str, dict[str, Any]], clock: str) -> str:
    keras_ok = [v for v in KERAS_VARIANTS if v in entries]
    return min(keras_ok, key=lambda v: entries[v][clock]["median"])


def _table(entries: dict[str, dict[str, Any]]) -> str:
    best_cpu, best_wall = _best(entries, "cpu"), _best(entries, "wall")
    base = entries["keras_float32"]
    lines = ["| variant | CPU ms/step | spread | wall ms/step | spread | vs float32 CPU | "
             "vs float32 wall | vs best Keras CPU | vs best Keras wall | peak MiB | final loss |",
             "| --- |" + " ---: |" * 10]
    for v, e in entries.items():
        c, w = e["cpu"], e["wall"]
        cells = [v + (" (mode: " + e["mode"] + ")" if e.get("mode") else ""),
                 f"{c['median'] * 1e3:.1f}", f"{c['spread'] * 1e3:.1f}",
                 f"{w['median'] * 1e3:.1f}", f"{w['spread'] * 1e3:.1f}",
                 f"{base['cpu']['median'] / c['median']:.2f}x",
                 f"{base['wall']['median'] / w['median']:.2f}x",
                 f"{entries[best_cpu]['cpu']['median'] / c['median']:.2f}x",
                 f"{entries[best_wall]['wall']['median'] / w['median']:.2f}x",
                 "" if not e.get("memory") else f"{e['memory']['peak_rss_mib']:.0f}",
                 "" if e.get("final_loss") is None else f"{e['final_loss']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    note = ""
    probe = (entries.get("keras_mp") or {}).get("probe")
    if probe:
        note = (f" keras_mp's figures include its float32 probe: {probe['cpu_s'] * 1e3:.0f} ms "
                f"CPU ({probe['wall_s'] * 1e3:.0f} ms wall) per call, one call in "
                f"{probe['every']:.0f} (a long fit's mean once probes confirm), i.e. +{probe['per_step_cpu_s'] * 1e3:.2f} ms CPU per step.")
    mem = (entries.get("keras_mp") or {}).get("memory_vs_keras")
    if mem:
        base_mib = next(e["memory"] for e in entries.values() if e.get("memory"))
        note += (f" Peak memory (each variant in a fresh process of its own, keras_mp's beside "
                 f"`{mem['variant']}`'s, the TensorFlow "
                 f"runtime's ~{base_mib.get('baseline_rss_mib', 0):.0f} MiB included): "
                 f"keras_mp {mem['ratio']:.2f}x `{mem['variant']}`.")
    return "\n".join(lines) + (f"\n\nBest Keras one-liner: `{best_cpu}` by CPU time, "
                               f"`{best_wall}` by wall time." + note)


def run(models: Sequence[str] | None = None, quick: bool = False,
        variants: Sequence[str] | None = None, out: str | None = None,
        log: Callable[[str], None] | None = None, rounds: int | None = None,
        steps: int | None = None, memory: bool = True,
        size: dict[str, int] | None = None) -> dict[str, Any]:
    """Runs the suite and returns its figures (and writes them under ``out``).

    Args:
        models: among :data:`MODELS`; None: all of them, or
            :data:`QUICK_MODELS` with ``quick``. A model whose package is
            missing (``gpt2`` without KerasHub) is skipped with the reason.
        quick: fewer models, smaller shapes (under 3 minutes on 2 cores).
        variants: among :data:`VARIANTS`; ``keras_float32`` is always run (it
            is the baseline of every ratio). None: all of them, but with
            ``quick`` those of :func:`quick_left_out`.
        out: a folder for ``bench.json`` and ``bench.png``, or None;
            checked before the run starts (made if missing, and writable).
            Without matplotlib a line says so and only ``bench.json`` is
            written.
        log: where log lines go; None: stdout, with a progress line (model,
            variant, round, time left in the phase) drawn below them where
            stdout is a terminal (:mod:`benchmarks.progress`).
        rounds: interleaved timed rounds (>= 5); 5 in quick mode, 7 otherwise.
        steps: training steps per round and variant (>= 5); 20 (a multiple
            of ``AdaptivePrecision``'s default ``statistics_every``, so
            keras_mp's statistics steps are timed at their steady-state rate).
        memory: measure each variant's peak memory (module docstring).
        size: overrides of the models' sizes (module docstring), e.g.
            ``{"batch": 64, "length": 256}``; every key must be one of each
            run model's sizes.

    Returns:
        ``{"machine": {...}, "quick": bool, "rounds": int, "steps": int,
        "sizes": {model: {name: int}}, "results": {model: {variant:
        {...}}}, "skipped": {model: {variant: reason}}, "missing": {model: reason}, "tables": {model: markdown},
        "seconds": float}``; each variant has ``cpu`` and ``wall``
        (``median``, ``spread``, ``min``, ``max``, ``samples``, s per step),
        ``vs_float32`` and ``vs_best_keras`` (``{"cpu": x, "wall": x}``),
        ``final_loss``, ``gpu_peak_mib`` (None off GPU), ``memory``
        (:data:`benchmarks.memory.FIELDS` in MiB, or None where not
        measured), ``compute_dtypes`` (layers with weights per compute dtype
        at the end) and, for keras_mp, ``mode`` (``"xla"``, ``"xla_update"``
        or ``"graph"``, as :mod:`keras_mp.execution` measured on the model),
        ``memory_vs_keras`` (its peak RSS over the Keras one-liner's of its
        compute dtype, and which one) and ``probe`` (the float32 probe's
        seconds per call, ``cpu_s`` and ``wall_s``, ``every`` calls, and the
        ``per_step_cpu_s`` / ``per_step_wall_s`` added to its figures).
    """
    started = time.perf_counter()
    progress = Progress()
    log = progress.log if log is None else log
    models = list((QUICK_MODELS if quick else MODELS) if models is None else models)
    if not models:
        raise ValueError(f"`models` must name at least one of {MODELS}.")
    for m in models:
        if m not in MODELS:
            raise ValueError(f"`models` must be among {MODELS}, got {m!r}.")
    sizes = {m: _size(m, quick, size) for m in models}
    named = variants is not None
    variants = list(VARIANTS if variants is None else variants)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"`variants` must be among {VARIANTS}, got {unknown}.")
    default_steps, default_rounds = _SCHEDULE["quick" if quick else "full"]
    steps = default_steps if steps is None else steps
    rounds = default_rounds if rounds is None else rounds
    for name, value in (("rounds", rounds), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 5:
            raise ValueError(f"`{name}` must be an int >= 5, got {value!r}.")
    variants = ["keras_float32"] + [v for v in VARIANTS if v in variants and v != "keras_float32"]
    plot = False
    if out is not None:
        # Before the first step: what the run measures is never lost to them.
        from keras_mp import _checks

        os.makedirs(out, exist_ok=True)
        _checks.writable("out", out)
        try:
            _checks.extra(("matplotlib",), "plot", "bench.png (the picture)")
            plot = True
        except ImportError as e:
            log(f"{e} The bench runs on and writes bench.json.")
    quiet_tensorflow()
    import keras

    from keras_mp import device, execution

    prof = device.profile()
    machine = _machine(prof, execution.profile(steps=not quick))
    left_out = quick_left_out(variants, prof.hardware) if quick and not named else {}
    variants = [v for v in variants if v not in left_out]
    for v, why in left_out.items():
        log(f"{v}: {why}")
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, dict[str, str]] = {}
    absent: dict[str, str] = {}
    tables: dict[str, str] = {}
    keras.utils.clear_session()
    for number, kind in enumerate(models, 1):
        tag = f"[{kind} {number}/{len(models)}]"
        if missing(kind):
            absent[kind] = missing(kind)
            log(f"[{kind}] skipped: {absent[kind]}")
            continue
        size = sizes[kind]
        build, data = get_model(kind, size, steps)
        small = get_model(kind, size, 1, rows=8)[1]
        log(f"[{kind}] building {len(variants)} variants ({size}), "
            f"{steps} steps x {rounds} rounds each")
        progress.start(f"{tag} warming up", len(variants))
        made, skipped[kind] = _warm_up(kind, variants, build, data, small, steps, log,
                                       progress)
        skipped[kind].update(left_out)
        t0 = time.perf_counter()
        progress.start(f"{tag} timing", rounds * len(made))
        timings = interleaved_clocks({v: m[0] for v, m in made.items()}, rounds=rounds,
                                     warmup=0, per_call=steps, progress=progress)
        progress.clear()
        log(f"[{kind}] timed in {time.perf_counter() - t0:.0f} s")
        entries: dict[str, dict[str, Any]] = {}
        for v, (train, state) in made.items():
            model = state["model"]
            entries[v] = {**timings[v], "final_loss": state.get("loss"),
                          "gpu_peak_mib": _gpu_peak_mib(train),
                          "mode": execution.chosen(model) if v == "keras_mp" else None,
                          "compute_dtypes": dtype_counts(model), "memory": None}
            if v == "keras_mp" and state["callback"] is not None:
                entries[v]["probe"] = add_probe_cost(entries[v], state["callback"], data)
                log(f"[{kind}] keras_mp probe: {entries[v]['probe']}")
        made.clear()
        keras.utils.clear_session()
        if memory:
            _add_memory(kind, size, steps, entries, quick, log, progress, tag)
        for clock in ("cpu", "wall"):
            best = _best(entries, clock)
            for e in entries.values():
                e.setdefault("vs_float32", {})[clock] = (
                    entries["keras_float32"][clock]["median"] / e[clock]["median"])
                e.setdefault("vs_best_keras", {})[clock] = (
                    entries[best][clock]["median"] / e[clock]["median"])
                e.setdefault("best_keras", {})[clock] = best
        results[kind] = entries
        tables[kind] = _table(entries)
        log(f"\n{kind} (per training step, batch {size['batch']}):\n{tables[kind]}\n")
    seconds = time.perf_counter() - started
    log(f"keras-mp bench{' --quick' if quick else ''}: {seconds:.0f} s")
    report = {"machine": machine, "quick": quick, "rounds": rounds, "steps": steps,
              "sizes": sizes,
              "results": results, "skipped": skipped, "missing": absent, "tables": tables,
              "seconds": seconds}
    if out is not None:
        written = [os.path.join(out, "bench.json")]
        with open(written[0], "w") as f:
            json.dump(report, f, indent=2)
        if results and plot:
            report["plot"] = _plot(os.path.join(out, "bench.png"), results, machine)
            written.append(report["plot"])
        log(f"Wrote {' and '.join(written)}")
    return report


def fastest_step(train: Callable[..., Any], on: Any, bound: float = 0.0) -> float:
    """Wall seconds of the fastest of up to :data:`SINGLE_STEPS` calls of
    ``train(1, on)``, stopping at the first that takes ``bound`` or less (a
    variant that is not slow costs one step; a pause of the machine during one
    step does not make it slow).

    >>> calls = []
    >>> def train(n, on):
    ...     calls.append(on)
    ...     time.sleep(0.05 if len(calls) == 1 else 0.0)
    >>> fastest_step(train, "batch", bound=0.01) < 0.01, len(calls)
    (True, 2)
    >>> fastest_step(train, "batch", bound=1.0) < 1.0, len(calls)
    (True, 3)
    """
    best = math.inf
    for _ in range(SINGLE_STEPS):
        w0 = time.perf_counter()
        train(1, on)
        best = min(best, time.perf_counter() - w0)
        if best <= bound:
            break
    return best


def _warm_up(kind, variants, build, data, small, steps, log, progress):
    """Builds and warms up every variant; returns ``({variant: (train,
    state)}, {variant: why it was not timed})``."""
    made: dict[str, tuple[Callable[[], Any], dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    base: dict[str, float] = {}   # keras_float32's single step, per batch kind

    for v in variants:
        progress.update(v)
        train, state = make_variant(v, build, data, steps)
        first = first_steps(v, data, small)
        try:
            # Tracing and XLA compilation, then one timed step, to leave out
            # what is far too slow to time (seconds per full step).
            slow = None
            if first is not None:
                train(1, first)
                rows = "8 rows" if first is small else "a batch"
                if v == "keras_float32":   # the reference: the fastest of all its steps
                    ref = base.setdefault(rows, fastest_step(train, first))
                    took = ref
                else:
                    ref = base[rows]
                    took = fastest_step(train, first, TOO_SLOW * ref)
                if took > TOO_SLOW * ref:
                    slow = (f"too slow to time: {took * 1e3:.0f} ms for one step of {rows}, "
                            f"{took / ref:.0f}x keras_float32 ({ref * 1e3:.1f} ms)")
            if slow is None:
                # Warm-up, one epoch: for keras_mp, its measured choice of
                # execution mode (the first calls) and the first statistics
                # step (call 20) are traced here.
                train(max(steps, WARMUP_CALLS))
            if v == "keras_float32":   # the reference for the *_xla variants' batch step
                base["a batch"] = fastest_step(train, data)
        except Exception as e:  # noqa: BLE001 - e.g. XLA cannot compile this variant
            if v == "keras_float32":
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            skipped[v] = f"{type(e).__name__}: {reason}"
        else:
            skipped.update({v: slow} if slow is not None else {})
        progress.done()
        if v in skipped:
            log(f"[{kind}] {v} skipped: {skipped[v]}")
            continue
        made[v] = (train, state)
    progress.clear()
    return made, skipped


def _same_dtype_keras(entry: dict[str, Any]) -> str:
    """The Keras one-liner computing in keras_mp's (most common) compute dtype,
    under XLA where keras_mp's step runs under XLA."""
    counts = entry.get("compute_dtypes") or {"float32": 1}
    narrow = {d: n for d, n in counts.items() if d in ("bfloat16", "float16")}
    dtype = max(narrow, key=narrow.get) if narrow else "float32"
    name = "keras_float32" if dtype == "float32" else f"keras_mixed_{dtype}"
    return name + ("_xla" if entry.get("mode") == "xla" else "")


def _add_memory(kind, size, steps, entries, quick, log, progress, tag) -> None:
    """Each variant's peak memory, a fresh process each (benchmarks.memory)."""
    names = list(entries)
    if "keras_mp" in entries:
        # keras_mp and the one-liner it is held to run first, as one pair of
        # processes side by side (keras_float32 where that one-liner was not
        # timed): a process alone on the cores runs more ops at once and
        # peaked up to 200 MiB higher than the same one beside another.
        # --quick measures that pair alone.
        ref = _same_dtype_keras(entries["keras_mp"])
        pair = [ref if ref in entries else "keras_float32", "keras_mp"]
        names = pair + ([] if quick else [v for v in names if v not in pair])
    t0 = time.perf_counter()
    # The warm-up epoch holds keras_mp's trial and first statistics step; the
    # full bench adds one round's epoch, --quick does not.
    specs = [dict(kind=kind, size=size, variant=v, steps=steps, epochs=1 if quick else 2,
                  warmup=max(steps, WARMUP_CALLS)) for v in names]
    progress.start(f"{tag} memory", len(specs))
    measured = memory_lib.measure(specs, progress=progress)
    progress.clear()
    for v, figures in zip(names, measured):
        if "error" in figures:
            log(f"[{kind}] {v}: memory not measured ({figures['error']})")
            continue
        entries[v]["memory"] = figures
    log(f"[{kind}] memory of {len(names)} variants measured in "
        f"{time.perf_counter() - t0:.0f} s")
    mp = entries.get("keras_mp")
    if mp and mp["memory"]:
        ref = _same_dtype_keras(mp)
        if ref in entries and entries[ref]["memory"]:
            mp["memory_vs_keras"] = {
                "variant": ref, "ratio": mp["memory"]["peak_rss_mib"]
                / entries[ref]["memory"]["peak_rss_mib"]}


def _plot(path: str, results: dict[str, dict[str, Any]], machine: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(results)
    variants = [v for v in VARIANTS if any(v in results[m] for m in models)]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 3 * len(models), 4.6), sharey=True)
    width = 0.8 / len(variants)
    colors = plt.get_cmap("tab10").colors
    for ax, clock, label in zip(axes, ("cpu", "wall"), ("process CPU time", "wall time")):
        for i, v in enumerate(variants):
            xs, vals, lo, hi = [], [], [], []
            for j, m in enumerate(models):
                if v not in results[m]:
                    continue
                base = results[m]["keras_float32"][clock]["median"]
                e = results[m][v][clock]
                r = base / e["median"]
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                vals.append(r)
                # The spread of the variant's own rounds, as a ratio.
                lo.append(r - base / e["max"])
                hi.append(base / e["min"] - r)
            ax.bar(xs, vals, width, yerr=[lo, hi], capsize=2, label=v,
                   color=colors[i % len(colors)], edgecolor="black" if v == "keras_mp" else None,
                   linewidth=1.2 if v == "keras_mp" else 0)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_title(f"by {label}", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("speed-up vs Keras float32 (higher is faster)")
    gpu = ", ".join(machine.get("gpus") or [])
    fig.suptitle(f"keras-mp {machine['keras_mp']} vs Keras {machine['keras']} (TF "
                 f"{machine['tensorflow']}) on {gpu or machine['cpu']}, "
                 f"{machine['cores']} cores\nmedian of interleaved rounds, bars: spread",
                 fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.83, 0.5), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=None)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--size", default=None)
    args = parser.parse_args(argv)
    run(models=None if args.models is None else [m for m in args.models.split(",") if m],
        quick=args.quick, out=args.out, rounds=args.rounds, steps=args.steps,
        variants=None if args.variants is None else [v for v in args.variants.split(",") if v],
        memory=not args.no_memory,
        size=None if args.size is None else parse_size(args.size))


if __name__ == "__main__":
    main()
